"""The VNNI kernels (GEMV, dequantize, gather) on the GGUF superblock layouts of ``formats/vnni.py``
(K-quants, IQ4, Q5_1, Q5_0): fresh random codes, group scales and mins and superblock d / dmin in each
type's own value ranges, checked against the float64 weights of the documented formula
w = (d * sc) * code - dmin * m (exact in float32, so the dequantize and gather must match bit for bit)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from sched_helpers import int8_rounding_slack, needs_vnni, prologue_x

from perfx_compiler.formats.ggml.iq4_nl import KVALUES
from perfx_compiler.formats.vnni import quantize_activations, subscaled_vnni_packed
from perfx_compiler.formats.vnni_lowbit import (
    pack_q2_quads,
    pack_q3_octets,
    pack_q5_octets,
    pack_q6_quads,
    part_byte,
    q6_byte,
    unpack_q2_quads,
    unpack_q3_octets,
    unpack_q5_octets,
    unpack_q6_quads,
)
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import build_func

# type: (group, superblock, signed codes range or unsigned code max, scale range, min max or None)
TYPES = {
    "Q4_K": (32, 256, (0, 15), (0, 63), 63),
    "Q2_K": (16, 256, (0, 3), (0, 15), 15),
    "Q5_K": (32, 256, (0, 31), (0, 63), 63),
    "Q6_K": (16, 256, (-32, 31), (-128, 127), None),
    "Q3_K": (16, 256, (-4, 3), (-32, 31), None),
    "IQ4_XS": (32, 256, (-127, 113), (-32, 31), None),
    "IQ4_NL": (32, 32, (-127, 113), (1, 1), None),
    "Q5_1": (32, 32, (0, 31), (1, 1), 1),
    "Q5_0": (32, 32, (-16, 15), (1, 1), None),  # (formats/gguf_blocks.py makes it, one level, zero point 16)
}


def fake_subscaled(qtype: str, n: int, k: int, rng: np.random.Generator) -> tuple[SimpleNamespace, np.ndarray]:
    """(A SubScaled-shaped tensor of random values, its float64 weights)."""
    g, sb, (c0, c1), (s0, s1), mmax = TYPES[qtype]
    signed = mmax is None
    codes = rng.integers(c0, c1 + 1, (n, k)).astype(np.int8 if signed else np.uint8)
    if qtype.startswith("IQ4"):  # the codes are the non-linear table's values (stored as its indices)
        codes = KVALUES[rng.integers(0, 16, (n, k))]
    scales = rng.integers(s0, s1 + 1, (n, k // g)).astype(np.int8)
    d = (rng.random((n, k // sb)) * 0.002 + 1e-4).astype(np.float16)
    mins = dmin = None
    if not signed:
        mins = rng.integers(0 if mmax > 1 else 1, mmax + 1, (n, k // g)).astype(np.int8)
        dmin = (rng.random((n, k // sb)) * 0.003 * (1 if sb > g else -10)).astype(np.float16)
    gi, si = np.arange(k) // g, np.arange(k) // sb
    w = (d.astype(np.float32)[:, si] * scales.astype(np.float32)[:, gi]) * codes.astype(np.float32)
    if mins is not None:
        w = w - dmin.astype(np.float32)[:, si] * mins.astype(np.float32)[:, gi]
    sub = SimpleNamespace(codes=codes, scales=scales, mins=mins, d=d, dmin=dmin, group=g, sb=sb)
    return sub, w.astype(np.float32)


@pytest.fixture(scope="module")
def template():
    from schedules.gemv_qvnni_cpu import TEMPLATE

    return TEMPLATE


@pytest.fixture(scope="module")
def target():
    return load_target("host")


def _build(template, target, func, config=None):
    wl = template.match(func, target)
    assert wl is not None
    cfg = config if config is not None else template.default_config(wl, target)
    return build_func(template.apply(func, wl, cfg, target), target)


@needs_vnni
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(48, 512), (37, 2304)])
def test_dequant_and_take_are_exact(template, target, qtype, n, k):
    import tvm

    rng = np.random.default_rng()
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_vnni_packed(sub, qtype)
    dev = tvm.cpu()
    arrays = [tvm.runtime.tensor(a, dev) for _, a in pk.arrays]
    out = tvm.runtime.tensor(np.zeros((n, k), np.float32), dev)
    _build(template, target, pk.compute("dequant", (None, None)))["main"](*arrays, out)
    np.testing.assert_array_equal(out.numpy(), w)
    ids = rng.integers(0, n, (1, 5)).astype(np.int64)
    got = tvm.runtime.tensor(np.zeros((1, 5, k), np.float32), dev)
    _build(template, target, pk.compute("take", (None, None)))["main"](*arrays, tvm.runtime.tensor(ids, dev), got)
    np.testing.assert_array_equal(got.numpy(), w[ids])


@needs_vnni
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k,rows", [(64, 512, (1, 1)), (38, 2304, (1, 1)), (32, 1024, (1, 3))])
def test_gemv_matches_int8_reference(template, target, qtype, n, k, rows):
    import tvm

    rng = np.random.default_rng()
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_vnni_packed(sub, qtype)
    func = pk.compute("matmul", rows)
    wl = template.match(func, target)
    configs = [template.default_config(wl, target), {"units": 1, "tasks": 2, "unroll": 1, "split": 1}]
    dev = tvm.cpu()
    x = rng.standard_normal((*rows, k)).astype(np.float32)
    x[..., :32] *= 20.0  # one loud group: per-group scales must not leak across groups
    ref = quantize_activations(x, k, sub.group) @ w.astype(np.float64).T
    for cfg in configs:
        y = tvm.runtime.tensor(np.zeros((*rows, n), np.float32), dev)
        rt = build_func(template.apply(func, wl, cfg, target), target)
        rt["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for _, a in pk.arrays], y)
        assert np.abs(y.numpy() - ref).max() <= 2e-5 * np.abs(ref).max(), (qtype, cfg)


@pytest.mark.parametrize("n,k", [(1, 256), (4, 512), (13, 768), (37, 2304)])
def test_q6_quads_are_one_stream_in_lane_group_order_and_round_trip(n, k):
    """pack_q6_quads: per 4 rows and 64-column step, the two nibble pair parts and the high-bits part
    side by side (``q6_byte``), the columns in lane-group order (step s of a 256-column chunk holds in
    its lane l columns 4s..4s+3 of group l), checked by that formula per row; unpacked back to the codes."""
    rng = np.random.default_rng()
    codes = rng.integers(0, 64, (n, k)).astype(np.uint8)
    packed = pack_q6_quads(codes)
    kp = -(-k // 64) * 64
    assert packed.shape == (-(-n // 4), 3 * kp) and packed.dtype == np.uint8
    cols = np.arange(k)
    # column 4s + j of group l of chunk c: stored step 4c + s, part p, lane l, byte j
    assert q6_byte(2, 16 * 5 + 4 * 3 + 1) == 3 * 192 + 2 * 64 + 5 * 4 + 1
    assert q6_byte(0, 256 + 16 * 15 + 2) == 4 * 192 + 15 * 4 + 2
    with pytest.raises(ValueError, match="whole 256-column chunks"):
        pack_q6_quads(codes[:, :64])
    for row in range(n):
        q, r = divmod(row, 4)
        lo = (packed[q, q6_byte(r // 2, cols)] >> (4 * (r % 2))) & 15
        hb = (packed[q, q6_byte(2, cols)] >> (2 * r)) & 3
        np.testing.assert_array_equal(lo | (hb << 4), codes[row])
    np.testing.assert_array_equal(unpack_q6_quads(packed, n, k), codes)
    n4 = -(-n // 4) * 4
    assert kp == k and not unpack_q6_quads(packed, n4, k)[n:].any()  # a quad's padding rows hold 0


@pytest.mark.parametrize("n,k", [(1, 5), (8, 64), (13, 100), (37, 2304)])
def test_q5_octets_are_one_stream_and_round_trip(n, k):
    """pack_q5_octets: per 8 rows and 64-column step, four nibble pair parts and a part of the rows'
    fifth bits (row r in bit r) side by side (``part_byte``), checked by that formula per row, and
    unpacked back to the codes (N not a multiple of 8)."""
    rng = np.random.default_rng()
    codes = rng.integers(0, 32, (n, k)).astype(np.uint8)
    packed = pack_q5_octets(codes)
    kp = -(-k // 64) * 64
    assert packed.shape == (-(-n // 8), 5 * kp) and packed.dtype == np.uint8
    assert part_byte(5, 4, 64 * 3 + 7) == 3 * 320 + 4 * 64 + 7  # step 3's fifth part, column 7 of it
    cols = np.arange(k)
    for row in range(n):
        o, r = divmod(row, 8)
        lo = (packed[o, part_byte(5, r // 2, cols)] >> (4 * (r % 2))) & 15
        hb = (packed[o, part_byte(5, 4, cols)] >> r) & 1
        np.testing.assert_array_equal(lo | (hb << 4), codes[row])
    np.testing.assert_array_equal(unpack_q5_octets(packed, n, k), codes)
    pad = np.arange(k, kp)
    assert not packed[:, np.concatenate([part_byte(5, j, pad) for j in range(5)])].any()  # padding columns hold 0


@pytest.mark.parametrize("n,k", [(1, 5), (8, 64), (13, 100), (37, 2304)])
def test_q2_quads_and_q3_octets_round_trip(n, k):
    """pack_q2_quads: per 4 rows one row of 2-bit codes (row r in bits 2r..2r+1); pack_q3_octets: per 8
    rows and 64-column step two such quad parts of the low 2 bits and a part of the rows' third bits
    (row r in bit r) side by side (``part_byte``: one stream). Each checked by that formula per row and
    unpacked back to the codes (N not a multiple of 4 / 8)."""
    rng = np.random.default_rng()
    kp = -(-k // 64) * 64
    c2 = rng.integers(0, 4, (n, k)).astype(np.uint8)
    p2 = pack_q2_quads(c2)
    assert p2.shape == (-(-n // 4), kp) and p2.dtype == np.uint8
    c3 = rng.integers(0, 8, (n, k)).astype(np.uint8)
    p3 = pack_q3_octets(c3)
    assert p3.shape == (-(-n // 8), 3 * kp) and p3.dtype == np.uint8
    cols = np.arange(k)
    for row in range(n):
        np.testing.assert_array_equal((p2[row // 4, :k] >> (2 * (row % 4))) & 3, c2[row])
        o, r = divmod(row, 8)
        lo = (p3[o, part_byte(3, r // 4, cols)] >> (2 * (r % 4))) & 3
        np.testing.assert_array_equal(lo | (((p3[o, part_byte(3, 2, cols)] >> r) & 1) << 2), c3[row])
    np.testing.assert_array_equal(unpack_q2_quads(p2, n, k), c2)
    np.testing.assert_array_equal(unpack_q3_octets(p3, n, k), c3)
    pad = np.arange(k, kp)
    assert not p2[:, k:].any() and not p3[:, np.concatenate([part_byte(3, j, pad) for j in range(3)])].any()


def random_file_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Fresh random GGUF file bytes [N, K/bw * bb] of ``qtype``: random bytes, the f16 fields finite."""
    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.gguf_blocks import BLOCK_BYTES

    if qtype in ggml.FORMATS:
        fmt = ggml.FORMATS[qtype]
        bw, bb, fields = fmt.block_weights, fmt.block_bytes, fmt.f16_fields
    else:
        bw, bb, fields = 32, BLOCK_BYTES[qtype], (0,)
    b = rng.integers(0, 256, (n, k // bw, bb), dtype=np.uint8)
    for at in fields:
        d = (10.0 ** rng.uniform(-4, -2, b.shape[:2]) * rng.choice([-1.0, 1.0], b.shape[:2])).astype(np.float16)
        b[:, :, at : at + 2] = d[..., None].view(np.uint8)
    return b.reshape(n, -1)


@needs_vnni
@pytest.mark.parametrize("qtype", ["IQ4_XS", "IQ4_NL", "Q5_K", "Q5_1", "Q5_0", "Q3_K", "Q2_K"])
def test_file_blocks_match_gguf(template, target, qtype):
    """IQ4 as 4-bit table indices (the kernels' vpshufb / select lookup), the Q5 types as 5-bit row
    octets, Q3_K as 3-bit row octets and Q2_K as 2-bit row quads: dequantize and gather equal gguf-py's dequantization of fresh random blocks bit for bit, the
    GEMV and the prefill GEMM follow it up to the int8 activations, and the artifact holds at most 1.03x
    the file's bytes."""
    import tvm
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.gguf_blocks import packed_from_blocks
    from schedules.gemm_qvnni_cpu import TEMPLATE as GEMM

    rng = np.random.default_rng()
    n, k = 96, 2048
    raw = random_file_blocks(qtype, n, k, rng)
    w = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32)
    group = 16 if qtype in ("Q3_K", "Q2_K") else 32
    if qtype in ggml.FORMATS:
        pk = subscaled_vnni_packed(ggml.FORMATS[qtype].unpack(raw, (n, k)), qtype)
    else:
        pk = packed_from_blocks(qtype, raw, (n, k), vnni=True)
    assert sum(a.nbytes for _, a in pk.arrays) <= 1.03 * raw.nbytes
    dev = tvm.cpu()
    arrays = [tvm.runtime.tensor(a, dev) for _, a in pk.arrays]
    out = tvm.runtime.tensor(np.zeros((n, k), np.float32), dev)
    _build(template, target, pk.compute("dequant", (None, None)))["main"](*arrays, out)
    np.testing.assert_array_equal(out.numpy(), w)
    ids = rng.integers(0, n, (1, 4)).astype(np.int64)
    got = tvm.runtime.tensor(np.zeros((1, 4, k), np.float32), dev)
    _build(template, target, pk.compute("take", (None, None)))["main"](*arrays, tvm.runtime.tensor(ids, dev), got)
    np.testing.assert_array_equal(got.numpy(), w[ids])
    for tmpl, rows in ((template, (1, 1)), (GEMM, (1, 40))):
        x = rng.standard_normal((*rows, k)).astype(np.float32)
        ref = quantize_activations(x, k, group) @ w.astype(np.float64).T
        y = tvm.runtime.tensor(np.zeros((*rows, n), np.float32), dev)
        _build(tmpl, target, pk.compute("matmul", rows))["main"](tvm.runtime.tensor(x, dev), *arrays, y)
        assert np.abs(y.numpy() - ref).max() <= 2e-5 * np.abs(ref).max(), (qtype, rows)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS"])
def test_reference_func_dequantizes_the_file_blocks(qtype):
    """The tagged reference PrimFunc (``vnni_compute``, unscheduled: what the tuner checks candidates
    against) reads each superblock layout as the kernels do: its dequantize equals gguf-py's bit for bit."""
    import tvm
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from perfx_compiler.formats import ggml

    rng = np.random.default_rng()
    n, k = 20, 512
    raw = random_file_blocks(qtype, n, k, rng)
    pk = subscaled_vnni_packed(ggml.FORMATS[qtype].unpack(raw, (n, k)), qtype)
    func = pk.compute("dequant", (None, None))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    out = tvm.runtime.tensor(np.zeros((n, k), np.float32))
    lib["main"](*[tvm.runtime.tensor(a) for _, a in pk.arrays], out)
    want = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32)
    np.testing.assert_array_equal(out.numpy(), want)


@needs_vnni
@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS", "Q4_K"])
def test_iq4_table_lookup_is_one_vpshufb(template, target, qtype):
    """IQ4's non-linear codes come from one ``vpshufb`` of a constant table register per code vector in
    the GEMV and the prefill GEMM (no compare/blend chain left from the select the table is written
    as); a linear 4-bit type has no lookup at all."""
    import tvm

    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.gguf_blocks import packed_from_blocks
    from schedules.gemm_qvnni_cpu import TEMPLATE as GEMM

    n, k = 96, 2048
    raw = random_file_blocks(qtype, n, k, np.random.default_rng(0))
    if qtype in ggml.FORMATS:
        pk = subscaled_vnni_packed(ggml.FORMATS[qtype].unpack(raw, (n, k)), qtype)
    else:
        pk = packed_from_blocks(qtype, raw, (n, k), vnni=True)
    for tmpl, rows in ((template, (1, 1)), (GEMM, (1, 40))):
        func = pk.compute("matmul", rows)
        wl = tmpl.match(func, target)
        sched = tmpl.apply(func, wl, tmpl.default_config(wl, target), target)
        mod = tvm.IRModule({"main": sched.with_attr("global_symbol", "main")})
        asm = tvm.compile(mod, target.tvm()).mod.inspect_source("asm")
        lookups, dots = asm.count("vpshufb"), asm.count("vpdpbusd")
        assert dots > 0, (qtype, rows)
        if qtype.startswith("IQ4"):
            assert 0 < lookups <= dots, (qtype, rows, lookups, dots)
            assert asm.count("vpcmpeqb") == 0 and asm.count("vpblendmb") == 0, (qtype, rows)
        else:
            assert lookups == 0, (qtype, rows, lookups)


def _prologue_inputs(prologue: str, k: int, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """(The fused GEMV's inputs, the x it multiplies with: ``sched_helpers.prologue_x``, or the input itself)."""
    if prologue == "swiglu":
        inputs = [(rng.standard_normal((1, 1, 2 * k)) * 3).astype(np.float32)]
    else:
        inputs = [rng.standard_normal((1, 1, k)).astype(np.float32) for _ in range(2)]
        if not prologue:
            return inputs[:1], inputs[0]
        inputs.append((1 + 0.3 * rng.standard_normal(k)).astype(np.float32))
    return inputs, prologue_x(prologue, inputs, k)


@needs_vnni
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K", "Q6_K", "Q3_K", "Q2_K"])
@pytest.mark.parametrize("prologue,epilogue", [("add_rms_norm", ""), ("swiglu", ""), ("", "swiglu"),
                                               ("add_rms_norm", "swiglu")])
def test_fused_prologue_and_epilogue_on_low_bit_codes(template, target, qtype, prologue, epilogue):
    """passes/fuse_gemv_prologue.py fuses add_rms_norm / swiglu into the 2-, 3-, 5- and 6-bit GEMVs too: x
    made inside the call must be the separate kernel's x (a + b returned exactly), y the plain GEMV's, and
    h = silu(gate) * up of that y, for the default config and x quantized on the calling thread; keyed
    as the plain GEMV (its records apply). N = 2 x 96: whole row units per half for every layout."""
    import tvm

    from perfx_compiler.formats import QUANT_ATTR
    from perfx_compiler.formats.vnni import vnni_compute
    from perfx_compiler.passes._relax_util import json_attr

    rng = np.random.default_rng()
    n, k = 192, 512
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_vnni_packed(sub, qtype)
    info = json_attr(pk.compute("matmul", (1, 1)), QUANT_ATTR)
    args = (n, k, int(sub.group), int(info["bits"]), bool(info["sym"]), bool(info["offset"]), "matmul", (1, 1))
    extra = {"sb": int(info.get("sb", 0)), "lut": str(info.get("lut", ""))}
    func = vnni_compute(*args, prologue=prologue, eps=1e-5, epilogue=epilogue, **extra)
    wl = template.match(func, target)
    plain = template.match(vnni_compute(*args, **extra).with_attr("op_pattern", 8), target)
    assert wl.key == plain.key
    inputs, x = _prologue_inputs(prologue, k, rng)
    ref = quantize_activations(x, k, sub.group) @ w.astype(np.float64).T
    slack = int8_rounding_slack(x, w, sub.group) if prologue else 0.0
    dev = tvm.cpu()
    default = template.default_config(wl, target)
    for cfg in (default, {**default, "tquant": 0, "tasks": 3}):
        rt = build_func(template.apply(func, wl, cfg, target), target)
        total = tvm.runtime.tensor(np.zeros((1, 1, k), np.float32), dev)
        y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
        h = tvm.runtime.tensor(np.full((1, 1, n // 2), np.nan, np.float32), dev)
        rt["main"](*[tvm.runtime.tensor(v, dev) for v in inputs], *[tvm.runtime.tensor(a, dev) for _, a in pk.arrays],
                   *([total] if prologue == "add_rms_norm" else []), y, *([h] if epilogue else []))
        yv = y.numpy()
        assert (np.abs(yv[0, 0] - ref[0, 0]) <= 2e-5 * np.abs(ref).max() + slack).all(), (qtype, cfg)
        if prologue == "add_rms_norm":
            assert np.array_equal(total.numpy(), inputs[0] + inputs[1]), cfg
        if epilogue:
            g, u = yv[..., : n // 2].astype(np.float64), yv[..., n // 2 :].astype(np.float64)
            want = g / (1 + np.exp(-g)) * u
            assert np.abs(h.numpy() - want).max() <= 1e-5 * np.abs(want).max(), (qtype, cfg)
