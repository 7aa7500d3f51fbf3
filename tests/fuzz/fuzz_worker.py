"""Fuzz worker: runs many bad-input cases in one process and reports each on its own line.

    python tests/fuzz/fuzz_worker.py CASES.json START

CASES.json is a list of case dicts (``op`` plus the op's arguments); the worker runs them from
index START on. Protocol lines go to the original stdout (fd 1 is pointed at stderr so that a
library's own prints cannot corrupt them): ``{"ready": true}`` once the imports are done, then per
case ``{"i": N, "start": true}`` before and ``{"i": N, "status": ..., ...}`` after it. Status is
``ok`` (the input was accepted; ``detail`` says what came out), ``perfx`` (a PerfXError: the one
clear error the user sees) or ``error`` (any other exception: a bug). A crash or a hang leaves a
``start`` without its result, which the parent (``fuzz_harness.run_cases``) reports.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _op_load_model(case: dict[str, Any]) -> Any:
    """Load a (mutated) model file the way perfx-compile does, and touch every weight."""
    import numpy as np

    from perfx_compiler.model.lazy import is_lazy
    from perfx_compiler.model.loader import load_model

    desc = load_model(case["path"], lazy=case.get("lazy"))
    desc.validate()
    lazy = 0
    for w in desc.weights.values():
        if is_lazy(w):  # dequantized on demand: what the float paths would do with it
            lazy += 1
            np.asarray(w)
    return {"weights": len(desc.weights), "lazy": lazy}


def _op_tuning_log(case: dict[str, Any]) -> Any:
    """Read a (torn / garbage) tuning log and ask it every question the compiler asks."""
    from perfx_compiler.tune.records import TuningDatabase

    db = TuningDatabase(case["path"], load_dir=False, strict=bool(case.get("strict")))
    for r in db.records():
        for bucket in (None, r.bucket):
            db.best(r.workload_key, r.target_key, bucket, nearest=True)
            db.measured_configs(r.workload_key, r.target_key, bucket)
            db.confirmation(r.workload_key, r.target_key, bucket)
        db.buckets(r.workload_key, r.target_key)
        _ = r.ok, r.stale
    return {"records": [r.to_json() for r in db.records()]}


def _op_artifact(case: dict[str, Any]) -> Any:
    """Load a (corrupted) compiled artifact and generate greedily."""
    from perfx_compiler.llm import LLM
    from perfx_compiler.runtime.api import SamplingParams

    llm = LLM(case["path"])
    out = llm.generate(case.get("prompt", "hello"), SamplingParams(max_tokens=int(case.get("max_tokens", 4)), temperature=0))
    return {"token_ids": out[0].outputs[0].token_ids}


def _op_selftest(case: dict[str, Any]) -> Any:
    """What the harness must survive and report (test_fuzz_harness.py)."""
    import signal
    import time

    from perfx_compiler.errors import ModelFormatError

    action = case["action"]
    if action == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "abort":
        os.abort()
    elif action == "hang":
        time.sleep(3600)
    elif action == "perfx":
        raise ModelFormatError("a clear error")
    elif action == "raise":
        raise KeyError("a bug")
    return {"action": action}


OPS = {"load_model": _op_load_model, "tuning_log": _op_tuning_log, "artifact": _op_artifact, "selftest": _op_selftest}


def _warm(cases: list[dict[str, Any]]) -> None:
    """Import what the cases need before saying ready, so the first case's deadline is a case's."""
    import perfx_compiler.errors  # noqa: F401

    ops = {c["op"] for c in cases}
    if "load_model" in ops:
        import perfx_compiler.model.foreign_onnx.graph_to_description  # noqa: F401
        import perfx_compiler.model.gguf  # noqa: F401
        import perfx_compiler.model.loader  # noqa: F401
        import perfx_compiler.model.onnx_read  # noqa: F401
    if "tuning_log" in ops:
        import perfx_compiler.tune.records  # noqa: F401
        import perfx_compiler.tune.traffic  # noqa: F401
    if "artifact" in ops:
        import perfx_compiler.llm  # noqa: F401
        import perfx_compiler.runtime.engine  # noqa: F401


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[0]).read_text())
    start = int(argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (Python or native) go to stderr, never into the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.ERROR)
    warnings.simplefilter("ignore")
    from perfx_compiler.errors import PerfXError

    _warm(cases[start:])
    proto.write(json.dumps({"ready": True}) + "\n")
    for i in range(start, len(cases)):
        case = cases[i]
        proto.write(json.dumps({"i": i, "start": True}) + "\n")
        sys.stderr.write(f"--- case {i}: {case.get('id')}\n")
        sys.stderr.flush()
        try:
            detail = OPS[case["op"]](case)
            res: dict[str, Any] = {"i": i, "status": "ok", "detail": detail}
        except PerfXError as err:
            res = {"i": i, "status": "perfx", "type": type(err).__name__, "message": str(err)}
        except BaseException as err:  # noqa: BLE001 - every other exception is what the fuzzing looks for
            tb = traceback.format_exc(limit=-6)
            res = {"i": i, "status": "error", "type": type(err).__name__, "message": str(err)[:500], "traceback": tb}
        proto.write(json.dumps(res, default=str) + "\n")
    proto.write(json.dumps({"done": True}) + "\n")
    proto.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
