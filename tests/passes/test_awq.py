"""AWQ: folding the scales leaves the float model unchanged; the artifact computes exactly the folded,
int4-rounded model; the scale search beats plain round-to-nearest on salient channels; names parse."""

from __future__ import annotations

from typing import Any

import numpy as np

from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, quantize_int4
from perfx_compiler.model.description import ModelDescription
from perfx_compiler.passes.awq import awq_weights, calibration_ids, parse, search_scale
from tests.passes.conftest import ALL_PASSES, max_rel_err, tiny_desc


def salient_desc() -> ModelDescription:
    desc = tiny_desc(tied=True, hidden=128, ffn=256, seed=4)
    for i in range(desc.config.num_layers):  # a few large-activation channels, as in trained LLMs
        desc.weights[f"model.layers.{i}.input_layernorm.weight"][:8] *= 20
        desc.weights[f"model.layers.{i}.post_attention_layernorm.weight"][:8] *= 20
    return desc


def merged_table(desc: ModelDescription) -> dict[str, np.ndarray]:
    w = {n.replace(".", "_"): a for n, a in desc.weights.items()}
    for i in range(desc.config.num_layers):
        p = f"model_layers_{i}_"
        w[p + "self_attn_qkv_proj_weight"] = np.concatenate([w.pop(p + f"self_attn_{x}_proj_weight") for x in "qkv"])
        w[p + "mlp_gate_up_proj_weight"] = np.concatenate([w.pop(p + "mlp_gate_proj_weight"), w.pop(p + "mlp_up_proj_weight")])
    return w


def folded_model(desc: ModelDescription, fmt: Int4Format) -> ModelDescription:
    """The float model with AWQ's scales folded in, in Hugging Face names (no quantization)."""
    c = desc.config
    scaled, alphas = awq_weights(merged_table(desc), desc, fmt)
    assert any(a > 0 for a in alphas.values())  # some scaling was chosen
    back = {name: scaled.get(name.replace(".", "_")) for name in desc.weights}
    for i in range(c.num_layers):
        p, q = f"model.layers.{i}.", f"model_layers_{i}_"
        qkv = scaled[q + "self_attn_qkv_proj_weight"]
        back[p + "self_attn.q_proj.weight"] = qkv[: c.q_size]
        back[p + "self_attn.k_proj.weight"] = qkv[c.q_size : c.q_size + c.kv_size]
        back[p + "self_attn.v_proj.weight"] = qkv[c.q_size + c.kv_size :]
        gu = scaled[q + "mlp_gate_up_proj_weight"]
        back[p + "mlp.gate_proj.weight"], back[p + "mlp.up_proj.weight"] = gu[: c.intermediate_size], gu[c.intermediate_size :]
    return ModelDescription(config=c, weights=back, source="awq-folded")


def test_folding_keeps_the_float_model() -> None:
    from perfx_compiler.model.reference import ReferenceModel

    desc = salient_desc()
    ids = [3, 9, 27, 81, 4, 12]
    want = ReferenceModel(desc).forward(ids)
    got = ReferenceModel(folded_model(desc, Int4Format(128, False))).forward(ids)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_awq_artifact_equals_its_quantized_model(compiled: Any) -> None:
    """Compiled q4_awq_g128 = the folded model with every matrix int4 round-tripped (rows are
    quantized independently, so the merged and the split matrices round alike)."""
    from perfx_compiler.runtime.engine import Engine

    desc, fmt = salient_desc(), Int4Format(128, False)
    folded = folded_model(desc, fmt)
    dq = {n: dequantize_int4(*quantize_int4(w, fmt), fmt.group) if w.ndim == 2 else w for n, w in folded.weights.items()}
    art = compiled("awq", desc, [*ALL_PASSES, "awq"], "q4_awq_g128")
    assert max_rel_err(Engine(art), ModelDescription(config=desc.config, weights=dq)) < 1e-3


def test_search_never_worse_than_round_to_nearest() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:, :4] *= 30  # salient channels
    w = (0.05 * rng.standard_normal((48, 128))).astype(np.float32)
    fmt = Int4Format(128, False)
    s, alpha = search_scale(w, x, fmt)

    def err(scale: np.ndarray) -> float:
        wq = dequantize_int4(*quantize_int4(w * scale, fmt), 128) / scale
        return float(np.square(x @ wq.T - x @ w.T).mean())

    assert alpha > 0 and err(s) < err(np.ones(128, np.float32))


def test_names_and_calibration() -> None:
    assert parse("q4_awq_g128") == Int4Format(128, False)
    assert parse("q4_g128") is None
    ids = calibration_ids(tiny_desc())  # no tokenizer: fixed pseudo-random ids
    assert len(ids) == 64 and ids == calibration_ids(tiny_desc())
