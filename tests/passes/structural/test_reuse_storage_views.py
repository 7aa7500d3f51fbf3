"""ReuseStorageViews (VM lowering, after StaticPlanBlockMemory): a second ``alloc_tensor`` with the storage,
offset, shape and dtype of an earlier one is that earlier view (its uses read the first var, its
``kill_tensor`` goes); a tuple of kernel outputs that is only read back item by item goes too. The modules are
in the form StaticPlanBlockMemory leaves (kernels called directly in destination-passing style)."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.passes.reuse_storage_views import ReuseStorageViews


@I.ir_module
class Before:
    @T.prim_func(private=True)
    def add(a: T.Buffer((2, 8), "float32"), b: T.Buffer((2, 8), "float32"), c: T.Buffer((2, 8), "float32")):
        for i, j in T.grid(2, 8):
            c[i, j] = a[i, j] + b[i, j]

    @R.function
    def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = Before
        storage = R.memory.alloc_storage(R.shape([64]), 0, R.str("global"), R.dtype("float32"))
        alloc = R.memory.alloc_tensor(storage, 0, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(x, x, alloc)
        a = alloc
        storage1 = R.memory.alloc_storage(R.shape([64]), 0, R.str("global"), R.dtype("float32"))
        alloc1 = R.memory.alloc_tensor(storage1, 0, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(a, x, alloc1)
        pair = (alloc, alloc1)  # a two-output kernel's result, as CallTIRRewrite leaves it
        p = pair[0]
        q = pair[1]
        alloc2 = R.memory.alloc_tensor(storage, 0, R.shape([2, 8]), R.dtype("float32"), 0)  # alloc's view again
        cls.add(q, p, alloc2)
        _k = R.memory.kill_tensor(alloc2)
        alloc3 = R.memory.alloc_tensor(storage, 0, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(q, x, alloc3)
        return alloc3


@I.ir_module
class Expected:
    @T.prim_func(private=True)
    def add(a: T.Buffer((2, 8), "float32"), b: T.Buffer((2, 8), "float32"), c: T.Buffer((2, 8), "float32")):
        for i, j in T.grid(2, 8):
            c[i, j] = a[i, j] + b[i, j]

    @R.function
    def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = Expected
        storage = R.memory.alloc_storage(R.shape([64]), 0, R.str("global"), R.dtype("float32"))
        alloc = R.memory.alloc_tensor(storage, 0, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(x, x, alloc)
        a = alloc
        storage1 = R.memory.alloc_storage(R.shape([64]), 0, R.str("global"), R.dtype("float32"))
        alloc1 = R.memory.alloc_tensor(storage1, 0, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(a, x, alloc1)
        cls.add(alloc1, alloc, alloc)
        cls.add(alloc1, x, alloc)
        return alloc


def test_one_view_per_planned_buffer() -> None:
    tvm.ir.assert_structural_equal(ReuseStorageViews()(Before), Expected)


@I.ir_module
class Distinct:
    """Views at different offsets (or of a symbolic shape) are different memory; a tuple that is returned
    is read."""

    @T.prim_func(private=True)
    def add(a: T.Buffer((2, 8), "float32"), b: T.Buffer((2, 8), "float32"), c: T.Buffer((2, 8), "float32")):
        for i, j in T.grid(2, 8):
            c[i, j] = a[i, j] + b[i, j]

    @R.function
    def main(x: R.Tensor((2, 8), "float32"), n: R.Shape(["m"])):
        m = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = Distinct
        storage = R.memory.alloc_storage(R.shape([128]), 0, R.str("global"), R.dtype("float32"))
        alloc = R.memory.alloc_tensor(storage, 0, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(x, x, alloc)
        alloc1 = R.memory.alloc_tensor(storage, 64, R.shape([2, 8]), R.dtype("float32"), 0)
        cls.add(alloc, x, alloc1)
        v = R.memory.alloc_tensor(storage, 0, R.shape([m, 8]), R.dtype("float32"), 0)
        w = R.memory.alloc_tensor(storage, 0, R.shape([m, 8]), R.dtype("float32"), 0)
        pair = (alloc, alloc1, v, w)
        return pair


def test_distinct_views_are_left_alone() -> None:
    tvm.ir.assert_structural_equal(ReuseStorageViews()(Distinct), Distinct)
