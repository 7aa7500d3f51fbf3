"""Quantized prefill reads panels: the dequantize kernels write W as [N / nb, K, nb] (nb =
``panel_width(target)``, the layout weight_layout packs float weights into) and the prefill GEMM
reads them like a compile-time packed weight.

* every format's dequantize-to-panels kernel (the template's, as the pipeline builds it) equals
  numpy's float64 dequantization of fresh random codes, panel-packed;
* a tiny GGUF model (quantization gguf) lowers with no [N, K] float weight, permute or
  unpacked matmul left on its prefill path, and matches the float64 reference model.
"""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.formats.gguf_blocks import Q4_0, Q4_1
from perfx_compiler.formats.half import from_half, half_packed
from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, int4_packed, quantize_int4
from perfx_compiler.formats.int8 import dequantize_int8, int8_packed, quantize_int8
from perfx_compiler.formats.panels import pack_weight
from perfx_compiler.passes.weight_layout import packed_dequant
from perfx_compiler.tune.measure import build_func

N, K = 384, 256  # several panels at every nb; K covers two g128 groups


def _weights(fmt: str, rng: np.random.Generator):
    """(Packed, float64 dequantized W) of fresh random codes in format ``fmt``."""
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    if fmt in ("bf16", "f16"):
        pk = half_packed(w, fmt)
        return pk, from_half(pk.arrays[0][1], fmt).astype(np.float64)
    if fmt == "Q8_0":
        codes, scale = quantize_int8(w, 32)
        return int8_packed(codes, scale, 32), dequantize_int8(codes, scale, 32).astype(np.float64)
    if fmt == "Q4_1":  # w = q * d + m with random mins (the GGUF offset format)
        codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
        d = (rng.random((N, K // 32)) * 0.01 + 1e-3).astype(np.float16)
        m = (-rng.random((N, K // 32)) * 0.08).astype(np.float16)
        idx = np.arange(K) // 32
        return int4_packed(codes, d, m, Q4_1), codes * d.astype(np.float64)[:, idx] + m.astype(np.float64)[:, idx]
    f = {"Q4_0": Q4_0, "q4_sym_g32": Int4Format(32, True), "q4_sym_g128": Int4Format(128, True),
         "q4_g32": Int4Format(32, False), "q4_g128": Int4Format(128, False)}[fmt]
    codes, scale, zero = quantize_int4(w, f)
    return int4_packed(codes, scale, zero, f), dequantize_int4(codes, scale, zero, f.group).astype(np.float64)


def _template(func, target):
    from schedules import gemv_half_cpu, gemv_int4_cpu, gemv_int8_cpu, gemv_qvnni_cpu

    for mod in (gemv_qvnni_cpu, gemv_int4_cpu, gemv_int8_cpu, gemv_half_cpu):
        wl = mod.TEMPLATE.match(func, target)
        if wl is not None:
            return mod.TEMPLATE, wl
    raise AssertionError("no dequantize template matched")


FORMATS = ["Q4_0", "Q4_1", "Q8_0", "q4_sym_g32", "q4_sym_g128", "q4_g32", "q4_g128", "bf16", "f16"]


HALF_FORMATS = ("bf16", "f16")  # float weights: no int8 (VNNI) layout exists for them


@pytest.mark.parametrize(
    "fmt, layout", [(f, "f32") for f in FORMATS] + [(f, "vnni") for f in FORMATS if f not in HALF_FORMATS]
)
def test_dequant_to_panels_matches_numpy(cpu_target, fmt, layout):
    import tvm

    from schedules._matmul import panel_width

    rng = np.random.default_rng()  # fresh codes every run
    pk, wd = _weights(fmt, rng)
    if layout == "vnni":
        assert pk.vnni is not None, f"{fmt} lost its VNNI layout"
        from perfx_compiler.formats.vnni import has_avx512_vnni

        if not has_avx512_vnni(cpu_target):
            pytest.skip("no AVX-512 VNNI on this CPU")
        pk = pk.vnni()
    nb = panel_width(cpu_target)
    func = packed_dequant(pk.compute("dequant", (None, None)), nb)
    template, wl = _template(func, cpu_target)
    assert wl.info["nb"] == nb
    sched = template.apply(func, wl, template.builtin_default(wl, cpu_target), cpu_target)
    assert [int(d) for d in sched.params[-1].shape] == [N // nb, K, nb]
    rt = build_func(sched, cpu_target)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full((N // nb, K, nb), np.nan, np.float32), dev)
    rt["main"](*[tvm.runtime.tensor(a, dev) for _, a in pk.arrays], out)
    want = pack_weight(wd, nb)
    err = np.abs(out.numpy().astype(np.float64) - want).max()
    assert err <= 1e-6 * np.abs(want).max(), (fmt, layout, err)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    root = tmp_path_factory.mktemp("q4panels")
    # vocab 284 (not a multiple of nb: its prefill lm-head keeps [N, K]); ffn 192 = 3 panels at nb 64
    path, _ = write_tiny_gguf(root / "m.gguf", qtype="Q4_1", ffn=192, context_length=96, tied=True, seed=5)
    desc = load_gguf(path)
    art = compile_model(desc, "host", root / "art", progress=False, quantization="gguf", activations="f32")
    return desc, art


def test_prefill_matmuls_read_dequantized_panels(tiny_q4):
    """(a) structure, on the lowered module: every prefill dequantize of a weight whose N is a
    multiple of nb writes [N / nb, K, nb] panels and only packed matmuls read them; no
    transpose or repack kernel touches a dequantized weight."""
    from tvm import relax, tirx

    from perfx_compiler.passes._relax_util import FuncInfo, exported
    from perfx_compiler.passes.weight_layout import is_dequant
    from perfx_compiler.pipeline import lower_model
    from schedules._matmul import panel_width

    desc, _ = tiny_q4
    mod, state = lower_model(desc, "host", quantization="gguf", activations="f32")
    nb = panel_width(state.target)
    seen = 0
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        for var, value in info.values.items():
            if not (isinstance(value, relax.Call) and isinstance(value.args[0], relax.GlobalVar)):
                continue
            callee = mod[value.args[0]]
            if not is_dequant(callee):
                continue
            shape = [int(d) for d in var.ty.shape.values]
            if len(shape) == 2:
                assert shape[0] % nb, f"{fn}: {value.args[0].name_hint} writes [N, K] though N % {nb} == 0"
                continue
            seen += 1
            n, k = shape[0] * shape[2], shape[1]
            assert shape == [n // nb, k, nb]
            for reader in info.readers[var]:
                rcall = info.values[reader]
                rfunc = mod[rcall.args[0]]
                assert isinstance(rfunc, tirx.PrimFunc) and "_packed" in rcall.args[0].name_hint, rcall.args[0]
                pos = [i for i, a in enumerate(rcall.args[1].fields) if a.same_as(var)]
                assert [int(d) for d in rfunc.params[pos[0]].shape] == shape  # read as panels, as stored
                assert "transpose" not in rcall.args[0].name_hint and "permute" not in rcall.args[0].name_hint
    assert seen >= 4 * desc.config.num_layers  # qkv/o/gate-up/down of every layer, at least


def test_tiny_gguf_prefill_and_decode_match_reference(tiny_q4):
    """(c) numerics: 20-token prefill (every position) and decode match float64 at 1e-3."""
    from perfx_compiler.model.reference import ReferenceModel
    from perfx_compiler.runtime.engine import Engine

    desc, art = tiny_q4
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=20 + 8).tolist()
    ref = ReferenceModel(desc).forward(ids)
    eng = Engine(art)
    got = eng.prefill_all(ids[:20])
    steps = np.stack([eng.decode(t) for t in ids[20:]])
    scale = np.abs(ref).max()
    assert np.abs(got - ref[:20]).max() / scale < 1e-3
    assert np.abs(steps - ref[20:]).max() / scale < 1e-3
