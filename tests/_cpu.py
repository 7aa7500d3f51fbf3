"""What this CPU can run, for the tests that skip without it (one copy for the whole suite)."""

from __future__ import annotations

from pathlib import Path

import pytest


def has_vnni() -> bool:
    """AVX-512 VNNI (the int8-activation kernels need it)."""
    try:
        return " avx512_vnni" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


needs_vnni = pytest.mark.skipif(not has_vnni(), reason="this CPU has no AVX-512 VNNI")
