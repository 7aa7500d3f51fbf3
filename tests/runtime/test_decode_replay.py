"""Decode steps replayed from the recorded kernel calls (perfx_compiler/runtime/decode_replay.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from perfx_compiler.runtime import decode_replay

PROMPT = [1, 504, 3458, 314, 260, 2987]
SECOND_PROMPT = [1, 28, 253, 3277]


def _greedy(engine, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Prefill, then greedy decode; every step's logits (copies)."""
    engine.reset()
    logits = [np.asarray(engine.prefill(prompt)[-1]).copy()]
    for _ in range(steps):
        logits.append(np.asarray(engine.decode(int(np.argmax(logits[-1])))).reshape(-1).copy())
    return logits


VM_SCRIPT = f"""
import sys, numpy as np
PROMPT, SECOND = {PROMPT!r}, {SECOND_PROMPT!r}
from perfx_compiler.runtime.engine import Engine
e = Engine(sys.argv[1])
out = []
for prompt, steps in ((PROMPT, 12), (SECOND, 5)):
    e.reset()
    out.append(e.prefill(prompt)[-1].copy())
    for _ in range(steps):
        out.append(e.decode(int(np.argmax(out[-1]))).reshape(-1).copy())
assert e.decode_path.startswith("vm"), e.decode_path
np.save(sys.argv[2], np.stack(out))
"""


def test_replayed_decode_equals_the_vm_bit_for_bit(smol_artifact, tmp_path):
    """The replay (recorded at load) runs every step, across positions and a second prompt (a prefill
    by the VM between replayed steps), and gives the VM's logits exactly (the VM in a process of its own)."""
    from perfx_compiler.runtime.engine import Engine

    engine = Engine(smol_artifact)
    assert engine.decode_path.startswith("replay ("), engine.decode_path  # recorded at load
    got = _greedy(engine, PROMPT, 12)
    got += _greedy(engine, SECOND_PROMPT, 5)
    env = dict(os.environ, PERFX_DECODE_REPLAY="0")
    subprocess.run([sys.executable, "-c", VM_SCRIPT, str(smol_artifact), str(tmp_path / "vm.npy")], env=env,
                   check=True, timeout=600)
    np.testing.assert_array_equal(np.stack(got), np.load(tmp_path / "vm.npy"))


def test_replayed_logits_are_not_overwritten_by_the_next_step(smol_artifact):
    from perfx_compiler.runtime.engine import Engine

    engine = Engine(smol_artifact)
    engine.prefill(PROMPT)
    engine.decode(260)
    first = engine.decode(28)
    kept = first.copy()
    second = engine.decode(253)
    assert engine.decode_path.startswith("replay (")
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)


def test_unknown_builtin_keeps_the_vm(smol_artifact, monkeypatch):
    """A step that makes a VM builtin the replay does not know is left to the VM (and still decodes)."""
    from perfx_compiler.runtime.engine import Engine

    monkeypatch.setattr(decode_replay, "SAFE_BUILTINS", frozenset({"vm.builtin.check_tensor_info"}))
    engine = Engine(smol_artifact)
    got = _greedy(engine, PROMPT, 3)
    assert engine.decode_path.startswith("vm (the step calls vm.builtin."), engine.decode_path
    monkeypatch.undo()
    want = _greedy(Engine(smol_artifact), PROMPT, 3)
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


def test_replay_switch_keeps_the_vm(smol_artifact, monkeypatch):
    from perfx_compiler.runtime.engine import Engine

    monkeypatch.setenv("PERFX_DECODE_REPLAY", "0")
    engine = Engine(smol_artifact)
    _greedy(engine, PROMPT, 2)
    assert engine.decode_path == "vm (PERFX_DECODE_REPLAY=0)"


def test_record_refuses_logits_no_kernel_writes(smol_artifact):
    """The guard on the output: a step whose returned tensor is not a recorded kernel's output."""
    import tvm

    from perfx_compiler.runtime.engine import Engine

    engine = Engine(smol_artifact)
    engine.prefill(PROMPT)
    engine._pos_view[0] = engine.position
    engine._token_view[0, 0] = 260
    stray = tvm.runtime.tensor(np.zeros((1, 1, engine.vocab_size), np.float32))

    def step():
        engine._invoke_stateful(engine._decode_name)
        return stray

    _, replay = decode_replay.record(engine.vm, step)
    assert replay == "the logits are not written by a recorded kernel"


def test_profiler_gets_the_vm_back_after_replayed_steps(smol_artifact):
    """perfx-bench --profile times kernels through the VM's hook: an engine that was replaying hands its
    decode back to the VM, and the decode profile lists the step's kernels."""
    from perfx_compiler.bench.profile import profile_engine
    from perfx_compiler.runtime.engine import Engine

    engine = Engine(smol_artifact)
    _greedy(engine, PROMPT, 3)
    assert engine.decode_path.startswith("replay (")
    decode = profile_engine(engine, PROMPT, 2, [])[0]
    assert engine.decode_path == "vm (profiled)"
    assert decode.phase == "decode" and sum(k.calls for k in decode.kernels) >= 2 * 100


def test_decode_greedy_equals_decode_and_argmax(smol_artifact):
    """``Engine.decode_greedy`` (the steps in the C++ loop) gives the per-step ``decode`` + ``np.argmax``
    tokens, stops after a stop token, advances the position by the tokens it made, refuses more tokens
    than the context holds (before running any), and does the same through the VM once the replay is
    given back."""
    from perfx_compiler.errors import ContextLengthError
    from perfx_compiler.runtime.engine import Engine

    engine = Engine(smol_artifact)
    logits = _greedy(engine, PROMPT, 20)
    want = [int(np.argmax(x)) for x in logits]  # want[0]: the prefill's argmax, fed to the first step
    fresh = Engine(smol_artifact)
    fresh.reset()
    fresh.prefill(PROMPT)
    assert fresh.decode_greedy(want[0], 20) == want[1:]
    assert fresh.decode_path.startswith("replay (") and fresh.position == len(PROMPT) + 20
    fresh.reset()
    fresh.prefill(PROMPT)
    stop = want[12]
    got = fresh.decode_greedy(want[0], 20, stop_ids=[stop])
    assert got == want[1 : want.index(stop, 1) + 1] and fresh.position == len(PROMPT) + len(got)
    room = fresh.max_context - fresh.position
    with pytest.raises(ContextLengthError):
        fresh.decode_greedy(got[-1], room + 1)
    assert fresh.position == len(PROMPT) + len(got)
    fresh.keep_vm_decode("test")
    fresh.reset()
    fresh.prefill(PROMPT)
    assert fresh.decode_greedy(want[0], 20) == want[1:]
