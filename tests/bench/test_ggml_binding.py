"""perfx_compiler/bench/ggml_mul_mat.py (``benchmarks/kernels.py ggml``): ggml's mul_mat through ctypes on llama-cpp-python's libggml
(plain and CPU_REPACK weights) and PerfX's VNNI kernels built from the same GGUF blocks, each against
float64 (gguf-py's dequantize of the blocks @ x). A wrong struct layout, type id or row order is off by
O(1) of max |y|; int8 activations stay under 1e-2."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.bench import ggml_mul_mat as _ggml
from tests._cpu import needs_vnni

gguf = pytest.importorskip("gguf")
TOL = 2e-2


try:
    _ggml.lib_dir()
except RuntimeError:
    pytest.skip("llama-cpp-python (with its libggml) is not installed", allow_module_level=True)


def _case(qtype: str, n: int, k: int, m: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = _ggml.random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    return raw, x, x.astype(np.float64) @ w.T


def _err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("qtype", sorted(_ggml.BLOCKS))
@pytest.mark.parametrize("m", [1, 5])
def test_ggml_mul_mat_matches_float64(qtype: str, m: int) -> None:
    n, k = 24, 512
    raw, x, ref = _case(qtype, n, k, m)
    for repack in (False, True) if _ggml.repacked(qtype) else (False,):
        mm = _ggml.MulMat(qtype, raw, n, k, m, copies=2, repack=repack)
        try:
            mm.set_x(x)
            for _ in range(2):  # both weight copies
                mm()
                assert _err(mm.output(), ref) <= TOL, (qtype, m, repack, mm.pos)
        finally:
            mm.close()


def test_ggml_rejects_wrong_byte_count() -> None:
    raw, _, _ = _case("Q4_K", 8, 256, 1)
    with pytest.raises(ValueError, match="bytes"):
        _ggml.MulMat("Q4_K", raw[:, :-1], 8, 256, 1)


@needs_vnni
@pytest.mark.parametrize("qtype,m", [("Q4_K", 1), ("Q6_K", 1), ("Q8_0", 7), ("Q4_0", 1)])
def test_perfx_kernel_on_the_same_blocks(qtype: str, m: int) -> None:
    from perfx_compiler.targets import load_target

    n, k = 48, 512  # N % 16 == 0: the GEMM's condition (else prefill dequantizes)
    raw, x, ref = _case(qtype, n, k, m, seed=1)
    pk, rt, label = _ggml.perfx_kernel(qtype, raw, n, k, m, load_target("host"), None)
    assert label.startswith("gemv_qvnni_cpu default" if m == 1 else "gemm_qvnni_cpu default")
    call, out = _ggml.perfx_call(pk, rt, x, n, copies=2)
    call()
    assert _err(out(), ref) <= TOL, qtype
