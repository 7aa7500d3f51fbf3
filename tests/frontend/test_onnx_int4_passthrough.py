"""Imported onnxruntime-genai int4 models run PerfX's own int4 kernels over the file's codes.

genai-format graphs (``genai_testgraph``: MatMulNBits with round-to-nearest codes of random
weights, GroupQueryAttention, (Skip)SimplifiedLayerNormalization) are recorded as int4 tables at
import and packed by ``passes/onnx_int4_passthrough`` (quantization ``auto`` -> ``onnx``):

* the tables hold the file's codes bit for bit, and the packed weights dequantize (through the
  kernels' own reference PrimFunc, whatever the packed layout) to the file's weights up to the
  float16 rounding of the scales;
* the compiled model matches onnxruntime on the same file (prefill + 16 decode steps, relative
  error < 1e-3) and the float64 reference on the kernels' weights (< 1e-4), and its linears take
  int4 bytes (<= 0.6 bytes per parameter at block 32, no float copy left).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tvm
from genai_testgraph import GenaiSpec, build_genai_model, kernel_weights_desc

from perfx_compiler.errors import PerfXError, UnsupportedModelError
from perfx_compiler.model.description import ModelDescription
from perfx_compiler.model.foreign_onnx.decoder_io import OrtDecoder
from perfx_compiler.model.onnx_read import load_onnx
from perfx_compiler.model.reference import ReferenceModel
from perfx_compiler.passes.onnx_int4_passthrough import int4_tables, packed_from_table
from perfx_compiler.pipeline import CompileOptions, compile_model, resolve_quantization
from perfx_compiler.runtime.engine import Engine

pytest.importorskip("onnxruntime")
PROMPT = [5, 17, 33, 9, 100, 61, 7]
DECODE_STEPS = 16
# fp32 activations: int8 activation quantization (if the kernels offer it) must not enter this check
F32_ACTIVATIONS = {"activations": "f32"} if "activations" in CompileOptions.__dataclass_fields__ else {}

SPECS = {
    "g32_sym_packed_qkv": GenaiSpec(),
    "g64_zp_separate_qkv_interleaved": GenaiSpec(block=64, zero_points=True, packed_qkv=False, interleaved=True, seed=1),
    "g16_sym_gidx": GenaiSpec(block=16, g_idx=True, seed=2),
    "g128_zp": GenaiSpec(block=128, zero_points=True, seed=3),
}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _hf(name: str) -> list[str]:
    """HF weight names a genai linear became (a packed QKV: q, k, v)."""
    name = name.replace(".attn.", ".self_attn.")
    if name.endswith("qkv_proj"):
        return [f"{name[: -len('qkv_proj')]}{r}_proj.weight" for r in "qkv"]
    return [name + ".weight"]


def dequant_packed(pk) -> np.ndarray:
    """The float weight a Packed holds, through its own reference dequant PrimFunc (any layout)."""
    func = pk.compute("dequant", (None, None))
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "llvm"}))
    args = [tvm.runtime.tensor(a) for _, a in pk.arrays]
    out = tvm.runtime.tensor(np.zeros((pk.n, pk.k), np.float32))
    lib["main"](*args, out)
    return out.numpy()


@pytest.mark.parametrize("key", ["g32_sym_packed_qkv", "g64_zp_separate_qkv_interleaved", "g16_sym_gidx", "g128_zp"])
def test_tables_hold_the_files_codes(key, tmp_path):
    spec = SPECS[key]
    path, files = build_genai_model(tmp_path / key, spec)
    desc = load_onnx(path)
    assert resolve_quantization("auto", desc) == "onnx"
    d = spec.hidden // spec.heads
    for name, (codes, scale, zero) in files.items():
        parts = []
        for hf in _hf(name):
            t = desc.quantized[hf][1]
            arrays = [t.codes, t.scales, t.zero_points()]
            if spec.interleaved and hf.endswith(("q_proj.weight", "k_proj.weight")):
                from perfx_compiler.model.gguf import permute_qk

                arrays = [permute_qk(a, a.shape[0] // d) for a in arrays]  # back to the file's row order
            assert (t.zeros is None) == (zero is None), hf
            parts.append(arrays)
        got_codes, got_scale, got_zero = (np.concatenate(x) for x in zip(*parts, strict=True))
        assert np.array_equal(got_codes, codes), name  # bit for bit
        assert np.array_equal(got_scale, scale.reshape(codes.shape[0], -1)), name
        assert np.array_equal(got_zero, zero if zero is not None else np.full_like(got_zero, 8)), name
    # Packed (merged QKV / gate+up included) vs the file: dequantized both ways.
    tables = int4_tables(desc)
    assert {"model_layers_0_self_attn_qkv_proj_weight", "model_layers_1_mlp_gate_up_proj_weight"} <= set(tables)
    for name in ("model_layers_0_self_attn_qkv_proj_weight", "model_layers_1_mlp_gate_up_proj_weight",
                 "model_layers_0_mlp_down_proj_weight", "lm_head_weight"):
        t = tables[name]
        pk = packed_from_table(t)
        assert pk is not None and pk.family == "q4"
        got = dequant_packed(pk)
        exact = t.dequantize()  # float32 scales: what onnxruntime multiplies by
        idx = np.arange(t.shape[1]) // t.block
        s16 = t.scales.astype(np.float16).astype(np.float32)[:, idx]
        kernel_w = (t.codes.astype(np.float32) - t.zero_points().astype(np.float32)[:, idx]) * s16
        assert np.array_equal(got, kernel_w), name  # same codes and zeros, float16 scales
        bound = np.abs(exact) * 2.0 ** -11 + 1e-30  # float16 rounding of each scale
        assert np.all(np.abs(got - exact) <= bound), name


def check_against_onnxruntime(path: Path, art: Path, desc: ModelDescription) -> tuple[float, float]:
    """(max rel error vs onnxruntime, vs the float64 reference on the kernels' weights), prefill + decode."""
    eng, ort_dec, ref = Engine(art), OrtDecoder(path), ReferenceModel(kernel_weights_desc(desc))
    want = ort_dec.step(PROMPT)[-1]
    got = eng.prefill(PROMPT)[0]
    errs, ref_errs = [_rel(got, want)], [_rel(got, ref.forward(PROMPT)[-1])]
    tok = int(np.argmax(want))
    for _ in range(DECODE_STEPS):
        want = ort_dec.step([tok])[-1]
        got = eng.decode(tok)
        errs.append(_rel(got, want))
        ref_errs.append(_rel(got, ref.forward([tok])[-1]))
        tok = int(np.argmax(want))
    return max(errs), max(ref_errs)


def linear_bytes_per_param(art: Path, desc: ModelDescription) -> tuple[float, list[str]]:
    """(bytes per parameter of the linears in the artifact, float linear weights left)."""
    manifest = json.loads((art / "perfx-config.json").read_text())
    assert manifest["quantization"] == "onnx"
    params = sum(desc.weights[n].size for n in desc.quantized)
    names = {w["name"]: w for w in manifest["weights"]}
    q4 = sum(w["nbytes"] for n, w in names.items() if "_q4" in n)
    floats = [n for n in names if n.endswith(("_proj_weight", "lm_head_weight"))]
    return q4 / params, floats


@pytest.mark.parametrize("key", ["g32_sym_packed_qkv", "g64_zp_separate_qkv_interleaved", "g16_sym_gidx", "g128_zp"])
def test_compiled_int4_matches_onnxruntime(key, tmp_path):
    spec = SPECS[key]
    path, _ = build_genai_model(tmp_path / key, spec)
    desc = load_onnx(path)
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False, **F32_ACTIVATIONS)
    err, ref_err = check_against_onnxruntime(path, art, desc)
    per_param, floats = linear_bytes_per_param(art, desc)
    print(f"{key}: vs onnxruntime {err:.2e}, vs fp64 reference on the kernels' weights {ref_err:.2e}, "
          f"{per_param:.3f} bytes/param")
    assert err < 1e-3 and ref_err < 1e-4
    assert not floats, floats  # every linear runs int4, no float copy
    assert per_param <= 0.5 + 3 / spec.block + 1e-9  # codes + fp16 scale + uint8 zero per block
    if spec.block >= 32:
        assert per_param <= 0.6


def test_accuracy_level_is_ignored_and_gidx_with_zero_points_refused(tmp_path):
    a, _ = build_genai_model(tmp_path / "lvl1", GenaiSpec(accuracy_level=1))
    b, _ = build_genai_model(tmp_path / "lvl4", GenaiSpec(accuracy_level=4))
    qa, qb = load_onnx(a).quantized, load_onnx(b).quantized
    assert qa.keys() == qb.keys()
    assert all(np.array_equal(qa[n][1].codes, qb[n][1].codes) and np.array_equal(qa[n][1].scales, qb[n][1].scales)
               for n in qa)
    bad, _ = build_genai_model(tmp_path / "gz", GenaiSpec(zero_points=True, g_idx=True))
    with pytest.raises(UnsupportedModelError, match="g_idx and packed uint8 zero points"):
        load_onnx(bad)


def test_onnx_quantization_needs_int4_tables(tmp_path):
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path / "f32.gguf", arch="llama", hidden=64, heads=4, kv_heads=2, ffn=96, seed=1)
    desc = load_gguf(path)
    desc.quantized = {}
    with pytest.raises(PerfXError, match="quantization 'onnx' needs an ONNX model with int4 MatMulNBits"):
        compile_model(desc, "host", tmp_path / "art", progress=False, batching=False, quantization="onnx")
    assert not (tmp_path / "art").exists()


def test_failed_package_leaves_no_partial_artifact(tmp_path, monkeypatch):
    import perfx_compiler.package as package

    path, _ = build_genai_model(tmp_path / "m", GenaiSpec(layers=1))

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(package, "_write_weights", disk_full)
    monkeypatch.setattr(package.WeightFile, "_append", disk_full)  # (the weights file written during the passes)
    out = tmp_path / "art"
    with pytest.raises(PerfXError, match="No space left on device"):
        compile_model(str(path), "host", out, progress=False, batching=False)
    assert not out.exists() and not out.with_name("art.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_gguf_quantization_on_onnx_int4_is_one_line_error(tmp_path):
    path, _ = build_genai_model(tmp_path / "m", GenaiSpec(layers=1))
    with pytest.raises(PerfXError, match="run as quantization 'onnx'"):
        compile_model(str(path), "host", tmp_path / "art", progress=False, batching=False, quantization="gguf")
    assert not (tmp_path / "art").exists()
