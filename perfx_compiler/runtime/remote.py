"""A compiled artifact's prefill and decode on a device reached through TVM RPC (a phone, a board, a
remote GPU box): the host uploads ``model.so`` and the weights once, the device runs the Relax VM.

TVM's VM copies every tensor argument that arrives over RPC (the remote side receives a DLTensor,
which it cannot share), so the KV caches cannot be written in place across calls as the local
``Engine`` does: each call's updated caches come back as remote handles (the functions' outputs
after the logits) and are passed to the next call. The copies make a remote step slower than a
deployed one, so speed is not measured through steps: ``time_call`` times a function on the device
(``time_evaluator`` of the VM's ``invoke_stateful``), with no network round trip in the number.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler.errors import ArtifactError
from perfx_compiler.runtime.engine import PREFILL_CHUNK, check_room, read_manifest, token_batch


class RemoteEngine:
    """One sequence's prefill/decode on ``device`` of an RPC ``session``."""

    def __init__(self, artifact_dir: str | Path, session: Any, device: Any, *, verify: bool = True) -> None:
        import tvm.runtime
        from tvm.runtime.vm import VirtualMachine

        self.root = Path(artifact_dir)
        self.manifest = read_manifest(self.root, verify=verify)
        if self.manifest.get("textures"):
            raise ArtifactError(f"{self.root} keeps weights as OpenCL images, which TVM's VM cannot take over "
                                "RPC (it copies remote arguments into plain buffers); time its kernels over RPC with "
                                "perfx-tune --rpc-tracker, or run the bundle on the device (DEPLOY.md)")
        model = self.manifest["model"]
        self.max_context, self.vocab_size = int(model["max_context"]), int(model["vocab_size"])
        self.index_dtype = np.dtype(self.manifest.get("index_dtype", "int64"))
        self.functions = self.manifest["functions"]
        self.device = device
        self._arity: dict[str, int] = {}
        # named by content: a server that keeps its folder between sessions never loads a stale library
        remote_name = f"perfx-{self.manifest.get('manifest_sha256', 'model')[:16]}.so"
        session.upload(str(self.root / "model.so"), remote_name)
        self.vm = VirtualMachine(session.load_module(remote_name), device)
        blob = np.memmap(self.root / "weights.bin", dtype=np.uint8, mode="r")
        self._weights = [
            tvm.runtime.tensor(np.frombuffer(blob[w["offset"] : w["offset"] + w["nbytes"]], dtype=w["dtype"])
                               .reshape(w["shape"]), device)
            for w in self.manifest["weights"]
        ]
        self.reset()

    def reset(self) -> None:
        """Forget the sequence: fresh zero caches on the device."""
        import tvm.runtime

        kv = self.manifest["kv_cache"]
        zeros = np.zeros(kv["shape"], dtype=kv["dtype"])
        self._caches = [tvm.runtime.tensor(zeros, self.device) for _ in range(kv["count"])]
        self.position = 0

    def _bind(self, name: str, ids: np.ndarray, position: int) -> None:
        import tvm.runtime

        pos = np.array([position], dtype=self.index_dtype)
        self.vm.set_input(name, tvm.runtime.tensor(ids, self.device), tvm.runtime.tensor(pos, self.device),
                          *self._caches, *self._weights)

    def _call(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Run ``name`` on ``ids`` at the current position; keep its updated caches; its logits."""
        self._bind(name, ids, self.position)
        self.vm.invoke_stateful(name)
        if name not in self._arity:  # one round trip per function, not per step
            self._arity[name] = int(self.vm._get_output_arity(name))
        arity = self._arity[name]
        if arity != 1 + len(self._caches):
            raise ArtifactError(f"{name} returns {arity} values, not logits + {len(self._caches)} caches; "
                                "recompile with this PerfX version")
        self._caches = [self.vm._get_output(name, i) for i in range(1, arity)]
        logits = self.vm._get_output(name, 0).numpy()
        self.position += ids.shape[1]
        return logits

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run tokens (in calls of at most ``PREFILL_CHUNK``); the last position's logits as [1, vocab]."""
        ids = token_batch(token_ids, self.index_dtype, self.vocab_size)
        check_room(self.position, ids.shape[1], self.max_context)
        for start in range(0, ids.shape[1], PREFILL_CHUNK):
            logits = self._call(self.functions["prefill"], np.ascontiguousarray(ids[:, start : start + PREFILL_CHUNK]))
        return logits[0]

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token; its logits [vocab]."""
        ids = token_batch([token_id], self.index_dtype, self.vocab_size)
        check_room(self.position, 1, self.max_context)
        return self._call(self.functions["decode"], ids)[0, 0]

    def time_call(self, phase: str, tokens: int, position: int, number: int, repeat: int = 1) -> list[float]:
        """Seconds per call of ``phase`` ("decode" or "prefill") on ``tokens`` tokens written at
        ``position``, timed on the device: ``repeat`` means of ``number`` calls after one warm-up call.
        Every call rewrites the same cache rows, so each does the work of that step of a sequence."""
        if phase not in ("decode", "prefill") or (phase == "decode" and tokens != 1):
            raise ValueError(f"cannot time {phase} of {tokens} tokens")
        check_room(position, tokens, self.max_context)
        name = self.functions[phase]
        self._bind(name, np.zeros((1, tokens), dtype=self.index_dtype), position)
        timer = self.vm.time_evaluator("invoke_stateful", self.device, number=number, repeat=repeat)
        return [float(s) for s in timer(name).results]
