"""llama.cpp's logits of every position of a token sequence, for reference checks against PerfX.

One eval of the whole sequence (``logits_all=True``), 2 threads, in a process of its own: a crash there (a
llama.cpp built with AMX segfaults on some VMs; see perfx-bench's hint) fails the caller's check instead of
ending it. Modes:

* ``default``: llama.cpp as it runs the file (int8 activations in its own blocks, fp16 KV cache);
* ``f32-weights``: an F32 copy of the file that llama.cpp dequantized itself, F32 KV cache, no flash
  attention: no step of its forward pass rounds below float32;
* ``f32-kv``: the file as it is with an F32 KV cache: against ``default``, how far llama.cpp's own two
  settings agree (the ceiling of any other engine's agreement with it).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

MODES = ("default", "f32-weights", "f32-kv")
_F32 = 0  # GGML_TYPE_F32


def llamacpp_logits(gguf: str | Path, ids: list[int], mode: str = "default", timeout: int = 600) -> np.ndarray:
    """``[len(ids), vocab]`` float64 logits from llama.cpp (llama-cpp-python) on ``gguf``."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="perfx-llamacpp-") as tmp:
        ids_file, out = Path(tmp) / "ids.npy", Path(tmp) / "logits.npy"
        np.save(ids_file, np.asarray(ids, dtype=np.int64))
        cmd = [sys.executable, "-m", "perfx_compiler.bench.llamacpp_logits", str(gguf), str(ids_file), str(out), mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp eval ({mode}) failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return np.load(out).astype(np.float64)


def _eval(path: str, ids_file: str, out_file: str, mode: str) -> None:
    import ctypes
    import os

    import llama_cpp

    kw: dict = {}
    f32_copy = None
    if mode == "f32-weights":
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.nthread, p.allow_requantize = llama_cpp.LLAMA_FTYPE_ALL_F32, 2, True
        f32_copy = out_file + ".f32.gguf"
        if llama_cpp.llama_model_quantize(path.encode(), f32_copy.encode(), ctypes.byref(p)) != 0:
            raise SystemExit("llama.cpp could not write an F32 copy")
        path, kw = f32_copy, {"type_k": _F32, "type_v": _F32, "flash_attn": False}
    elif mode == "f32-kv":
        kw = {"type_k": _F32, "type_v": _F32}
    try:
        ids = np.load(ids_file).tolist()
        n = max(512, len(ids))
        llm = llama_cpp.Llama(model_path=path, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=2, logits_all=True,
                              verbose=False, **kw)
        llm.eval(ids)
        np.save(out_file, np.asarray(llm.scores[: len(ids)], dtype=np.float32))
    finally:
        if f32_copy:
            os.remove(f32_copy)  # an F32 copy of a 135M model is 540 MB


if __name__ == "__main__":
    _eval(*sys.argv[1:5])
