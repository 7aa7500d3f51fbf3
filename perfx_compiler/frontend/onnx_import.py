"""ONNX -> Relax import: TVM's frontend plus project-side converter fixes and clean errors.

``import_onnx`` checks every operator up front (one ``UnsupportedModelError`` naming all of
them), runs ``tvm.relax.frontend.onnx.from_onnx`` with our converter overrides
(``converter_fixes``) and turns any converter failure into a one-line ``PerfXError`` naming
the node, instead of a TVM traceback.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import tvm

from perfx_compiler.errors import ModelFormatError, PerfXError, UnsupportedModelError
from perfx_compiler.frontend.converter_fixes import patched_convert_map
from perfx_compiler.model import onnx_ops


def _effective_ops(extra_converters: Mapping[str, type] | None) -> set[str]:
    with patched_convert_map(extra_converters) as convert_map:
        return set(convert_map)


def unsupported_ops(
    model: onnx.ModelProto, extra_converters: Mapping[str, type] | None = None
) -> list[tuple[str, str, int]]:
    """``model.onnx_ops.unsupported_ops`` against the converter map this importer runs with
    (``extra_converters`` registered: converted whatever their domain)."""
    return onnx_ops.unsupported_ops(model, _effective_ops(extra_converters), set(extra_converters or {}))


def _load(model: onnx.ModelProto | str | Path) -> tuple[onnx.ModelProto, str]:
    if isinstance(model, onnx.ModelProto):
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data:
                raise ModelFormatError(
                    f"initializer '{t.name}' lives in an external data file that was not loaded; "
                    "pass the .onnx path to import_onnx so its directory is searched"
                )
        return model, model.graph.name or "ONNX model"
    path = Path(model)
    if not path.is_file():
        raise ModelFormatError(f"ONNX file not found: {path}")
    try:
        # onnx.load resolves external data relative to the file's directory.
        loaded = onnx.load(str(path), load_external_data=True)
    except Exception as e:  # protobuf/IO errors have many types
        raise ModelFormatError(f"cannot read ONNX model {path}: {_one_line(e)}") from e
    return loaded, str(path)


def _one_line(err: BaseException, limit: int = 300) -> str:
    """The informative line of an exception (TVM messages carry a C++ traceback first)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _input_dtypes(model: onnx.ModelProto) -> dict[str, str]:
    """The graph's declared input dtypes (int64 ids stay int64)."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        elem = vi.type.tensor_type.elem_type
        if elem:
            out[vi.name] = onnx.helper.tensor_dtype_to_np_dtype(elem).name
    return out


class _NodeTracker:
    """Wraps converters to remember which node is being converted, for error messages."""

    def __init__(self) -> None:
        self.node: str | None = None
        self.op: str | None = None

    def wrap(self, op_type: str, conv: type) -> type:
        tracker = self

        class Tracked:
            @classmethod
            def get_converter(cls, opset: int) -> Any:
                fn = conv.get_converter(opset)

                def run(bb: Any, inputs: Any, attr: dict, params: Any) -> Any:
                    tracker.node = attr.get("tvm_custom", {}).get("name") or "<unnamed>"
                    tracker.op = op_type
                    return fn(bb, inputs, attr, params)

                return run

        Tracked.__name__ = f"Tracked{getattr(conv, '__name__', op_type)}"
        return Tracked


def import_onnx(
    model: onnx.ModelProto | str | Path,
    *,
    shape_dict: dict[str, list] | None = None,
    keep_params_in_input: bool = True,
    extra_converters: dict[str, type] | None = None,
) -> tvm.IRModule:
    """Import an ONNX model as a Relax ``tvm.IRModule`` (function ``main``).

    ``keep_params_in_input=True`` makes initializers trailing parameters of ``main`` with
    their values in ``main.attrs["params"]`` (first ``main.attrs["num_input"]`` are inputs).
    Symbolic input dims (``dim_param``) stay symbolic unless ``shape_dict`` pins them.
    """
    proto, source = _load(model)
    if proto.functions:
        # TVM's importer does not expand model-local functions; inline them first,
        # except those a converter maps as one operator (perfx.CachedAttention).
        import onnx.inliner

        keep = [(f.domain, f.name) for f in proto.functions if f.name in (extra_converters or {})]
        proto = onnx.inliner.inline_selected_functions(proto, keep, exclude=True)
    found = unsupported_ops(proto, extra_converters)
    if found:
        raise UnsupportedModelError(onnx_ops.unsupported_message(found, source))

    from tvm.relax.frontend.onnx import from_onnx
    from tvm.relax.frontend.onnx import onnx_frontend as _of

    tracker = _NodeTracker()
    with patched_convert_map(extra_converters) as convert_map:
        for op_type, conv in list(convert_map.items()):
            convert_map[op_type] = tracker.wrap(op_type, conv)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                # Renaming/unknown-dim warnings fire per parameter; the frontend prints whole
                # input lists on failure: neither helps a user.
                warnings.filterwarnings("ignore", module=_of.__name__)
                mod = from_onnx(
                    proto,
                    shape_dict=shape_dict,
                    dtype_dict=_input_dtypes(proto),
                    keep_params_in_input=keep_params_in_input,
                )
        except PerfXError:
            raise
        except Exception as e:  # TVM raises many error types
            where = f" at node '{tracker.node}' ({tracker.op})" if tracker.node else ""
            raise PerfXError(
                f"ONNX import of {source} failed{where}: {_one_line(e)}; "
                "report this with the model, or fix it with a converter in extra_converters"
            ) from e
    return mod
