"""The fuzz harness itself: a case that kills its worker (a signal) or hangs is reported as that
case, and the cases after it still run in a fresh worker."""

from __future__ import annotations

from fuzz_harness import failures, run_cases


def test_worker_crash_and_hang_are_reported_per_case():
    actions = ["ok", "segv", "ok", "hang", "perfx", "abort", "raise", "ok"]
    cases = [{"id": f"self/{a}/{i}", "seed": i, "op": "selftest", "action": a} for i, a in enumerate(actions)]
    results = run_cases(cases, case_s=5.0)
    got = [(r["status"], r.get("message", "")) for r in results]
    assert [s for s, _ in got] == ["ok", "crash", "ok", "hang", "perfx", "crash", "error", "ok"], got
    assert "SIGSEGV" in got[1][1] and "SIGABRT" in got[5][1]
    bad = failures(cases, results)
    assert len(bad) == 4 and bad[0].startswith("case self/segv/1 (seed 1,"), bad
