"""Hand-written TIR kernels. Importing the package installs the TVMScript parse speedup
(perfx_compiler/tvmscript_speedups.py) that every kernel built here goes through."""

from perfx_compiler.tvmscript_speedups import install as _install_tvmscript_speedups

_install_tvmscript_speedups()
