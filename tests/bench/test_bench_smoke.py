"""Smoke test of perfx-bench: tiny random model, PerfX only, one round (well under a minute)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from perfx_compiler.bench.machine import pingpong_ns, placement, read_bandwidth
from perfx_compiler.bench.report import ROUND_COLUMNS, SUMMARY_COLUMNS
from perfx_compiler.cli.bench import main
from perfx_compiler.model.testing import write_tiny_gguf


def test_bandwidth_probe_is_plausible():
    bw = read_bandwidth(threads=2, size_bytes=256 << 20, reps=3)
    assert 1.0 < bw < 2000.0
    ns = pingpong_ns(rounds=2000, repeats=3)
    assert math.isnan(ns) or ns > 0
    assert placement(ns) in ("shared", "split", "n/a")


def test_bench_cli_writes_csv(tmp_path):
    model, _ = write_tiny_gguf(tmp_path / "tiny.gguf", vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    out = tmp_path / "results"
    argv = [
        str(model),
        "--peers",
        "",
        "--rounds",
        "1",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "16",
        "--bw-size-mb",
        "128",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
        "--no-plot",
        "--name",
        "tiny",
    ]
    assert main(argv) == 0
    rows = list(csv.DictReader(open(out / "bench_tiny.csv")))
    assert len(rows) == 1 and rows[0]["engine"] == "perfx"
    assert list(rows[0]) == SUMMARY_COLUMNS
    for col in (
        "decode_tok_s",
        "prefill128_tok_s",
        "prefill512_tok_s",
        "ttft_ms",
        "peak_rss_mb",
        "achieved_gbs",
        "bw_ceiling_gbs",
        "weight_mb_per_token",
    ):
        assert float(rows[0][col]) > 0, col
    assert rows[0]["quantization"]
    rounds = list(csv.DictReader(open(out / "bench_tiny_rounds.csv")))
    assert len(rounds) == 1 and list(rounds[0]) == ROUND_COLUMNS
    # the decode is bracketed by two probes; its ratio is taken against their mean
    r0 = rounds[0]
    assert float(r0["bw_before_gbs"]) > 0 and float(r0["bw_after_gbs"]) > 0
    ceiling = (float(r0["bw_before_gbs"]) + float(r0["bw_after_gbs"])) / 2
    # the CSV keeps 4 decimals: a tiny model's fraction (0.0013) is only that exact
    assert float(r0["bw_fraction"]) == pytest.approx(float(r0["achieved_gbs"]) / ceiling, rel=2e-2, abs=6e-5)
    machine = json.loads((out / "bench_tiny_machine.json").read_text())
    assert machine["bw_start_gbs"] > 1.0 and machine["cores"] >= 1


def test_llamacpp_segfault_on_amx_cpu_says_how_to_rebuild(monkeypatch):
    """A llama.cpp worker killed by SIGSEGV on a CPU with AMX (ggml's AMX matmul crashes in VMs that do not
    grant the tile state) gets the rebuild without AMX in its error; other deaths and CPUs get nothing."""
    from perfx_compiler.cli import bench

    monkeypatch.setattr(bench, "cpu_flags", lambda: {"avx512f", "amx_int8"})
    hint = bench.death_hint("llama.cpp", -11)
    assert "-DGGML_NATIVE=OFF" in hint and "-DGGML_AVX512_VNNI=ON" in hint and "llama-cpp-python==0.3.36" in hint
    assert bench.death_hint("llama.cpp", 1) == "" and bench.death_hint("ort", -11) == ""
    monkeypatch.setattr(bench, "cpu_flags", lambda: {"avx512f"})
    assert bench.death_hint("llama.cpp", -11) == ""
