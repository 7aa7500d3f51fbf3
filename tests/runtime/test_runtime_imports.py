"""The thin runtime must import without the compiler, ONNX or TVM's frontends.

Each check runs in a fresh interpreter whose meta-path refuses the blocked
packages, so an accidental top-level ``import onnx`` (or of the compiler) fails loudly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BLOCKED = [
    "onnx",
    "onnxruntime",
    "perfx_compiler.pipeline",
    "perfx_compiler.model",
    "perfx_compiler.frontend",
    "perfx_compiler.passes",
    "perfx_compiler.tune",
    "tvm.relax.frontend",
]

LIGHT_MODULES = [
    "perfx_compiler",
    "perfx_compiler.runtime.api",
    "perfx_compiler.llm",
    "perfx_compiler.runtime.generate",
    "perfx_compiler.runtime.sampling",
    "perfx_compiler.runtime.chat",
    "perfx_compiler.cli.run",
]

PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys

    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"blocked import of {{name}} (the thin runtime must not need it)")
            return None

    sys.meta_path.insert(0, Block())
    for m in {modules!r}:
        importlib.import_module(m)
    print(json.dumps(sorted(sys.modules)))
    """
)


def probe(modules: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = PROBE.format(blocked=BLOCKED, modules=modules)
    return subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_runtime_modules_import_without_compiler() -> None:
    r = probe(LIGHT_MODULES)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = set(__import__("json").loads(r.stdout))
    # Importing the API is cheap: TVM loads with the engine, jinja2 with the first chat prompt.
    assert "tvm" not in loaded
    assert "jinja2" not in loaded


def test_engine_imports_without_compiler() -> None:
    if not (REPO / "perfx_compiler" / "runtime" / "engine.py").exists():
        pytest.skip("perfx_compiler/runtime/engine.py is not written yet")
    r = probe(["perfx_compiler.runtime.engine", *LIGHT_MODULES])
    assert r.returncode == 0, (
        "engine must import with the compiler blocked; note that a plain `import tvm` pulls in "
        "tvm.relax.frontend unless TVM_USE_RUNTIME_LIB=1 is set first\n" + r.stderr[-3000:]
    )


def test_engine_import_leaves_child_processes_a_compiler() -> None:
    """The engine loads TVM's runtime-only library through TVM_USE_RUNTIME_LIB; a compile started as a
    child process afterwards (perfx-bench, a user's script) must not inherit it, or its ``import
    tvm.relax`` fails with an AttributeError from TVM's FFI."""
    script = textwrap.dedent(
        """
        import os, subprocess, sys
        import perfx_compiler.runtime.engine  # noqa: F401
        assert "TVM_USE_RUNTIME_LIB" not in os.environ, os.environ["TVM_USE_RUNTIME_LIB"]
        child = subprocess.run([sys.executable, "-c", "import tvm.relax"], capture_output=True, text=True)
        assert child.returncode == 0, child.stderr[-2000:]
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("module", ["perfx_compiler.runtime.engine", "perfx_compiler.pipeline"])
def test_tvm_import_leaves_torch_out_and_importable(module: str) -> None:
    """tvm_ffi imports torch when it is installed (~200 MB resident, ~1.5 s); the engine's runtime-only
    TVM import and the compiler's (perfx-compile's peak RSS) hide it, and torch imports normally afterwards."""
    pytest.importorskip("torch")
    script = textwrap.dedent(
        f"""
        import sys
        import {module}  # noqa: F401
        assert "tvm_ffi" in sys.modules and "torch" not in sys.modules, "importing TVM loaded torch"
        import torch
        assert torch.zeros(2).sum().item() == 0.0
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_compiler_after_runtime_in_one_process() -> None:
    """On the CPU the engine imports no ``tvm`` package (tvm_ffi and TVM's runtime library alone), so the
    compiler imports after it in one process and both run. A non-CPU device imports TVM runtime-only (its
    device backends); importing the compiler then is one clear ImportError naming the fix, not an
    AttributeError from deep inside tvm.relax. The other order works."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)

    cpu = run("import sys, perfx_compiler.runtime.engine\nassert 'tvm' not in sys.modules\n"
              "import perfx_compiler.pipeline, tvm\nprint(tvm.runtime.tensor([1.0, 2.0]).numpy().sum())")
    assert cpu.returncode == 0 and cpu.stdout.strip() == "3.0", cpu.stderr[-2000:]
    gpu = "import perfx_compiler.runtime.engine\nfrom perfx_compiler.runtime import tvm_runtime\ntvm_runtime.device('opencl')\n"
    # every compiler-side package a script may import on its own, not only the pipeline
    for module in ("perfx_compiler.pipeline", "perfx_compiler.passes.fuse_add_norm", "perfx_compiler.tune.session",
                   "perfx_compiler.frontend.onnx_import", "schedules.gemv_qvnni_cpu"):
        late = run(f"{gpu}import {module}")
        assert late.returncode != 0, module
        last = late.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError:") and "import perfx_compiler.pipeline before perfx_compiler.runtime" in last, (
            module, late.stderr[-2000:])
    early = run("import perfx_compiler.pipeline\nimport perfx_compiler.runtime.engine\nprint('ok')")
    assert early.returncode == 0 and early.stdout.strip() == "ok", early.stderr[-2000:]
