"""The attention kernel re-targeted to read Q/K/V out of one merged [1, seq, q+k+v] tensor."""

from __future__ import annotations

import re
from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels.memo import memoized_kernel

_PARAM_RE = (
    r'Q: T\.Buffer\(\(T\.int64\(1\), seq, T\.int64\((\d+)\)\), "float32"\), '
    r'K: T\.Buffer\(\(T\.int64\(1\), seq, T\.int64\((\d+)\)\), "float32"\), '
    r'V: T\.Buffer\(\(T\.int64\(1\), seq, T\.int64\((\d+)\)\), "float32"\), '
)


@memoized_kernel
def attention_over_qkv(kernel: Any) -> Any | None:
    """The attention PrimFunc ``kernel(Q, K, V, caches...)`` rewritten to take one [1, seq, q+k+v]
    tensor: Q/K/V become strided views of it, so the merged projection is read in place (no
    split copies). Returns None when the kernel's signature is not the one this rewrite knows
    (the caller then splits with strided_slice instead)."""
    from typing import TypeVar

    import tvm

    src = kernel.script()
    m = re.search(_PARAM_RE, src)
    if m is None or src.count("def ") != 1:
        return None
    q, k, v = (int(g) for g in m.groups())
    width = q + k + v
    src = src.replace(m.group(0), f'QKV: T.Buffer((T.int64(1), seq, T.int64({width})), "float32"), ', 1)
    views = [
        f'    {name} = T.decl_buffer((T.int64(1), seq, T.int64({w})), "float32", data=QKV.data, '
        f"strides=(seq * T.int64({width}), T.int64({width}), T.int64(1)), elem_offset=T.int64({off}))"
        for name, w, off in (("Q", q, 0), ("K", k, q), ("V", v, q + k))
    ]
    lines = [ln for ln in src.split("\n") if not ln.startswith("#")]
    at = next((i for i, ln in enumerate(lines) if "T.func_attr" in ln), None)
    if at is None:
        return None
    lines[at + 1 : at + 1] = views
    try:
        return tvm.script.from_source("\n".join(lines), extra_vars={"T": T, "TypeVar": TypeVar})
    except Exception:  # noqa: BLE001 - an unexpected kernel shape: fall back to slicing
        return None
