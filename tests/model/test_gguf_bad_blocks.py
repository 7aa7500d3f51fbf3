"""Bad GGUF blocks fail at load with one line, through ``perfx-compile`` too: a NaN / infinite
superblock scale in a Q4_K_M file llama.cpp wrote (a file made of such blocks decodes to garbage,
or NaN logits, if loaded), and a tensor type PerfX does not read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.errors import ModelFormatError


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    from perfx_compiler.bench.models import llama_quantize
    from perfx_compiler.model.testing import write_tiny_gguf

    root = tmp_path_factory.mktemp("bad")
    f32, _ = write_tiny_gguf(root / "f32.gguf", qtype="F32", hidden=256, ffn=512, tied=False)
    return llama_quantize(f32, root / "q4_k_m.gguf", "Q4_K_M")


def _corrupt(src: Path, dst: Path, value: float) -> str:
    """Copy ``src`` with the first Q4_K tensor's third block's d set to ``value``; the tensor's name."""
    from perfx_compiler.model.gguf_header import read_gguf_header

    t = next(t for t in read_gguf_header(src).tensors if t.tensor_type.name == "Q4_K")
    data = bytearray(src.read_bytes())
    at = t.data_offset + 2 * 144  # block 2's d (f16, the block's first two bytes)
    data[at : at + 2] = np.float16(value).tobytes()
    dst.write_bytes(bytes(data))
    return t.name


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_scale_is_one_line_at_load(q4_k_m, tmp_path, value):
    from perfx_compiler.model.gguf import load_gguf

    bad = tmp_path / "bad.gguf"
    name = _corrupt(q4_k_m, bad, value)
    load_gguf(q4_k_m)  # the file itself loads
    for lazy in (False, True):
        with pytest.raises(ModelFormatError) as e:
            load_gguf(bad, lazy=lazy)
        msg = str(e.value)
        assert "\n" not in msg and name in msg and "NaN or infinite scale" in msg and "corrupt" in msg, msg


def test_cli_names_the_corrupt_tensor_without_a_traceback(q4_k_m, tmp_path):
    bad = tmp_path / "bad.gguf"
    name = _corrupt(q4_k_m, bad, np.nan)
    proc = subprocess.run([sys.executable, "-m", "perfx_compiler.cli.compile", str(bad), "-o", str(tmp_path / "a"),
                           "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err and name in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "a").exists()


def test_unread_type_names_it_and_the_supported_ones(tmp_path):
    import gguf

    from perfx_compiler.errors import UnsupportedModelError
    from perfx_compiler.model.gguf import SUPPORTED_GGML_TYPES, load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path / "tq.gguf", qtype="F32", hidden=256, ffn=512, tied=False)
    # rewrite one matrix's type as TQ1_0 (ternary; PerfX reads no such blocks) with bytes of the right size
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(tmp_path / "tq2.gguf", arch="llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    target = "blk.0.ffn_down.weight"
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name == target:
            n, k = int(t.shape[1]), int(t.shape[0])
            per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.TQ1_0]
            raw = np.zeros((n, k // per * size), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(tmp_path / "tq2.gguf")
    msg = str(e.value)
    assert "\n" not in msg and "TQ1_0" in msg and target in msg
    assert all(t in msg for t in SUPPORTED_GGML_TYPES)
