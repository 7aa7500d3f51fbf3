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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import onnx
import tvm

from perfx_compiler.errors import ModelFormatError, PerfXError, UnsupportedModelError
from perfx_compiler.frontend.converter_fixes import patched_convert_map

# Domains whose ops TVM's map covers by op_type (ai.onnx + the com.microsoft contrib ops it has).
_KNOWN_DOMAINS = ("", "ai.onnx", "com.microsoft")
# Handled by the importer itself, not through the converter map.
_DIRECT_OPS = ("If", "Constant")
_MAX_LISTED_NODES = 3  # node names shown per unsupported op type
_MAX_LISTED_TYPES = 12


def _op_label(domain: str, op_type: str) -> str:
    return op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"


def _opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    versions = {imp.domain: imp.version for imp in model.opset_import}
    if "ai.onnx" in versions and "" not in versions:
        versions[""] = versions["ai.onnx"]
    return versions


def _walk_nodes(
    graph: onnx.GraphProto | onnx.FunctionProto, functions: Mapping[tuple[str, str], onnx.FunctionProto]
) -> Iterator[onnx.NodeProto]:
    """Every node, including those in If/Loop/Scan bodies and in called model-local functions
    (import_onnx inlines those, so their bodies are what must convert)."""
    for node in graph.node:
        body = functions.get((node.domain or "", node.op_type))
        if body is not None:
            yield from _walk_nodes(body, functions)
            continue
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(a.g, functions)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _walk_nodes(g, functions)


def _effective_ops(extra_converters: Mapping[str, type] | None) -> set[str]:
    with patched_convert_map(extra_converters) as convert_map:
        return set(convert_map)


def unsupported_ops(
    model: onnx.ModelProto, extra_converters: Mapping[str, type] | None = None
) -> list[tuple[str, str, int]]:
    """Nodes no converter handles: ``(op_type with domain, node name, opset)`` in graph order.

    A node from an unknown domain counts as unsupported even if an ai.onnx op of the same
    name exists (TVM looks converters up by op_type alone), unless ``extra_converters``
    registers that op_type explicitly.
    """
    known = _effective_ops(extra_converters)
    extra = set(extra_converters or {})
    versions = _opset_versions(model)
    out = []
    functions = {(f.domain or "", f.name): f for f in model.functions}
    for node in _walk_nodes(model.graph, functions):
        domain = node.domain or ""
        if node.op_type in _DIRECT_OPS and domain in ("", "ai.onnx"):
            continue
        ok = node.op_type in extra or (domain in _KNOWN_DOMAINS and node.op_type in known)
        if not ok:
            out.append((_op_label(domain, node.op_type), node.name, versions.get(domain, 0)))
    return out


def _unsupported_message(found: list[tuple[str, str, int]], source: str) -> str:
    by_type: dict[tuple[str, int], list[str]] = {}
    for label, name, opset in found:
        if isinstance(name, bytes):  # protobuf hands back a name that is not UTF-8 as bytes
            name = name.decode("utf-8", errors="replace")
        by_type.setdefault((label, opset), []).append(name or "<unnamed>")
    parts = []
    for (label, opset), names in list(by_type.items())[:_MAX_LISTED_TYPES]:
        shown = ", ".join(names[:_MAX_LISTED_NODES])
        more = f" +{len(names) - _MAX_LISTED_NODES} more" if len(names) > _MAX_LISTED_NODES else ""
        parts.append(f"{label} (opset {opset}; {len(names)} node{'s' * (len(names) > 1)}: {shown}{more})")
    if len(by_type) > _MAX_LISTED_TYPES:
        parts.append(f"+{len(by_type) - _MAX_LISTED_TYPES} more op types")
    return (
        f"{source} uses {len(by_type)} unsupported ONNX operator type(s): {'; '.join(parts)}. "
        "Re-export with standard ai.onnx ops (torch.onnx.export) or the com.microsoft ops onnxruntime-genai "
        "writes (MatMulNBits, GroupQueryAttention, RotaryEmbedding, (Skip)SimplifiedLayerNormalization), "
        "or register converters for them via extra_converters."
    )


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
        raise UnsupportedModelError(_unsupported_message(found, source))

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
