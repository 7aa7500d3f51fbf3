"""The decode replay loop is one-time setup: built by ``perfx-compile`` (or at engine load on a machine
that has none), recorded at load, and never rebuilt or recorded inside a timed decode step.

Issue 22 item 7: the first ``perfx-run`` on a new machine printed 6.8 tok/s (the next ~180) because
ninja built the loop inside the first decode step, and rebuilt its object later when a header's mtime
moved. Here a fresh cache folder ($XDG_CACHE_HOME) plays the new machine; every build, record and
decode call is logged in order, so the test does not depend on timings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from perfx_compiler.cli import compile as compile_cli
from perfx_compiler.cli import run as run_cli
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.runtime import decode_replay
from perfx_compiler.runtime.engine import Engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def events(monkeypatch, tmp_path):
    """A fresh native cache and a log of builds ("build"), records ("record") and decode calls ("decode")."""
    import tvm_ffi.cpp

    log: list[str] = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    decode_replay._module.cache_clear()  # this process may hold the loop from the real cache

    def logged(name, fn):
        def wrapper(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(tvm_ffi.cpp, "build_inline", logged("build", tvm_ffi.cpp.build_inline))
    monkeypatch.setattr(tvm_ffi.cpp, "load_inline", logged("build", tvm_ffi.cpp.load_inline))
    monkeypatch.setattr(decode_replay, "record", logged("record", decode_replay.record))
    monkeypatch.setattr(Engine, "decode", logged("decode", Engine.decode))
    monkeypatch.setattr(Engine, "decode_greedy", logged("decode", Engine.decode_greedy))
    yield log
    decode_replay._module.cache_clear()  # later tests load the loop from their own cache again


def _after_first_decode(events: list[str]) -> list[str]:
    return events[events.index("decode"):]


def _run(art, capsys) -> dict:
    capsys.readouterr()
    assert run_cli.main([str(art), "--prompt", "hello world", "--max-tokens", "6", "--json", "--no-verify"]) == 0
    return json.loads(capsys.readouterr().out)


def test_loop_built_at_compile_and_load_never_in_a_decode_step(events, tmp_path, capsys):
    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", context_length=64)
    art = tmp_path / "art"
    assert compile_cli.main([str(gguf), "--target", "host", "-o", str(art), "--max-context", "64", "--quiet"]) == 0
    # perfx-compile built the loop for this machine
    assert events == ["build"] and decode_replay.library_path().is_file()

    events.clear()
    out = _run(art, capsys)
    assert len(out["token_ids"]) == 6 and out["decode_tokens_per_s"] is not None
    # the step was recorded at load, before any decode; nothing was built (the file exists)
    assert events[0] == "record" and set(_after_first_decode(events)) == {"decode"}, events
    assert "build" not in events, events

    # a machine that has the artifact but not the loop (copied there): built at load, still before decode
    shutil.rmtree(decode_replay.cache_dir())
    decode_replay._module.cache_clear()
    events.clear()
    _run(art, capsys)
    assert events[:2] == ["record", "build"] and set(_after_first_decode(events)) == {"decode"}, events

    # a later process on that machine loads the file as it is: no ninja run that could rebuild it
    decode_replay._module.cache_clear()
    events.clear()
    engine = Engine(art, verify=False)
    assert events == ["record"] and engine.decode_path.startswith("replay ("), (events, engine.decode_path)

    # a damaged library in the cache (a truncated copy) is built anew, not a failed load; in a process of
    # its own (this one holds the loaded library, which dlopen would hand back), the file replaced, not
    # written over (this process maps it)
    lib = decode_replay.library_path()
    lib.unlink()
    lib.write_bytes(b"\x7fELF truncated")
    script = "import sys; from perfx_compiler.runtime.engine import Engine; print(Engine(sys.argv[1]).decode_path)"
    res = subprocess.run([sys.executable, "-c", script, str(art)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0 and res.stdout.startswith("replay ("), res.stderr[-2000:]
    assert lib.stat().st_size > 1000 and "rebuilding it" in res.stderr
