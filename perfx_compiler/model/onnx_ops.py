"""Which ONNX operators PerfX reads, and the one-line error naming those it does not.

Data, not TVM: the model layer refuses a foreign ONNX file's unknown operators without importing the
compiler. ``TVM_OPS`` is the converter map of TVM 0.27's ONNX frontend with PerfX's converter fixes
(``frontend/converter_fixes.py``); ``tests/frontend/test_onnx_import.py`` holds it equal to that map, so
it cannot drift from what the importer converts. ``CONTRIB_OPS``: the com.microsoft operators of
onnxruntime-genai graphs PerfX converts itself (``frontend/contrib_ops.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

import onnx

TVM_OPS = frozenset((
    "Abs", "Acos", "Acosh", "Add", "AffineGrid", "AllClassNMS", "And", "ArgMax", "ArgMin", "Asin", "Asinh", "Atan",
    "Atanh", "Attention", "AveragePool", "BatchNormalization", "BiasGelu", "BitShift", "BitwiseAnd", "BitwiseNot",
    "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Ceil", "Clip", "Compress", "Concat", "ConcatFromSequence",
    "Constant", "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "Cosh", "CumSum", "DepthToSpace",
    "DequantizeLinear", "Div", "Dropout", "DynamicQuantizeLinear", "Einsum", "Elu", "EmbedLayerNormalization",
    "Equal", "Erf", "Exp", "Expand", "EyeLike", "FastGelu", "Flatten", "Floor", "Gather", "GatherElements",
    "GatherND", "Gelu", "Gemm", "GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "Greater", "GreaterOrEqual",
    "GridSample", "GroupNormalization", "HardSigmoid", "HardSwish", "Hardmax", "Identity", "InstanceNormalization",
    "IsInf", "IsNaN", "LRN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax",
    "LpPool", "MatMul", "MatMulInteger", "MatMulInteger16", "Max", "MaxPool", "MaxRoiPool", "MaxUnpool", "Mean",
    "MeanVarianceNormalization", "Min", "Mish", "Mod", "Mul", "Neg", "NonMaxSuppression", "NonZero", "Not",
    "OneHot", "Optional", "OptionalGetElement", "OptionalHasElement", "Or", "PRelu", "Pad", "Pow", "QuantizeLinear",
    "RMSNormalization", "Range", "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare", "Relu", "Reshape",
    "Resize", "RoiAlign", "Round", "Scatter", "ScatterElements", "ScatterND", "Selu", "SequenceAt",
    "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength", "Shape", "Shrink",
    "Sigmoid", "Sign", "Sin", "Sinh", "Size", "SkipLayerNormalization", "Slice", "Softmax", "Softplus", "Softsign",
    "SpaceToDepth", "Split", "SplitToSequence", "Sqrt", "Squeeze", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu",
    "Tile", "TopK", "Transpose", "Trilu", "Unique", "Unsqueeze", "Upsample", "Where", "Xor"
))
CONTRIB_OPS = frozenset(("GroupQueryAttention", "MatMulNBits", "MultiHeadAttention", "RotaryEmbedding",
                         "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"))
# Domains whose ops the converter map covers by op_type (ai.onnx + the com.microsoft contrib ops it has).
KNOWN_DOMAINS = ("", "ai.onnx", "com.microsoft")
# Handled by the importer itself, not through the converter map.
DIRECT_OPS = ("If", "Constant")
_MAX_LISTED_NODES = 3  # node names shown per unsupported op type
_MAX_LISTED_TYPES = 12


def _op_label(domain: str, op_type: str) -> str:
    return op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"


def _opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    versions = {imp.domain: imp.version for imp in model.opset_import}
    if "ai.onnx" in versions and "" not in versions:
        versions[""] = versions["ai.onnx"]
    return versions


def _walk_nodes(
    graph: onnx.GraphProto | onnx.FunctionProto, functions: Mapping[tuple[str, str], onnx.FunctionProto]
) -> Iterator[onnx.NodeProto]:
    """Every node, including those in If/Loop/Scan bodies and in called model-local functions
    (import_onnx inlines those, so their bodies are what must convert)."""
    for node in graph.node:
        body = functions.get((node.domain or "", node.op_type))
        if body is not None:
            yield from _walk_nodes(body, functions)
            continue
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(a.g, functions)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _walk_nodes(g, functions)


def unsupported_ops(
    model: onnx.ModelProto, known: Collection[str] = TVM_OPS | CONTRIB_OPS, extra: Collection[str] = CONTRIB_OPS
) -> list[tuple[str, str, int]]:
    """Nodes no converter handles: ``(op_type with domain, node name, opset)`` in graph order.

    ``known``: the op types converted; ``extra``: those converted whatever their domain. A node from an
    unknown domain counts as unsupported even if an ai.onnx op of the same name exists (TVM looks
    converters up by op_type alone), unless ``extra`` names that op_type.
    """
    extra = set(extra)
    versions = _opset_versions(model)
    out = []
    functions = {(f.domain or "", f.name): f for f in model.functions}
    for node in _walk_nodes(model.graph, functions):
        domain = node.domain or ""
        if node.op_type in DIRECT_OPS and domain in ("", "ai.onnx"):
            continue
        ok = node.op_type in extra or (domain in KNOWN_DOMAINS and node.op_type in known)
        if not ok:
            out.append((_op_label(domain, node.op_type), node.name, versions.get(domain, 0)))
    return out


def unsupported_message(found: list[tuple[str, str, int]], source: str) -> str:
    by_type: dict[tuple[str, int], list[str]] = {}
    for label, name, opset in found:
        if isinstance(name, bytes):  # protobuf hands back a name that is not UTF-8 as bytes
            name = name.decode("utf-8", errors="replace")
        by_type.setdefault((label, opset), []).append(name or "<unnamed>")
    parts = []
    for (label, opset), names in list(by_type.items())[:_MAX_LISTED_TYPES]:
        shown = ", ".join(names[:_MAX_LISTED_NODES])
        more = f" +{len(names) - _MAX_LISTED_NODES} more" if len(names) > _MAX_LISTED_NODES else ""
        parts.append(f"{label} (opset {opset}; {len(names)} node{'s' * (len(names) > 1)}: {shown}{more})")
    if len(by_type) > _MAX_LISTED_TYPES:
        parts.append(f"+{len(by_type) - _MAX_LISTED_TYPES} more op types")
    return (
        f"{source} uses {len(by_type)} unsupported ONNX operator type(s): {'; '.join(parts)}. "
        "Re-export with standard ai.onnx ops (torch.onnx.export) or the com.microsoft ops onnxruntime-genai "
        "writes (MatMulNBits, GroupQueryAttention, RotaryEmbedding, (Skip)SimplifiedLayerNormalization), "
        "or register converters for them via extra_converters."
    )
