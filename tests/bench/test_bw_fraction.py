"""perfx-bench's "weights streamed / read-bandwidth probe": paired per turn, then the median."""

from __future__ import annotations

import pytest

from perfx_compiler.bench.machine import BandwidthProbe
from perfx_compiler.bench.report import summarize


def _row(engine: str, rnd: int, achieved: float, before: float, after: float, placement: str = "shared") -> dict:
    ceiling = (before + after) / 2
    return {
        "model": "m", "engine": engine, "round": rnd, "decode_tok_s": achieved, "ttft_ms": 1.0,
        "prefill128_tok_s": 1.0, "prefill512_tok_s": 1.0, "achieved_gbs": achieved, "pingpong_ns": 50.0,
        "placement": placement, "bw_before_gbs": before, "bw_after_gbs": after, "round_bw_gbs": ceiling,
        "bw_fraction": achieved / ceiling, "other_cpu": 0.0, "redone": 0, "disturbed": False, "load_avg_1m": 0.5,
    }


def test_fraction_is_median_of_per_turn_ratios():
    # the machine's bandwidth halves between rounds; the engine always streams at 90% of it
    rows = [_row("perfx", 0, 36.0, 40.0, 40.0), _row("perfx", 1, 63.0, 70.0, 70.0), _row("perfx", 2, 36.0, 38.0, 42.0)]
    rows.append(_row("llama.cpp", 0, 20.0, 40.0, 40.0))
    s = {r["engine"]: r for r in summarize(rows, {"perfx": {"weight_bytes": 1}}, {}, "m", 2)}
    px = s["perfx"]
    assert px["bw_fraction"] == pytest.approx(0.9, abs=1e-3)
    assert px["bw_fraction_min"] == pytest.approx(0.9, abs=1e-3) and px["bw_fraction_max"] == pytest.approx(0.9, abs=1e-3)
    # the ceiling reported is the median of this engine's own brackets, not of the whole run's probes
    assert px["bw_ceiling_gbs"] == pytest.approx(40.0)
    assert px["bw_probe_min_gbs"] == 38.0 and px["bw_probe_max_gbs"] == 70.0
    assert px["bw_probe_turn_change"] == pytest.approx(0.0)
    assert s["llama.cpp"]["bw_fraction"] == pytest.approx(0.5)


def test_pooled_fraction_differs_when_the_probe_moves():
    # achieved 36 at a 40 GB/s turn, 45 at a 50 GB/s turn, 54 at a 60 GB/s turn: 90% paired,
    # but pooled against a probe whose median sits in a different turn it is not
    rows = [_row("perfx", 0, 36.0, 40.0, 40.0), _row("perfx", 1, 45.0, 50.0, 50.0), _row("perfx", 2, 54.0, 60.0, 60.0),
            _row("ort", 0, 10.0, 70.0, 70.0), _row("ort", 1, 10.0, 72.0, 72.0), _row("ort", 2, 10.0, 74.0, 74.0)]
    px = next(r for r in summarize(rows, {}, {}, "m", 2) if r["engine"] == "perfx")
    assert px["bw_fraction"] == pytest.approx(0.9, abs=1e-3)
    assert px["bw_fraction_pooled"] == pytest.approx(45.0 / 65.0, abs=1e-3)


def test_fraction_per_placement_uses_steady_turns_only():
    # hyperthreads of one core (~50 GB/s) at 90%, two cores (~80 GB/s) at 75%; two turns' probes
    # jumped from 50 to 80 mid-decode (placement changed): they count in neither placement's figure
    # (counted, they would move the shared median to 91%)
    rows = [_row("perfx", 0, 45.0, 50.0, 50.0), _row("perfx", 1, 60.0, 80.0, 80.0, "split"),
            _row("perfx", 2, 44.1, 49.0, 49.0), _row("perfx", 3, 61.5, 82.0, 82.0, "split"),
            _row("perfx", 4, 60.0, 50.0, 80.0), _row("perfx", 5, 60.0, 50.0, 80.0)]
    px = summarize(rows, {}, {}, "m", 2)[0]
    assert px["bw_fraction_shared"] == pytest.approx(0.9, abs=1e-3)
    assert px["bw_fraction_split"] == pytest.approx(0.75, abs=1e-3)
    assert px["bw_fraction"] == pytest.approx(0.9, abs=1e-3)  # unfiltered: all six turns, the jumped ones at 92%


def test_probe_reuses_its_buffer():
    with BandwidthProbe(threads=2, size_bytes=64 << 20) as probe:
        a, b = probe.measure(2), probe.measure(2, threads=1)
        windows = probe.chunk_gbs(4 << 20, 20)  # walks through the 16 windows of the buffer
    assert 0.0 < a < 5000.0 and 0.0 < b < 5000.0
    assert len(windows) == 20 and all(0.0 < w < 5000.0 for w in windows)  # a busy machine can stall one window
    with pytest.raises(RuntimeError):
        probe.measure(1)
