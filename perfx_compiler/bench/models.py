"""Model files for the benchmark: one GGUF in, every engine's form out (cached in a work folder).

GGUF (as shipped, or requantized with llama.cpp's own quantizer)
  -> llama.cpp : the file itself
  -> PerfX     : perfx compile with the best quantization PerfX has for the file's type
  -> ort-genai : HF folder (config + tokenizer) + F16 GGUF -> onnxruntime-genai builder, int4
  -> ort       : PerfX's emitted fp32 ONNX graph
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler.errors import PerfXError

# Random-weight TinyLlama-1.1B dimensions (untied output, as in the real model).
TINYLLAMA_DIMS = dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, tied=False)
# Random-weight Llama-2-7B dimensions (multi-head attention, untied output).
LLAMA2_7B_DIMS = dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000, tied=False)


def resolve_model(spec: str) -> Path:
    """A GGUF path from a file path or a known model name (smollm2-135m)."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p.resolve()
    from perfx_compiler.model.loader import KNOWN_MODELS, known_model_path

    if spec.lower() in KNOWN_MODELS:
        return known_model_path(spec)
    raise PerfXError(f"{spec}: no such GGUF file or known model")


def model_key(path: Path) -> str:
    """Short name for files and folders: the file stem, lowercased."""
    return path.stem.lower().replace(" ", "_")


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"


def build_stamp(gguf_path: Path, quantization: str, max_context: int,
                knobs: Mapping[str, Any] | None = None) -> str:
    """What a cached PerfX build of ``gguf_path`` must match to be reused: the file, the options
    (``knobs``: perfx-compile --knob values, knobs.py), and the compiler's files (llm.compiler_digest, also
    in LLM()'s cache key)."""
    from perfx_compiler.llm import compiler_digest

    stamp = _stamp(gguf_path) + f":{quantization}:{max_context}:{compiler_digest()}"
    return stamp + (f":{json.dumps(dict(knobs), sort_keys=True, default=str)}" if knobs else "")


def _knobs_suffix(knobs: Mapping[str, Any] | None) -> str:
    """A knobbed build's own cache folder (``-k`` + a hash of the knobs), so A/B builds do not evict each other."""
    if not knobs:
        return ""
    import hashlib

    return "-k" + hashlib.sha1(json.dumps(dict(knobs), sort_keys=True, default=str).encode()).hexdigest()[:8]


def _fresh(marker: Path, stamp: str) -> bool:
    return marker.is_file() and marker.read_text() == stamp


# ----------------------------------------------------------------------------------------- llama.cpp quantizer
def llama_quantize(src: str | Path, dst: str | Path, qtype: str, threads: int = 2, pure: bool = False) -> Path:
    """Requantize ``src`` to ``qtype`` (Q4_0, Q4_1, Q8_0, F16, ...) with llama.cpp's own quantizer.

    ``pure``: every matrix in ``qtype`` (llama.cpp otherwise keeps the output head in Q6_K), so all
    engines read the same 4-bit data, output head included."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None and qtype.upper() == "F32":
        ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    if ftype is None:
        raise PerfXError(f"llama.cpp has no quantization type {qtype}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    params.allow_requantize = True
    params.pure = pure
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        raise PerfXError(f"llama.cpp quantization of {src} to {qtype} failed (rc={rc})")
    tmp.rename(dst)
    return dst


def write_random_tinyllama(path: str | Path, qtype: str = "F16", seed: int = 0) -> Path:
    """A random-weight GGUF with TinyLlama-1.1B dimensions (F32/F16 through GGUFWriter)."""
    from perfx_compiler.model.testing import write_tiny_gguf

    d = TINYLLAMA_DIMS
    out, _ = write_tiny_gguf(
        path,
        vocab=d["vocab"],
        hidden=d["hidden"],
        layers=d["layers"],
        heads=d["heads"],
        kv_heads=d["kv_heads"],
        ffn=d["ffn"],
        qtype=qtype,
        tied=d["tied"],
        seed=seed,
        # TinyLlama's own is 2048; the metadata only bounds --max-context, and benchmarks/run_peers.py --long-context
        # prompts up to 8k tokens
        context_length=16384,
    )
    return Path(out)


# Weight magnitude of a random block is d times at most (scale x code); dividing d by this keeps
# every type's weights at Q4_0's scale, so activations stay finite through 32 layers.
_RANDOM_RANGE = {"Q4_0": 1.0, "Q4_K": 63 * 15 / 8, "Q6_K": 128 * 32 / 8}


def q4_k_m_type(name: str, layers: int) -> str:
    """The type llama.cpp's Q4_K_M recipe gives the matrix ``name``: Q6_K for the output head and for
    attn_v / ffn_down in its "more bits" layers (the first and last eighth, every third between), Q4_K
    elsewhere."""
    if name == "lm_head.weight":
        return "Q6_K"
    if name.endswith(("v_proj.weight", "down_proj.weight")):
        i = int(name.split(".")[2])
        eighth = layers // 8
        if i < eighth or i >= 7 * eighth or (i - eighth) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def write_random_blocks(path: str | Path, dims: dict[str, Any], mix: str = "Q4_0", seed: int = 0,
                        log: Any = print) -> Path:
    """A random-weight GGUF of ``dims`` written block by block: ``mix`` "Q4_0" (every matrix Q4_0,
    "pure"), "Q4_K_M" (llama.cpp's Q4_K / Q6_K mix) or "F16" (normal(0, 0.02) float16 matrices: a float
    file to compile to PerfX's own quantizations); norms F32.

    Random blocks (random bytes, small finite f16 scales) go straight to the file one tensor at a
    time, so a 7B file (3.6-4 GiB) is written without a float copy (an F16 file + llama.cpp's
    quantizer would need 13 GB of disk and as much memory to write). Speed and compile memory do not
    depend on the weight values; the metadata and vocabulary are the tiny test model's (byte-level BPE)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from perfx_compiler.formats.ggml import FORMATS
    from perfx_compiler.model.description import ModelConfig, expected_weight_shapes
    from perfx_compiler.model.testing import _gguf_name, add_tiny_tokenizer, tiny_vocab

    if mix not in ("Q4_0", "Q4_K_M", "F16"):
        raise PerfXError(f"write_random_blocks: unknown mix {mix}; use Q4_0, Q4_K_M or F16")
    d = dims
    tokens, types, merges = tiny_vocab(d["vocab"])
    cfg = ModelConfig(
        architecture="llama", vocab_size=len(tokens), hidden_size=d["hidden"], intermediate_size=d["ffn"],
        num_layers=d["layers"], num_heads=d["heads"], num_kv_heads=d["kv_heads"],
        head_dim=d["hidden"] // d["heads"], tie_word_embeddings=d["tied"],
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("random-llama")
    w.add_context_length(4096)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(int({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                         "F16": gguf.LlamaFileType.MOSTLY_F16}[mix]))
    add_tiny_tokenizer(w, tokens, types, merges, "smollm")
    shapes = expected_weight_shapes(cfg)

    def qtype_of(name: str) -> str:
        return mix if mix != "Q4_K_M" else q4_k_m_type(name, cfg.num_layers)

    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor_info(_gguf_name(name), shape, np.dtype(np.float32), 4 * shape[0])
            continue
        if mix == "F16":
            w.add_tensor_info(_gguf_name(name), shape, np.dtype(np.float16), 2 * shape[0] * shape[1])
            continue
        q = GGMLQuantizationType[qtype_of(name)]
        block, size = GGML_QUANT_SIZES[q]
        nbytes = shape[0] * shape[1] // block * size
        w.add_tensor_info(_gguf_name(name), (shape[0], shape[1] // block * size), np.dtype(np.uint8), nbytes, q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    from tqdm import tqdm

    for name, shape in tqdm(shapes.items(), desc=f"write random {mix}", unit="tensor", disable=log is None):
        if len(shape) == 1:
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        if mix == "F16":
            f16 = np.empty(shape, np.float16)
            for r in range(0, shape[0], 4096):  # (float32 draws 4096 rows at a time)
                f16[r : r + 4096] = 0.02 * rng.standard_normal((min(4096, shape[0] - r), shape[1]), dtype=np.float32)
            w.write_tensor_data(f16)
            del f16
            continue
        qtype = qtype_of(name)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        nb = shape[0] * shape[1] // block
        raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        fields = FORMATS[qtype].f16_fields if qtype in FORMATS else (0,)
        for at in fields:  # d (and dmin): small, finite, positive
            scale = rng.random(nb, dtype=np.float32) * (0.2 / np.sqrt(shape[1]) / _RANDOM_RANGE[qtype])
            raw[:, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(nb, 2)
        w.write_tensor_data(raw.reshape(shape[0], -1))
        del raw
    w.close()
    tmp.rename(path)
    return path


# ----------------------------------------------------------------------------------------- PerfX
def _gguf_main_type(path: Path) -> str:
    from perfx_compiler.bench.engines import gguf_types

    return gguf_types(path).split("+")[0]


def quantization_candidates(path: Path) -> list[str]:
    """PerfX quantization options to try, best first: GGUF passthrough, the closest own format, f32."""
    main = _gguf_main_type(path).upper()
    # GGUF Q4_0 = symmetric int4, groups of 32; Q4_1 = scale + min (asymmetric), groups of 32.
    closest = {"Q4_0": ["q4_sym_g32", "q4_g32"], "Q4_1": ["q4_g32", "q4_sym_g32"], "Q8_0": ["q8"]}.get(main, [])
    out = ["gguf", *closest, "f32"]
    return list(dict.fromkeys(out))


def compile_perfx(
    gguf_path: Path,
    work: Path,
    quantization: str | None = None,
    max_context: int = 1024,
    rebuild: bool = False,
    log: Any = print,
    knobs: Mapping[str, Any] | None = None,
    target: str = "host",
) -> tuple[Path, dict[str, Any]]:
    """Compile (or reuse) a PerfX artifact for ``target``; return (dir, notes) with the requested/effective
    quantization (``knobs``: perfx-compile --knob values, part of the build stamp)."""
    from perfx_compiler.bench.engines import weight_format
    from perfx_compiler.pipeline import compile_model

    cands = [quantization] if quantization else quantization_candidates(gguf_path)
    tried: list[str] = []
    for q in cands:
        where = "" if target == "host" else f"-{target}"
        out = work / f"perfx-{model_key(gguf_path)}-{q}-ctx{max_context}{where}{_knobs_suffix(knobs)}"
        marker = out / ".bench-stamp"
        stamp = build_stamp(gguf_path, q, max_context, knobs) + where
        if not rebuild and _fresh(marker, stamp):
            manifest = json.loads((out / "perfx-config.json").read_text())
        else:
            log(f"perfx: compiling {gguf_path.name} with quantization={q} ...")
            t = time.perf_counter()
            try:
                compile_model(str(gguf_path), target, out, progress=False, quantization=q, max_context=max_context,
                              knobs=dict(knobs or {}))
            except PerfXError as err:
                tried.append(f"{q}: {err}")
                log(f"perfx: quantization {q} not available ({err})")
                continue
            manifest = json.loads((out / "perfx-config.json").read_text())
            marker.write_text(stamp)
            log(f"perfx: compiled in {time.perf_counter() - t:.0f} s")
        fmt = weight_format(manifest)
        if q != "f32" and fmt == "float32":  # the option was accepted but ignored: try the next one
            tried.append(f"{q}: compiled, but the weights stayed float32")
            log(f"perfx: quantization {q} left the weights float32; trying the next option")
            continue
        note = f"not available in PerfX: {', '.join(t.split(':')[0] for t in tried)}" if tried else ""
        return out, {"requested": q, "effective": q, "weight_format": fmt, "note": note, "tried": tried}
    raise PerfXError(f"no PerfX quantization worked for {gguf_path}: {'; '.join(tried)}")


# ----------------------------------------------------------------------------------------- onnxruntime
def emit_ort_onnx(
    gguf_path: Path, work: Path, max_context: int = 1024, rebuild: bool = False, log: Any = print
) -> Path:
    """PerfX's emitted fp32 ONNX graph for plain onnxruntime."""
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.onnx_emit import save_onnx

    folder = work / f"ort-{model_key(gguf_path)}-ctx{max_context}"
    path = folder / "model.onnx"
    marker = folder / ".bench-stamp"
    stamp = _stamp(gguf_path) + f":{max_context}"
    if rebuild or not _fresh(marker, stamp):
        log(f"ort: emitting ONNX for {gguf_path.name} ...")
        folder.mkdir(parents=True, exist_ok=True)
        save_onnx(load_model(str(gguf_path), max_context=max_context), path)
        marker.write_text(stamp)
    return path


def build_ort_genai(
    gguf_path: Path,
    work: Path,
    precision: str = "int4",
    rebuild: bool = False,
    log: Any = print,
    from_f16_gguf: bool = False,
) -> Path:
    """onnxruntime-genai model folder built offline by its model builder from this GGUF.

    The builder reads config + tokenizer from a Hugging Face folder written from ``gguf_path``
    (fp32 safetensors of the GGUF's dequantized weights); it quantizes those weights itself. With
    ``from_f16_gguf`` the weights come from the GGUF requantized to F16 by llama.cpp instead (the
    builder reads only F16/F32 GGUFs).
    """
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise PerfXError("onnxruntime-genai is not installed (pip install onnxruntime-genai)")
    key = model_key(gguf_path)
    out = work / f"ortgenai-{key}-{precision}"
    marker = out / ".bench-stamp"
    stamp = _stamp(gguf_path) + f":{precision}:{from_f16_gguf}"
    if not rebuild and _fresh(marker, stamp):
        return out
    from perfx_compiler.model.hf import write_hf_folder
    from perfx_compiler.model.loader import load_model

    hf = work / f"hf-{key}"
    if rebuild or not _fresh(hf / ".bench-stamp", _stamp(gguf_path)):
        log(f"ort-genai: writing HF folder for {gguf_path.name} ...")
        write_hf_folder(load_model(str(gguf_path)), hf)
        (hf / ".bench-stamp").write_text(_stamp(gguf_path))
    src: Path = hf
    if precision == "int4" and from_f16_gguf:
        f16 = work / f"{key}.F16.gguf"
        if rebuild or not _fresh(work / f"{key}.F16.stamp", _stamp(gguf_path)):
            log(f"ort-genai: requantizing {gguf_path.name} to F16 with llama.cpp ...")
            llama_quantize(gguf_path, f16, "F16")
            (work / f"{key}.F16.stamp").write_text(_stamp(gguf_path))
        src = f16
    cache = work / "ortgenai-cache"
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-m",
        str(hf),
        "-i",
        str(src),
        "-o",
        str(out),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(cache),
    ]
    log(f"ort-genai: building {precision} model ...")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not (out / "genai_config.json").is_file():
        raise PerfXError(f"onnxruntime-genai builder failed: {(res.stderr or res.stdout).strip()[-800:]}")
    (out / "perfx-bench.json").write_text(json.dumps({"precision": precision, "source": str(gguf_path)}))
    marker.write_text(stamp)
    return out
