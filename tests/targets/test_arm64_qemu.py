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
