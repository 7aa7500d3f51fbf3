"""Adreno texture path for decode GEMVs: the ``decode`` function's linear layers read their weights
through OpenCL images instead of buffers, when the target file asks for it
(``templates.gpu_gemv.texture: true``; targets/adreno.json).

For every decode linear (one token: x is [1, 1, K]) whose weight fits the target's image limits
(``tvm_target.texture_spatial_limit`` for width and height, ``templates.gpu_gemv.texture_max_layers``
for the layers of an image array), the weight is packed at compile time into an extra weight
parameter ``<name>__tex`` ([layers, height, width, 4]; layouts in ``kernels/gemv_texture.py``):

* float32 weights (``R.matmul(x, permute_dims(W))``) -> one RGBA32F image;
* int4 / int8 linears (``call_tir`` of a ``perfx.quant`` PrimFunc: GGUF Q4_0/Q4_1/Q8_0 passthrough,
  q4_* and q8 quantization) -> the code words as RGBA32UI and their scales (+ zeros / mins) as
  RGBA32F (``<scale name>__tex``: OpenCL reads fp16 buffers only with cl_khr_fp16, images of float32
  without it).

The call becomes a ``call_tir`` of the matching texture kernel. Prefill and the paged functions keep
the buffer weights (their GEMMs read buffers), so image weights are extra device memory: the codes
once more, scales widened to fp32. Weights that do not fit (K not a multiple of the kernel's texel
pair, or too many rows) keep their buffer GEMV.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import tvm
from tvm import relax

from perfx_compiler.passes._relax_util import SKIP, FuncInfo, find_linears, replace_weight_params, rewrite_functions

NAME = "texture_weights"
ORDER = 88  # after quantization; before weight_layout, whose FuseTransposeMatmul hides float linears in call_tir
DEFAULT = True
TEX_SUFFIX = "__tex"
QUANT_ATTR = "perfx.quant"
FUNCTION = "decode"


def texture_options(target: Any) -> dict[str, Any] | None:
    """The target's texture settings (None when the target file does not enable textures)."""
    gemv = (getattr(target, "templates", None) or {}).get("gpu_gemv", {})
    if not gemv.get("texture"):
        return None
    spatial = int(target.tvm_target.get("texture_spatial_limit", 16384))
    return {
        "max_width": int(gemv.get("texture_max_width", spatial)),
        "max_height": int(gemv.get("texture_max_height", spatial)),
        "max_layers": int(gemv.get("texture_max_layers", 2048)),
        "threads": int(gemv.get("threads", 64)),
    }


def _static(expr: Any) -> list[int] | None:
    dims = []
    for d in expr.ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return None
        dims.append(int(d.value))
    return dims


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    from perfx_compiler.kernels import gemv_texture as gt

    opts = texture_options(ctx.target)
    if opts is None or FUNCTION not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod, weights
    func = mod[FUNCTION]
    info = FuncInfo.of(func)
    new: dict[str, np.ndarray] = {}
    kernels: dict[str, Any] = {}
    todo: list[tuple[str, Any, str, list[str]]] = []  # (kind, binding var or Linear, kernel, image names)

    def add_image(name: str, make: Any) -> str:
        if name + TEX_SUFFIX not in new:
            new[name + TEX_SUFFIX] = make()
        return name + TEX_SUFFIX

    for var, value in info.values.items():  # quantized linears: call_tir of a perfx.quant PrimFunc
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir"):
            continue
        pf = mod[value.args[0]]
        q = json.loads(str(pf.attrs[QUANT_ATTR])) if pf.attrs is not None and QUANT_ATTR in pf.attrs else None
        args = list(value.args[1].fields)
        if q is None or q.get("kind") != "matmul" or q.get("words") or _static(args[0]) != [1, 1, int(q["K"])]:
            continue
        n, k = int(q["N"]), int(q["K"])
        names = [a.name for a in args[1:]]
        if any(nm not in weights for nm in names):
            continue
        try:
            if q["bits"] == 4:
                cl = gt.image_layout(n, k // 32, "RGBA32UI", opts)
                ng = weights[names[1]].shape[1]
                sl = gt.image_layout(n, -(-ng // 2), "RGBA32F", opts)
                kern = gt.texture_q4_gemv_kernel(q, cl, sl, opts["threads"])
            elif q["bits"] == 8:
                cl = gt.image_layout(n, k // 16, "RGBA32UI", opts)
                ng = weights[names[1]].shape[1]
                sl = gt.image_layout(n, -(-ng // 4), "RGBA32F", opts)
                kern = gt.texture_q8_gemv_kernel(q, cl, sl, opts["threads"])
            else:
                continue
        except gt.TextureLimitError:
            continue
        codes = np.ascontiguousarray(weights[names[0]])
        words = codes.view(np.uint32) if codes.dtype != np.uint32 else codes
        imgs = [add_image(names[0], lambda words=words, cl=cl: gt.pack_image(words, cl)),
                add_image(names[1], lambda sl=sl, s=[weights[nm] for nm in names[1:]]: gt.pack_scales(s, sl))]
        kname = f"texture_{value.args[0].name_hint}"
        kernels[kname] = kern
        todo.append(("quant", var, kname, imgs))

    for lin in find_linears(info):  # float32 linears
        shape_x, shape_w = _static(lin.x), _static(lin.weight)
        if shape_w is None or len(shape_w) != 2 or str(lin.weight.ty.dtype) != "float32":
            continue
        n, k = shape_w
        if shape_x != [1, 1, k] or lin.weight.name not in weights:
            continue
        try:
            lay = gt.image_layout(n, k // 4, "RGBA32F", opts)
            kern = gt.texture_gemv_kernel(n, k, opts["threads"], lay)
        except gt.TextureLimitError:
            continue
        w = np.ascontiguousarray(weights[lin.weight.name], np.float32)
        img = add_image(lin.weight.name, lambda w=w, lay=lay: gt.pack_image(w, lay))
        kname = f"texture_gemv_{n}_{k}_l{lay.layers}"
        kernels[kname] = kern
        todo.append(("f32", lin, kname, [img]))

    if not todo:
        return mod, weights
    mod, table, params = replace_weight_params(mod, weights, {**weights, **new})

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        if fn != FUNCTION:
            return {}
        p = params[fn]
        plan: dict[Any, Any] = {}
        for kind, item, kname, imgs in todo:
            if kind == "quant":

                def quant(rw: Any, binding: Any, kname=kname, imgs=imgs) -> None:
                    x = rw.arg(binding.value.args[1].fields[0])
                    call = relax.call_tir(gvars[kname], [x, *(p[i] for i in imgs)], binding.var.ty)
                    rw.remap(binding.var, rw.emit(call, binding.var))

                plan[item] = quant
            else:
                lin = item
                for v in lin.vars:
                    plan[v] = SKIP

                def linear(rw: Any, binding: Any, lin=lin, kname=kname, imgs=imgs) -> None:
                    ty = lin.matmul.ty
                    y = rw.emit(relax.call_tir(gvars[kname], [rw.arg(lin.x), p[imgs[0]]],
                                               relax.TensorType(ty.shape, "float32")),
                                None if lin.add is not None else lin.matmul)
                    if lin.add is not None:
                        y = rw.emit(relax.op.add(y, rw.arg(lin.bias)), lin.add)
                    rw.remap(lin.out, y)

                plan[min(lin.vars[1:], key=lambda v: info.order[v])] = linear
        return plan

    # the plan was made on the function before its parameters were extended: same binding vars
    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, table


def _content(source: str) -> str:
    if source.endswith("_q4"):
        return "int4 code words of passes/_quant.py (uint32 [N, K/8]), 4 words a texel"
    if source.endswith("_q8"):
        return "int8 codes as little-endian uint32 words (16 codes a texel)"
    if source.endswith("_q4_scale"):
        return "per group (scale, min|zero) as fp32; texel i = groups 2i, 2i+1"
    if source.endswith("_q8_scale"):
        return "per group scale as fp32; texel i = groups 4i .. 4i+3"
    return "float32 weights W[N, K]; texel x = W[n, 4x : 4x+4]"


def texture_manifest(weights: dict[str, Any]) -> dict[str, Any]:
    """Manifest entry per image weight: format, image size and what a texel holds."""
    out = {}
    for name, arr in weights.items():
        if not name.endswith(TEX_SUFFIX):
            continue
        layers, height, width, _ = arr.shape
        fmt = {"uint32": "RGBA32UI", "float32": "RGBA32F", "float16": "RGBA16F"}[str(arr.dtype)]
        source = name[: -len(TEX_SUFFIX)]
        out[name] = {"source": source, "format": fmt, "image": "image2d_array",
                     "width": int(width), "height": int(height), "layers": int(layers), "content": _content(source),
                     "row_to_texel": "matrix row n: layer n // height, y = n % height"}
    return out
