"""Large GGUF weights are packed a chunk of rows at a time (``passes/gguf_passthrough._pack_in_chunks``):
for every block type the VNNI layout's arrays, written chunk by chunk, must be the bytes of the weight
packed whole, with the whole weight's N in its Packed (``formats.vnni.ROW_CHUNKS``). Row counts that are
no multiple of the layouts' row units (int4 pairs, 6-bit quads, 5-bit / 3-bit octets) pad the last
chunk only, as packing whole pads the end."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from perfx_compiler.passes import gguf_passthrough as gp

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_1"]


def _random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with finite float16 fields: every other byte pair decoded as float16 is made
    small and finite (the packers copy or convert d / dmin; NaN bits would compare unequal)."""
    per, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n, k // per * nbytes), dtype=np.uint8)
    f16 = (rng.random(raw.size // 2) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    flat = raw.reshape(-1, 2)
    bad = ~np.isfinite(flat.copy().view(np.float16)[:, 0])
    flat[bad] = f16[bad]
    return raw


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1000, 203])
def test_chunked_packing_is_the_whole_packing(monkeypatch, qtype: str, n: int) -> None:
    rng = np.random.default_rng()
    k = 512
    raw = _random_blocks(qtype, n, k, rng)
    whole = gp._pack(qtype, raw, (n, k), False, True)
    monkeypatch.setattr(gp, "PACK_CHUNK_BYTES", 1)  # chunks of ROW_CHUNKS rows: 16 for n=1000, 4 for 203
    chunked = gp._pack_in_chunks(qtype, raw, (n, k), False, True)
    assert (chunked.n, chunked.k, chunked.family, chunked.tag) == (whole.n, whole.k, whole.family, whole.tag) == (
        n, k, whole.family, whole.tag)
    assert [s for s, _ in chunked.arrays] == [s for s, _ in whole.arrays]
    for (suffix, a), (_, b) in zip(chunked.arrays, whole.arrays, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, suffix
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (qtype, suffix)
    import tvm_ffi

    assert tvm_ffi.structural_equal(chunked.compute("matmul", (1, 1)), whole.compute("matmul", (1, 1)))


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_drop_file_pages_leaves_the_data_and_copies_alone(tmp_path) -> None:
    """Chunked packing and the load's block scan drop pages of the mapped GGUF (``heap.drop_file_pages``): the
    pages leave the process's resident set, the view still reads the same bytes (they come back from the
    file), and a copy (writable) is never touched."""
    from perfx_compiler.heap import drop_file_pages

    data = np.random.default_rng().integers(0, 256, 1 << 22, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    mapped = np.asarray(memoryview(np.memmap(path, dtype=np.uint8, mode="r")._mmap)).reshape(-1, 4096)
    copy = np.array(mapped)
    assert np.array_equal(mapped, copy)
    before = _rss_file_kb()
    drop_file_pages(mapped[10:900])
    assert before - _rss_file_kb() >= 890 * 4 // 2, (before, _rss_file_kb())  # 890 pages of 4 KiB, most of them
    drop_file_pages(copy[10:900])
    assert np.array_equal(mapped.reshape(-1), data) and np.array_equal(copy.reshape(-1), data)
