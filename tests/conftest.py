"""Shared fixtures (compiled artifacts are built once per test run and reused), the run's random seed, and
the skip policy.

Seed: every ``np.random.default_rng()`` without a seed (fresh inputs each run), ``np.random`` and ``random``
draw from one seed per run, derived per test from its id; the seed is printed in the header and under
every failure, and ``PERFX_TEST_SEED=N`` replays a run.

Skips: under ``CI=true`` a skipped test fails (a missing tool or package is an install bug:
tests/setup.sh installs everything), except the tests in ``ALLOWED_SKIPS``, which cannot run on any
CPU-only machine. ``-rs`` prints every skip at the end of the run.

Workers: pytest-xdist runs the files on two processes (pyproject's addopts; ``-n 0`` runs one). A test
marked ``alone`` (it times kernels or holds a wall-clock deadline) runs with no other test beside it:
every test holds a shared lock over the run's workers, an ``alone`` one holds it exclusively.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import re
import sys
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))

# (test id regex, why it cannot run on a CPU-only machine). Nothing else may skip under CI=true.
ALLOWED_SKIPS: list[tuple[str, str]] = []

# built kernels kept between the run's processes (xdist workers, CLI subprocesses) in one folder of the
# machine's temp dir, not the user's ~/.cache (perfx_compiler/kernels/memo.py; keyed by the code version)
os.environ.setdefault("PERFX_KERNEL_CACHE", str(Path(tempfile.gettempdir()) / "perfx-test-kernels"))
SEED = int(os.environ.get("PERFX_TEST_SEED") or random.SystemRandom().randrange(2**32))
os.environ["PERFX_TEST_SEED"] = str(SEED)  # xdist's workers start after this: one seed for the whole run
_unseeded_default_rng = np.random.default_rng
_current = {"test": "", "draws": itertools.count()}


def _seeded_default_rng(seed=None):
    """np.random.default_rng: without a seed, a fresh stream per call derived from the run seed and test id."""
    if seed is None:
        seed = [SEED, zlib.crc32(_current["test"].encode()), next(_current["draws"])]
    return _unseeded_default_rng(seed)


np.random.default_rng = _seeded_default_rng


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    if _under_ci():  # a module skipped at collection fails, and the other modules still run
        config.option.continue_on_collection_errors = True


def pytest_report_header(config: pytest.Config) -> str:
    return f"random inputs: PERFX_TEST_SEED={SEED} (set it to replay this run)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current["test"] = item.nodeid
    _current["draws"] = itertools.count()
    test_seed = (SEED ^ zlib.crc32(item.nodeid.encode())) & 0xFFFFFFFF
    np.random.seed(test_seed)
    random.seed(test_seed)


class _RunAlone:
    """A reader-writer lock over the workers of one xdist run (flock on two files; the gate gives a waiting
    ``alone`` test priority over the shared holders that keep arriving)."""

    def __init__(self, run_id: str) -> None:
        folder = Path(tempfile.gettempdir()) / f"perfx-pytest-{run_id}"
        folder.mkdir(exist_ok=True)
        self.gate = open(folder / "gate", "a+")  # noqa: SIM115 - held for the worker's life
        self.rw = open(folder / "rw", "a+")  # noqa: SIM115

    @contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.rw, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.rw, fcntl.LOCK_UN)


_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in xdist's workers only
_run_alone = _RunAlone(_RUN_ID) if _RUN_ID else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup (session fixtures it builds included), call and teardown under the run's lock."""
    if _run_alone is None:
        yield
        return
    with _run_alone.hold(item.get_closest_marker("alone") is not None):
        yield


def _skip_allowed(nodeid: str) -> bool:
    return any(re.search(pattern, nodeid) for pattern, _ in ALLOWED_SKIPS)


def _fail_skip_under_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not _under_ci() or not report.skipped:
        return
    if _skip_allowed(report.nodeid) or getattr(report, "wasxfail", None) is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n"
        "CI installs every tool (tests/setup.sh); a test that cannot run on any CPU-only machine belongs in "
        "ALLOWED_SKIPS in tests/conftest.py"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    _fail_skip_under_ci(report)
    if report.failed:
        report.sections.append(("random seed", f"PERFX_TEST_SEED={SEED} replays this run's random inputs"))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_skip_under_ci(outcome.get_result())


@pytest.fixture(scope="session")
def smol_desc():
    """The default model's description (SmolLM2-135M-Instruct, dequantized)."""
    from perfx_compiler.model.loader import load_model

    return load_model("smollm2-135m", max_context=512)


def _built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Path:
    """``build(out)``'s artifact, compiled once per run for every xdist worker: the first worker to ask
    builds it under a lock in the run's shared temp folder, the others wait and reuse it (the tests
    only read it). A build that failed half-way is redone by the next worker that asks."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / f"shared-{name}" / "artifact"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"shared-{name}.done").is_file():
            import shutil

            shutil.rmtree(out.parent, ignore_errors=True)
            build(out)
            (root / f"shared-{name}.done").touch()
    return out


@pytest.fixture(scope="session")
def smol_artifact(smol_desc, tmp_path_factory):
    """The default model compiled for this CPU (host target)."""
    from perfx_compiler.pipeline import compile_model

    # float activations: test_smollm2 holds it to the float64 reference at 1e-3 (the int8-activation
    # default on VNNI CPUs is checked against this artifact in tests/passes/test_activations_int8.py)
    return _built_once(tmp_path_factory, "smol", lambda out: compile_model(
        smol_desc, "host", out, progress=False, activations="f32"))


@pytest.fixture(scope="session")
def smol_engine(smol_artifact):
    from perfx_compiler.runtime.engine import Engine

    return Engine(smol_artifact)


@pytest.fixture(scope="session")
def smol_reference(smol_desc):
    from perfx_compiler.model.reference import ReferenceModel

    return ReferenceModel(smol_desc)


@pytest.fixture(scope="session")
def smol_int8_artifact(smol_desc, tmp_path_factory):
    """The default model compiled with int8 activations (the default on AVX-512 VNNI CPUs; callers need
    VNNI). batching=False: the tests that use it run one sequence."""
    from perfx_compiler.pipeline import compile_model

    return _built_once(tmp_path_factory, "smol-int8", lambda out: compile_model(
        smol_desc, "host", out, progress=False, activations="int8", batching=False))


_FAMILY_LINES = pytest.StashKey[list]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":  # the last report of a test carries all its user_properties
        lines = _config.stash.setdefault(_FAMILY_LINES, []) if _config else []
        lines += [value for name, value in report.user_properties if name == "family_report"]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    lines = config.stash.get(_FAMILY_LINES, [])
    if lines:  # tests/families/conftest.py's family_report
        terminalreporter.section("decoder-family fixtures")
        for family, check, text in lines:
            terminalreporter.write_line(f"{family:8s} {check:14s} {text}")
