"""Tuning records: append-only JSON lines under ``tuning_logs/<target>/<name>.jsonl``.

One line per measured candidate: workload key, target key, template, config, M bucket,
mean/std seconds (or the error that disqualified it), versions and a timestamp. Every record is
flushed and fsync'ed so a crash loses at most the line being written; a torn last line is
skipped with a warning. Records whose target key or workload key differs from what is asked
for are never returned: a changed function structure or another target simply has no records.

A record whose measurement method changed is stale the same way: ``versions["timing"]`` says how
it was timed (``cold``: weights flushed before each call, ``warm``); a measured record without it
predates that field and, when its workload is decode-shaped (``traffic.decode_shaped``: timed
cold now), was timed warm: it is never returned (nor counted as measured, so a retune re-times it).

A confirmation record (``confirm`` set, written by ``tune/confirm.py`` at the end of a workload's
search) names the winner of the top candidates and the template default re-timed in alternation;
``best`` returns the latest confirmation of a (workload, bucket) over the fastest raw record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from perfx_compiler.errors import TuningLogError

log = logging.getLogger(__name__)
RECORD_VERSION = 1
DEFAULT_LOG_ROOT = Path(__file__).resolve().parents[2] / "tuning_logs"


def _versions() -> dict[str, str]:
    out = {"record": str(RECORD_VERSION)}
    try:
        import tvm

        out["tvm"] = str(tvm.__version__)
    except Exception:  # noqa: BLE001 - records stay writable without TVM (tests, tools)
        log.debug("tvm not importable; record carries no tvm version")
    return out


def config_key(config: dict[str, Any]) -> str:
    """Canonical text of a configuration (dedup / resume key)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass
class TuningRecord:
    workload_key: str
    target_key: str
    template: str
    config: dict[str, Any]
    mean_s: float
    std_s: float = 0.0
    bucket: int | None = None  # M the candidate was timed at (symbolic-M workloads)
    error: str | None = None
    dims: dict[str, int] | None = None  # workload dims, so the cost model can learn from any record
    # "measured" (timed here), "predicted" (perfx-tune --no-measure: cost model / roofline estimate),
    # "shared" (timed on an equivalent workload: same template, dims and layout).
    source: str = "measured"
    versions: dict[str, str] = field(default_factory=_versions)
    timestamp: float = field(default_factory=time.time)
    # Confirmation records only (tune/confirm.py): rounds, timing mode and every candidate's
    # per-round seconds and median; mean_s is then the winner's median, not a fastest call.
    confirm: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.mean_s)

    @property
    def confirmed(self) -> bool:
        """A confirmation record: its config won the paired re-timing of the top candidates."""
        return self.confirm is not None

    @property
    def stale(self) -> bool:
        """Measured with a method the tuner no longer uses: a decode-shaped workload (timed cold
        now) whose record carries no timing provenance (timed warm, before cold timing existed)."""
        from perfx_compiler.tune.traffic import decode_shaped

        return self.source != "predicted" and "timing" not in self.versions and decode_shaped(self.dims, self.bucket)

    def to_json(self) -> str:
        data = asdict(self)
        if not math.isfinite(self.mean_s):
            data["mean_s"] = None
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> TuningRecord:
        """The record of one JSON line; ValueError when the line is not one, field by field (a
        record of the wrong shape would otherwise fail later, inside ``best`` or the cost model)."""
        data = json.loads(line)
        if not isinstance(data, dict) or "workload_key" not in data or "config" not in data:
            raise ValueError("not a tuning record")
        for key in ("workload_key", "target_key", "template"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"{key} is {type(data.get(key)).__name__}, not a string")
        mean, std, bucket = data.get("mean_s"), data.get("std_s"), data.get("bucket")
        for key, value in (("mean_s", mean), ("std_s", std), ("timestamp", data.get("timestamp"))):
            if value is not None and (not _is_number(value) or value < 0):
                raise ValueError(f"{key} is {value!r}, not a number of seconds >= 0")
        if bucket is not None and not (_is_int(bucket) and bucket >= 0):
            raise ValueError(f"bucket is {bucket!r}, not a row count")
        dims = data.get("dims")
        if dims is not None and not (isinstance(dims, dict) and all(_is_int(v) for v in dims.values())):
            raise ValueError(f"dims is {dims!r}, not a map of names to integers")
        versions = data.get("versions") or {}
        if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
            raise ValueError(f"versions is {versions!r}, not a map of names to strings")
        kinds = {"config": dict, "error": str, "source": str, "confirm": dict}
        for key, kind in kinds.items():
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise ValueError(f"{key} is {type(data[key]).__name__}, not {kind.__name__}")
        return cls(
            workload_key=data["workload_key"],
            target_key=data["target_key"],
            template=data["template"],
            config=dict(data["config"]),
            mean_s=float("inf") if mean is None else float(mean),
            std_s=float(std or 0.0),
            bucket=bucket,
            error=data.get("error"),
            dims=dims,
            source=data.get("source") or "measured",
            versions=dict(versions),
            timestamp=float(data.get("timestamp") or 0.0),
            confirm=data.get("confirm"),
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_records(path: Path, strict: bool = False) -> Iterator[TuningRecord]:
    """Records of one file; a torn (unterminated, unparsable) last line is skipped with a warning.

    ``strict``: an unreadable line anywhere but at the end raises TuningLogError (a corrupt file,
    not a writer killed mid-line)."""
    try:
        # bytes that are not UTF-8 (a disk error, another file) spoil their line only, not the file
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as err:
        raise TuningLogError(f"cannot read tuning log {path}: {err}") from None
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield TuningRecord.from_json(line)
        except (ValueError, TypeError, KeyError, RecursionError) as err:  # RecursionError: JSON nested too deep
            last = number == len(lines) or all(not rest.strip() for rest in lines[number:])
            if last:
                log.warning("%s: skipping torn last line %d (%s)", path, number, err)
            elif strict:
                raise TuningLogError(f"{path}: line {number} is not a tuning record ({err})") from None
            else:
                log.warning("%s: skipping unreadable line %d (%s)", path, number, err)


class TuningDatabase:
    """Records of one target directory, loaded into memory; new records are appended to ``path``."""

    def __init__(self, path: str | os.PathLike[str], load_dir: bool = True, strict: bool = False) -> None:
        self.path = Path(path)
        self._records: list[TuningRecord] = []
        files = sorted(self.path.parent.glob("*.jsonl")) if load_dir else [self.path]
        if self.path not in files and self.path.exists():
            files.append(self.path)
        for file in files:
            self._records.extend(read_records(file, strict=strict))

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], target_name: str) -> TuningDatabase:
        """Open what a user points at: a .jsonl file (with its directory's other logs), a target
        directory (``tuning_logs/x86-avx512``) or a log root holding ``<target_name>/``."""
        p = Path(path)
        if p.is_dir():
            if (p / target_name).is_dir():
                p = p / target_name
            return cls(p / "records.jsonl")
        if not p.exists():
            raise TuningLogError(f"tuning log {p} does not exist")
        return cls(p)

    @classmethod
    def for_target(
        cls, target_name: str, root: str | os.PathLike[str] | None = None, name: str = "records"
    ) -> TuningDatabase:
        base = Path(root) if root is not None else DEFAULT_LOG_ROOT
        return cls(base / target_name / f"{name}.jsonl")

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[TuningRecord]:
        return list(self._records)

    def add(self, record: TuningRecord) -> None:
        """Append one record durably (flush + fsync) and index it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = record.to_json() + "\n"
        # If a previous writer died mid-line, start on a fresh line so this record stays readable.
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        with open(self.path, "a", encoding="utf-8") as f:
            if needs_newline:
                f.write("\n")
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._records.append(record)

    def add_many(self, records: Iterable[TuningRecord]) -> None:
        for record in records:
            self.add(record)

    def for_workload(
        self, workload_key: str, target_key: str, bucket: int | None = None, include_stale: bool = False
    ) -> list[TuningRecord]:
        """Records of (workload, target[, bucket]); stale ones (see module doc) only when asked."""
        return [
            r
            for r in self._records
            if r.workload_key == workload_key
            and r.target_key == target_key
            and (bucket is None or r.bucket == bucket)
            and (include_stale or not r.stale)
        ]

    def measured_configs(self, workload_key: str, target_key: str, bucket: int | None = None) -> set[str]:
        """Configs already measured (successfully or not): a resumed search skips them."""
        return {config_key(r.config) for r in self.for_workload(workload_key, target_key, bucket) if not r.confirmed}

    def confirmation(self, workload_key: str, target_key: str, bucket: int | None = None) -> TuningRecord | None:
        """The latest confirmation record of (workload, target, bucket), or None."""
        rows = [r for r in self.for_workload(workload_key, target_key, bucket) if r.confirmed and r.bucket == bucket]
        return max(rows, key=lambda r: r.timestamp) if rows else None

    def buckets(self, workload_key: str, target_key: str) -> list[int]:
        """M buckets with at least one valid record for (workload, target), ascending."""
        return sorted({r.bucket for r in self.for_workload(workload_key, target_key) if r.ok and r.bucket is not None})

    def best(
        self,
        workload_key: str,
        target_key: str,
        bucket: int | None = None,
        nearest: bool = False,
        confirmed: bool = True,
    ) -> TuningRecord | None:
        """The record to build (workload, target) with: the latest confirmation record when one
        exists (``confirmed=False``: ignore them, the search's view), else the fastest valid
        record; measured records beat predicted ones, stale ones never count.

        For symbolic-M workloads without a bucket, the largest measured bucket decides (prefill
        shapes dominate the time). ``nearest``: when ``bucket`` has no records, use the bucket
        nearest to it on a log scale."""
        if nearest and bucket is not None:
            have = self.buckets(workload_key, target_key)
            if have and bucket not in have:
                bucket = min(have, key=lambda b: (abs(math.log2(max(b, 1)) - math.log2(max(bucket, 1))), -b))
        rows = [r for r in self.for_workload(workload_key, target_key, bucket) if r.ok]
        if not confirmed:
            rows = [r for r in rows if not r.confirmed]
        if not rows:
            return None
        measured = [r for r in rows if r.source != "predicted"]
        rows = measured or rows
        if bucket is None:
            buckets = [r.bucket for r in rows if r.bucket is not None]
            if buckets:
                top = max(buckets)
                rows = [r for r in rows if r.bucket == top]
        # A confirmation's mean_s is a median over paired rounds, not comparable with a raw
        # fastest call: when one exists it decides, whatever the raw minimum says.
        confirmations = [r for r in rows if r.confirmed]
        if confirmations:
            return max(confirmations, key=lambda r: r.timestamp)
        return min(rows, key=lambda r: r.mean_s)


def default_records(target_name: str, tuning_log: str | os.PathLike[str] | None = None) -> TuningDatabase | None:
    """Records the compile pipeline builds from: ``tuning_log`` when given (a ``.jsonl`` file, a
    target directory or a log root; ``"none"``: no records, template defaults only), else the repo's
    ``tuning_logs/<target_name>/`` when it exists (an installed package without the repo has none)."""
    if tuning_log is not None and str(tuning_log).strip().lower() == "none":
        return None
    if tuning_log is not None:
        return TuningDatabase.from_path(tuning_log, target_name)
    directory = DEFAULT_LOG_ROOT / target_name
    if not directory.is_dir() or not any(directory.glob("*.jsonl")):
        return None
    return TuningDatabase(directory / "records.jsonl")
