"""formats/ggml quantizers vs llama.cpp's own (``ggml_quantize_chunk`` of the llama-cpp-python build:
without an importance matrix it runs quantize_row_q4_K_ref / quantize_row_q6_K_ref): random float weights, quantized both
ways, dequantized by gguf-py. The numpy port accumulates every sum left to right in float32 as the C
code does, so the blocks come out bit for bit the same; the test reports the fraction and holds the
error to llama.cpp's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from perfx_compiler.formats import ggml
from perfx_compiler.formats.ggml import q4_k, q5_k, q6_k


@pytest.fixture(scope="module")
def ggml_quantize_chunk():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from perfx_compiler.bench.ggml_mul_mat import ggml

    fn = ggml().quantize_chunk  # llama-cpp-python's libggml, typed once there

    def quantize(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        w = np.ascontiguousarray(w, dtype=np.float32)
        n, k = w.shape
        block, nbytes = GGML_QUANT_SIZES[qtype]
        out = np.zeros((n, k // block * nbytes), dtype=np.uint8)
        fn(int(qtype), w.ctypes.data, out.ctypes.data, 0, n, k, None)  # no imatrix: the *_ref quantizer
        return out

    return quantize


def realistic_weights(shape: tuple[int, int]) -> np.ndarray:
    """normal * 0.02 with ~0.05% outliers (x20), an all-zero and a constant superblock, an all-zero sub-block."""
    rng = np.random.default_rng()  # fresh per run (tests/conftest.py prints the seed)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    at = rng.choice(w.size, size=max(1, w.size // 2000), replace=False)
    w.flat[at] *= np.float32(20)
    w[0, :256] = 0
    w[1, 256:512] = np.float32(0.01)
    w[-1, 16:32] = 0  # one all-zero sub-block
    return w


def rmse(qtype: GGMLQuantizationType, raw: np.ndarray, w: np.ndarray) -> float:
    return float(np.sqrt(np.mean((gguf_dequantize(raw, qtype).reshape(w.shape).astype(np.float64) - w) ** 2)))


MODULES = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
QUANTIZERS = {qtype: mod.quantize for qtype, mod in MODULES.items()}


@pytest.mark.parametrize("qtype", sorted(QUANTIZERS))
@pytest.mark.parametrize("shape", [(64, 2048), (3, 256)])
def test_quantize_matches_llamacpp(qtype: str, shape: tuple[int, int], ggml_quantize_chunk) -> None:
    qt = GGMLQuantizationType[qtype]
    nbytes = GGML_QUANT_SIZES[qt][1]
    w = realistic_weights(shape)
    got = QUANTIZERS[qtype](w)
    want = ggml_quantize_chunk(w, qt)
    assert got.shape == want.shape and got.dtype == np.uint8
    same = float((got.reshape(-1, nbytes) == want.reshape(-1, nbytes)).all(axis=1).mean())
    ours, theirs = rmse(qt, got, w), rmse(qt, want, w)
    print(f"{qtype} {shape}: {same:.1%} of blocks identical to llama.cpp's; RMSE {ours:.6g} vs llama.cpp {theirs:.6g}")
    assert ours <= theirs * 1.01
    assert same >= 0.9
    # the unpacked arrays the kernels read reproduce gguf-py's dequantization bit for bit
    np.testing.assert_array_equal(ggml.dequantize(qtype, got, shape), gguf_dequantize(got, qt).reshape(shape))


@pytest.mark.parametrize("qtype", sorted(QUANTIZERS))
def test_row_chunks_do_not_change_blocks(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w = realistic_weights((5, 512))
    whole = QUANTIZERS[qtype](w)
    monkeypatch.setattr(MODULES[qtype], "CHUNK_WEIGHTS", 1024)  # 2 rows at a time
    np.testing.assert_array_equal(QUANTIZERS[qtype](w), whole)


@pytest.mark.parametrize("qtype", sorted(QUANTIZERS))
def test_rejects_partial_superblocks(qtype: str) -> None:
    with pytest.raises(ValueError, match="256"):
        QUANTIZERS[qtype](np.zeros((2, 384), dtype=np.float32))


def test_compiled_searches_are_the_numpy_references() -> None:
    """Q4_K's scale / min search and Q6_K's scale search compiled (kernels/kquant_search.py, what q4_k.quantize
    and q6_k.quantize run) give the numpy references' scales, mins and codes bit for bit (signed zeros
    included), flat and zero groups too."""
    from perfx_compiler.kernels import kquant_search

    if not kquant_search.compiled():
        pytest.skip("the compiled search runs on x86 hosts (elsewhere q4_k.quantize runs the reference)")
    compiled, compiled_qx = kquant_search.make_qkx2_quants, kquant_search.make_qx_quants
    w = realistic_weights((45, 1024)).reshape(45, 4, 8, 32)  # 1440 groups: not a multiple of LANES
    w[2, 1, 3] = np.float32(-0.5)  # a flat group below zero
    weights = np.sqrt(q4_k.seqsum(w * w) / np.float32(32))[..., None] + np.abs(w)
    want = q4_k.make_qkx2_quants(w, weights, 15, -1.0, 0.1, 20)
    got = compiled(w, weights, 15, -1.0, 0.1, 20)
    want += q4_k.make_qkx2_quants(w, weights, 31, -0.5, 0.1, 15)  # Q5_K's search
    got += compiled(w, weights, 31, -0.5, 0.1, 15)
    # and Q6_K's (make_qx_quants: groups of 16, an all-zero one and a sign tie for the largest |x| too)
    x = realistic_weights((45, 1024)).reshape(45, 4, 16, 16)
    x[3, 2, 5, :2] = np.float32([0.3, -0.3])
    want += q6_k.make_qx_quants(x, 32)
    got += compiled_qx(x, 32)
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(a.view(np.uint32) if a.dtype == np.float32 else a,
                              b.view(np.uint32) if b.dtype == np.float32 else b)


@pytest.mark.parametrize("qtype", sorted(MODULES))
def test_quantizer_blocks_are_the_same_with_either_search(qtype: str) -> None:
    """``quantize(w, compiled=True)`` (the search kernel) and ``compiled=False`` (the numpy reference) write the
    same blocks byte for byte: the benchmark's numpy arm times the same work."""
    from perfx_compiler.kernels import kquant_search

    if not kquant_search.compiled():
        pytest.skip("the compiled search runs on x86 hosts")
    w = realistic_weights((24, 512))
    w[5] = 0.0  # an all-zero row: every block's scales zero
    assert np.array_equal(MODULES[qtype].quantize(w, compiled=True), MODULES[qtype].quantize(w, compiled=False))
