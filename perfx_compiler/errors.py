"""User-facing errors: one line saying what is wrong and what to do.

The CLI prints ``PerfXError`` messages without a traceback (unless ``--debug``).
This module imports nothing heavy so the thin runtime can use it too.
"""

from __future__ import annotations


class PerfXError(Exception):
    """Base class of every error a user can cause."""


class ModelFormatError(PerfXError):
    """A model file is corrupt, truncated or not what its name says."""


class UnsupportedModelError(PerfXError):
    """An architecture, quantization type or operator PerfX does not handle."""


class UnknownTargetError(PerfXError):
    """A target name with no file in targets/."""


class ArtifactError(PerfXError):
    """A compiled artifact is incomplete, modified or from another version."""


class ContextLengthError(PerfXError):
    """A prompt (plus requested tokens) does not fit the model's context."""


class TuningLogError(PerfXError):
    """A tuning record file cannot be used."""


class KVCacheFullError(PerfXError):
    """The paged KV pool has no free pages for a request right now."""


class MissingDependencyError(PerfXError):
    """An optional package a command needs is not installed (the message names the extra)."""


class DeviceUnavailableError(PerfXError):
    """No device to measure on (no RPC server free for a key): the tuning session stops."""
