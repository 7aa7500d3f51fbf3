"""Artifact bytes against GGUF file bytes, per block type and per weight layout (issue #25: <= 1.03x).

Each type's random blocks (``bench.ggml_mul_mat.random_blocks``) at TinyLlama-1.1B's down projection
(2048 x 5632, N x K) go through the GGUF passthrough's own packing (``passes/gguf_passthrough._pack``)
into each layout a compile can choose:

  int8_act   x86 with AVX-512 VNNI (int8 activations, ``formats/vnni.py``)
  float_act  CPUs without it: ARM, RISC-V, older x86 (``formats/superblocks.py``, ``formats/gguf_blocks.py``)
  gpu        GPU targets (group values and superblock d in arrays of their own, d as float32 bits)

No timing: the bytes depend only on the layouts. Writes benchmarks/results/format_bytes.csv and .png.

    python benchmarks/format_bytes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from _common import RESULTS, figure, write_csv  # noqa: E402

from perfx_compiler.bench.ggml_mul_mat import BLOCKS, random_blocks  # noqa: E402
from perfx_compiler.passes.gguf_passthrough import _pack  # noqa: E402

N, K = 2048, 5632
LAYOUTS = {"int8_act": {"vnni": True}, "float_act": {"vnni": False}, "gpu": {"vnni": False, "gpu": True}}


def main() -> int:
    rng = np.random.default_rng(0)
    rows = []
    for qtype in BLOCKS:
        raw = random_blocks(qtype, N, K, rng)
        row = {"type": qtype, "N": N, "K": K, "file_bytes": raw.nbytes}
        for name, opts in LAYOUTS.items():
            pk = _pack(qtype, raw, (N, K), False, **opts)
            row[f"{name}_bytes"] = pk.nbytes
            row[f"{name}_vs_file"] = pk.nbytes / raw.nbytes
        rows.append(row)
        print(f"{qtype:7s} " + "  ".join(f"{n} {row[f'{n}_vs_file']:.3f}x" for n in LAYOUTS), flush=True)
    out = RESULTS / "format_bytes.csv"
    write_csv(out, rows, floats=".4f")
    with figure(out.with_suffix(".png"), figsize=(10, 4)) as (_fig, ax):
        x = np.arange(len(rows))
        for i, name in enumerate(LAYOUTS):
            ax.bar(x + (i - 1) * 0.27, [r[f"{name}_vs_file"] for r in rows], 0.27, label=name)
        ax.axhline(1.03, color="k", ls="--", lw=1, label="1.03x (issue #25)")
        ax.set_xticks(x)
        ax.set_xticklabels([r["type"] for r in rows])
        ax.set_ylabel("artifact bytes / GGUF file bytes")
        ax.set_title(f"Weight bytes per layout, {N} x {K} random blocks")
        ax.legend(fontsize=8)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
