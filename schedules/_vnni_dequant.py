"""The VNNI layouts' other readers (``formats/vnni.py``: int4 row pairs, int8 + 128), used by the
``gemv_qvnni_cpu`` template beside the GEMV of ``_vnni_kernels``: ``dequant`` (prefill: W in float32,
row-major or as the packed GEMM's panels) and ``take`` (the embedding gather).
"""

from __future__ import annotations

from typing import Any

from schedules._vnni_kernels import plan, transpose_tile


def dequant(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, tasks: int, nb: int = 0) -> Any:
    """W [N, K] in float32 from the VNNI layout (prefill: the float GEMM follows), or with
    ``nb`` as [N / nb, K, nb] panels, the packed GEMM's layout (see weight_layout)."""
    from tvm.script import tirx as T

    p = plan(K, G)
    KP, NGP = p["KP"], p["NGP"]
    pair = bits == 4
    N2 = N + N % 2 if pair else N
    QW = N2 // 2 if pair else N
    ZT = "float16" if offset else "uint8"
    NV = K // 16
    PER = -(-N // tasks)

    def _w(Q: Any, Sc: Any, Z: Any, row: Any, col: Any, g: Any) -> Any:
        return weight_expr(bits, sym, offset, Q, Sc, Z, row, col, g)

    if nb and (N % nb or nb % 16):
        raise ValueError(f"panel width {nb} must be a multiple of 16 dividing N={N}")
    OUT = (N // nb, K, nb) if nb else (N, K)

    # Panels: a 16 x 16 tile (16 rows, 16 columns) is widened with row-contiguous loads as in
    # the row kernel, then stored transposed (16 columns of 16 rows each, contiguous in Out):
    # transpose_tile's shuffles, then column c picked from them (constant after unrolling).
    @T.macro
    def panels(Q, Sc, Z, Out):
        for pn in T.parallel(N // nb):
            for kb in T.serial(K // 16):
                for jb in T.serial(nb // 16):
                    tile = T.decl_buffer((256,), "float32", scope="local")
                    for j in T.unroll(16):
                        for lane in T.vectorized(16):
                            tile[j * 16 + lane] = _w(Q, Sc, Z, pn * nb + jb * 16 + j, kb * 16 + lane, (kb * 16) // G)
                    for c in T.unroll(16):
                        Out[pn, kb * 16 + c, T.Ramp(jb * 16, 1, 16)] = T.Shuffle(
                            transpose_tile([tile[T.Ramp(r * 16, 1, 16)] for r in range(16)]), [c * 16 + r for r in range(16)])

    @T.macro
    def rows(Q, Sc, Z, Out):
        for t in T.parallel(tasks):
            for j in T.serial(PER):
                if t * PER + j < N:
                    for v in T.serial(NV):
                        for lane in T.vectorized(16):
                            Out[t * PER + j, v * 16 + lane] = _w(
                                Q, Sc, Z, t * PER + j, v * 16 + lane, (v * 16) // G)

    body = panels if nb else rows

    if pair:

        @T.prim_func(private=True)
        def qv_dequant4(q_h: T.handle, s_h: T.handle, z_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(KP)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(NGP)), "float16")
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(NGP)), ZT)
            Out = T.match_buffer(o_h, [T.int64(d) for d in OUT], "float32")
            body(Q, Sc, Z, Out)

        return qv_dequant4

    @T.prim_func(private=True)
    def qv_dequant8(q_h: T.handle, s_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(QW), T.int64(KP)), "uint8")
        Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(NGP)), "float16")
        Out = T.match_buffer(o_h, [T.int64(d) for d in OUT], "float32")
        body(Q, Sc, Sc, Out)

    return qv_dequant8


def weight_expr(bits: int, sym: bool, offset: bool, Q: Any, Sc: Any, Z: Any, row: Any, col: Any, g: Any) -> Any:
    """Float weight (row, col) of group g read from the VNNI layout."""
    from tvm.script import tirx as T

    s = T.Cast("float32", Sc[row, g])
    if bits == 8:
        return (T.Cast("float32", Q[row, col]) - T.float32(128)) * s
    code = T.Cast("float32", T.bitwise_and(T.shift_right(Q[row // 2, col], T.Cast("uint8", (row % 2) * 4)),
                                           T.uint8(15)))
    if offset:
        return code * s + T.Cast("float32", Z[row, g])
    if sym:
        return (code - T.float32(8)) * s
    return (code - T.Cast("float32", Z[row, g])) * s


def take(bits: int, N: int, K: int, G: int, sym: bool, offset: bool) -> Any:
    """Embedding gather out[b, m, :] = W[ids[b, m], :] from the VNNI layout."""
    from tvm.script import tirx as T

    p = plan(K, G)
    KP, NGP = p["KP"], p["NGP"]
    pair = bits == 4
    N2 = N + N % 2 if pair else N
    QW = N2 // 2 if pair else N
    ZT = "float16" if offset else "uint8"
    NV = K // 16

    def _w(Q: Any, Sc: Any, Z: Any, row: Any, col: Any, g: Any) -> Any:
        return weight_expr(bits, sym, offset, Q, Sc, Z, row, col, g)

    @T.macro
    def body(Q, Sc, Z, ID, Out, b, m):
        for bm in T.serial(b * m):
            for v in T.serial(NV):
                for lane in T.vectorized(16):
                    Out[bm // m, bm % m, v * 16 + lane] = _w(
                        Q, Sc, Z, ID[bm // m, bm % m], v * 16 + lane, (v * 16) // G)

    if pair:

        @T.prim_func(private=True)
        def qv_take4(q_h: T.handle, s_h: T.handle, z_h: T.handle, i_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            b = T.int64()
            m = T.int64()
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(KP)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(NGP)), "float16")
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(NGP)), ZT)
            ID = T.match_buffer(i_h, (b, m), "int64")
            Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
            body(Q, Sc, Z, ID, Out, b, m)

        return qv_take4

    @T.prim_func(private=True)
    def qv_take8(q_h: T.handle, s_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        Q = T.match_buffer(q_h, (T.int64(QW), T.int64(KP)), "uint8")
        Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(NGP)), "float16")
        ID = T.match_buffer(i_h, (b, m), "int64")
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        body(Q, Sc, Sc, ID, Out, b, m)

    return qv_take8
