"""arm64-neon: the cross-compiled whole model runs under qemu-aarch64 with the aarch64 TVM runtime
from PyPI's wheels, and its logits match the x86 build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS

pytestmark = pytest.mark.targets


def test_arm64_whole_model_under_qemu(tiny_gguf: Path, tmp_path: Path, host_logits) -> None:
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.targets_exec.qemu import qemu_missing, run_decode_qemu

    why = qemu_missing("aarch64")
    if why:
        pytest.skip(why)
    out = compile_model(str(tiny_gguf), "arm64-neon", tmp_path / "a64", progress=False, max_context=MAX_CONTEXT)
    got = run_decode_qemu(out, TOKENS, tmp_path / "work")
    err = np.abs(got - host_logits).max()
    assert err < 1e-4, f"arm64 logits differ from x86 by {err}"
    assert (got.argmax(-1) == host_logits.argmax(-1)).all()


def test_arm64_gemma3_under_qemu(gemma3_folder: Path, tmp_path: Path, gemma3_host_logits) -> None:
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.targets_exec.qemu import qemu_missing, run_decode_qemu

    why = qemu_missing("aarch64")
    if why:
        pytest.skip(why)
    out = compile_model(str(gemma3_folder), "arm64-neon", tmp_path / "a64", progress=False, max_context=MAX_CONTEXT,
                        activations="f32")
    got = run_decode_qemu(out, TOKENS, tmp_path / "work")
    err = np.abs(got.reshape(gemma3_host_logits.shape) - gemma3_host_logits).max()
    assert err < 1e-4, f"arm64 Gemma 3 logits differ from x86 by {err}"


def test_arm64_iq4_xs_file_under_qemu(tmp_path: Path) -> None:
    """The float-activation bit-plane kernels on NEON, on a tiny file llama.cpp's own quantizer made in
    IQ4_XS (IQ4 indices looked up with ``tbl``; its mix keeps some matrices in other K-quants): the
    arm64 logits match the x86 build of the same file (``pshufb``)."""
    from perfx_compiler.bench.models import llama_quantize
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine
    from perfx_compiler.targets_exec.qemu import qemu_missing, run_decode_qemu

    why = qemu_missing("aarch64")
    if why:
        pytest.skip(why)
    f32, _ = write_tiny_gguf(tmp_path / "f32.gguf", qtype="F32", hidden=256, ffn=512, heads=4, kv_heads=2,
                             vocab=320, tied=False, context_length=128, seed=7)
    gguf = llama_quantize(f32, tmp_path / "iq4_xs.gguf", "IQ4_XS")
    host = compile_model(str(gguf), "host", tmp_path / "host", progress=False, max_context=MAX_CONTEXT,
                         activations="f32")
    engine = Engine(host)
    want = np.stack([engine.decode(t) for t in TOKENS])
    out = compile_model(str(gguf), "arm64-neon", tmp_path / "a64", progress=False, max_context=MAX_CONTEXT)
    got = run_decode_qemu(out, TOKENS, tmp_path / "work")
    err = np.abs(got.reshape(want.shape) - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"arm64 IQ4_XS logits differ from x86 by {err}"
