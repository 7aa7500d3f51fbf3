"""Why int8-activation prefill and decode disagree on a random-weight TinyLlama but not on SmolLM2.

Hypothesis under test (issue #8): the VNNI GEMM (prefill) and GEMV (decode) sum in different orders,
so their float32 results differ by ~1e-7 relative; now and then that moves an activation across an
int8 rounding boundary (the kernels quantize each linear's input row per 32-column group,
``dx = amax / 127``, ``q = rint(x * 127 / amax)``), and a deep random network amplifies such flips
while a trained one does not.

A float64 numpy forward pass (full causal sequence, the ``perfx_compiler.model.reference`` model)
runs several variants of one model in lockstep, layer by layer (weights dequantized one layer at a
time from the GGUF blocks):

* ``i8``: every linear (q|k|v, o, gate|up, down, lm_head) multiplies with its input quantized to
  int8 exactly as :func:`perfx_compiler.passes._qvnni.quantize_activations` (float32 scale, rint);
* ``i8+eps<s>``: the same with every linear input multiplied by ``1 + eps * N(0, 1)`` first
  (eps = 1e-7 emulates a change of float32 summation order), seed s;
* ``i8+eps/100``: the same with eps / 100 (1e-9: below float32 resolution for most inputs);
* ``i8+kick``: one int8 code of layer 0's q|k|v input (middle token) moved by one step, nothing else;
* ``f64``, ``f64+eps1``, ``f64+kick``: the same without int8 quantization (float activations; the
  kick adds the same one-step amount).

Each perturbed variant is compared with its unperturbed base after every layer (max |dx| / max |x|
of the residual stream, all tokens) and at the logits (max |dlogit| / max |logit| at the last
position, like the engine check; and the share of positions whose argmax changed); for int8 the
share of int8 codes that differ from the base at each layer's linears is recorded.

Reading the plot: the residual metric is normalized by max |x|, so SmolLM2's massive activations (one
channel ~100x the rest from layer ~11 on) push every curve down there; the logits rows of the CSV are
the comparable numbers. ``i8 vs f64`` is the int8 quantization error itself: the level a flip cascade
saturates at.

With ``--engine`` it also runs the compiled int8 artifact: prefill logits vs token-by-token decode
(the number the issue reports), both vs the numpy ``i8`` / ``f64`` references, and how many of 32
greedy tokens after a text prompt agree when the prompt's KV cache comes from prefill or from decode.

    python benchmarks/int8_drift.py [--models tinyllama,smollm2] [--tokens 32] [--layers 0] [--engine]

Writes benchmarks/results/int8_drift.csv (long format, with the 1-minute load average) and .png.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, figure, write_csv

from perfx_compiler.model.reference import _apply_rope, _rms_norm, _silu

BENCH = Path("/tmp/perfx-bench")
MODELS = {  # name -> (GGUF, int8-activation artifact the peer benchmarks build from it)
    "tinyllama-random-q4_0": (BENCH / "models/tinyllama-1.1b-random.Q4_0-pure.gguf",
                              BENCH / "perfx-tinyllama-1.1b-random.q4_0-pure-gguf-ctx1024"),
    "smollm2-q4_0": (BENCH / "models/SmolLM2-135M-Instruct.Q4_0.gguf",
                     BENCH / "perfx-smollm2-135m-instruct.q4_0-gguf-ctx1024"),
}
PROMPT = "Once upon a time, there was a little girl named"  # models.md's SmolLM2 greedy check
GROUP = 32  # activation group of every GGUF Q4_0/Q4_1/Q8_0 VNNI kernel (the weight block)


def quantize_codes(x: np.ndarray, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (as float32) and the per-group step of x [..., K], by the kernels' rule
    (``_qvnni.quantize_activations``: float32 x, inv = 127 / amax in float32, rint). K % group == 0."""
    x32 = np.asarray(x, dtype=np.float32)
    g = x32.reshape(*x32.shape[:-1], -1, group)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((g * inv).astype(np.float32))
    return q, (amax / np.float32(127.0)).astype(np.float32)


def dequantize_codes(q: np.ndarray, dx: np.ndarray) -> np.ndarray:
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(*q.shape[:-2], -1)


@dataclass
class Variant:
    name: str
    int8: bool
    eps: float = 0.0
    seed: int = 0
    kick: bool = False
    base: str = ""  # the variant it is compared with ("" for a base)
    x: np.ndarray | None = None
    flips: dict[int, list[int]] = field(default_factory=dict)  # layer -> [codes differing, codes]
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(1000 + self.seed)


def variants() -> list[Variant]:
    # bases first: a perturbed variant reads its base's codes at the same site
    return [Variant("i8", True), Variant("i8+eps1", True, 1.0, 1, base="i8"),
            Variant("i8+eps2", True, 1.0, 2, base="i8"), Variant("i8+eps/100", True, 0.01, 3, base="i8"),
            Variant("i8+kick", True, kick=True, base="i8"),
            Variant("f64", False), Variant("f64+eps1", False, 1.0, 1, base="f64"),
            Variant("f64+kick", False, kick=True, base="f64")]


class Lockstep:
    """Runs every variant through one layer's weights before loading the next layer."""

    def __init__(self, desc: Any, ids: np.ndarray, eps: float, kick_at: tuple[int, int]) -> None:
        self.desc, self.cfg, self.ids, self.eps = desc, desc.config, ids, eps
        self.kick_at = kick_at  # (token, column) of the layer-0 q|k|v input moved by one code
        self.kick_size = 0.0
        self.vs = variants()
        self.by_name = {v.name: v for v in self.vs}
        self.codes: dict[tuple[str, str], np.ndarray] = {}  # (base, site) -> codes in the current layer

    def _w(self, name: str) -> np.ndarray:
        return np.asarray(self.desc.weights[name], dtype=np.float64)

    def linear(self, v: Variant, x: np.ndarray, w: np.ndarray, layer: int, site: str) -> np.ndarray:
        """x [T, K] @ w.T with v's activation treatment; w [N, K]."""
        if v.eps:
            assert v.rng is not None
            x = x * (1.0 + v.eps * self.eps * v.rng.standard_normal(x.shape))
        if v.int8:
            q, dx = quantize_codes(x)
            if v.kick and layer == 0 and site == "qkv":
                t, c = self.kick_at
                q[t, c // GROUP, c % GROUP] += 1.0 if q[t, c // GROUP, c % GROUP] < 127 else -1.0
                self.kick_size = float(dx[t, c // GROUP, 0])
            if not v.base:
                self.codes[(v.name, site)] = q
            else:
                cnt = v.flips.setdefault(layer, [0, 0])
                cnt[0] += int(np.count_nonzero(q != self.codes[(v.base, site)]))
                cnt[1] += q.size
            x = dequantize_codes(q, dx)
        elif v.kick and layer == 0 and site == "qkv":
            x = x.copy()
            t, c = self.kick_at
            # the int8 kick's size (the i8 variants run first at every site)
            x[t, c] += self.kick_size if self.kick_size else float(np.abs(x[t]).max() / 127)
        return x @ w.T

    def layer(self, li: int) -> None:
        c, p = self.cfg, f"model.layers.{li}."
        t = self.ids.shape[0]
        wqkv = np.concatenate([self._w(p + f"self_attn.{n}_proj.weight") for n in "qkv"], axis=0)
        wo = self._w(p + "self_attn.o_proj.weight")
        wgu = np.concatenate([self._w(p + "mlp.gate_proj.weight"), self._w(p + "mlp.up_proj.weight")], axis=0)
        wd = self._w(p + "mlp.down_proj.weight")
        n1, n2 = self._w(p + "input_layernorm.weight"), self._w(p + "post_attention_layernorm.weight")
        from perfx_compiler.model.description import rope_tables

        cos, sin = (a.astype(np.float64) for a in rope_tables(c, t))
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        mask = np.arange(t)[None, :] > np.arange(t)[:, None]
        for v in self.vs:
            assert v.x is not None
            qkv = self.linear(v, _rms_norm(v.x, n1, c.rms_norm_eps), wqkv, li, "qkv")
            q = qkv[:, : nh * hd].reshape(t, nh, hd).transpose(1, 0, 2)
            k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(t, nkv, hd).transpose(1, 0, 2)
            val = qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd).transpose(1, 0, 2)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            s = np.einsum("grsd,gtd->grst", q.reshape(nkv, nh // nkv, t, hd), k) / np.sqrt(hd)
            s = np.where(mask, -np.inf, s)
            pr = np.exp(s - s.max(axis=-1, keepdims=True))
            pr /= pr.sum(axis=-1, keepdims=True)
            o = np.einsum("grst,gtd->grsd", pr, val).reshape(nh, t, hd).transpose(1, 0, 2).reshape(t, nh * hd)
            v.x = v.x + self.linear(v, o, wo, li, "o")
            gu = self.linear(v, _rms_norm(v.x, n2, c.rms_norm_eps), wgu, li, "gate_up")
            ffn = c.intermediate_size
            v.x = v.x + self.linear(v, _silu(gu[:, :ffn]) * gu[:, ffn:], wd, li, "down")

    def run(self, layers: int, on_layer: Any) -> dict[str, np.ndarray]:
        emb = self._w("model.embed_tokens.weight")[self.ids]
        for v in self.vs:
            v.x = emb.copy()
        for li in range(layers):
            self.layer(li)
            on_layer(li, self)
        head = np.asarray(self.desc.lm_head(), dtype=np.float64)
        fn = self._w("model.norm.weight")
        return {v.name: self.linear(v, _rms_norm(v.x, fn, self.cfg.rms_norm_eps), head, layers, "lm_head")
                for v in self.vs}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def engine_logits(art: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(prefill_all logits [T, vocab], token-by-token decode logits [T, vocab]) of the artifact."""
    from perfx_compiler.runtime.engine import Engine

    eng = Engine(art)
    eng.reset()
    pre = np.asarray(eng.prefill_all(ids), dtype=np.float64).reshape(len(ids), -1)
    eng.reset()
    steps = [np.asarray(eng.prefill(ids[:1]), dtype=np.float64).reshape(-1)]
    steps += [np.asarray(eng.decode(t), dtype=np.float64).reshape(-1).copy() for t in ids[1:]]
    del eng
    return pre, np.stack(steps)


def engine_greedy(art: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """Greedy tokens after ``prompt`` with its KV cache written by prefill (GEMM) and by token-by-token
    decode (GEMV); the generated tokens run through decode either way."""
    from tokenizers import Tokenizer

    from perfx_compiler.runtime.engine import Engine

    ids = Tokenizer.from_file(str(art / "tokenizer.json")).encode(prompt).ids
    eng = Engine(art)
    outs = []
    for via_prefill in (True, False):
        eng.reset()
        if via_prefill:
            logits = np.asarray(eng.prefill(ids)).reshape(-1)
        else:
            logits = np.asarray(eng.prefill(ids[:1])).reshape(-1)
            for t in ids[1:]:
                logits = np.asarray(eng.decode(t)).reshape(-1)
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(logits)))
            logits = np.asarray(eng.decode(toks[-1])).reshape(-1)
        outs.append(toks)
    del eng
    return outs[0], outs[1]


def study(name: str, tokens: int, layers: int, eps: float, engine: bool, seed: int) -> list[dict[str, Any]]:
    from perfx_compiler.model.gguf import load_gguf

    gguf, art = MODELS[name]
    desc = load_gguf(gguf, max_context=max(tokens, 64), lazy=True)
    cfg = desc.config
    nl = layers or cfg.num_layers
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, cfg.vocab_size, size=tokens)
    rows: list[dict[str, Any]] = []
    load = round(os.getloadavg()[0], 2)

    def add(variant: str, base: str, layer: Any, metric: str, value: float) -> None:
        rows.append({"model": name, "variant": variant, "vs": base, "layer": layer, "metric": metric,
                     "value": value, "tokens": tokens, "layers": nl, "eps": eps, "loadavg1": load})

    def on_layer(li: int, ls: Lockstep) -> None:
        msg = []
        for v in ls.vs:
            if v.base:
                b = ls.by_name[v.base]
                add(v.name, v.base, li, "resid_rel", rel(v.x, b.x))
                msg.append(f"{v.name} {rel(v.x, b.x):.1e}")
                if v.int8:
                    d, n = v.flips[li]
                    add(v.name, v.base, li, "flip_frac", d / n)
                    add(v.name, v.base, li, "flips", float(d))
        ref = ls.by_name["i8"].x
        add("i8", "f64", li, "resid_rel", rel(ref, ls.by_name["f64"].x))
        print(f"  {name} layer {li:2d}: " + ", ".join(msg), flush=True)

    ls = Lockstep(desc, ids, eps, kick_at=(tokens // 2, int(rng.integers(cfg.hidden_size))))
    t0 = time.time()
    logits = ls.run(nl, on_layer)
    print(f"  {name}: {nl} layers x {tokens} tokens x {len(ls.vs)} variants in {time.time() - t0:.0f} s", flush=True)
    add("i8", "f64", "logits", "logit_rel_last", rel(logits["i8"][-1], logits["f64"][-1]))  # int8 error itself
    # how close greedy decoding is to a tie: (top1 - top2) / max |logit| per position, float reference
    top = np.sort(logits["f64"], axis=1)[:, -2:]
    gap = (top[:, 1] - top[:, 0]) / np.abs(logits["f64"]).max(axis=1)
    add("f64", "", "logits", "top2_gap_median", float(np.median(gap)))
    add("f64", "", "logits", "top2_gap_min", float(gap.min()))
    add("i8", "f64", "logits", "argmax_changed", float(np.mean(logits["i8"].argmax(1) != logits["f64"].argmax(1))))
    for v in ls.vs:
        if not v.base:
            continue
        a, b = logits[v.name], logits[v.base]
        add(v.name, v.base, "logits", "logit_rel_last", rel(a[-1], b[-1]))
        add(v.name, v.base, "logits", "logit_rel_all", rel(a, b))
        add(v.name, v.base, "logits", "logit_rel_first", rel(a[0], b[0]))
        add(v.name, v.base, "logits", "argmax_changed", float(np.mean(a.argmax(1) != b.argmax(1))))
        if v.int8:
            add(v.name, v.base, "logits", "flips_total", float(sum(d for d, _ in v.flips.values())))
            add(v.name, v.base, "logits", "codes_total", float(sum(n for _, n in v.flips.values())))
    if engine and nl == cfg.num_layers and art.is_dir():
        del desc, ls
        pre, dec = engine_logits(art, ids.tolist())
        add("engine_prefill", "engine_decode", "logits", "logit_rel_last", rel(pre[-1], dec[-1]))
        add("engine_prefill", "engine_decode", "logits", "logit_rel_all", rel(pre, dec))
        add("engine_prefill", "engine_decode", "logits", "logit_rel_first", rel(pre[0], dec[0]))
        add("engine_prefill", "engine_decode", "logits", "argmax_changed", float(np.mean(pre.argmax(1) != dec.argmax(1))))
        for en, e in (("engine_prefill", pre), ("engine_decode", dec)):
            for b in ("i8", "f64"):
                add(en, b, "logits", "logit_rel_last", rel(e[-1], logits[b][-1]))
                add(en, b, "logits", "argmax_changed", float(np.mean(e.argmax(1) != logits[b].argmax(1))))
        a, b = engine_greedy(art, PROMPT, 32)
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        add("engine_prefill", "engine_decode", "greedy", "greedy_same_prefix", float(same))
    for r in rows:
        if r["layer"] in ("logits", "greedy"):
            print(f"  {name} {r['variant']} vs {r['vs']}: {r['metric']} = {r['value']:.3g}", flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    models = sorted({r["model"] for r in rows})
    with figure(path, 2, len(models), figsize=(6 * len(models), 8), squeeze=False) as (fig, axes):
        for j, m in enumerate(models):
            mr = [r for r in rows if r["model"] == m and r["layer"] != "logits"]
            for v in sorted({r["variant"] for r in mr if r["metric"] == "resid_rel"}):
                vs = {r["vs"] for r in mr if r["variant"] == v and r["metric"] == "resid_rel"}
                for b in vs:
                    pts = [(r["layer"], max(r["value"], 1e-17)) for r in mr
                           if r["variant"] == v and r["vs"] == b and r["metric"] == "resid_rel"]
                    axes[0][j].semilogy(*zip(*pts, strict=True), marker=".", ls="-" if v.startswith("i8+") else "--",
                                        label=f"{v} vs {b}")
                fl = [(r["layer"], max(r["value"], 1e-9)) for r in mr if r["variant"] == v and r["metric"] == "flip_frac"]
                if fl:
                    axes[1][j].semilogy(*zip(*fl, strict=True), marker=".", label=v)
            lg = [r for r in rows if r["model"] == m and r["layer"] == "logits" and r["metric"] == "logit_rel_last"]
            eng = next((r["value"] for r in lg if r["variant"] == "engine_prefill" and r["vs"] == "engine_decode"), None)
            title = m + (f"\nengine prefill vs decode: {eng:.2g} of max|logit|" if eng is not None else "")
            axes[0][j].set_title(title)
            axes[0][j].set_xlabel("layer")
            axes[0][j].set_ylabel("max |dx| / max |x| (residual stream)")
            axes[0][j].legend(fontsize=7)
            axes[1][j].set_xlabel("layer")
            axes[1][j].set_ylabel("share of int8 codes differing from i8")
            axes[1][j].legend(fontsize=7)
        fig.suptitle("int8-activation drift: 1e-7 relative input noise / one int8 code step, float64 emulation")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=0, help="first N layers only (0: all)")
    p.add_argument("--eps", type=float, default=1e-7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", action="store_true", help="also run the compiled int8 artifacts")
    p.add_argument("--out", default=str(RESULTS / "int8_drift.csv"))
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for m in args.models.split(","):
        rows += study(m, args.tokens, args.layers, args.eps, args.engine, args.seed)
    out = write_csv(args.out, rows)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
