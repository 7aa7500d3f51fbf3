"""The runtime keeps a CPU artifact's weights in one mapping advised for transparent huge pages
(runtime/engine.py ``HugePageArena``): every weight tensor is a view into it, and the model's
logits are bit-equal to the engine that allocates each weight on its own (as where ``madvise`` has no
huge-page advice)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _thp_eligible(addr: int) -> bool | None:
    """The kernel's ``THPeligible`` flag of the mapping holding ``addr`` (None where smaps lacks it)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                for follow in lines[i + 1 :]:
                    if follow.startswith("THPeligible:"):
                        return follow.split()[1] == "1"
                    if "-" in follow.split()[0] and ":" not in follow.split()[0]:
                        return None
    return None


def test_weights_live_in_one_huge_page_arena_and_logits_are_unchanged(smol_artifact, monkeypatch) -> None:
    from perfx_compiler.runtime.engine import Engine

    engine = Engine(smol_artifact, verify=False)
    arena = engine._weight_arena
    assert arena is not None
    lo = arena.buf.ctypes.data
    hi = lo + arena.buf.nbytes
    for w in engine._weights:
        p = np.from_dlpack(w).ctypes.data
        assert lo <= p < hi and p % arena.align == 0
    assert (lo + (-lo) % arena.HUGE) == np.from_dlpack(engine._weights[0]).ctypes.data  # 2 MiB-aligned start
    # where transparent huge pages are not off, the kernel takes the mapping as huge-page eligible
    # (fails for a mapping without the madvise, or a shared one: shmem follows shmem_enabled)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert _thp_eligible(lo) is not False

    from perfx_compiler.runtime import engine as engine_module

    monkeypatch.setattr(engine_module.HugePageArena, "for_weights", classmethod(lambda cls, weights: None))
    plain = Engine(smol_artifact, verify=False)
    assert plain._weight_arena is None
    prompt = np.random.default_rng().integers(10, 4000, 12).tolist()
    for e in (engine, plain):
        e.reset()
    a, b = engine.prefill(prompt), plain.prefill(prompt)
    assert np.array_equal(a, b)
    tok = int(np.argmax(a))
    for _ in range(4):
        a, b = engine.decode(tok), plain.decode(tok)
        assert np.array_equal(a, b)
        tok = int(np.argmax(a))
