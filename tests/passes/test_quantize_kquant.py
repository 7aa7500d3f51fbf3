"""quantizations ``q4_k`` / ``q5_k`` / ``q6_k`` (passes/quantize_kquant.py): float weights quantized to GGUF Q4_K /
Q5_K / Q6_K blocks at compile time (K % 256 == 0; the others int8 groups of 32), run on the VNNI kernels under
int8 activations and on the float-activation kernels elsewhere (a CPU target without VNNI).

The model checks compare with the float64 reference run on the weights the artifact holds (each
linear's Q4_K / Q6_K / int8 blocks dequantized), so the only difference left is the activations.
int8 activations: bound 5e-2 of max |logit|, between test_activations_int8.py's 3e-2 (int8 vs float
activations at hidden 64) and test_prefill_int8_gemm.py's 6e-2: at hidden 256 seven random models gave
0.8e-2 to 2.2e-2 (prefill and 4 decode steps), the same model's q8 build 3.0e-2 against its float
weights. Float activations: 1e-3 (test_gemv_superblocks_f32.py's Q4_K_M model bound; float32 sums
only). The reference on the original (not dequantized) weights is 0.2 away (checked below for the
float build: the bound would catch weights left unquantized or quantized another way), and a broken
kernel order 1."""

from __future__ import annotations

import json

import numpy as np
import pytest

from perfx_compiler.formats import ggml
from perfx_compiler.formats.ggml import q4_k, q5_k, q6_k
from perfx_compiler.formats.int8 import quantize_int8
from perfx_compiler.model.description import ModelDescription
from tests._cpu import needs_vnni

from .conftest import ALL_PASSES, compile_options, tiny_desc

PASSES = [*ALL_PASSES, "quantize_kquant", "quantize_int8"]
HIDDEN, FFN = 256, 320  # down_proj's K = 320 is no multiple of 256: the int8 fallback


QUANTIZE = {"Q4_K": q4_k.quantize, "Q5_K": q5_k.quantize, "Q6_K": q6_k.quantize}


def dequantized(desc: ModelDescription, qtype: str = "Q4_K") -> ModelDescription:
    """The model with every matrix (the linears', and the embedding, tied or only gathered) replaced by what the
    quantization stores for it, dequantized."""
    weights = dict(desc.weights)
    linear = [n for n, a in weights.items() if np.ndim(a) == 2]
    for name in linear:
        w = np.asarray(weights[name], dtype=np.float32)
        if w.shape[1] % 256 == 0:
            weights[name] = ggml.dequantize(qtype, QUANTIZE[qtype](w), w.shape)
        else:
            codes, scale = quantize_int8(w, 32)
            g = codes.reshape(w.shape[0], -1, 32).astype(np.float32) * scale.astype(np.float32)[:, :, None]
            weights[name] = g.reshape(w.shape)
    return ModelDescription(config=desc.config, weights=weights, source=desc.source)


def rel(a: np.ndarray, r: np.ndarray) -> float:
    return float(np.abs(np.asarray(a).reshape(-1) - r).max() / np.abs(r).max())


def logit_errors(art, ref, vocab: int) -> list[float]:
    """Relative logit errors of the artifact against ``ref``: a 12-token prefill, then 4 decode steps."""
    from perfx_compiler.runtime.engine import Engine

    eng = Engine(art)
    ids = np.random.default_rng().integers(0, vocab, size=12).tolist()
    errs = [rel(eng.prefill(ids), ref.forward(ids)[-1])]
    for tok in ids[:4]:
        errs.append(rel(eng.decode(tok), ref.forward([tok])[-1]))
    return errs


def compiled(tmp_path, quantization: str, target: str, activations: str):
    """(A random tiny llama, its artifact compiled with ``quantization``, the artifact's manifest)."""
    from perfx_compiler.pipeline import compile_model

    desc = tiny_desc(hidden=HIDDEN, ffn=FFN, tied=True, seed=int(np.random.default_rng().integers(1 << 30)))
    art = tmp_path / quantization
    compile_model(desc, target, art, **compile_options(progress=False, passes=PASSES, quantization=quantization,
                                                       activations=activations))
    manifest = json.loads((art / "perfx-config.json").read_text())
    assert manifest["quantization"] == quantization
    return desc, art, manifest


def check_stored(manifest: dict, desc: ModelDescription, family: str, codes: str, group: int) -> None:
    """The artifact holds superblock codes (``family``: _q4 int4 or _q8 int8 codes, dtype ``codes``) with
    int8 sub-scales + f16 d, and int8 codes for down_proj (K = 320), no float matrices."""
    stored = {w["name"]: w for w in manifest["weights"]}
    floats = [n for n, w in stored.items() if w["dtype"] == "float32" and len(w["shape"]) == 2
              and not n.startswith("rope_")]  # the RoPE tables are no weights
    assert not floats, floats
    sb = [n for n in stored if n.endswith(family) and "down_proj" not in n]
    assert len(sb) >= 1 + 3 * desc.config.num_layers, sb  # lm-head/embedding, qkv, o, gate|up per layer
    for n in sb:
        assert stored[n]["dtype"] == codes and stored[f"{n}_scale"]["dtype"] == "int8", stored[n]
        # int8 [N, K/G + 2 K/256]: the group values, then the superblock d's float16 bytes
        assert stored[f"{n}_scale"]["shape"][1] == HIDDEN // group + 2 * HIDDEN // 256, stored[f"{n}_scale"]
    down = [n for n in stored if "down_proj" in n and n.endswith("_q8")]
    assert len(down) == desc.config.num_layers, down


@needs_vnni
def test_tiny_q4_k_model_matches_reference_on_dequantized_weights(tmp_path) -> None:
    from perfx_compiler.model.reference import ReferenceModel

    desc, art, manifest = compiled(tmp_path, "q4_k", "host", "int8")
    assert manifest["activations"] == "int8"

    # the artifact holds Q4_K blocks (int4 row pairs, int8 sub-scales / mins + f16 d) and int8 codes, not floats
    stored = {w["name"]: w for w in manifest["weights"]}
    floats = [n for n, w in stored.items() if w["dtype"] == "float32" and len(w["shape"]) == 2
              and not n.startswith("rope_")]  # the RoPE tables are no weights
    assert not floats, floats
    q4 = [n for n in stored if n.endswith("_q4")]
    assert len(q4) >= 1 + 3 * desc.config.num_layers, q4  # lm-head/embedding, qkv, o, gate|up per layer
    for n in q4:
        assert stored[n]["dtype"] == "uint8" and stored[f"{n}_scale"]["dtype"] == "int8"
        assert stored[f"{n}_min"]["dtype"] == "int8"
        assert stored[n]["shape"][1] % 256 == 0  # K: whole superblocks
    down = [n for n in stored if "down_proj" in n and n.endswith("_q8")]
    assert len(down) == desc.config.num_layers and all(stored[n]["dtype"] == "uint8" for n in down)
    q4_bytes = sum(stored[n]["nbytes"] for n in stored if "_q4" in n)
    q4_weights = sum(stored[n]["shape"][0] * 2 * stored[n]["shape"][1] for n in q4)
    assert 8 * q4_bytes / q4_weights < 5.5, 8 * q4_bytes / q4_weights  # ~4.6 bits a weight, not 32

    errs = logit_errors(art, ReferenceModel(dequantized(desc)), desc.config.vocab_size)
    print(f"q4_k: max rel logit error vs the float64 reference on the dequantized weights: {max(errs):.2e}")
    assert max(errs) < 5e-2, errs


@needs_vnni
@pytest.mark.parametrize(("quantization", "suffix", "row_bytes"), [("q5_k", "_q5", 5 * HIDDEN), ("q6_k", "_q6", 3 * HIDDEN)])
def test_tiny_q5_k_q6_k_models_int8_activations(tmp_path, quantization: str, suffix: str, row_bytes: int) -> None:
    """q5_k / q6_k on the VNNI kernels: 5-bit row octets (uint8 [N/8, 5K]) / 6-bit row quads (uint8 [N/4, 3K]),
    int8 sub-scales (and mins) + f16 d."""
    from perfx_compiler.model.reference import ReferenceModel

    desc, art, manifest = compiled(tmp_path, quantization, "host", "int8")
    assert manifest["activations"] == "int8"
    stored = {w["name"]: w for w in manifest["weights"]}
    packed = [n for n in stored if n.endswith(suffix)]
    assert len(packed) >= 1 + 3 * desc.config.num_layers, packed  # lm-head/embedding, qkv, o, gate|up per layer
    assert all(stored[n]["dtype"] == "uint8" and stored[n]["shape"][1] == row_bytes for n in packed), packed
    errs = logit_errors(art, ReferenceModel(dequantized(desc, quantization.upper())), desc.config.vocab_size)
    print(f"{quantization} (int8 activations): max rel logit error vs the float64 reference: {max(errs):.2e}")
    assert max(errs) < 5e-2, errs


@pytest.mark.parametrize("quantization", ["q4_k", "q5_k", "q6_k"])
def test_tiny_kquant_model_float_activations(tmp_path, quantization: str) -> None:
    """A CPU target without VNNI (x86-avx2, runnable here): activations resolve to f32 and the
    float-activation kernels read the blocks (formats/superblocks.py: Q4_K int4 interleaved codes with
    mins, Q6_K 6-bit plane codes); logits within float32 rounding of the reference on the dequantized weights."""
    from perfx_compiler.model.reference import ReferenceModel

    qtype = quantization.upper()
    desc, art, manifest = compiled(tmp_path, quantization, "x86-avx2", "auto")
    assert manifest["activations"] == "f32"
    if qtype == "Q4_K":
        check_stored(manifest, desc, "_q4", "uint32", 32)  # 8 codes a word
    elif qtype == "Q5_K":
        check_stored(manifest, desc, "_q8", "uint8", 32)  # codes in 5-bit planes, with mins
    else:
        check_stored(manifest, desc, "_q8", "uint8", 16)  # codes + 32 in 6-bit planes (formats/bitplanes.py)
    errs = logit_errors(art, ReferenceModel(dequantized(desc, qtype)), desc.config.vocab_size)
    far = logit_errors(art, ReferenceModel(desc), desc.config.vocab_size)  # the unquantized weights
    print(f"{quantization} (f32 activations): max rel logit error {max(errs):.2e} on the dequantized weights, "
          f"{max(far):.2e} on the float weights")
    assert max(errs) < 1e-3, errs
    assert max(far) > 10 * max(errs), (far, errs)  # the bound tells these weights from the float ones


@pytest.mark.parametrize("quantization", ["q5_k", "q6_k"])
def test_kquant_on_a_words_only_gpu_target_packs_32_bit_words(quantization: str) -> None:
    """On WGSL (no 8-bit types) q5_k's / q6_k's blocks take the GPU superblock layout in uint32 words, as a GGUF
    file's Q5_K / Q6_K blocks do there (decode on lavapipe / PoCL: tests/targets/test_gpu_superblocks.py)."""
    from perfx_compiler import pipeline
    from perfx_compiler.targets import load_target

    opts = pipeline.CompileOptions(**compile_options(target="vulkan", passes=PASSES, quantization=quantization,
                                                     progress=False))
    state = pipeline.CompileState(desc=tiny_desc(hidden=HIDDEN, ffn=FFN), target=load_target("vulkan"), options=opts)
    pipeline.phase_import(state)
    pipeline.phase_passes(state)
    mats = {n: np.asarray(w) for n, w in state.weights.items() if np.ndim(w) >= 2 and not n.startswith("rope_")}
    # (down_proj, K = 320: the int8 fallback in q8's GPU layout)
    packed = {n: a for n, a in mats.items() if a.dtype != np.float32 and "down_proj" not in n}
    assert packed and {a.dtype for a in packed.values()} == {np.dtype(np.uint32)}, {n: a.dtype for n, a in packed.items() if a.dtype != np.uint32}
    assert [n for n, a in mats.items() if a.dtype == np.float32 and a.ndim == 2] == []  # (the embedding: blocks)


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_kquant_is_a_known_name(name: str) -> None:
    from perfx_compiler.passes.quantize_int4 import parse

    assert parse(name) is None  # valid, and not int4 RTN


@pytest.mark.parametrize(("mix", "tied"), [("q4_k_m", False), ("q5_k_m", True)])
def test_kquant_mix_holds_llamacpp_files_blocks(tmp_path, mix: str, tied: bool) -> None:
    """--quantization q4_k_m / q5_k_m of a float file packs every matrix exactly as compiling llama.cpp's own
    Q4_K_M / Q5_K_M of that file does: the same weights, of the same types (Q6_K for the output projection, the
    embedding when tied, and for attn_v / ffn_down in layers 0, 3, 6, 7 of 8; Q/K/V left unmerged there; an
    untied embedding in the base type), byte for byte."""
    import json

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model
    from tests.families.family_fixtures import quantize_gguf

    src, _ = write_tiny_gguf(tmp_path / "f32.gguf", hidden=256, ffn=512, heads=4, kv_heads=2, layers=8, vocab=320,
                             tied=tied, seed=int(np.random.default_rng().integers(1 << 30)))
    theirs = quantize_gguf(src, tmp_path / f"{mix}.gguf", mix.upper())
    arts = {}
    for name, model, quantization in (("ours", src, mix), ("theirs", theirs, "gguf")):
        arts[name] = tmp_path / name
        compile_model(str(model), "host", arts[name], quantization=quantization, progress=False, batching=False)

    def linears(art) -> dict[str, bytes]:
        manifest = json.loads((art / "perfx-config.json").read_text())
        blob = (art / "weights.bin").read_bytes()
        return {w["name"]: blob[w["offset"] : w["offset"] + w["nbytes"]] for w in manifest["weights"]
                if "_scale" in w["name"] or any(f"_q{b}" in w["name"] for b in (4, 5, 6, 8))}

    ours, want = linears(arts["ours"]), linears(arts["theirs"])
    assert sorted(ours) == sorted(want)
    assert [n for n in ours if ours[n] != want[n]] == []
    q6 = {n.split("_weight")[0] for n in ours if n.endswith("_q6")}
    assert ("model_embed_tokens" if tied else "lm_head") in q6, q6
    assert {f"model_layers_{i}_self_attn_v_proj" for i in (0, 3, 6, 7)} <= q6, q6
    assert tied or any(n.startswith("model_embed_tokens_weight_q") for n in ours)  # the gathered embedding: blocks
    assert "model_layers_1_self_attn_qkv_proj" in {n.split("_weight")[0] for n in ours}
