"""Load an artifact and run prefill/decode on a KV cache allocated once.

Imports only TVM's runtime library through tvm_ffi (``tvm_runtime.py``: not the ``tvm`` package on
a CPU), numpy and ``perfx_compiler.errors``. The caches
are tensors created at load time; the compiled attention kernel writes new
keys/values into them in place, so a step allocates nothing but its logits.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# TVM's thread pool assumes SMT and takes half the logical CPUs (ONE thread on a 2-vCPU machine);
# it is created on first use, so size it before any kernel runs.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

from perfx_compiler import heap  # noqa: E402
from perfx_compiler.artifact_hash import MANIFEST_DIGEST_KEY, manifest_digest, sha256_file  # noqa: E402
from perfx_compiler.errors import ArtifactError, ContextLengthError  # noqa: E402
from perfx_compiler.runtime import decode_replay, thread_team  # noqa: E402
from perfx_compiler.runtime import tvm_runtime as rt  # noqa: E402

log = logging.getLogger(__name__)

MANIFEST = "perfx-config.json"
# 1: files checksummed; 2: the manifest too (artifact_hash.manifest_digest)
SUPPORTED_FORMATS = (1, 2)
# Prompts run in calls of at most this many tokens: the VM sizes its activation buffers by the call.
# Over an 8k prompt, 512-token calls peak 180 MB (TinyLlama dims) below 2048-token ones at the same
# prefill speed (each call's weight repack is small beside 512 rows): docs/decisions/long-context.md.
PREFILL_CHUNK = 512


def read_manifest(artifact_dir: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """Parse and check the manifest; with ``verify``, check every file's sha256."""
    root = Path(artifact_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{root} is not a PerfX artifact ({MANIFEST} missing); compile one with perfx-compile")
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ArtifactError(f"{path} is not valid JSON ({getattr(err, 'msg', err)}); recompile with perfx-compile") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path} is not a PerfX manifest (a JSON {type(manifest).__name__}); recompile with perfx-compile")
    fmt = manifest.get("format")
    if fmt not in SUPPORTED_FORMATS:
        raise ArtifactError(
            f"artifact format {fmt!r} is not supported by this runtime "
            f"(reads {', '.join(map(str, SUPPORTED_FORMATS))}); recompile with this PerfX version"
        )
    # Checked before anything in it is used: a changed shape, offset or digest must not reach the kernels.
    if (fmt != 1 or MANIFEST_DIGEST_KEY in manifest) and manifest.get(MANIFEST_DIGEST_KEY) != manifest_digest(manifest):
        raise ArtifactError(f"artifact file {MANIFEST} is corrupt (checksum mismatch); recompile with perfx-compile")
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        raise ArtifactError(f"{path} has no file list; recompile with perfx-compile")
    for name, digest in files.items():
        f = root / name
        if not f.is_file():
            raise ArtifactError(f"artifact file {name} is missing from {root}; recompile or copy the whole directory")
        # before the shared library is loaded: a corrupt model.so would crash the process, not raise
        if verify and sha256_file(f) != digest:
            raise ArtifactError(f"artifact file {name} is corrupt (sha256 checksum mismatch); recompile with perfx-compile")
    return manifest


def check_room(position: int, n: int, max_context: int) -> None:
    """ContextLengthError unless ``n`` more tokens after ``position`` fit ``max_context``."""
    if position + n > max_context:
        raise ContextLengthError(
            f"{position + n} tokens do not fit the context of {max_context}; "
            "shorten the prompt or compile with a larger --max-context"
        )


def token_batch(token_ids: Sequence[int] | np.ndarray, dtype: np.dtype, vocab_size: int) -> np.ndarray:
    """Token ids as the [1, n] array the compiled functions take; ValueError when empty or out of range."""
    ids = np.asarray(token_ids, dtype=dtype).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("no tokens to run")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    return ids


class Engine:
    """One sequence's prefill/decode over a preallocated KV cache."""

    def __init__(self, artifact_dir: str | Path, *, verify: bool = True, device: str = "cpu", kv_cache: bool = True):
        self.root = Path(artifact_dir)
        self.manifest = read_manifest(self.root, verify=verify)
        self.tokenizer_path = self.root / "tokenizer.json"
        model = self.manifest["model"]
        self.max_context = int(model["max_context"])
        self.vocab_size = int(model["vocab_size"])
        self.device = rt.device(device)
        self._cpu = self.device.dlpack_device_type() == rt.CPU  # tensors are host memory
        if self._cpu:
            heap.map_large_allocations()  # freed activations leave the process (see _run)
        self._pooled: tuple[str, int] | None = None  # the calls whose buffers the VM's pool holds (pool_for)
        lib = rt.load_module(self.root / "model.so")
        self.vm = rt.VirtualMachine(lib, self.device)
        # the kernels' parallel loops: PerfX's spinning team where the artifact has one, else TVM's pool
        self.thread_pool = (thread_team.install(self.root / "model.so")
                            if self._cpu else "tvm (not a CPU device)")
        self._weights = self._load_weights()
        kv = self.manifest["kv_cache"]
        zeros = np.zeros(kv["shape"] if kv_cache else [0], dtype=kv["dtype"])
        # kv_cache=False: a BatchEngine brings its own paged pool and uses only the weights.
        self._caches = [rt.tensor(zeros, self.device) for _ in range(kv["count"] if kv_cache else 0)]
        # Look the functions up once; per-step Python work stays minimal.
        fns = self.manifest["functions"]
        self._prefill = self.vm[fns["prefill"]]
        self._decode = self.vm[fns["decode"]]
        self._prefill_all = self.vm[fns["prefill_all"]]
        self._tail = [*self._caches, *self._weights]
        # ids / past_len element type the graph was compiled with (int32 on targets without i64)
        self.index_dtype = np.dtype(self.manifest.get("index_dtype", "int64"))
        self._one_token = np.zeros((1, 1), dtype=self.index_dtype)
        self._pos = np.zeros((1,), dtype=self.index_dtype)
        # Device tensors reused every step: a decode step allocates nothing but its logits.
        self._one_token_dev = rt.tensor(self._one_token, self.device)
        self._pos_dev = rt.tensor(self._pos, self.device)
        self.position = 0
        # Decode runs on arguments bound once (VM set_input + invoke_stateful): a step passes no
        # argument list (~490 tensors) and reads back only the logits, not the 61-entry result tuple.
        # On the CPU the token and position are written straight into the bound tensors (numpy
        # views over their memory) and the logits are returned as a view, not copied.
        self._decode_name = fns["decode"]
        if kv_cache:  # a BatchEngine's base (no caches) never runs decode: its arguments would not match
            self.vm.set_input(self._decode_name, self._one_token_dev, self._pos_dev, *self._tail)
        self._invoke_stateful = self.vm.invoke_stateful
        self._get_output = self.vm.get_output
        if self._cpu:
            self._token_view = np.from_dlpack(self._one_token_dev)
            self._pos_view = np.from_dlpack(self._pos_dev)
        # On the CPU, one decode step's kernel calls are recorded; decode steps replay them from C++
        # without the VM (decode_replay.py). _vm_reason: why the VM runs them (None only until decided,
        # in __init__).
        self._replay: decode_replay.DecodeReplay | None = None
        self._vm_reason: str | None = None
        if not (self._cpu and kv_cache):
            self._vm_reason = ""
        elif not decode_replay.enabled():
            self._vm_reason = "PERFX_DECODE_REPLAY=0"
        else:
            self._prepare_decode()

    @property
    def decode_path(self) -> str:
        """What runs the decode steps: ``replay (N kernels)`` or ``vm (why)`` (decided at load)."""
        if self._replay is not None:
            return f"replay ({self._replay.kernels} kernels)"
        return f"vm ({self._vm_reason})" if self._vm_reason else "vm"

    def _load_weights(self) -> list[Any]:
        arena = HugePageArena.for_weights(self.manifest["weights"]) if self._cpu else None
        self._weight_arena = arena
        if arena is not None:
            # read() straight into the arena: copying from a memory map of the file held the file's
            # pages resident next to the arena while loading (TinyLlama dims: peak RSS 1372 MB for
            # 1095 MB loaded, docs/decisions/long-context.md)
            with open(self.root / "weights.bin", "rb", buffering=0) as f:
                return [rt.from_dlpack(arena.read(f, w)) for w in self.manifest["weights"]]
        blob = np.memmap(self.root / "weights.bin", dtype=np.uint8, mode="r")
        # Adreno texture path: these weights exist only as images (passes/texture_weights.py); a GPU
        # allocates them in texture memory (not verified on a device: no TVM OpenCL runtime here)
        textures = self.manifest.get("textures", {}) if not self._cpu else {}
        out = []
        for w in self.manifest["weights"]:
            raw = blob[w["offset"] : w["offset"] + w["nbytes"]]
            arr = np.frombuffer(raw, dtype=w["dtype"]).reshape(w["shape"])
            if w["name"] in textures:
                t = rt.empty(arr.shape, arr.dtype, self.device, mem_scope="global.texture")
                rt.copy_from(t, arr)
                out.append(t)
                continue
            out.append(rt.tensor(arr, self.device))
        return out

    def reset(self) -> None:
        """Forget the sequence; the cache memory is reused (stale rows are never read)."""
        self.position = 0

    def _check_room(self, n: int) -> None:
        check_room(self.position, n, self.max_context)

    def _run(self, fn: Any, token_ids: Sequence[int] | np.ndarray, every_position: bool = False) -> np.ndarray:
        ids = token_batch(token_ids, self.index_dtype, self.vocab_size)
        n = ids.shape[1]
        self._check_room(n)
        outs = []
        for start in range(0, n, PREFILL_CHUNK):
            chunk = ids[:, start : start + PREFILL_CHUNK]  # (a [1, c] slice: contiguous)
            self.pool_for(("prefill", chunk.shape[1]))
            self._pos[0] = self.position
            rt.copy_from(self._pos_dev, self._pos)
            if chunk.shape[1] == 1:
                rt.copy_from(self._one_token_dev, chunk)
                ids_dev = self._one_token_dev
            else:
                ids_dev = rt.tensor(chunk, self.device)
            out = fn(ids_dev, self._pos_dev, *self._tail)[0]
            self.position += chunk.shape[1]
            if every_position or start + PREFILL_CHUNK >= n:  # prefill: only the last chunk's logits
                outs.append(rt.to_numpy(out)[0])
        return np.concatenate(outs) if every_position else outs[-1]

    def pool_for(self, call: tuple[str, int]) -> None:
        """Before a VM call of another kind or size than the last (``call``: its function and rows): drop
        the buffers the VM's allocator pooled for the last one. The pool keeps every buffer it gets back,
        keyed by size, and a call's activations are sized by its rows, so each new prompt length or batch
        size would add its own set for good (a server with varied requests grew by hundreds of MiB:
        docs/decisions/long-context.md). Buffers a tensor still holds (the decode replay's) stay."""
        if self._cpu and call != self._pooled:
            rt.clear_pool()
            self._pooled = call

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run tokens (in calls of at most ``PREFILL_CHUNK``); return the last position's logits as [1, vocab]."""
        return self._run(self._prefill, token_ids)

    def prefill_all(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run tokens (in calls of at most ``PREFILL_CHUNK``); return logits of every position [len, vocab]."""
        return self._run(self._prefill_all, token_ids, every_position=True)

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token; return its logits [vocab] (valid until the caller drops them; not reused)."""
        tok = int(token_id)
        if not 0 <= tok < self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        self._check_room(1)
        if self._cpu:
            self._token_view[0, 0] = tok
            self._pos_view[0] = self.position
            if self._replay is not None:
                self._replay.run()
                self.position += 1
                return self._replay.logits.copy()  # the replay rewrites this buffer every step
        else:
            self._one_token[0, 0] = tok
            self._pos[0] = self.position
            rt.copy_from(self._one_token_dev, self._one_token)
            rt.copy_from(self._pos_dev, self._pos)
        logits = self._vm_decode_step()
        self.position += 1
        # A view keeps the VM's output buffer alive, so the next step allocates a fresh one.
        return (np.from_dlpack(logits) if self._cpu else rt.to_numpy(logits))[0, 0]

    def decode_greedy(self, token_id: int, max_tokens: int, stop_ids: Iterable[int] = ()) -> list[int]:
        """Greedy decoding: feed ``token_id``, then each step's argmax, for up to ``max_tokens`` steps;
        stop after a token in ``stop_ids``. Returns the tokens (the same as ``decode`` + ``np.argmax``
        per step). With the decode replay the steps run in one C++ loop (no Python, no logits copy
        between steps); else through ``decode``."""
        tok, n = int(token_id), int(max_tokens)
        if not 0 <= tok < self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        self._check_room(n)
        stops = {int(t) for t in stop_ids}
        out: list[int] = []
        while len(out) < n:
            replay = self._replay
            if replay is not None and replay.greedy is not None:
                got = replay.greedy(self._token_view.ctypes.data, self._token_view.dtype.itemsize == 8,
                                    self._pos_view.ctypes.data, self._pos_view.dtype.itemsize == 8,
                                    replay.logits.ctypes.data, replay.logits.shape[0], tok, self.position,
                                    n - len(out), sorted(stops))
                out += [int(t) for t in got]
                self.position += len(got)
                break
            tok = int(np.argmax(self.decode(tok)))
            out.append(tok)
            if tok in stops:
                break
        return out

    def _vm_decode_step(self) -> Any:
        """One decode step by the VM on the bound arguments; its logits tensor [1, 1, vocab]."""
        self._invoke_stateful(self._decode_name)
        return self._get_output(self._decode_name, 0)

    def keep_vm_decode(self, reason: str = "asked") -> None:
        """Run every later decode step through the VM (for tools that hook the VM's calls)."""
        self._replay, self._vm_reason = None, reason

    def _prepare_decode(self) -> None:
        """Record the decode step at load: the replay loop's build (seconds on a new machine), the VM's
        traced step and the replayed check are one-time setup, which must not land in the first timed
        decode step of a run. The step decodes token 0 at position 0 (its KV row is rewritten by the
        next prefill); the record is replayed once on the same token and position and kept only if
        its logits are the VM's, bit for bit."""
        self._token_view[0, 0] = 0
        self._pos_view[0] = 0
        logits, replay = decode_replay.record(self.vm, self._vm_decode_step)
        got = np.from_dlpack(logits)[0, 0].copy()
        if isinstance(replay, str):
            self._vm_reason = replay
            return
        replay.run()
        if np.array_equal(replay.logits, got):
            self._replay = replay
        else:
            self._vm_reason = "the replayed step differed from the VM's"
            log.warning("decode replay disabled: its logits differ from the VM's")


class HugePageArena:
    """Arrays in one private anonymous mapping advised ``MADV_HUGEPAGE`` before its first touch, so
    that the kernel backs it with 2 MiB pages where transparent huge pages are allowed (``madvise``
    mode, the usual default). The engine keeps a CPU artifact's weights in one: a decode step streams
    every weight once, and on 4 KiB pages one core's stream was capped by the pages it walks
    (docs/decisions/runtime.md). Where ``madvise`` has no huge-page advice: one allocation per weight.
    Arrays start at multiples of ``align`` bytes from the mapping's first 2 MiB boundary."""

    HUGE = 2 << 20

    def __init__(self, nbytes: int, align: int = 4096) -> None:
        import mmap

        self.align = align
        # private: a shared anonymous mapping is shmem, whose huge pages follow shmem_enabled (often never)
        self.mm = mmap.mmap(-1, nbytes + self.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.off = (-self.buf.ctypes.data) % self.HUGE

    @staticmethod
    def span(nbytes: int, align: int = 4096) -> int:
        """Bytes an array of ``nbytes`` takes in an arena of that alignment."""
        return -(-nbytes // align) * align

    @classmethod
    def for_weights(cls, weights: list[dict[str, Any]]) -> HugePageArena | None:
        import mmap

        if not hasattr(mmap, "MADV_HUGEPAGE") or not weights:
            return None
        return cls(sum(cls.span(int(w["nbytes"])) for w in weights))

    def read(self, f: Any, w: dict[str, Any]) -> np.ndarray:
        """Manifest weight ``w`` read from the open weights file ``f`` into the arena (its first touch)."""
        nbytes = int(w["nbytes"])
        out = self.buf[self.off : self.off + nbytes]
        f.seek(int(w["offset"]))
        view = memoryview(out)
        done = 0
        while done < nbytes:  # readinto may return less than asked
            got = f.readinto(view[done:])
            if not got:
                raise ArtifactError(f"artifact file weights.bin ends inside weight {w['name']}; recompile with perfx-compile")
            done += got
        self.off += self.span(nbytes, self.align)
        return out.view(w["dtype"]).reshape(w["shape"])
