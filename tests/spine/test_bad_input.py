"""Bad input: one clear line on stderr, exit code 2, no traceback (unless --debug)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from perfx_compiler.model.testing import write_tiny_gguf


def run_cli(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    err = [ln for ln in res.stderr.strip().splitlines() if "error:" in ln]
    assert len(err) == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n.lower() in err[0].lower(), err[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("bad") / "tiny.gguf", context_length=32)
    return path


@pytest.fixture(scope="module")
def tiny_artifact(tiny_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_art") / "art"
    res = run_cli("perfx_compiler.cli.compile", str(tiny_gguf), "--target", "host", "-o", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    return out


def test_unknown_target_lists_known_ones(tiny_gguf, tmp_path):
    res = run_cli("perfx_compiler.cli.compile", str(tiny_gguf), "--target", "pdp11", "-o", str(tmp_path / "o"))
    assert_one_line_error(res, "unknown target 'pdp11'", "x86-avx512")


@pytest.mark.parametrize("damage", ["empty", "magic", "truncated"])
def test_corrupt_gguf(tiny_gguf, tmp_path, damage):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"empty": b"", "magic": b"GGUX" + data[4:], "truncated": data[: len(data) // 2]}[damage])
    res = run_cli("perfx_compiler.cli.compile", str(bad), "-o", str(tmp_path / "o"))
    assert_one_line_error(res, "bad.gguf")
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = run_cli("perfx_compiler.cli.compile", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "o"))
    assert_one_line_error(res, "mamba")


def test_onnx_with_unsupported_ops_names_each_op_and_node(tmp_path):
    nodes = [
        helper.make_node("BeamSearch", ["x", "w"], ["y"], name="proj_q", domain="com.microsoft"),
        helper.make_node("FancyOp", ["y"], ["z"], name="weird_1", domain="example"),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]), helper.make_tensor_value_info("w", TensorProto.UINT8, [4, 2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("example", 1)])
    onnx.save(model, tmp_path / "m.onnx")
    res = run_cli("perfx_compiler.cli.compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o"))
    assert_one_line_error(res, "BeamSearch", "proj_q", "FancyOp", "weird_1")


def test_prompt_longer_than_context(tiny_artifact):
    res = run_cli("perfx_compiler.cli.run", str(tiny_artifact), "--prompt", "word " * 200, "--max-tokens", "4")
    assert_one_line_error(res, "context")


def test_missing_artifact_file(tiny_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (art / "weights.bin").unlink()
    res = run_cli("perfx_compiler.cli.run", str(art), "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(res, "weights.bin", "missing")


def test_hash_mismatch(tiny_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    with open(art / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02\x03\x04")
    res = run_cli("perfx_compiler.cli.run", str(art), "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(res, "weights.bin", "sha256")


def test_not_an_artifact(tmp_path):
    res = run_cli("perfx_compiler.cli.run", str(tmp_path), "--prompt", "hi")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_debug_shows_traceback(tiny_gguf, tmp_path):
    res = run_cli("perfx_compiler.cli.compile", str(tiny_gguf), "--target", "nope", "--debug")
    assert res.returncode == 2 and "Traceback" in res.stderr


def test_dump_ir_writes_every_phase(tiny_gguf, tmp_path):
    res = run_cli("perfx_compiler.cli.compile", str(tiny_gguf), "-o", str(tmp_path / "o"), "--dump-ir", str(tmp_path / "ir"), "--quiet")
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in (tmp_path / "ir").glob("*.py"))  # (+ .tvm.log: TVM's native messages)
    assert names == ["00_import.py", "01_passes.py", "02_lower.py", "03_schedule.py", "04_build.py", "05_package.py"]
    assert "cached_attention" in (tmp_path / "ir" / "00_import.py").read_text()
    manifest = json.loads((tmp_path / "o" / "perfx-config.json").read_text())
    # the manifest is written during the package phase: every earlier phase is timed in it
    assert set(manifest["compile_seconds"]) == {"import", "passes", "lower", "schedule", "build"}


def test_tvm_native_warnings_are_not_shown_to_users(tiny_gguf, tmp_path):
    res = run_cli("perfx_compiler.cli.compile", str(tiny_gguf), "-o", str(tmp_path / "o"), "--quiet")
    assert res.returncode == 0 and "Warning" not in res.stderr, res.stderr[-1000:]


def test_list_targets():
    res = run_cli("perfx_compiler.cli.compile", "--list-targets")
    assert res.returncode == 0 and "x86-avx512" in res.stdout and "host" in res.stdout
