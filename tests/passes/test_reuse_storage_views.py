"""ReuseStorageViews (build-phase Relax pass): fewer VM builtin calls, the same numbers."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from perfx_compiler.pipeline import vm_lowering_passes

TARGET = {"kind": "llvm"}


@tvm.script.ir_module
class Chain:
    """Static-shape chain with a two-output kernel (split), as a decode step has: the planner gives
    the intermediates a few storages; without the pass every use gets its own view."""

    @R.function
    def main(x: R.Tensor((2, 64), "float32"), w: R.Tensor((2, 64), "float32")) -> R.Tensor((2, 32), "float32"):
        with R.dataflow():
            a = R.add(x, w)
            b = R.multiply(a, w)
            c = R.add(b, x)
            d = R.multiply(c, a)
            e = R.subtract(d, w)
            f = R.split(e, 2, axis=1)
            g = R.add(f[0], f[1])
            h = R.multiply(g, g)
            out = R.add(h, f[0])
            R.output(out)
        return out


def _build(mod: tvm.IRModule, reuse: bool) -> tvm.runtime.Executable:
    # legalize, then exactly the lowering phase_build ships
    passes = [relax.transform.LegalizeOps(), *vm_lowering_passes(reuse_views=reuse)]
    return tvm.compile(mod, target=tvm.target.Target(TARGET), relax_pipeline=tvm.transform.Sequential(passes))


def _builtins(ex: tvm.runtime.Executable, func: str) -> collections.Counter:
    text = ex.mod["as_text"]() if hasattr(ex, "mod") else ex["as_text"]()
    body = next(f for f in re.split(r"\n(?=@)", text) if f.startswith(f"@{func}:"))
    return collections.Counter(ln.split()[1] for ln in body.splitlines()[1:] if ln.split()[:1] == ["call"])


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, w = x.astype(np.float64), w.astype(np.float64)
    a = x + w
    e = (a * w + x) * a - w
    f0, f1 = e[:, :32], e[:, 32:]
    g = f0 + f1
    return g * g + f0


def test_fewer_views_same_result():
    base, reuse = _build(Chain, False), _build(Chain, True)
    nb, nr = _builtins(base, "main"), _builtins(reuse, "main")
    # 9 intermediates on 2-3 planned storages: one view per distinct (storage, offset, shape)
    assert nr["vm.builtin.alloc_tensor"] < nb["vm.builtin.alloc_tensor"], (nb, nr)
    assert nr["vm.builtin.alloc_storage"] == nb["vm.builtin.alloc_storage"]
    # split's (f0, f1) tuple is only read back item by item: no make_tuple left
    assert nb["vm.builtin.make_tuple"] >= 1 and nr["vm.builtin.make_tuple"] == 0, (nb, nr)
    rng = np.random.default_rng()
    for _ in range(3):  # fresh inputs: a view that aliased a live buffer would corrupt some of them
        x = rng.standard_normal((2, 64)).astype("float32")
        w = rng.standard_normal((2, 64)).astype("float32")
        got = {}
        for name, ex in (("base", base), ("reuse", reuse)):
            vm = relax.VirtualMachine(ex, tvm.cpu())
            got[name] = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_array_equal(got["reuse"], got["base"])
        np.testing.assert_allclose(got["reuse"], _reference(x, w), rtol=1e-5, atol=1e-5)


def test_symbolic_shapes_are_left_alone():
    @tvm.script.ir_module
    class Dyn:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(("n", 8), "float32"):
            with R.dataflow():
                a = R.add(x, x)
                b = R.multiply(a, x)
                c = R.add(b, a)
                R.output(c)
            return c

    n = 5
    x = np.random.default_rng().standard_normal((n, 8)).astype("float32")
    vm = relax.VirtualMachine(_build(Dyn, True), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, (2 * x64) * x64 + 2 * x64, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tiny_model_decode_identical_with_fewer_builtins(tmp_path, monkeypatch):
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    path, _ = write_tiny_gguf(tmp_path / "m.gguf", context_length=64, arch="llama", heads=4, kv_heads=2, tied=True)
    from perfx_compiler import pipeline

    arts = {"1": compile_model(load_gguf(path), "host", tmp_path / "art1", progress=False)}
    shipped = pipeline.vm_lowering_passes  # "0": the same build with TVM's lowering (one alloc per use)
    monkeypatch.setattr(pipeline, "vm_lowering_passes", lambda reuse_views: shipped(reuse_views=False))
    arts["0"] = compile_model(load_gguf(path), "host", tmp_path / "art0", progress=False)
    counts = {f: _builtins(tvm.runtime.load_module(str(a / "model.so")), "decode") for f, a in arts.items()}
    assert counts["1"]["vm.builtin.alloc_tensor"] < counts["0"]["vm.builtin.alloc_tensor"] / 2, counts
    engines = {f: Engine(a) for f, a in arts.items()}
    ids = np.random.default_rng().integers(0, 200, size=6).tolist()
    first = {f: e.prefill(ids) for f, e in engines.items()}
    np.testing.assert_array_equal(first["1"], first["0"])
    tok = int(np.argmax(first["0"]))
    for _ in range(12):
        step = {f: e.decode(tok).copy() for f, e in engines.items()}
        np.testing.assert_array_equal(step["1"], step["0"])
        tok = int(np.argmax(step["0"]))
