"""The paged KV pool's pages, with automatic prefix caching (as vLLM's): who holds which page, which are free.

Every page has a reference count. A page that a sequence has filled by prefill (``page_size`` tokens) is
registered under a key hashing its tokens chained with the key of the page before it, so one key names
the whole prefix up to the end of that page. A new sequence whose prompt starts with registered pages
takes them (refcount + 1) and prefills only the rest. When its last user ends, a registered page keeps
its KV and its key with refcount 0 in an LRU list and counts as free: it is evicted (key dropped) only
when the free list runs out. Partial pages are never registered, so a shared page is never written.

Only KV written by prefill chunks of 2 tokens or more is registered: ``paged_prefill`` computes each row
of such a chunk bit for bit the same whatever the chunk's start and size, whereas a 1-token chunk and the
batched decode take other kernels whose float sums differ in the last bits. For the same reason a prompt
always keeps at least its last 2 tokens to prefill (when the whole prompt is cached, its last page is
recomputed into a page of its own). So a request's logits, and its text, do not depend on the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from perfx_compiler.errors import ContextLengthError, KVCacheFullError

__all__ = ["MIN_PREFILL", "PagePool", "PrefixHit", "page_key"]

MIN_PREFILL = 2  # prompt tokens always prefilled: a 1-token chunk's rows come out of other kernels


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page: sha256 of the previous page's key and this page's token ids (no collisions
    in practice, unlike Python's 64-bit ``hash``; a collision would hand a request another prompt's KV)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(frozen=True)
class PrefixHit:
    tokens: int  # leading prompt tokens whose KV is cached (whole pages)
    pages: list[int]
    idle: int  # how many of those pages no sequence holds now (taking them uses up free room)


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is in ``pages``
    tokens: list[int] = field(default_factory=list)  # their ids, while ``cacheable``
    keys: list[bytes] = field(default_factory=list)  # key of each full page so far (the hash chain)
    cacheable: bool = True  # every token so far was written by a prefill chunk of >= MIN_PREFILL tokens


class PagePool:
    """Page bookkeeping of one KV pool (no tensors): sequences, refcounts, free list, prefix cache."""

    def __init__(self, num_pages: int, page_size: int, max_context: int, *, prefix_cache: bool = True) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_context = max_context
        self.prefix_cache = prefix_cache
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._ref = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # registered pages (in use or idle)
        self._page_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, refcount 0; least recently used first
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self.query_tokens = 0  # prompt tokens looked up in the cache so far
        self.hit_tokens = 0  # of those, found cached

    # -- counts ---------------------------------------------------------------------------------
    def free_pages(self) -> int:
        """Pages a sequence can take: never used, or cached but held by nobody (evicted on demand)."""
        return len(self._free) + len(self._idle)

    def cached_pages(self) -> int:
        """Cached pages held by no sequence (kept for reuse; part of ``free_pages``)."""
        return len(self._idle)

    def pages_in_use(self) -> int:
        return self.num_pages - self.free_pages()

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def pages(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].pages

    # -- sequences -------------------------------------------------------------------------------
    def match(self, prompt: Sequence[int]) -> PrefixHit:
        """The cached prefix ``add_sequence(prompt)`` would take (changes nothing)."""
        pages: list[int] = []
        if self.prefix_cache:
            key = b""
            ps = self.page_size
            for i in range(max(0, len(prompt) - MIN_PREFILL) // ps):
                key = page_key(key, prompt[i * ps : (i + 1) * ps])
                page = self._page_of.get(key)
                if page is None:
                    break
                pages.append(page)
        return PrefixHit(len(pages) * self.page_size, pages, sum(1 for p in pages if self._ref[p] == 0))

    def add_sequence(self, prompt: Sequence[int] | None = None) -> int:
        """A new sequence; with ``prompt``, it starts holding the prompt's cached prefix (see ``length``)."""
        seq_id = self._next_id
        self._next_id += 1
        st = _Seq()
        if prompt is not None:
            hit = self.match(prompt)
            for page in hit.pages:
                if self._ref[page] == 0:
                    del self._idle[page]
                self._ref[page] += 1
            st.pages = list(hit.pages)
            st.length = hit.tokens
            st.tokens = [int(t) for t in prompt[: hit.tokens]]
            st.keys = [self._key_of[p] for p in hit.pages]
            self.query_tokens += len(prompt)
            self.hit_tokens += hit.tokens
        self._seqs[seq_id] = st
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is None:
            return
        for page in reversed(st.pages):  # tail first: the LRU then evicts a prefix's end before its start
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def reserve(self, seq_id: int, new_tokens: int) -> None:
        """Give the sequence the pages ``new_tokens`` more tokens need (before they are computed)."""
        st = self._seqs[seq_id]
        total = st.length + new_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"{total} tokens do not fit the context of {self.max_context}; shorten the prompt or max_tokens"
            )
        need = self.pages_needed(total) - len(st.pages)
        if need > self.free_pages():
            raise KVCacheFullError(f"KV cache full: {need} more pages needed, {self.free_pages()} free")
        for _ in range(need):
            st.pages.append(self._allocate())

    def _allocate(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the least recently used cached page
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._ref[page] = 1
        return page

    def commit(self, seq_id: int, token_ids: Sequence[int], *, prefill: bool) -> None:
        """Record that ``token_ids``' KV now fills the sequence's next positions, and register the pages
        they completed (``prefill``: written by a prefill chunk of all of ``token_ids``)."""
        st = self._seqs[seq_id]
        st.length += len(token_ids)
        if not (self.prefix_cache and prefill and len(token_ids) >= MIN_PREFILL and st.cacheable):
            st.cacheable, st.tokens = False, []  # later pages sit on KV from other kernels: never shared
            return
        st.tokens.extend(int(t) for t in token_ids)
        ps = self.page_size
        while len(st.keys) < len(st.tokens) // ps:
            i = len(st.keys)
            key = page_key(st.keys[-1] if st.keys else b"", st.tokens[i * ps : (i + 1) * ps])
            st.keys.append(key)
            if key not in self._page_of:  # else another sequence computed the same page first: keep that one
                self._page_of[key] = st.pages[i]
                self._key_of[st.pages[i]] = key

    def clear(self) -> int:
        """Forget every cached prefix; return how many idle cached pages went back to the free list.
        Pages that sequences hold stay theirs, but no new sequence will share them."""
        n = len(self._idle)
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()
        return n

    def check(self) -> None:
        """Raise ``AssertionError`` unless every page is in exactly one place and refcounts match holders."""
        held = [0] * self.num_pages
        for st in self._seqs.values():
            for page in st.pages:
                held[page] += 1
        assert held == self._ref, "refcounts differ from the sequences' page lists"
        free, idle = set(self._free), set(self._idle)
        in_use = {p for p in range(self.num_pages) if self._ref[p] > 0}
        assert len(free) == len(self._free), "a page is twice in the free list"
        assert not (free & idle or free & in_use or idle & in_use), "a page is in two places"
        assert len(free) + len(idle) + len(in_use) == self.num_pages, "a page was lost"
        assert all(p in self._key_of for p in idle) and len(self._page_of) == len(self._key_of)
