"""The tuning sweep on devices: the sweep's GEMM (y = x · Wᵀ, M = 12288/scale output features,
K = 4096/scale) tuned at a few token counts through TVM RPC on each device key of a tracker, as a
table and a plot per device (the tracker cell of notebooks/tuning_sweep.ipynb).

Candidates are built here for ``target`` and timed on the devices (``tune/rpc.py``: checked there
against the unscheduled function first); each device's records go to its own log, which a rerun resumes.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def device_sweep(
    tracker: str,
    keys: Sequence[str],
    target: str = "host",
    scale: int = 16,
    tokens: Sequence[int] = (1, 16),
    trials: int = 8,
    log_dir: str | Path | None = None,
    request_timeout_s: float = 60.0,
) -> Any:
    """Tune the sweep GEMM at ``tokens`` on every device of ``keys``; one row per timed candidate
    (device, tokens, trial, config, seconds, gflops, best_gflops so far, error)."""
    import pandas as pd
    import tvm

    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.records import TuningDatabase
    from perfx_compiler.tune.rpc import RPCMeasurer, check_tracker, parse_tracker
    from perfx_compiler.tune.session import group_tasks, tune_groups
    from perfx_compiler.tune.workloads import extract_tasks, linear_module, matmul_func

    tdesc = load_target(target)
    addr = parse_tracker(tracker)
    check_tracker(addr)
    n_out, k = 12288 // scale, 4096 // scale
    mod = tvm.IRModule({"sweep_gemm": matmul_func(linear_module(None, k, n_out, None, True))
                        .with_attr("global_symbol", "sweep_gemm")})
    groups = group_tasks(extract_tasks(mod, tdesc, buckets=tuple(tokens)))
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="perfx-device-sweep-"))
    rows: list[dict[str, Any]] = []
    for key in keys:
        db = TuningDatabase(logs / key / f"{tdesc.name}-sweep.jsonl")
        with RPCMeasurer(tdesc, addr, key, request_timeout_s=request_timeout_s) as measurer:
            tune_groups(groups, tdesc, db, measurer, trials=trials)
        measured = sorted((r for r in db.records() if r.source == "measured" and not r.confirmed),
                          key=lambda r: r.timestamp)
        trial: dict[int, int] = {}
        for r in measured:
            m = int(r.bucket or 1)
            trial[m] = trial.get(m, 0) + 1
            rows.append({"device": key, "tokens": m, "trial": trial[m], "template": r.template,
                         "config": json.dumps(r.config, sort_keys=True), "seconds": r.mean_s if r.ok else None,
                         "gflops": 2.0 * m * k * n_out / r.mean_s / 1e9 if r.ok else None, "error": r.error or ""})
    df = pd.DataFrame(rows, columns=["device", "tokens", "trial", "template", "config", "seconds", "gflops", "error"])
    df["best_gflops"] = df.groupby(["device", "tokens"])["gflops"].cummax()
    return df


def plot_device_sweeps(df: Any) -> Any:
    """One panel per device: every candidate's GFLOP/s (dots) and the best so far (line) per token count."""
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(df["device"]))
    fig, axes = plt.subplots(1, max(1, len(devices)), figsize=(5 * max(1, len(devices)), 3.6), squeeze=False)
    for ax, device in zip(axes[0], devices, strict=False):
        part = df[df["device"] == device]
        for m, rows in part.groupby("tokens"):
            line = ax.plot(rows["trial"], rows["best_gflops"], label=f"{m} tokens")[0]
            ax.scatter(rows["trial"], rows["gflops"], s=12, color=line.get_color(), alpha=0.5)
        ax.set_title(f"rpc:{device}")
        ax.set_xlabel("trial")
        ax.set_ylabel("GFLOP/s (line: best so far)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
