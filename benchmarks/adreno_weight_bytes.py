"""Weight bytes of the adreno build (texture path): the artifact's weights.bin, the OpenCL device's
allocations for the weights, against the model's quantized weight bytes (the buffer-only mali build).

    python benchmarks/adreno_weight_bytes.py [--models tiny-f32 tiny-q4_1 smollm2-135m] [--label NAME]
        [--src CHECKOUT] [--append] [--csv benchmarks/results/adreno_weight_bytes.csv]

Per model: ``perfx-compile --target adreno`` (weights.bin size, textures in the manifest); every weight
of that artifact uploaded to the first OpenCL device (PoCL here) as the launcher does, images for
``*__tex``, summing pyopencl's allocation sizes; the mali build's weight table (no textures, same GPU
quantization formats) for the quantized bytes; and the bytes of buffers also present as images
(the duplicate of issue #5). ``--src`` measures another checkout (e.g. a ``git worktree`` of an older
commit) with this script; ``--append`` adds rows to the CSV instead of replacing it. Writes the CSV and
a bar chart next to it (.png). Nothing here runs on an Adreno GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _model_path(name: str, tmp: Path) -> str:
    if not name.startswith("tiny-"):
        return name
    from perfx_compiler.model.testing import write_tiny_gguf

    q = name.removeprefix("tiny-")
    kw = {"qtype": "Q4_1", "embed_qtype": "F32"} if q == "q4_1" else {}
    path, _ = write_tiny_gguf(tmp / f"{name}.gguf", context_length=128, **kw)
    return str(path)


def _device_bytes(artifact: Path) -> int:
    """Upload the artifact's weights to the OpenCL device (images for the manifest's textures); sum the
    allocations pyopencl reports."""
    from perfx_compiler.targets_exec.opencl import OpenCLLauncher

    launcher = OpenCLLauncher()
    manifest = json.loads((artifact / "perfx-config.json").read_text())
    blob = np.memmap(artifact / "weights.bin", dtype=np.uint8, mode="r")
    textures = manifest.get("textures", {})
    total = 0
    for w in manifest["weights"]:
        arr = np.frombuffer(blob[w["offset"] : w["offset"] + w["nbytes"]], dtype=w["dtype"]).reshape(w["shape"])
        if w["name"] in textures:
            total += int(launcher.to_image(arr).image.size)
        else:
            total += int(launcher.to_device(arr).buffer.size)
    return total


def measure(model: str, label: str, tmp: Path, max_context: int) -> dict:
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.targets_exec.reference import lowered_module

    spec = _model_path(model, tmp)
    out = compile_model(spec, "adreno", tmp / f"adreno-{model}", progress=False, max_context=max_context)
    manifest = json.loads((Path(out) / "perfx-config.json").read_text())
    names = {w["name"]: w["nbytes"] for w in manifest["weights"]}
    images = {n: b for n, b in names.items() if n.endswith("__tex")}
    # buffers whose group is also stored as images: codes / float W / scales (own image), mins and zeros
    # (packed into their scales' image)
    duplicated = sum(b for n, b in names.items() if n + "__tex" in names or (
        n.endswith(("_min", "_zero")) and n.rsplit("_", 1)[0] + "_scale__tex" in names))
    mali, _ = lowered_module(spec, "mali", max_context=max_context, schedule=False)
    quantized = sum(np.asarray(w).nbytes for w in mali.weights.values())
    wbin = (Path(out) / "weights.bin").stat().st_size
    return {
        "label": label, "model": model, "weights_bin_bytes": wbin, "manifest_weight_bytes": manifest["weight_bytes"],
        "device_bytes": _device_bytes(Path(out)), "quantized_bytes": quantized, "image_bytes": sum(images.values()),
        "images": len(images), "buffer_copies_of_images_bytes": duplicated,
        "weights_bin_over_quantized": round(wbin / quantized, 4),
    }


def plot(rows: list[dict], path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from _common import figure

    models = list(dict.fromkeys(r["model"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    with figure(path, figsize=(7, 3.5)) as (_, ax):
        width = 0.8 / max(1, len(labels))
        for i, lab in enumerate(labels):
            vals = [next((float(r["weights_bin_over_quantized"]) for r in rows if r["model"] == m and r["label"] == lab), 0)
                    for m in models]
            ax.bar(np.arange(len(models)) + i * width, vals, width, label=lab)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(models)) + width * (len(labels) - 1) / 2, models)
        ax.set_ylabel("weights.bin / quantized weight bytes")
        ax.set_title("adreno build: weight bytes (1.0 = each weight stored once)")
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-f32", "tiny-q4_1", "smollm2-135m"])
    ap.add_argument("--label", default=None, help="row label (default: the checkout's git commit)")
    ap.add_argument("--src", type=Path, default=HERE.parent, help="checkout whose perfx_compiler is measured")
    ap.add_argument("--max-context", type=int, default=128)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--csv", type=Path, default=HERE / "results" / "adreno_weight_bytes.csv")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.src.resolve()))
    label = args.label or subprocess.run(["git", "-C", str(args.src), "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            row = measure(model, label, Path(tmp), args.max_context)
            print(json.dumps(row))
            rows.append(row)
    if args.append and args.csv.exists():
        import csv

        with open(args.csv) as f:
            rows = list(csv.DictReader(f)) + rows
    sys.path.insert(0, str(HERE))
    from _common import write_csv

    write_csv(args.csv, rows)
    plot(rows, args.csv.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
