"""Device code and deployment notes in the artifact, for targets whose runtime is not in the wheel.

The PyPI TVM wheel runs x86 CPU and CUDA code; for OpenCL, WebGPU/Vulkan and ROCm it only
generates code. :func:`export_device_code` writes what the compiler produced into the bundle so it
can be inspected, checked and deployed:

    kernels.cl                  OpenCL C (adreno, mali, intel-igpu)
    kernels.cu                  CUDA C;  kernels.<arch>.cubin + kernels.<arch>.ptxas.txt with nvcc
    kernels.<mcpu>.hsaco/.s     AMDGPU code object and assembly (ROCm)
    kernels.wgsl                WGSL (vulkan via WebGPU)
    DEPLOY.md                   target, host, files, runtime needed, known limits

:func:`prepare_build_env` points TVM at the toolchains it needs (ROCm bitcode + ld.lld) before build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("PERFX_TARGETS_CACHE", Path.home() / ".cache" / "perfx-targets"))


# Code objects TVM's ROCm build linked in this process (the hip module cannot write them back out).
_HSACO: list[bytes] = []


def _capture_rocm_link() -> None:
    """Wrap TVM's ``tvm_callback_rocm_link`` (object file -> hsaco bytes) to keep a copy of each code object."""
    import tvm

    original = tvm.get_global_func("tvm_callback_rocm_link", allow_missing=True)
    if original is None or getattr(original, "_perfx_capture", False):
        return

    def link(obj: Any) -> Any:
        out = original(obj)
        _HSACO.append(bytes(out))
        return out

    link._perfx_capture = True  # type: ignore[attr-defined]
    tvm.register_global_func("tvm_callback_rocm_link", link, override=True)


def prepare_build_env(target: Any) -> None:
    """ROCm: TVM needs $ROCM_PATH/amdgcn/bitcode and an ld.lld >= 19 (tests/setup.sh makes one)."""
    if target.tvm_target.get("kind") != "rocm":
        return
    _HSACO.clear()
    _capture_rocm_link()
    if os.environ.get("ROCM_PATH"):
        return
    cached = CACHE / "rocm"
    if (cached / "amdgcn" / "bitcode").exists() and (cached / "bin" / "ld.lld").exists():
        os.environ["ROCM_PATH"] = str(cached)
        os.environ["PATH"] = f"{cached / 'bin'}:{os.environ.get('PATH', '')}"


def device_modules(module: Any) -> list[Any]:
    """Every imported module below ``module`` whose kind is not a host kind."""
    out: list[Any] = []
    stack = list(module.imports)
    while stack:
        m = stack.pop(0)
        try:
            kind = m.kind
        except Exception:  # noqa: BLE001 - a module without a kind is not device code
            kind = ""
        if kind not in ("llvm", "c", "library", "static_library", "relax.VMExecutable", ""):
            out.append(m)
        stack.extend(m.imports)
    return out


def nvcc_cubin(cuda_src: str, arch: str, out_dir: Path, stem: str = "kernels", timeout: int = 600) -> dict[str, Any]:
    """Compile CUDA C to a cubin with ``nvcc -Xptxas -v``; return {"cubin", "log", "kernels": {name: stats}}."""

    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
    if nvcc is None:
        return {"error": "nvcc not found"}
    cu = out_dir / f"{stem}.cu"
    if not cu.exists():
        cu.write_text(cuda_src)
    cubin = out_dir / f"{stem}.{arch}.cubin"
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-o", str(cubin), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    (out_dir / f"{stem}.{arch}.ptxas.txt").write_text(log)
    if proc.returncode != 0:
        return {"error": f"nvcc failed ({proc.returncode}): {log[-2000:]}", "log": log}
    return {"cubin": str(cubin), "log": log, "kernels": parse_ptxas(log)}


def export_device_code(executable: Any, target: Any, out_dir: Path, cubin: bool = True) -> dict[str, Any]:
    """Write the device code files of ``executable`` into ``out_dir``; return manifest facts.
    ``cubin``: CUDA artifacts also get the nvcc-built cubin (perfx-compile --no-cubin: without)."""

    facts: dict[str, Any] = {"files": []}
    tt = target.tvm_target
    for m in device_modules(executable.mod):
        kind = m.kind
        if kind == "opencl":
            (out_dir / "kernels.cl").write_text(dedup_opencl(m.inspect_source()))
            facts["files"].append("kernels.cl")
        elif kind == "cuda":
            src = m.inspect_source()
            (out_dir / "kernels.cu").write_text(src)
            facts["files"].append("kernels.cu")
            if cubin:
                arch = str(tt.get("arch", "sm_80"))
                res = nvcc_cubin(src, arch, out_dir)
                if "cubin" in res:
                    facts["files"] += [Path(res["cubin"]).name, f"kernels.{arch}.ptxas.txt"]
                    spills = {
                        k: v for k, v in res["kernels"].items() if v.get("spill_stores", 0) or v.get("spill_loads", 0)
                    }
                    facts["cubin"] = {
                        "arch": arch,
                        "kernels": len(res["kernels"]),
                        "kernels_with_spills": sorted(spills),
                    }
                else:
                    facts["cubin"] = {"arch": arch, "error": res.get("error", "")[:500]}
        elif kind in ("rocm", "hip"):

            mcpu = str(tt.get("mcpu", "gfx"))
            asm = m.inspect_source("asm")
            (out_dir / f"kernels.{mcpu}.s").write_text(asm)
            facts["files"].append(f"kernels.{mcpu}.s")
            if _HSACO:
                (out_dir / f"kernels.{mcpu}.hsaco").write_bytes(_HSACO[-1])
                facts["files"].append(f"kernels.{mcpu}.hsaco")
            stats = parse_amdgpu_asm(asm)
            facts["amdgpu"] = {
                "mcpu": mcpu,
                "kernels": len(stats),
                "max_vgpr": max((v["vgpr"] for v in stats.values()), default=0),
                "kernels_with_scratch": sorted(k for k, v in stats.items() if v["scratch_bytes"]),
            }
        elif kind in ("webgpu", "vulkan"):
            (out_dir / "kernels.wgsl").write_text(m.inspect_source())
            facts["files"].append("kernels.wgsl")
    return facts


def write_deploy_md(state: Any, out_dir: Path, device_facts: dict[str, Any]) -> None:
    """DEPLOY.md: what was built and what running it on the target needs."""
    t = state.target
    raw = t.raw or {}
    host = t.host or t.tvm_target
    lines = [
        f"# Deploying this PerfX build: {t.name}",
        "",
        f"{t.description}",
        "",
        f"- TVM target: `{t.tvm_target}`",
        f"- host code: `{host.get('mtriple', t.host_triple)}` ({t.cross_compiler or 'native compiler'})",
        f"- model: {state.notes.get('model_spec', '')}, KV cache {state.desc.config.max_context} positions",
        f"- memory bandwidth {t.memory_bandwidth_gbs} GB/s, fp32 peak {t.peak_gflops_fp32} GFLOP/s (public figures)",
        "",
        "## Files",
        "",
        "- `model.so`: host code (Relax VM executable) with the device kernels embedded",
        "- `weights.bin`, `perfx-config.json`, `tokenizer.json`: weights, manifest (sha256 of every file), tokenizer",
    ]
    for f in device_facts.get("files", []):
        lines.append(f"- `{f}`: device code exported for inspection / offline checks")
    lines += ["", "## Runtime needed on the device", "", raw.get("packaging", "the apache-tvm runtime for the host")]
    if "cubin" in device_facts:
        c = device_facts["cubin"]
        if "error" in c:
            lines += ["", f"nvcc cubin build failed: {c['error']}"]
        else:
            lines += [
                "",
                f"cubin ({c['arch']}): {c['kernels']} kernels, with register spills: {c['kernels_with_spills'] or 'none'}",
            ]
    lines += _texture_lines(state)
    adapted = state.notes.get("gpu_host_kernels_adapted") or []
    if adapted:
        from perfx_compiler.gpu_adapt import adapted_note

        lines += ["", "## Known limits", "", adapted_note(adapted)]
    if raw.get("notes"):
        lines += ["", "## Target notes", "", raw["notes"]]
    lines += [
        "",
        "## Tune on the device",
        "",
        "Register the device with a TVM RPC tracker (TVM's Android RPC app, or `python -m tvm.exec.rpc_server "
        "--tracker HOST:9190 --key KEY` on a board or GPU box), then on the build machine:",
        "",
        f"    perfx-tune MODEL --target {t.name} --rpc-tracker HOST:9190 --rpc-key KEY --rpc-parallel N",
        "",
        "and rebuild this bundle: the records go to `tuning_logs/" + t.name + "/` (docs/tuning.md, \"Tuning on "
        "devices over TVM RPC\"). Then time this bundle's decode and prefill on the device, from the build "
        "machine (the weights are uploaded once; timed on the device, no network round trip counted):",
        "",
        "    perfx-bench THIS_FOLDER --rpc-tracker HOST:9190 --rpc-key KEY",
    ]
    lines += [
        "",
        "## Run",
        "",
        "```python",
        "from perfx_compiler.runtime.engine import Engine",
        f"engine = Engine('.', device='{_device_name(t)}')",
        "logits = engine.prefill([1, 2, 3])",
        "```",
        "",
    ]
    (out_dir / "DEPLOY.md").write_text("\n".join(lines))


def _texture_lines(state: Any) -> list[str]:
    """DEPLOY.md section on the image weights of the texture path (passes/texture_weights.py)."""
    from perfx_compiler.passes.texture_weights import texture_manifest

    tex = texture_manifest(state.weights)
    if not tex:
        return []
    fmts = sorted({v["format"] for v in tex.values()})
    return [
        "",
        "## Image (texture) weights",
        "",
        f"{len(tex)} weights are stored only as OpenCL images ({', '.join(fmts)}; "
        "`image2d_array_t`, read with a nearest, unnormalized sampler; uint32 images with `read_imageui`). "
        "They are the parameters named `*__tex`, packed at compile time as [layers, height, width, 4]: "
        "matrix row n is texel row n % height of layer n // height. Allocate each as an image, not a buffer "
        "(TVM runtime: `tvm.runtime.empty(shape, dtype, dev, mem_scope=\"global.texture\")`, then copy the "
        "array in); the manifest's `textures` entry gives format, width, height, layers and what a texel "
        "holds. There is no buffer copy: decode's GEMVs, the prefill and batched (paged) GEMMs and the "
        "gather of a tied embedding all read these images.",
    ]


def _device_name(target: Any) -> str:
    kind = target.tvm_target.get("kind")
    return {"llvm": "cpu", "webgpu": "webgpu", "opencl": "opencl", "cuda": "cuda", "rocm": "rocm"}.get(kind, "cpu")


def export_for_target(state: Any, out_dir: Path) -> dict[str, Any]:
    """Package hook: device code (GPU targets) + DEPLOY.md (every non-x86-host target and GPUs)."""
    facts: dict[str, Any] = {"files": []}
    if state.target.family == "gpu":
        facts = export_device_code(state.executable, state.target, out_dir,
                                   cubin=getattr(state.options, "cubin", True))
        # hand-scheduled CPU kernels bound to the device as they are (gpu_adapt): correct, not tuned
        facts["adapted_cpu_kernels"] = sorted(state.notes.get("gpu_host_kernels_adapted") or [])
    write_deploy_md(state, out_dir, facts)
    return facts


def parse_ptxas(log: str) -> dict[str, dict[str, Any]]:
    """ptxas -v output -> {kernel: {registers, spill_stores, spill_loads, shared_bytes, stack_bytes}}."""
    out: dict[str, dict[str, Any]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            out.setdefault(
                current, {"registers": 0, "spill_stores": 0, "spill_loads": 0, "shared_bytes": 0, "stack_bytes": 0}
            )
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            out[current]["shared_bytes"] = int(m.group(1))
    return out


def parse_amdgpu_asm(asm: str) -> dict[str, dict[str, int]]:
    """AMDGPU assembly -> {kernel: {vgpr, sgpr, spill_vgpr, spill_sgpr, lds_bytes}} from the .amdhsa metadata."""
    out: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"\.amdhsa_kernel (\S+)(.*?)\.end_amdhsa_kernel", asm, re.S):
        body = m.group(2)

        def field(name: str, body: str = body) -> int:
            f = re.search(rf"\.amdhsa_{name}\s+(\d+)", body)
            return int(f.group(1)) if f else 0

        out[m.group(1)] = {
            "vgpr": field("next_free_vgpr"),
            "sgpr": field("next_free_sgpr"),
            "lds_bytes": field("group_segment_fixed_size"),
            "scratch_bytes": field("private_segment_fixed_size"),
        }
    for name, stats in out.items():
        sp = re.search(rf"{re.escape(name)}.*?; ScratchSize: (\d+)", asm, re.S)
        if sp:
            stats["scratch_bytes"] = max(stats["scratch_bytes"], int(sp.group(1)))
    return out


def dedup_opencl(src: str) -> str:
    """OpenCL's inspect_source emits one "// Function: NAME" chunk per kernel (and, in some TVM
    versions, the whole program once per kernel): keep the first chunk of every kernel name."""
    parts = re.split(r"(?m)^(?=// Function: )", src)
    seen: set[str] = set()
    out = []
    for part in parts:
        m = re.match(r"// Function: (\S+)", part)
        if m is not None:
            if m.group(1) in seen:
                continue
            seen.add(m.group(1))
        out.append(part)
    return "".join(out)
