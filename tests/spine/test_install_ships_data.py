"""``pip install .`` (the README's first command) ships what the compiler reads from the repo: the
committed tuning records (``tuning_logs/<target>/*.jsonl``: without them an installed perfx-compile builds
the README model from template defaults), the target files, and the package's non-Python files (AWQ's
calibration text, the cross-compiled C/C++ harnesses)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_wheel_holds_every_record_target_and_data_file(tmp_path: Path) -> None:
    # built from a copy of the checkout's files: the repo's own build/ folder would feed the wheel stale files
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"], capture_output=True,
                            text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = listed.stdout.splitlines()
    src = tmp_path / "src"
    for f in files:
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / f, src / f)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"pip wheel failed: {out.stderr[-2000:]}")
    (wheel,) = tmp_path.glob("perfx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = [f for f in files if f.startswith(("tuning_logs/", "targets/", "perfx_compiler/", "schedules/"))
              and not f.endswith((".py", ".pyc"))]
    assert any(w.startswith("tuning_logs/x86-avx512/") for w in wanted)  # the README model's records
    missing = [w for w in wanted if w not in names]
    assert not missing, f"not in the wheel: {missing}"
