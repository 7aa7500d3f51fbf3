"""perfx_compiler/narrow_index.py: kernels that allocate int64 local buffers narrow to int32 (TVM's
ForceNarrowIndexToInt32 refuses them), and no error raised while rewriting can corrupt the heap.

The tiled CPU attention kernel (SmolLM2's shape) keeps each row's query position in an int64 local buffer;
narrowed, built for the host and run on fresh random inputs it must match the float64 reference."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.targets

REPO = Path(__file__).resolve().parents[2]


def _attention_helpers():
    spec = importlib.util.spec_from_file_location("_attn_ref", REPO / "tests/schedules/test_attention_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _local_dtypes(func) -> dict[str, str]:
    import tvm_ffi
    from tvm import tirx

    found: dict[str, str] = {}
    tvm_ffi.structural_walk(
        func.body, [(tirx.AllocBuffer, lambda s: found.__setitem__(s.buffer.name, str(s.buffer.dtype)))]
    )
    return found


@pytest.mark.parametrize("body", ["tiled", "split"])
def test_attention_with_int64_local_buffer_narrows_and_matches(body: str) -> None:
    import tvm

    from perfx_compiler.kernels.attention import cached_attention_kernel
    from perfx_compiler.narrow_index import narrow_to_int32, remaining_int64
    from perfx_compiler.targets import load_target

    ref = _attention_helpers()
    H, KVH, D, MAXC = ref.H, ref.KVH, ref.D, ref.MAXC
    cfg = {"body": body, "k_tile": 32, "q_tile": 8, "lanes": 16, "splits": 4}
    func = cached_attention_kernel(H, KVH, D, MAXC, "float32", "int32", cfg)
    if body == "tiled":
        assert _local_dtypes(func)["lim"] == "int64"  # the case TVM's pass refuses
    mod = narrow_to_int32(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    assert remaining_int64(mod["main"]) == []
    assert "int64" not in _local_dtypes(mod["main"]).values()
    lib = tvm.compile(mod, load_target("host").tvm())

    rng = np.random.default_rng()
    dev = tvm.cpu()
    cos, sin = ref.rope_tables(MAXC, D)
    for seq, past in ((1, int(rng.integers(1, MAXC - 1))), (int(rng.integers(9, 40)), 0), (13, 40)):
        q = rng.standard_normal((1, seq, H * D)).astype(np.float32)
        k = rng.standard_normal((1, seq, KVH * D)).astype(np.float32)
        v = rng.standard_normal((1, seq, KVH * D)).astype(np.float32)
        kc = rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32)
        vc = rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32)
        want, wk, wv = ref.attention_reference(q, k, v, kc, vc, past, cos, sin, H, KVH)
        kct, vct = tvm.runtime.tensor(kc, dev), tvm.runtime.tensor(vc, dev)
        out = tvm.runtime.tensor(np.zeros_like(q), dev)
        args = [tvm.runtime.tensor(a, dev) for a in (q, k, v)]
        past_t = tvm.runtime.tensor(np.array([past], np.int32), dev)
        lib["main"](*args, kct, vct, past_t, tvm.runtime.tensor(cos, dev), tvm.runtime.tensor(sin, dev), out)
        for got, exp in ((out.numpy(), want), (kct.numpy(), wk), (vct.numpy(), wv)):
            assert np.abs(got - exp).max() / max(1.0, np.abs(exp).max()) < ref.TOL, (seq, past)


def test_error_inside_rewrite_leaves_heap_intact() -> None:
    """A callback error after a variable was remapped comes out as the error, and the process lives on
    (raised inside tvm_ffi's structural_map it corrupts the heap: "malloc(): unaligned tcache chunk")."""
    code = textwrap.dedent(
        """
        import numpy as np, tvm
        from tvm import tirx
        from perfx_compiler.kernels.attention import cached_attention_kernel
        from perfx_compiler.narrow_index import _map
        f = cached_attention_kernel(9, 3, 64, 1024, "float32", "int64", {"body": "tiled"})
        new = {}
        def on_var(v):
            return new.setdefault("rs", v.with_dtype("float32")) if getattr(v, "name", "") == "rs" else v
        def on_store(x):
            if x.buffer.name == "rs":
                raise TypeError("refused store")
            return x
        for _ in range(3):
            try:
                _map(f.body, [(tirx.Var, on_var), (tirx.BufferStore, on_store)])
            except TypeError as err:
                print("raised:", err)
        for i in range(200):
            tvm.runtime.tensor(np.zeros(1000 + i, np.float32))
        print("alive")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("raised: refused store") == 3 and "alive" in proc.stdout


def test_mismatched_store_width_is_found() -> None:
    """A store whose value is wider than its buffer's elements (what a remapped buffer leaves behind when
    nothing casts the value) is reported; the clean kernel has none."""
    from tvm import tirx

    from perfx_compiler.kernels.attention import cached_attention_kernel
    from perfx_compiler.narrow_index import _map, mismatched_stores

    func = cached_attention_kernel(9, 3, 64, 1024, "float32", "int64", {"body": "tiled"})
    assert mismatched_stores(func) == []
    new = {}

    def on_var(v):
        return new.setdefault("lim", v.with_dtype("int32")) if getattr(v, "name", "") == "lim" else v

    bad = func.with_body(_map(func.body, [(tirx.Var, on_var)]))
    found = mismatched_stores(bad)
    assert found and all(s.startswith("lim[") and "int64" in s for s in found)
