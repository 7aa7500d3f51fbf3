"""Shared analysis and loop-nest builders for the CPU matmul templates (GEMM and GEMV).

The functions we schedule come from Relax ``matmul(x, permute_dims(w))`` after LegalizeOps /
FuseTransposeMatmul / FuseOps / FuseTIR: one reduction block ``C[b, m, n] += A[b, m, k] * B[..]``
with B either ``[K, N]`` ("NN", when LegalizeOps ran first and the transpose is a separate
function) or ``[N, K]`` ("NT", from FuseTransposeMatmul), followed by injective epilogue blocks
(bias add, SiLU * mul, residual add).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfx_compiler.schedule_template import ScheduleConfigError


def vector_registers(target: Any) -> int:
    """Architectural SIMD registers: 32 on AVX-512, AArch64 (NEON) and RISC-V V; 16 on AVX2/SSE."""
    triple = str(target.tvm_target.get("mtriple") or getattr(target, "host_triple", "") or "")
    if triple.startswith(("aarch64", "arm64", "riscv")):
        return 32
    return 32 if (target.vector_bits or 128) >= 512 else 16


def panel_width(target: Any) -> int:
    """Width nb of the weight panels [N / nb, K, nb] the weight_layout pass packs for ``target``
    and the GEMM/GEMV templates read: the widest micro-tile that leaves room for >= 4 rows of
    accumulators (4 vectors with 32 registers, 2 with 16). A target file may fix it
    (``"packed_panel": nb``, a multiple of the vector lanes)."""
    lanes = max(1, (target.vector_bits or 128) // 32)
    fixed = (getattr(target, "raw", None) or {}).get("packed_panel")
    if fixed:
        if int(fixed) % lanes:
            raise ScheduleConfigError(f"target {target.name}: packed_panel {fixed} is not a multiple of {lanes} lanes")
        return int(fixed)
    return (4 if vector_registers(target) >= 32 else 2) * lanes


def _name(node: Any) -> str:
    src = getattr(node, "source", None)
    if src is None:
        src = getattr(node, "buffer", None)
    return str(getattr(src, "name", src))


def _var_positions(indices: Any, iter_vars: list) -> list[int] | None:
    """Map each index to the position of the block iter var it is; None if any index is not plain."""
    out = []
    for index in indices:
        pos = next((i for i, iv in enumerate(iter_vars) if index.same_as(iv.var)), None)
        if pos is None:
            return None
        out.append(pos)
    return out


def _packed_positions(indices: Any, iter_vars: list) -> tuple[list[int], int] | None:
    """B read as ``W[n // nb, k, n % nb]`` (weights pre-packed into nb-wide panels by the
    weight_layout pass): the positions of (n, k) and the panel width nb; None otherwise."""
    if len(indices) != 3:
        return None
    div, mid, mod = indices
    if _as_int(div) == 0:  # a single panel (N == nb): TVM folded n // nb to 0 and n % nb to n
        pos = _var_positions([mod, mid], iter_vars)
        return None if pos is None else (pos, -1)
    if type(div).__name__ != "FloorDiv" or type(mod).__name__ != "FloorMod":
        return None
    nb, nb2 = _as_int(div.b), _as_int(mod.b)
    if nb is None or nb != nb2:
        return None
    pos = _var_positions([div.a, mid], iter_vars)
    if pos is None or _var_positions([mod.a], iter_vars) != pos[:1]:
        return None
    return pos, nb


def _as_int(expr: Any) -> int | None:
    value = getattr(expr, "value", None)
    return int(value) if isinstance(value, int) else None


def root_blocks(func: Any) -> tuple[Any, list[Any]] | None:
    """(an ``s_tir.Schedule`` of ``func``, the root's child blocks); None when it cannot be scheduled."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        return sch, sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # noqa: BLE001
        return None


def outer_extents(extents: list[Any]) -> tuple[int, str | None]:
    """(product of the static extents, name of the symbolic one or None) over loop ``extents``."""
    static, symbolic = 1, None
    for ext in extents:
        value = _as_int(ext)
        if value is None:
            symbolic = str(getattr(ext, "name", ext))
        else:
            static *= value
    return static, symbolic


def _small_constant_extent(expr: Any) -> int | None:
    """Value of an extent that is constant once every shape var is >= 1 (None otherwise)."""
    import tvm_ffi
    from tvm import sym, tirx

    free: list[Any] = []
    tvm_ffi.structural_walk(expr, (tirx.Var, free.append))
    analyzer = sym.Analyzer()
    for var in free:
        analyzer.update(var, sym.analyzer.ConstIntBound(1, (1 << 62)), override=True)
    return _as_int(analyzer.simplify(expr))


@dataclass
class MatmulFacts:
    block: str
    roles: list[str]  # role of each block iter / loop: "u" (unit), "m", "n", "k"
    M: int | None  # None when symbolic
    m_var: str | None
    N: int
    K: int
    layout: str  # "NN": B[K, N]; "NT": B[N, K]; "P": B[N / nb, K, nb] (pre-packed panels)
    b_read_index: int  # which read of the block is B (for cache_read)
    epilogue: list[str]
    dtype: str
    nb: int = 0  # panel width of a pre-packed B (layout "P"), 0 otherwise
    b_half: str = ""  # "f16" / "bf16" when B is a half array widened in the product, else ""

    def info(self) -> dict[str, Any]:
        out = {"layout": self.layout, "block": self.block, "epilogue": list(self.epilogue)}
        if self.nb:
            out["nb"] = self.nb
        if self.b_half:
            out["b_half"] = self.b_half
        return out


def _is_spatial_block(blk: Any) -> bool:
    return all(int(iv.iter_type) == 0 for iv in blk.iter_vars)


def _dt(expr: Any) -> str:
    dtype = getattr(expr, "dtype", None)
    return str(dtype if dtype is not None else getattr(expr, "ty", ""))


def _half_load(expr: Any) -> tuple[Any, str] | None:
    """``expr`` = a half load widened to float32 (f16: a cast; bf16: uint16 -> uint32, shift left
    16, reinterpret): (the load, "f16" / "bf16"); None otherwise."""
    loads = ("TensorLoad", "BufferLoad")
    kind = type(expr).__name__
    if kind == "Cast" and _dt(expr) == "float32" and _dt(expr.value) == "float16":
        return (expr.value, "f16") if type(expr.value).__name__ in loads else None
    if kind != "Call" or str(getattr(expr.op, "name", "")) != "tirx.reinterpret" or _dt(expr) != "float32":
        return None
    shift = expr.args[0]
    if type(shift).__name__ in ("LShift", "Shl"):
        value, amount = shift.a, shift.b
    elif type(shift).__name__ == "Call" and str(getattr(shift.op, "name", "")) == "tirx.shift_left":
        value, amount = shift.args
    else:
        return None
    if _as_int(amount) != 16 or type(value).__name__ != "Cast" or _dt(value) != "uint32":
        return None
    load = value.value
    if type(load).__name__ not in loads or _dt(load) != "uint16":
        return None
    return load, "bf16"


def analyze_matmul(func: Any, allow_half: bool = False) -> MatmulFacts | None:
    """Recognise a (batch-1) fp32 matmul with an optional injective epilogue; None otherwise.
    With ``allow_half``, B may also be an f16 / bf16 array widened to fp32 inside the product
    (the half-weight GEMM); without it such a matmul is not recognised."""
    found = root_blocks(func)  # None: functions without a root block are simply not matmuls
    if found is None or not found[1]:
        return None
    sch, blocks = found
    first = sch.get(blocks[0])
    store = first.body
    value = getattr(store, "value", None)
    if first.init is None or value is None or type(value).__name__ != "Add":
        return None
    acc, prod = value.a, value.b
    if type(prod).__name__ != "Mul" or _name(acc) != _name(store):
        return None
    lhs, rhs = prod.a, prod.b
    b_half = ""
    widened = _half_load(rhs) if allow_half else None
    if widened is not None:
        rhs, b_half = widened
    if type(lhs).__name__ not in ("TensorLoad", "BufferLoad") or type(rhs).__name__ not in (
        "TensorLoad",
        "BufferLoad",
    ):
        return None
    ivs = list(first.iter_vars)
    c_pos = _var_positions(store.indices, ivs)
    a_pos = _var_positions(lhs.indices, ivs)
    b_pos = _var_positions(rhs.indices, ivs)
    nb = 0
    if b_pos is None:
        packed = _packed_positions(rhs.indices, ivs)
        if packed is not None:
            b_pos, nb = packed  # [n, k]: the panel index and lane both come from n
    if c_pos is None or a_pos is None or b_pos is None or len(b_pos) != 2:
        return None
    loops = sch.get_loops(blocks[0])
    if len(loops) != len(ivs):
        return None
    roles: list[str] = []
    m_extent: Any = None
    n_extent = k_extent = None
    for i, iv in enumerate(ivs):
        reduce = int(iv.iter_type) == 2
        in_a, in_b, in_c = i in a_pos, i in b_pos, i in c_pos
        ext = iv.dom.extent
        if not ext.same_as(sch.get(loops[i]).extent) and _as_int(ext) != _as_int(sch.get(loops[i]).extent):
            return None  # loops were already transformed
        if reduce and in_a and in_b and not in_c:
            if k_extent is not None:
                return None
            roles.append("k")
            k_extent = ext
        elif not reduce and _as_int(ext) == 1:
            roles.append("u")
        elif not reduce and in_b and in_c and not in_a:
            if n_extent is not None:
                return None
            roles.append("n")
            n_extent = ext
        elif not reduce and in_a and in_c and not in_b:
            if m_extent is not None:
                return None
            roles.append("m")
            m_extent = ext
        else:
            return None
    N, K = _as_int(n_extent), _as_int(k_extent)
    if N is None or K is None or "k" not in roles or "n" not in roles:
        return None
    if m_extent is None:  # M = 1: the last unit axis indexing A and C (not B) plays M
        cands = [i for i, r in enumerate(roles) if r == "u" and i in a_pos and i in c_pos and i not in b_pos]
        if not cands:
            return None
        roles[cands[-1]] = "m"
        m_extent = ivs[cands[-1]].dom.extent
    M = _as_int(m_extent)
    if M is None:
        M = _small_constant_extent(m_extent)  # e.g. the last-token slice: 1 once seq >= 1
    # A symbolic M may be any expression of the shape vars (not only `seq` itself): the
    # padded tiling only needs its value at run time.
    m_var = None if M is not None else str(getattr(m_extent, "name", m_extent))
    dtype = str(store.value.dtype if hasattr(store.value, "dtype") else "float32")
    if "float32" not in dtype:
        return None
    if nb == -1:
        nb = N
    layout = "P" if nb else "NN" if b_pos.index(roles.index("k")) == 0 else "NT"
    if nb and N % nb:
        return None
    b_name = _name(rhs)
    reads = [_name(r) for r in first.reads]
    if b_name not in reads:
        return None
    epilogue = []
    for blk_rv in blocks[1:]:
        blk = sch.get(blk_rv)
        if not _is_spatial_block(blk) or blk.init is not None:
            return None
        epilogue.append(blk.name_hint)
    return MatmulFacts(
        block=first.name_hint,
        roles=roles,
        M=M,
        m_var=m_var,
        N=N,
        K=K,
        layout=layout,
        b_read_index=reads.index(b_name),
        epilogue=epilogue,
        dtype="float32",
        nb=nb,
        b_half=b_half,
    )


def _loops_by_role(sch: Any, block: Any, roles: list[str]) -> dict[str, Any]:
    loops = sch.get_loops(block)
    out: dict[str, Any] = {}
    for role, loop in zip(roles, loops[: len(roles)], strict=True):  # extra (split) loops follow
        if role != "u":
            out[role] = loop
    return out


def _pack_loops(sch: Any, bpack: Any, layout: str, nr: int, lanes: int) -> None:
    """Order the B-packing copy so its stores are contiguous vectors (the [.., k, nr] slab)."""
    loops = sch.get_loops(bpack)
    if layout == "NT":  # loops (n, k): make n's lane part innermost -> contiguous stores
        n, k = loops[-2], loops[-1]
        n_o, n_i = sch.split(n, [None, nr])
        ko, ki = sch.split(k, [None, 4])
        sch.reorder(n_o, ko, ki, n_i)
        sch.unroll(ki)
        _, lane = sch.split(n_i, [None, lanes])
        sch.vectorize(lane)
    else:  # loops (k, n): n is already contiguous on both sides
        _, lane = sch.split(loops[-1], [None, lanes])
        sch.vectorize(lane)


def schedule_register_tiled(
    func: Any,
    facts: MatmulFacts,
    *,
    mr: int,
    nr: int,
    nc: int,
    lanes: int,
    parallel: str,
    pack_x: bool,
    pack_b: bool,
    k_outer: bool = False,
    k_unroll: int = 1,
) -> Any:
    """Register-tiled outer-product kernel: an mr x nr accumulator tile lives in registers while k
    runs over the whole reduction; an nc-wide panel of B stays in L2 across the M tiles.

    Symbolic or ragged M is padded to a multiple of mr (pad_einsum) so the hot loop has no
    predicate; only the write-back tile is predicated. NT weights are packed per panel into
    [K, nr] slabs so that the vectorized axis is contiguous.
    """
    from tvm import s_tir

    N = facts.N
    if mr < 1 or nr % lanes or nc % nr or N % nc:
        raise ScheduleConfigError(f"bad tiles mr={mr} nr={nr} nc={nc} for N={N}, lanes={lanes}")
    if facts.layout == "P" and (facts.nb % nr or (nc % facts.nb and facts.nb % nc)):
        # The weights were packed at compile time: a micro-tile must lie inside one panel.
        raise ScheduleConfigError(f"tiles nr={nr} nc={nc} do not fit the packed panel width nb={facts.nb}")
    if k_unroll < 1 or facts.K % k_unroll:
        raise ScheduleConfigError(f"k_unroll={k_unroll} does not divide K={facts.K}")
    if parallel not in ("n", "nm"):
        raise ScheduleConfigError(f"parallel must be 'n' or 'nm', not {parallel!r}")
    sch = s_tir.Schedule(func)
    mm = sch.get_sblock(facts.block)
    epis = [sch.get_sblock(name) for name in facts.epilogue]
    for blk in epis[:-1]:  # e.g. sigmoid feeding the SiLU multiply: fold into the last block
        sch.compute_inline(blk)
    last_epi = epis[-1] if epis else None

    pad = mr > 1 and (facts.M is None or facts.M % mr != 0)
    if pad:
        if facts.layout == "P":
            # pad_einsum wants plain indices: view the packed weights as [N, K] around it (the
            # parameter keeps its packed shape: the two layout maps are inverses).
            nb = facts.nb
            sch.transform_layout(mm, ("read", facts.b_read_index), lambda p, k, q: (p * nb + q, k))
        sch.pad_einsum(mm, [mr if r == "m" else 1 for r in facts.roles])
        if facts.layout == "P":
            sch.transform_layout(mm, ("read", facts.b_read_index), lambda n, k: (n // nb, k, n % nb))
        producers = sch.get_producers(mm)
        xpad = next(b for b in producers if sch.get(b).name_hint.endswith("_pad"))
        copy_out = sch.get_consumers(mm)[0]
    else:
        xpad = None
        copy_out = sch.cache_write(mm, 0, "global")  # accumulator tile, promoted to registers
    if last_epi is not None:
        sch.compute_inline(copy_out)
        last = last_epi
    else:
        last = copy_out

    bpack = None
    if facts.layout == "NT" or (facts.layout == "NN" and pack_b):
        bpack = sch.cache_read(mm, facts.b_read_index, "global")
        if facts.layout == "NT":
            sch.transform_layout(bpack, ("write", 0), lambda n, k: (n // nr, k, n % nr))
        else:
            sch.transform_layout(bpack, ("write", 0), lambda k, n: (n // nr, k, n % nr))

    loops = _loops_by_role(sch, mm, facts.roles)
    m, n, k = loops["m"], loops["n"], loops["k"]
    mo, mi = sch.split(m, [None, mr])
    no, nj, nv, nl = sch.split(n, [None, nc // nr, nr // lanes, lanes])
    if k_outer:
        sch.reorder(no, mo, k, nj, mi, nv, nl)
        sch.reverse_compute_at(last, mo)
    else:
        if k_unroll > 1:
            k, ku = sch.split(k, [None, k_unroll])
            sch.reorder(no, mo, nj, k, ku, mi, nv, nl)
            sch.unroll(ku)
        else:
            sch.reorder(no, mo, nj, k, mi, nv, nl)
        sch.reverse_compute_at(last, nj)
    if xpad is not None:
        if pack_x:
            sch.compute_at(xpad, mo)  # copy the mr x K strip of x next to its use
        else:
            sch.compute_inline(xpad)
    if bpack is not None:
        if parallel == "n":
            sch.compute_at(bpack, no)  # pack this panel of B once, reuse across all M tiles
            _pack_loops(sch, bpack, facts.layout, nr, lanes)
        else:
            _pack_loops(sch, bpack, facts.layout, nr, lanes)
            sch.parallel(sch.get_loops(bpack)[0])
    if parallel == "n":
        sch.parallel(no)
    else:
        sch.parallel(sch.fuse(no, mo))
    sch.unroll(mi)
    sch.unroll(nv)
    sch.vectorize(nl)
    init = sch.decompose_reduction(mm, k)
    iloops = sch.get_loops(init)[-3:]
    if not k_outer:
        sch.unroll(iloops[0])
        sch.unroll(iloops[1])
    sch.vectorize(iloops[2])
    wloops = sch.get_loops(last)
    _, wl = sch.split(wloops[-1], [None, lanes])
    sch.vectorize(wl)
    return sch.mod["main"]


def _inner_loops(sch: Any, block: Any, outer: Any) -> list:
    """The loops of ``block`` below ``outer`` (unit loops may have been dropped)."""
    loops = sch.get_loops(block)
    outer_sref = sch.get_sref(outer)
    idx = next(i for i, lp in enumerate(loops) if sch.get_sref(lp).same_as(outer_sref))
    return loops[idx + 1 :]


def schedule_dot_rows(
    func: Any,
    facts: MatmulFacts,
    *,
    rows: int,
    accum: int,
    lanes: int,
    tasks: int,
) -> Any:
    """GEMV with weights [N, K]: each output is a dot product along contiguous K. ``rows`` outputs
    share each x load; the K loop keeps ``accum`` vector partial sums per row (rfactor) so the FMA
    latency chain is hidden.

    The partial sums are a task-local [rows, accum * lanes] buffer with the lanes innermost, so
    each accumulator is one contiguous vector (LLVM keeps them in registers); with the lanes
    outermost (rfactor's default axis) every FMA result went through a strided scatter/gather in
    memory and decode GEMVs ran at half of numpy's speed. Each row's accum * lanes partial sums are
    then added as a tree of vector adds (successive rfactors over halves: 32 -> 16 -> ... -> 2
    lanes, log2 dependent adds instead of a 31-long scalar chain) before the last scalar add."""
    from tvm import s_tir

    N, K = facts.N, facts.K
    kr = accum * lanes
    if facts.layout != "NT":
        raise ScheduleConfigError("dot-row GEMV needs weights laid out [N, K]")
    if rows < 1 or N % rows or K % kr or tasks < 1 or (N // rows) % tasks:
        raise ScheduleConfigError(f"bad GEMV tiles rows={rows} accum={accum} tasks={tasks} for N={N}, K={K}")
    sch = s_tir.Schedule(func)
    mm = sch.get_sblock(facts.block)
    epis = [sch.get_sblock(name) for name in facts.epilogue]
    for blk in epis[:-1]:
        sch.compute_inline(blk)
    loops = _loops_by_role(sch, mm, facts.roles)
    m, n, k = loops["m"], loops["n"], loops["k"]
    no, nt, ni = sch.split(n, [tasks, None, rows])
    ko, kf = sch.split(k, [None, kr])
    sch.reorder(no, nt, ko, m, ni, kf)
    out_dims = len(sch.get(mm).writes[0].region)
    rf = sch.rfactor(kf, factor_axis=out_dims)  # partial sums [..., N, kr]: lanes innermost
    folds = []  # the tree, built while the final block still has its own loop nest
    width = kr
    while width > 2 and width % 2 == 0:
        _, half = sch.split(sch.get_loops(mm)[-1], [2, width // 2])
        folds.append(sch.rfactor(half, factor_axis=out_dims))
        width //= 2
    rloops = sch.get_loops(rf)
    rku, rkl = sch.split(rloops[-1], [accum, lanes])
    sch.unroll(rku)
    sch.vectorize(rkl)
    sch.unroll(rloops[-2])  # ni
    if _as_int(sch.get(rloops[-3]).extent) is not None:  # m; may be an expression equal to 1
        sch.unroll(rloops[-3])
    rf_nt = sch.get_loops(rf)[-6]  # loops: ..., no, nt, ko, m, ni, k_acc, k_lane
    sch.set_scope(rf, 0, "local")  # compacted to [rows, kr] per task step: registers
    for fold in folds:
        sch.reverse_compute_at(fold, rf_nt)
        sch.set_scope(fold, 0, "local")
    sch.reverse_compute_at(mm, rf_nt)
    if epis:
        sch.reverse_compute_at(epis[-1], rf_nt)
    sch.parallel(sch.get_loops(rf)[-7])
    init = sch.decompose_reduction(rf, sch.get_loops(rf)[len(rloops) - 4])
    sch.vectorize(sch.get_loops(init)[-1])
    for fold in folds:  # loops (half, 2[, row]) -> (row, 2, half): vector adds of two halves
        inner = _inner_loops(sch, fold, rf_nt)
        sch.reorder(*inner[2:], inner[1], inner[0])
        _unroll_constant(sch, inner[1:])
        sch.vectorize(inner[0])
    inner = _inner_loops(sch, mm, rf_nt)  # (2[, row])
    sch.reorder(*inner[1:], inner[0])
    _unroll_constant(sch, inner)
    return sch.mod["main"]


def _unroll_constant(sch: Any, loops: list) -> None:
    """Unroll the loops with a constant extent (an M that is an expression equal to 1 is not)."""
    for lp in loops:
        if _as_int(sch.get(lp).extent) is not None:
            sch.unroll(lp)


def schedule_split_k(
    func: Any,
    facts: MatmulFacts,
    *,
    splits: int,
    nr: int,
    k_block: int,
    lanes: int,
) -> Any:
    """GEMV with weights [K, N] streamed in memory order: each of ``splits`` parallel tasks reads
    a contiguous block of K/splits whole weight rows (one sequential stream, no strided panels)
    into its own full-width partial sum (rfactor over the K split), ``k_block`` rows per pass so
    each partial-sum vector is loaded and stored once per k_block FMAs; a short vectorized pass
    adds the partial sums. This is what DRAM-resident weights (lm_head, every decode layer of a
    real model) need."""
    from tvm import s_tir

    N, K = facts.N, facts.K
    if facts.layout != "NN":
        raise ScheduleConfigError("split-K GEMV needs weights laid out [K, N]")
    if splits < 1 or k_block < 1 or K % (splits * k_block) or nr % lanes or N % nr:
        raise ScheduleConfigError(f"bad split-K tiles splits={splits} k_block={k_block} nr={nr} for K={K}, N={N}")
    sch = s_tir.Schedule(func)
    mm = sch.get_sblock(facts.block)
    epis = [sch.get_sblock(name) for name in facts.epilogue]
    for blk in epis[:-1]:
        sch.compute_inline(blk)
    ks, kr = sch.split(_loops_by_role(sch, mm, facts.roles)["k"], [splits, None])
    rf = sch.rfactor(ks, factor_axis=0)
    rl = _loops_by_role(sch, rf, facts.roles)  # the rf block keeps the original loop nest
    rks = sch.get_loops(rf)[-2]
    rkr = sch.get_loops(rf)[-1]
    kro, kri = sch.split(rkr, [None, k_block])
    nj, nv, nl = sch.split(rl["n"], [None, nr // lanes, lanes])
    sch.reorder(rks, kro, nj, kri, rl["m"], nv, nl)
    sch.parallel(rks)
    sch.unroll(kri)
    if _as_int(sch.get(rl["m"]).extent) is not None:
        sch.unroll(rl["m"])
    sch.unroll(nv)
    sch.vectorize(nl)
    init = sch.decompose_reduction(rf, kro)
    sch.vectorize(sch.get_loops(init)[-1])
    # Final sum over the splits: lanes of N innermost, splits just above them.
    wl = sch.get_loops(mm)
    wn, wks = wl[-2], wl[-1]
    wno, wnl = sch.split(wn, [None, lanes])
    sch.reorder(wno, wks, wnl)
    sch.vectorize(wnl)
    if epis:
        sch.reverse_compute_at(epis[-1], wno)
        sch.vectorize(sch.get_loops(epis[-1])[-1])
    return sch.mod["main"]
