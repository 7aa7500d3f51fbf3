"""perfx-serve command line: user errors are one line and exit 2 (no engine needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perfx_compiler.cli.serve import _is_loopback, build_parser


def test_cli_user_errors(tmp_path: Path, capsys: Any) -> None:
    from perfx_compiler.cli.serve import main

    assert main([str(tmp_path)]) == 2
    assert "not a compiled artifact" in capsys.readouterr().err
    assert main([str(tmp_path), "--max-batch", "0"]) == 2
    assert "--max-batch must be at least 1" in capsys.readouterr().err


def test_defaults_bind_loopback() -> None:
    args = build_parser().parse_args(["DIR"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.max_batch == 16 and args.queue_size == 64
    assert _is_loopback("127.0.0.1") and _is_loopback("localhost") and _is_loopback("::1")
    assert not _is_loopback("0.0.0.0")
