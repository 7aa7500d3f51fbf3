"""Constants shared by the target checks."""

TOKENS = [5, 17, 42, 99, 3]
MAX_CONTEXT = 64
