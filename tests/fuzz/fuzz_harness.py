"""Parent side of the bad-input fuzzing: run many cases through ``fuzz_worker.py`` processes.

Importing TVM or the loaders costs seconds, so one worker process runs every case in turn and
reports each on its own line. A case that kills the worker (a signal: segfault, abort) or runs
past the per-case deadline (a hang) is recorded as such and a fresh worker resumes at the next
case; the parent never waits on a dead or stuck worker.

Every case is a dict: ``id`` (kind and number), ``seed`` (what its mutation drew from), ``op``
(what the worker does with it) and the op's arguments. ``failures`` turns results into one
readable report per bad case: id, seed, file, what happened.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("fuzz_worker.py")
# Every mutation is drawn from (SEED, its kind, its number); CI uses 0, PERFX_FUZZ_SEED=N draws another set.
SEED = int(os.environ.get("PERFX_FUZZ_SEED", "0"))
READY_S = 300.0  # the worker's imports (the TVM runtime for artifacts), on 2 busy cores
CASE_S = 30.0  # one case: a load of a tiny model takes ~50 ms, a tiny artifact's run ~2 s


def case_seed(*parts: object) -> int:
    """The seed of one case: a stable hash of the run's SEED and the case's own name."""
    return zlib.crc32(repr((SEED, *parts)).encode())


def _reader(stream: Any, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group: nothing else is touched
    proc.wait()


def run_cases(
    cases: list[dict[str, Any]], *, case_s: float = CASE_S, ready_s: float = READY_S, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """One result per case, in order (see fuzz_worker for the fields); crashes and hangs included."""
    results: list[dict[str, Any] | None] = [None] * len(cases)
    with tempfile.TemporaryDirectory(prefix="perfx-fuzz-") as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps(cases))
        start = 0
        while start < len(cases):
            log = Path(tmp) / f"worker-{start}.log"
            with open(log, "w") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(WORKER), str(spec), str(start)], stdout=subprocess.PIPE, stderr=err,
                    text=True, start_new_session=True, env={**os.environ, **(env or {})},
                )
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
            start = _drive(proc, lines, results, start, case_s, ready_s, log)
    return [r for r in results if r is not None]


def _drive(
    proc: subprocess.Popen, lines: queue.Queue, results: list[dict[str, Any] | None], start: int,
    case_s: float, ready_s: float, log: Path,
) -> int:
    """Collect one worker's results; returns the index the next worker starts at."""
    current, wait = None, ready_s
    while True:
        deadline = time.monotonic() + wait
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _stop(proc)
            if current is None:
                raise RuntimeError(f"fuzz worker not ready after {ready_s:.0f} s:\n{_tail(log)}") from None
            results[current] = {"i": current, "status": "hang", "message": f"no result after {case_s:.0f} s",
                                "log": _tail(log)}
            return current + 1
        if line is None:  # the worker exited: after 'done', or killed by the case it was running
            rc = proc.wait()
            if current is None:
                if rc == 0:
                    return len(results)
                raise RuntimeError(f"fuzz worker exited {rc} before any case:\n{_tail(log)}")
            how = f"signal {-rc} ({signal.Signals(-rc).name})" if rc < 0 else f"exit code {rc}"
            results[current] = {"i": current, "status": "crash", "message": f"worker died: {how}", "log": _tail(log)}
            return current + 1
        msg = json.loads(line)
        if msg.get("ready"):
            wait = case_s
        elif msg.get("start"):
            current = int(msg["i"])
        elif msg.get("done"):
            current = None
        elif "status" in msg:
            results[int(msg["i"])] = msg
            current = None


def _tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def failures(
    cases: list[dict[str, Any]], results: list[dict[str, Any]],
    check_ok: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
) -> list[str]:
    """Reports of the cases that did not end in a clean outcome: a PerfXError with a message, or
    ``ok`` (and, with ``check_ok``, a correct one: it returns what is wrong, or None)."""
    bad = []
    for case, res in zip(cases, results, strict=True):
        why = None
        if res["status"] == "perfx":
            if not res.get("message", "").strip():
                why = f"{res['type']} with an empty message"
        elif res["status"] == "ok":
            why = check_ok(case, res) if check_ok else None
        else:
            why = f"{res['status']}: {res.get('type', '')} {res.get('message', '')}\n{res.get('traceback') or res.get('log', '')}"
        if why:
            bad.append(f"case {case['id']} (seed {case['seed']}, file {case.get('path')}): {why}")
    return bad


def summary(results: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        key = r["status"] if r["status"] != "perfx" else f"perfx:{r['type']}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def assert_clean(cases: list[dict[str, Any]], results: list[dict[str, Any]], check_ok: Any = None) -> None:
    bad = failures(cases, results, check_ok)
    head = f"{len(bad)} of {len(cases)} fuzz cases failed with PERFX_FUZZ_SEED={SEED} ({summary(results)})"
    assert not bad, head + "\n\n" + "\n\n".join(bad[:15])


def run_and_check(label: str, cases: list[dict[str, Any]], check_ok: Any = None, **run: Any) -> list[dict[str, Any]]:
    """run_cases, print the outcome counts, assert_clean; the results, for a test's own further checks."""
    results = run_cases(cases, **run)
    print(f"PERFX_FUZZ_SEED={SEED}: {len(cases)} {label} cases: {summary(results)}")
    assert_clean(cases, results, check_ok)
    return results
