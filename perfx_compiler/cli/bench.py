"""``perfx-bench``: PerfX against llama.cpp and onnxruntime on the same model file, alternated.

    perfx-bench smollm2-135m --threads 2 --peers llama.cpp,ort-genai,ort --profile
    perfx-bench model.Q4_0.gguf --rounds 7 --out benchmarks/results

Each engine runs in its own worker process (``perfx_compiler.bench.worker``). Every round
measures every engine once (order reversed on odd rounds): decode (``--decode-tokens`` greedy
tokens after a ``--prompt-tokens`` prompt, EOS ignored), time to first token of that prompt, and
prefill of 128 and 512 tokens. Before each engine's turn the placement probe (ping-pong) runs.
The read-bandwidth probe (same thread count, a buffer far larger than the LLC) brackets every
engine's decode: once just before it and once just after it (after a settle pause, so neither
the probe's nor the engine's spinning pool threads overlap the other), and that turn's ceiling is
the mean of the two. On a shared VM the probe moves 2x between minutes; pairing each decode with
its own bracket is what makes "weights streamed / ceiling" comparable between turns. A
measurement during which other processes used more than ``--busy`` CPUs is redone
(``--max-redo`` times, then kept and flagged).

Every requested peer must run: one that cannot (package missing, conversion or worker load
failed) stops the bench with one line naming it (exit 2), so a "fastest peer" never silently
comes from fewer engines; ``--skip-failed-peers`` runs without it, and the run prints (and
``_machine.json`` records) which engines ran and which were skipped.

Writes ``bench_<model>.csv`` (medians, PerfX/peer ratios taken round by round), ``_rounds.csv``,
``_machine.json`` and ``bench_<model>.png``; with ``--profile`` also ``profile_<model>.csv`` and
``profile_<model>_roofline.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perfx_compiler.cli._errors import run_command
from perfx_compiler.errors import PerfXError
from perfx_compiler.targets import cpu_flags

PROG = "perfx-bench"
DEFAULT_PEERS = "llama.cpp,ort-genai,ort"
# peer -> (Python packages it runs on, the install that provides them); ort-genai's model builder
# (onnxruntime_genai.models.builder, run to convert the GGUF) imports torch, transformers and onnx_ir
PEER_PACKAGES = {
    "llama.cpp": (("llama_cpp",), 'pip install "perfx[bench]"'),
    "ort-genai": (("onnxruntime_genai", "torch", "transformers", "onnx_ir"), 'pip install "perfx[bench]"'),
    "ort": (("onnxruntime",), "pip install onnxruntime"),
}
PREFILL_LENS = (128, 512)  # the CSV's prefill128/prefill512 columns
# llama-cpp-python built for this CPU's AVX-512 (VNNI, BF16, VBMI) without ggml's AMX kernels
LLAMA_NO_AMX_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                           "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
                           "-DGGML_AVX_VNNI=ON")


def death_hint(engine: str, returncode: int | None) -> str:
    """What to do about a worker that died: for llama.cpp killed by SIGSEGV on a CPU with AMX, the
    rebuild without ggml's AMX kernels (built in by -march=native; they crash where the VM does not
    grant the tile state)."""
    if engine == "llama.cpp" and returncode == -11 and "amx_int8" in cpu_flags():
        return (" -- this CPU has AMX: rebuild llama-cpp-python without it, CMAKE_ARGS=\"" + LLAMA_NO_AMX_CMAKE_ARGS
                + "\" pip install --force-reinstall --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36")
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Benchmark PerfX against llama.cpp and onnxruntime.")
    p.add_argument("model", help="a .gguf file or a known model name (smollm2-135m, gemma3-270m)")
    p.add_argument("--quantization", default=None, help="PerfX quantization (default: best available for the file)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers", default=None,
                   help=f"comma list of peers, '' for PerfX only (default {DEFAULT_PEERS}; none with --rpc-tracker)")
    p.add_argument("--skip-failed-peers", action="store_true",
                   help="run without a requested peer that fails to load (default: that is an error, exit 2), "
                        "so a 'fastest peer' may come from fewer engines; the summary says which ran")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prefill-lens", default=",".join(map(str, PREFILL_LENS)),
                   help="prefill lengths to time, a subset of 128,512 ('' for none: big models); the others read n/a")
    p.add_argument("--profile", action="store_true", help="per-kernel profile of PerfX (decode and prefill)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="model label for file names (default: the GGUF stem)")
    p.add_argument("--work", default=None, help="folder for compiled/converted models (default: $TMPDIR/perfx-bench)")
    p.add_argument("--rebuild", action="store_true", help="recompile/convert even when cached")
    p.add_argument("--knob", action="append", default=[], metavar="TEMPLATE.KEY=VALUE",
                   help="build PerfX with this schedule template setting (repeatable; as perfx-compile --knob)")
    p.add_argument("--bw-size-mb", type=int, default=1024, help="array size of the bandwidth probe")
    p.add_argument("--busy", type=float, default=0.25, help="other processes' CPU use (in CPUs) that voids a run")
    p.add_argument("--max-redo", type=int, default=2)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--target", default="host",
                   help="target to compile MODEL for when it is not an artifact folder (with --rpc-tracker)")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="time PerfX on a device of this TVM RPC tracker instead of here (bench/remote.py)")
    p.add_argument("--rpc-key", default=None, metavar="KEY", help="device key of the server to run on")
    p.add_argument("--rpc-timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for a free server of the key")
    p.add_argument("--debug", action="store_true")
    return p


class Worker:
    """A worker subprocess for one engine."""

    def __init__(self, engine: str, path: Path, threads: int, log: Path, options: dict[str, Any] | None = None):
        spec = {"engine": engine, "path": str(path), "threads": threads, "options": options or {}}
        self.engine = engine
        self.log = log
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so a checkout without an install works too
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(log, "w") as errf:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "perfx_compiler.bench.worker", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errf,
                text=True,
                bufsize=1,
                env=env,
            )
        ready = self._read()
        self.load_s = float(ready.get("load_s", 0.0))

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            err = self.log.read_text(errors="replace") if self.log.is_file() else ""
            hint = death_hint(self.engine, self.proc.returncode)
            raise PerfXError(f"{self.engine} worker died (rc={self.proc.returncode}){hint}: {err.strip()[-1200:]}")
        msg = json.loads(line)
        if "error" in msg:
            raise PerfXError(f"{self.engine} worker: {msg['error']}\n{msg.get('traceback', '')}")
        return msg

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.ask("quit")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def peer_failed(args: argparse.Namespace, peer: str, why: str, skipped: dict[str, str]) -> None:
    """A requested peer that cannot run: an error naming it (a 'fastest peer' over fewer engines than
    asked for would mislead), or with ``--skip-failed-peers`` one printed line and a note in ``skipped``."""
    if not getattr(args, "skip_failed_peers", False):
        raise PerfXError(f"peer {peer} failed: {why} (--skip-failed-peers runs without it)")
    print(f"{PROG}: skipping {peer}: {why}")
    skipped[peer] = why


def check_peers(args: argparse.Namespace, peers: list[str], skipped: dict[str, str]) -> list[str]:
    """The requested peers that can start, checked before the machine probes and the builds: an
    unknown name is always an error; a missing package goes through :func:`peer_failed`."""
    import importlib.util

    unknown = [p for p in peers if p not in PEER_PACKAGES]
    if unknown:
        raise PerfXError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEER_PACKAGES)}")
    ok = []
    for peer in peers:
        modules, install = PEER_PACKAGES[peer]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            peer_failed(args, peer, f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
                        f"{install}", skipped)
        else:
            ok.append(peer)
    return ok


def _prepare(
    args: argparse.Namespace, gguf: Path, work: Path, peers: list[str], skipped: dict[str, str]
) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """Model forms for PerfX and each requested peer (a peer that fails: see :func:`peer_failed`)."""
    from perfx_compiler.bench import models

    paths: dict[str, Path] = {}
    meta: dict[str, dict[str, Any]] = {}
    from perfx_compiler.knobs import parse_knobs

    art, notes = models.compile_perfx(gguf, work, args.quantization, args.max_context, args.rebuild,
                                      knobs=parse_knobs(args.knob))
    paths["perfx"] = art
    meta["perfx"] = {
        "quantization": notes["effective"]
        if notes["requested"] == notes["effective"]
        else f"{notes['requested']}->{notes['effective']}",
        "note": notes["note"],
    }
    for peer in peers:
        try:
            if peer == "llama.cpp":
                paths[peer] = gguf
            elif peer == "ort-genai":
                paths[peer] = models.build_ort_genai(gguf, work, rebuild=args.rebuild)
            elif peer == "ort":
                paths[peer] = models.emit_ort_onnx(gguf, work, args.max_context, args.rebuild)
            meta[peer] = {"note": ""}
        except Exception as err:  # noqa: BLE001 - any failure of a peer's conversion is that peer's
            peer_failed(args, peer, f"preparing its model failed: {_one_line(err)}", skipped)
    return paths, meta


PROBE_SETTLE_S = 0.3  # idle time before a probe: the engine's pool threads stop spinning


def _measure(
    w: Worker,
    prompt: list[int],
    n_decode: int,
    prefill_ids: dict[int, list[int]],
    weight_bytes: int,
    probe: Any = None,
) -> dict[str, Any]:
    """One turn of one engine: decode (bracketed by bandwidth probes when ``probe`` is given), prefills."""
    bw_before = probe.measure(3) if probe is not None else float("nan")
    if probe is not None:
        time.sleep(0.05)  # the probe's OpenMP threads spin a little after their last pass
    d = w.ask("decode", prompt=prompt, n=n_decode)
    if probe is not None:
        time.sleep(PROBE_SETTLE_S)
    bw_after = probe.measure(3) if probe is not None else float("nan")
    achieved = weight_bytes * n_decode / d["decode_s"] / 1e9
    ceiling = (bw_before + bw_after) / 2
    row: dict[str, Any] = {
        "decode_tok_s": n_decode / d["decode_s"],
        "ttft_ms": d["ttft_s"] * 1e3,
        "achieved_gbs": achieved,
        "bw_before_gbs": round(bw_before, 2),
        "bw_after_gbs": round(bw_after, 2),
        "round_bw_gbs": round(ceiling, 2),
        "bw_fraction": round(achieved / ceiling, 4) if ceiling > 0 else float("nan"),
    }
    for n in PREFILL_LENS:
        ids = prefill_ids.get(n)
        row[f"prefill{n}_tok_s"] = n / w.ask("prefill", ids=ids)["prefill_s"] if ids else float("nan")
    return row


def _load_workers(args: argparse.Namespace, paths: dict[str, Path], meta: dict[str, dict[str, Any]], work: Path,
                  name: str, prefill_lens: list[int], skipped: dict[str, str], workers: dict[str, Worker]) -> None:
    """Start a worker per engine into ``workers`` (the caller closes them); a peer that fails to load goes
    through :func:`peer_failed`, PerfX failing is an error."""
    for eng, path in paths.items():
        opts: dict[str, Any] = {}
        if eng == "llama.cpp":
            opts = {"n_ctx": args.max_context, "n_batch": max([512, *prefill_lens])}
        elif eng == "ort-genai":
            opts = {"max_length": args.max_context}
        try:
            workers[eng] = Worker(eng, path, args.threads, work / f"worker-{name}-{eng}.log", opts)
            info = workers[eng].ask("info")
        except PerfXError as err:
            if eng == "perfx":
                raise
            failed = workers.pop(eng, None)
            if failed is not None:
                failed.close()
            peer_failed(args, eng, f"its worker failed to load: {_one_line(err)}", skipped)
            continue
        extra = {k: v for k, v in info["info"].items() if v}
        if eng == "perfx":  # keep "requested->effective" from the compile step
            extra.pop("quantization", None)
        meta[eng].update(weight_bytes=int(info["weight_bytes"]), **extra)
        print(
            f"{PROG}: {eng} loaded in {workers[eng].load_s:.1f} s, {info['weight_bytes'] / 1e6:.1f} MB weights "
            f"per token, {info['info']}"
        )


def _alternated_rounds(args: argparse.Namespace, workers: dict[str, Worker], meta: dict[str, dict[str, Any]], name: str,
                       prompt: list[int], prefill_ids: dict[int, list[int]], prefill_lens: list[int],
                       probe: Any) -> list[dict[str, Any]]:
    """``--rounds`` rounds, every engine once a round (order reversed on odd rounds); a measurement during
    which other processes used more than ``--busy`` CPUs is redone up to ``--max-redo`` times."""
    from perfx_compiler.bench import machine as mach

    names = list(workers)
    pids = [w.proc.pid for w in workers.values()]
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for eng in order:
            w = workers[eng]
            for redone in range(args.max_redo + 1):  # noqa: B007 (kept: how many redos it took)
                ns = mach.pingpong_ns(settle_s=0.3)
                watch = mach.CpuWatch(pids).start()
                row = _measure(w, prompt, args.decode_tokens, prefill_ids, meta[eng]["weight_bytes"], probe)
                other = watch.stop()
                if other <= args.busy:
                    break
                print(f"  round {r} {eng}: other processes used {other:.2f} CPUs, redoing")
            row.update(
                model=name,
                engine=eng,
                round=r,
                pingpong_ns=round(ns, 1),
                placement=mach.placement(ns),
                other_cpu=round(other, 3),
                redone=redone,
                disturbed=other > args.busy,
                load_avg_1m=round(os.getloadavg()[0], 2),
            )
            rounds.append(row)
            print(
                f"  round {r} {eng:<10} decode {row['decode_tok_s']:7.1f} tok/s  prefill "
                + " ".join(f"{row.get(f'prefill{n}_tok_s', 0):7.1f}" for n in prefill_lens)
                + f"  ttft {row['ttft_ms']:6.1f} ms  {row['achieved_gbs']:5.1f} GB/s  bw {row['bw_before_gbs']:5.1f}"
                f"/{row['bw_after_gbs']:5.1f} ({100 * row['bw_fraction']:3.0f}%)  "
                f"pp {ns:5.0f} ns ({row['placement']}) other {other:.2f}"
            )
    return rounds


def _machine_record(args: argparse.Namespace, m0: Any, m1: Any, rounds: list[dict[str, Any]], gguf: Path,
                    skipped: dict[str, str]) -> dict[str, Any]:
    """``_machine.json``: the machine probed before (``m0``) and after (``m1``) the run, the per-turn
    bandwidth brackets, and which engines ran or were skipped."""
    return {
        "cpu": m0.cpu,
        "cores": m0.cores,
        "threads": args.threads,
        "bw_1thread_gbs": m0.bandwidth_1t_gbs,
        "bw_start_gbs": m0.bandwidth_gbs,
        "bw_end_gbs": m1.bandwidth_gbs,
        "pingpong_start_ns": m0.pingpong_ns,
        "pingpong_end_ns": m1.pingpong_ns,
        "bw_rounds_gbs": [r["round_bw_gbs"] for r in rounds],
        "bw_probes_gbs": [[r["bw_before_gbs"], r["bw_after_gbs"]] for r in rounds],
        "bw_probe_note": "per turn: best of 3 passes over the buffer just before and just after the decode; "
        "the turn's ceiling is their mean; bw_fraction = median over turns of achieved / that ceiling",
        "line": m0.line(),
        "model_file": str(gguf),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "engines": list(dict.fromkeys(r["engine"] for r in rounds)),
        "peers_skipped": skipped,  # requested peers that did not run (--skip-failed-peers), and why
    }


def run(args: argparse.Namespace) -> int:
    import tempfile

    import numpy as np

    from perfx_compiler.bench import machine as mach
    from perfx_compiler.bench import models, report

    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "perfx-bench"
    work.mkdir(parents=True, exist_ok=True)
    remote = bool(args.rpc_tracker or args.rpc_key)
    peers_text = args.peers if args.peers is not None else ("" if remote else DEFAULT_PEERS)
    peers = [p.strip() for p in peers_text.split(",") if p.strip()]
    prefill_lens = [int(x) for x in str(args.prefill_lens).split(",") if x.strip()]
    if any(n not in PREFILL_LENS for n in prefill_lens):
        raise PerfXError(f"--prefill-lens takes lengths among {PREFILL_LENS} (the CSV's columns), not {args.prefill_lens}")
    if remote:
        from perfx_compiler.bench.remote import run_remote

        args.peers = peers
        return run_remote(args, work, prefill_lens)
    if args.prompt_tokens + args.decode_tokens + 1 > args.max_context or max(prefill_lens, default=0) > args.max_context:
        raise PerfXError(f"prompt + decode tokens and prefill lengths {prefill_lens} must fit --max-context")
    if args.target != "host":
        raise PerfXError(f"--target {args.target} runs on a device: give --rpc-tracker and --rpc-key (peers run here)")
    gguf = models.resolve_model(args.model)
    name = args.name or models.model_key(gguf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    size = args.bw_size_mb << 20
    print(f"{PROG}: probing the machine ...")
    skipped: dict[str, str] = {}  # peer -> why it did not run (--skip-failed-peers)
    peers = check_peers(args, peers, skipped)
    m0 = mach.probe_machine(args.threads, size)
    print(m0.line())
    paths, meta = _prepare(args, gguf, work, peers, skipped)

    workers: dict[str, Worker] = {}
    probes: list[Any] = []
    try:
        _load_workers(args, paths, meta, work, name, prefill_lens, skipped, workers)
        vocab = json.loads((paths["perfx"] / "perfx-config.json").read_text())["model"]["vocab_size"]
        rng = np.random.default_rng(0)
        hi = max(101, min(vocab, 20000))
        prompt = rng.integers(100, hi, size=args.prompt_tokens).tolist()
        prefill_ids = {n: rng.integers(100, hi, size=n).tolist() for n in prefill_lens}
        # warm-up: one short pass per engine (page-in weights, thread pools, allocator)
        for w in workers.values():
            w.ask("decode", prompt=prompt, n=8)
            if prefill_lens:
                w.ask("prefill", ids=prefill_ids[prefill_lens[0]])
        print(f"{PROG}: engines: {', '.join(workers)}"
              + (f"; skipped: {', '.join(f'{k} ({v})' for k, v in skipped.items())}" if skipped else ""))
        probe = mach.BandwidthProbe(args.threads, size)  # one buffer for all the probes of the run
        probes.append(probe)
        rounds = _alternated_rounds(args, workers, meta, name, prompt, prefill_ids, prefill_lens, probe)
        probe.close()  # free the 1 GiB before the profile
        profiles = None
        if args.profile:
            print(f"{PROG}: profiling PerfX kernels ...")
            profiles = workers["perfx"].ask("profile", prompt=prompt, steps=16, lens=prefill_lens)["profiles"]
        for eng, w in workers.items():
            meta[eng]["peak_rss_mb"] = w.ask("peak")["peak_rss_mb"]
    finally:
        for w in workers.values():
            w.close()
        for pr in probes:
            pr.close()

    machine = _machine_record(args, m0, mach.probe_machine(args.threads, size), rounds, gguf, skipped)
    summary = report.summarize(rounds, meta, machine, name, args.threads)
    report.write_csv(out / f"bench_{name}.csv", summary, report.SUMMARY_COLUMNS)
    report.write_csv(out / f"bench_{name}_rounds.csv", rounds, report.ROUND_COLUMNS)
    (out / f"bench_{name}_machine.json").write_text(json.dumps(machine, indent=1))
    report.print_summary(summary)
    print(m0.line())
    print(f"{PROG}: engines that ran: {', '.join(machine['engines'])}"
          + (f"; requested but skipped: {', '.join(skipped)}" if skipped else ""))
    if not args.no_plot:
        report.plot_summary(summary, out / f"bench_{name}.png", f"{name}: {args.threads} threads; {m0.line()}")
    if profiles is not None:
        _write_profile(profiles, out, name, summary)
    print(f"{PROG}: wrote {out / f'bench_{name}.csv'}")
    return 0


def _write_profile(raw: list[dict[str, Any]], out: Path, name: str, summary: list[dict[str, Any]]) -> None:
    from perfx_compiler.bench import profile as prof
    from perfx_compiler.bench import report
    from perfx_compiler.targets import load_target

    profiles = [
        prof.PhaseProfile(p["phase"], p["steps"], p["plain_step_s"], [prof.KernelStat(**k) for k in p["kernels"]])
        for p in raw
    ]
    t = load_target("host")
    target = {"memory_bandwidth_gbs": t.memory_bandwidth_gbs, "peak_gflops_fp32": t.peak_gflops_fp32}
    bw = float(summary[0]["bw_ceiling_gbs"]) if summary else 0.0
    prof.print_profile(profiles, bw, target)
    rows = prof.profile_rows(profiles, bw, target)
    cols = list(rows[0]) if rows else ["phase", "kernel"]
    report.write_csv(out / f"profile_{name}.csv", rows, cols)
    prof.plot_roofline(profiles, bw, target, out / f"profile_{name}_roofline.png", f"PerfX kernels, {name} ({t.name})")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
