"""The one way every PerfX command reports errors a user can cause.

A ``PerfXError`` becomes one line ``PROG: error: ...`` on stderr and exit code 2 (the traceback
only with ``--debug``); Ctrl-C exits 130 with an optional hint. Imports nothing heavy, so the
thin runtime's commands can use it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from perfx_compiler.errors import PerfXError


def run_command(prog: str, body: Callable[[], int], *, debug: bool = False, interrupted: str = "interrupted") -> int:
    try:
        return body()
    except PerfXError as err:
        if debug:
            traceback.print_exc()
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
