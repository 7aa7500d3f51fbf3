"""The one-pass GGUF header reader (gguf_header.py) against gguf's GGUFReader: every metadata value
and tensor info equal on tiny files of every type, a file holding every value type, llama.cpp's vocab
files, SmolLM2 and (when cached) Gemma 3 270M; load_gguf gives the same model from either."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.errors import ModelFormatError
from perfx_compiler.model import gguf as gguf_mod
from perfx_compiler.model.gguf_header import GGUFFile, GGUFTensor, read_gguf_header
from perfx_compiler.model.lazy import QuantizedWeight
from perfx_compiler.model.testing import write_tiny_gguf

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
VOCAB_DIR = Path.home() / ".cache/perfx/llamacpp-vocab"


def _tiny(root: Path, qtype: str) -> Path:
    kw = {"hidden": 256, "ffn": 256} if qtype.endswith("_K") else {}
    return write_tiny_gguf(root / f"{qtype}.gguf", qtype=qtype, tied=qtype != "Q8_0", **kw)[0]


def _every_value_type(path: Path) -> Path:
    """A GGUF with each scalar type, arrays of each, non-ASCII strings and a non-default alignment."""
    import gguf
    from gguf import GGUFValueType as V

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
               V.INT32: -2_000_000_000, V.FLOAT32: 1e-6, V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT64: 1 / 3,
               V.BOOL: True}
    for vt, v in scalars.items():
        w.add_key_value(f"t.{vt.name}", v, vt)
        w.add_key_value(f"t.{vt.name}.arr", [v, v, v], V.ARRAY, sub_type=vt)
    w.add_key_value("t.bool_false", False, V.BOOL)
    w.add_key_value("t.str", "héllo ▁ 世界 🙂", V.STRING)
    w.add_key_value("t.empty_str", "", V.STRING)
    w.add_key_value("t.strs", ["", "a", "Ġ▁x", "\x00z", "🙂" * 40], V.ARRAY, sub_type=V.STRING)
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal(5).astype(np.float16))
    w.add_tensor("c", np.arange(7, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _files() -> list:
    from perfx_compiler.model.loader import known_model_path

    params: list = [pytest.param(("tiny", q), id=f"tiny-{q}") for q in QTYPES]
    params.append(pytest.param(("every-type", ""), id="every-type"))
    # GGUFReader itself takes 5-30 s on the larger vocabularies (Gemma's 262k tokens): the files under 3 MB
    # cover every value type; the large ones are read by the tokenizer tests (against llama.cpp) instead
    params += [pytest.param(("file", str(p)), id=p.stem)
               for p in sorted(VOCAB_DIR.glob("ggml-vocab-*.gguf")) if p.stat().st_size <= 3e6]
    try:
        params.append(pytest.param(("file", str(known_model_path("smollm2-135m"))), id="smollm2"))
    except ModelFormatError:
        pass
    return params


def _path(spec: tuple[str, str], root: Path) -> Path:
    kind, arg = spec
    if kind == "tiny":
        return _tiny(root, arg)
    if kind == "every-type":
        return _every_value_type(root / "every.gguf")
    return Path(arg)


def _from_reader(path: Path) -> GGUFFile:
    """What gguf.GGUFReader reads, as a GGUFFile (values through ``contents()``, the same mapping offsets)."""
    import mmap

    import gguf

    r = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = [GGUFTensor(t.name, t.tensor_type, tuple(t.shape.tolist()), int(t.n_bytes), int(t.data_offset), buf)
               for t in r.tensors]
    for ours, t in zip(tensors, r.tensors, strict=True):  # the views too, not only their offsets
        assert ours.data.dtype == t.data.dtype and ours.data.shape == t.data.shape, t.name
        assert ours.data.tobytes() == np.asarray(t.data).tobytes(), t.name
    return GGUFFile(path, fields, tensors, int(r.alignment), int(r.data_offset), buf)


@pytest.mark.parametrize("spec", _files())
def test_header_equals_gguf_reader(spec: tuple[str, str], tmp_path: Path) -> None:
    path = _path(spec, tmp_path)
    ours, ref = read_gguf_header(path), _from_reader(path)
    assert list(ours.fields) == list(ref.fields)
    for key, want in ref.fields.items():
        got = ours.fields[key]
        assert type(got) is type(want) and got == want, key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert [(t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset) for t in ref.tensors]
    for t in ours.tensors:
        assert t.data.nbytes == t.n_bytes and not t.data.flags.writeable


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("spec", [p for p in _files() if p.values[0][0] in ("tiny",) or "smollm2" in p.id])
def test_load_gguf_same_as_through_gguf_reader(spec: tuple[str, str], lazy: bool, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = _path(spec, tmp_path)
    ours = gguf_mod.load_gguf(path, lazy=lazy)
    monkeypatch.setattr(gguf_mod, "read_gguf_header", _from_reader)
    ref = gguf_mod.load_gguf(path, lazy=lazy)
    assert ours.config.to_dict() == ref.config.to_dict()
    assert ours.tokenizer_json == ref.tokenizer_json and ours.chat_template == ref.chat_template
    assert set(ours.weights) == set(ref.weights) and set(ours.quantized) == set(ref.quantized)
    for name, w in ref.weights.items():
        np.testing.assert_array_equal(np.asarray(ours.weights[name]), np.asarray(w), err_msg=name)
    for name, (qtype, blocks, shape) in ref.quantized.items():
        got = ours.quantized[name]
        assert (got[0], got[2]) == (qtype, shape)
        np.testing.assert_array_equal(_blocks(got[1]), _blocks(blocks), err_msg=name)


def _blocks(raw: object) -> np.ndarray:
    """The raw blocks of a ``quantized`` entry (an array, or a lazy weight's mapped blocks)."""
    return raw.blocks() if isinstance(raw, QuantizedWeight) else np.asarray(raw)


def test_bad_utf8_and_duplicates_are_one_line_errors(tmp_path: Path) -> None:
    path = _every_value_type(tmp_path / "e.gguf")
    data = path.read_bytes()
    bad = data.replace("héllo".encode(), b"h\xff\xfello", 1)
    (tmp_path / "utf8.gguf").write_bytes(bad)
    with pytest.raises(ModelFormatError, match=r"metadata 't\.str' is not UTF-8 text") as e:
        read_gguf_header(tmp_path / "utf8.gguf")
    assert "\n" not in str(e.value)
    (tmp_path / "dup.gguf").write_bytes(data.replace(b"t.UINT16", b"t.UINT32", 1))  # same length: still parses
    with pytest.raises(ModelFormatError, match=r"metadata 't\.UINT32' appears twice"):
        read_gguf_header(tmp_path / "dup.gguf")
