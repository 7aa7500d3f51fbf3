"""Committed tuning records, one folder per target (``<target>/*.jsonl``).

A package only so that ``pip install .`` ships the records next to ``perfx_compiler``:
``perfx_compiler.tune.records.DEFAULT_LOG_ROOT`` is this folder in the repository and in an install.
"""
