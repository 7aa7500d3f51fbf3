"""Plumbing shared by the scripts in benchmarks/: where results go, CSV writing, a matplotlib figure
that saves itself and the alternated order of A/B rounds.

Scripts run as ``python benchmarks/<name>.py`` (this folder is then on ``sys.path``) and import it as
``from _common import ...``; importing it also puts the repository root on ``sys.path`` so that
``schedules`` and ``perfx_compiler`` resolve without an install.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
L3_BYTES = 32 << 20  # at least the last-level cache of the machines here: weight copies past it come from DRAM


def write_csv(
    path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, floats: str | None = None
) -> Path:
    """Writes ``rows`` under the header ``columns`` (default: the first row's keys); a row's missing
    columns are left empty; with ``floats`` (a format spec, e.g. ``".2f"``) float values are written
    in that format. Creates the folder."""
    from perfx_compiler.bench.report import write_csv as _write

    if floats is not None:
        rows = [{k: format(v, floats) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    return _write(path, rows, list(columns) if columns is not None else list(rows[0]))


@contextmanager
def figure(path: str | Path, *args: Any, dpi: int = 110, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` of ``plt.subplots(*args, **kwargs)`` on the Agg backend (no display needed);
    on leaving the block the figure is laid out, saved to ``path`` and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def alternated(items: Sequence[Any], round_index: int) -> list[Any]:
    """``items`` in order on even rounds, reversed on odd ones: neither variant always runs first
    (after the probe, or on a machine that is warming up)."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]
