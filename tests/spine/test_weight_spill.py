"""The packed weights go to disk during the graph passes (``package.WeightFile``), so neither the passes'
nor codegen's peak lands on top of them: the GGUF passthrough and the quantizing passes stage each packed
array as it is packed, the rest follow when the passes end. The artifact's ``weights.bin`` is that file
moved in place, holding every weight as writing it at packaging gives (in another order when arrays were
staged, with no bytes that no weight uses), and no weights file is left behind, neither by a compile nor
by one that fails."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler import pipeline
from perfx_compiler.errors import PerfXError
from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.package import SpilledWeights, WeightFile, _write_weights


def test_spilled_weights_are_the_artifacts_and_leave_nothing(tmp_path, monkeypatch):
    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_0", vocab=320, seed=int(np.random.default_rng().integers(1 << 30)))
    desc = load_gguf(gguf)
    seen = {}
    orig = pipeline.phase_build

    def build(state):  # what the later phases see: the weights mapped from the spill file
        seen["weights"] = state.weights
        orig(state)

    monkeypatch.setattr(pipeline, "PHASES", [(n, build if n == "build" else f) for n, f in pipeline.PHASES])
    out = pipeline.compile_model(desc, "host", tmp_path / "art", progress=False)
    weights = seen["weights"]
    assert isinstance(weights, SpilledWeights) and weights
    assert all(not a.flags.writeable for a in weights.values())
    again = tmp_path / "again.bin"
    _write_weights(again, {n: np.array(a) for n, a in weights.items()})
    assert again.read_bytes() == (out / "weights.bin").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.bin", "art", "m.gguf"]

    def fail(state):
        raise PerfXError("codegen failed")

    monkeypatch.setattr(pipeline, "PHASES", [(n, fail if n == "build" else f) for n, f in pipeline.PHASES])
    with pytest.raises(PerfXError, match="codegen failed"):
        pipeline.compile_model(desc, "host", tmp_path / "art2", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.bin", "art", "m.gguf"]


def _artifact_weights(out) -> dict[str, bytes]:
    import json

    blob = (out / "weights.bin").read_bytes()
    index = json.loads((out / "perfx-config.json").read_text())["weights"]
    return {e["name"]: blob[e["offset"] : e["offset"] + e["nbytes"]] for e in index}


@pytest.mark.parametrize(("qtype", "quantization"), [("Q4_K", "gguf"), ("F16", "q4_k")])
def test_quantizing_passes_stage_packed_weights_while_packing(tmp_path, monkeypatch, qtype, quantization):
    """Every packed array of the GGUF passthrough and of a quantizing pass (each hands its weights to
    ``_quantized_linears.finalized``) is staged (threshold lowered to 0
    for this tiny model) and the artifact's weights are, name by name, the bytes an unstaged compile writes;
    the file has no dead bytes."""
    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype=qtype, vocab=320, hidden=256, ffn=512, seed=int(np.random.default_rng().integers(1 << 30)))
    desc = load_gguf(gguf)
    plain = pipeline.compile_model(desc, "host", tmp_path / "plain", progress=False, quantization=quantization)
    staged: list[tuple[int, ...]] = []
    stage = WeightFile.stage

    def spy(self, arr):
        staged.append(np.shape(arr))
        return stage(self, arr)

    monkeypatch.setattr(WeightFile, "STAGE_MIN_BYTES", 0)
    monkeypatch.setattr(WeightFile, "stage", spy)
    out = pipeline.compile_model(desc, "host", tmp_path / "staged", progress=False, quantization=quantization)
    assert len(staged) >= 7, staged  # q|k|v, o, gate|up, down per layer and the embedding / head
    assert _artifact_weights(out) == _artifact_weights(plain)
    assert (out / "weights.bin").stat().st_size == (plain / "weights.bin").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "plain", "staged"]


def test_weight_file_leaves_no_dead_bytes(tmp_path):
    """A staged array that no final weight uses (a later pass replaced it) is not kept in the file."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((64, 300)).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    wf = WeightFile(tmp_path / "w.bin")
    dropped = wf.stage(rng.standard_normal((64, 300)).astype(np.float32))
    kept = wf.stage(a)
    assert not dropped.flags.writeable and np.array_equal(kept, a)
    weights = wf.finish({"a": kept, "b": b})
    _write_weights(tmp_path / "ref.bin", {"a": a, "b": b})
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert np.array_equal(weights["a"], a) and np.array_equal(weights["b"], b)


def test_chunked_packing_fills_reserved_arrays_in_the_file(tmp_path, monkeypatch):
    """A weight packed a chunk of rows at a time (``gguf_passthrough._pack_in_chunks``) fills arrays that
    ``WeightFile.reserve`` placed in the weights file, chunk by chunk: the artifact holds, name by name, the
    bytes of a compile that packs each weight whole, and the file is no larger (nothing written twice)."""
    from perfx_compiler.passes import gguf_passthrough

    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_K", vocab=320, hidden=256, ffn=512,
                              seed=int(np.random.default_rng().integers(1 << 30)))
    desc = load_gguf(gguf, lazy=True)  # (mapped blocks: what a large file gets, and what is packed in chunks)
    monkeypatch.setattr(WeightFile, "STAGE_MIN_BYTES", 0)
    plain = pipeline.compile_model(desc, "host", tmp_path / "plain", progress=False)
    reserved: list[tuple[int, ...]] = []
    reserve = WeightFile.reserve

    def spy(self, shape, dtype):
        reserved.append(tuple(shape))
        return reserve(self, shape, dtype)

    monkeypatch.setattr(WeightFile, "reserve", spy)
    monkeypatch.setattr(gguf_passthrough, "PACK_CHUNK_BYTES", 1)  # chunks of ROW_CHUNKS rows: every weight chunked
    out = pipeline.compile_model(desc, "host", tmp_path / "chunked", progress=False)
    assert any(s[0] >= 320 for s in reserved), reserved  # the 320-row embedding / head at least
    assert _artifact_weights(out) == _artifact_weights(plain)
    assert (out / "weights.bin").stat().st_size == (plain / "weights.bin").stat().st_size


def test_dropping_written_pages_keeps_the_writes(tmp_path):
    """``drop_file_pages(view, written=True)`` on a filled part of a shared writable mapping (what
    ``WeightFile.reserve`` gives) takes its pages out of the resident set and the bytes read back the same,
    from the page cache; on a private copy-on-write mapping or a heap array it does nothing (dropping those
    pages would lose the writes)."""
    from perfx_compiler.heap import drop_file_pages

    def rss_file_kb() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))

    data = np.random.default_rng().integers(0, 256, (1024, 4096), dtype=np.uint8)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * data.nbytes)
    shared = np.memmap(path, dtype=np.uint8, mode="r+", shape=data.shape)
    shared[:] = data
    before = rss_file_kb()
    drop_file_pages(shared[10:900], written=True)
    assert before - rss_file_kb() >= 890 * 4 // 2, (before, rss_file_kb())  # 890 pages of 4 KiB, most of them
    assert np.array_equal(shared, data)
    del shared
    assert np.array_equal(np.fromfile(path, dtype=np.uint8).reshape(data.shape), data)
    private = np.memmap(path, dtype=np.uint8, mode="c", shape=data.shape)
    private[:] = 7
    heap = np.full(data.shape, 7, dtype=np.uint8)
    drop_file_pages(private[10:900], written=True)
    drop_file_pages(heap[10:900], written=True)
    assert (private == 7).all() and (heap == 7).all()


def test_a_full_disk_while_reserving_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """``WeightFile.reserve`` takes the disk blocks up front (``posix_fallocate``): a full disk is the compile's
    one-line error, with no artifact or weights file left, not a SIGBUS when a write through the map finds none."""
    import errno
    import os

    from perfx_compiler.passes import gguf_passthrough

    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate on this platform")
    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_K", vocab=320, hidden=256, ffn=512,
                              seed=int(np.random.default_rng().integers(1 << 30)))
    desc = load_gguf(gguf, lazy=True)

    def disk_full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(WeightFile, "STAGE_MIN_BYTES", 0)
    monkeypatch.setattr(gguf_passthrough, "PACK_CHUNK_BYTES", 1)
    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    with pytest.raises(PerfXError, match="No space left on device") as err:
        pipeline.compile_model(desc, "host", tmp_path / "art", progress=False)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
