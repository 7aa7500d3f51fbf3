"""``perfx-run``: generate a continuation with a compiled model and print its speed.

    perfx-run ARTIFACT_DIR_or_MODEL --prompt "Once upon a time" --max-tokens 64 [--json]

Plain mode prints the text, then one line with prefill and decode tok/s; ``--json``
prints one JSON object instead. User errors print ``perfx-run: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from perfx_compiler.cli._errors import run_command

PROG = "perfx-run"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Generate text with a PerfX-compiled model.")
    p.add_argument("model", help="compiled artifact directory, or a model to compile first (cached)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible runs)")
    p.add_argument("--stop", nargs="+", default=None, metavar="STR", help="stop strings")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--target", default="host", help="target to compile for when MODEL is not an artifact")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--no-verify", action="store_true", help="skip the artifact's sha256 check (faster load)")
    return p


def _fmt_rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} tok/s"


def kv_cache_bytes(manifest: dict[str, Any]) -> dict[str, Any]:
    """The contiguous KV cache's element type, bytes one token takes in it (k and v, every layer; an int8 row
    holds its float32 scale too) and bytes allocated for it (max_context tokens); none for a manifest without one."""
    kv = manifest.get("kv_cache")
    if not kv:
        return {}
    _, heads, positions, row = kv["shape"]
    itemsize = {"float32": 4, "float16": 2, "int8": 1}[kv["dtype"]]
    per_token = int(kv["count"]) * heads * row * itemsize
    return {"kv_cache_dtype": kv["dtype"], "kv_bytes_per_token": per_token, "kv_cache_bytes": per_token * positions}


def _run(args: argparse.Namespace) -> int:
    # Imported here so `perfx-run --help` stays instant.
    from perfx_compiler.llm import LLM
    from perfx_compiler.runtime.api import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, target=args.target, verify=not args.no_verify)
    if args.chat:
        messages: list[dict[str, Any]] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": args.prompt})
        result = llm.chat(messages, params)[0]
    else:
        result = llm.generate(args.prompt, params)[0]
    out = result.outputs[0]
    m = result.metrics
    if args.json:
        doc = {
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "prefill_tokens_per_s": m.prefill_tokens_per_s,
            "decode_tokens_per_s": m.decode_tokens_per_s,
            "time_to_first_token_s": m.time_to_first_token,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            **kv_cache_bytes(llm.manifest),
        }
        print(json.dumps(doc, ensure_ascii=False))
    else:
        print(out.text)
        print(
            f"[{len(result.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
            f"{out.finish_reason}] prefill: {_fmt_rate(m.prefill_tokens_per_s)}, "
            f"decode: {_fmt_rate(m.decode_tokens_per_s)}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
