"""``perfx-serve``: an OpenAI-compatible HTTP server with continuous batching over a compiled model.

    perfx-serve ARTIFACT_DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-batch 16] [--queue-size 64]
                [--served-model-name NAME]

Serves ``/v1/completions``, ``/v1/chat/completions`` (streaming too), ``/v1/models``,
``/health`` and ``/metrics``. It binds to 127.0.0.1 unless told otherwise; the API key
may also come from $PERFX_API_KEY. The model is served under the artifact folder's name
(``perfx-serve out`` serves ``"model": "out"``), or ``--served-model-name``, as vLLM names it
after the path it was given. User errors print ``perfx-serve: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from perfx_compiler.cli._errors import require, run_command
from perfx_compiler.errors import PerfXError

PROG = "perfx-serve"


class UsageError(PerfXError):
    """A bad command line (reported like any user error)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Serve a PerfX-compiled model over an OpenAI-compatible API.")
    p.add_argument("artifact", help="compiled artifact directory (perfx-compile MODEL -o DIR)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $PERFX_API_KEY)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most (default 16)")
    p.add_argument("--queue-size", type=int, default=64, help="waiting requests before answering 503 (default 64)")
    p.add_argument("--num-pages", type=int, default=None, help="KV cache pages (default: max-batch full contexts)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per step (default 256)")
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="do not keep full prompt pages for later requests with the same prefix (default: keep them)",
    )
    # --model-name: this option's earlier spelling, kept so existing command lines still work
    p.add_argument(
        "--served-model-name",
        "--model-name",
        dest="served_model_name",
        default=None,
        help="model id in the API (default: the artifact folder's name, e.g. 'out')",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for requests that give none")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-verify", action="store_true", help="skip the artifact's sha256 check (faster start)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("max_batch", "queue_size", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_pages is not None and args.num_pages < 1:
        raise UsageError("--num-pages must be at least 1")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name must not be empty")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not (Path(args.artifact) / "perfx-config.json").is_file():
        raise UsageError(
            f"{args.artifact} is not a compiled artifact (no perfx-config.json); "
            "compile one with 'perfx-compile MODEL -o DIR'"
        )


def served_model_name(args: argparse.Namespace) -> str:
    """The name clients put in "model": the one the user gave, else the artifact folder's own name
    (not the weights' metadata name, which the user never typed and may hold spaces)."""
    if args.served_model_name is not None:
        return str(args.served_model_name)
    return Path(os.path.abspath(args.artifact)).name  # abspath: "out/" and "." name a folder too


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run(args: argparse.Namespace) -> int:
    require("uvicorn", "fastapi", "prometheus_client")  # the "serve" extra; checked before any other work
    _check(args)
    # Imported here so `perfx-serve --help` stays instant.
    import uvicorn

    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.serve.app import create_app

    api_key = args.api_key or os.environ.get("PERFX_API_KEY") or None
    if not _is_loopback(args.host) and not api_key:
        print(
            f"{PROG}: warning: serving on {args.host} without --api-key; anyone who can reach it may use it",
            file=sys.stderr,
        )
    engine = BatchEngine(
        args.artifact,
        verify=not args.no_verify,
        num_pages=args.num_pages,
        max_batch=args.max_batch,
        prefix_cache=args.prefix_cache,
    )
    print(f"{PROG}: KV pool: {engine.pool_summary()} (--num-pages; its storage: perfx-compile --kv-cache)",
          file=sys.stderr)
    app = create_app(
        engine,
        model_name=served_model_name(args),
        api_key=api_key,
        max_queue=args.queue_size,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
