"""Autotuning: search spaces measured on the target, an XGBoost cost model, and the tuning records."""

import perfx_compiler.tvm_compiler  # noqa: F401  (before tvm.relax: one line if TVM was loaded runtime-only)
