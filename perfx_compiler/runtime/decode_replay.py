"""A CPU decode step replayed without the VM: the step's kernel calls, recorded once, run from C++.

A decode step of a CPU artifact is a fixed list of kernel calls on fixed buffers: one token at a
time, a KV cache of fixed size updated in place, every intermediate tensor the same shape at every
position, and the position itself read from a tensor (``Engine._pos_dev``) the engine writes before
each step. The VM still interprets ~130 builtins per step (argument checks, storage and tensor
allocation) and calls the kernels (116 for TinyLlama) one by one. Here one step is run through the VM with its
instrumentation hook to record the kernel calls and their arguments (the VM's own tensors, kept
alive by the record); later steps call the same kernels on the same tensors from a small C++ loop,
and read the logits from the tensor the recorded lm_head call writes.

The record is used only when it is safe:
* the step's builtins are all bookkeeping (``SAFE_BUILTINS``); anything else keeps the VM;
* the logits tensor the VM returned is the output argument of a recorded call;
* the same step (token, position) run again by the replay gives the VM's logits bit for bit
  (re-running a step rewrites the same KV row with the same values).
The loop is a small C++ library built once per machine (``tvm_ffi.cpp.build_inline``) into
``~/.cache/perfx/native`` ($XDG_CACHE_HOME respected) under a name keyed by its source, the C++
compiler and the tvm_ffi version. ``perfx-compile`` builds it for a host CPU artifact and the engine
at load, so no decode step waits for a compiler; once the file exists it is loaded as is, ninja never
runs again (ninja rebuilt the object whenever a header's mtime moved, e.g. after a reinstall of
apache-tvm-ffi, inside a timed decode step). Without a C++ compiler the VM runs every step.
``PERFX_DECODE_REPLAY=0`` keeps the VM (A/B runs).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# VM builtins a decode step may make that the replay can skip: checks and the allocation of
# tensors the record already holds. Anything else (a copy, a KV-cache builtin) keeps the VM.
SAFE_BUILTINS = frozenset({
    "vm.builtin.check_tensor_info", "vm.builtin.match_shape", "vm.builtin.null_value",
    "vm.builtin.alloc_storage", "vm.builtin.alloc_tensor", "vm.builtin.make_tuple",
    "vm.builtin.check_shape_info", "vm.builtin.check_tuple_info", "vm.builtin.make_shape",
    "vm.builtin.reshape", "vm.builtin.tuple_getitem",
})

# calls[i] = [kernel, args...], unpacked once into functions and argument views. Shared with
# perfx_compiler/bench/replay.py (benchmarks/ab.py --level step), whose timing loops run the same unpacked list.
CALLS_CC = r"""
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>

#include <vector>

using namespace tvm::ffi;

struct Calls {
  std::vector<Function> fns;
  std::vector<std::vector<AnyView>> args;
  std::vector<Array<Any>> keep;  // owns the Any values the AnyViews point into
  explicit Calls(const Array<Array<Any>>& calls) {
    for (const Array<Any>& call : calls) keep.push_back(call);
    for (const Array<Any>& call : keep) {
      fns.push_back(call[0].cast<Function>());
      args.emplace_back();
      for (size_t j = 1; j < call.size(); ++j) args.back().push_back(AnyView(call[j]));
    }
  }
  size_t size() const { return fns.size(); }
  void run(size_t i, Any* rv) const {
    fns[i].CallPacked(args[i].data(), static_cast<int32_t>(args[i].size()), rv);
  }
};
"""

_STEP_CC = CALLS_CC + r"""
#include <algorithm>
#include <memory>

// A function that runs the whole list once, in order.
Function build(Array<Array<Any>> calls) {
  auto step = std::make_shared<Calls>(calls);
  return Function::FromTyped([step]() {
    Any rv;
    for (size_t i = 0; i < step->size(); ++i) step->run(i, &rv);
  });
}

// Greedy decoding without Python between steps: per step the token and its position are stored where
// the recorded calls read them (int32 or int64 scalars at the given addresses), the list runs, and the
// first index of the largest float32 logit (numpy's argmax, a NaN included) is the next token. Up to
// `n` steps; stops after a token listed in `stop`. Returns the tokens.
template <typename T>
static void store(int64_t addr, int64_t v) { *reinterpret_cast<T*>(addr) = static_cast<T>(v); }

Function build_greedy(Array<Array<Any>> calls) {
  auto step = std::make_shared<Calls>(calls);
  return Function::FromTyped([step](int64_t token_addr, bool token_wide, int64_t pos_addr, bool pos_wide,
                                    int64_t logits_addr, int64_t vocab, int64_t token, int64_t position,
                                    int64_t n, Array<int64_t> stop) {
    const float* logits = reinterpret_cast<const float*>(logits_addr);
    std::vector<int64_t> stops(stop.begin(), stop.end());
    Array<int64_t> out;
    Any rv;
    for (int64_t s = 0; s < n; ++s) {
      token_wide ? store<int64_t>(token_addr, token) : store<int32_t>(token_addr, token);
      pos_wide ? store<int64_t>(pos_addr, position + s) : store<int32_t>(pos_addr, position + s);
      for (size_t i = 0; i < step->size(); ++i) step->run(i, &rv);
      int64_t best = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        if (logits[v] != logits[v]) { best = v; break; }  // NaN: numpy's argmax returns the first
        if (logits[v] > logits[best]) best = v;
      }
      out.push_back(best);
      token = best;
      if (std::find(stops.begin(), stops.end(), best) != stops.end()) break;
    }
    return out;
  });
}
"""


_NAME = "perfx_decode_replay_step"
_FUNCTIONS = ["build", "build_greedy"]
_CFLAGS = ["-O2"]


def cache_dir() -> Path:
    """Where the built loop lives: $XDG_CACHE_HOME/perfx/native, else ~/.cache/perfx/native."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "perfx" / "native"


def _compiler_id() -> str:
    """The C++ compiler tvm_ffi's ninja file calls ($CXX, else c++) and its version line: a new
    compiler gets a new library, an unchanged one keeps the old."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or cxx
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(path)}\n{version.splitlines()[0] if version else ''}"


def library_path() -> Path:
    """The built loop's file: named by a hash of everything that decides its bytes (the source, the
    exported names, the flags, the compiler, tvm_ffi's version: its headers and ABI)."""
    import tvm_ffi

    key = "\0".join([_STEP_CC, *_FUNCTIONS, *_CFLAGS, _compiler_id(), str(tvm_ffi.__version__)])
    return cache_dir() / f"{_NAME}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build_library() -> Path:
    """The loop's library, built now if this machine has none yet (seconds; raises where it cannot be
    built). Built in a private folder and renamed into place, so concurrent builders never see half a
    file; an existing library is never rebuilt."""
    out = library_path()
    if out.is_file():
        return out
    import tvm_ffi.cpp

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{_NAME}-", dir=out.parent)
    try:
        built = tvm_ffi.cpp.build_inline(_NAME, cpp_sources=_STEP_CC, functions=_FUNCTIONS, extra_cflags=_CFLAGS,
                                         build_directory=tmp)
        os.replace(built, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prebuild() -> Path | None:
    """Build the loop ahead of any run (``perfx-compile``, engine load); None where it cannot be."""
    try:
        return build_library()
    except Exception as err:  # noqa: BLE001 - a missing or broken C++ toolchain
        log.warning("decode replay unavailable (%s: %s): decode runs through the VM",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None


@functools.cache
def _module() -> Any:
    """The C++ loops (``build(calls)``, ``build_greedy(calls)``), loaded once per process from the
    library ``build_library`` made; None where they cannot be built (no C++ compiler). A library that
    does not load (a damaged cache file) is built anew once."""
    import tvm_ffi

    for attempt in range(2):
        path = prebuild()
        if path is None:
            return None
        try:
            return tvm_ffi.load_module(str(path))
        except Exception as err:  # noqa: BLE001 - a truncated or foreign file in the cache
            log.warning("decode replay library %s does not load (%s)%s", path, str(err).splitlines()[0] if str(err)
                        else type(err).__name__, "; rebuilding it" if attempt == 0 else ": decode runs through the VM")
            path.unlink(missing_ok=True)
    return None


def enabled() -> bool:
    return os.environ.get("PERFX_DECODE_REPLAY", "1") != "0"


@dataclass
class DecodeReplay:
    """The recorded decode step of one engine: ``run()`` makes one step, ``logits`` is a numpy view
    of the [vocab] row it writes (rewritten by the next step); ``greedy`` runs many steps (see
    ``build_greedy`` in the C++ source; called through ``Engine.decode_greedy``)."""

    run: Callable[[], None]
    logits: np.ndarray
    kernels: int
    greedy: Callable[..., Any] | None = None


@dataclass
class Trace:
    """One call of a VM function as its hook saw it: the kernel calls ``[function, args...]`` in order,
    their symbols, and the names of the VM builtins it made."""

    result: Any
    calls: list[list[Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    builtins: list[str] = field(default_factory=list)


def trace(vm: Any, step: Callable[[], Any]) -> Trace:
    """Run ``step()`` (a call of ``vm``'s functions) with the VM's instrument hook recording it."""
    out = Trace(None)

    def hook(func: Any, sym: Any, before: bool, ret: Any, *args: Any) -> int:
        if before:
            name = str(sym)
            if name.startswith("vm.builtin."):
                out.builtins.append(name)
            else:
                out.calls.append([func, *args])
                out.names.append(name)
        return 0

    vm.set_instrument(hook)
    try:
        out.result = step()
    finally:
        vm.set_instrument(None)
    return out


def record(vm: Any, step: Callable[[], Any]) -> tuple[Any, DecodeReplay | str]:
    """Run ``step()`` (one VM decode, returning its logits tensor) traced; returns (that step's logits
    tensor, the replay of its kernel calls or why there is none)."""
    tr = trace(vm, step)
    logits = tr.result
    unsafe = sorted(set(tr.builtins) - SAFE_BUILTINS)
    if unsafe:
        return logits, f"the step calls {', '.join(unsafe)}"
    out_ptr = logits.data_ptr()
    if not any(callable(getattr(c[-1], "data_ptr", None)) and c[-1].data_ptr() == out_ptr for c in tr.calls):
        return logits, "the logits are not written by a recorded kernel"
    mod = _module()
    if mod is None:
        return logits, "no C++ compiler for the replay loop"
    row = np.from_dlpack(logits)[0, 0]
    greedy = mod.build_greedy(tr.calls) if row.dtype == np.float32 and row.flags.c_contiguous else None
    return logits, DecodeReplay(mod.build(tr.calls), row, len(tr.calls), greedy)
