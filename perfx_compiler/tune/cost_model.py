"""XGBoost cost model over (workload, config) features, shared by every workload (transfer).

Target: log(seconds per unit of work) where work is the product of the workload's dims (times M
for symbolic-M buckets), so a model trained on gate_up transfers its ranking of tiles to q_proj.
Features are named (template, dims, knobs; string knobs one-hot), so templates with different
knobs share one model. Until it has seen enough records the model returns None and the search
samples at random.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from perfx_compiler.schedule_template import Workload
from perfx_compiler.tune.records import TuningRecord

MIN_TRAIN = 8


def _work(dims: dict[str, int], m_value: int | None) -> float:
    work = 1.0
    for value in dims.values():
        if value and value > 0:
            work *= value
    if m_value:
        work *= m_value if not dims.get("M") else 1
    return max(work, 1.0)


def features(
    template: str, dims: dict[str, int], config: dict[str, Any], m_value: int | None
) -> dict[str, float]:
    feats: dict[str, float] = {f"t:{template}": 1.0}
    for name, value in dims.items():
        feats[f"d:{name}"] = math.log2(1 + max(0, int(value)))
    m = m_value or dims.get("M") or 1
    feats["m"] = math.log2(1 + m)
    numeric = []
    for knob, value in config.items():
        if isinstance(value, bool):
            feats[f"c:{knob}"] = float(value)
        elif isinstance(value, (int, float)):
            feats[f"c:{knob}"] = float(value)
            feats[f"l:{knob}"] = math.log2(1 + abs(float(value)))
            numeric.append(float(value))
        else:
            feats[f"c:{knob}={value}"] = 1.0
    # Ratios that decide tile quality independent of the knob names: work per task, tile area.
    if "mr" in config and "nr" in config:
        feats["x:tile"] = math.log2(1 + config["mr"] * config["nr"])
        feats["x:m_waste"] = (-(-m // config["mr"]) * config["mr"] - m) / max(1, m)
    if "nc" in config and "N" in dims and dims["N"]:
        feats["x:panels"] = math.log2(1 + dims["N"] / max(1, config["nc"]))
    return feats


class CostModel:
    """Gradient-boosted regressor; ``predict`` returns lower-is-better scores."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rows: list[dict[str, float]] = []
        self._y: list[float] = []
        self._names: list[str] = []
        self._model: Any = None

    def __len__(self) -> int:
        return len(self._y)

    def add(self, template: str, dims: dict[str, int], config: dict[str, Any], m_value: int | None, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        self._rows.append(features(template, dims, config, m_value))
        self._y.append(math.log(seconds / _work(dims, m_value)))

    def add_records(self, records: list[TuningRecord], workloads: dict[str, Workload]) -> None:
        """Train on stored records of known workloads (records of other workloads transfer too)."""
        for r in records:
            wl = workloads.get(r.workload_key)
            dims = wl.dims if wl is not None else r.dims
            # Confirmations repeat a measured config with another statistic (a median); stale
            # records rank configurations by a method no longer used (warm decode GEMVs).
            if r.ok and dims and not r.confirmed and not r.stale:
                self.add(r.template, dims, r.config, r.bucket, r.mean_s)

    def _matrix(self, rows: list[dict[str, float]]) -> np.ndarray:
        index = {n: i for i, n in enumerate(self._names)}
        x = np.full((len(rows), len(self._names)), np.nan, dtype=np.float32)
        for i, row in enumerate(rows):
            for name, value in row.items():
                j = index.get(name)
                if j is not None:
                    x[i, j] = value
        return x

    def fit(self) -> bool:
        if len(self._y) < MIN_TRAIN:
            return False
        import xgboost as xgb

        self._names = sorted({n for row in self._rows for n in row})
        x = self._matrix(self._rows)
        y = np.asarray(self._y, dtype=np.float32)
        # Native API: the sklearn wrapper would need scikit-learn installed.
        params = {
            "objective": "reg:squarederror",
            "max_depth": 5,
            "eta": 0.15,
            "subsample": 0.9,
            "seed": self.seed,
            "nthread": 1,
            "verbosity": 0,
        }
        self._model = xgb.train(params, xgb.DMatrix(x, label=y, missing=np.nan), num_boost_round=120)
        return True

    @property
    def trained(self) -> bool:
        return self._model is not None

    def predict(self, template: str, dims: dict[str, int], configs: list[dict[str, Any]], m_value: int | None) -> np.ndarray | None:
        if self._model is None or not configs:
            return None
        rows = [features(template, dims, c, m_value) for c in configs]
        import xgboost as xgb

        matrix = xgb.DMatrix(self._matrix(rows), missing=np.nan)
        return np.asarray(self._model.predict(matrix), dtype=np.float64)
