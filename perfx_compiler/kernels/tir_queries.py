"""Questions asked of a PrimFunc by several layers (schedule templates, GPU lowering, the build, the
target launchers): kept here, below all of them."""

from __future__ import annotations

from typing import Any

OPAQUE = 8  # relax OpPatternKind.kOpaque as a PrimFunc's "op_pattern": FuseOps leaves such a call_tir alone


def buffer_type(param: Any) -> Any:
    """The BufferType of a buffer parameter (TVM 0.27 PrimFuncs take buffers as typed Vars), else None."""
    from tvm.tirx.buffer import BufferType

    ty = getattr(param, "ty", None)
    return ty if isinstance(ty, BufferType) else None


def has_texture_params(func: Any) -> bool:
    """Whether a PrimFunc takes a buffer in scope ``global.texture`` (an OpenCL image)."""
    return any("texture" in str(getattr(buffer_type(p), "storage_scope", "")) for p in func.params)


def has_device_launch(func: Any) -> bool:
    """True when ``func`` binds a GPU thread (thread-bound loop or a thread_extent attribute)."""
    import tvm_ffi
    from tvm import tirx

    found = False

    def visit_attr(node: Any) -> None:
        nonlocal found
        if node.attr_key == "thread_extent":
            found = True

    def visit_for(node: Any) -> None:
        nonlocal found
        if node.kind == tirx.ForKind.THREAD_BINDING:
            found = True

    tvm_ffi.structural_walk(func.body, [(tirx.AttrStmt, visit_attr), (tirx.For, visit_for)], order="post")
    return found
