"""One engine in its own process, driven over stdin/stdout with one JSON object per line.

    python -m perfx_compiler.bench.worker '{"engine": "perfx", "path": "...", "threads": 2}'

Requests (``op``) and replies:
    info                         -> weight_bytes, engine info, load_s, rss_mb
    decode  prompt, n            -> ttft_s (prompt -> first token), decode_s (n greedy steps), last token
    prefill ids                  -> prefill_s (fresh sequence)
    profile prompt, steps, lens  -> per-kernel profile (PerfX only)
    peak                         -> peak_rss_mb of this process
    quit
Timings are taken here, around the engine calls only. Library output is sent to stderr so the
protocol on stdout stays clean.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def _peak_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork+exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def serve(spec: dict[str, Any], out: Any) -> None:
    """Create the engine described by ``spec`` and answer requests from stdin until ``quit``."""
    threads = int(spec.get("threads", 2))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    from perfx_compiler.bench.engines import create_engine

    t0 = time.perf_counter()
    engine = create_engine(spec["engine"], spec["path"], threads, **spec.get("options", {}))
    load_s = time.perf_counter() - t0

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, "load_s": load_s})
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "info":
                reply(
                    {
                        "weight_bytes": engine.weight_bytes_per_token(),
                        "info": engine.info(),
                        "load_s": load_s,
                        "rss_mb": _rss_mb(),
                    }
                )
            elif op == "decode":
                engine.reset()
                t = time.perf_counter()
                tok = engine.prefill(req["prompt"])
                ttft = time.perf_counter() - t
                # an engine's own many-step greedy loop (PerfX, llama.cpp), else a call per token
                many = getattr(engine, "decode_many", None)
                t = time.perf_counter()
                if many is not None:
                    tok = many(tok, int(req["n"]))
                else:
                    for _ in range(int(req["n"])):
                        tok = engine.decode(tok)
                reply({"ttft_s": ttft, "decode_s": time.perf_counter() - t, "token": tok})
            elif op == "prefill":
                engine.reset()
                t = time.perf_counter()
                engine.prefill(req["ids"])
                reply({"prefill_s": time.perf_counter() - t})
            elif op == "profile":
                from perfx_compiler.bench.profile import profile_engine

                if spec["engine"] != "perfx":
                    raise ValueError("only the perfx engine has a per-kernel profile")
                profs = profile_engine(
                    engine.engine, req["prompt"], int(req.get("steps", 16)), req.get("lens", [128, 512])
                )  # type: ignore[attr-defined]
                reply({"profiles": [asdict(p) for p in profs]})
            elif op == "peak":
                reply({"peak_rss_mb": _peak_mb(), "rss_mb": _rss_mb()})
            elif op == "quit":
                reply({"bye": True})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as err:  # report and keep serving; the driver decides
            reply({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def main() -> None:
    # Keep the protocol on a private copy of stdout; everything else printed goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(json.loads(sys.argv[1]), proto)


if __name__ == "__main__":
    main()
