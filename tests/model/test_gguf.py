"""GGUF loading: dequantizers vs independent references, Q/K permutation, tiny files, corrupt files, SmolLM2."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from perfx_compiler.errors import (
    ContextLengthError,
    ModelFormatError,
    UnsupportedModelError,
)
from perfx_compiler.model.gguf import (
    PASSTHROUGH_TYPES,
    dequantize_tensor,
    load_gguf,
    permute_qk,
    unpermute_qk,
)
from perfx_compiler.model.testing import write_tiny_gguf

# ---- independent reference dequantizers, written from ggml-quants.c's block definitions ----


def _f16(b: np.ndarray, off: int) -> np.float32:
    return np.float32(b[off:off + 2].copy().view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def ref_q8_0(b: np.ndarray) -> list[np.float32]:
    d = _f16(b, 0)
    return [d * np.float32(q) for q in b[2:34].view(np.int8)]


def ref_q4_0(b: np.ndarray) -> list[np.float32]:
    d, qs = _f16(b, 0), b[2:18]
    return [np.float32(int(q & 0xF) - 8) * d for q in qs] + [np.float32(int(q >> 4) - 8) * d for q in qs]


def ref_q4_1(b: np.ndarray) -> list[np.float32]:
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20]
    return [d * np.float32(q & 0xF) + m for q in qs] + [d * np.float32(q >> 4) + m for q in qs]


def _q5(qs: np.ndarray, qh: int) -> list[int]:
    lo = [int(qs[j] & 0xF) | (((qh >> j) << 4) & 0x10) for j in range(16)]
    hi = [int(qs[j] >> 4) | ((qh >> (j + 12)) & 0x10) for j in range(16)]
    return lo + hi


def ref_q5_0(b: np.ndarray) -> list[np.float32]:
    d, qh = _f16(b, 0), int(b[2:6].copy().view(np.uint32)[0])
    return [np.float32(x - 16) * d for x in _q5(b[6:22], qh)]


def ref_q5_1(b: np.ndarray) -> list[np.float32]:
    d, m, qh = _f16(b, 0), _f16(b, 2), int(b[4:8].copy().view(np.uint32)[0])
    return [np.float32(x) * d + m for x in _q5(b[8:24], qh)]


def ref_q4_k(b: np.ndarray) -> list[np.float32]:
    d, dmin, scales, q = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    out = []
    for j in range(4):  # 64 values per step: low nibbles then high nibbles of 32 bytes
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        d1, mm1, d2, mm2 = d * np.float32(sc1), dmin * np.float32(m1), d * np.float32(sc2), dmin * np.float32(m2)
        qq = q[32 * j:32 * j + 32]
        out += [d1 * np.float32(x & 0xF) - mm1 for x in qq] + [d2 * np.float32(x >> 4) - mm2 for x in qq]
    return out


def ref_q5_k(b: np.ndarray) -> list[np.float32]:
    d, dmin, scales, qh, ql = _f16(b, 0), _f16(b, 2), b[4:16], b[16:48], b[48:176]
    out = []
    for j in range(4):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        d1, mm1, d2, mm2 = d * np.float32(sc1), dmin * np.float32(m1), d * np.float32(sc2), dmin * np.float32(m2)
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        qq = ql[32 * j:32 * j + 32]
        out += [d1 * np.float32((qq[e] & 0xF) + (16 if qh[e] & u1 else 0)) - mm1 for e in range(32)]
        out += [d2 * np.float32((qq[e] >> 4) + (16 if qh[e] & u2 else 0)) - mm2 for e in range(32)]
    return out


def ref_q6_k(b: np.ndarray) -> list[np.float32]:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    y = [np.float32(0)] * 256
    for n in range(2):  # two halves of 128 values
        L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for e in range(32):
            i = e // 16
            q1 = int((L[e] & 0xF) | (((H[e] >> 0) & 3) << 4)) - 32
            q2 = int((L[e + 32] & 0xF) | (((H[e] >> 2) & 3) << 4)) - 32
            q3 = int((L[e] >> 4) | (((H[e] >> 4) & 3) << 4)) - 32
            q4 = int((L[e + 32] >> 4) | (((H[e] >> 6) & 3) << 4)) - 32
            for k, q in ((0, q1), (2, q2), (4, q3), (6, q4)):
                y[128 * n + e + 16 * k] = d * np.float32(S[i + k]) * np.float32(q)
    return y


def ref_bf16(b: np.ndarray) -> list[np.float32]:
    return list((b.view(np.uint16).astype(np.uint32) << 16).view(np.float32))


# type -> (reference, bytes per block, offsets of f16 scale fields that must be finite)
REFS = {
    "Q8_0": (ref_q8_0, 34, (0,)), "Q4_0": (ref_q4_0, 18, (0,)), "Q4_1": (ref_q4_1, 20, (0, 2)),
    "Q5_0": (ref_q5_0, 22, (0,)), "Q5_1": (ref_q5_1, 24, (0, 2)), "Q4_K": (ref_q4_k, 144, (0, 2)),
    "Q5_K": (ref_q5_k, 176, (0, 2)), "Q6_K": (ref_q6_k, 210, (208,)), "BF16": (ref_bf16, 2, ()),
}


def _random_blocks(rng: np.random.Generator, qtype: str, n: int) -> np.ndarray:
    _, size, scale_offs = REFS[qtype]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in scale_offs:
        raw[:, off:off + 2] = rng.normal(0, 0.05, size=(n, 1)).astype(np.float16).view(np.uint8)
    if qtype == "BF16":  # finite values only
        raw = rng.normal(size=(n, 1)).astype(np.float32).view(np.uint16)[:, 1:].copy().view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", sorted(REFS))
def test_dequantize_matches_reference(qtype: str) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(sum(qtype.encode()))
    n = 6
    raw = _random_blocks(rng, qtype, n)
    assert raw.shape == (n, size)
    ref = np.array([v for blk in raw for v in REFS[qtype][0](blk)], dtype=np.float32)
    tensor = SimpleNamespace(name="t", tensor_type=qt, shape=np.array([block * n // 2, 2]), data=raw.reshape(2, -1))
    got = dequantize_tensor(tensor).reshape(-1)
    np.testing.assert_array_equal(got, ref)


def test_unsupported_type_names_type_and_tensor() -> None:
    from gguf.constants import GGMLQuantizationType

    t = SimpleNamespace(name="blk.3.ffn_up.weight", tensor_type=GGMLQuantizationType.IQ2_XS,
                        shape=np.array([256, 1]), data=np.zeros((1, 74), np.uint8))
    with pytest.raises(UnsupportedModelError, match=r"blk\.3\.ffn_up\.weight.*IQ2_XS"):
        dequantize_tensor(t)


# ---- Q/K permutation ----


def test_permutation_round_trip_and_rope_equivalence() -> None:
    rng = np.random.default_rng(1)
    heads, hd, hidden = 3, 8, 16
    w = rng.standard_normal((heads * hd, hidden))
    assert not np.array_equal(permute_qk(w, heads), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, heads), heads), w)
    # Interleaved (GPT-J) RoPE on permuted rows == rotate-half RoPE on HF rows, up to the same permutation.
    x, pos = rng.standard_normal(hidden), 5
    ang = pos * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(ang), np.sin(ang)
    q = (w @ x).reshape(heads, hd)
    a, b = q[:, : hd // 2], q[:, hd // 2:]
    hf = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1).reshape(-1)
    qp = (permute_qk(w, heads) @ x).reshape(heads, hd // 2, 2)
    e, o = qp[..., 0], qp[..., 1]
    inter = np.stack([e * cos - o * sin, o * cos + e * sin], axis=-1).reshape(-1)
    np.testing.assert_allclose(unpermute_qk(inter, heads), hf, atol=1e-12)


# ---- tiny files ----

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_tiny_gguf_loads_exact(tmp_path: Path, qtype: str) -> None:
    kw = {"hidden": 256, "ffn": 256} if qtype.endswith("_K") else {}
    path, expected = write_tiny_gguf(tmp_path / "m.gguf", qtype=qtype, **kw)
    desc = load_gguf(path)
    assert set(desc.weights) == set(expected)
    for name, w in expected.items():
        assert desc.weights[name].dtype == np.float32
        np.testing.assert_array_equal(desc.weights[name], w, err_msg=name)
    c = desc.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 2, 4, 2, kw.get("hidden", 64) // 4)
    assert c.tie_word_embeddings and "lm_head.weight" not in desc.weights
    assert c.max_context == 2048 and c.bos_token_id == 1 and c.eos_token_ids == [2, 0]
    assert desc.chat_template and "<|im_start|>" in desc.chat_template
    if qtype in PASSTHROUGH_TYPES:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        assert "model.layers.0.self_attn.q_proj.weight" in desc.quantized
        for name, (tname, raw, shape) in desc.quantized.items():
            assert tname == qtype and raw.dtype == np.uint8
            back = dequantize(np.asarray(raw), GGMLQuantizationType[tname]).reshape(shape)
            np.testing.assert_array_equal(back, desc.weights[name], err_msg=name)  # raw rows are un-permuted too
    else:
        assert desc.quantized == {}


def test_untied_and_context(tmp_path: Path) -> None:
    path, expected = write_tiny_gguf(tmp_path / "m.gguf", tied=False, context_length=512, seed=3)
    desc = load_gguf(path)
    assert not desc.config.tie_word_embeddings and desc.config.max_context == 512
    np.testing.assert_array_equal(desc.lm_head(), expected["lm_head.weight"])
    path, _ = write_tiny_gguf(tmp_path / "b.gguf", context_length=8192)
    assert load_gguf(path).config.max_context == 2048
    assert load_gguf(path, max_context=4096).config.max_context == 4096
    with pytest.raises(ContextLengthError):
        load_gguf(path, max_context=100000)


def test_qwen2_with_bias(tmp_path: Path) -> None:
    path, expected = write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", with_bias=True, qtype="Q8_0")
    desc = load_gguf(path)
    assert desc.config.architecture == "qwen2" and desc.config.attention_bias
    for kind in ("q", "k", "v"):
        name = f"model.layers.1.self_attn.{kind}_proj.bias"
        np.testing.assert_array_equal(desc.weights[name], expected[name])
    for name, w in expected.items():  # qwen2 files are not permuted; nothing may be undone
        np.testing.assert_array_equal(desc.weights[name], w, err_msg=name)


def test_rope_scaling(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path / "l.gguf", rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert load_gguf(path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    sc = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    path, _ = write_tiny_gguf(tmp_path / "l3.gguf", hidden=256, heads=2, kv_heads=1, rope_theta=500000.0, rope_scaling=sc)
    desc = load_gguf(path)
    assert desc.config.rope_scaling == sc and "rope_freqs.weight" not in desc.weights


# ---- corrupt and unsupported files ----


def _one_line_error(exc_type: type[Exception], path: Path) -> str:
    with pytest.raises(exc_type) as info:
        load_gguf(path)
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


def test_empty_and_wrong_magic(tmp_path: Path) -> None:
    (tmp_path / "e.gguf").write_bytes(b"")
    assert "empty" in _one_line_error(ModelFormatError, tmp_path / "e.gguf")
    (tmp_path / "w.gguf").write_bytes(b"GGML" + bytes(100))
    assert "magic" in _one_line_error(ModelFormatError, tmp_path / "w.gguf")
    (tmp_path / "s.gguf").write_bytes(b"GG")
    _one_line_error(ModelFormatError, tmp_path / "s.gguf")
    _one_line_error(ModelFormatError, tmp_path / "missing.gguf")


def test_truncated_at_many_points(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    data = path.read_bytes()
    cut_points = [4, 8, 15, 24, 100, 2000, len(data) // 3, len(data) // 2, len(data) - 1000, len(data) - 1]
    for cut in cut_points:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        _one_line_error(ModelFormatError, bad)


def test_garbage_header(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for i in range(5):
        bad = tmp_path / f"g{i}.gguf"
        bad.write_bytes(b"GGUF" + np.uint32(3).tobytes() + rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
        _one_line_error(ModelFormatError, bad)


def test_unsupported_architecture_by_name(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "mamba" in _one_line_error(UnsupportedModelError, path)


# ---- the real SmolLM2-135M-Instruct ----


@pytest.fixture(scope="module")
def smollm():
    from perfx_compiler.model.loader import default_model_path

    try:
        path = default_model_path()
    except ModelFormatError as e:
        pytest.skip(str(e))
    return load_gguf(path)


def test_smollm2_config(smollm) -> None:
    c = smollm.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.max_context) == (1536, 49152, 100000.0, 2048)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert c.bos_token_id == 1 and c.eos_token_ids[0] == 2 and not c.add_bos_token
    assert 130e6 < smollm.parameter_count() < 140e6
    assert smollm.quantized["model.embed_tokens.weight"][0] == "Q8_0"
    assert smollm.quantized["model.layers.0.self_attn.q_proj.weight"][0] == "Q4_1"
    assert len(smollm.quantized) == 1 + 30 * 7


def test_smollm2_greedy_continuation(smollm) -> None:
    """End to end: un-permuted weights + tokenizer give the documented float reference continuation."""
    from perfx_compiler.model.reference import ReferenceModel, greedy
    from perfx_compiler.model.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm.tokenizer_json)
    ids = tok.encode("Once upon a time, there was a little girl named").ids
    out = greedy(ReferenceModel(smollm, np.float32), ids, 6)
    assert tok.decode(out) == " Emma who loved to play in"


def test_mistral_arch_and_writable_weights(tmp_path: Path) -> None:
    path, expected = write_tiny_gguf(tmp_path / "m.gguf", arch="mistral")
    desc = load_gguf(path)
    assert desc.config.architecture == "mistral"
    for name, w in expected.items():
        np.testing.assert_array_equal(desc.weights[name], w, err_msg=name)
    assert all(w.flags.writeable for w in desc.weights.values())  # not views of the read-only mapping
