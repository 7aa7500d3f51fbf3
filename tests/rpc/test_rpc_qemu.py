"""Cross-architecture through TVM RPC: an aarch64 server under qemu-aarch64 (the aarch64 TVM runtime
of PyPI's wheel, targets_exec/qemu_rpc.py) measures arm64-neon kernels built here. Timings under qemu
mean nothing: the round trip (upload, load, remote check against the unscheduled function, time) is
what is checked, through issue #27's own command (perfx-tune smollm2-135m --target arm64-neon over RPC)."""

from __future__ import annotations

import pytest

from perfx_compiler.targets_exec.qemu import qemu_missing
from perfx_compiler.tune.records import TuningDatabase

MISSING = qemu_missing("aarch64")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"qemu-aarch64 toolchain: {MISSING}")


def test_qemu_arm64_server_measures_smollm2(tmp_path, rpc_farm, capsys):
    from perfx_compiler.cli import tune as tune_cli

    rpc_farm.server("qemu-arm64", qemu=True)
    logs = tmp_path / "logs"
    args = ["smollm2-135m", "--target", "arm64-neon", "--rpc-tracker", f"127.0.0.1:{rpc_farm.port}",
            "--rpc-key", "qemu-arm64", "--trials", "8", "--log-dir", str(logs), "--buckets", "1",
            "--time-budget", "120", "--quiet"]
    assert tune_cli.main(args) == 0
    out = capsys.readouterr().out
    db = TuningDatabase(logs / "arm64-neon" / "smollm2-135m.jsonl")
    measured = [r for r in db.records() if r.source == "measured" and not r.confirmed]
    ok = [r for r in measured if r.ok]
    assert len(ok) >= 4, (out, [r.error for r in measured][:5])
    assert all(r.versions.get("device") == "rpc:qemu-arm64" for r in measured)
    assert all(r.mean_s > 0 and r.target_key == measured[0].target_key for r in ok)
    # checked on the device against the unscheduled function: a wrong kernel would be an error record
    assert not any("wrong result" in (r.error or "") for r in measured)
