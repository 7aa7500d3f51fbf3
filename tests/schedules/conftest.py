"""Fixtures for the schedule-template tests: the host target and model-shaped functions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from anywhere, without an install
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def cpu_target():
    from perfx_compiler.targets import load_target

    return load_target("x86-avx512" if _has_avx512() else "x86-avx2")


@pytest.fixture(scope="session")
def target():
    """The AVX-512 target the VNNI kernel tests build for, whatever the host (``cpu_target`` is the host's);
    the tests that run the kernels carry ``sched_helpers.needs_vnni``."""
    from perfx_compiler.targets import load_target

    return load_target("x86-avx512")


def _has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags and " avx512bw" in flags
