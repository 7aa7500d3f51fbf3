"""Hugging Face model folders: read (config.json + safetensors) and write.

The tokenizer contract is the same as for GGUF (see ``tokenizer.py``): the
stored tokenizer JSON adds no special tokens; a BOS-adding post-processor in a
Hugging Face ``tokenizer.json`` is removed and recorded as ``add_bos_token``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler.errors import (
    ContextLengthError,
    ModelFormatError,
    UnsupportedModelError,
)
from perfx_compiler.model.description import (
    FEATURE_DEFAULTS,
    ModelConfig,
    ModelDescription,
    expected_weight_shapes,
)
from perfx_compiler.model.families import FAMILIES, family_for_hf_class, hf_classes
from perfx_compiler.model.families._family import Family, HFConfig, missing_features, row_plan
from perfx_compiler.model.gguf import DEFAULT_MAX_CONTEXT, LAZY_FLOAT_BYTES, STOP_TOKENS
from perfx_compiler.model.lazy import FLOAT_BYTES
from perfx_compiler.model.tokenizer import load_tokenizer

_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id")
# config.json's activation -> ModelConfig.mlp_activation (the gate of a gated MLP)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Buffers some exporters save that are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e}); fix or re-download the file") from None


def _config_from_hf(hf: dict[str, Any], source: str, max_context: int | None) -> tuple[Family, ModelConfig]:
    if not isinstance(hf, dict):
        raise ModelFormatError(f"{source}/config.json is not a JSON object; use the model's original config.json")
    archs = hf.get("architectures") or []
    arch_cls = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    family = family_for_hf_class(arch_cls)
    if family is None:
        missing = missing_features(hf)
        detail = f" (it needs {', '.join(missing)}, which PerfX does not run)" if missing else ""
        raise UnsupportedModelError(
            f"{source}: architecture '{arch_cls or hf.get('model_type')}' is not supported{detail}; "
            f"PerfX reads {', '.join(hf_classes())}"
        )
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: hidden_act {act!r} is not supported; PerfX runs gated MLPs with silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)"
        )
    flags = [k for k in _INT_KEYS if isinstance(hf.get(k), bool)]
    if flags:
        raise ModelFormatError(f"{source}/config.json: {flags[0]} is true/false, not a number; use the model's original config.json")
    try:
        c = HFConfig(hf)
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        ctx = int(hf.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
        if max_context is None:
            max_ctx = min(ctx, DEFAULT_MAX_CONTEXT)
        elif 1 <= max_context <= ctx:
            max_ctx = int(max_context)
        else:
            raise ContextLengthError(
                f"max_context={max_context} is outside the model's trained context 1..{ctx}; pick a value in that range"
            )
        eos = hf.get("eos_token_id")
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        fields: dict[str, Any] = dict(
            architecture=family.name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.rope().get("rope_theta", 10000.0)),
            rope_scaling=c.rope_scaling(),
            max_context=max_ctx,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_activation=_ACTIVATIONS[act],
            bos_token_id=int(hf["bos_token_id"]) if hf.get("bos_token_id") is not None else None,
            eos_token_ids=eos_ids,
            name=str(hf.get("_name_or_path") or Path(source).name),
        )
        fields.update(family.hf_features(c))
        return family, ModelConfig(**fields)
    except KeyError as e:
        raise ModelFormatError(f"{source}/config.json lacks {e}; use the model's original config.json") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{source}/config.json has a malformed value ({e}); use the model's original config.json") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{index}: no weight_map; re-download the model")
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{folder}: shard {missing[0]} listed in the index is missing; download every shard")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder}: no *.safetensors weights; PerfX reads safetensors (convert .bin files first)")
    return files


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        import ml_dtypes  # noqa: F401  # registers numpy's bfloat16 so bf16 checkpoints load
    except ImportError:
        pass
    try:
        return load_file(str(path))
    except TypeError as e:
        raise UnsupportedModelError(f"{path}: tensor dtype not readable ({e}); pip install ml_dtypes for bfloat16") from None
    except Exception as e:  # safetensors raises SafetensorError (not exported) for corrupt headers
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(f"{path}: corrupt safetensors file ({first}); re-download it") from e




def _widened(dtype: str, raw: np.ndarray) -> np.ndarray:
    """A float tensor's bytes as a float32 copy (bf16: its bits are float32's top half)."""
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float16 if dtype == "F16" else np.float32).astype(np.float32)


def _mapped_safetensors(path: Path) -> dict[str, Any]:
    """A safetensors file's tensors without reading its matrices: each 2-D BF16/F16/F32 tensor as (its dtype, its
    bytes [rows, row bytes] as a read-only view of the mapped file), every other tensor as a float32 (or, of
    other dtypes, as stored) array read on its own. The file is checked by the safetensors library first (the
    eager load's errors for a corrupt file)."""
    import mmap

    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            others = {n: f.get_tensor(n) for n in names if f.get_slice(n).get_dtype() not in FLOAT_BYTES}
    except TypeError as e:
        raise UnsupportedModelError(f"{path}: tensor dtype not readable ({e})") from None
    except Exception as e:  # SafetensorError (not exported) for corrupt headers
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(f"{path}: corrupt safetensors file ({first}); re-download it") from e
    with path.open("rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    header_len = int.from_bytes(buf[:8], "little")
    header = json.loads(bytes(buf[8 : 8 + header_len]))
    out: dict[str, Any] = {}
    for name in names:
        if name in others:
            out[name] = others[name]
            continue
        dtype, shape = header[name]["dtype"], [int(d) for d in header[name]["shape"]]
        start, end = (int(o) for o in header[name]["data_offsets"])
        raw = np.frombuffer(buf, np.uint8, count=end - start, offset=8 + header_len + start)
        if len(shape) == 2 and 0 not in shape:
            out[name] = (dtype, raw.reshape(shape[0], -1))
        else:  # norms, biases: small
            out[name] = _widened(dtype, raw).reshape(shape)
    return out


def _post_processor_adds_bos(data: dict[str, Any], bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends the BOS token (TemplateProcessing)."""
    if bos_id is None:
        return False
    bos = next((t.get("content") for t in data.get("added_tokens", []) if t.get("id") == bos_id), None)
    pp = data.get("post_processor") or {}
    procs = pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]
    for proc in procs:
        single = proc.get("single") if proc.get("type") == "TemplateProcessing" else None
        if single and "SpecialToken" in single[0] and single[0]["SpecialToken"].get("id") == bos:
            return True
    return False


def _tokenizer_files(folder: Path, cfg: ModelConfig) -> tuple[str | None, str | None]:
    tok_json = None
    tok_path = folder / "tokenizer.json"
    tok_cfg: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        tok_cfg = _read_json(folder / "tokenizer_config.json")
    adds_bos = False
    if tok_path.is_file():
        data = _read_json(tok_path)
        try:  # one the runtime can build, checked before its fields are read below
            load_tokenizer(json.dumps(data, ensure_ascii=False))
        except ModelFormatError as e:
            raise ModelFormatError(f"{tok_path}: {e}") from None
        adds_bos = _post_processor_adds_bos(data, cfg.bos_token_id)
        data["post_processor"] = None  # our contract: BOS is the runtime's job (config.add_bos_token)
        tok_json = json.dumps(data, ensure_ascii=False)
    cfg.add_bos_token = bool(tok_cfg.get("add_bos_token", adds_bos))
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return tok_json, template


def _want_lazy(folder: Path, lazy: bool | None) -> bool:
    """``lazy`` as given; None: the env var PERFX_LAZY_WEIGHTS (0/1), else lazy when the checkpoint's files
    exceed LAZY_FLOAT_BYTES (as for GGUF: an eager float32 copy of a 7B bf16 checkpoint is 27 GB)."""
    if lazy is not None:
        return lazy
    env = os.environ.get("PERFX_LAZY_WEIGHTS", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return sum(f.stat().st_size for f in _safetensors_files(folder)) > LAZY_FLOAT_BYTES // 2  # bf16: 2 bytes a weight


def load_hf_folder(path: str | os.PathLike[str], max_context: int | None = None,
                   lazy: bool | None = None) -> ModelDescription:
    """Load a Hugging Face Llama/Mistral/Qwen2 folder (config.json + safetensors) as float32 (``lazy``: its
    BF16/F16/F32 matrices as ``lazy.QuantizedWeight`` over the mapped files, widened one at a time where a
    pass reads them; None decides by size, ``_want_lazy``)."""
    folder = Path(path)
    source = str(folder)
    if not (folder / "config.json").is_file():
        raise ModelFormatError(f"{folder}: no config.json; pass a Hugging Face model folder")
    family, cfg = _config_from_hf(_read_json(folder / "config.json"), source, max_context)
    weights = _canonical_weights(folder, family, cfg, source, _want_lazy(folder, lazy))
    if not cfg.tie_word_embeddings and "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        cfg.tie_word_embeddings = True  # some exports drop lm_head but forget the flag
    tok_json, template = _tokenizer_files(folder, cfg)
    template = template or family.chat_template
    if tok_json is not None:
        _add_stop_tokens(cfg, tok_json)
    desc = ModelDescription(config=cfg, weights=weights, tokenizer_json=tok_json, chat_template=template, source=source)
    desc.validate()
    return desc


def _canonical_name(family: Family, name: str) -> str:
    """The canonical name of a checkpoint tensor (the family's layer renames applied once)."""
    if name.startswith("model.layers."):
        prefix, _, rest = name[len("model.layers."):].partition(".")
        module, dot, kind = rest.rpartition(".")
        if module in family.hf_renames:
            return f"model.layers.{prefix}.{family.hf_renames[module]}{dot}{kind}"
    return name


def _is_norm(name: str) -> bool:
    return name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight"


def _canonical_weights(folder: Path, family: Family, cfg: ModelConfig, source: str, lazy: bool = False) -> dict[str, Any]:
    """The checkpoint's tensors as float32 under canonical names, in the canonical layout (``lazy``: matrices as
    ``QuantizedWeight`` over the mapped rows)."""
    from perfx_compiler.heap import drop_file_pages
    from perfx_compiler.model.lazy import QuantizedWeight

    expected = expected_weight_shapes(cfg)
    weights: dict[str, Any] = {}
    for f in _safetensors_files(folder):
        for name, arr in (_mapped_safetensors(f) if lazy else _load_safetensors(f)).items():
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            canon = _canonical_name(family, name)
            offset = family.hf_norm_offset and _is_norm(canon)
            mapped = None
            if isinstance(arr, tuple):  # (ggml type, mapped rows [N, K * element bytes])
                qtype, raw = arr
                mapped = QuantizedWeight(qtype, [raw], (raw.shape[0], raw.shape[1] // FLOAT_BYTES[qtype]))
                arr = np.asarray(mapped) if offset else raw
                mapped = None if offset else mapped
            w = arr if mapped is not None else np.asarray(arr).astype(np.float32, copy=False)
            if offset:
                w = w + np.float32(family.hf_norm_offset)  # the factor the model applies: (1 + w)
            plan = row_plan(canon, int(w.shape[0]) if w.ndim else 0, cfg, family.hf_rope_layout)
            for part, rows, order in plan:
                if part not in expected:
                    raise UnsupportedModelError(
                        f"{source}: weight '{name}' is not part of a {family.name} model PerfX understands")
                piece = w[rows]
                if mapped is not None:  # rows of the mapped bytes; the head order is applied where they are read
                    release = functools.partial(drop_file_pages, piece) if len(plan) == 1 else None
                    weights[part] = QuantizedWeight(mapped.qtype, [piece], (piece.shape[0], mapped.shape[1]),
                                                    [order], [release])
                else:
                    weights[part] = np.ascontiguousarray(piece[order] if order is not None else piece)
    return weights


def _add_stop_tokens(cfg: ModelConfig, tok_json: str) -> None:
    """Chat end markers also stop generation (same rule as for GGUF)."""
    added = {t["content"]: t["id"] for t in json.loads(tok_json).get("added_tokens", []) if "content" in t}
    for t in STOP_TOKENS:
        if t in added and added[t] not in cfg.eos_token_ids:
            cfg.eos_token_ids.append(int(added[t]))


def write_hf_folder(desc: ModelDescription, path: str | os.PathLike[str]) -> Path:
    """Write ``desc`` as a Hugging Face folder (fp32 safetensors); ``load_hf_folder`` reads it back."""
    from safetensors.numpy import save_file

    c = desc.config
    default = ModelConfig(**{**c.to_dict(), **FEATURE_DEFAULTS})
    if c.architecture not in ("llama", "mistral", "qwen2") or c != default:
        raise UnsupportedModelError(f"write_hf_folder writes Llama-shaped models; {c.architecture} with its features is not")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": [FAMILIES[c.architecture].hf_classes[0]],
        "model_type": c.architecture,
        "_name_or_path": c.name,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_context,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in desc.weights.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok_cfg: dict[str, Any] = {"add_bos_token": c.add_bos_token, "tokenizer_class": "PreTrainedTokenizerFast",
                               "clean_up_tokenization_spaces": False}
    if desc.tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(desc.tokenizer_json, encoding="utf-8")
        from perfx_compiler.model.tokenizer import load_tokenizer

        tok = load_tokenizer(desc.tokenizer_json)
        if c.bos_token_id is not None:
            tok_cfg["bos_token"] = tok.id_to_token(c.bos_token_id)
        if c.eos_token_ids:
            tok_cfg["eos_token"] = tok.id_to_token(c.eos_token_ids[0])
    if desc.chat_template is not None:
        tok_cfg["chat_template"] = desc.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    return folder
