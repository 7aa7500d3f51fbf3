"""A compiled artifact run on a device through TVM RPC (runtime/remote.py, perfx-bench --rpc-tracker),
with real tracker / server processes on 127.0.0.1 (tests/rpc/conftest.py): the remote prefill and
decode give the local engine's logits, and the bench writes its CSV, or stops with one line."""

from __future__ import annotations

import csv

import numpy as np
import tvm  # noqa: F401 - the whole TVM first: the engine's import alone would load only its runtime

from perfx_compiler.runtime.engine import Engine
from perfx_compiler.runtime.remote import RemoteEngine
from perfx_compiler.targets import load_target
from perfx_compiler.tune.rpc import remote_device, request_session


def test_remote_engine_matches_local(tiny_model, rpc_farm):
    _, host = tiny_model
    rpc_farm.server("x86")
    sess = request_session(rpc_farm.addr, "x86", 30)
    remote = RemoteEngine(host, sess, remote_device(sess, load_target("host")))
    local = Engine(host)
    rng = np.random.default_rng()  # fresh tokens every run
    prompt = rng.integers(0, local.vocab_size, size=7).tolist()
    np.testing.assert_allclose(remote.prefill(prompt), local.prefill(prompt), rtol=0, atol=1e-5)
    tok = int(rng.integers(0, local.vocab_size))
    for _ in range(4):  # each step reads the caches the previous call returned
        want = local.decode(tok)
        got = remote.decode(tok)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        tok = int(np.argmax(want))
    assert remote.position == local.position == 11
    remote.reset()
    np.testing.assert_allclose(remote.prefill(prompt[:3]), Engine(host).prefill(prompt[:3]), rtol=0, atol=1e-5)
    times = remote.time_call("decode", 1, 20, number=5, repeat=2)
    assert len(times) == 2 and all(0 < t < 1 for t in times)


def test_bench_over_rpc_writes_csv(tiny_model, rpc_farm, tmp_path, capsys):
    from perfx_compiler.cli import bench

    _, host = tiny_model
    rpc_farm.server("x86")
    out = tmp_path / "out"
    rc = bench.main([str(host), "--rpc-tracker", f"127.0.0.1:{rpc_farm.port}", "--rpc-key", "x86", "--rounds", "2",
                     "--prompt-tokens", "8", "--decode-tokens", "16", "--prefill-lens", "", "--out", str(out),
                     "--name", "tiny", "--bw-size-mb", "128"])
    assert rc == 0, capsys.readouterr()
    rows = list(csv.DictReader(open(out / "bench_tiny_rpc-x86.csv")))
    assert [r["round"] for r in rows] == ["0", "1", "median"]
    assert all(r["device"] == "rpc:x86" and float(r["decode_tok_s"]) > 0 and float(r["ttft_ms"]) > 0 for r in rows)
    assert rows[0]["decode_position"] == "16"  # the middle of the 8 + 16 token window
    # the device's read bandwidth, measured there: real pages (a zero-page read would be far above DRAM)
    assert all(0.5 < float(r["device_bw_gbs"]) < 400 and float(r["bw_fraction"]) > 0 for r in rows)
    assert (out / "bench_tiny_rpc-x86.png").stat().st_size > 0


def test_bench_without_server_is_one_line(tiny_model, rpc_farm, tmp_path, capsys):
    from perfx_compiler.cli import bench

    _, host = tiny_model
    args = [str(host), "--rpc-tracker", f"127.0.0.1:{rpc_farm.port}", "--rpc-key", "nobody", "--rpc-timeout", "2",
            "--prefill-lens", "", "--out", str(tmp_path)]
    assert bench.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no RPC server with key 'nobody'" in err[0]
    assert bench.main([*args[:4], "x86", "--peers", "llama.cpp"]) == 2
    assert "peers run on this machine" in capsys.readouterr().err
