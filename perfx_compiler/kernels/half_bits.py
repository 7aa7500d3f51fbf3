"""float16 bits to float32 by integer operations, for kernels on devices without a float16 type
(OpenCL without cl_khr_fp16, such as PoCL; WGSL): the GPU superblock factors
(``formats/gpu_factors.py``) and the Adreno scale images (``kernels/gemv_texture.py``) keep float16
values as their bits in uint32 words."""

from __future__ import annotations

from typing import Any


def te_half(h: Any) -> Any:
    """(TE / TIR) float32 of the float16 bits in the low half of a uint32 expression, by integer operations
    (no float16 type needed). Finite values only: the loader rejects inf / NaN factors."""
    from tvm import tirx

    def u(v: int) -> Any:
        return tirx.const(v, "uint32")

    e = (h >> u(10)) & u(31)
    m = h & u(0x3FF)
    sign = (h & u(0x8000)) << u(16)
    normal = tirx.reinterpret("float32", sign | ((e + u(112)) << u(23)) | (m << u(13)))
    tiny = m.astype("float32") * tirx.const(2.0**-24, "float32")  # zero and subnormals
    tiny = tirx.Select((h & u(0x8000)) != u(0), -tiny, tiny)
    return tirx.Select(e == u(0), tiny, normal)
