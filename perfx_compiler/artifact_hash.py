"""Checksums of a compiled artifact, shared by the packager (writes them) and the runtime (checks
them before it loads anything), and the digest of the compiler's own files (``compiler_digest``: what
``LLM()``'s artifact cache and the kernel cache of ``kernels/memo.py`` are keyed by). Imports only the
standard library: the thin runtime uses it.

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


def compiler_digest(root: Path | None = None) -> str:
    """Digest of the compiler's own files (package sources and native code, schedule templates, target
    files, tuning records), wherever the package is installed: a cached artifact is rebuilt when the code
    or the records that compiled it have changed. ``root``: the folder holding them (default: this install's)."""
    root = root or Path(__file__).resolve().parent.parent  # (this file is perfx_compiler/artifact_hash.py)
    digest = hashlib.sha1()
    for folder, patterns in (("perfx_compiler", ("*.py", "*.c", "*.cc", "*.h")), ("schedules", ("*.py",)),
                             ("targets", ("*",)), ("tuning_logs", ("*",))):
        files = {f for pattern in patterns for f in (root / folder).rglob(pattern)}
        for f in sorted(files):
            if f.is_file() and "__pycache__" not in f.parts:
                digest.update(f.relative_to(root).as_posix().encode())
                digest.update(f.read_bytes())
    return digest.hexdigest()[:12]
