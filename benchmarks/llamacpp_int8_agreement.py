"""How closely can PerfX agree with llama.cpp on SmolLM2 (the shipped Q4_1 GGUF)? The numbers behind the
bounds of tests/model/test_llamacpp_reference.py.

llama.cpp rounds every quantized linear's input to int8 (Q8_1 blocks for Q4_1, Q8_0 for Q8_0: 32 values,
d = amax/127 stored as fp16) and keeps K/V in fp16. The question (issue #22): would PerfX's int8-activation
build, rounding in llama.cpp's own blocks, agree with llama.cpp's top-1 token on >= 98% of positions?

Teacher-forced over the first ``--tokens`` tokens of perfx_compiler/data/kjv_genesis_1-3.txt, each source
gives the logits of every position:

* numpy (float64, SmolLM2's dequantized weights, the ``perfx_compiler.model.reference`` model):
  ``f64``; ``i8``: every linear's input rounded to int8 per 32 columns as PerfX's kernels do (f32 d);
  ``i8+1e-6 s<n>``: the same after multiplying every linear input by 1 + 1e-6 N(0, 1) (seed n: a change of
  float32 summation order, at most); ``i8 fp16-d``: d rounded to fp16 as llama.cpp stores it;
  ``i8 fp16-d fp16-kv``: also K, V, Q and the attention weights through fp16;
* llama.cpp 0.3.36 (2 threads, one eval): ``default``, ``f32-kv`` (type_k = type_v = F32), ``flash-attn``,
  ``f32-weights`` (an F32 copy of the file llama.cpp dequantized itself, F32 KV: no int8 or fp16 step);
* PerfX: ``f32`` (prefill), ``int8`` (prefill: the VNNI GEMM), ``int8 decode`` (one token at a time: the GEMV).

Each row compares two sources: top-1 agreement, mean KL(a || b), max |logit difference| / max |logit|.

    python benchmarks/llamacpp_int8_agreement.py [--tokens 320]

Writes benchmarks/results/llamacpp_int8_agreement.csv.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO, RESULTS, write_csv

from perfx_compiler.bench.llamacpp_logits import llamacpp_logits
from perfx_compiler.model.reference import _apply_rope, _rms_norm, _silu, rope_tables

WORK = Path("/tmp/perfx-bench/llamacpp-agreement")
TEXT = REPO / "perfx_compiler" / "data" / "kjv_genesis_1-3.txt"

def f16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float64)


def int8_round(x: np.ndarray, fp16_d: bool, eps: float, rng: np.random.Generator) -> np.ndarray:
    """x [s, K] rounded to int8 per 32 columns (q = rint(x * 127/amax)) times d = amax/127, as float64."""
    x = np.asarray(x, np.float32)
    if eps:
        x = (x * (1 + eps * rng.standard_normal(x.shape))).astype(np.float32)
    g = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    q = np.rint(g * np.where(amax > 0, np.float32(127) / safe, np.float32(0)))
    d = (amax / np.float32(127)).astype(np.float32)
    return (q * (f16(d) if fp16_d else d.astype(np.float64))).reshape(x.shape)


def numpy_logits(desc: Any, ids: list[int], int8: bool = False, fp16_d: bool = False, fp16_kv: bool = False,
                 eps: float = 0.0, seed: int = 0) -> np.ndarray:
    """SmolLM2's logits [len(ids), vocab] in float64, every linear's input optionally rounded to int8."""
    c, w = desc.config, desc.weights
    rng = np.random.default_rng(seed)
    seq, nh, nkv, hd = len(ids), c.num_heads, c.num_kv_heads, c.head_dim
    cos, sin = (t[:seq] for t in rope_tables(c, seq))
    mask = np.arange(seq)[None, :] > np.arange(seq)[:, None]

    def W(name: str) -> np.ndarray:  # noqa: N802
        return np.asarray(w[name], np.float64)

    def lin(h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return (int8_round(h, fp16_d, eps, rng) if int8 else h) @ weight.T

    x = W("model.embed_tokens.weight")[np.asarray(ids)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, W(p + "input_layernorm.weight"), c.rms_norm_eps)
        q, k, v = (lin(h, W(p + f"self_attn.{n}_proj.weight")).reshape(seq, -1, hd).transpose(1, 0, 2) for n in "qkv")
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if fp16_kv:
            q, k, v = f16(q), f16(k), f16(v)
        s = np.einsum("grsd,gtd->grst", q.reshape(nkv, nh // nkv, seq, hd), k) / np.sqrt(hd)
        s = np.exp(np.where(mask, -np.inf, s) - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("grst,gtd->grsd", f16(s) if fp16_kv else s, v).reshape(nh, seq, hd).transpose(1, 0, 2)
        x = x + lin(o.reshape(seq, nh * hd), W(p + "self_attn.o_proj.weight"))
        h = _rms_norm(x, W(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
        gate, up = lin(h, W(p + "mlp.gate_proj.weight")), lin(h, W(p + "mlp.up_proj.weight"))
        x = x + lin(_silu(gate) * up, W(p + "mlp.down_proj.weight"))
    return lin(_rms_norm(x, W("model.norm.weight"), c.rms_norm_eps), np.asarray(desc.lm_head(), np.float64))


def perfx_logits(desc: Any, ids: list[int], activations: str, decode: bool) -> np.ndarray:
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    art = WORK / activations
    if not (art / "perfx-config.json").exists():
        compile_model(desc, "host", art, progress=False, activations=activations, batching=False)
    eng = Engine(art)
    eng.reset()
    if not decode:
        return np.asarray(eng.prefill_all(ids), np.float64)
    rows = [np.asarray(eng.prefill(ids[:1]), np.float64).reshape(-1)]
    rows += [np.asarray(eng.decode(t), np.float64).reshape(-1) for t in ids[1:]]
    return np.stack(rows)


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    la, lb = log_softmax(a), log_softmax(b)
    return {"top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "mean_kl": float((np.exp(la) * (la - lb)).sum(-1).mean()),
            "max_rel_logit_diff": float((np.abs(a - b).max(-1) / np.abs(a).max(-1)).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=320)
    args = ap.parse_args()
    from perfx_compiler.bench.models import resolve_model
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.tokenizer import load_tokenizer

    WORK.mkdir(parents=True, exist_ok=True)
    desc = load_model("smollm2-135m", max_context=512)
    text = TEXT.read_text(encoding="utf-8")
    ids = load_tokenizer(desc.tokenizer_json).encode(text, add_special_tokens=False).ids[: args.tokens]
    gguf = str(resolve_model("smollm2-135m"))
    src: dict[str, np.ndarray] = {}
    for mode in ("default", "f32-kv", "flash-attn", "f32-weights"):
        src[f"llama.cpp {mode}"] = llamacpp_logits(gguf, ids, mode)
        print(mode, "done", flush=True)
    for name, act, dec in (("PerfX f32", "f32", False), ("PerfX int8", "int8", False),
                           ("PerfX int8 decode", "int8", True)):
        src[name] = perfx_logits(desc, ids, act, dec)
        print(name, "done", flush=True)
    for name, kw in (("numpy f64", {}), ("numpy i8", {"int8": True}),
                     ("numpy i8+1e-6 s0", {"int8": True, "eps": 1e-6, "seed": 0}),
                     ("numpy i8+1e-6 s1", {"int8": True, "eps": 1e-6, "seed": 1}),
                     ("numpy i8 fp16-d", {"int8": True, "fp16_d": True}),
                     ("numpy i8 fp16-d fp16-kv", {"int8": True, "fp16_d": True, "fp16_kv": True})):
        src[name] = numpy_logits(desc, ids, **kw)
        print(name, "done", flush=True)
    pairs = [("llama.cpp default", b) for b in src if b != "llama.cpp default"]
    pairs += [("llama.cpp f32-weights", "PerfX f32"), ("llama.cpp f32-weights", "numpy f64"),
              ("numpy f64", "PerfX f32"), ("numpy i8", "numpy i8+1e-6 s0"), ("numpy i8", "numpy i8+1e-6 s1"),
              ("numpy i8", "numpy i8 fp16-d"), ("numpy f64", "numpy i8"), ("PerfX int8", "PerfX int8 decode"),
              ("PerfX f32", "PerfX int8")]
    load = os.getloadavg()[0]
    rows = [{"a": a, "b": b, **compare(src[a], src[b]), "tokens": len(ids), "loadavg1": load} for a, b in pairs]
    for r in rows:
        print(f"{r['a']:>22} vs {r['b']:<24} top-1 {r['top1_agreement']:.4f}  KL {r['mean_kl']:.2e}  "
              f"max rel {r['max_rel_logit_diff']:.2e}")
    print("wrote", write_csv(RESULTS / "llamacpp_int8_agreement.csv", rows, floats=".6g"))


if __name__ == "__main__":
    main()
