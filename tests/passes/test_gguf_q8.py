"""GGUF passthrough (Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks used as they are) and q8: block unpacking against
the gguf package, logits against the float64 reference on the dequantized weights, kernels
scheduled by the quantized templates, option resolution and one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.gguf_blocks import dequantize_blocks, unpack_blocks
from perfx_compiler.formats.int4 import pack_int4, unpack_int4
from perfx_compiler.formats.int8 import dequantize_int8, quantize_int8
from perfx_compiler.model.description import ModelDescription
from tests.passes.conftest import ALL_PASSES, lower, max_rel_err, tiny_desc

GGUF_PASSES = [*ALL_PASSES, "gguf_passthrough", "quantize_int8"]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_blocks_match_gguf_dequantize(qtype: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 192)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[qtype])
    want = dequantize(raw, GGMLQuantizationType[qtype]).reshape(w.shape)
    assert np.array_equal(dequantize_blocks(qtype, raw, w.shape), want)  # bit for bit
    if qtype not in ("Q8_0", "Q5_0"):
        codes = unpack_blocks(qtype, raw, w.shape)[0]
        assert np.array_equal(unpack_int4(pack_int4(codes, 8), 192, 8), codes)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelDescription]:
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf

    root = tmp_path_factory.mktemp("gguf")
    cases = {
        "Q4_0+Q8_0": {"qtype": "Q4_0", "embed_qtype": "Q8_0", "tied": True},  # the llama.cpp default mix
        "Q4_1": {"qtype": "Q4_1", "tied": False, "seed": 1},  # SmolLM2's type, separate lm_head
        "Q8_0": {"qtype": "Q8_0", "tied": True, "seed": 2, "hidden": 128, "ffn": 256},  # K % 128 == 0
        "Q5_0+Q8_0": {"qtype": "Q5_0", "embed_qtype": "Q8_0", "tied": True, "seed": 3},  # Q4_K_M files' Q5_0 layers
    }
    out = {}
    for key, kw in cases.items():
        # vocab 320: a multiple of 64 rows (the tiny vocabulary's 284 trips an unrelated float GEMV bug)
        path, _ = write_tiny_gguf(root / f"{key.replace('+', '_')}.gguf", vocab=320, **kw)
        out[key] = load_gguf(path)
    return out


@pytest.mark.parametrize("key", ["Q4_0+Q8_0", "Q4_1", "Q8_0", "Q5_0+Q8_0"])
def test_passthrough_logits_equal_dequantized_reference(compiled: Any, tiny_ggufs: dict, key: str) -> None:
    """The artifact computes with the file's own weights: the reference on the dequantized GGUF
    (what load_gguf gives as floats) agrees within float rounding."""
    import json

    from perfx_compiler.runtime.engine import Engine

    desc = tiny_ggufs[key]
    art = compiled(f"gguf_{key}", desc, GGUF_PASSES, "gguf")
    manifest = json.loads((Path(art) / "perfx-config.json").read_text())
    assert manifest["quantization"] == "gguf"
    dtypes = {w["dtype"] for w in manifest["weights"]}
    assert "float32" in dtypes and ({"uint32", "int8"} & dtypes)
    float_mats = [w["name"] for w in manifest["weights"] if w["dtype"] == "float32" and len(w["shape"]) == 2]
    assert float_mats == ["rope_cos", "rope_sin"] or all("rope" in n for n in float_mats)
    assert max_rel_err(Engine(art), desc) < 1e-3


def test_passthrough_ir_uses_quantized_kernels(tiny_ggufs: dict) -> None:
    from perfx_compiler import compile_report as report
    from perfx_compiler.schedule import schedule_func
    from perfx_compiler.targets import load_target

    st = lower(tiny_ggufs["Q4_0+Q8_0"], GGUF_PASSES, "gguf")
    decode = report.kernel_breakdown(st.notes["after_passes"], "decode")
    layers = tiny_ggufs["Q4_0+Q8_0"].config.num_layers
    assert sum(v for k, v in decode.items() if k.startswith("q4_matmul")) == 4 * layers  # qkv, o, gate_up, down
    assert sum(v for k, v in decode.items() if k.startswith("q8_matmul")) == 1  # tied lm_head (Q8_0)
    assert sum(v for k, v in decode.items() if k.startswith("q8_take")) == 1
    prefill = report.kernel_breakdown(st.notes["after_passes"], "prefill")
    assert not any(k.startswith("q4_matmul") for k in prefill)  # many rows: dequantize + float GEMM
    assert sum(v for k, v in prefill.items() if k.startswith("q8_matmul")) == 1  # last-token lm_head: GEMV
    target = load_target("host")
    names = set()
    for gv, func in st.mod.functions_items():
        if func.attrs is not None and "perfx.quant" in func.attrs:
            names.add((gv.name_hint.split("_")[0], schedule_func(func, target)[1]))
    assert names == {("q4", "gemv_int4_cpu"), ("q8", "gemv_int8_cpu")}


def test_quantization_resolution_and_errors(tiny_ggufs: dict) -> None:
    from perfx_compiler.pipeline import resolve_quantization

    assert resolve_quantization("auto", tiny_ggufs["Q4_1"]) == "gguf"
    assert resolve_quantization("auto", tiny_desc()) == "f32"
    assert resolve_quantization(None, tiny_desc()) == "f32"
    assert resolve_quantization("q8", tiny_ggufs["Q4_1"]) == "q8"
    with pytest.raises(PerfXError, match="needs a GGUF model"):
        lower(tiny_desc(), GGUF_PASSES, "gguf")
    with pytest.raises(PerfXError, match="group size 128 does not divide"):
        lower(tiny_desc(), GGUF_PASSES, "q8_g128")  # K = 64


def test_q8_roundtrip() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    codes, scale = quantize_int8(w, 32)
    assert codes.dtype == np.int8 and scale.shape == (16, 8)
    step = np.repeat(scale.astype(np.float32), 32, axis=1)
    assert np.all(np.abs(dequantize_int8(codes, scale, 32) - w) <= 0.5 * step * 1.01 + 1e-6)


def test_q8_row_chunks_quantize_each_group_as_the_plain_formula() -> None:
    """Rows go a few at a time (bounded temporaries); every group, at a chunk's edge or not, a zero group
    included, gets scale fp16(max|w| / 127) and codes round(w / scale), as a per-group loop computes them."""
    rng = np.random.default_rng()
    w = rng.standard_normal((37, 96)).astype(np.float32)
    w[5, 32:64] = 0.0
    codes, scale = quantize_int8(w, 32, chunk_weights=200)  # 2 rows a chunk, the last one alone
    for r in range(37):
        for g in range(3):
            x = w[r, 32 * g : 32 * (g + 1)].astype(np.float64)
            s = np.float16(np.abs(x).max() / 127.0)
            assert scale[r, g] == s
            want = np.clip(np.rint(x / (float(s) or 1.0)), -127, 127)
            assert np.array_equal(codes[r, 32 * g : 32 * (g + 1)], want), (r, g)


def test_q8_logits_match_dequantized_reference(compiled: Any) -> None:
    from perfx_compiler.runtime.engine import Engine

    desc = tiny_desc(tied=True, seed=3)
    weights = {}
    for name, w in desc.weights.items():
        weights[name] = dequantize_int8(*quantize_int8(w, 32), 32) if w.ndim == 2 else w
    art = compiled("q8", desc, GGUF_PASSES, "q8")
    assert max_rel_err(Engine(art), ModelDescription(config=desc.config, weights=weights, source="q8")) < 1e-3


def test_q5_0_and_q8_0_weights_of_one_shape_get_kernels_of_their_own() -> None:
    """Kernels are named by family, shape and format tag: a Q5_0 weight (5-bit planes on CPUs) must not
    share the name of a same-shape Q8_0 weight's kernel (byte codes), as Gemma 3's Q4_K_M file has them
    (k_proj Q5_0, v_proj Q8_0: the compile once failed with their arrays crossed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from perfx_compiler.formats.gguf_blocks import packed_from_blocks

    w = np.random.default_rng(2).standard_normal((16, 640)).astype(np.float32)
    tags = {q: packed_from_blocks(q, quantize(w, GGMLQuantizationType[q]), w.shape).tag for q in ("Q5_0", "Q8_0")}
    assert tags["Q5_0"] != tags["Q8_0"], tags
