"""``perfx-bench --rpc-tracker HOST:PORT --rpc-key KEY``: a compiled artifact's decode and prefill timed
on a device reached through TVM RPC (a phone, a board, a remote GPU box).

    perfx-bench smollm2-135m --target arm64-neon --rpc-tracker 127.0.0.1:9190 --rpc-key phone --peers ''
    perfx-bench path/to/artifact --rpc-tracker 127.0.0.1:9190 --rpc-key jetson --peers ''

The model is a compiled artifact folder, or a GGUF / known model compiled here for ``--target``. The
artifact is uploaded once (``runtime/remote.py``); each round times on the device, with
``time_evaluator`` (no network round trip counted): ``--decode-tokens`` decode steps at the middle of
the generation window (position prompt + decode/2), the prompt's prefill (time to first token) and
each ``--prefill-lens`` prefill. Peers run on this machine, not on the device, so none is run.

Achieved GB/s = decode weight bytes x tok/s, divided by the device's read bandwidth measured just
before each round's decode (``bench/remote_bandwidth.py``: a read kernel built for the target, timed on
the device over ``--bw-size-mb``; CPU targets) and, for every target, by the target description's nominal
``memory_bandwidth_gbs``.
Writes ``bench_<model>_rpc-<key>.csv`` (one row per round + the median) and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from perfx_compiler.errors import DeviceUnavailableError, PerfXError

PROG = "perfx-bench"
COLUMNS = ["model", "engine", "target", "device", "round", "decode_tok_s", "decode_ms", "decode_position", "ttft_ms",
           "prefill128_tok_s", "prefill512_tok_s", "weight_mb_per_token", "achieved_gbs", "device_bw_gbs", "bw_fraction",
           "nominal_bw_gbs", "bw_fraction_nominal"]


def artifact_for(args: argparse.Namespace, work: Path) -> Path:
    """The artifact to run: MODEL itself when it is one, else MODEL compiled here for ``--target``."""
    from perfx_compiler.bench import models
    from perfx_compiler.knobs import parse_knobs
    from perfx_compiler.runtime.engine import MANIFEST

    folder = Path(args.model).expanduser()
    if (folder / MANIFEST).is_file():
        return folder
    gguf = models.resolve_model(args.model)
    art, _ = models.compile_perfx(gguf, work, args.quantization, args.max_context, args.rebuild,
                                  knobs=parse_knobs(args.knob), target=args.target)
    return art


def _connect(args: argparse.Namespace, manifest: dict[str, Any]) -> tuple[Any, Any]:
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.rpc import NoFreeServer, check_tracker, parse_tracker, remote_device, request_session

    tracker = parse_tracker(args.rpc_tracker)
    check_tracker(tracker)
    try:
        sess = request_session(tracker, args.rpc_key, args.rpc_timeout)
    except NoFreeServer as err:
        raise DeviceUnavailableError(
            f"no RPC server with key {args.rpc_key!r} at {tracker[0]}:{tracker[1]}: {err}; register one (docs/tuning.md) "
            "or raise --rpc-timeout") from None
    target = load_target(manifest["target"]["name"])
    return sess, remote_device(sess, target)


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0], round="median")
    for col in COLUMNS:
        values = [r[col] for r in rows if isinstance(r.get(col), int | float) and not isinstance(r.get(col), bool)]
        if col not in ("round", "decode_position") and len(values) == len(rows):
            out[col] = round(statistics.median(values), 4)
    return out


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in ("decode_tok_s", "prefill128_tok_s", "prefill512_tok_s") if rows[0].get(c) not in ("", None)]
    fig, axes = plt.subplots(1, len(cols), figsize=(4 * len(cols), 3.4), squeeze=False)
    for ax, col in zip(axes[0], cols, strict=True):
        ax.bar([str(r["round"]) for r in rows], [float(r[col]) for r in rows], color="#4477aa")
        ax.set_title(col.replace("_tok_s", " tok/s"))
        ax.set_xlabel("round")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_remote(args: argparse.Namespace, work: Path, prefill_lens: list[int]) -> int:
    import tvm  # noqa: F401 - the whole TVM (it builds the bandwidth probe) before the engine's runtime-only import

    from perfx_compiler.bench.engines import perfx_weight_bytes
    from perfx_compiler.bench.remote_bandwidth import device_read_probe
    from perfx_compiler.runtime.engine import read_manifest
    from perfx_compiler.runtime.remote import RemoteEngine
    from perfx_compiler.targets import load_target

    if not args.rpc_key:
        raise PerfXError("--rpc-tracker and --rpc-key go together (the tracker and the device key to run on)")
    if args.peers:
        raise PerfXError("peers run on this machine, not on the RPC device: pass --peers '' with --rpc-tracker")
    art = artifact_for(args, work)
    manifest = read_manifest(art, verify=False)
    target = load_target(manifest["target"]["name"])
    name = args.name or art.name
    sess, dev = _connect(args, manifest)
    t0 = time.perf_counter()
    try:
        engine = RemoteEngine(art, sess, dev)
    except PerfXError:
        raise
    except Exception as err:  # noqa: BLE001 - a device that cannot load the artifact: one line
        raise PerfXError(f"the device of key {args.rpc_key!r} could not load {art}: "
                         f"{str(err).strip().splitlines()[-1][:300]}") from None
    print(f"{PROG}: {art.name} ({target.name}) loaded on rpc:{args.rpc_key} in {time.perf_counter() - t0:.1f} s")
    weight_bytes = perfx_weight_bytes(manifest)
    position = args.prompt_tokens + args.decode_tokens // 2
    probe = device_read_probe(sess, dev, target, mib=args.bw_size_mb)  # built and uploaded once
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        try:
            device_bw = probe.gbs() if probe is not None else None
            step_s = engine.time_call("decode", 1, position, number=args.decode_tokens)[0]
            ttft_s = engine.time_call("prefill", args.prompt_tokens, 0, number=2)[0]
            prefill = {n: n / engine.time_call("prefill", n, 0, number=2)[0] for n in prefill_lens}
        except Exception as err:  # noqa: BLE001 - a session that broke mid-run: one line, rounds so far kept
            if not rows:
                raise PerfXError(f"the RPC session to {args.rpc_key!r} failed: "
                                 f"{str(err).strip().splitlines()[-1][:300]}") from None
            print(f"{PROG}: round {r}: the RPC session failed ({str(err).strip().splitlines()[-1][:200]}); "
                  f"keeping {len(rows)} round(s)")
            break
        tok_s = 1.0 / step_s
        row = {"model": name, "engine": "perfx", "target": target.name, "device": f"rpc:{args.rpc_key}", "round": r,
               "decode_tok_s": round(tok_s, 2), "decode_ms": round(step_s * 1e3, 4), "decode_position": position,
               "ttft_ms": round(ttft_s * 1e3, 3),
               "weight_mb_per_token": round(weight_bytes / 1e6, 2), "achieved_gbs": round(weight_bytes * tok_s / 1e9, 3),
               "device_bw_gbs": round(device_bw, 2) if device_bw else "",
               "bw_fraction": round(weight_bytes * tok_s / 1e9 / device_bw, 4) if device_bw else "",
               "nominal_bw_gbs": target.memory_bandwidth_gbs,
               "bw_fraction_nominal": round(weight_bytes * tok_s / 1e9 / target.memory_bandwidth_gbs, 4)
               if target.memory_bandwidth_gbs else ""}
        for n in (128, 512):
            row[f"prefill{n}_tok_s"] = round(prefill[n], 2) if n in prefill else ""
        rows.append(row)
        print(f"  round {r} rpc:{args.rpc_key} decode {tok_s:8.1f} tok/s ({row['achieved_gbs']:.2f} GB/s, device "
              f"reads {row['device_bw_gbs'] or '-'} GB/s)  ttft "
              f"{row['ttft_ms']:7.1f} ms  prefill " + " ".join(f"{n}: {prefill[n]:.1f} tok/s" for n in prefill_lens))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from perfx_compiler.bench import report

    rows.append(_median_row(rows))
    csv_path = report.write_csv(out / f"bench_{name}_rpc-{args.rpc_key}.csv", rows, COLUMNS)
    (out / f"bench_{name}_rpc-{args.rpc_key}.json").write_text(json.dumps(
        {"artifact": str(art), "target": target.name, "device": f"rpc:{args.rpc_key}", "tracker": args.rpc_tracker,
         "date": time.strftime("%Y-%m-%d %H:%M:%S"), "prompt_tokens": args.prompt_tokens,
         "decode_tokens": args.decode_tokens, "timing": "time_evaluator on the device (no network round trip)",
         "bandwidth": "device_bw_gbs: read kernel timed on the device before each round's decode (CPU targets); "
                      f"nominal_bw_gbs: the target description's; probe size {args.bw_size_mb} MiB"}, indent=1))
    med = rows[-1]
    measured = f"{med['device_bw_gbs']} GB/s measured on the device, " if med["device_bw_gbs"] != "" else ""
    print(f"{PROG}: rpc:{args.rpc_key} median decode {med['decode_tok_s']} tok/s, {med['achieved_gbs']} GB/s of "
          f"{measured}{target.memory_bandwidth_gbs} GB/s nominal; ttft {med['ttft_ms']} ms")
    if not args.no_plot:
        plot(rows[:-1], out / f"bench_{name}_rpc-{args.rpc_key}.png",
             f"{name} on rpc:{args.rpc_key} ({target.name}), timed on the device")
    print(f"{PROG}: wrote {csv_path}")
    return 0
