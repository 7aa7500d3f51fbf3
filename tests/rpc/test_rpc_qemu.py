"""Cross-architecture through TVM RPC: an aarch64 server under qemu-aarch64 (the aarch64 TVM runtime
of PyPI's wheel, targets_exec/qemu_rpc.py) measures arm64-neon kernels built here. Timings under qemu
mean nothing: the round trip (upload, load, remote check against the unscheduled function, time) is
what is checked, on two small matmuls."""

from __future__ import annotations

import pytest

from perfx_compiler.targets_exec.qemu import qemu_missing
from perfx_compiler.tune.records import TuningDatabase

MISSING = qemu_missing("aarch64")
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=f"qemu-aarch64 toolchain: {MISSING}"),
              pytest.mark.alone]  # records within a time budget


def test_qemu_arm64_server_measures_matmuls(tmp_path, rpc_farm):
    """Two projection-shaped matmuls at M=16 (the CLI over RPC is checked on x86 in test_rpc_tune.py)."""
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.rpc import RPCMeasurer
    from perfx_compiler.tune.session import tune_groups
    from tests.rpc.conftest import matmul_groups

    target = load_target("arm64-neon")
    rpc_farm.server("qemu-arm64", qemu=True)
    db = TuningDatabase(tmp_path / target.name / "m.jsonl")
    with RPCMeasurer(target, rpc_farm.addr, "qemu-arm64", parallel=1, request_timeout_s=60) as rm:
        tune_groups(matmul_groups(target), target, db, rm, trials=3, time_budget_s=90, seed=0, show_progress=False)
    measured = [r for r in db.records() if r.source == "measured" and not r.confirmed]
    ok = [r for r in measured if r.ok]
    assert len(ok) >= 4, [r.error for r in measured][:5]
    assert {r.workload_key for r in ok} == {g.rep.workload.key for g in matmul_groups(target)}
    assert all(r.versions.get("device") == "rpc:qemu-arm64" for r in measured)
    assert all(r.mean_s > 0 for r in ok)
    # checked on the device against the unscheduled function: a wrong kernel would be an error record
    assert not any("wrong result" in (r.error or "") for r in measured)
