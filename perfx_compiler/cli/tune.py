"""``perfx-tune``: tune a model's kernels for a target; records go to tuning_logs/<target>/<model>.jsonl.

    perfx-tune smollm2-135m --target x86-avx512 --time-budget 900
    perfx-tune smollm2-135m --target arm64-neon --no-measure          # cost-model picks, no timing
    perfx-tune smollm2-135m --target arm64-neon --import-records phone.jsonl
    perfx-tune smollm2-135m --target arm64-neon --rpc-tracker 127.0.0.1:9190 --rpc-key phone --rpc-parallel 2

Runs the compile pipeline's phases 0-2 (import, passes, lower), extracts the distinct workloads
(symbolic-M functions once per M bucket), and tunes them with the XGBoost-guided search: builds in
a process pool with a timeout, verification against the unscheduled function, timing on this CPU.
A killed run resumes without re-measuring anything in the log. ``perfx-compile`` picks the
records up from tuning_logs/<target>/ by default.

User errors print one line ``perfx-tune: error: ...`` and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from perfx_compiler.cli._errors import run_command
from perfx_compiler.errors import PerfXError

PROG = "perfx-tune"


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets takes comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("--buckets needs at least one M >= 1")
    return values


def _positive(kind: type) -> object:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected a value >= 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Autotune PerfX schedule templates for a model and target.")
    p.add_argument("model", help="a known model (smollm2-135m, gemma3-270m), a .gguf file, a Hugging Face folder or an .onnx file")
    p.add_argument("--target", default="host", help="a target from targets/ (default host)")
    p.add_argument("--quantization", default="f32", help="weight format, as for perfx-compile (default f32)")
    # Defaults sized so that tuning SmolLM2-135M on a 2-core host ends within 20 minutes, lowering
    # included (benchmarks/tuning_time.py measures it); the cost model also ends a workload early.
    p.add_argument("--trials", type=_positive(int), default=24,
                   help="measured configurations per workload and M bucket, counting those already logged (default 24)")
    p.add_argument("--time-budget", type=_positive(float), default=960.0, metavar="S",
                   help="stop after S seconds of tuning (import/lowering not counted; default 960)")
    p.add_argument("--no-measure", action="store_true",
                   help="do not time anything: pick configs from template defaults + the cost model, "
                        "write them as predicted records (targets that cannot run here)")
    p.add_argument("--import-records", default=None, metavar="FILE",
                   help="validate and import records measured elsewhere into the log, then stop")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="log root (default: the repo's tuning_logs/)")
    p.add_argument("--buckets", type=_buckets, default=None, help="M buckets for symbolic-M kernels (default 1,16,64,256)")
    p.add_argument("--templates", default=None, metavar="NAMES",
                   help="tune only workloads of these templates (comma-separated, e.g. gemv_cpu)")
    p.add_argument("--workers", type=int, default=None, help="parallel build processes (default: min(2, CPUs))")
    p.add_argument("--build-timeout", type=float, default=120.0, metavar="S", help="per-candidate build timeout")
    p.add_argument("--max-context", type=int, default=None, help="KV cache length, as for perfx-compile")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="time candidates on the devices registered at this TVM RPC tracker (docs/tuning.md)")
    p.add_argument("--rpc-key", default=None, metavar="KEY", help="device key of the servers to use (with --rpc-tracker)")
    p.add_argument("--rpc-parallel", type=int, default=1, metavar="N",
                   help="candidates timed at once, on N servers of the key (default 1)")
    p.add_argument("--rpc-timeout", type=_positive(float), default=60.0, metavar="S",
                   help="stop when no server of the key is free for S seconds (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _print_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"{'workload':<44} {'fns':>3} {'trials':>6} {'default us':>11} {'best us':>10} {'x':>5}  source")
    for r in sorted(rows, key=lambda r: -(r["best_us"] or 0) * r["functions"]):
        d = "-" if r["default_us"] is None else f"{r['default_us']:.1f}"
        b = "-" if r["best_us"] is None else f"{r['best_us']:.1f}"
        x = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        print(f"{r['workload'][:44]:<44} {r['functions']:>3} {r['trials']:>6} {d:>11} {b:>10} {x:>5}  {r['source'] or '-'}")


def run(args: argparse.Namespace) -> int:
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.records import DEFAULT_LOG_ROOT, TuningDatabase

    target = load_target(args.target)  # unknown target: UnknownTargetError, before any slow work
    tracker = None
    if args.rpc_tracker or args.rpc_key:
        from perfx_compiler.tune.rpc import check_tracker, parse_tracker

        if not (args.rpc_tracker and args.rpc_key):
            raise PerfXError("--rpc-tracker and --rpc-key go together (the tracker and the device key to tune on)")
        if args.rpc_parallel < 1:
            raise PerfXError(f"--rpc-parallel must be >= 1, not {args.rpc_parallel}")
        tracker = parse_tracker(args.rpc_tracker)
        check_tracker(tracker)  # a wrong address: one line now, not after lowering the model
    if not args.no_measure and not args.import_records and not target.runnable_here and tracker is None:
        raise PerfXError(f"target {target.name} cannot be measured on this machine; use --rpc-tracker HOST:PORT "
                         "--rpc-key KEY (a device), --no-measure (cost-model picks) or --import-records FILE")
    root = Path(args.log_dir) if args.log_dir else DEFAULT_LOG_ROOT
    from perfx_compiler.tune.session import log_name

    path = root / target.name / f"{log_name(args.model)}.jsonl"
    db = TuningDatabase(path, load_dir=True, strict=True)  # a corrupt log: one-line error, not garbage
    say = (lambda *a, **k: None) if args.quiet else print

    from perfx_compiler.pipeline import lower_model
    from perfx_compiler.tune.workloads import M_BUCKETS, extract_tasks

    start = time.perf_counter()
    options = {"quantization": args.quantization}
    if args.max_context:
        options["max_context"] = args.max_context
    mod, state = lower_model(args.model, args.target, **options)
    buckets = args.buckets or M_BUCKETS
    say(f"lowered {args.model} for {target.name} in {time.perf_counter() - start:.1f} s")

    if args.import_records:
        from perfx_compiler.tune.session import import_records

        every = extract_tasks(mod, target, buckets, only_tunable=False)
        added, dup = import_records(Path(args.import_records), db, every, target)
        print(f"imported {added} records into {path} ({dup} already there)")
        return 0

    from perfx_compiler.tune.session import group_tasks

    tasks = extract_tasks(mod, target, buckets)
    if args.templates:
        wanted = {t.strip() for t in args.templates.split(",") if t.strip()}
        known = {t.workload.template for t in tasks}
        if not wanted & known:
            raise PerfXError(f"--templates {args.templates}: no workload of this model uses them; "
                             f"its templates are {', '.join(sorted(known))}")
        tasks = [t for t in tasks if t.workload.template in wanted]
    groups = group_tasks(tasks)
    say(f"{len(tasks)} tasks ({len({t.workload.key for t in tasks})} workloads x M buckets {list(buckets)}), "
        f"{len(groups)} distinct; {len(db)} records already in {path.parent}")

    if args.no_measure:
        from perfx_compiler.tune.session import predict_groups, summary_rows, training_model

        model, scope = training_model(db, root, args.seed)
        say(f"cost model: {'trained on ' + scope if model.trained else 'untrained (no records): template defaults'}")
        written = predict_groups(groups, target, db, model)
        if not args.quiet:
            _print_table(summary_rows(groups, target, db))
        print(f"wrote {written} predicted records to {path}")
        return 0

    from perfx_compiler.tune.measure import LocalMeasurer
    from perfx_compiler.tune.session import tune_groups

    if tracker is not None:
        from perfx_compiler.tune.rpc import RPCMeasurer

        measurer: LocalMeasurer = RPCMeasurer(target, tracker, args.rpc_key, parallel=args.rpc_parallel,
                                              workers=args.workers, build_timeout_s=args.build_timeout,
                                              request_timeout_s=args.rpc_timeout)
    else:
        measurer = LocalMeasurer(target, workers=args.workers, build_timeout_s=args.build_timeout)
    with measurer:
        summary = tune_groups(groups, target, db, measurer, trials=args.trials, time_budget_s=args.time_budget,
                              seed=args.seed, show_progress=not args.quiet)
    if not args.quiet:
        _print_table(summary.rows)
    note = " (time budget reached; rerun to continue)" if summary.stopped_by_budget else ""
    if summary.failed:
        note += f"; {len(summary.failed)} workloads could not be measured (left at defaults): {', '.join(summary.failed[:4])}"
    print(f"measured {summary.measured} candidates in {summary.seconds:.0f} s, shared {summary.shared} records "
          f"with equivalent workloads, confirmed {summary.confirmed} winners ({summary.confirm_s:.0f} s); "
          f"log {path}{note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.ERROR, format="%(name)s: %(message)s")
    os.environ.setdefault("TQDM_MININTERVAL", "0.5")
    return run_command(PROG, lambda: run(args), debug=args.debug, interrupted="interrupted; records so far are saved, rerun to resume")


if __name__ == "__main__":
    sys.exit(main())
