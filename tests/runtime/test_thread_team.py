"""The spinning thread team linked into CPU artifacts (perfx_compiler/runtime/thread_team.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.runtime import thread_team


def _parallel_kernel_library(path: Path, with_team: bool) -> Path:
    import tvm
    from tvm.script import tirx as T

    @T.prim_func
    def scale(a: T.Buffer((8, 4096), "float32"), b: T.Buffer((8, 4096), "float32")):
        for i in T.parallel(8):
            for j in range(4096):
                b[i, j] = a[i, j] * T.float32(2) + T.float32(i)

    kwargs = thread_team.link_options() if with_team else {}
    assert kwargs or not with_team, "no C compiler: the team cannot be built"
    tvm.tirx.build(scale, target="llvm").export_library(str(path), **kwargs)
    return path


def _run(lib, a: np.ndarray) -> np.ndarray:
    import tvm

    b = tvm.runtime.tensor(np.zeros_like(a))
    lib["main"](tvm.runtime.tensor(a), b)
    return b.numpy()


def _expected(a: np.ndarray) -> np.ndarray:
    return a * 2 + np.arange(a.shape[0], dtype=np.float32)[:, None]


@pytest.fixture()
def team_library(tmp_path, monkeypatch):
    import tvm

    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    monkeypatch.delenv("PERFX_THREAD_POOL", raising=False)
    path = _parallel_kernel_library(tmp_path / "scale.so", with_team=True)
    lib = tvm.runtime.load_module(str(path))
    return path, lib


def test_team_runs_every_launch_and_matches_numpy(team_library):
    path, lib = team_library
    assert thread_team.launches(path) == 0
    assert thread_team.install(path) == thread_team.TEAM
    assert thread_team.install(path) == thread_team.TEAM  # a second Engine on the same library
    rng = np.random.default_rng()
    for calls in range(1, 51):
        a = rng.standard_normal((8, 4096)).astype(np.float32)
        np.testing.assert_array_equal(_run(lib, a), _expected(a))
        assert thread_team.launches(path) == calls  # the team, not TVM's pool, ran the launch


def test_tvm_pool_when_asked_or_when_the_library_has_no_team(team_library, tmp_path, monkeypatch):
    import tvm

    path, lib = team_library
    monkeypatch.setenv("PERFX_THREAD_POOL", "tvm")
    assert thread_team.install(path).startswith("tvm")
    a = np.random.default_rng().standard_normal((8, 4096)).astype(np.float32)
    np.testing.assert_array_equal(_run(lib, a), _expected(a))
    assert thread_team.launches(path) == 0
    monkeypatch.delenv("PERFX_THREAD_POOL")
    plain = _parallel_kernel_library(tmp_path / "plain.so", with_team=False)
    tvm.runtime.load_module(str(plain))
    assert thread_team.install(plain) == "tvm (artifact built without the team)"
    assert thread_team.launches(plain) == -1
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert thread_team.install(path) == "tvm (1 thread)"


FORK_SCRIPT = """
import os, signal, sys
import numpy as np
import tvm
from perfx_compiler.runtime import thread_team
lib = tvm.runtime.load_module(sys.argv[1])
assert thread_team.install(sys.argv[1]) == thread_team.TEAM
a = np.random.default_rng().standard_normal((8, 4096)).astype(np.float32)
want = a * 2 + np.arange(8, dtype=np.float32)[:, None]
def run():
    b = tvm.runtime.tensor(np.zeros_like(a))
    lib["main"](tvm.runtime.tensor(a), b)
    return np.array_equal(b.numpy(), want)
assert run() and thread_team.launches(sys.argv[1]) == 1
pid = os.fork()
if pid == 0:  # the child: the team's worker did not survive the fork
    signal.alarm(30)  # a child stuck waiting for it must not outlive the test
    os._exit(0 if run() and thread_team.launches(sys.argv[1]) == 1 else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert run() and thread_team.launches(sys.argv[1]) == 2  # the parent's team still works
print("ok")
"""


def test_forked_child_falls_back_to_tvm_pool(team_library):
    """The workers do not survive fork(): a child's launch goes to TVM's pool instead of waiting forever
    for them. In a fresh process: TVM's own pool is not fork-safe once it has started, so the parent
    must not have used it."""
    path, _ = team_library
    env = dict(os.environ, TVM_NUM_THREADS="2")
    env.pop("PERFX_THREAD_POOL", None)
    try:
        proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(path)], env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a forked child hung on the parent's thread team")
    # a child that hung dies of its alarm: SIGALRM is exit code -14 and fails the parent's assertion
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: the runtime keeps TVM's pool")
def test_artifact_decodes_on_the_team_bit_equal_to_tvm_pool(smol_artifact, smol_engine, tmp_path):
    """The default artifact carries the team, the engine uses it for every kernel's parallel loop, and
    its logits equal those of TVM's pool bit for bit (same tasks, same split of the work)."""
    assert smol_engine.thread_pool == thread_team.TEAM
    ids = [1, 504, 3458, 314, 260, 2987, 28, 253, 3277, 4009]
    before = thread_team.launches(Path(smol_artifact) / "model.so")
    smol_engine.reset()
    got = [smol_engine.prefill(ids[:6])[-1].copy()] + [smol_engine.decode(t).reshape(-1).copy() for t in ids[6:]]
    assert thread_team.launches(Path(smol_artifact) / "model.so") - before > 4 * 100  # >100 per decode step
    script = (
        "import sys, numpy as np\n"
        "from perfx_compiler.runtime.engine import Engine\n"
        "e = Engine(sys.argv[1])\n"
        "assert e.thread_pool.startswith('tvm'), e.thread_pool\n"
        f"ids = {ids}\n"
        "out = [e.prefill(ids[:6])[-1]] + [e.decode(t).reshape(-1) for t in ids[6:]]\n"
        "np.save(sys.argv[2], np.stack(out))\n"
    )
    env = dict(os.environ, PERFX_THREAD_POOL="tvm", TVM_NUM_THREADS=str(thread_team.team_threads()))
    subprocess.run([sys.executable, "-c", script, str(smol_artifact), str(tmp_path / "tvm.npy")], env=env,
                   check=True, timeout=600)
    np.testing.assert_array_equal(np.stack(got), np.load(tmp_path / "tvm.npy"))
