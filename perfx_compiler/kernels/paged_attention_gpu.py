"""Fused RoPE + paged-KV append + causal GQA attention for a batch of sequences, for GPUs.

Same contract and signature as ``kernels/paged_attention.py`` (the CPU kernel; both are built by its
``paged_attention_func``): sequence ``b`` has ``positions[b]`` tokens cached in the pages
``page_table[b]`` lists; its ``seq`` new tokens are rotated, written to (page, slot) =
(page_table[b, p // PS], p % PS) of the [pages, PS, KVH, D] pools in place, and query ``s`` attends
over cache positions ``0 .. positions[b] + s``. The append must be complete before any block reads
the pools, so it is a launch of its own:

1. append: one block per (kv head, sequence), ``D/2`` threads; thread ``t`` rotates the pair
   (t, t + D/2) of each new k row and copies v[t], v[t + D/2].
2. attention: grid (query tile, sequence * heads + head), ``T`` threads (the power of two >= D, at
   most ``max_threads``; one-query tiles: grid (head, sequence), see below). A block takes ``QT`` consecutive queries of one head (a prefill chunk's
   tiles run in parallel; decode has one tile of one query). Keys come in tiles of ``T``: thread
   ``t`` loads key ``tile*T + t`` once and scores it against every rotated query of the tile held in
   shared memory, masked causally per query (key position <= the query's); each query's tile max is
   a tree reduction across the block's threads in shared memory (log2 T steps, the tile's queries
   side by side); then thread ``d < D`` loads ``V[j, d]`` once and adds ``p_qj * V[j, d]`` to each
   query's output dimension ``d`` and ``p_qj`` to its weight sum, under an online softmax per query
   (running max and sum, rescaled per tile). K and V are read once per tile of queries instead of
   once per query. Shared memory is ``QT * (D + 3T)`` floats whatever the context length, and
   ``QT`` is chosen so that it fits WebGPU's 16 KiB. Tiles of a single query (decode, or a chunk's
   last tile) are served by a one-query copy of the kernel (its own launch, one block per (head,
   sequence) for the last tile; a block whose tile is of the other kind reads no keys), so decode does
   no work for idle rows and keeps a small kernel; the multi-query kernel's grid is a single idle
   block when ``seq`` is 1.

The kernel carries ``tirx.is_scheduled`` so no template touches it.

Variants (Gemma 2/3, Mistral), built only when asked for, so plain kernels are unchanged:

* ``window`` W > 0: sliding-window attention, the query at position p sees keys ``p - W < j <= p``
  (HF / llama.cpp: masked when ``p - j >= W``), masked per query. A block starts at the key tile of
  its first query's oldest visible key, and keys no query of the block sees are neither read from the
  pools nor looked up in the page table (pages before a window may be recycled some day).
* ``softcap`` C > 0: logit soft-capping, the score ``s = (q . k) * scale`` becomes ``C * tanh(s / C)``
  before the mask and the softmax.
"""

from __future__ import annotations

import math
from typing import Any

import tvm
from tvm.script import tirx as T

from perfx_compiler.errors import UnsupportedModelError
from perfx_compiler.kernels.paged_attention import paged_attention_func

NEG = -3.0e38  # finite "minus infinity": exp(NEG - m) is 0, never NaN
SHARED_BYTES = 16384  # WebGPU's guaranteed workgroup storage, the smallest of the GPU targets
MAX_QUERY_TILE = 8  # queries a block: registers hold 5 floats per query per thread


def paged_threads(head_dim: int, max_threads: int = 256) -> int:
    """Threads of an attention block: the power of two >= head_dim (one thread per output dimension)."""
    t = 1
    while t < head_dim:
        t *= 2
    if t > max_threads:
        raise UnsupportedModelError(
            f"paged attention (GPU): head_dim {head_dim} needs {t} threads a block, more than the target's {max_threads}"
        )
    return t


def paged_query_tile(head_dim: int, threads: int) -> int:
    """Queries per attention block: the largest power of two <= MAX_QUERY_TILE whose shared memory
    (queries, two tree-max buffers and weights: ``QT * (D + 3T)`` floats) fits SHARED_BYTES."""
    qt = MAX_QUERY_TILE
    while qt > 1 and 4 * qt * (head_dim + 3 * threads) > SHARED_BYTES:
        qt //= 2
    return qt


def paged_attention_kernel_gpu(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    page_size: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
    threads: int | None = None,
    query_tile: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> Any:
    """The GPU PrimFunc for one configuration (shape constants baked in). ``index_dtype``: element
    type of ``positions`` and ``page_table`` (int32 on WebGPU, where the compiler narrows every index).
    ``query_tile``: queries a block (default :func:`paged_query_tile`). ``window``: sliding window in
    tokens (0 = plain causal); ``softcap``: logit soft-cap (0 = none); see the module doc."""
    H, KVH, D, PS = num_heads, num_kv_heads, head_dim, page_size
    G = H // KVH
    HALF = D // 2
    TS = threads or paged_threads(D)
    LOG = TS.bit_length() - 1
    QT = query_tile or paged_query_tile(D, TS)
    scale = 1.0 / math.sqrt(D)
    if H % KVH or D % 2 or TS < D or TS & (TS - 1) or QT < 1:
        raise UnsupportedModelError(
            f"paged attention (GPU): unsupported shape heads={H} kv_heads={KVH} head_dim={D} threads={TS} "
            f"query tile={QT} (heads must be a multiple of kv_heads, head_dim even, threads a power of two >= head_dim)"
        )
    W, CAP = int(window), float(softcap)
    if W < 0 or CAP < 0:
        raise UnsupportedModelError(f"paged attention (GPU): window {window} and softcap {softcap} must be >= 0")

    # The variants enter through these expressions (and the parse-time ``if CAP``): with W = 0 they
    # are exactly the plain kernel's, so its IR (and tuning records, digests) do not change.
    def first_key(p0: Any) -> Any:
        """The oldest key the block's first query (position p0) sees; later queries see no older one."""
        return T.max(p0 - T.int64(W - 1), T.int64(0))

    def first_tile(p0: Any, tiles: Any) -> Any:
        """The block's first key tile (at most ``tiles``: a block of the other kind runs none)."""
        if W == 0:
            return T.int64(0)
        return T.min(first_key(p0) // T.int64(TS), tiles)

    def read_key(j: Any, p0: Any, last: Any) -> Any:
        """Key j is seen by some query of the block (positions p0 .. last)."""
        if W == 0:
            return j <= last
        return tvm.tirx.And(j <= last, first_key(p0) <= j)

    def seen(j: Any, p: Any) -> Any:
        """The query at position p sees key j: causal, inside the window."""
        if W == 0:
            return j <= p
        return tvm.tirx.And(j <= p, p - j < T.int64(W))

    def first_value(p0: Any, kt: Any) -> Any:
        """The first row of key tile kt whose value is read (rows before the window weigh 0)."""
        if W == 0:
            return T.int64(0)
        return T.max(first_key(p0) - kt * T.int64(TS), T.int64(0))

    @T.macro
    def halve(NQ, src, dst, off, tx):
        """One tree-max level for NQ rows: dst[r*TS + t] = max(src[r*TS + t], src[r*TS + t + off]),
        t < off. Reading one buffer and writing another keeps the rows' statements free of
        read-after-write conflicts, so TVM's barrier insertion accepts them under the ``if``."""
        if tx < off:
            for r in T.unroll(T.int64(NQ)):
                dst[r * TS + tx] = T.max(src[r * TS + tx], src[r * TS + tx + off])

    @T.macro
    def tree_max(NQ, ra, rb, tx):
        """Max of ra[r*TS : (r+1)*TS] for each of NQ rows, two levels a step (ra -> rb -> ra): the
        result ends in ra[r*TS], or rb[r*TS] when log2(TS) is odd."""
        for lv in T.serial(LOG // 2):
            halve(NQ, ra, rb, T.shift_right(T.int64(TS // 2), lv * T.int64(2)), tx)
            T.tvm_storage_sync("shared")
            halve(NQ, rb, ra, T.shift_right(T.int64(TS // 4), lv * T.int64(2)), tx)
            T.tvm_storage_sync("shared")
        if LOG % 2 == 1:
            halve(NQ, ra, rb, T.int64(1), tx)
            T.tvm_storage_sync("shared")

    @T.macro
    def key_tile(NQ, kt, KP, VP, PT, b, p0, last, tx, qs, ra, rb, wt, kh, m, lsum, acc, sc, tm):
        """Key tile kt for the first NQ queries of ``qs``: their scores, the tile's max per query, and
        the online-softmax update of the running max ``m``, sum ``lsum`` and output ``acc``."""
        j: T.let[T.int64] = kt * T.int64(TS) + tx
        for r in T.unroll(T.int64(NQ)):
            sc[r] = T.float32(NEG)
        if read_key(j, p0, last):
            kb: T.let[T.int64] = T.Cast("int64", PT[b, j // PS])
            for r in T.unroll(T.int64(NQ)):
                sc[r] = T.float32(0)
            for d in T.serial(D):  # key j is read once for all the tile's queries
                kv: T.let[T.float32] = KP[kb, j % PS, kh, d]
                for r in T.unroll(T.int64(NQ)):
                    sc[r] = sc[r] + qs[r * D + d] * kv
            if CAP > 0:  # soft-capping bounds the scores to (-C, C), before the mask
                for r in T.unroll(T.int64(NQ)):
                    sc[r] = T.float32(CAP) * T.tanh(sc[r] * T.float32(1.0 / CAP))
            for r in T.unroll(T.int64(NQ)):  # causal: query r sees keys up to its own position
                sc[r] = T.if_then_else(seen(j, p0 + r), sc[r], T.float32(NEG))
        for r in T.unroll(T.int64(NQ)):
            ra[r * TS + tx] = sc[r]
        T.tvm_storage_sync("shared")
        tree_max(NQ, ra, rb, tx)  # each row's max score of the tile
        for r in T.unroll(T.int64(NQ)):
            if LOG % 2 == 1:
                tm[r] = T.max(m[r], rb[r * TS])
            else:
                tm[r] = T.max(m[r], ra[r * TS])
        for r in T.unroll(T.int64(NQ)):  # a masked key (score NEG) weighs 0
            w: T.let[T.float32] = T.if_then_else(sc[r] > T.float32(NEG), T.exp(sc[r] - tm[r]), T.float32(0))
            wt[r * TS + tx] = w
            alpha: T.let[T.float32] = T.exp(m[r] - tm[r])
            lsum[r] = lsum[r] * alpha
            acc[r] = acc[r] * alpha
            m[r] = tm[r]
        T.tvm_storage_sync("shared")
        if tx < T.int64(D):  # the weight sums are summed here too (only output threads need them)
            for jj in T.serial(first_value(p0, kt), T.min(T.int64(TS), last + T.int64(1) - kt * T.int64(TS))):
                vb: T.let[T.int64] = T.Cast("int64", PT[b, (kt * T.int64(TS) + jj) // PS])
                vv: T.let[T.float32] = VP[vb, (kt * T.int64(TS) + jj) % PS, kh, tx]
                for r in T.unroll(T.int64(NQ)):  # v row j is read once for all the queries
                    lsum[r] = lsum[r] + wt[r * TS + jj]
                    acc[r] = acc[r] + wt[r * TS + jj] * vv
        T.tvm_storage_sync("shared")  # ra / wt are rewritten by the next tile

    @T.macro
    def keys(NQ, tiles, KP, VP, PT, OUT, b, h, s0, p0, last, nq, tx, qs, ra, rb, wt):
        """Key tiles 0 .. tiles - 1 for the first NQ rotated queries in ``qs`` (query r at position
        p0 + r; rows r >= nq hold zeros and are never written), then their outputs. NQ is a Python
        int: the row loops unroll and the per-row state stays in registers. ``tiles`` is 0 unless
        this variant serves the block's tile (see ``attention``)."""
        m = T.decl_buffer((NQ,), "float32", scope="local")  # running max
        lsum = T.decl_buffer((NQ,), "float32", scope="local")  # running sum
        acc = T.decl_buffer((NQ,), "float32", scope="local")  # output dimension tx, unnormalised
        sc = T.decl_buffer((NQ,), "float32", scope="local")  # this thread's key's scores
        tm = T.decl_buffer((NQ,), "float32", scope="local")  # max after this tile
        kh: T.let[T.int64] = h // G
        for r in T.unroll(T.int64(NQ)):
            m[r] = T.float32(NEG)
            lsum[r] = T.float32(0)
            acc[r] = T.float32(0)
        if W == 0:
            for kt in T.serial(tiles):
                key_tile(NQ, kt, KP, VP, PT, b, p0, last, tx, qs, ra, rb, wt, kh, m, lsum, acc, sc, tm)
        else:
            # from the window's first tile. The loop starts at 0 and the first tile is added: TVM
            # 0.27 shifts a loop starting elsewhere to 0 without substituting its variable in the
            # bounds of inner loops (the V loop's), which then run over the wrong rows.
            first: T.let[T.int64] = first_tile(p0, tiles)
            for kt in T.serial(tiles - first):
                key_tile(NQ, first + kt, KP, VP, PT, b, p0, last, tx, qs, ra, rb, wt, kh, m, lsum, acc, sc, tm)
        if tiles > T.int64(0) and tx < T.int64(D):
            for r in T.unroll(T.int64(NQ)):
                if r < nq:
                    OUT[b, s0 + r, h * D + tx] = acc[r] / lsum[r]

    @T.macro
    def block(NQ, Q, KP, VP, POS, PT, COS, SIN, OUT, seq, b, h, s0, tx):
        """One block of the attention kernel for tiles of exactly one query (NQ = 1) or of 2 .. QT
        (NQ = QT): head h of sequence b, the tile of queries from s0."""
        qs = T.decl_buffer((NQ * D,), "float32", scope="shared")  # rotated, scaled queries
        ra = T.decl_buffer((NQ * TS,), "float32", scope="shared")  # tree-max levels (even)
        rb = T.decl_buffer((NQ * TS,), "float32", scope="shared")  # tree-max levels (odd)
        wt = T.decl_buffer((NQ * TS,), "float32", scope="shared")  # the tile's weights
        nq: T.let[T.int64] = T.min(T.int64(QT), seq - s0)
        p0: T.let[T.int64] = T.Cast("int64", POS[b]) + s0  # the tile's first query position
        last: T.let[T.int64] = p0 + nq - T.int64(1)  # keys 0 .. last are read
        for r in T.unroll(T.int64(NQ)):
            if tx < T.int64(HALF):
                if r < nq and (NQ == 1 or nq > 1):  # the other kind's blocks load nothing
                    x1: T.let[T.float32] = Q[b, s0 + r, h * D + tx]
                    x2: T.let[T.float32] = Q[b, s0 + r, h * D + tx + HALF]
                    c: T.let[T.float32] = COS[p0 + r, tx]
                    sn: T.let[T.float32] = SIN[p0 + r, tx]
                    qs[r * D + tx] = (x1 * c - x2 * sn) * T.float32(scale)
                    qs[r * D + tx + HALF] = (x2 * c + x1 * sn) * T.float32(scale)
                else:
                    qs[r * D + tx] = T.float32(0)
                    qs[r * D + tx + HALF] = T.float32(0)
        T.tvm_storage_sync("shared")
        tiles: T.let[T.int64] = last // T.int64(TS) + T.int64(1)
        many: T.let[T.int64] = T.min(tiles, (nq - T.int64(1)) * tiles)  # 0 if nq == 1, else tiles
        if NQ == 1:
            keys(1, tiles - many, KP, VP, PT, OUT, b, h, s0, p0, last, nq, tx, qs, ra, rb, wt)
        else:
            keys(NQ, many, KP, VP, PT, OUT, b, h, s0, p0, last, nq, tx, qs, ra, rb, wt)

    @T.macro
    def body(Q, K, V, KP, VP, POS, PT, COS, SIN, OUT, batch, seq, pages):
        # 1) rotate k, append k and v at each new token's (page, slot): grid (kv head, sequence)
        for kh in T.thread_binding(T.int64(KVH), thread="blockIdx.x"):
            for b in T.thread_binding(batch, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(HALF), thread="threadIdx.x"):
                    for s in T.serial(seq):
                        p: T.let[T.int64] = T.Cast("int64", POS[b]) + s
                        page: T.let[T.int64] = T.Cast("int64", PT[b, p // PS])
                        x1: T.let[T.float32] = K[b, s, kh * D + tx]
                        x2: T.let[T.float32] = K[b, s, kh * D + tx + HALF]
                        c: T.let[T.float32] = COS[p, tx]
                        sn: T.let[T.float32] = SIN[p, tx]
                        KP[page, p % PS, kh, tx] = x1 * c - x2 * sn
                        KP[page, p % PS, kh, tx + HALF] = x2 * c + x1 * sn
                        VP[page, p % PS, kh, tx] = V[b, s, kh * D + tx]
                        VP[page, p % PS, kh, tx + HALF] = V[b, s, kh * D + tx + HALF]
        # 2) attention, two kernels, TS threads: one for tiles of one query (decode; a chunk's
        # 1-query last tile), one for tiles of 2..QT. A block whose tile is of the other kind runs
        # zero key tiles (TVM inserts no barrier under an if, but a loop with a block-uniform trip
        # count is fine). Two kernels rather than two loops in one keep decode's kernel as small as
        # before (registers, shared memory).
        # 2a) one query: grid (head, sequence), at the chunk's last tile (the only one that can hold one)
        for h in T.thread_binding(T.int64(H), thread="blockIdx.x"):
            for b in T.thread_binding(batch, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(TS), thread="threadIdx.x"):
                    block(1, Q, KP, VP, POS, PT, COS, SIN, OUT, seq, b, h, (seq - T.int64(1)) // T.int64(QT) * T.int64(QT), tx)
        # 2b) 2..QT queries: grid (query tile, sequence * H + head), a single idle block when seq is
        # 1. The symbolic extent is blockIdx.x's, so only the constant H divides a block index
        # (int64 division by a symbolic extent costs registers; WebGPU reserves blockIdx.z)
        if QT > 1:
            for qt in T.thread_binding((seq + T.int64(QT - 1)) // T.int64(QT), thread="blockIdx.x"):
                for bh in T.thread_binding(
                    T.min(seq - T.int64(1), T.int64(1)) * (batch * T.int64(H) - T.int64(1)) + T.int64(1), thread="blockIdx.y"
                ):
                    for tx in T.thread_binding(T.int64(TS), thread="threadIdx.x"):
                        block(QT, Q, KP, VP, POS, PT, COS, SIN, OUT, seq, bh // T.int64(H), bh % T.int64(H), qt * T.int64(QT), tx)

    return paged_attention_func(H, KVH, D, max_context, PS, dtype, index_dtype, body)
