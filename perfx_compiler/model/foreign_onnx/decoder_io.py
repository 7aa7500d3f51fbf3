"""Recognise the inputs and outputs of a third-party decoder graph, and drive it with onnxruntime.

Two export styles are understood:

* onnxruntime-genai (``genai_config.json`` next to the model names every input and output:
  ``input_ids``, ``attention_mask``, ``past_key_values.%d.key`` ... ``present.%d.value``, ``logits``);
* ``torch.onnx.export(dynamo=True)`` of a transformers decoder, whose names follow the user's
  ``input_names``/``output_names`` (conventionally the same Hugging Face names; also accepted:
  ``past_key_N``/``past.N.key``/``present_key_values.N.key`` spellings).

KV tensors are ``[batch, kv_heads, seq, head_dim]`` in both. ``OrtDecoder`` runs such a graph
step by step with its cache (prefill then decode), which is what tests compare PerfX against.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError

_IDS_NAMES = ("input_ids", "ids", "tokens", "input")
_MASK_NAMES = ("attention_mask", "mask")
_POS_NAMES = ("position_ids", "positions")
_PAST = re.compile(r"^past(?:_key_values)?[._](\d+)[._](key|value)$|^past_(key|value)(?:_values)?[._](\d+)$")
_PRESENT = re.compile(
    r"^present(?:_key_values)?[._](\d+)[._](key|value)$|^present_(key|value)(?:_values)?[._](\d+)$"
)


@dataclass
class DecoderIO:
    """Names of a decoder graph's inputs/outputs, KV tensors ordered by layer."""

    input_ids: str
    logits: str
    attention_mask: str | None = None
    position_ids: str | None = None
    past_keys: list[str] = field(default_factory=list)
    past_values: list[str] = field(default_factory=list)
    present_keys: list[str] = field(default_factory=list)
    present_values: list[str] = field(default_factory=list)
    # onnxruntime-genai's past_present_share_buffer: past/present may be one max-length buffer.
    shared_buffer: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.past_keys)

    @property
    def has_cache(self) -> bool:
        return bool(self.past_keys)


def read_genai_config(folder: str | Path) -> dict[str, Any] | None:
    """``genai_config.json`` of an onnxruntime-genai model folder, or None when there is none."""
    path = Path(folder) / "genai_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e}); re-run the onnxruntime-genai builder") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ModelFormatError(f"{path}: no 'model' section; re-run the onnxruntime-genai builder")
    return data


def _by_layer(found: dict[int, dict[str, str]], kind: str, source: str) -> tuple[list[str], list[str]]:
    if not found:
        return [], []
    layers = sorted(found)
    if layers != list(range(len(layers))) or any(set(found[i]) != {"key", "value"} for i in layers):
        raise UnsupportedModelError(
            f"{source}: {kind} KV tensors are not one key and one value per layer 0..N-1 "
            f"(layers {layers}); export every layer's past/present key and value"
        )
    return [found[i]["key"] for i in layers], [found[i]["value"] for i in layers]


def _match_kv(names: list[str], pattern: re.Pattern[str]) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for n in names:
        m = pattern.match(n)
        if not m:
            continue
        layer, kind = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(4), m.group(3))
        out.setdefault(int(layer), {})[kind] = n
    return out


def _from_genai(model: onnx.ModelProto, cfg: dict[str, Any], source: str) -> DecoderIO:
    dec = cfg["model"].get("decoder", {})
    ins, outs = dec.get("inputs", {}), dec.get("outputs", {})
    graph_in = [i.name for i in model.graph.input]
    graph_out = [o.name for o in model.graph.output]
    n_layers = int(dec.get("num_hidden_layers", 0))

    def names(pattern: str | None, pool: list[str]) -> list[str]:
        if not pattern:
            return []
        got = [pattern % i for i in range(n_layers)]
        missing = [g for g in got if g not in pool]
        if missing:
            raise ModelFormatError(f"{source}: genai_config.json names {missing[0]}, which the graph lacks")
        return got

    def one(key: str, pool: list[str], required: bool = False) -> str | None:
        name = (ins if pool is graph_in else outs).get(key)
        if name and name in pool:
            return name
        if required:
            raise ModelFormatError(f"{source}: genai_config.json's {key} ({name}) is not a graph input/output")
        return None

    search = cfg.get("search", {})
    return DecoderIO(
        input_ids=one("input_ids", graph_in, required=True) or "",
        logits=one("logits", graph_out, required=True) or "",
        attention_mask=one("attention_mask", graph_in),
        position_ids=one("position_ids", graph_in),
        past_keys=names(ins.get("past_key_names"), graph_in),
        past_values=names(ins.get("past_value_names"), graph_in),
        present_keys=names(outs.get("present_key_names"), graph_out),
        present_values=names(outs.get("present_value_names"), graph_out),
        shared_buffer=bool(search.get("past_present_share_buffer", False)),
    )


def recognize_io(model: onnx.ModelProto, genai_config: dict[str, Any] | None = None, source: str = "") -> DecoderIO:
    """The decoder's I/O names, from ``genai_config`` when given, else from the graph's names."""
    source = source or model.graph.name or "ONNX model"
    if genai_config is not None:
        return _from_genai(model, genai_config, source)
    inits = {t.name for t in model.graph.initializer}
    graph_in = [i.name for i in model.graph.input if i.name not in inits]
    graph_out = [o.name for o in model.graph.output]
    ids = next((n for n in _IDS_NAMES if n in graph_in), None)
    if ids is None:
        ints = [i.name for i in model.graph.input if i.name not in inits
                and i.type.tensor_type.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
                and not _PAST.match(i.name) and i.name not in _MASK_NAMES + _POS_NAMES]
        if len(ints) != 1:
            raise UnsupportedModelError(
                f"{source}: cannot tell which input holds the token ids (inputs: {', '.join(graph_in)}); "
                "name it input_ids when exporting"
            )
        ids = ints[0]
    logits = "logits" if "logits" in graph_out else (graph_out[0] if graph_out else None)
    if logits is None:
        raise ModelFormatError(f"{source}: the graph has no outputs")
    pk, pv = _by_layer(_match_kv(graph_in, _PAST), "past", source)
    ok, ov = _by_layer(_match_kv(graph_out, _PRESENT), "present", source)
    if len(pk) != len(ok):
        raise UnsupportedModelError(
            f"{source}: {len(pk)} layers of past KV inputs but {len(ok)} of present outputs; "
            "export past_key_values inputs and present outputs together"
        )
    return DecoderIO(
        input_ids=ids,
        logits=logits,
        attention_mask=next((n for n in _MASK_NAMES if n in graph_in), None),
        position_ids=next((n for n in _POS_NAMES if n in graph_in), None),
        past_keys=pk, past_values=pv, present_keys=ok, present_values=ov,
    )


def _input_info(model: onnx.ModelProto, name: str) -> tuple[np.dtype, list[int | str]]:
    vi = next(i for i in model.graph.input if i.name == name)
    tt = vi.type.tensor_type
    dims: list[int | str] = [d.dim_param or d.dim_value for d in tt.shape.dim]
    return onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type), dims


class OrtDecoder:
    """Run a decoder graph with onnxruntime one step at a time (batch 1), keeping its KV cache.

    Past/present buffers are run unshared (present = past + new tokens), which every
    export style accepts, including onnxruntime-genai graphs built for a shared buffer.
    """

    def __init__(self, path: str | Path, io: DecoderIO | None = None, threads: int = 1,
                 model: onnx.ModelProto | None = None, head_dim: int | None = None) -> None:
        import onnxruntime as ort

        path = Path(path)
        proto = model if model is not None else onnx.load(str(path), load_external_data=False)
        genai = read_genai_config(path.parent)
        self.io = io or recognize_io(proto, genai, str(path))
        if head_dim is None and genai is not None:
            head_dim = genai["model"].get("decoder", {}).get("head_size")
        self._head_dim = head_dim
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        if model is not None:
            self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        else:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self._ids_dtype = _input_info(proto, self.io.input_ids)[0]
        self._mask_dtype = _input_info(proto, self.io.attention_mask)[0] if self.io.attention_mask else None
        self._pos_dtype = _input_info(proto, self.io.position_ids)[0] if self.io.position_ids else None
        self._kv: list[tuple[np.dtype, list[int | str]]] = [
            _input_info(proto, n) for n in self.io.past_keys + self.io.past_values
        ]
        self.reset()

    def reset(self) -> None:
        self.past: list[np.ndarray] = []
        for dtype, dims in self._kv:
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in dims]
            shape[2] = 0
            if not (isinstance(dims[3], int) and dims[3] > 0):
                if self._head_dim is None:
                    raise ModelFormatError("the KV inputs' head dimension is symbolic; pass head_dim")
                shape[3] = int(self._head_dim)
            self.past.append(np.zeros(shape, dtype=dtype))
        self.position = 0

    def step(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Logits [len(token_ids), vocab] (float32) for the next tokens; advances the cache."""
        ids = np.asarray(token_ids, dtype=self._ids_dtype).reshape(1, -1)
        s, p = ids.shape[1], self.position
        feeds: dict[str, np.ndarray] = {self.io.input_ids: ids}
        if self.io.attention_mask and self._mask_dtype is not None:
            feeds[self.io.attention_mask] = np.ones((1, p + s), dtype=self._mask_dtype)
        if self.io.position_ids and self._pos_dtype is not None:
            feeds[self.io.position_ids] = np.arange(p, p + s, dtype=self._pos_dtype).reshape(1, s)
        names = self.io.past_keys + self.io.past_values
        feeds.update(zip(names, self.past, strict=True))
        outs = self.io.present_keys + self.io.present_values
        got = self.session.run([self.io.logits, *outs], feeds)
        self.past = [np.ascontiguousarray(a[:, :, : p + s]) for a in got[1:]]
        self.position = p + s
        return np.asarray(got[0], dtype=np.float32).reshape(s, -1)
