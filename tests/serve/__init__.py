"""Serving tests (a package, so this conftest does not shadow tests/runtime/conftest.py as `conftest`)."""
