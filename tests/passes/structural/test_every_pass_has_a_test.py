"""Every pass module in ``perfx_compiler/passes/`` has a structural test here (``test_<module>.py``): a new pass
comes with its before / expected modules."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
PASSES = HERE.parents[2] / "perfx_compiler" / "passes"
NOT_TESTED_HERE = {
}


def test_every_pass_module_has_a_structural_test() -> None:
    modules = sorted(p.stem for p in PASSES.glob("[a-z]*.py"))
    assert "fuse_add_norm" in modules, PASSES  # the folder is where this test thinks it is
    missing = [m for m in modules if m not in NOT_TESTED_HERE and not (HERE / f"test_{m}.py").exists()]
    assert not missing, f"passes without a structural test in {HERE}: {missing}"
