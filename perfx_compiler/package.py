"""Phase 5: write the artifact directory.

    model.so            compiled Relax VM executable + kernels (host library)
    weights.bin         every weight, packed in the layout the kernels read, 64-byte aligned
    tokenizer.json      `tokenizers` JSON
    perfx-config.json   manifest: model, target, functions, weight index, sha256 of every file and of itself
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from perfx_compiler.artifact_hash import MANIFEST_DIGEST_KEY, manifest_digest, sha256_file
from perfx_compiler.kernels._kv_cache import kv_dtype
from perfx_compiler.model.onnx_emit import PAGE_SIZE, cache_shape, pages_per_sequence, pool_shape
from perfx_compiler.targets import index_dtype_of

# 2: the manifest carries its own checksum (artifact_hash.manifest_digest); the runtime reads 1 and 2
FORMAT_VERSION = 2
MANIFEST = "perfx-config.json"
ALIGN = 64


def _write_weights(path: Path, weights: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    index, offset = [], 0
    with open(path, "wb") as f:
        for name, arr in weights.items():
            arr = np.ascontiguousarray(arr)
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(arr.reshape(-1).view(np.uint8))  # (not tobytes(): a copy as large as the weight)
            index.append(
                {"name": name, "shape": list(arr.shape), "dtype": str(arr.dtype), "offset": offset, "nbytes": arr.nbytes}
            )
            offset += arr.nbytes
    return index


class SpilledWeights(dict):
    """``weights.bin`` written ahead of packaging, its arrays mapped back read-only (``WeightFile.finish``)."""

    def __init__(self, arrays: dict[str, np.ndarray], path: Path, index: list[dict[str, Any]]) -> None:
        super().__init__(arrays)
        self.path, self.index = path, index


class WeightFile:
    """``weights.bin`` written while the compile runs, before packaging moves it in.

    A graph pass hands each packed array that is final to ``stage``, which appends it to the file and
    returns it mapped back read-only: the packed weights leave the heap one by one instead of all
    sitting there until the passes end (a 7B model's 3.9 GB). ``finish`` then appends the rest and
    indexes every weight in parameter order (the index holds each offset; the file's order is free).
    """

    STAGE_MIN_BYTES = 1 << 16  # smaller arrays (norms, scales of small weights) go with the rest

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115  (closed by finish or discard)
        self._offset = 0
        # (address, nbytes) of a staged view -> (its offset, the view): the view is kept so that no other array
        # can take its address while the file is written (a replaced view would otherwise pass for staged)
        self._staged: dict[tuple[int, int], tuple[int, np.ndarray]] = {}

    def _append(self, arr: np.ndarray) -> int:
        pad = (-self._offset) % ALIGN
        self._file.write(b"\0" * pad)
        start = self._offset + pad
        self._file.write(arr.reshape(-1).view(np.uint8))  # (not tobytes(): a copy as large as the weight)
        self._offset = start + arr.nbytes
        return start

    def stage(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` written now and mapped back read-only (a small one comes back as it is; a ``reserve``d one
        is in the file already)."""
        arr = np.ascontiguousarray(arr)
        if arr.nbytes < self.STAGE_MIN_BYTES:
            return arr
        if (arr.ctypes.data, arr.nbytes) in self._staged:
            return self._staged[(arr.ctypes.data, arr.nbytes)][1]
        start = self._append(arr)
        self._file.flush()
        view = np.memmap(self.path, dtype=arr.dtype, mode="r", offset=start, shape=arr.shape)
        self._staged[(view.ctypes.data, arr.nbytes)] = (start, view)
        return view

    def reserve(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An array placed in the file now (zeros) and mapped writable, for a pass that fills a large packed
        array a part at a time and drops each filled part's pages (``heap.drop_file_pages(part, written=True)``):
        the array never sits on the heap whole. ``stage`` then takes it as it is. (A small one: ``np.empty``.)"""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes < self.STAGE_MIN_BYTES:
            return np.empty(shape, dtype)
        start = self._offset + (-self._offset) % ALIGN
        self._file.flush()
        if hasattr(os, "posix_fallocate"):  # the blocks on disk now: a full disk is an OSError here, not a SIGBUS
            os.posix_fallocate(self._file.fileno(), start, nbytes)  # when a write through the map finds none
        else:
            self._file.truncate(start + nbytes)
        self._file.seek(start + nbytes)
        self._offset = start + nbytes
        view = np.memmap(self.path, dtype=dtype, mode="r+", offset=start, shape=tuple(shape))
        self._staged[(view.ctypes.data, nbytes)] = (start, view)
        return view

    def finish(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every weight in the file, mapped back read-only (``weights`` as they are when none has bytes)."""
        try:
            index, used = [], set()
            for name, arr in weights.items():
                arr = np.ascontiguousarray(arr)
                hit = self._staged.get((arr.ctypes.data, arr.nbytes)) if arr.nbytes else None
                if hit is None:
                    start = self._append(arr)
                else:
                    start = hit[0]
                    used.add(start)
                index.append({"name": name, "shape": list(arr.shape), "dtype": str(arr.dtype), "offset": start,
                              "nbytes": arr.nbytes})
            self._file.close()
            if used != {start for start, _ in self._staged.values()}:  # a staged array was replaced: no dead bytes
                self.path.unlink()
                index = _write_weights(self.path, weights)
        except BaseException:
            self.discard()  # (a full disk: no partial file left behind)
            raise
        self._staged.clear()
        if not any(e["nbytes"] for e in index):
            self.path.unlink()
            return weights
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        arrays = {e["name"]: mm[e["offset"] : e["offset"] + e["nbytes"]].view(np.asarray(weights[e["name"]]).dtype)
                  .reshape(e["shape"])
                  for e in index}
        return SpilledWeights(arrays, self.path, index)

    def discard(self) -> None:
        self._staged.clear()
        self._file.close()
        self.path.unlink(missing_ok=True)


def write_artifact(state: Any, functions: list[str]) -> Path:
    """Write ``state`` (a pipeline CompileState after build), which exports ``functions``, to
    ``state.options.output_dir``."""
    out = Path(state.options.output_dir)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        return _write_into(state, functions, tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no partial artifact behind
        raise


def _write_into(state: Any, functions: list[str], tmp: Path, out: Path) -> Path:
    from perfx_compiler import __version__
    from perfx_compiler.passes.texture_weights import texture_manifest

    desc, target = state.desc, state.target
    state.executable.export_library(str(tmp / "model.so"), **_export_kwargs(target))
    weights = state.weights
    if isinstance(weights, SpilledWeights) and weights.path.exists() and [e["name"] for e in weights.index] == list(weights):
        os.replace(weights.path, tmp / "weights.bin")  # written before codegen (WeightFile)
        weight_index = weights.index
    else:
        weight_index = _write_weights(tmp / "weights.bin", weights)
    if desc.tokenizer_json:
        (tmp / "tokenizer.json").write_text(desc.tokenizer_json)
    cfg = desc.config
    kv_cache = getattr(state.options, "kv_cache", "f32")
    manifest = {
        "format": FORMAT_VERSION,
        "perfx_version": __version__,
        "tvm_version": tvm.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": state.notes.get("model_spec", desc.source),
        "model": cfg.to_dict(),
        "chat_template": desc.chat_template,
        "target": {"name": target.name, "tvm_target": target.tvm_target, "family": target.family,
                   "host_triple": target.host_triple},
        "quantization": state.options.quantization,
        "activations": getattr(state.options, "activations", "f32"),
        "precision": getattr(state.options, "precision", "f32"),
        # the compile options the fields above do not show (LLM()'s cache key holds them all)
        "compile_options": _compile_options(state),
        # every kernel and the template that scheduled it (schedule.py; --report prints them)
        "schedules": state.notes.get("schedules", []),
        "functions": {name: name for name in functions},
        # element type of input_ids / past_len / positions / page_table (int32 on targets without i64)
        "index_dtype": index_dtype_of(target),
        "kv_cache": _kv_cache_entry(cfg, kv_cache),
        "paged_kv": {
            "page_size": PAGE_SIZE,
            "pages_per_sequence": pages_per_sequence(cfg),
            "page_shape": pool_shape(cfg, 1, kv_cache=kv_cache)[1:],
            "dtype": kv_dtype(kv_cache),
            "count": 2 * cfg.num_layers,
        },
        "weights": weight_index,
        "weight_bytes": int(sum(w["nbytes"] for w in weight_index)),
        "weight_dtypes": _weight_dtypes(weight_index),
        # image weights of the Adreno texture GEMVs (passes/texture_weights.py): upload as images
        "textures": texture_manifest(state.weights),
        "parameters": desc.parameter_count(),
        "compile_seconds": {k: round(v, 2) for k, v in state.timings.items()},
        "files": {},
    }
    from perfx_compiler.device_export import export_for_target

    manifest["device_code"] = export_for_target(state, tmp)  # kernels.* files + DEPLOY.md
    for f in sorted(tmp.iterdir()):
        manifest["files"][f.name] = sha256_file(f)
    manifest[MANIFEST_DIGEST_KEY] = manifest_digest(manifest)  # last: it covers every other key
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # the artifact appears whole or not at all
    return out


def _kv_cache_entry(cfg: Any, kv_cache: str) -> dict[str, Any]:
    """The contiguous caches (--kv-cache): shape (an int8 row is head_dim values + its float32 scale), element
    type, how many. An f32 cache's entry is the one earlier versions wrote."""
    return {"shape": cache_shape(cfg, kv_cache), "dtype": kv_dtype(kv_cache), "count": 2 * cfg.num_layers}


def _compile_options(state: Any) -> dict[str, Any]:
    """The compile options that change the artifact beyond the fields beside them: schedule source, pass
    list, tuning records, best effort, --knob values, the CUDA cubin."""
    opts = state.options
    return {
        "schedule": getattr(opts, "schedule", "perfx"),
        "passes": getattr(opts, "passes", None),  # None: the default pass list of this PerfX version
        "tuning_log": None if getattr(opts, "tuning_log", None) is None else str(opts.tuning_log),
        "tuning_records": state.notes.get("tuning_records"),  # how many records the schedule phase had
        "best_effort": getattr(opts, "best_effort", False),
        "knobs": dict(getattr(opts, "knobs", None) or {}),  # perfx-compile --knob (knobs.py)
        "cubin": getattr(opts, "cubin", True),  # CUDA targets: the nvcc-built cubin exported (--no-cubin: not)
    }


def _weight_dtypes(index: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes per stored element type (bfloat16 weights are stored as uint16 bit patterns)."""
    out: dict[str, int] = {}
    for w in index:
        dtype = "bfloat16" if w["dtype"] == "uint16" and w["name"].endswith("_bf16") else w["dtype"]
        out[dtype] = out.get(dtype, 0) + int(w["nbytes"])
    return out


def _export_kwargs(target: Any) -> dict[str, Any]:
    if target.cross_compiler:
        from tvm.support import cc

        return {"fcompile": cc.cross_compiler(target.cross_compiler)}
    # host-compiled library: link the spinning thread team its parallel loops run on (runtime/thread_team.py)
    from perfx_compiler.runtime.thread_team import link_options

    return link_options()
