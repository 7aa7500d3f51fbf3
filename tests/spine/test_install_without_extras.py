"""A plain ``pip install .`` (no extras) in a fresh venv: every console command either works or says
in one line which extra to install, never a traceback (issue 22 item 8: perfx-serve died with
``ModuleNotFoundError: uvicorn``).

The venv is made without --system-site-packages and gets the checkout's wheel with its core
dependencies only (from pip's configured mirrors; ~1.5 minutes), so nothing of the test environment's
extras (fastapi, uvicorn, llama-cpp-python, onnxruntime-genai) is importable there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _wheel(tmp: Path) -> Path:
    """The checkout's wheel, built from a copy of its files (the repo's build/ folder holds stale ones)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"], capture_output=True,
                            text=True, check=True)
    src = tmp / "src"
    for f in listed.stdout.splitlines():
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp)], capture_output=True, text=True, check=True)
    (wheel,) = tmp.glob("perfx-*.whl")
    return wheel


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """bin/ of a fresh venv holding perfx and its core dependencies, no extras."""
    tmp = tmp_path_factory.mktemp("bare")
    wheel = _wheel(tmp)
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    py = env_dir / "bin" / "python"
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True)
    assert out.returncode == 0, f"pip install perfx failed:\n{out.stderr[-3000:]}"
    # the point of the test: the extras' packages are absent there
    extras = ["uvicorn", "fastapi", "prometheus_client", "llama_cpp", "onnxruntime_genai"]
    probe = f"import importlib.util as u; print([m for m in {extras!r} if u.find_spec(m)])"
    assert subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    return env_dir / "bin"


def _cmd(bin_dir: Path, cwd: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(res: subprocess.CompletedProcess, prog: str) -> str:
    """The run ended with exit 2 and exactly one line on stderr, ``PROG: error: ...``."""
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), (res.returncode,
                                                                                                 res.stderr[-3000:])
    return lines[0]


def test_every_command_works_or_names_its_extra(bare_venv: Path, tmp_path: Path) -> None:
    from perfx_compiler.model.testing import write_tiny_gguf

    for prog in ("perfx-compile", "perfx-run", "perfx-serve", "perfx-bench", "perfx-tune"):
        res = _cmd(bare_venv, tmp_path, prog, "--help")
        assert res.returncode == 0 and "usage:" in res.stdout and not res.stderr.strip(), (prog, res.stderr[-2000:])

    res = _cmd(bare_venv, tmp_path, "perfx-compile", "--list-targets")
    assert res.returncode == 0 and "host" in res.stdout and "Traceback" not in res.stderr, res.stderr[-2000:]

    _one_error_line(_cmd(bare_venv, tmp_path, "perfx-run", str(tmp_path / "missing"), "--prompt", "hi"), "perfx-run")

    art = tmp_path / "art"  # perfx-serve checks the extra before the artifact
    art.mkdir()
    line = _one_error_line(_cmd(bare_venv, tmp_path, "perfx-serve", str(art)), "perfx-serve")
    assert 'pip install "perfx[serve]"' in line, line

    gguf, _ = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=64)
    for peer in ("llama.cpp", "ort-genai"):
        res = _cmd(bare_venv, tmp_path, "perfx-bench", str(gguf), "--peers", peer, "--rounds", "1", "--no-plot",
                   "--bw-size-mb", "8", "--max-context", "256", "--prefill-lens", "", "--work", str(tmp_path / "w"),
                   "--out", str(tmp_path / "out"))
        line = _one_error_line(res, "perfx-bench")
        assert 'pip install "perfx[bench]"' in line, line
