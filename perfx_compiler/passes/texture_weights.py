"""Adreno texture path: weights that the decode GEMVs read through OpenCL images are kept ONLY as
images, and every other function reads the same images (``templates.gpu_gemv.texture: true``;
targets/adreno.json).

A weight group (the float W, or int4 / int8 codes with their scales and zeros / mins) becomes images
when ``decode`` has a GEMV on it (x is [1, 1, K]) and it fits the target's image limits
(``tvm_target.texture_spatial_limit`` for width and height, ``templates.gpu_gemv.texture_max_layers``
for the layers of an image array). It is packed at compile time into ``<name>__tex``
([layers, height, width, 4]; layouts in ``kernels/gemv_texture.py``):

* float32 weights (``R.matmul(x, permute_dims(W))``, ``R.take(W, ids)``) -> one RGBA32F image;
* int4 / int8 weights (``call_tir`` of a ``perfx.quant`` PrimFunc: GGUF Q4_0/Q4_1/Q8_0 passthrough,
  q4_* and q8) -> the code words as RGBA32UI and their float16 scales (+ zeros / mins) as their bits
  in RGBA32UI (``<scale name>__tex``: OpenCL reads float16 only with cl_khr_fp16; the kernels decode
  the bits by integer operations);
* K-quants and IQ4_XS (in the GPU superblock layout) -> ``<codes>_sb__tex``: runs of a head texel of
  group values and d, then the superblocks' code texels (``formats/superblock_images.py``, read by
  ``kernels/texture_superblocks.py``); Q6_K's and Q2_K's d words in ``<scale_d>__tex``. The one-level
  bit-plane formats (Q5_0, Q5_1, IQ4_NL) stay buffers.

Every read of the group in every exported function is rewritten: one-token matmuls to the texture
GEMVs (``kernels/gemv_texture.py``), multi-row matmuls of prefill and the batched paged functions to
the texture GEMMs, embedding gathers of a tied embedding to the texture gathers
(``kernels/gemm_texture.py``). The buffer form is then dropped from the weight table, so the
artifact and the device hold one copy. A group with a read that no texture kernel replaces (another
operator, a shape that does not fit) keeps its buffer form only, with its buffer GEMV: never both.
The only growth is padding (rows of the last layer, a texel's missing groups): the images hold the
weight's own bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from perfx_compiler.formats import QUANT_ATTR
from perfx_compiler.passes._relax_util import (
    SKIP,
    FuncInfo,
    exported,
    find_linears,
    op_name,
    replace_weight_params,
    rewrite_functions,
)

NAME = "texture_weights"
TEX_SUFFIX = "__tex"
SB_SUFFIX = "_sb"  # a superblock type's image of head and code texels (formats/superblock_images.py)
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


def _static(expr: Any, partial: bool = False) -> list[Any] | None:
    """Static dims of a tensor expression; a symbolic dim makes it None (``partial``: that dim None)."""
    dims: list[Any] = []
    for d in expr.ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            if not partial:
                return None
            dims.append(None)
            continue
        dims.append(int(d.value))
    return dims


@dataclass
class _Use:
    """One read of a weight group that a texture kernel can replace. ``kind``: qmm (call_tir of a
    perfx.quant matmul), qtake (its embedding gather), fmm (float linear), ftake (relax take)."""

    kind: str  # or "shape": R.shape_of(W), replaced by W's static shape
    names: list[str]  # weights read: codes (or the float W) first, then scale and zero|min
    anchor: Any  # the binding var the plan replaces
    rows: Any  # x (matmuls) or ids (gathers)
    q: dict[str, Any] | None = None
    pf: str = ""  # the perfx.quant PrimFunc replaced
    lin: Any = None
    skip: tuple[Any, ...] = ()  # bindings dropped with it (a prefill's dequantize and transpose)

    @property
    def gemv(self) -> bool:
        return self.kind in ("qmm", "fmm") and _static(self.rows, partial=True)[:2] == [1, 1]


def _quant_call(mod: tvm.IRModule, value: Any) -> tuple[str, dict[str, Any]] | None:
    if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir"):
        return None
    pf = mod[value.args[0]]
    if pf.attrs is None or QUANT_ATTR not in pf.attrs:
        return None
    return value.args[0].name_hint, json.loads(str(pf.attrs[QUANT_ATTR]))


def _uses(mod: tvm.IRModule, info: FuncInfo, weights: dict[str, Any]) -> list[_Use]:
    """The reads of weights in one function that a texture kernel can replace."""
    out: list[_Use] = []
    for var, value in info.values.items():
        found = _quant_call(mod, value)
        if found is not None:
            pf, q = found
            args = list(value.args[1].fields)
            if not takes_images(q):
                continue
            skip: tuple[Any, ...] = ()
            if q["kind"] == "dequant":  # prefill on GPUs: matmul(x, permute_dims(dequantize(W)))
                names, mm = [getattr(a, "name", "") for a in args], _only_reader(info, var, "relax.permute_dims")
                mm_pt = _only_reader(info, mm, "relax.matmul") if mm is not None else None
                if mm_pt is None or [int(a) for a in info.values[mm].attrs.axes or []] != [1, 0]:
                    continue
                rows = info.values[mm_pt].args[0]
                if not info.values[mm_pt].args[1].same_as(mm):
                    continue
                skip, var = (var, mm), mm_pt
                shape = _static(rows, partial=True)
                if len(shape) != 3 or shape[2] != int(q["K"]) or str(rows.ty.dtype) != "float32":
                    continue
            elif q["kind"] == "matmul":
                names, rows = [getattr(a, "name", "") for a in args[1:]], args[0]
                shape = _static(rows, partial=True)
                if len(shape) != 3 or shape[2] != int(q["K"]) or str(rows.ty.dtype) != "float32":
                    continue
            else:
                names, rows = [getattr(a, "name", "") for a in args[:-1]], args[-1]
                if len(rows.ty.shape.values) != 2:
                    continue
            if all(nm in weights for nm in names):
                out.append(_Use("qtake" if q["kind"] == "take" else "qmm", names, var, rows, q=q, pf=pf, skip=skip))
        elif op_name(value) == "relax.shape_of" and isinstance(value.args[0], relax.Var):
            if value.args[0].name in weights and _static(value.args[0]) is not None:
                out.append(_Use("shape", [value.args[0].name], var, None))
        elif op_name(value) == "relax.take":
            w, ids = value.args
            if (isinstance(w, relax.Var) and w.name in weights and int(value.attrs.axis or 0) == 0
                    and len(w.ty.shape.values) == 2 and str(w.ty.dtype) == "float32"
                    and len(ids.ty.shape.values) == 2):
                out.append(_Use("ftake", [w.name], var, ids))
    for lin in find_linears(info):
        shape_x, shape_w = _static(lin.x, partial=True), _static(lin.weight)
        if shape_w is None or len(shape_w) != 2 or str(lin.weight.ty.dtype) != "float32":
            continue
        if len(shape_x) != 3 or shape_x[2] != shape_w[1] or lin.weight.name not in weights:
            continue
        out.append(_Use("fmm", [lin.weight.name], min(lin.vars[1:], key=lambda v: info.order[v]), lin.x, lin=lin))
    return out


def takes_images(q: dict[str, Any]) -> bool:
    """Whether a ``perfx.quant`` kernel's weight has an image layout: int4 / int8 codes with float16 group
    tables, and the K-quants and IQ4_XS (``formats/superblock_images.py``). The one-level bit-plane codes
    (Q5_0, Q5_1, IQ4_NL) have none: they stay buffers."""
    from perfx_compiler.formats.superblock_images import superblock_type

    if q.get("kind") not in ("matmul", "take", "dequant"):
        return False
    if q.get("sb"):
        return superblock_type(q) is not None
    return not (q.get("words") or q.get("code_bits") or q.get("bits") not in (4, 8))


def quant_images(q: dict[str, Any], arrays: list[np.ndarray], opts: dict[str, Any]) -> list[np.ndarray]:
    """The images one quantized weight's arrays (codes, then scale [, zero | min]) become, packed as this
    pass packs them (``opts``: :func:`texture_options`); for reports (``benchmarks/kernels.py bytes``)."""
    names = [f"w{i}" for i in range(len(arrays))]
    weights = dict(zip(names, arrays, strict=True))
    group = _Group(_Use("qmm", names, None, None, q=q), weights, opts)
    return list(group.pack(weights).values())


def _only_reader(info: FuncInfo, var: Any, op: str) -> Any:
    """The binding var of the one ``op`` call that reads ``var`` (read nowhere else), or None."""
    readers = info.users(var)
    if info.uses.get(var, 0) != 1 or len(readers) != 1 or op_name(info.values.get(readers[0])) != op:
        return None
    return readers[0]


def _weight_reads(info: FuncInfo, weights: dict[str, Any]) -> dict[str, int]:
    """How many bindings (and the function's result) read each weight."""
    out: dict[str, int] = {}
    for value in [*info.values.values(), info.func.body.body]:
        seen: set[str] = set()
        relax.analysis.post_order_visit(value, lambda e, seen=seen: seen.add(e.name) if isinstance(e, relax.Var) else None)
        for name in seen & weights.keys():
            out[name] = out.get(name, 0) + 1
    return out


class _Group:
    """The images of one weight (codes + scales, or the float W) and the kernels that read them."""

    def __init__(self, use: _Use, weights: dict[str, Any], opts: dict[str, Any]) -> None:
        from perfx_compiler.formats.superblock_images import SuperblockImages
        from perfx_compiler.kernels import gemv_texture as gt

        self.names, self.opts, self.q = list(use.names), opts, use.q
        self.sb = SuperblockImages.of(use.q) if use.q is not None and use.q.get("sb") else None
        if self.sb is not None:  # superblock types: runs of a head and code texels [, d words]
            self.fmt, self.n, self.k = self.sb.qtype, self.sb.n, self.sb.k
            self.layouts = self.sb.layouts(opts)
            self.images = [self.names[0] + SB_SUFFIX + TEX_SUFFIX] + [self.names[-1] + TEX_SUFFIX] * (len(self.layouts) - 1)
            return
        if use.q is None:
            n, k = np.asarray(weights[use.names[0]]).shape
            self.fmt, self.n, self.k = "f32", int(n), int(k)
            self.layouts = [gt.image_layout(self.n, self.k // 4, "RGBA32F", opts)]
        else:
            q = use.q
            self.fmt, self.n, self.k = f"q{q['bits']}", int(q["N"]), int(q["K"])
            ng = np.asarray(weights[use.names[1]]).shape[1]
            per_texel = 32 if q["bits"] == 4 else 16  # codes a texel
            columns = gt.q4_columns(q) if q["bits"] == 4 else 1  # float16 values a group (scale [, zero | min])
            if len(use.names) - 1 != columns:
                raise ValueError(f"internal: texture {self.fmt} weight {use.names[0]} has {len(use.names) - 1} "
                                 f"scale arrays, its format {columns}")
            self.layouts = [gt.image_layout(self.n, self.k // per_texel, "RGBA32UI", opts),
                            gt.scale_layout(self.n, ng, columns, opts)]
        self.images = [nm + TEX_SUFFIX for nm in self.names[: len(self.layouts)]]

    def pack(self, weights: dict[str, Any]) -> dict[str, np.ndarray]:
        from perfx_compiler.kernels import gemv_texture as gt

        if self.sb is not None:
            return dict(zip(self.images, self.sb.pack([np.asarray(weights[nm]) for nm in self.names], self.layouts),
                            strict=True))
        if self.fmt == "f32":
            w = np.ascontiguousarray(weights[self.names[0]], np.float32)
            return {self.images[0]: gt.pack_image(w, self.layouts[0])}
        codes = np.ascontiguousarray(weights[self.names[0]])
        words = codes.view(np.uint32) if codes.dtype != np.uint32 else codes
        columns = [np.asarray(weights[nm]) for nm in self.names[1:]]
        return {self.images[0]: gt.pack_image(words, self.layouts[0]),
                self.images[1]: gt.pack_scales(columns, self.layouts[1])}

    def kernel(self, use: _Use, built: dict[str, Any]) -> tuple[str, Any]:
        """(name, PrimFunc) of the texture kernel replacing ``use``; TextureLimitError when none fits.
        The name fixes the kernel (shape, format, image layout): each is parsed once, into ``built``
        (TVMScript parsing dominated the pass: SmolLM2 has 121 decode GEMVs of 5 shapes)."""
        from perfx_compiler.kernels import gemm_texture as gm
        from perfx_compiler.kernels import gemv_texture as gt

        th, lay, q = self.opts["threads"], self.layouts, self.q
        if self.sb is not None:
            from perfx_compiler.kernels import texture_superblocks as ts

            ids = str(use.rows.ty.dtype) if use.kind == "qtake" else ""
            name = f"texture_{use.pf}" + {"qtake": f"_{ids}", "qmm": "" if use.gemv else "_rows"}[use.kind]
            sp = self.sb
            if use.kind == "qtake":
                make = lambda: ts.texture_superblock_take_kernel(sp, lay, ids, th)  # noqa: E731
            else:
                make = lambda: (ts.texture_superblock_gemv_kernel if use.gemv else ts.texture_superblock_gemm_kernel)(sp, lay, th)  # noqa: E731
        elif use.kind in ("qtake", "ftake"):
            ids = str(use.rows.ty.dtype)
            name = f"texture_take_{self.fmt}_{self.n}_{self.k}_l{lay[0].layers}_{ids}"
            if q is not None:  # the format: group, symmetric, offset (as the quantized PrimFuncs' names)
                name += f"_g{q['group']}{'s' if q.get('sym') else ''}{'m' if q.get('offset') else ''}"
            make = lambda: gm.texture_take_kernel(self.fmt, self.k, lay[0], lay[1] if q else None, q, ids, th)  # noqa: E731
        elif self.fmt == "f32" and use.gemv:
            name = f"texture_gemv_{self.n}_{self.k}_l{lay[0].layers}"
            make = lambda: gt.texture_gemv_kernel(self.n, self.k, th, lay[0])  # noqa: E731
        elif self.fmt == "f32":
            name = f"texture_gemm_{self.n}_{self.k}_l{lay[0].layers}"
            make = lambda: gm.texture_gemm_kernel(self.n, self.k, lay[0], th)  # noqa: E731
        elif use.gemv:
            name = f"texture_{use.pf}"
            fn = gt.texture_q4_gemv_kernel if self.fmt == "q4" else gt.texture_q8_gemv_kernel
            make = lambda: fn(q, lay[0], lay[1], th)  # noqa: E731
        else:
            name = f"texture_{use.pf}_rows"
            fn = gm.texture_q4_gemm_kernel if self.fmt == "q4" else gm.texture_q8_gemm_kernel
            make = lambda: fn(q, lay[0], lay[1], th)  # noqa: E731
        if name not in built:
            built[name] = make()
        return name, built[name]


def _plan_groups(infos: dict[str, FuncInfo], weights: dict[str, Any], opts: dict[str, Any],
                 uses: dict[str, list[_Use]]) -> tuple[dict[str, _Group], dict[tuple[str, Any], tuple[str, _Group]], dict[str, Any]]:
    """The weight groups that become images-only: those with a decode GEMV whose every read, in
    every exported function, a texture kernel replaces. Returns the groups, the kernel of each
    replaced use (by function and anchor var) and the kernels by name."""
    from perfx_compiler.kernels.gemv_texture import TextureLimitError

    groups: dict[str, _Group] = {}
    for u in uses.get(FUNCTION, []):
        if u.gemv and u.names[0] not in groups:
            try:
                groups[u.names[0]] = _Group(u, weights, opts)
            except TextureLimitError:
                continue
    reads = {fn: _weight_reads(infos[fn], weights) for fn in uses}
    chosen: dict[tuple[str, Any], tuple[str, _Group]] = {}
    kernels: dict[str, Any] = {}
    built: dict[str, Any] = {}
    for key, g in list(groups.items()):
        mine = {fn: [u for u in us if u.names[0] in g.names] for fn, us in uses.items()}
        # every read of the group's arrays must be one of these uses, each reading the whole group
        whole = all(u.names == g.names for us in mine.values() for u in us if u.kind != "shape")
        covered = whole and all(reads[fn].get(nm, 0) == sum(nm in u.names for u in mine[fn])
                                for fn in uses for nm in g.names)
        picks: dict[tuple[str, Any], tuple[str, Any]] = {}
        try:
            for fn, us in mine.items():
                for u in us if covered else []:
                    picks[(fn, u.anchor)] = ("", None) if u.kind == "shape" else g.kernel(u, built)
        except TextureLimitError:
            covered = False
        if not covered:
            del groups[key]  # keeps its buffer form (and its buffer kernels) only
            continue
        for where, (kname, kern) in picks.items():
            if kern is not None:
                kernels[kname] = kern
            chosen[where] = (kname, g)
    return groups, chosen, kernels


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    opts = texture_options(ctx.target)
    if opts is None or FUNCTION not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod, weights
    fns = exported(mod)
    infos = {fn: FuncInfo.of(mod[fn]) for fn in fns}
    uses = {fn: _uses(mod, infos[fn], weights) for fn in fns}
    groups, chosen, kernels = _plan_groups(infos, weights, opts, uses)
    if not groups:
        return mod, weights
    # one copy: a group's buffers leave the table; its images take the place of its first array
    dropped = {nm: g for g in groups.values() for nm in g.names}
    table: dict[str, Any] = {}
    for name, arr in weights.items():
        g = dropped.get(name)
        if g is None:
            table[name] = arr
        elif name == g.names[0]:
            table.update(g.pack(weights))
    mod, table, params = replace_weight_params(mod, weights, table)

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        p = params[fn]
        plan: dict[Any, Any] = {}
        for u in uses.get(fn, []):
            if (fn, u.anchor) not in chosen:
                continue
            kname, g = chosen[(fn, u.anchor)]
            imgs = [p[i] for i in g.images]
            for v in u.skip:
                plan[v] = SKIP
            if u.kind == "shape":

                def shape(rw: Any, binding: Any, dims=_static(info.values[u.anchor].args[0])) -> None:
                    rw.remap(binding.var, rw.emit(relax.ShapeExpr(dims), binding.var))

                plan[u.anchor] = shape
                continue
            if u.kind != "fmm":

                def call(rw: Any, binding: Any, u=u, kname=kname, imgs=imgs) -> None:
                    rows = rw.arg(u.rows)
                    args = [rows, *imgs] if u.kind == "qmm" else [*imgs, rows]
                    rw.remap(binding.var, rw.emit(relax.call_tir(gvars[kname], args, binding.var.ty), binding.var))

                plan[u.anchor] = call
                continue
            lin = u.lin
            for v in lin.vars:
                plan[v] = SKIP

            def linear(rw: Any, binding: Any, lin=lin, kname=kname, imgs=imgs) -> None:
                ty = lin.matmul.ty
                y = rw.emit(relax.call_tir(gvars[kname], [rw.arg(lin.x), *imgs], relax.TensorType(ty.shape, "float32")),
                            None if lin.add is not None else lin.matmul)
                if lin.add is not None:
                    y = rw.emit(relax.op.add(y, rw.arg(lin.bias)), lin.add)
                rw.remap(lin.out, y)

            plan[u.anchor] = linear
        return plan

    # the plans were made on the functions before their parameters changed: same binding vars
    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, table


def _content(source: str) -> str:
    if source.endswith(SB_SUFFIX):
        return ("GGUF superblocks of 256 weights (formats/superblock_images.py): runs of a head texel (group values, "
                "and d | dmin where they leave a word; IQ4_XS: two superblocks a head texel), then each superblock's "
                "code planes' words")
    if source.endswith("_scale_d"):
        return "a K-quant's superblock d words (formats/gpu_factors.py's scale_d), four superblocks a texel"
    if source.endswith("_q4"):
        return "int4 code words of formats/int4.py (uint32 [N, K/8]), 4 words a texel"
    if source.endswith("_q8"):
        return "int8 codes as little-endian uint32 words (16 codes a texel)"
    if source.endswith("_q4_scale"):
        return ("per group float16 bits, (scale, min|zero) a uint32 word, texel i = groups 4i .. 4i+3; "
                "symmetric int4 (zero 8): two scales a word, texel i = groups 8i .. 8i+7")
    if source.endswith("_q8_scale"):
        return "per group scale's float16 bits, two a uint32 word; texel i = groups 8i .. 8i+7"
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
