"""Fuzzing the tuning-record reader: logs with a torn last line, garbage lines (random bytes, text,
JSON nested too deep), valid JSON of the wrong shape (a list, a record with a string bucket, a
negative time, ...), flipped bytes and cuts, each read and asked every question the compiler asks
(best, buckets, measured configs, confirmations). Good records are never lost: every record
whose line was left intact comes back, and nothing of the wrong shape does.

``PERFX_FUZZ_SEED=N`` draws another set; a failure names each bad case's id, seed and file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fuzz_harness import case_seed, run_and_check

from perfx_compiler.tune.records import TuningDatabase, TuningRecord

KINDS = {"torn_last": 15, "garbage_lines": 25, "wrong_shape": 40, "flip": 20, "cut": 15, "binary": 5,
         "strict_garbage": 10, "strict_torn_last": 5}

# One field of a record set to a value of the wrong type or range (each must make the line unreadable).
WRONG_FIELDS = [
    ("workload_key", 5), ("workload_key", None), ("target_key", {"a": 1}), ("template", []), ("config", [1, 2]),
    ("config", "tile=4"), ("config", 3), ("mean_s", "fast"), ("mean_s", -1.0), ("mean_s", [0.1]), ("mean_s", True),
    ("std_s", "x"), ("bucket", "32"), ("bucket", 1.5), ("bucket", [1]), ("bucket", -4), ("bucket", True),
    ("dims", "M=1"), ("dims", [1, 2]), ("dims", {"N": "x"}), ("versions", "1"), ("versions", {"tvm": 1}),
    ("timestamp", "today"), ("timestamp", -5), ("confirm", [1]), ("error", 7), ("source", 3),
]
NOT_RECORDS = ["[]", "1", '"record"', "null", "{}", '{"workload_key": "w0"}', '{"config": {}}', "[" * 5000 + "]" * 5000,
               '{"workload_key": "w", "config": {}, "target_key": "t"}']


def good_lines() -> list[str]:
    """20 records over 3 workloads and a few buckets: timed, failed, predicted and confirmation ones."""
    recs = []
    for i in range(20):
        w = i % 3
        recs.append(TuningRecord(
            workload_key=f"w{w}", target_key="llvm -mcpu=x", template="gemv", config={"tile": 2 ** (i % 5), "i": i},
            mean_s=1e-5 * (i + 1) if i % 7 else float("inf"), std_s=1e-7, bucket=[None, 1, 32][w],
            error="timeout" if i % 7 == 0 else None, dims={"N": 64, "K": 64}, source="predicted" if i == 5 else "measured",
            versions={"record": "1", "timing": "cold"}, timestamp=1e9 + i,
            confirm={"rounds": 3} if i in (9, 18) else None,
        ))
    return [r.to_json() for r in recs]


def mutate(lines: list[str], kind: str, seed: int) -> tuple[bytes, list[int], bool]:
    """(file bytes, indices of the good lines that must come back, strict?)."""
    rng = np.random.default_rng(seed)
    keep = list(range(len(lines)))
    rows: list[bytes] = [ln.encode() for ln in lines]
    strict = kind.startswith("strict_")
    if kind in ("torn_last", "strict_torn_last"):
        rows[-1] = rows[-1][: int(rng.integers(1, len(rows[-1])))]
        return b"\n".join(rows), keep[:-1], strict
    if kind in ("garbage_lines", "wrong_shape", "strict_garbage"):
        for _ in range(int(rng.integers(1, 4))):
            if kind == "wrong_shape":
                if rng.random() < 0.3:
                    bad = NOT_RECORDS[int(rng.integers(len(NOT_RECORDS)))].encode()
                else:
                    data = json.loads(lines[int(rng.integers(len(lines)))])
                    key, value = WRONG_FIELDS[int(rng.integers(len(WRONG_FIELDS)))]
                    data[key] = value
                    bad = json.dumps(data).encode()
            elif rng.random() < 0.5:
                bad = bytes(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8)).replace(b"\n", b"")
            else:
                bad = "".join(chr(int(c)) for c in rng.integers(32, 127, int(rng.integers(1, 80)))).encode()
            rows.insert(int(rng.integers(0, len(rows))), bad)  # never last: the good last line stays last
        return b"\n".join(rows) + b"\n", keep, strict
    if kind == "flip":
        hit = sorted({int(rng.integers(len(rows))) for _ in range(int(rng.integers(1, 4)))})
        for i in hit:
            row = bytearray(rows[i])
            row[int(rng.integers(len(row)))] ^= int(rng.integers(1, 256))
            rows[i] = bytes(row)
        return b"\n".join(rows) + b"\n", [i for i in keep if i not in hit], strict
    if kind == "cut":
        data = b"\n".join(rows) + b"\n"
        cut = int(rng.integers(0, len(data)))
        whole = data[:cut].count(b"\n")  # lines that end before the cut
        return data[:cut], keep[:whole], strict
    if kind == "binary":
        return bytes(rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8)), [], strict
    raise ValueError(kind)


def make_cases(root: Path) -> list[dict]:
    lines = good_lines()
    cases = []
    for kind, count in KINDS.items():
        for n in range(count):
            seed = case_seed(kind, n)
            data, keep, strict = mutate(lines, kind, seed)
            path = root / f"{kind}-{n}.jsonl"
            path.write_bytes(data)
            cases.append({"id": f"tuning/{kind}/{n}", "seed": seed, "op": "tuning_log", "path": str(path),
                          "strict": strict, "keep": [lines[i] for i in keep]})
    return cases


def check_records(case: dict, res: dict) -> str | None:
    """Every intact good line came back; a line that came back is a whole record (no wrong shapes)."""
    got = res["detail"]["records"]
    missing = [ln for ln in case["keep"] if ln not in got]
    if missing:
        return f"lost {len(missing)} good records, e.g. {missing[0][:120]}"
    if case["id"].startswith("tuning/strict_garbage"):
        return "strict mode accepted a garbage line in the middle of the file"
    extra = [ln for ln in got if ln not in case["keep"]]
    if extra and not case["id"].startswith(("tuning/flip", "tuning/binary")):  # a flipped digit is still a record
        return f"returned {len(extra)} records that were not written, e.g. {extra[0][:120]}"
    return None


@pytest.fixture(scope="module")
def log_cases(tmp_path_factory) -> list[dict]:
    return make_cases(tmp_path_factory.mktemp("fuzz_tuning"))


def test_base_log_reads_whole(tmp_path):
    (tmp_path / "r.jsonl").write_text("\n".join(good_lines()) + "\n")
    db = TuningDatabase(tmp_path / "r.jsonl", load_dir=False, strict=True)
    assert [r.to_json() for r in db.records()] == good_lines()


def test_torn_and_garbage_tuning_logs(log_cases):
    results = run_and_check("tuning-log", log_cases, check_records)
    strict = [r for c, r in zip(log_cases, results, strict=True) if c["id"].startswith("tuning/strict_garbage")]
    assert all(r["status"] == "perfx" and r["type"] == "TuningLogError" for r in strict)
