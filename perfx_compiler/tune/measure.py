"""Build and time schedule candidates on the local CPU.

Builds run in a process pool (each candidate: apply template -> tvm.compile -> export .so) with a
timeout, so a pathological configuration cannot hang or crash the tuner. Timing runs in this
process, one candidate at a time, with ``time_evaluator``. Every candidate is checked against the
unscheduled function (TVM's default lowering is the reference semantics) on random inputs at a
small M, including an M tail, before it is timed. Decode GEMVs are timed with cold caches and
physically impossible times are recorded as errors (``tune/traffic.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfx_compiler.targets import TargetDescription
from perfx_compiler.tune.traffic import KernelTraffic, implausible, kernel_traffic

log = logging.getLogger(__name__)
VERIFY_M = 7  # odd on purpose: exercises the M tail of every tiled schedule


@dataclass
class MeasureResult:
    config: dict[str, Any]
    mean_s: float = float("inf")
    std_s: float = 0.0
    error: str | None = None  # build / verify / run failure; such candidates are recorded too
    build_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


# ----------------------------------------------------------------------------- concrete inputs


def _shape(ty: Any, m_value: int) -> tuple[int, ...]:
    """Concrete shape with every shape var set to m_value (dims may be expressions of it)."""
    dims = []
    for dim in ty.shape:
        value = getattr(dim, "value", None)
        dims.append(int(value) if isinstance(value, int) else _eval_dim(dim, m_value))
    return tuple(dims)


def _eval_dim(dim: Any, m_value: int) -> int:
    import tvm_ffi
    from tvm import sym, tirx

    free: list[Any] = []
    tvm_ffi.structural_walk(dim, (tirx.Var, free.append))
    analyzer = sym.Analyzer()
    for var in free:
        analyzer.bind(var, tirx.const(int(m_value), str(var.ty)), allow_override=True)
    value = getattr(analyzer.simplify(dim), "value", None)
    if not isinstance(value, int):
        raise ValueError(f"cannot evaluate shape dim {dim} at {m_value}")
    return int(value)


def param_specs(func: Any, m_value: int) -> list[tuple[str, tuple[int, ...] | None, str]]:
    """(name, concrete shape, dtype) of every parameter, symbolic dims set to m_value; scalar
    parameters (a shape var passed explicitly, e.g. ``seq``) have shape None."""
    specs = []
    for p in func.params:
        shape = getattr(p.ty, "shape", None)
        specs.append((str(p.name), None if shape is None else _shape(p.ty, m_value), str(p.ty.dtype)))
    return specs


def output_names(func: Any) -> set[str]:
    """Parameters some block writes: the function's outputs."""
    from tvm import s_tir

    params = {str(p.name) for p in func.params}
    try:
        sch = s_tir.Schedule(func)
        sch.get_sblock("root")
    except Exception:  # noqa: BLE001 - a loop-only kernel (no blocks): its last parameter is the output
        return {str(func.params[-1].name)}
    written: set[str] = set()

    def visit(block: Any) -> None:
        for child in sch.get_child_blocks(block):
            for region in sch.get(child).writes:
                src = getattr(region, "source", None)
                if src is None:
                    src = getattr(region, "buffer", None)
                written.add(str(getattr(src, "name", src)))
            visit(child)

    visit(sch.get_sblock("root"))
    outs = written & params
    return outs or {str(func.params[-1].name)}


PINNED_ATTR = "perfx.tune_inputs"  # JSON {param or buffer name: value} a kernel is measured at


def pinned_inputs(func: Any) -> dict[str, int]:
    """Integer inputs a kernel asks to be measured at (e.g. the decode attention's cache length:
    timed on a 10-token cache, its split count would tune nothing), by parameter name."""
    import json


    pins: dict[str, int] = {}
    attrs = func.attrs
    if attrs is not None and PINNED_ATTR in attrs:
        pins.update(json.loads(str(attrs[PINNED_ATTR])))
    return {str(p.name): int(pins[str(p.name)]) for p in func.params if str(p.name) in pins}


def random_inputs(func: Any, m_value: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    outs = output_names(func)
    pinned = pinned_inputs(func)
    arrays = []
    for name, shape, dtype in param_specs(func, m_value):
        if shape is None:
            arrays.append(np.dtype(dtype).type(m_value))  # scalar shape var: a numpy scalar, not a 0-d tensor
        elif name in outs:
            arrays.append(np.zeros(shape, dtype=dtype))
        elif name in pinned:
            arrays.append(np.full(shape, pinned[name], dtype=dtype))
        elif dtype.startswith(("int", "uint")):  # valid gather indices, drawn in the input's own type
            arrays.append(rng.integers(0, 16, size=shape, dtype=dtype))  # (int64 first: 8x a GB-sized input)
        else:
            arrays.append(rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False))
    return arrays


# ----------------------------------------------------------------------------- threads


def configure_threads(cores: int) -> int:
    """Size TVM's CPU thread pool to the target's cores; returns the pool size in effect.

    Without TVM_NUM_THREADS the pool takes hardware_concurrency / 2 (it assumes SMT), which is ONE
    thread on a 2-vCPU machine: every parallel loop then runs serially (prefill GEMM ~2x slower).
    The pool is created on first use, so this must run before any kernel does.
    """
    import tvm  # noqa: F401 - loads the runtime that registers runtime.NumThreads
    import tvm_ffi

    os.environ.setdefault("TVM_NUM_THREADS", str(max(1, cores)))
    threads = int(tvm_ffi.get_global_func("runtime.NumThreads")())
    if threads != cores:
        log.warning("TVM thread pool has %d threads, target has %d cores (TVM_NUM_THREADS=%s)",
                    threads, cores, os.environ.get("TVM_NUM_THREADS"))
    return threads


# ----------------------------------------------------------------------------- building


def build_func(func: Any, target: TargetDescription) -> Any:
    """Compile one PrimFunc to a runnable module (``main``)."""
    from perfx_compiler.stack_alloca import compile_kernel

    return compile_kernel(func, target).jit()


def run_func(rt: Any, func: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
    import tvm

    dev = tvm.cpu()
    tensors = [_to_arg(a, dev) for a in arrays]
    rt["main"](*tensors)
    outs = output_names(func)
    return [t.numpy() for p, t in zip(func.params, tensors, strict=True) if str(p.name) in outs]


def _to_arg(array: np.ndarray | np.generic, dev: Any) -> Any:
    """A scalar parameter (numpy scalar) goes by value; arrays, 0-d ones included, as tensors."""
    import tvm

    return array.item() if not isinstance(array, np.ndarray) else tvm.runtime.tensor(array, dev)


def max_rel_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    err = 0.0
    for g, w in zip(got, want, strict=True):
        scale = max(1.0, float(np.abs(w).max()) if w.size else 1.0)
        err = max(err, float(np.abs(g.astype(np.float64) - w).max()) / scale if w.size else 0.0)
    return err


FLUSH_PREPROC = "perfx.tune.flush_but_first"


def _register_flush() -> str:
    """time_evaluator's preproc for cold timing: TVM's ``cache_flush_cpu_non_first_arg`` (clflush
    of every buffer) over the tensor arguments after the first; the builtin alone casts every
    argument to a tensor and throws on a scalar one (a shape var passed explicitly)."""
    import tvm
    import tvm_ffi

    if tvm_ffi.get_global_func(FLUSH_PREPROC, allow_missing=True) is None:
        builtin = tvm_ffi.get_global_func("cache_flush_cpu_non_first_arg")

        def flush(*args: Any) -> None:
            builtin(args[0], *(a for a in args[1:] if isinstance(a, tvm.runtime.Tensor)))

        tvm_ffi.register_global_func(FLUSH_PREPROC, flush)
    return FLUSH_PREPROC


def time_module(
    rt: Any, func: Any, m_value: int, number: int = 0, repeat: int = 5, min_ms: int = 20, cold: bool = False
) -> tuple[float, float]:
    """(fastest single call, std of the calls) in seconds at M = m_value.

    Single calls, not means over batches of calls: on a shared 2-core machine a mean includes
    preemptions, and those hit a 2-thread kernel (the whole call waits for its slower thread)
    far more than a 1-thread one, so min-of-means systematically picked serial schedules. The
    number of calls is ``repeat`` rounds of about ``min_ms`` each (at least ``repeat``, at most 400).
    ``number`` > 1 keeps the old batched statistic for callers that ask for it.

    ``cold`` (decode GEMVs, see ``tune/traffic.py``): before every call, every tensor argument but
    the first (x) is flushed from the caches, so the weights come from DRAM as they do in the model.
    The flush is time_evaluator's ``f_preproc``, which runs outside the timed region (TVM's
    WrapTimeEvaluator starts its timer after it); it costs ~1.2 ms per 30 MB (the lm-head
    weight), ~20 us for a 0.2 MB one, so a cold candidate adds at most ~0.5 s of wall time.
    Rotating copies of the weights would evict just as well but need more than the LLC in copies
    per workload and a Python loop per call (microseconds of dispatch on a 3 us kernel)."""
    import tvm

    dev = tvm.cpu()
    tensors = [_to_arg(a, dev) for a in random_inputs(func, m_value, seed=1)]
    if number > 1:  # batched means: a flush per repeat would only reach the first call of each
        res = rt.time_evaluator("main", dev, number=number, repeat=repeat, min_repeat_ms=min_ms)(*tensors)
        samples = np.asarray(res.results, dtype=np.float64)
        return float(samples.min()), float(samples.std())
    first = float(time_calls(rt, tensors, 2, cold).min())
    calls = int(min(400, max(repeat, repeat * min_ms * 1e-3 / max(first, 1e-7))))
    samples = time_calls(rt, tensors, calls, cold)
    # min is robust to the other tenants of a shared machine; std shows the noise.
    return float(samples.min()), float(samples.std())


def time_calls(rt: Any, tensors: list[Any], calls: int, cold: bool) -> np.ndarray:
    """Seconds of ``calls`` single calls of ``main`` on ``tensors`` (cold: see ``time_module``)."""
    import tvm

    preproc = _register_flush() if cold else ""
    res = rt.time_evaluator("main", tvm.cpu(), number=1, repeat=int(calls), f_preproc=preproc)(*tensors)
    return np.asarray(res.results, dtype=np.float64)


# ----------------------------------------------------------------------------- worker side


def _worker_build(payload: dict[str, Any]) -> dict[str, Any]:
    """Runs in a pool process: schedule with the template, compile, export to a .so file."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])  # the repo root holds the schedules package
    if root not in sys.path:
        sys.path.insert(0, root)
    import tvm

    from perfx_compiler.schedule_template import template_by_name
    from perfx_compiler.stack_alloca import compile_kernel
    from perfx_compiler.targets import TargetDescription as TD

    start = time.perf_counter()
    func = tvm.ir.load_json(payload["func"])
    target = TD(**payload["target"])
    template = template_by_name(payload["template"])
    workload = template.match(func, target)
    if workload is None:
        return {"error": "template no longer matches"}
    try:
        scheduled = template.apply(func, workload, payload["config"], target)
        ex = compile_kernel(scheduled, target)
        if target.cross_compiler:  # a cross target (measured over RPC): link with its cross compiler
            from tvm.support import cc

            ex.export_library(payload["path"], fcompile=cc.cross_compiler(target.cross_compiler))
        else:
            ex.export_library(payload["path"])
    except Exception as err:  # noqa: BLE001 - any failure makes the candidate invalid, not the tuner
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}"}
    return {"error": None, "build_s": time.perf_counter() - start, "script": None}


def _target_payload(target: TargetDescription) -> dict[str, Any]:
    fields = TargetDescription.__dataclass_fields__
    return {k: getattr(target, k) for k in fields if k != "raw"}


class LocalMeasurer:
    """Build candidates in a process pool, then verify and time them here, one at a time."""

    def __init__(
        self,
        target: TargetDescription,
        workers: int | None = None,
        build_timeout_s: float = 120.0,
        repeat: int = 5,
        min_repeat_ms: int = 20,
        tolerance: float = 1e-4,
    ) -> None:
        self.target = target
        self.workers = workers or max(1, min(2, os.cpu_count() or 1))
        self.build_timeout_s = build_timeout_s
        self.repeat = repeat
        self.min_repeat_ms = min_repeat_ms
        self.tolerance = tolerance
        self._refs: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._traffics: dict[str, KernelTraffic | None] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="perfx-measure-")
        self._executor: cf.ProcessPoolExecutor | None = None
        # Verified builds kept for the confirmation stage (time_rounds): (workload, config) -> .so
        self._built: dict[tuple[str, str], str] = {}
        self.round_ms = 10.0  # time_rounds: calls per candidate and round last about this long
        self.threads = configure_threads(target.cores or os.cpu_count() or 1)

    # ------------------------------------------------------------------ build pool

    def _pool(self) -> cf.ProcessPoolExecutor:
        if self._executor is None:
            ctx = multiprocessing.get_context("spawn")  # TVM state must not be forked
            self._executor = cf.ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
        return self._executor

    def close(self) -> None:
        """Stop the build workers (they are ours: terminate them if a build hangs)."""
        pool, self._executor = self._executor, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)

    def __enter__(self) -> LocalMeasurer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build_all(
        self, base: dict[str, Any], configs: list[dict[str, Any]], paths: list[str], results: list[MeasureResult]
    ) -> None:
        """Build every candidate; a build that exceeds its time kills the pool (not the tuner),
        and candidates that had not started yet are resubmitted to a fresh pool."""
        pending = list(range(len(configs)))
        while pending:
            pool = self._pool()
            futures = {pool.submit(_worker_build, {**base, "config": configs[i], "path": paths[i]}): i for i in pending}
            pending = []
            waiting = set(futures)
            try:
                # A build that hangs is noticed build_timeout_s after the last build finished,
                # not after the whole batch's worth of timeouts.
                while waiting:
                    done, waiting = cf.wait(waiting, timeout=self.build_timeout_s, return_when=cf.FIRST_COMPLETED)
                    if not done:
                        raise cf.TimeoutError
                    for fut in done:
                        self._collect(fut, results[futures[fut]])
            except cf.TimeoutError:
                stalled = []
                for fut, i in futures.items():
                    if fut.done():
                        self._collect(fut, results[i])
                    elif fut.running():
                        results[i].error = f"build timed out after {self.build_timeout_s:g} s"
                    else:
                        stalled.append(i)
                progressed = len(stalled) < len(futures)
                for i in stalled:
                    if progressed:
                        pending.append(i)  # never started: retry on a fresh pool
                    else:
                        results[i].error = f"build did not start within {self.build_timeout_s:g} s"
                self.close()

    @staticmethod
    def _collect(fut: cf.Future, res: MeasureResult) -> None:
        if res.extra.get("collected"):
            return
        res.extra["collected"] = True
        try:
            out = fut.result(timeout=0)
        except Exception as err:  # noqa: BLE001 - a crashed worker fails only its candidate
            res.error = f"build crashed: {type(err).__name__}"
            return
        res.error = out.get("error")
        res.build_s = float(out.get("build_s", 0.0))

    def _reference(self, key: str, func: Any, m_verify: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if key not in self._refs:
            inputs = random_inputs(func, m_verify, seed=0)
            want = run_func(build_func(func, self.target), func, [a.copy() for a in inputs])
            self._refs[key] = (inputs, want)
        return self._refs[key]

    def _traffic(self, func: Any, template_name: str, workload_key: str, m_value: int) -> KernelTraffic | None:
        """Bytes / flops of the workload (cold timing and the plausibility guard), per workload and M."""
        key = f"{workload_key}@{m_value}"
        if key not in self._traffics:
            from perfx_compiler.schedule_template import template_by_name

            try:
                workload = template_by_name(template_name).match(func, self.target)
            except Exception as err:  # noqa: BLE001 - unknown template (a test's fake): no guard, warm timing
                log.debug("no workload for %s: %s", template_name, err)
                workload = None
            self._traffics[key] = None if workload is None else kernel_traffic(func, workload, m_value)
        return self._traffics[key]

    def _prepare(
        self, func: Any, template_name: str, workload_key: str, configs: list[dict[str, Any]], m_verify: int
    ) -> tuple[list[MeasureResult], list[Any]]:
        """Build (or reuse a kept build of) every config and check it against the reference;
        returns the results (errors set) and the loaded modules (None where a candidate failed).
        Verified builds are kept until ``forget``, so confirming a search's winners rebuilds nothing."""
        import tvm

        from perfx_compiler.tune.records import config_key

        results = [MeasureResult(config=c) for c in configs]
        keys = [(workload_key, config_key(c)) for c in configs]
        paths = [self._built.get(k) for k in keys]
        kept = {i for i, p in enumerate(paths) if p is not None and os.path.exists(p)}
        todo = [i for i in range(len(configs)) if i not in kept]
        if todo:
            fresh = [os.path.join(self._tmp.name, f"c{time.time_ns()}_{i}.so") for i in todo]
            base = {"func": tvm.ir.save_json(func), "target": _target_payload(self.target), "template": template_name}
            sub = [results[i] for i in todo]
            self._build_all(base, [configs[i] for i in todo], fresh, sub)
            for i, path in zip(todo, fresh, strict=True):
                paths[i] = path
        inputs, want = self._reference(workload_key, func, m_verify)
        modules: list[Any] = [None] * len(configs)
        for i, (res, path) in enumerate(zip(results, paths, strict=True)):
            try:
                if not res.ok:
                    continue
                rt = tvm.runtime.load_module(path)
                if i not in kept:
                    err = max_rel_error(run_func(rt, func, [a.copy() for a in inputs]), want)
                    res.extra["max_rel_error"] = err
                    if not err <= self.tolerance:
                        res.error = f"wrong result: max relative error {err:.2e}"
                        continue
                modules[i] = rt
                self._built[keys[i]] = str(path)
            except Exception as err:  # noqa: BLE001
                res.error = f"run failed: {type(err).__name__}: {str(err)[:200]}"
            finally:
                if modules[i] is None:
                    self._built.pop(keys[i], None)
                    _remove(path)
        return results, modules

    def forget(self, workload_key: str) -> None:
        """Delete the builds kept for ``workload_key`` (its confirmation is done)."""
        for key in [k for k in self._built if k[0] == workload_key]:
            _remove(self._built.pop(key))

    def measure(
        self,
        func: Any,
        template_name: str,
        workload_key: str,
        configs: list[dict[str, Any]],
        m_value: int,
        m_verify: int | None = None,
    ) -> list[MeasureResult]:
        m_verify = m_verify if m_verify is not None else min(m_value, VERIFY_M) if m_value else VERIFY_M
        results, modules = self._prepare(func, template_name, workload_key, configs, m_verify)
        traffic = self._traffic(func, template_name, workload_key, m_value)
        cold = traffic is not None and traffic.cold
        for res, rt in zip(results, modules, strict=True):
            if rt is None:
                continue
            try:
                res.mean_s, res.std_s = time_module(rt, func, m_value, repeat=self.repeat, min_ms=self.min_repeat_ms,
                                                    cold=cold)
                res.extra["cold_cache"] = cold
                why = implausible(res.mean_s, traffic, self.target, cold)
                if why is not None:  # a measurement error: recorded as such, never a best config
                    log.warning("%s %s: %s", template_name, res.config, why)
                    res.extra["implausible_s"] = res.mean_s
                    res.error, res.mean_s, res.std_s = why, float("inf"), 0.0
            except Exception as err:  # noqa: BLE001
                res.error = f"run failed: {type(err).__name__}: {str(err)[:200]}"
        return results

    def time_rounds(
        self,
        func: Any,
        template_name: str,
        workload_key: str,
        configs: list[dict[str, Any]],
        m_value: int,
        rounds: int,
    ) -> list[MeasureResult]:
        """Re-time ``configs`` in alternation (the confirmation stage, tune/confirm.py): ``rounds``
        rounds, each timing every candidate once for about ``round_ms`` of calls, in an order that
        rotates per round, so load changes hit every candidate alike. A round's value is the
        median of its calls (a preemption is one slow call, not the round's value); the result's
        ``mean_s`` is the median over rounds, ``extra["rounds"]`` the per-round values. Same cold /
        warm mode and plausibility guard as ``measure``."""
        import tvm

        m_verify = min(m_value, VERIFY_M) if m_value else VERIFY_M
        results, modules = self._prepare(func, template_name, workload_key, configs, m_verify)
        traffic = self._traffic(func, template_name, workload_key, m_value)
        cold = traffic is not None and traffic.cold
        tensors = [_to_arg(a, tvm.cpu()) for a in random_inputs(func, m_value, seed=1)]
        live = [i for i, rt in enumerate(modules) if rt is not None]
        calls: dict[int, int] = {}
        per_round: dict[int, list[float]] = {i: [] for i in live}
        for r in range(-1, rounds):  # round -1 sizes the call counts
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for i in order:
                if results[i].error is not None:
                    continue
                try:
                    if r < 0:
                        first = float(time_calls(modules[i], tensors, 2, cold).min())
                        calls[i] = int(min(200, max(3, self.round_ms * 1e-3 / max(first, 1e-7))))
                        continue
                    per_round[i].append(float(np.median(time_calls(modules[i], tensors, calls[i], cold))))
                except Exception as err:  # noqa: BLE001
                    results[i].error = f"run failed: {type(err).__name__}: {str(err)[:200]}"
        for i in live:
            res = results[i]
            if res.error is not None or not per_round[i]:
                continue
            res.mean_s = float(np.median(per_round[i]))
            res.std_s = float(np.std(per_round[i]))
            res.extra.update(rounds=per_round[i], cold_cache=cold)
            why = implausible(res.mean_s, traffic, self.target, cold)
            if why is not None:
                res.error, res.mean_s = why, float("inf")
        return results


def _remove(path: str | None) -> None:
    if path is None:
        return
    try:
        os.remove(path)
    except OSError:
        pass
