"""perfx_compiler/kernels/memo.py: a kernel builder parses once per distinct argument set, and a different
argument (a dict's item, a PrimFunc's body) always builds again."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.kernels import memo


def _counting_builder():
    calls: list[tuple] = []

    @memo.memoized_kernel
    def build(n: int, config: dict | None = None, func=None):
        calls.append((n, config))
        if n < 0:
            raise ValueError("bad n")
        return object()

    return build, calls


def test_same_arguments_build_once_and_others_build_again() -> None:
    build, calls = _counting_builder()
    a = build(4, config={"x": 1, "y": [2, 3]})
    assert build(4, config={"y": [2, 3], "x": 1}) is a  # a dict keyed by its items, in any order
    assert build(4, config={"x": 1, "y": [2, 4]}) is not a
    assert build(5, config={"x": 1, "y": [2, 3]}) is not a
    assert build(4) is not a and build(4) is build(4)
    assert len(calls) == 4
    with pytest.raises(ValueError):
        build(-1)
    with pytest.raises(ValueError):  # a builder that raised is not remembered: it runs (and raises) again
        build(-1)
    memo.clear()
    assert build(4, config={"x": 1, "y": [2, 3]}) is not a


def test_unkeyable_arguments_go_through_uncached() -> None:
    build, calls = _counting_builder()
    thing = np.zeros(3)
    assert build(1, func=thing) is not build(1, func=thing)
    assert len(calls) == 2


def test_tvm_arguments_are_keyed_by_structure() -> None:
    """Two PrimFuncs parsed apart but structurally equal share a build; a different body does not."""
    import tvm_ffi
    from tvm.script import tirx as T

    def scaled(factor: float):
        @T.prim_func
        def f(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
            for i in range(8):
                B[i] = A[i] * T.float32(factor)

        return f

    build, calls = _counting_builder()
    one, again, other = scaled(2.0), scaled(2.0), scaled(3.0)
    assert one is not again and tvm_ffi.structural_equal(one, again)
    assert build(1, func=one) is build(1, func=again)
    assert build(1, func=other) is not build(1, func=one)
    assert len(calls) == 2


def test_a_real_kernel_is_parsed_once_and_shared() -> None:
    import tvm_ffi

    from perfx_compiler.kernels.rms_norm import rms_norm_kernel

    memo.clear()
    first = rms_norm_kernel(64, 1e-6, False, 8)
    assert rms_norm_kernel(64, 1e-6, False, 8) is first
    assert rms_norm_kernel(64, 1e-5, False, 8) is not first  # eps is baked into the kernel
    memo.clear()
    rebuilt = rms_norm_kernel(64, 1e-6, False, 8)
    assert rebuilt is not first and tvm_ffi.structural_equal(rebuilt, first)


def test_kernels_are_kept_on_disk_between_processes(tmp_path, monkeypatch) -> None:
    """A kernel built from plain arguments is written to ``$PERFX_KERNEL_CACHE/<code version>`` and, once the
    process forgets it (``clear``: what a new process starts from), read back from there: the file is what
    the builder returns (a different kernel planted in it comes back), a truncated file is built again and
    replaced, and ``none`` keeps nothing on disk."""
    import gzip

    import tvm
    import tvm_ffi

    from perfx_compiler.kernels.rms_norm import rms_norm_kernel

    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path))
    memo.clear()
    built = rms_norm_kernel(48, 1e-6, False, 8)
    files = list((tmp_path / memo.code_version()).glob("*.json.gz"))
    assert len(files) == 1
    memo.clear()
    loaded = rms_norm_kernel(48, 1e-6, False, 8)
    assert loaded is not built and tvm_ffi.structural_equal(loaded, built)
    other = rms_norm_kernel(64, 1e-5, True, 16)
    files[0].write_bytes(gzip.compress(tvm.ir.save_json(other).encode()))
    memo.clear()
    assert tvm_ffi.structural_equal(rms_norm_kernel(48, 1e-6, False, 8), other)  # read from the file
    files[0].write_bytes(files[0].read_bytes()[:40])  # truncated
    memo.clear()
    assert tvm_ffi.structural_equal(rms_norm_kernel(48, 1e-6, False, 8), built)
    assert tvm_ffi.structural_equal(tvm.ir.load_json(gzip.decompress(files[0].read_bytes()).decode()), built)
    monkeypatch.setenv(memo.CACHE_ENV, "none")
    memo.clear()
    rms_norm_kernel(80, 1e-6, False, 8)
    assert len(list((tmp_path / memo.code_version()).glob("*.json.gz"))) == 2  # (the two above; not the third)


def test_a_changed_template_source_is_a_new_code_version(tmp_path, monkeypatch) -> None:
    """The disk cache's folder changes when any source file of the ``schedules`` templates changes (and with
    this package's, targets and tuning records: ``artifact_hash.compiler_digest``, which ``code_version``
    hashes): a kernel built by older template code is never read back."""
    from perfx_compiler import artifact_hash

    (tmp_path / "schedules").mkdir()
    (tmp_path / "schedules" / "gemv_cpu.py").write_text("UNROLL = 4\n")
    real = artifact_hash.compiler_digest
    monkeypatch.setattr(artifact_hash, "compiler_digest", lambda: real(tmp_path))
    memo.code_version.cache_clear()
    try:
        first = memo.code_version()
        (tmp_path / "schedules" / "gemv_cpu.py").write_text("UNROLL = 8\n")
        memo.code_version.cache_clear()
        changed = memo.code_version()
        (tmp_path / "schedules" / "gemv_cpu.py").write_text("UNROLL = 4\n")
        memo.code_version.cache_clear()
        assert changed != first and memo.code_version() == first
    finally:
        memo.code_version.cache_clear()


def test_a_call_with_tvm_arguments_is_read_back_only_for_equal_arguments(tmp_path, monkeypatch) -> None:
    """``attention_over_qkv(kernel)`` is keyed on disk by the kernel's structural hash; its file keeps that
    kernel too, and is used only when the call's kernel is structurally equal to it (a file whose stored
    argument differs, as a hash collision would, is built again)."""
    import gzip

    import tvm
    import tvm_ffi

    from perfx_compiler.kernels.attention import cached_attention_kernel
    from perfx_compiler.kernels.attention_qkv import attention_over_qkv

    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path))
    memo.clear()
    kernel = cached_attention_kernel(4, 2, 64, 128)
    built = attention_over_qkv(kernel)
    (path,) = [p for p in (tmp_path / memo.code_version()).glob("*.json.gz")
               if isinstance(tvm.ir.load_json(gzip.decompress(p.read_bytes()).decode()), tvm_ffi.Array)]
    memo.clear()
    assert tvm_ffi.structural_equal(attention_over_qkv(kernel), built)
    other = cached_attention_kernel(4, 4, 64, 128)
    path.write_bytes(gzip.compress(tvm.ir.save_json(tvm_ffi.convert([other, other])).encode()))
    memo.clear()
    assert tvm_ffi.structural_equal(attention_over_qkv(kernel), built)  # not `other`: its argument differs


def test_a_cache_folder_that_cannot_be_written_builds_in_memory(tmp_path, monkeypatch) -> None:
    """``$PERFX_KERNEL_CACHE`` naming something that is not a writable folder (here a file) costs the disk
    cache, never the build."""
    import tvm_ffi

    from perfx_compiler.kernels.rms_norm import rms_norm_kernel

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv(memo.CACHE_ENV, str(blocker))
    memo.clear()
    got = rms_norm_kernel(112, 1e-6, False, 8)
    monkeypatch.setenv(memo.CACHE_ENV, "none")
    memo.clear()
    assert tvm_ffi.structural_equal(got, rms_norm_kernel(112, 1e-6, False, 8))
    assert blocker.read_text() == "x"
