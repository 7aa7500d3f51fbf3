"""Summaries, CSV files and plots of a benchmark run."""

from __future__ import annotations

import csv
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROUND_COLUMNS = [
    "model",
    "engine",
    "round",
    "decode_tok_s",
    "ttft_ms",
    "prefill128_tok_s",
    "prefill512_tok_s",
    "achieved_gbs",
    "pingpong_ns",
    "placement",
    "round_bw_gbs",
    "bw_before_gbs",
    "bw_after_gbs",
    "bw_fraction",
    "other_cpu",
    "redone",
    "disturbed",
    "load_avg_1m",
]
SUMMARY_COLUMNS = [
    "model",
    "engine",
    "quantization",
    "weight_format",
    "weight_mb_per_token",
    "rounds",
    "decode_tok_s",
    "prefill128_tok_s",
    "prefill512_tok_s",
    "ttft_ms",
    "peak_rss_mb",
    "achieved_gbs",
    "bw_ceiling_gbs",
    "bw_fraction",
    "bw_fraction_min",
    "bw_fraction_max",
    "bw_fraction_pooled",
    "bw_probe_min_gbs",
    "bw_probe_max_gbs",
    "bw_probe_turn_change",
    "bw_fraction_shared",
    "bw_fraction_split",
    "perfx_decode_ratio",
    "perfx_prefill128_ratio",
    "perfx_prefill512_ratio",
    "perfx_decode_ratio_same_placement",
    "decode_tok_s_shared",
    "decode_tok_s_split",
    "placements",
    "pingpong_ns",
    "disturbed_rounds",
    "threads",
    "cpu",
    "cores",
    "bw_1thread_gbs",
    "load_avg_1m",
    "note",
]
METRICS = ("decode_tok_s", "prefill128_tok_s", "prefill512_tok_s")


def _median(vals: Sequence[float]) -> float:
    vals = [v for v in vals if v == v and v is not None]
    return float(statistics.median(vals)) if vals else float("nan")


def summarize(
    rounds: Sequence[dict[str, Any]],
    engines: dict[str, dict[str, Any]],
    machine: dict[str, Any],
    model: str,
    threads: int,
) -> list[dict[str, Any]]:
    """One row per engine: medians over rounds, and PerfX / engine ratios taken round by round."""
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        by_engine.setdefault(r["engine"], []).append(r)
    perfx = {r["round"]: r for r in by_engine.get("perfx", [])}
    bw_all = _median([r["round_bw_gbs"] for r in rounds])
    out = []
    for name, rows in by_engine.items():
        meta = engines.get(name, {})
        wbytes = meta.get("weight_bytes", 0)
        row: dict[str, Any] = {
            "model": model,
            "engine": name,
            "quantization": meta.get("quantization", ""),
            "weight_format": meta.get("weight_format", ""),
            "weight_mb_per_token": round(wbytes / 1e6, 1),
            "rounds": len(rows),
            "ttft_ms": round(_median([r["ttft_ms"] for r in rows]), 2),
            "peak_rss_mb": round(meta.get("peak_rss_mb", float("nan")), 0),
            # the probes that bracketed this engine's own decodes (median of the per-turn means)
            "bw_ceiling_gbs": round(_median([r["round_bw_gbs"] for r in rows]), 2),
            "threads": threads,
            "cpu": machine.get("cpu", ""),
            "cores": machine.get("cores", ""),
            "bw_1thread_gbs": round(machine.get("bw_1thread_gbs", 0.0), 2),
            "pingpong_ns": round(_median([r["pingpong_ns"] for r in rows]), 0),
            "placements": " ".join(f"{k}:{v}" for k, v in sorted(Counter(r["placement"] for r in rows).items())),
            "disturbed_rounds": sum(1 for r in rows if r["disturbed"]),
            # the machine's 1-minute load average after each run (median): other work on the box
            "load_avg_1m": round(_median([r["load_avg_1m"] for r in rows if "load_avg_1m" in r]), 2),
            "note": meta.get("note", ""),
        }
        for m in METRICS:
            row[m] = round(_median([r[m] for r in rows]), 2)
        row["achieved_gbs"] = round(_median([r["achieved_gbs"] for r in rows]), 2)
        row.update(_bw_fraction(rows, row["achieved_gbs"], bw_all))
        for m, col in zip(
            METRICS, ("perfx_decode_ratio", "perfx_prefill128_ratio", "perfx_prefill512_ratio"), strict=True
        ):
            pairs = [perfx[r["round"]][m] / r[m] for r in rows if r["round"] in perfx and r[m] > 0]
            row[col] = round(_median(pairs), 3) if pairs else ""
        same = [
            perfx[r["round"]]["decode_tok_s"] / r["decode_tok_s"]
            for r in rows
            if r["round"] in perfx and r["decode_tok_s"] > 0 and perfx[r["round"]]["placement"] == r["placement"]
        ]
        row["perfx_decode_ratio_same_placement"] = round(_median(same), 3) if same else ""
        for place in ("shared", "split"):
            vals = [r["decode_tok_s"] for r in rows if r["placement"] == place]
            row[f"decode_tok_s_{place}"] = round(_median(vals), 2) if vals else ""
        out.append(row)
    order = {"perfx": 0, "llama.cpp": 1, "ort-genai": 2, "ort": 3}
    return sorted(out, key=lambda r: order.get(r["engine"], 9))


STEADY_TURN = 0.10  # a turn whose probe moved more than this (placement changed mid-decode) is unsteady


def probe_move(before: float, after: float) -> float:
    """|after - before| / their mean: how far the ceiling moved during one turn's decode."""
    return abs(after - before) / ((after + before) / 2)


def _turn_move(r: dict[str, Any]) -> float | None:
    """:func:`probe_move` of the probes that bracket one turn's decode (None without both)."""
    if not r.get("round_bw_gbs") or "bw_before_gbs" not in r or r.get("bw_after_gbs") != r.get("bw_after_gbs"):
        return None
    return probe_move(r["bw_before_gbs"], r["bw_after_gbs"])


def _bw_fraction(rows: Sequence[dict[str, Any]], achieved: float, bw_all: float) -> dict[str, Any]:
    """Weights streamed as a fraction of the read-bandwidth probe, and the probe's own spread.

    ``bw_fraction``: median over turns of achieved / that turn's probe (mean of the probes just
    before and after its decode), so a turn is only compared with the machine state around it.
    ``bw_fraction_pooled``: median achieved over the median of every probe in the run (the
    unpaired figure, for comparison). ``bw_probe_turn_change``: median |after - before| / mean,
    how much the ceiling moved during one decode. ``bw_fraction_shared`` / ``_split``: the median
    over steady turns (probe moved < 10%) with the two vCPUs on one core's hyperthreads / on two
    cores: the host moves them between the two during a run, and the ceiling with them (~50 vs ~80
    GB/s here), so a turn whose placement changed mid-decode compares with the wrong probe.
    """
    pairs = [r["bw_fraction"] for r in rows if r.get("bw_fraction") == r.get("bw_fraction") and r.get("bw_fraction")]
    if not pairs:  # rounds without a bracket (probe off): ratio of medians
        pairs = [r["achieved_gbs"] / r["round_bw_gbs"] for r in rows if r.get("round_bw_gbs")]
    probes = [v for r in rows for v in (r.get("bw_before_gbs"), r.get("bw_after_gbs")) if v is not None and v == v]
    moves = [m for m in map(_turn_move, rows) if m is not None]
    by_place = {
        place: [
            r["bw_fraction"]
            for r in rows
            if r.get("placement") == place and r.get("bw_fraction")
            and (m := _turn_move(r)) is not None and m < STEADY_TURN
        ]
        for place in ("shared", "split")
    }
    return {
        **{f"bw_fraction_{place}": round(_median(v), 3) if v else "" for place, v in by_place.items()},
        "bw_fraction": round(_median(pairs), 3) if pairs else "",
        "bw_fraction_min": round(min(pairs), 3) if pairs else "",
        "bw_fraction_max": round(max(pairs), 3) if pairs else "",
        "bw_fraction_pooled": round(achieved / bw_all, 3) if bw_all == bw_all and bw_all else "",
        "bw_probe_min_gbs": round(min(probes), 2) if probes else "",
        "bw_probe_max_gbs": round(max(probes), 2) if probes else "",
        "bw_probe_turn_change": round(_median(moves), 3) if moves else "",
    }


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def plot_summary(summary: Sequence[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Three panels: decode tok/s, prefill tok/s (128/512), achieved GB/s with the measured ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [f"{r['engine']}\n{r['quantization']}"[:28] for r in summary]
    x = np.arange(len(summary))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    ax = axes[0]
    ax.bar(x, [float(r["decode_tok_s"]) for r in summary], color="tab:blue")
    ax.set_title("decode tok/s (128 tokens)")
    ax = axes[1]
    ax.bar(x - 0.2, [float(r["prefill128_tok_s"]) for r in summary], 0.4, label="128 tokens")
    ax.bar(x + 0.2, [float(r["prefill512_tok_s"]) for r in summary], 0.4, label="512 tokens")
    ax.set_title("prefill tok/s")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(x, [float(r["achieved_gbs"]) for r in summary], color="tab:green")
    ceiling = float(summary[0]["bw_ceiling_gbs"]) if summary else 0.0
    if ceiling == ceiling and ceiling > 0:
        ax.axhline(ceiling, color="k", ls="--", label=f"measured read bandwidth {ceiling:.1f} GB/s")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title("decode: weight bytes read / s (GB/s)")
    for a in axes:
        a.set_xticks(x)
        a.set_xticklabels(names, fontsize=7)
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_summary(summary: Sequence[dict[str, Any]]) -> None:
    print(
        f"\n{'engine':<10} {'quant':<22} {'decode':>8} {'pf128':>8} {'pf512':>8} {'ttft ms':>8} {'RSS MB':>7} "
        f"{'GB/s':>6} {'ceil':>6} {'%ceil':>6} {'perfx/x':>8} placements"
    )
    for r in summary:
        print(
            f"{r['engine']:<10} {str(r['quantization'])[:22]:<22} {r['decode_tok_s']:>8} {r['prefill128_tok_s']:>8} "
            f"{r['prefill512_tok_s']:>8} {r['ttft_ms']:>8} {r['peak_rss_mb']:>7} {r['achieved_gbs']:>6} "
            f"{r['bw_ceiling_gbs']:>6} {_pct(r['bw_fraction']):>6} {r['perfx_decode_ratio']!s:>8} {r['placements']}"
        )
    print(
        "%ceil: median over turns of decode weight GB/s / the read-bandwidth probe bracketing that decode; "
        "probe range per engine: " + ", ".join(
            f"{r['engine']} {r['bw_probe_min_gbs']}-{r['bw_probe_max_gbs']} GB/s" for r in summary
        )
    )


def _pct(v: Any) -> str:
    return f"{100 * float(v):.0f}%" if v not in ("", None) else "n/a"
