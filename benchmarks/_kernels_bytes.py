"""``python benchmarks/kernels.py bytes``: artifact bytes against GGUF file bytes per block type and weight
layout (benchmarks/kernels.py's docstring)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _common import RESULTS, figure, write_csv

BYTES_LAYOUTS = {"int8_act": {"vnni": True}, "float_act": {"vnni": False}, "gpu": {"vnni": False, "gpu": True}}


def bytes_main(args: argparse.Namespace) -> int:
    """``bytes``: artifact / file bytes per GGUF type and layout (module docstring)."""
    from perfx_compiler.bench.ggml_mul_mat import BLOCKS, random_blocks
    from perfx_compiler.formats import read_quant_info
    from perfx_compiler.passes.gguf_passthrough import _pack
    from perfx_compiler.passes.texture_weights import quant_images, takes_images, texture_options
    from perfx_compiler.targets import load_target

    n, k = 2048, 5632
    rng = np.random.default_rng(0)
    textures = texture_options(load_target("adreno"))
    layouts = [*BYTES_LAYOUTS, "adreno_images"]
    rows = []
    for qtype in BLOCKS:
        raw = random_blocks(qtype, n, k, rng)
        row = {"type": qtype, "N": n, "K": k, "file_bytes": raw.nbytes}
        packs = {name: _pack(qtype, raw, (n, k), False, **opts) for name, opts in BYTES_LAYOUTS.items()}
        for name, pk in packs.items():
            row[f"{name}_bytes"] = pk.nbytes
            row[f"{name}_vs_file"] = pk.nbytes / raw.nbytes
        gpu = packs["gpu"]  # Adreno packs its images from the GPU layout; the types without images stay in it
        q = read_quant_info(gpu.compute("matmul", (1, 1)))
        images = (sum(a.nbytes for a in quant_images(q, [a for _, a in gpu.arrays], textures))
                  if takes_images(q) else gpu.nbytes)
        row["adreno_images_bytes"], row["adreno_images_vs_file"] = images, images / raw.nbytes
        rows.append(row)
        print(f"{qtype:7s} " + "  ".join(f"{nm} {row[f'{nm}_vs_file']:.3f}x" for nm in layouts), flush=True)
    out = Path(args.out) if args.out else RESULTS / "format_bytes.csv"
    write_csv(out, rows, floats=".4f")
    with figure(out.with_suffix(".png"), figsize=(10, 4)) as (_fig, ax):
        x = np.arange(len(rows))
        for i, name in enumerate(layouts):
            ax.bar(x + (i - 1.5) * 0.2, [r[f"{name}_vs_file"] for r in rows], 0.2, label=name)
        ax.axhline(1.03, color="k", ls="--", lw=1, label="1.03x (issue #25)")
        ax.set_xticks(x)
        ax.set_xticklabels([r["type"] for r in rows])
        ax.set_ylabel("artifact bytes / GGUF file bytes")
        ax.set_title(f"Weight bytes per layout, {n} x {k} random blocks")
        ax.legend(fontsize=8)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
