"""The tuning sweep notebook's device cell against a loopback tracker with two x86 servers
(tests/rpc/conftest.py): the setup cell and the device cell run, every candidate is timed on its
device, and a plot with a panel per device is drawn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "tuning_sweep.ipynb"


def test_device_cell_tunes_on_each_device(rpc_farm, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    device = [c for c in code if "device_sweep" in c.source]
    assert len(device) == 1, "the notebook has no device-sweep cell"
    nb.cells = [code[0], device[0]]  # setup (imports, SCALE, TARGET) and the device cell
    rpc_farm.server("dev-a")
    rpc_farm.server("dev-b")
    env = {"PERFX_NB_SCALE": "16", "PERFX_NB_TRACKER": f"127.0.0.1:{rpc_farm.port}",
           "PERFX_NB_RPC_KEYS": "dev-a,dev-b", "PERFX_NB_RPC_TRIALS": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert os.environ["PERFX_NB_TRACKER"]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = nb.cells[1].get("outputs", [])
    assert not any(o.get("output_type") == "error" for o in outputs), outputs
    table = "\n".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "dev-a" in table and "dev-b" in table, table
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_device_sweep_rows(rpc_farm, tmp_path):
    from perfx_compiler.tune.device_sweep import device_sweep

    rpc_farm.server("dev-a")
    df = device_sweep(f"127.0.0.1:{rpc_farm.port}", ["dev-a"], scale=32, tokens=(16,), trials=3, log_dir=tmp_path)
    assert len(df) == 3 and set(df["device"]) == {"dev-a"} and (df["error"] == "").all()
    assert (df["gflops"] > 0).all() and (df["best_gflops"].diff().fillna(0) >= 0).all()
    assert (tmp_path / "dev-a").is_dir()  # the device's log: a rerun resumes from it
    again = device_sweep(f"127.0.0.1:{rpc_farm.port}", ["dev-a"], scale=32, tokens=(16,), trials=3, log_dir=tmp_path)
    assert len(again) == 3  # nothing new to time: the log already holds the trials
