"""Many sequences over one paged KV pool, decoded together in one batched step.

The pool (one K and one V tensor per layer, [pages, page_size, kv_heads,
head_dim]) is allocated once; sequences hold lists of pages handed out from a
free list and given back the moment a sequence ends. With ``prefix_cache`` (the
default) full prompt pages stay cached after their sequence ends, and a new
sequence added with its prompt starts on the cached pages of that prompt's
longest cached prefix (``runtime/prefix_cache.py``). ``decode`` runs every
listed sequence's next token in a single call of the compiled ``paged_decode``
function, so the linear layers run as small-M GEMMs instead of B GEMVs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from perfx_compiler.errors import ArtifactError
from perfx_compiler.runtime import tvm_runtime as rt
from perfx_compiler.runtime.engine import Engine
from perfx_compiler.runtime.prefix_cache import PagePool, PrefixHit


class BatchEngine:
    def __init__(
        self,
        artifact_dir: str | Path,
        *,
        verify: bool = True,
        num_pages: int | None = None,
        max_batch: int = 16,
        prefix_cache: bool = True,
    ) -> None:
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
        self._pools = [rt.tensor(zeros, dev) for _ in range(paged["count"])]
        self._tail = [*self._pools, *self._base._weights]
        self._prefill = self._base.vm[self.manifest["functions"]["paged_prefill"]]
        self._decode = self._base.vm[self.manifest["functions"]["paged_decode"]]
        self.page_pool = PagePool(self.num_pages, self.page_size, self.max_context, prefix_cache=prefix_cache)
        self.prefilled_tokens = 0  # tokens run through paged_prefill (a prefix-cache hit skips its tokens)

    def pool_bytes(self) -> int:
        """Bytes the K and V pools of every layer take (allocated once, at construction)."""
        return sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in self._pools)

    def pool_summary(self) -> str:
        """One line for a server's log: pages, tokens per page, storage, size."""
        return (f"{self.num_pages} pages of {self.page_size} tokens, {self.manifest['paged_kv']['dtype']}, "
                f"{self.pool_bytes() / 2**20:.0f} MiB")

    # -- bookkeeping (see PagePool) ---------------------------------------------------------------
    def free_pages(self) -> int:
        """Pages a new token can take, counting cached pages no sequence holds (evicted on demand)."""
        return self.page_pool.free_pages()

    def pages_in_use(self) -> int:
        return self.page_pool.pages_in_use()

    def cached_pages(self) -> int:
        return self.page_pool.cached_pages()

    def pages_needed(self, num_tokens: int) -> int:
        return self.page_pool.pages_needed(num_tokens)

    def match_prefix(self, prompt: Sequence[int]) -> PrefixHit:
        return self.page_pool.match(prompt)

    def add_sequence(self, prompt: Sequence[int] | None = None) -> int:
        """A new sequence. With its ``prompt``, it starts on the prompt's cached prefix: ``length(seq_id)``
        tokens are already there, and ``prefill(seq_id, prompt[length:])`` computes the rest."""
        return self.page_pool.add_sequence(prompt)

    def remove_sequence(self, seq_id: int) -> None:
        self.page_pool.remove_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        return self.page_pool.length(seq_id)

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (the next requests start cold); returns the cached pages freed."""
        return self.page_pool.clear()

    def _table(self, seq_ids: Sequence[int]) -> np.ndarray:
        table = np.zeros((len(seq_ids), self.pages_per_sequence), dtype=self.index_dtype)
        for row, sid in enumerate(seq_ids):
            pages = self.page_pool.pages(sid)
            table[row, : len(pages)] = pages
        return table

    # -- compute -----------------------------------------------------------------------------
    def prefill(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append a chunk of prompt tokens to one sequence; return its last logits [vocab]."""
        ids = np.asarray(token_ids, dtype=self.index_dtype).reshape(1, -1)
        if ids.size == 0:
            raise ValueError("no tokens to run")
        self.page_pool.reserve(seq_id, ids.shape[1])
        dev = self._base.device
        pos = np.array([self.page_pool.length(seq_id)], dtype=self.index_dtype)
        self._base.pool_for(("prefill", ids.shape[1]))
        out = self._prefill(
            rt.tensor(ids, dev), rt.tensor(pos, dev),
            rt.tensor(self._table([seq_id]), dev), *self._tail,
        )
        self.page_pool.commit(seq_id, ids[0].tolist(), prefill=True)
        self.prefilled_tokens += ids.shape[1]
        return rt.to_numpy(out[0])[0, -1]

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """One token for each listed sequence in one batched step; logits [len(seq_ids), vocab]."""
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise ValueError("decode needs one token per sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence may appear once per decode step")
        for sid in seq_ids:
            self.page_pool.reserve(sid, 1)
        dev = self._base.device
        ids = np.asarray(token_ids, dtype=self.index_dtype).reshape(-1, 1)
        pos = np.array([self.page_pool.length(s) for s in seq_ids], dtype=self.index_dtype)
        self._base.pool_for(("decode", len(seq_ids)))
        out = self._decode(
            rt.tensor(ids, dev), rt.tensor(pos, dev),
            rt.tensor(self._table(seq_ids), dev), *self._tail,
        )
        for sid, tok in zip(seq_ids, token_ids, strict=True):
            self.page_pool.commit(sid, [tok], prefill=False)
        return rt.to_numpy(out[0])[:, 0]
