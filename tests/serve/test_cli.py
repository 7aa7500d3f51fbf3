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


def test_served_model_name_is_what_the_user_typed(tmp_path: Path, capsys: Any) -> None:
    from perfx_compiler.cli.serve import main, served_model_name

    parse = build_parser().parse_args
    assert served_model_name(parse(["out"])) == "out"  # the README's `perfx-serve out`, not general.name
    assert served_model_name(parse(["out/"])) == "out"
    assert served_model_name(parse([str(tmp_path / "art")])) == "art"
    assert served_model_name(parse(["out", "--served-model-name", "smol"])) == "smol"
    assert served_model_name(parse(["out", "--model-name", "old-spelling"])) == "old-spelling"
    (tmp_path / "perfx-config.json").write_text("{}")
    assert main([str(tmp_path), "--served-model-name", " "]) == 2
    assert "--served-model-name must not be empty" in capsys.readouterr().err


def test_no_prefix_cache_reaches_the_engine(tmp_path: Path, monkeypatch: Any) -> None:
    import uvicorn

    import perfx_compiler.runtime.batch_engine as be
    import perfx_compiler.serve.app as app
    from perfx_compiler.cli.serve import main

    made: list[dict[str, Any]] = []

    class FakeEngine:
        def pool_summary(self) -> str:
            return "fake"

    def fake_engine(artifact: str, **kw: Any) -> object:
        made.append(kw)
        return FakeEngine()

    monkeypatch.setattr(be, "BatchEngine", fake_engine)
    monkeypatch.setattr(app, "create_app", lambda engine, **kw: None)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    (tmp_path / "perfx-config.json").write_text("{}")
    assert main([str(tmp_path)]) == 0
    assert main([str(tmp_path), "--no-prefix-cache"]) == 0
    assert [kw["prefix_cache"] for kw in made] == [True, False]
