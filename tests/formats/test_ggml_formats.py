"""perfx_compiler.formats.ggml: every superblock type unpacks to SubScaled arrays of the documented
dtypes/ranges, and dequantizing from them is bit for bit gguf-py's (and llama.cpp's) dequantization,
on random blocks, on the real Gemma 3 Q4_K_M file and on files quantized by llama.cpp itself."""

from __future__ import annotations

import ctypes
import secrets
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from perfx_compiler.errors import ModelFormatError
from perfx_compiler.formats import ggml
from perfx_compiler.formats.ggml._format import SubScaled
from perfx_compiler.formats.ggml.iq4_nl import KVALUES

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "Q5_1"]
SHAPES = [(3, 256), (5, 1024), (1, 512)]
# name -> codes dtype, codes (lo, hi), scales (lo, hi), mins (lo, hi) or None, group, sb; (1, 1): all ones
SPEC = {
    "Q4_K": (np.uint8, (0, 15), (0, 63), (0, 63), 32, 256),
    "Q5_K": (np.uint8, (0, 31), (0, 63), (0, 63), 32, 256),
    "Q6_K": (np.int8, (-32, 31), (-128, 127), None, 16, 256),
    "Q3_K": (np.int8, (-4, 3), (-32, 31), None, 16, 256),
    "Q2_K": (np.uint8, (0, 3), (0, 15), (0, 15), 16, 256),
    "IQ4_NL": (np.int8, (-127, 113), (1, 1), None, 32, 32),
    "IQ4_XS": (np.int8, (-127, 113), (-32, 31), None, 32, 256),
    "Q5_1": (np.uint8, (0, 31), (1, 1), (1, 1), 32, 32),
}
# llama.cpp ftype (LLAMA_FTYPE_MOSTLY_*) whose pure quantization gives each type
FTYPES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K", "Q3_K": "Q3_K_M", "Q2_K": "Q2_K",
          "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "Q5_1": "Q5_1"}


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    seed = secrets.randbits(32)
    print(f"ggml formats test seed: {seed}")  # rerun a failure with np.random.default_rng(seed)
    return np.random.default_rng(seed)


def random_raw(rng: np.random.Generator, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """Uniformly random block bytes, except finite f16 d/dmin of realistic size (1e-4..0.1, either sign)."""
    fmt = ggml.FORMATS[qtype]
    n, k = shape
    b = rng.integers(0, 256, size=(n, k // fmt.block_weights, fmt.block_bytes), dtype=np.uint8)
    for at in fmt.f16_fields:
        mag = 10.0 ** rng.uniform(-4, -1, size=b.shape[:2])
        val = (mag * rng.choice([-1.0, 1.0], size=b.shape[:2])).astype(np.float16)
        b[:, :, at : at + 2] = val[..., None].view(np.uint8)
    return b.reshape(n, -1)


def reference64(s: SubScaled) -> np.ndarray:
    """The SubScaled formula in float64 on repeated (not broadcast) factors. Every product is exact and
    the one subtraction rounds to 53 bits, so rounding to float32 afterwards equals doing it all in
    float32 (double rounding is innocuous for 53 >= 2 * 24 + 2 bits)."""
    d = np.repeat(s.d.astype(np.float64), s.sb, axis=1)
    w = d * np.repeat(s.scales.astype(np.float64), s.group, axis=1) * s.codes.astype(np.float64)
    if s.mins is not None:
        dmin = np.repeat(s.dmin.astype(np.float64), s.sb, axis=1)
        w = w - dmin * np.repeat(s.mins.astype(np.float64), s.group, axis=1)
    return w


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and want.dtype == np.float32 and got.shape == want.shape
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} weights differ, first at {np.argwhere(diff)[0]}"


def check_spec(qtype: str, s: SubScaled, shape: tuple[int, int], full_range: bool) -> None:
    codes_dtype, (clo, chi), (slo, shi), mins, group, sb = SPEC[qtype]
    n, k = shape
    assert (s.group, s.sb) == (group, sb)
    assert s.codes.dtype == codes_dtype and s.codes.shape == (n, k)
    assert s.scales.dtype == np.int8 and s.scales.shape == (n, k // group)
    assert s.d.dtype == np.float16 and s.d.shape == (n, k // sb)
    assert clo <= s.codes.min() and s.codes.max() <= chi
    assert slo <= s.scales.min() and s.scales.max() <= shi
    if full_range:  # uniformly random bytes reach both ends of the code range (thousands of codes)
        assert (s.codes.min(), s.codes.max()) == (clo, chi)
        if qtype.startswith("IQ4"):
            assert set(np.unique(s.codes)) == set(KVALUES.tolist())
    if mins is None:
        assert s.mins is None and s.dmin is None
    else:
        assert s.mins is not None and s.dmin is not None
        assert s.mins.dtype == np.int8 and s.mins.shape == (n, k // group)
        assert s.dmin.dtype == np.float16 and s.dmin.shape == (n, k // sb)
        assert mins[0] <= s.mins.min() and s.mins.max() <= mins[1]


def check_tensor(qtype: str, raw: np.ndarray, shape: tuple[int, int], full_range: bool = False) -> None:
    """Unpack, check the arrays, and compare both dequantizations with gguf-py's bit for bit."""
    want = np.asarray(gguf_dequantize(raw, GGMLQuantizationType[qtype]), dtype=np.float32).reshape(shape)
    s = ggml.unpack(qtype, raw, shape)
    check_spec(qtype, s, shape, full_range)
    assert_bits_equal(ggml.dequantize(qtype, raw, shape), want)
    assert_bits_equal(reference64(s).astype(np.float32), want)


def test_registry_matches_ggml_sizes() -> None:
    assert sorted(ggml.FORMATS) == sorted(TYPES)
    for name, fmt in ggml.FORMATS.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert (fmt.block_weights, fmt.block_bytes) == (block, size)
        assert fmt.bits == size * 8 / block


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", TYPES)
def test_random_blocks_bit_exact(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> None:
    raw = random_raw(rng, qtype, shape)
    check_tensor(qtype, raw, shape, full_range=shape[0] * shape[1] >= 4096)
    check_tensor(qtype, raw.reshape(-1), shape)  # a flat byte array unpacks the same


def test_q5_1_min_is_negated_dmin(rng: np.random.Generator) -> None:
    raw = random_raw(rng, "Q5_1", (2, 64))
    m = raw.reshape(2, 2, 24)[:, :, 2:4].copy().view("<f2")[:, :, 0]
    s = ggml.unpack("Q5_1", raw, (2, 64))
    assert s.dmin is not None and np.array_equal(s.dmin.view(np.uint16), (-m).view(np.uint16))


def test_gemma3_q4_k_m_file() -> None:
    from perfx_compiler.model.gguf_header import read_gguf_header
    from perfx_compiler.model.loader import known_model_path

    try:
        gemma = known_model_path("gemma3-270m")  # assembled by tests/setup.sh from its PyPI packages
    except ModelFormatError as e:
        pytest.skip(f"{e}; tests/setup.sh installs it")

    seen = {"Q4_K": 0, "Q6_K": 0}
    for t in read_gguf_header(gemma).tensors:
        if t.tensor_type.name in seen and len(t.shape) == 2:
            seen[t.tensor_type.name] += 1
            check_tensor(t.tensor_type.name, t.data, (t.shape[1], t.shape[0]))  # ne order: K first
    assert seen["Q4_K"] > 0 and seen["Q6_K"] > 0, seen


@pytest.fixture(scope="module")
def llamacpp_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny F32 llama GGUF (every matrix width a multiple of 256) quantized purely to each type by llama.cpp."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from perfx_compiler.model.testing import write_tiny_gguf

    folder = tmp_path_factory.mktemp("ggml_formats")
    src, _ = write_tiny_gguf(folder / "f32.gguf", hidden=256, ffn=512, heads=4, kv_heads=2, layers=1, seed=1)
    out = {}
    for qtype, ftype in FTYPES.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = 2
        params.pure = True  # one type throughout, so every matrix is the type under test
        dst = folder / f"{qtype}.gguf"
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        assert rc == 0, f"llama_model_quantize -> {ftype} returned {rc}"
        out[qtype] = dst
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_llamacpp_quantized_file(qtype: str, llamacpp_files: dict[str, Path]) -> None:
    from perfx_compiler.model.gguf_header import read_gguf_header

    n = 0
    for t in read_gguf_header(llamacpp_files[qtype]).tensors:
        if len(t.shape) == 2:
            assert t.tensor_type.name == qtype, (t.name, t.tensor_type.name)
            check_tensor(qtype, t.data, (t.shape[1], t.shape[0]))
            n += 1
    assert n >= 7


@pytest.mark.parametrize("qtype", TYPES)
def test_check_finite_nan_scale(qtype: str, rng: np.random.Generator) -> None:
    fmt = ggml.FORMATS[qtype]
    raw = random_raw(rng, qtype, (2, 512))
    ggml.check_finite(qtype, raw, (2, 512), "blk.0.ffn_up.weight")  # finite: no error
    b = raw.reshape(2, -1, fmt.block_bytes)
    at = fmt.f16_fields[-1]
    b[1, 0, at : at + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    b[0, 1, at : at + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(ModelFormatError) as e:
        ggml.check_finite(qtype, raw, (2, 512), "blk.0.ffn_up.weight")
    msg = str(e.value)
    assert msg == (f"tensor blk.0.ffn_up.weight ({qtype}): 2 blocks have a NaN or infinite scale; "
                   "the file is corrupt — re-download or re-quantize it")
    assert "\n" not in msg


def test_check_finite_truncated() -> None:
    fmt = ggml.FORMATS["Q4_K"]
    raw = np.zeros(2 * 4 * fmt.block_bytes - 100, dtype=np.uint8)
    with pytest.raises(ModelFormatError) as e:
        ggml.check_finite("Q4_K", raw, (2, 1024), "blk.3.attn_q.weight")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("tensor blk.3.attn_q.weight (Q4_K): ")
    assert f"needs {2 * 4 * 144} bytes, got {2 * 4 * 144 - 100}" in msg and "truncated" in msg
    with pytest.raises(ModelFormatError, match="truncated"):
        ggml.unpack("Q4_K", raw, (2, 1024))


def test_unknown_type_is_a_clear_error() -> None:
    from perfx_compiler.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="no superblock format for ggml type IQ2_XXS"):
        ggml.unpack("IQ2_XXS", np.zeros(66, dtype=np.uint8), (1, 256))
