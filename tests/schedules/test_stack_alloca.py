"""perfx_cpu TIR pipeline: small static scratch buffers become stack allocas, results unchanged."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm.script import tirx as T  # noqa: E402

from perfx_compiler.stack_alloca import MAX_STACK_BYTES, register_pipeline  # noqa: E402


@T.prim_func
def _kernel(A: T.Buffer((256,), "float32"), B: T.Buffer((256,), "float32"), C: T.Buffer((4096,), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    acc = T.alloc_buffer((16,))  # outside the parallel loop, read inside it
    big = T.alloc_buffer((4096,))  # 16 KiB: above the stack limit, stays in the workspace pool
    for i in range(16):
        acc[i] = A[i] * T.float32(3.0)
    for t in T.parallel(16):
        loc = T.alloc_local((16,))  # per task
        for i in range(16):
            loc[i] = A[t * 16 + i] * T.float32(2.0) + acc[i]
        for i in range(16):
            B[t * 16 + i] = loc[i] + T.float32(1.0)
    for i in range(4096):
        big[i] = A[i % 256] + T.float32(i)
    for i in range(4096):
        C[i] = big[4095 - i]


def _build(pipeline: str):
    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    return tvm.tirx.build(tvm.IRModule({"main": _kernel}), tgt, pipeline=pipeline)


def _workspace_calls(lib) -> int:
    return lib.inspect_source("ll").count("call ptr %TVMBackendAllocWorkspace") + lib.inspect_source("ll").count(
        "@TVMBackendAllocWorkspace("
    )


def test_small_scratch_on_stack_and_results_equal() -> None:
    assert MAX_STACK_BYTES < 4096 * 4
    rng = np.random.default_rng(0)
    a = rng.standard_normal(256).astype("float32")
    ref_b = (a.reshape(16, 16) * 2 + a[:16] * 3 + 1).reshape(-1)
    ref_c = (a[np.arange(4096) % 256] + np.arange(4096, dtype=np.float64)).astype("float32")[::-1]
    outs = {}
    for name in ("default", register_pipeline()):
        lib = _build(name)
        b = tvm.runtime.tensor(np.zeros(256, "float32"))
        c = tvm.runtime.tensor(np.zeros(4096, "float32"))
        lib["main"](tvm.runtime.tensor(a), b, c)
        np.testing.assert_allclose(b.numpy(), ref_b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(c.numpy(), ref_c, rtol=1e-6, atol=1e-3)
        ll = lib.inspect_source("ll")
        outs[name] = ll.count("TVMBackendAllocWorkspace")
    # default: acc, loc and big go through the pool; perfx_cpu: only big (above the limit)
    assert outs["perfx_cpu"] < outs["default"], outs
    assert outs["perfx_cpu"] > 0, outs


def test_tuner_and_sweeps_build_with_the_artifact_pipeline() -> None:
    """The tuner's and the sweeps' kernel builds (measure.build_func, sweep._compile) lower small
    scratch as the artifact build does (perfx_cpu): they time the code the artifact runs."""
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.measure import build_func
    from perfx_compiler.tune.sweep import _compile

    target = load_target("x86-avx2")
    want = {name: _build(name).inspect_source("ll").count("TVMBackendAllocWorkspace")
            for name in ("default", register_pipeline())}
    assert want["perfx_cpu"] < want["default"], want
    for build in (build_func, _compile):
        assert build(_kernel, target).inspect_source("ll").count("TVMBackendAllocWorkspace") == want["perfx_cpu"]


@pytest.mark.parametrize("body", ["split", "rows", "tiled"])
def test_attention_scratch_where_it_is_fast(body: str) -> None:
    """The rows and split attention bodies keep their vector scratch in the workspace pool (as allocas
    LLVM scalarized their accumulators: the decode body ran 5x slower); their scalars and the tiled
    body's scratch go on the stack, where they are faster."""
    from tvm import tirx

    from perfx_compiler.kernels._attention_common import ROWS_SCRATCH
    from perfx_compiler.kernels.attention import cached_attention_kernel
    from perfx_compiler.narrow_index import _map
    from perfx_compiler.stack_alloca import ANNOTATION, stack_small_allocs_pass

    cfg = {"split": {"body": "split", "k_tile": 64, "splits": 2, "lanes": 16},
           "rows": {"body": "rows", "k_tile": 64, "lanes": 16},
           "tiled": {"body": "tiled", "k_tile": 32, "q_tile": 16, "heads_per_task": 3, "key_block": 2, "lanes": 16}}[body]
    mod = tvm.IRModule({"main": cached_attention_kernel(9, 3, 64, 256, config=cfg)})
    placed: dict[str, set[bool]] = {}

    def seen(stmt):
        stacked = stmt.annotations is not None and ANNOTATION in stmt.annotations
        placed.setdefault(str(stmt.buffer.name), set()).add(stacked)
        return stmt

    _map(stack_small_allocs_pass()(mod)["main"].body, [(tirx.AllocBuffer, seen)])
    pooled = {n for n, s in placed.items() if s == {False}}
    if body == "tiled":
        assert not pooled & set(ROWS_SCRATCH) and len(pooled) < len(placed) // 2, placed
    else:
        assert {"qr", "sc", "racc", "st"} <= pooled <= set(ROWS_SCRATCH), placed
        assert placed["kh"] == {True}  # a scalar: on the stack
