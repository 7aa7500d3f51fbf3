"""onnxruntime contrib operators (domain com.microsoft) used by onnxruntime-genai LLM exports.

``dequantize_matmulnbits`` turns a ``MatMulNBits`` weight (blocks of 2/4/8-bit codes with
per-block scales and optional packed zero points) into the exact float matrix onnxruntime
multiplies by; ``matmulnbits_table`` keeps the same weight as its integer codes, scales and zero
points (an ``NBitsTable``), which the graph recogniser records for the int4 passthrough pass
(``passes/onnx_int4_passthrough.py``: PerfX's int4 kernels over the file's own codes).
``CONTRIB_CONVERTERS`` are Relax converters for
``import_onnx(..., extra_converters=CONTRIB_CONVERTERS)``:

* ``MatMulNBits``: unpack + dequantize in Relax, then ``A @ W^T`` (+ bias);
* ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization``: RMSNorm (computed in
  float32), the skip variant also returns ``input + skip (+ bias)`` as its 4th output;
* ``RotaryEmbedding``: rotate-half or interleaved RoPE from cos/sin caches and position ids;
* ``MultiHeadAttention``: K/V already per head (genai's fp16 CPU builds), attention_bias, causal;
* ``GroupQueryAttention``: optional packed QKV, RoPE inside (``do_rotary``), GQA head sharing,
  causal attention over ``past ++ new``; ``present = concat(past, new)`` along the sequence
  (batch 1 / no left padding: positions are ``past_len + i``; a past buffer is taken as
  holding exactly ``past_len`` tokens, i.e. the unshared past/present mode).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from perfx_compiler.errors import UnsupportedModelError
from perfx_compiler.model.foreign_onnx.nbits import (  # noqa: F401  (re-exported: the converters' readers)
    NBitsTable,
    _attr,
    _expect_size,
    dequantize_matmulnbits,
    float_attr,
    int_attr,
    matmulnbits_table,
    unpack_codes,
)


def _shape(x: relax.Expr) -> list:
    return list(x.ty.shape.values)


def _i64(bb: relax.BlockBuilder, value: Any) -> relax.Expr:
    return relax.const(np.int64(value)) if isinstance(value, int) else value


class MatMulNBits(OnnxOpConverter):
    """A [.., K] x dequant(B) [N, K]^T -> [.., N] (+ bias)."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, params: Any) -> relax.Expr:
        a, b, scales = inputs[0], inputs[1], inputs[2]
        zp = inputs[3] if len(inputs) > 3 else None
        if len(inputs) > 4 and inputs[4] is not None:
            raise UnsupportedModelError("MatMulNBits with g_idx (act-order) is not supported")
        bias = inputs[5] if len(inputs) > 5 else None
        k, n = int(attr["K"]), int(attr["N"])
        bits, block = int(attr.get("bits", 4)), int(attr["block_size"])
        if bits not in (2, 4, 8):
            raise UnsupportedModelError(f"MatMulNBits with bits={bits} is not supported (2, 4, 8 are)")
        per, mask = 8 // bits, (1 << bits) - 1
        n_blocks = -(-k // block)
        dtype = str(a.ty.dtype)
        packed = bb.emit(relax.op.astype(relax.op.reshape(b, [n, n_blocks, block // per]), "int32"))
        parts = [relax.op.bitwise_and(relax.op.right_shift(packed, relax.const(bits * j, "int32")),
                                      relax.const(mask, "int32")) for j in range(per)]
        codes = bb.emit(relax.op.reshape(relax.op.stack(parts, axis=3), [n, n_blocks, block]))
        scale = relax.op.reshape(relax.op.astype(scales, "float32"), [n, n_blocks, 1])
        if zp is None:
            zero: relax.Expr = relax.const(float(1 << (bits - 1)), "float32")
        elif str(zp.ty.dtype) == "uint8":
            zb = relax.op.astype(zp, "int32")
            zparts = [relax.op.bitwise_and(relax.op.right_shift(zb, relax.const(bits * j, "int32")),
                                           relax.const(mask, "int32")) for j in range(per)]
            zrow = int(np.prod([int(d) for d in _shape(zp)])) // n
            zall = relax.op.reshape(relax.op.stack(zparts, axis=2), [n, zrow * per])
            zero = relax.op.reshape(relax.op.astype(relax.op.strided_slice(zall, [1], [0], [n_blocks]), "float32"),
                                    [n, n_blocks, 1])
        else:
            zero = relax.op.reshape(relax.op.astype(zp, "float32"), [n, n_blocks, 1])
        w = relax.op.multiply(relax.op.subtract(relax.op.astype(codes, "float32"), zero), scale)
        w = relax.op.reshape(w, [n, n_blocks * block])
        if n_blocks * block != k:
            w = relax.op.strided_slice(w, [1], [0], [k])
        w = bb.emit(relax.op.astype(w, dtype))
        out = relax.op.matmul(a, relax.op.permute_dims(w, [1, 0]))
        if bias is not None:
            out = relax.op.add(out, bias)
        return out


def _rms(x: relax.Expr, scale: relax.Expr, eps: float) -> relax.Expr:
    dtype = str(x.ty.dtype)
    xf = relax.op.astype(x, "float32") if dtype != "float32" else x
    sf = relax.op.astype(scale, "float32") if str(scale.ty.dtype) != "float32" else scale
    y = relax.op.nn.rms_norm(xf, sf, axes=[-1], epsilon=eps)
    return relax.op.astype(y, dtype) if dtype != "float32" else y


class SimplifiedLayerNormalization(OnnxOpConverter):
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * scale."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, params: Any) -> relax.Expr:
        axis = int(attr.get("axis", -1))
        if axis not in (-1, len(_shape(inputs[0])) - 1):
            raise UnsupportedModelError(f"SimplifiedLayerNormalization over axis {axis} is not supported (last axis is)")
        return _rms(inputs[0], inputs[1], float(attr.get("epsilon", 1e-5)))


class SkipSimplifiedLayerNormalization(OnnxOpConverter):
    """(RMSNorm(x + skip [+ bias]), -, -, x + skip [+ bias])."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, params: Any) -> relax.Expr:
        x, skip, gamma = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        s = relax.op.add(x, skip)
        if bias is not None:
            s = relax.op.add(s, bias)
        s = bb.emit(s)
        y = bb.emit(_rms(s, gamma, float(attr.get("epsilon", 1e-5))))
        dummy = relax.const(np.zeros((1,), np.float32))
        return relax.Tuple([y, dummy, dummy, s])


def _rope(x: relax.Expr, cos: relax.Expr, sin: relax.Expr, interleaved: bool) -> relax.Expr:
    """x [..., S, D] (heads before S), cos/sin [S, D/2] broadcast over heads."""
    shape = _shape(x)
    d = int(shape[-1])
    h = d // 2
    if interleaved:
        pairs = relax.op.reshape(x, [*shape[:-1], h, 2])
        x1 = relax.op.squeeze(relax.op.strided_slice(pairs, [len(shape)], [0], [1]), [len(shape)])
        x2 = relax.op.squeeze(relax.op.strided_slice(pairs, [len(shape)], [1], [2]), [len(shape)])
        o1 = relax.op.subtract(relax.op.multiply(x1, cos), relax.op.multiply(x2, sin))
        o2 = relax.op.add(relax.op.multiply(x2, cos), relax.op.multiply(x1, sin))
        return relax.op.reshape(relax.op.stack([o1, o2], axis=len(shape)), shape)
    x1 = relax.op.strided_slice(x, [len(shape) - 1], [0], [h])
    x2 = relax.op.strided_slice(x, [len(shape) - 1], [h], [d])
    o1 = relax.op.subtract(relax.op.multiply(x1, cos), relax.op.multiply(x2, sin))
    o2 = relax.op.add(relax.op.multiply(x2, cos), relax.op.multiply(x1, sin))
    return relax.op.concat([o1, o2], axis=-1)


def _tables(cos_cache: relax.Expr, sin_cache: relax.Expr, positions: relax.Expr, dtype: str) -> tuple:
    cos = relax.op.astype(relax.op.take(cos_cache, positions, axis=0), dtype)
    sin = relax.op.astype(relax.op.take(sin_cache, positions, axis=0), dtype)
    return cos, sin


class RotaryEmbedding(OnnxOpConverter):
    """input [B, S, H*D] or [B, H, S, D]; position_ids [B, S] (or a 1-element start offset)."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, params: Any) -> relax.Expr:
        x, pos, cos_cache, sin_cache = inputs[:4]
        interleaved = bool(attr.get("interleaved", 0))
        shape = _shape(x)
        half = int(_shape(cos_cache)[1])
        if int(attr.get("rotary_embedding_dim", 0)) not in (0, 2 * half):
            raise UnsupportedModelError("RotaryEmbedding on part of the head (rotary_embedding_dim) is not supported")
        if len(shape) == 4:  # [B, H, S, D]
            b, heads, s, d = shape
            xs = x
        else:
            b, s, hidden = shape
            d = 2 * half
            heads = int(attr.get("num_heads", 0)) or int(hidden) // d
            xs = bb.emit(relax.op.permute_dims(relax.op.reshape(x, [b, s, heads, d]), [0, 2, 1, 3]))
        if len(_shape(pos)) == 2:
            positions = relax.op.reshape(pos, [b, 1, s])  # batch 1 per table lookup below
            cos = relax.op.astype(relax.op.take(cos_cache, positions, axis=0), str(x.ty.dtype))  # [B,1,S,D/2]
            sin = relax.op.astype(relax.op.take(sin_cache, positions, axis=0), str(x.ty.dtype))
        else:
            start = relax.op.reshape(pos, [])
            positions = relax.op.add(relax.op.arange(0, s, 1, str(pos.ty.dtype)), start)
            cos, sin = _tables(cos_cache, sin_cache, positions, str(x.ty.dtype))
        y = bb.emit(_rope(xs, cos, sin, interleaved))
        if len(shape) == 4:
            return y
        return relax.op.reshape(relax.op.permute_dims(y, [0, 2, 1, 3]), shape)


class GroupQueryAttention(OnnxOpConverter):
    """(query|packed qkv, key, value, past_key, past_value, seqlens_k, total_len, cos, sin) -> out, present k/v."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, params: Any) -> relax.Expr:
        q_in, k_in, v_in, past_k, past_v = inputs[:5]
        cos_cache = inputs[7] if len(inputs) > 7 else None
        sin_cache = inputs[8] if len(inputs) > 8 else None
        if any(x is not None for x in inputs[9:]):
            raise UnsupportedModelError("GroupQueryAttention with position_ids/attention_bias/head_sink inputs is not supported")
        heads, kv_heads = int(attr["num_heads"]), int(attr["kv_num_heads"])
        if int(attr.get("local_window_size", -1)) != -1 or float(attr.get("softcap", 0.0)) != 0.0:
            raise UnsupportedModelError("GroupQueryAttention with a sliding window or softcap is not supported")
        dtype = str(q_in.ty.dtype)
        b, s, width = _shape(q_in)
        if k_in is None:  # packed QKV
            d = int(width) // (heads + 2 * kv_heads)
            q = relax.op.strided_slice(q_in, [2], [0], [heads * d])
            k = relax.op.strided_slice(q_in, [2], [heads * d], [(heads + kv_heads) * d])
            v = relax.op.strided_slice(q_in, [2], [(heads + kv_heads) * d], [(heads + 2 * kv_heads) * d])
        else:
            d = int(width) // heads
            q, k, v = q_in, k_in, v_in

        def split(t: relax.Expr, n: int) -> relax.Expr:
            return bb.emit(relax.op.permute_dims(relax.op.reshape(t, [b, s, n, d]), [0, 2, 1, 3]))

        q, k, v = split(q, heads), split(k, kv_heads), split(v, kv_heads)
        past_len = _shape(past_k)[2] if past_k is not None else 0
        if attr.get("do_rotary", 0):
            positions = relax.op.arange(past_len, past_len + s, 1, "int64") if not isinstance(past_len, int) \
                else relax.op.arange(past_len, past_len + s, 1, "int64")
            cos, sin = _tables(cos_cache, sin_cache, positions, dtype)
            inter = bool(attr.get("rotary_interleaved", 0))
            q, k = bb.emit(_rope(q, cos, sin, inter)), bb.emit(_rope(k, cos, sin, inter))
        if past_k is not None:
            k = bb.emit(relax.op.concat([past_k, k], axis=2))
            v = bb.emit(relax.op.concat([past_v, v], axis=2))
        present_k, present_v = k, v
        group = heads // kv_heads
        if group > 1:
            k = relax.op.repeat(k, group, axis=1)
            v = relax.op.repeat(v, group, axis=1)
        total = _shape(present_k)[2]
        scale = float(attr.get("scale", 0.0)) or 1.0 / float(np.sqrt(d))
        # einsum, not matmul(q, permute_dims(k)): a transpose of a symbolic-length tensor trips
        # TVM's RewriteDataflowReshape when the length is past + seq.
        scores = relax.op.multiply(relax.op.einsum([q, bb.emit(k)], "bhqd,bhkd->bhqk"), relax.const(scale, dtype))
        qi = relax.op.reshape(relax.op.arange(0, s, 1, "int64"), [s, 1])
        kj = relax.op.reshape(relax.op.arange(0, total, 1, "int64"), [1, total])
        allowed = relax.op.less_equal(kj, relax.op.add(qi, _i64(bb, relax.prim_value(past_len))
                                                       if not isinstance(past_len, int) else relax.const(past_len, "int64")))
        masked = relax.op.where(allowed, scores, relax.const(float(np.finfo(np.float32).min), dtype))
        probs = relax.op.nn.softmax(masked, axis=-1)
        out = relax.op.matmul(probs, v)  # [B, H, S, D]
        out = bb.emit(relax.op.reshape(relax.op.permute_dims(out, [0, 2, 1, 3]), [b, s, heads * d]))
        return relax.Tuple([out, present_k, present_v])


class MultiHeadAttention(OnnxOpConverter):
    """(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value) ->
    (out, present_key, present_value): softmax(q k^T * scale + attention_bias [+ causal]) v.

    What onnxruntime-genai's fp16 CPU builds write (K/V already repeated to every head, the
    causal mask as ``attention_bias``). key/value are [B, L, H*D] or [B, H, L, D]; past K/V
    [B, H, P, D] are prepended."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs: list, attr: dict, params: Any) -> relax.Expr:
        q_in, k_in, v_in = inputs[:3]
        bias, pad_mask, attn_bias = (inputs[i] if len(inputs) > i else None for i in (3, 4, 5))
        past_k, past_v = (inputs[i] if len(inputs) > i else None for i in (6, 7))
        if k_in is None or v_in is None or bias is not None or pad_mask is not None:
            raise UnsupportedModelError("MultiHeadAttention with packed QKV, a bias or key_padding_mask is not supported")
        heads = int(attr["num_heads"])
        dtype = str(q_in.ty.dtype)
        b, s, width = _shape(q_in)
        d = int(width) // heads

        def split(t: relax.Expr) -> relax.Expr:
            if len(_shape(t)) == 4:
                return t
            bt, lt, _ = _shape(t)
            return bb.emit(relax.op.permute_dims(relax.op.reshape(t, [bt, lt, heads, d]), [0, 2, 1, 3]))

        q, k, v = split(q_in), split(k_in), split(v_in)
        if past_k is not None:
            k = bb.emit(relax.op.concat([past_k, k], axis=2))
            v = bb.emit(relax.op.concat([past_v, v], axis=2))
        total = _shape(k)[2]
        scale = float(attr.get("scale", 0.0)) or 1.0 / float(np.sqrt(d))
        scores = relax.op.multiply(relax.op.einsum([q, k], "bhqd,bhkd->bhqk"), relax.const(scale, dtype))
        if attn_bias is not None:
            scores = relax.op.add(scores, attn_bias)
        if int(attr.get("unidirectional", 0)):
            qpos = relax.op.reshape(relax.op.arange(total - s, total, 1, "int64"), [s, 1])  # absolute positions
            kj = relax.op.reshape(relax.op.arange(0, total, 1, "int64"), [1, total])
            allowed = relax.op.less_equal(kj, qpos)
            scores = relax.op.where(allowed, scores, relax.const(float(np.finfo(np.float16 if dtype == "float16"
                                                                                  else np.float32).min), dtype))
        probs = relax.op.nn.softmax(bb.emit(scores), axis=-1)
        out = relax.op.matmul(probs, v)
        out = bb.emit(relax.op.reshape(relax.op.permute_dims(out, [0, 2, 1, 3]), [b, s, heads * d]))
        return relax.Tuple([out, k, v])


#: op_type -> converter, for import_onnx(extra_converters=...).
CONTRIB_CONVERTERS: dict[str, type] = {
    "MatMulNBits": MatMulNBits,
    "SimplifiedLayerNormalization": SimplifiedLayerNormalization,
    "SkipSimplifiedLayerNormalization": SkipSimplifiedLayerNormalization,
    "RotaryEmbedding": RotaryEmbedding,
    "GroupQueryAttention": GroupQueryAttention,
    "MultiHeadAttention": MultiHeadAttention,
}
