"""quantize_int4: packing round trips, bytes per parameter, option errors, IR structure and
logits vs the float64 reference run on the dequantized weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from perfx_compiler import compile_report as report
from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int4 import (
    Int4Format,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from perfx_compiler.model.description import ModelDescription
from perfx_compiler.passes.quantize_int4 import parse
from tests.passes.conftest import ALL_PASSES, lower, max_rel_err, tiny_desc


def dequantized(desc: ModelDescription, fmt: Int4Format) -> ModelDescription:
    """The model the int4 artifact computes: every matrix (the linears', and the embedding, tied or only
    gathered) round-tripped."""
    weights = {}
    for name, w in desc.weights.items():
        weights[name] = dequantize_int4(*quantize_int4(w, fmt), fmt.group) if w.ndim == 2 else w
    return ModelDescription(config=desc.config, weights=weights, source="dequantized")


@pytest.mark.parametrize("group,sym", [(32, False), (64, True), (128, False)])
def test_pack_roundtrip_and_error(group: int, sym: bool) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 576)).astype(np.float32)  # K=576: g128 leaves a group of 64
    fmt = Int4Format(group, sym)
    codes, scale, zero = quantize_int4(w, fmt)
    lanes = fmt.lanes(576)
    assert lanes == 8
    assert np.array_equal(unpack_int4(pack_int4(codes, lanes), 576, lanes), codes)
    assert codes.max() <= 15 and scale.dtype == np.float16 and zero.dtype == np.uint8
    back = dequantize_int4(codes, scale, zero, group)
    # 4 bits over a group's range: error at most half a step (+ fp16 scale rounding)
    step = np.repeat(scale.astype(np.float32), group, axis=1)[:, :576]
    assert np.all(np.abs(back - w) <= 0.5 * step * 1.01 + 1e-6)


def test_bytes_per_param_g128() -> None:
    w = np.zeros((1536, 576), np.float32)
    codes, scale, zero = quantize_int4(w, Int4Format(128, False))
    packed = pack_int4(codes, 8)
    assert (packed.nbytes + scale.nbytes + zero.nbytes) / w.size <= 0.53


def test_quantization_names() -> None:
    assert parse("q4_g64") == Int4Format(64, False)
    assert parse("q4_sym_g128") == Int4Format(128, True)
    assert parse("f32") is None
    with pytest.raises(PerfXError, match="unknown quantization 'q4_g96'"):
        parse("q4_g96")
    assert parse("q8") is None and parse("gguf") is None  # other passes' schemes: valid, not int4 RTN
    with pytest.raises(PerfXError, match="multiple of 32"):
        Int4Format(32, False).lanes(100)


def test_unknown_quantization_is_refused_before_the_model_is_read(tmp_path) -> None:
    from perfx_compiler.pipeline import compile_model

    with pytest.raises(PerfXError, match="unknown quantization 'q4_k_xl'; use one of auto, .*q4_k_m, q5_k_m"):
        compile_model(str(tmp_path / "no-such-model.gguf"), "host", tmp_path / "out", quantization="q4_k_xl")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def q4_state() -> Any:
    return lower(tiny_desc(tied=True), ALL_PASSES, "q4_g128")


def test_ir_structure(q4_state: Any) -> None:
    st = q4_state
    assert "model_embed_tokens_weight" not in st.weights  # tied embedding gathered from int4
    assert st.weights["model_embed_tokens_weight_q4"].dtype == np.uint32
    decode = report.kernel_breakdown(st.notes["after_passes"], "decode")
    assert sum(v for k, v in decode.items() if k.startswith("q4_matmul")) == 2 * 4 + 1
    assert sum(v for k, v in decode.items() if k.startswith("q4_take")) == 1
    prefill = report.kernel_breakdown(st.notes["after_passes"], "prefill")
    assert sum(v for k, v in prefill.items() if k.startswith("q4_dequant")) == 2 * 4
    # the last-token lm_head reads one row (its row count is an expression equal to 1): GEMV
    assert sum(v for k, v in prefill.items() if k.startswith("q4_matmul")) == 1


@pytest.mark.parametrize(
    "quant,fmt,kw",
    [
        ("q4_g32", Int4Format(32, False), {"tied": True}),
        ("q4_sym_g64", Int4Format(64, True), {"bias": True, "hidden": 96, "ffn": 192}),
        ("q4_g128", Int4Format(128, False), {}),
    ],
)
def test_int4_logits_match_dequantized_reference(compiled: Any, quant: str, fmt: Int4Format, kw: dict) -> None:
    from perfx_compiler.runtime.engine import Engine

    desc = tiny_desc(**kw)
    art = compiled(f"{quant}_{len(kw)}", desc, ALL_PASSES, quant)
    assert max_rel_err(Engine(art), dequantized(desc, fmt)) < 1e-3
