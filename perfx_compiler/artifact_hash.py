"""Checksums of a compiled artifact, shared by the packager (writes them) and the runtime (checks
them before it loads anything). Imports only the standard library: the thin runtime uses it.

Every file of the artifact has its sha256 in ``perfx-config.json`` (``files``); the manifest
itself carries ``manifest_sha256``, the sha256 of its own canonical JSON without that key, so a
changed number in it (a KV-cache shape, a weight offset) is refused like a changed weight byte
instead of reaching the kernels.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST_DIGEST_KEY = "manifest_sha256"


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), its own digest left out."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
