"""ONNX graphs into TVM Relax: the importer and the converter fixes it needs."""

import perfx_compiler.tvm_compiler  # noqa: F401  (before tvm.relax: one line if TVM was loaded runtime-only)
