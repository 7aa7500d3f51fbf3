"""Many sequences over one paged KV pool, decoded together in one batched step.

The pool (one K and one V tensor per layer, [pages, page_size, kv_heads,
head_dim]) is allocated once; sequences own lists of pages handed out from a
free list and returned the moment a sequence ends. ``decode`` runs every
listed sequence's next token in a single call of the compiled ``paged_decode``
function, so the linear layers run as small-M GEMMs instead of B GEMVs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from perfx_compiler.errors import ArtifactError, ContextLengthError, KVCacheFullError
from perfx_compiler.runtime.engine import Engine, tvm


class BatchEngine:
    def __init__(
        self, artifact_dir: str | Path, *, verify: bool = True, num_pages: int | None = None, max_batch: int = 16
    ):
        # Reuse the single-sequence loader for module, weights and manifest checks.
        self._base = Engine(artifact_dir, verify=verify, kv_cache=False)
        self.manifest = self._base.manifest
        if "paged_decode" not in self.manifest["functions"]:
            raise ArtifactError("this artifact has no batched functions; recompile it with batching enabled")
        self.tokenizer_path = self._base.tokenizer_path
        self.max_context = self._base.max_context
        self.vocab_size = self._base.vocab_size
        paged = self.manifest["paged_kv"]
        self.page_size = int(paged["page_size"])
        self.index_dtype = self._base.index_dtype  # ids / positions / page table (the manifest's index_dtype)
        self.pages_per_sequence = int(paged["pages_per_sequence"])
        self.max_batch = max_batch
        self.num_pages = num_pages or max_batch * self.pages_per_sequence
        dev = self._base.device
        zeros = np.zeros([self.num_pages, *paged["page_shape"]], dtype=paged["dtype"])
        self._pools = [tvm.runtime.tensor(zeros, dev) for _ in range(paged["count"])]
        self._tail = [*self._pools, *self._base._weights]
        self._prefill = self._base.vm[self.manifest["functions"]["paged_prefill"]]
        self._decode = self._base.vm[self.manifest["functions"]["paged_decode"]]
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}
        self._next_id = 0

    # -- bookkeeping -------------------------------------------------------------------------
    def free_pages(self) -> int:
        return len(self._free)

    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._pages[seq_id] = []
        self._length[seq_id] = 0
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        self._free.extend(reversed(self._pages.pop(seq_id, [])))
        self._length.pop(seq_id, None)

    def length(self, seq_id: int) -> int:
        return self._length[seq_id]

    def _reserve(self, seq_id: int, new_tokens: int) -> None:
        total = self._length[seq_id] + new_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"{total} tokens do not fit the context of {self.max_context}; shorten the prompt or max_tokens"
            )
        pages = self._pages[seq_id]
        need = self.pages_needed(total) - len(pages)
        if need > len(self._free):
            raise KVCacheFullError(f"KV cache full: {need} more pages needed, {len(self._free)} free")
        for _ in range(need):
            pages.append(self._free.pop())

    def _table(self, seq_ids: Sequence[int]) -> np.ndarray:
        table = np.zeros((len(seq_ids), self.pages_per_sequence), dtype=self.index_dtype)
        for row, sid in enumerate(seq_ids):
            pages = self._pages[sid]
            table[row, : len(pages)] = pages
        return table

    # -- compute -----------------------------------------------------------------------------
    def prefill(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append a chunk of prompt tokens to one sequence; return its last logits [vocab]."""
        ids = np.asarray(token_ids, dtype=self.index_dtype).reshape(1, -1)
        if ids.size == 0:
            raise ValueError("no tokens to run")
        self._reserve(seq_id, ids.shape[1])
        dev = self._base.device
        pos = np.array([self._length[seq_id]], dtype=self.index_dtype)
        out = self._prefill(
            tvm.runtime.tensor(ids, dev), tvm.runtime.tensor(pos, dev),
            tvm.runtime.tensor(self._table([seq_id]), dev), *self._tail,
        )
        self._length[seq_id] += ids.shape[1]
        return out[0].numpy()[0, -1]

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """One token for each listed sequence in one batched step; logits [len(seq_ids), vocab]."""
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise ValueError("decode needs one token per sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence may appear once per decode step")
        for sid in seq_ids:
            self._reserve(sid, 1)
        dev = self._base.device
        ids = np.asarray(token_ids, dtype=self.index_dtype).reshape(-1, 1)
        pos = np.array([self._length[s] for s in seq_ids], dtype=self.index_dtype)
        out = self._decode(
            tvm.runtime.tensor(ids, dev), tvm.runtime.tensor(pos, dev),
            tvm.runtime.tensor(self._table(seq_ids), dev), *self._tail,
        )
        for sid in seq_ids:
            self._length[sid] += 1
        return out[0].numpy()[:, 0]
