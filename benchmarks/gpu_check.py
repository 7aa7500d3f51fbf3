"""GPU check for a lent NVIDIA machine (H200): correctness and speed of the cuda-sm90 build, one table.

    python benchmarks/gpu_check.py [--model smollm2-135m] [--target cuda-sm90] [--dry] [--csv FILE]

1. times TVM's scheduled fp16 GEMM (dlight gpu.Matmul, the gpu_matmul template's default) against
   torch.matmul on the model's prefill shapes (M = 128) and 4096^3;
2. times an int4 (group 32) GEMV 1x4096x4096 and reports its bandwidth against a device-to-device copy;
3. builds the model for the CUDA target and for the host CPU (bundles in --work are reused), decodes
   the same tokens on both and compares logits (max |diff|, argmax agreement);
4. decode tokens/s of the whole model.
``--dry`` builds every kernel for the target without running anything (works on a machine without a GPU).
``--csv`` appends the table's rows (with the date, device and mode) to a CSV file.
No network is used: the model must be loadable offline (see perfx_compiler/model/loader.py).

Two checks that need no GPU:

    python benchmarks/gpu_check.py ptxas [--model smollm2-135m] [--targets cuda-sm80 cuda-sm90]
        [--csv benchmarks/results/ptxas_sm80_sm90a.csv] [--work DIR]

registers and spills of every CUDA kernel of the model per target (nvcc ``-Xptxas -v``; the bundle keeps
``kernels.<arch>.ptxas.txt``): one CSV row per (target, kernel), with whether it is a hot one
(GEMM/GEMV/attention) or a CPU kernel run as-is on the device (``device_code.adapted_cpu_kernels``).
Exits 1 when a hot kernel spills.

    XDG_RUNTIME_DIR=/tmp python benchmarks/gpu_check.py lavapipe [--model smollm2-135m] [--tokens 1 504 3458]
        [--quantization auto|f32|gguf|q8|q4_g128] [--host-build DIR] [--csv benchmarks/results/vulkan_lavapipe.csv]

the vulkan build (phases 0-3: int32 indices, WGSL kernels) decoding each token kernel by kernel through
PerfX's WGSL launcher on the first wgpu adapter (Mesa's lavapipe on a CPU-only machine), against an x86
build of the same model and quantization (``--host-build`` reuses one) and the float64 reference model.
Exits 1 when the logits differ from x86's by more than 1e-3 x scale or the greedy tokens differ; appends
one row to ``--csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROWS: list[tuple[str, str, str]] = []
CSV_OUT: dict[str, Any] = {}  # path and row prefix once --csv is parsed: rows are appended as they come


def row(what: str, value: str, note: str = "") -> None:
    ROWS.append((what, value, note))
    print(f"  {what}: {value} {note}", flush=True)
    if CSV_OUT:  # written at once, so a run cut by the time limit keeps what it measured
        import csv

        path: Path = CSV_OUT["path"]
        new = not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["utc", "model", "target", "device", "mode", "what", "value", "note"])
            w.writerow([*CSV_OUT["prefix"], what, value, note])


def build_tir(func: Any, tgt: Any) -> Any:
    import tvm
    from tvm.s_tir import dlight as dl

    mod = tvm.IRModule({"main": func})
    with tgt:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.Fallback())(mod)
        return tvm.compile(mod, target=tgt)


def matmul_func(m: int, n: int, k: int, dtype: str = "float16") -> Any:
    from tvm import te

    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    r = te.reduce_axis((0, k), "k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[j, r].astype("float32"), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype(dtype), name="D")
    return te.create_prim_func([a, b, d])


def int4_gemv_func(n: int, k: int, group: int = 32) -> Any:
    import tvm
    from tvm import te

    x = te.placeholder((1, k), "float16", name="X")
    w = te.placeholder((n, k // 8), "uint32", name="W")
    s = te.placeholder((n, k // group), "float16", name="S")

    def deq(j: Any, kk: Any) -> Any:
        nib = (w[j, kk // 8] >> ((kk % 8) * 4).astype("uint32")) & tvm.tirx.const(15, "uint32")
        return (nib.astype("float16") - tvm.tirx.const(8, "float16")) * s[j, kk // group]

    dq = te.compute((n, k), deq, name="dequant")
    r = te.reduce_axis((0, k), "k")
    y = te.compute(
        (1, n), lambda i, j: te.sum(x[i, r].astype("float32") * dq[j, r].astype("float32"), axis=r), name="Y"
    )
    return te.create_prim_func([x, w, s, y])


def time_tvm(ex: Any, dev: Any, args: list[Any], number: int = 20) -> float:
    f = ex.jit().time_evaluator("main", dev, number=number, repeat=3)
    return float(np.median(f(*args).results))


def gemm_rows(tgt: Any, dev: Any, dry: bool, shapes: list[tuple[int, int, int]]) -> None:
    import tvm

    try:
        import torch
    except ImportError:
        torch = None
    for m, n, k in shapes:
        t0 = time.perf_counter()
        ex = build_tir(matmul_func(m, n, k), tgt)
        if dry:
            row(f"GEMM fp16 {m}x{n}x{k}", "built", f"{time.perf_counter() - t0:.1f} s")
            continue
        a = np.random.default_rng(0).standard_normal((m, k)).astype("float16")
        b = np.random.default_rng(1).standard_normal((n, k)).astype("float16") * np.float16(0.05)
        ta, tb = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)
        tc = tvm.runtime.tensor(np.zeros((m, n), "float16"), dev)
        sec = time_tvm(ex, dev, [ta, tb, tc])
        ref = a.astype(np.float32) @ b.astype(np.float32).T
        err = float(np.abs(tc.numpy().astype(np.float32) - ref).max())
        tf = 2 * m * n * k / sec / 1e12
        note = f"err {err:.2e}"
        if torch is not None and torch.cuda.is_available():
            xa, xb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            for _ in range(3):
                torch.matmul(xa, xb.T)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                torch.matmul(xa, xb.T)
            end.record()
            torch.cuda.synchronize()
            tsec = start.elapsed_time(end) / 1e3 / 20
            note += f"; torch {2 * m * n * k / tsec / 1e12:.1f} TFLOP/s (PerfX/torch {tsec / sec:.2f})"
        row(f"GEMM fp16 {m}x{n}x{k}", f"{tf:.2f} TFLOP/s", note)


def gemv_rows(tgt: Any, dev: Any, dry: bool, n: int = 4096, k: int = 4096) -> None:
    import tvm

    ex = build_tir(int4_gemv_func(n, k), tgt)
    if dry:
        row(f"int4 GEMV 1x{n}x{k}", "built")
        return
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint64).astype(np.uint32)
    s = (rng.random((n, k // 32)) * 0.02).astype("float16")
    x = rng.standard_normal((1, k)).astype("float16")
    args = [tvm.runtime.tensor(a, dev) for a in (x, w, s)] + [tvm.runtime.tensor(np.zeros((1, n), "float32"), dev)]
    sec = time_tvm(ex, dev, args, number=50)
    nib = ((w[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15).reshape(n, k).astype(np.float32) - 8
    ref = (nib * np.repeat(s.astype(np.float32), 32, axis=1)) @ x[0].astype(np.float32)
    err = float(np.abs(args[3].numpy()[0] - ref).max() / max(1.0, np.abs(ref).max()))
    nbytes = w.nbytes + s.nbytes + x.nbytes + n * 4
    big = tvm.runtime.tensor(np.zeros(256 << 20, np.uint8), dev)
    dst = tvm.runtime.empty((256 << 20,), "uint8", dev)
    for _ in range(3):
        big.copyto(dst)
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(20):
        big.copyto(dst)
    dev.sync()
    copy_gbs = 2 * (256 << 20) * 20 / (time.perf_counter() - t0) / 1e9
    gbs = nbytes / sec / 1e9
    row(
        f"int4 GEMV 1x{n}x{k} (g32)",
        f"{gbs:.0f} GB/s",
        f"{sec * 1e6:.1f} us, rel err {err:.1e}; device copy {copy_gbs:.0f} GB/s ({gbs / copy_gbs:.0%})",
    )


def model_rows(model: str, target: str, work: Path, dry: bool, steps: int, quantization: str = "auto") -> None:
    from perfx_compiler.pipeline import compile_model

    def build(tgt_name: str) -> Path:
        out = work / f"model-{tgt_name}"
        if (out / "perfx-config.json").exists():  # a rerun in the same session reuses the bundle
            return out
        # float activations on the CPU too: on an AVX-512 VNNI host "auto" would pick int8 activations,
        # which the CUDA build does not use, and the comparison would measure that, not the GPU
        # and on the GPU no offline cubin: the run's own module is what gets timed
        extra = {"activations": "f32"} if tgt_name == "host" else {"cubin": False}
        return compile_model(model, tgt_name, out, progress=False, quantization=quantization, **extra)

    t0 = time.perf_counter()
    gpu_dir = build(target)
    row(f"build {model} ({quantization}) for {target}", f"{time.perf_counter() - t0:.0f} s")
    if dry:
        return
    from perfx_compiler.runtime.engine import Engine

    t0 = time.perf_counter()
    cpu_dir = build("host")
    row(f"build {model} for host", f"{time.perf_counter() - t0:.0f} s")
    tokens = [1, 422, 3011, 314, 253, 1523, 30, 216]
    gpu, cpu = Engine(gpu_dir, device="cuda"), Engine(cpu_dir)
    g = np.stack([gpu.decode(t) for t in tokens])
    c = np.stack([cpu.decode(t) for t in tokens])
    err = float(np.abs(g - c).max())
    agree = float((g.argmax(-1) == c.argmax(-1)).mean())
    row("logits cuda vs cpu", f"max |diff| {err:.2e}", f"argmax agreement {agree:.0%} over {len(tokens)} steps")
    gpu.reset()
    gpu.prefill(tokens)
    t0 = time.perf_counter()
    tok = tokens[-1]
    for _ in range(steps):
        tok = int(gpu.decode(tok).argmax())
    sec = time.perf_counter() - t0
    row("decode", f"{steps / sec:.0f} tok/s", f"{steps} greedy steps after an {len(tokens)}-token prompt")


def cuda_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU check on a CUDA device (see the module doc)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--target", default="cuda-sm90")
    ap.add_argument("--work", default="/tmp/perfx-gpu-check")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--quantization", default="auto", help="of the model builds (GPU and CPU alike)")
    ap.add_argument("--dry", action="store_true", help="build only (no GPU needed)")
    ap.add_argument("--csv", type=Path, default=None, help="append the rows to this CSV")
    args = ap.parse_args(argv)
    import tvm

    from perfx_compiler.targets import load_target

    tgt = load_target(args.target).tvm()
    dev = tvm.cuda(0)
    if not args.dry and not dev.exist:
        print("gpu_check: no CUDA device visible to TVM; use --dry to only build")
        return 1
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.csv is not None:
        import datetime

        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        device = "none (dry)" if args.dry else str(dev.device_name)
        CSV_OUT.update(path=args.csv, prefix=[stamp, args.model, args.target, device, "dry" if args.dry else "run"])
    # kernel sections first (about a minute), then the model (builds for the GPU and the CPU): a run
    # cut by the time limit still has the kernel numbers
    sections = [
        (
            "gemm",
            lambda: gemm_rows(
                tgt,
                dev,
                args.dry,
                [(128, 576, 576), (128, 1536, 576), (128, 576, 1536), (128, 49152, 576), (4096, 4096, 4096)],
            ),
        ),
        ("gemv", lambda: gemv_rows(tgt, dev, args.dry)),
        ("model", lambda: model_rows(args.model, args.target, work, args.dry, args.steps, args.quantization)),
    ]
    for name, fn in sections:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one failing section must not hide the others
            row(
                f"{name} section",
                "FAILED",
                f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else ''}",
            )
    width = max(len(r[0]) for r in ROWS)
    print("\n" + "=" * 100)
    print(f"PerfX GPU check: {args.model} on {args.target} ({'dry: build only' if args.dry else dev.device_name})")
    for what, value, note in ROWS:
        print(f"{what:<{width}}  {value:>22}  {note}")
    if args.csv is not None:
        print(f"rows appended to {args.csv}")
    return 1 if any(value == "FAILED" for _, value, _ in ROWS) else 0


# -- ptxas: registers and spills per CUDA kernel (nvcc, no GPU) ------------------------------------

HOT = ("matmul", "attention", "gemv")
FIELDS = ["model", "quantization", "target", "arch", "kernel", "hot", "adapted_cpu_kernel", "registers",
          "spill_stores", "spill_loads", "stack_bytes", "shared_bytes"]  # fmt: skip


def kernel_rows(model: str, target: str, out: Path) -> list[dict[str, object]]:
    from perfx_compiler.device_export import parse_ptxas
    from perfx_compiler.pipeline import compile_model

    if not (out / "perfx-config.json").exists():
        start = time.perf_counter()
        compile_model(model, target, out, progress=False)
        print(f"{target}: built {model} in {time.perf_counter() - start:.0f} s -> {out}", flush=True)
    manifest = json.loads((out / "perfx-config.json").read_text())
    facts = manifest["device_code"]["cubin"]
    if "error" in facts:
        raise SystemExit(f"{target}: no cubin: {facts['error']}")
    adapted = manifest["device_code"].get("adapted_cpu_kernels", [])
    stats = parse_ptxas((out / f"kernels.{facts['arch']}.ptxas.txt").read_text())
    rows = []
    for name, st in sorted(stats.items()):
        rows.append({
            "model": model, "quantization": manifest.get("quantization", ""), "target": target,
            "arch": facts["arch"], "kernel": name, "hot": any(h in name for h in HOT),
            "adapted_cpu_kernel": any(name.startswith(a) for a in adapted), **st,
        })  # fmt: skip
    return rows


def ptxas_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="registers and spills of every CUDA kernel (see the module doc)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--targets", nargs="+", default=["cuda-sm80", "cuda-sm90"])
    ap.add_argument("--csv", type=Path, default=REPO / "benchmarks" / "results" / "ptxas_sm80_sm90a.csv")
    ap.add_argument("--work", type=Path, default=Path("/tmp/perfx-ptxas"))
    args = ap.parse_args(argv)
    rows: list[dict[str, object]] = []
    for target in args.targets:
        rows += kernel_rows(args.model, target, args.work / target)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in FIELDS})
    bad = [r for r in rows if r["hot"] and (r["spill_stores"] or r["spill_loads"])]
    for target in args.targets:
        mine = [r for r in rows if r["target"] == target]
        spills = [r["kernel"] for r in mine if r["spill_stores"] or r["spill_loads"]]
        hot = [r for r in mine if r["hot"]]
        print(f"{target}: {len(mine)} kernels, {len(hot)} hot (max {max(int(r['registers']) for r in hot)} registers), "
              f"spilling: {spills or 'none'}")  # fmt: skip
    print(f"wrote {args.csv}")
    return 1 if bad else 0


# -- lavapipe: the vulkan build through the WGSL launcher -------------------------------------------

def lavapipe_main(argv: list[str] | None = None) -> int:
    from perfx_compiler import pipeline as P
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.reference import ReferenceModel
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps
    from perfx_compiler.targets_exec.webgpu import WebGPULauncher, webgpu_available

    ap = argparse.ArgumentParser(description="the vulkan build on lavapipe vs x86 (see the module doc)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 504, 3458])
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--host-build", type=Path, default=None, help="an x86 artifact of the same model (else built)")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args(argv)
    why = webgpu_available()
    if why:
        print(f"skip: {why}")
        return 2
    start = time.perf_counter()
    desc = load_model(args.model, max_context=args.max_context)
    quant = P.resolve_quantization(args.quantization, desc, load_target("vulkan"))
    options = P.CompileOptions(target="vulkan", progress=False, quantization=quant, batching=False)
    state = P.CompileState(desc=desc, target=load_target("vulkan"), options=options)
    phases = dict(P.PHASES)
    for name in ("import", "passes", "lower", "schedule"):
        phases[name](state)
    print(f"vulkan module for {args.model} ({quant}): {time.perf_counter() - start:.1f} s")
    launcher = WebGPULauncher()
    start = time.perf_counter()
    got = np.stack(run_decode_steps(state, launcher, args.tokens, state.weights))
    print(f"{len(args.tokens)} decode steps on {launcher.adapter.info['device']}: "
          f"{time.perf_counter() - start:.1f} s, {launcher.launches} WGSL launches")  # fmt: skip
    host = x86_logits(args, quant)
    ref = ReferenceModel(desc)
    want = np.stack([ref.forward([t]).reshape(-1) for t in args.tokens])
    err_x86 = float(np.abs(got - host).max())
    err_ref = float(np.abs(got - want).max())
    scale = float(np.abs(host).max())
    same = bool((got.argmax(-1) == host.argmax(-1)).all())
    print(f"max |logit - x86 build| = {err_x86:.3g}, max |logit - float64 reference| = {err_ref:.3g} "
          f"(logit scale {scale:.3g}); greedy tokens equal x86's: {same}")  # fmt: skip
    ok = err_x86 <= 1e-3 * max(scale, 1.0) and same
    if args.csv is not None:
        new = not args.csv.exists()
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("a") as f:
            if new:
                f.write("model,quantization,device,tokens,max_err_vs_x86,max_err_vs_float64,logit_scale,greedy_equal,ok\n")
            f.write(f"{args.model},{quant},{launcher.adapter.info['device']},{' '.join(map(str, args.tokens))},"
                    f"{err_x86:.3g},{err_ref:.3g},{scale:.3g},{same},{ok}\n")  # fmt: skip
    return 0 if ok else 1


def x86_logits(args: argparse.Namespace, quant: str) -> np.ndarray:
    """Decode logits of ``args.tokens`` from an x86 build of the same model and quantization."""
    import tempfile

    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    out = args.host_build
    if out is None or not (out / "perfx-config.json").exists():
        out = out or Path(tempfile.mkdtemp(prefix="perfx-x86-"))
        start = time.perf_counter()
        compile_model(args.model, "host", out, progress=False, max_context=args.max_context, quantization=quant,
                      activations="f32")  # fmt: skip  # float activations, as the WGSL kernels compute
        print(f"x86 build ({quant}): {time.perf_counter() - start:.1f} s -> {out}")
    engine = Engine(out)
    return np.stack([engine.decode(t) for t in args.tokens])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = {"ptxas": ptxas_main, "lavapipe": lavapipe_main}
    if argv and argv[0] in modes:
        return modes[argv[0]](argv[1:])
    return cuda_main(argv)


if __name__ == "__main__":
    sys.exit(main())
