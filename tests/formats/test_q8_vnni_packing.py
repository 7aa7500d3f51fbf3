"""Q8_0 in the VNNI layout (``formats/vnni.py``): packed from a view of the GGUF blocks' code bytes
(no int8 [N, K] copy), each weight's byte is its code + 128 and its scale the block's float16, checked
against gguf-py's dequantization of the same random blocks, widths that are and are not a multiple of
the kernels' 64-column step included (padding columns must hold 128: weight 0)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from perfx_compiler.bench.ggml_mul_mat import random_blocks
from perfx_compiler.formats.gguf_blocks import packed_from_blocks
from perfx_compiler.formats.vnni import padded_k


@pytest.mark.parametrize("shape", [(33, 96), (64, 640), (7, 32), (16, 1056)])
def test_q8_vnni_packing_matches_gguf_py(shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_blocks("Q8_0", n, k, np.random.default_rng())
    pk = packed_from_blocks("Q8_0", raw, shape, vnni=True)
    (_, codes), (_, scale) = pk.arrays
    assert codes.shape == (n, padded_k(k)) and pk.n == n and pk.k == k
    assert (codes[:, k:] == 128).all()
    w = (codes[:, :k].astype(np.float64) - 128) * scale[:n, : k // 32].astype(np.float64).repeat(32, axis=1)
    ref = gguf_dequantize(raw, GGMLQuantizationType.Q8_0).reshape(n, k).astype(np.float64)
    np.testing.assert_array_equal(w, ref)
