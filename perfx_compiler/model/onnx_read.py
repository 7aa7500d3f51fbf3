"""Read an ONNX file back into a ModelDescription.

A graph PerfX emitted carries its config, tokenizer and chat template in
``metadata_props`` and its weights as initializers; it compiles exactly like
the model it came from. Other ONNX files (torch.onnx / onnxruntime-genai decoders) go
to ``model/foreign_onnx/graph_to_description``: operators PerfX cannot import are named in one
error, otherwise the decoder is recognised and its description rebuilt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from perfx_compiler.errors import ModelFormatError
from perfx_compiler.model.description import ModelConfig, ModelDescription
from perfx_compiler.model.onnx_emit import ROPE_COS, ROPE_COS_LOCAL, ROPE_SIN, ROPE_SIN_LOCAL


def tensor_array(t: onnx.TensorProto, what: str = "initializer") -> np.ndarray:
    """``numpy_helper.to_array`` of a tensor whose bytes may not match its dims or type (a corrupt or
    hand-edited file): the mismatch is one ModelFormatError naming the tensor, not a numpy error."""
    try:
        return numpy_helper.to_array(t)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelFormatError(
            f"ONNX {what} '{t.name}' (dims {list(t.dims)}, type {t.data_type}) cannot be decoded ({msg}); "
            "the file is corrupt, re-export it"
        ) from None


def _check_names(model: onnx.ModelProto, path: Path) -> None:
    """Every tensor name is text: protobuf hands back a name that is not UTF-8 as bytes, which no
    lookup by name would match (the file is corrupt; found by tests/fuzz)."""
    g = model.graph
    names = [t.name for t in g.initializer] + [v.name for v in (*g.input, *g.output)]
    names += [e for n in g.node for e in (*n.input, *n.output)]
    bad = next((n for n in names if not isinstance(n, str)), None)
    if bad is not None:
        raise ModelFormatError(f"{path}: tensor name {bad!r} is not UTF-8 text; the file is corrupt, re-export it")


def _check_tokenizer(text: str, path: Path) -> None:
    """A tokenizer the runtime can load, checked now: a broken one would be copied into the artifact
    and fail only at run time, where recompiling cannot fix it."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own Exception type
        msg = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ModelFormatError(f"{path}: its perfx.tokenizer metadata is not a tokenizer ({msg}); re-export it") from None


def load_onnx(path: str | Path, max_context: int | None = None) -> ModelDescription:
    """The ModelDescription of an ONNX file; ``max_context`` overrides the KV cache length."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as err:  # protobuf/decode errors: say what the file is not
        raise ModelFormatError(f"{path} is not a readable ONNX file ({type(err).__name__}); re-export it") from None
    _check_names(model, path)
    meta = {p.key: p.value for p in model.metadata_props}
    for key in ("perfx.config", "perfx.tokenizer", "perfx.chat_template"):
        if isinstance(meta.get(key), bytes):  # protobuf hands back a string that is not UTF-8 as bytes
            raise ModelFormatError(f"{path}: its {key} metadata is not UTF-8 text; the file is corrupt, re-export it")
    if "perfx.config" not in meta:
        # A third-party decoder (torch.onnx, onnxruntime-genai): recognise it and rebuild its description.
        from perfx_compiler.model.foreign_onnx.graph_to_description import load_foreign_onnx

        return load_foreign_onnx(model, path, max_context)
    try:
        data = json.loads(meta["perfx.config"])
    except (json.JSONDecodeError, RecursionError) as err:
        raise ModelFormatError(f"{path}: its perfx.config metadata is not valid JSON ({getattr(err, 'msg', err)}); "
                               "re-export it with --emit-onnx") from None
    config = ModelConfig.from_dict(data)
    if meta.get("perfx.tokenizer"):
        _check_tokenizer(meta["perfx.tokenizer"], path)
    if max_context is not None:
        config.max_context = int(max_context)
    weights = {
        t.name: tensor_array(t)
        for t in model.graph.initializer
        if t.name not in (ROPE_COS, ROPE_SIN, ROPE_COS_LOCAL, ROPE_SIN_LOCAL)
    }
    desc = ModelDescription(
        config=config,
        weights=weights,
        tokenizer_json=meta.get("perfx.tokenizer"),
        chat_template=meta.get("perfx.chat_template"),
        source=str(path),
    )
    desc.validate()
    return desc
