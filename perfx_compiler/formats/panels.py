"""The panel layout of float and half linear weights on CPU targets: [N, K] stored as [N / nb, K, nb], so
the GEMM (prefill) and GEMV (decode) templates read nb output columns per k step from one contiguous run
(``passes/weight_layout.py`` packs float weights, ``passes/_half_panels.py`` half ones)."""

from __future__ import annotations

import numpy as np


def pack_weight(w: np.ndarray, nb: int) -> np.ndarray:
    """[N, K] -> [N / nb, K, nb]: panel p holds rows p*nb .. p*nb+nb-1, k-major inside."""
    n, k = w.shape
    return np.ascontiguousarray(w.reshape(n // nb, nb, k).transpose(0, 2, 1))


def unpack_weight(wp: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_weight``."""
    p, k, nb = wp.shape
    return np.ascontiguousarray(wp.transpose(0, 2, 1).reshape(p * nb, k))
