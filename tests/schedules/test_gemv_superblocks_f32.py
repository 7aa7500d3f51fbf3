"""The float-activation CPU kernels (``gemv_int4_cpu`` / ``gemv_int8_cpu``) on the GGUF superblock
layouts of ``formats/superblocks.py`` (K-quants, IQ4, Q5_1), built with those templates directly
(never the VNNI ones, whatever the host): GEMV of one and three rows against float64 ``x @ w.T``,
dequantize (row-major and panels) and gather bit for bit against w = (d * sc) * code - dmin * m."""

from __future__ import annotations

import numpy as np
import pytest
from test_vnni_superblocks import TYPES, fake_subscaled

from perfx_compiler.formats import read_quant_info
from perfx_compiler.formats.ggml import FORMATS
from perfx_compiler.formats.superblocks import subscaled_packed
from perfx_compiler.formats.vnni import NIBBLE_TYPES
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import build_func

PLANE_TYPES = {"Q6_K": 6, "Q5_K": 5, "Q5_1": 5, "Q3_K": 3, "Q2_K": 2, "IQ4_XS": 4, "IQ4_NL": 4}  # CPU codes in bit planes (formats/bitplanes.py)


@pytest.fixture(scope="module")
def host():
    return load_target("host")


def _template(pk):
    if pk.family == "q4":
        from schedules.gemv_int4_cpu import TEMPLATE
    else:
        from schedules.gemv_int8_cpu import TEMPLATE
    return TEMPLATE


def _run(pk, func, target, config, *args, lanes=None):
    import tvm

    template = _template(pk)
    wl = template.match(func, target)
    assert wl is not None, read_quant_info(func)
    if lanes:  # the vector width of another CPU (NEON: 4 float lanes, AVX2: 8)
        wl.dims["L"] = lanes
    cfg = dict(template.default_config(wl, target), **config)
    rt = build_func(template.apply(func, wl, cfg, target), target)
    dev = tvm.cpu()
    tens = [tvm.runtime.tensor(a, dev) for a in args]
    rt["main"](*tens)
    return tens[-1].numpy()


def _arrays(pk):
    return [a for _, a in pk.arrays]


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_layout_and_facts(qtype):
    sub, _ = fake_subscaled(qtype, 8, 512, np.random.default_rng(0))
    pk = subscaled_packed(sub, qtype)
    assert pk.family == ("q4" if qtype in NIBBLE_TYPES and qtype not in PLANE_TYPES else "q8")
    info = read_quant_info(pk.compute("matmul", (1, 1)))
    g, sb, _, _, mmax = TYPES[qtype]
    assert info.get("sb") == (sb if sb > g else None)
    assert bool(info.get("offset")) == (mmax is not None)
    if qtype == "Q3_K":  # int8 [N, K/G]: 4 sc, d's 16 bits in the low 2 bits of each superblock's first 8
        scale = dict(pk.arrays)["_q8_scale"]
        assert scale.dtype == np.int8 and scale.shape == (8, 512 // g)
        assert np.array_equal(scale >> 2, sub.scales)
        low = (scale.view(np.uint8) & 3).astype(np.uint16).reshape(8, -1, 16)[:, :, :8]
        d16 = (low << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
        assert np.array_equal(d16.view("<f2"), sub.d)
    elif sb > g:  # int8 [N, K/G + 2 K/sb]: group values, then d's float16 bytes
        scale = dict(pk.arrays)[f"_{pk.family}_scale"]
        assert scale.dtype == np.int8 and scale.shape == (8, 512 // g + 2 * 512 // sb)
        assert np.array_equal(scale[:, 512 // g:].copy().view("<f2"), sub.d)
    assert pk.vnni is not None and pk.vnni().tag.endswith("v")
    # the float32 matrix would be 4 bytes a weight: the packed arrays are well under 1.5
    assert pk.nbytes < 1.5 * 8 * 512
    if qtype in PLANE_TYPES:  # bit-plane codes: the file's own bytes (Q5_K 1.023x, Q3_K 1.018x)
        fmt = FORMATS[qtype]
        assert info.get("code_bits") == PLANE_TYPES[qtype]
        assert pk.nbytes <= 1.03 * (8 * 512 // fmt.block_weights * fmt.block_bytes), pk.nbytes


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("k", [32, 576, 2304])
def test_bit_planes_round_trip(bits, k):
    """pack_planes / unpack_planes give the codes back exactly (K = 576: a partial last run), at
    ``bits`` bits a code once K spans whole runs; the kernels' reads are checked by the tests below."""
    from perfx_compiler.formats.bitplanes import pack_planes, row_bytes, unpack_planes

    codes = np.random.default_rng(k + bits).integers(0, 1 << bits, (5, k)).astype(np.uint8)
    packed = pack_planes(codes, bits)
    assert packed.shape == (5, row_bytes(k, bits)) and np.array_equal(unpack_planes(packed, k, bits), codes)
    if k % 128 == 0:
        assert packed.shape[1] * 8 == k * bits
    with pytest.raises(ValueError, match="unsigned"):
        pack_planes(codes.astype(np.int16) - 1, bits)


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(48, 512), (37, 2304)])
def test_dequant_and_take_are_exact(host, qtype, n, k):
    rng = np.random.default_rng(1)
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_packed(sub, qtype)
    out = _run(pk, pk.compute("dequant", (None, None)), host, {}, *_arrays(pk), np.zeros((n, k), np.float32))
    np.testing.assert_array_equal(out, w)
    ids = rng.integers(0, n, (1, 5)).astype(np.int64)
    got = _run(pk, pk.compute("take", (None, None)), host, {}, *_arrays(pk), ids, np.zeros((1, 5, k), np.float32))
    np.testing.assert_array_equal(got, w[ids])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_1"])
def test_dequant_panels_are_exact(host, qtype):
    from perfx_compiler.passes.weight_layout import packed_dequant

    n, k, nb = 48, 512, 16
    sub, w = fake_subscaled(qtype, n, k, np.random.default_rng(2))
    pk = subscaled_packed(sub, qtype)
    func = packed_dequant(pk.compute("dequant", (None, None)), nb)
    out = _run(pk, func, host, {}, *_arrays(pk), np.zeros((n // nb, k, nb), np.float32))
    np.testing.assert_array_equal(out, w.reshape(n // nb, nb, k).transpose(0, 2, 1))


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(48, 512), (37, 2304)])
@pytest.mark.parametrize("rows", [(1, 1), (1, 3)])
def test_gemv_matches_float64(host, qtype, n, k, rows):
    rng = np.random.default_rng(3)
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_packed(sub, qtype)
    x = rng.standard_normal((*rows, k)).astype(np.float32)
    x[..., :32] *= 20.0  # one loud group: per-group factors must not leak across groups
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    func = pk.compute("matmul", rows)
    configs = [{}]
    if rows != (1, 1):
        configs.append({"unpack_once": 0})  # the per-row kernel too (unpack_once=1 is the default)
    for cfg in configs:
        y = _run(pk, func, host, cfg, x, *_arrays(pk), np.zeros((*rows, n), np.float32))
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), (qtype, cfg)


@pytest.mark.parametrize("qtype", sorted(PLANE_TYPES))
@pytest.mark.parametrize("lanes", [4, 8])
def test_bit_plane_kernels_at_narrow_vectors(host, qtype, lanes):
    """The bit-plane reads at NEON's 4 and AVX2's 8 float lanes (several vectors a plane run): GEMV and
    dequantize. Q5_1 at K = 576 (4.5 one-bit runs): the GEMV's groups are not unrolled, its shifts variable."""
    n, k = 24, 576 if qtype == "Q5_1" else 768
    rng = np.random.default_rng(lanes)
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_packed(sub, qtype)
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    y = _run(pk, pk.compute("matmul", (1, 1)), host, {}, x, *_arrays(pk), np.zeros((1, 1, n), np.float32), lanes=lanes)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    out = _run(pk, pk.compute("dequant", (None, None)), host, {}, *_arrays(pk), np.zeros((n, k), np.float32),
               lanes=lanes)
    np.testing.assert_array_equal(out, w)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_batched_gemv_matches_float64(host, qtype):
    """paged_decode's x [batch, 1, K], batch symbolic (3 rows at run time)."""
    n, k = 32, 512
    rng = np.random.default_rng(4)
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_packed(sub, qtype)
    x = rng.standard_normal((3, 1, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    for cfg in [{}, {"unpack_once": 0}] if pk.family == "q4" else [{}]:
        y = _run(pk, pk.compute("matmul", (None, 1)), host, cfg, x, *_arrays(pk), np.zeros((3, 1, n), np.float32))
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), cfg


def test_q4_k_m_model_matches_reference(tmp_path):
    """A tiny llama quantized to Q4_K_M by llama.cpp (Q4_K and Q6_K matrices), compiled with float
    activations: every matrix stays blocks (no float32 copy) and the logits agree with the float64
    reference on the file's dequantized weights."""
    import ctypes
    import json

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.reference import ReferenceModel
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    src, _ = write_tiny_gguf(tmp_path / "f32.gguf", hidden=256, ffn=512, heads=4, kv_heads=2, layers=1, seed=1,
                             vocab=320, tied=False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    dst = tmp_path / "q4km.gguf"
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    desc = load_gguf(dst)
    types = {v[0] for v in desc.quantized.values()}
    assert {"Q4_K", "Q6_K"} <= types, types
    out = tmp_path / "artifact"
    compile_model(desc, "host", out, quantization="gguf", activations="f32", batching=False, progress=False)
    manifest = json.loads((out / "perfx-config.json").read_text())
    float_mats = [w["name"] for w in manifest["weights"] if w["dtype"] == "float32" and len(w["shape"]) == 2]
    assert all("rope" in n for n in float_mats), float_mats
    scales = {w["name"] for w in manifest["weights"] if w["name"].endswith("_scale") and w["dtype"] == "int8"}
    assert len(scales) >= 7, scales  # superblock scale tables: every matrix of the file
    engine, ref = Engine(out), ReferenceModel(desc)

    def rel(a: np.ndarray, r: np.ndarray) -> float:
        return float(np.abs(a - r).max() / np.abs(r).max())

    ids = [3, 17, 42, 5, 9, 60, 1]
    assert rel(engine.prefill(ids), ref.forward(ids)[-1]) < 1e-3
    for tok in (7, 11):
        assert rel(engine.decode(tok), ref.forward([tok])[-1]) < 1e-3


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_1"])
def test_reference_dequant_is_exact(host, qtype):
    """The reference PrimFunc (what the tuner checks candidates against, and what runs where a
    template declines) reads the same layout: bit for bit too."""
    import tvm

    n, k = 16, 512
    sub, w = fake_subscaled(qtype, n, k, np.random.default_rng(5))
    pk = subscaled_packed(sub, qtype)
    rt = build_func(pk.compute("dequant", (None, None)), host)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((n, k), np.float32), dev)
    rt["main"](*[tvm.runtime.tensor(a, dev) for a in _arrays(pk)], out)
    np.testing.assert_array_equal(out.numpy(), w)


@pytest.mark.parametrize("name", ["arm64-neon", "riscv64-rvv"])
def test_bit_plane_gemv_builds_for_arm_and_riscv(name):
    """The CPUs this layout is for: the bit-plane GEMVs (Q6_K, Q2_K, Q5_1's variable-shift fallback and
    IQ4_XS's table lookup: one ``tbl`` per 16 codes on arm64, a select chain on RISC-V) cross-compile with
    LLVM for the target's triple into code using its FMA (whole models run under qemu in tests/targets)."""
    import tvm

    target = load_target(name)
    fma = {"arm64-neon": ("fmla",), "riscv64-rvv": ("vfmacc", "vfmadd")}[name]
    for qtype, k in (("Q6_K", 512), ("Q2_K", 512), ("Q5_1", 576), ("IQ4_XS", 512)):
        sub, _ = fake_subscaled(qtype, 16, k, np.random.default_rng(0))
        pk = subscaled_packed(sub, qtype)
        func = pk.compute("matmul", (1, 1))
        template = _template(pk)
        wl = template.match(func, target)
        kernel = template.apply(func, wl, template.default_config(wl, target), target)
        ex = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target.tvm())
        asm = ex.mod.inspect_source("asm")
        assert any(op in asm for op in fma), (name, qtype)
        if qtype == "IQ4_XS" and name == "arm64-neon":
            assert "tbl\t" in asm, "IQ4 indices are looked up with tbl"
