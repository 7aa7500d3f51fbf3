"""Readers of ONNX files PerfX did not emit (torch.onnx exports, onnxruntime-genai folders): the graph's
structure is recognised, its weights and features read into a ``ModelDescription`` as the HF and GGUF
readers give it. No TVM here: operators are checked against ``model/onnx_ops.py``'s table."""
