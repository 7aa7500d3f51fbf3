"""Measure schedule candidates on remote devices through TVM's RPC (a tracker and device servers).

Candidates are built here exactly as ``LocalMeasurer`` builds them (process pool, timeout, a .so
cross-linked for the target), then each is uploaded to a free server of the key, checked there
against the unscheduled function run on the same server, and timed there with ``time_evaluator``.
``parallel`` slots each hold one session (one server); a batch's candidates are spread over them.

Faults cost only the candidates involved: a session that errors or drops (server killed) has its
candidate retried once on another slot; one that does not answer within ``run_timeout_s`` (a hung
server) is abandoned, its thread left to die with the socket; a candidate lost twice is recorded as
failed with the reason. No session obtainable within ``request_timeout_s`` while no other slot holds
one stops the run with ``DeviceUnavailableError`` (one line); records already written stay.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfx_compiler.errors import DeviceUnavailableError, PerfXError
from perfx_compiler.targets import TargetDescription
from perfx_compiler.tune.measure import (
    VERIFY_M,
    LocalMeasurer,
    MeasureResult,
    _remove,
    _target_payload,
    implausible,
    max_rel_error,
    output_names,
    random_inputs,
)

log = logging.getLogger(__name__)
FLUSH = "cache_flush_cpu_non_first_arg"  # TVM's builtin: clflush every tensor argument but the first


def parse_tracker(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); PerfXError naming the expected form otherwise."""
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PerfXError(f"--rpc-tracker {text!r} is not HOST:PORT (e.g. 127.0.0.1:9190)")
    return host, int(port)


def check_tracker(addr: tuple[str, int], timeout: float = 5.0) -> None:
    """Fail fast with one line when ``addr`` is not a reachable TVM RPC tracker (TVM's own client
    retries a refused connection for 60 s and then raises a traceback)."""
    from tvm.rpc import base

    try:
        with socket.create_connection(addr, timeout=timeout) as sock:
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            magic = struct.unpack("<i", base.recvall(sock, 4))[0]
    except (OSError, RuntimeError) as err:
        raise PerfXError(f"cannot reach the RPC tracker at {addr[0]}:{addr[1]} ({err}); start one with "
                         f"python -m tvm.exec.rpc_tracker --host {addr[0]} --port {addr[1]}") from None
    if magic != base.RPC_TRACKER_MAGIC:
        raise PerfXError(f"{addr[0]}:{addr[1]} is not a TVM RPC tracker")


def free_servers(addr: tuple[str, int], key: str) -> int:
    """Servers of ``key`` the tracker has free now (0 when it cannot be asked)."""
    from tvm.rpc import base

    try:
        with socket.create_connection(addr, timeout=5.0) as sock:
            sock.settimeout(5.0)
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            base.recvall(sock, 4)
            base.sendjson(sock, [base.TrackerCode.SUMMARY])
            value = base.recvjson(sock)
        return int(value[1]["queue_info"].get(key, {}).get("free", 0))
    except (OSError, RuntimeError, KeyError, IndexError, TypeError, ValueError):
        return 0


class NoFreeServer(Exception):
    """No server of the key became free in time (or the tracker could not be reached)."""


def request_session(tracker: tuple[str, int], key: str, timeout_s: float) -> Any:
    """An RPC session on a free server of ``key``, waiting at most ``timeout_s`` for one (``NoFreeServer``
    otherwise). TVM's ``TrackerSession.request`` retries for ever; here a timed-out request closes its
    socket, which withdraws it at the tracker."""
    from tvm import rpc
    from tvm.rpc import base

    try:
        sock = socket.create_connection(tracker, timeout=10.0)
    except OSError as err:
        raise NoFreeServer(f"tracker unreachable: {err}") from None
    try:
        sock.settimeout(timeout_s)
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        base.recvall(sock, 4)
        base.sendjson(sock, [base.TrackerCode.REQUEST, key, "", 1])
        value = base.recvjson(sock)
    except OSError:
        raise NoFreeServer(f"no server free within {timeout_s:g} s") from None
    finally:
        sock.close()
    url, port, matchkey = value[1]
    return rpc.connect(url, port, matchkey, session_timeout=0)


def remote_device(sess: Any, target: TargetDescription) -> Any:
    """The device of ``sess`` that ``target``'s kernels run on: the CPU for CPU targets, else the
    device of the TVM target kind (cuda, rocm, opencl, vulkan, ...)."""
    kind = str(target.tvm_target.get("kind", "llvm"))
    return sess.cpu(0) if target.family == "cpu" or kind in ("llvm", "c") else sess.device(kind, 0)


_HANDSHAKE_GRACE_S = 15.0  # connecting to a server the tracker handed out: seconds at most when it is alive
_TRANSPORT_ERRORS = ("RPCCode", "kShutdown", "Connection reset", "Broken pipe", "Socket")


class _Lost(Exception):
    """The session broke (server gone, connection closed): the candidate goes to another slot."""


@dataclass
class _Slot:
    index: int
    sess: Any = None
    dev: Any = None
    dead: bool = False  # could not get a server: unused until the tracker has one free again
    cache: dict[str, Any] = field(default_factory=dict)  # remote inputs + reference of the current workload
    uploads: int = 0


@dataclass
class _Job:
    kind: str  # "measure": one candidate (index into results); "rounds": the confirmation of all
    indices: list[int]
    attempts: int = 0


class RPCMeasurer(LocalMeasurer):
    """``LocalMeasurer``'s builds, timed on the servers of ``key`` registered at ``tracker``."""

    def __init__(
        self,
        target: TargetDescription,
        tracker: tuple[str, int],
        key: str,
        parallel: int = 1,
        workers: int | None = None,
        build_timeout_s: float = 120.0,
        request_timeout_s: float = 60.0,
        run_timeout_s: float = 600.0,
        repeat: int = 5,
        min_repeat_ms: int = 20,
        tolerance: float = 1e-4,
    ) -> None:
        super().__init__(target, workers, build_timeout_s, repeat, min_repeat_ms, tolerance)
        check_tracker(tracker)
        self.tracker, self.key = tracker, key
        self.request_timeout_s, self.run_timeout_s = request_timeout_s, run_timeout_s
        self._slots = [_Slot(i) for i in range(max(1, parallel))]
        self._ref_so: dict[str, str] = {}
        self._inputs: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sessions

    def _request(self) -> tuple[Any, Any]:
        """A session on a free server of the key, waiting at most request_timeout_s for one."""
        sess = request_session(self.tracker, self.key, self.request_timeout_s)
        return sess, remote_device(sess, self.target)

    def close(self) -> None:
        for slot in self._slots:
            slot.sess = slot.dev = None
            slot.cache.clear()
        super().close()

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, jobs: list[_Job], run: Any, results: list[MeasureResult]) -> None:
        """Run ``jobs`` over the slots. ``run(slot, job)`` does one on a session and returns fresh
        results by index, copied into ``results`` only when the job ends well (an abandoned thread
        that wakes up later must not touch what was recorded); a job given up fails its indices."""
        revive = free_servers(self.tracker, self.key)
        for slot in self._slots:  # a slot that found no server may find one now
            if slot.dead and revive > 0:
                slot.dead, revive = False, revive - 1
        if all(s.dead for s in self._slots):
            for slot in self._slots:
                slot.dead = False
        pending = collections.deque(jobs)
        running: dict[int, tuple[threading.Thread, _Job, float, dict[str, Any]]] = {}
        while pending or running:
            for slot in self._slots:
                if slot.index in running or slot.dead or not pending:
                    continue
                job, box = pending.popleft(), {"phase": "request" if slot.sess is None else "run"}
                thread = threading.Thread(target=self._thread, args=(slot, job, run, box), daemon=True)
                running[slot.index] = (thread, job, time.monotonic(), box)
                thread.start()
            time.sleep(0.01)
            for index, (thread, job, start, box) in list(running.items()):
                slot = self._slots[index]
                elapsed = time.monotonic() - start
                late = box["phase"] == "run" and elapsed > self.run_timeout_s
                # a slot still waiting for a server while another slot idles with one: move the job.
                # A request past its timeout plus the handshake's grace is stuck too: the tracker
                # handed it a server that accepts but never answers (stopped), and TVM's connect
                # has no timeout; without this bound the batch waits for ever.
                idle = any(s.sess is not None and s.index not in running and not s.dead for s in self._slots)
                stuck = elapsed > self.request_timeout_s + _HANDSHAKE_GRACE_S
                stolen = box["phase"] == "request" and ((not pending and idle) or stuck)
                if thread.is_alive() and not (late or stolen):
                    continue
                del running[index]
                outcome = "late" if late else "stolen" if stolen else box.get("outcome", "lost")
                if late or stolen:
                    box["abandoned"] = True  # the thread drops whatever it gets when it returns
                    self._slots[index] = slot = _Slot(index, dead=stolen)
                if outcome == "ok":
                    for i, res in box["value"].items():
                        results[i] = res
                    continue
                if outcome in ("no_server", "stolen"):
                    slot.dead = True
                    pending.appendleft(job)
                    if all(s.dead for s in self._slots) and not running:
                        raise DeviceUnavailableError(
                            f"no RPC server with key {self.key!r} free at tracker {self.tracker[0]}:{self.tracker[1]} "
                            f"within {self.request_timeout_s:g} s ({box.get('why', '')}); start one with "
                            f"python -m tvm.exec.rpc_server --tracker {self.tracker[0]}:{self.tracker[1]} --key {self.key}")
                    continue
                why = (f"RPC server did not answer within {self.run_timeout_s:g} s" if late
                       else f"RPC session lost: {box.get('why', 'thread ended')}")
                log.warning("%s (slot %d)", why, index)
                slot.sess = slot.dev = None
                slot.cache.clear()
                job.attempts += 1
                if job.attempts < 2:
                    pending.append(job)  # another slot (or a fresh session) gets it
                else:
                    for i in job.indices:
                        results[i].error = f"{why} (twice)"

    def _thread(self, slot: _Slot, job: _Job, run: Any, box: dict[str, Any]) -> None:
        try:
            if slot.sess is None:
                sess, dev = self._request()
                if box.get("abandoned"):
                    return
                slot.sess, slot.dev, box["phase"] = sess, dev, "run"
            box["value"] = run(slot, job)
            box["outcome"] = "ok"
        except NoFreeServer as err:
            box.update(outcome="no_server", why=str(err))
        except Exception as err:  # noqa: BLE001 - any session fault costs only this job
            box.update(outcome="lost", why=f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else ''}")

    # ------------------------------------------------------------------ remote work

    def _reference_so(self, workload_key: str, func: Any) -> str:
        """The unscheduled function built for the target (the semantics candidates are checked against)."""
        with self._lock:
            return self._reference_so_locked(workload_key, func)

    def _reference_so_locked(self, workload_key: str, func: Any) -> str:
        if workload_key not in self._ref_so:
            from perfx_compiler.stack_alloca import compile_kernel

            path = os.path.join(self._tmp.name, f"ref{time.time_ns()}.so")
            kwargs: dict[str, Any] = {}
            if self.target.cross_compiler:
                from tvm.support import cc

                kwargs["fcompile"] = cc.cross_compiler(self.target.cross_compiler)
            compile_kernel(func, self.target).export_library(path, **kwargs)
            self._ref_so[workload_key] = path
        return self._ref_so[workload_key]

    def _load(self, slot: _Slot, path: str) -> Any:
        # A fresh name per upload: rewriting a .so the server has loaded (the reference, uploaded
        # again for a later workload) changes mapped code under it, and the server segfaults.
        slot.uploads += 1
        name = f"u{slot.uploads}_{os.path.basename(path)}"
        slot.sess.upload(path, name)
        return slot.sess.load_module(name)

    def _prepare_slot(self, slot: _Slot, func: Any, workload_key: str, m_verify: int, m_value: int) -> dict[str, Any]:
        """Remote verify / timing inputs and the remote reference outputs of the workload (cached
        per slot for the current workload only: weights can be tens of MB)."""
        import tvm

        tag = f"{workload_key}@{m_verify}@{m_value}"
        if slot.cache.get("tag") == tag:
            return slot.cache
        slot.cache.clear()
        outs = output_names(func)
        out_idx = [i for i, p in enumerate(func.params) if str(p.name) in outs]
        with self._lock:  # slots prepare concurrently; the arrays are made once (same seeds as local)
            for tag_m, m, seed in (("v", m_verify, 0), ("t", m_value, 1)):
                if f"{workload_key}@{tag_m}{m}" not in self._inputs:
                    self._inputs[f"{workload_key}@{tag_m}{m}"] = random_inputs(func, m, seed=seed)
            verify = self._inputs[f"{workload_key}@v{m_verify}"]
            timing = self._inputs[f"{workload_key}@t{m_value}"]

        def put(a: Any) -> Any:
            return a.item() if not isinstance(a, np.ndarray) else tvm.runtime.tensor(a, slot.dev)

        cache = {"out_idx": out_idx, "verify_np": verify, "verify": [put(a) for a in verify],
                 "timing": [put(a) for a in timing], "scalar": any(not isinstance(a, np.ndarray) for a in timing)}
        cache["want"] = self._run_remote(cache, self._load(slot, self._reference_so(workload_key, func)))
        cache["tag"] = tag
        slot.cache.update(cache)
        return slot.cache

    @staticmethod
    def _run_remote(cache: dict[str, Any], mod: Any) -> list[np.ndarray]:
        for i in cache["out_idx"]:  # outputs start from zeros for every candidate
            cache["verify"][i].copyfrom(cache["verify_np"][i])
        mod["main"](*cache["verify"])
        return [cache["verify"][i].numpy() for i in cache["out_idx"]]

    def _time_remote(self, slot: _Slot, mod: Any, cache: dict[str, Any], calls: int, cold: bool) -> np.ndarray:
        # the flush builtin clflushes host addresses: a GPU's buffers are not, so a GPU is timed warm
        flush = FLUSH if cold and self.target.family == "cpu" else ""
        f = mod.time_evaluator("main", slot.dev, number=1, repeat=int(calls), f_preproc=flush)
        return np.asarray(f(*cache["timing"]).results, dtype=np.float64)

    def _candidate(self, slot: _Slot, res: MeasureResult, path: str, func: Any, key: str, m_verify: int,
                   m_value: int, cold: bool) -> Any:
        """Upload, check and return the loaded remote module, or None with ``res.error`` set.
        A remote error that leaves the session alive is the candidate's fault; otherwise _Lost."""
        cache = self._prepare_slot(slot, func, key, m_verify, m_value)
        try:
            mod = self._load(slot, path)
            err = max_rel_error(self._run_remote(cache, mod), cache["want"])
        except Exception as exc:  # noqa: BLE001
            self._check_alive(slot, exc)
            res.error = f"run failed on {self.key}: {type(exc).__name__}: {str(exc)[:200]}"
            return None
        res.extra["max_rel_error"] = err
        if not err <= self.tolerance:
            res.error = f"wrong result: max relative error {err:.2e}"
            return None
        return mod

    def _check_alive(self, slot: _Slot, exc: Exception) -> None:
        # a server killed mid-call can surface as the call's own error (RPCCode kShutdown) while the
        # round trip below still answers from the client side: the transport's words mean a lost session
        if any(word in str(exc) for word in _TRANSPORT_ERRORS):
            raise _Lost(str(exc)[:200]) from None
        try:
            slot.dev.exist  # noqa: B018 - a round trip: raises when the session is gone
        except Exception:  # noqa: BLE001
            raise _Lost(str(exc)[:200]) from None

    # ------------------------------------------------------------------ Measurer protocol

    def _builds(self, func: Any, template_name: str, workload_key: str,
                configs: list[dict[str, Any]]) -> tuple[list[MeasureResult], list[str | None]]:
        """Build the configs not kept from an earlier call (same pool and timeout as local)."""
        import tvm

        from perfx_compiler.tune.records import config_key

        results = [MeasureResult(config=c) for c in configs]
        paths = [self._built.get((workload_key, config_key(c))) for c in configs]
        todo = [i for i, p in enumerate(paths) if p is None or not os.path.exists(p)]
        if todo:
            fresh = [os.path.join(self._tmp.name, f"c{time.time_ns()}_{i}.so") for i in todo]
            base = {"func": tvm.ir.save_json(func), "target": _target_payload(self.target), "template": template_name}
            self._build_all(base, [configs[i] for i in todo], fresh, [results[i] for i in todo])
            for i, path in zip(todo, fresh, strict=True):
                paths[i] = path
        for i, (res, path) in enumerate(zip(results, paths, strict=True)):
            if not res.ok:
                _remove(path)
                paths[i] = None
            else:
                self._built[(workload_key, config_key(configs[i]))] = str(path)
        return results, paths

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
        results, paths = self._builds(func, template_name, workload_key, configs)
        traffic = self._traffic(func, template_name, workload_key, m_value)

        def run(slot: _Slot, job: _Job) -> dict[int, MeasureResult]:
            res = MeasureResult(config=results[job.indices[0]].config, build_s=results[job.indices[0]].build_s)
            out = {job.indices[0]: res}
            cold = traffic is not None and traffic.cold and not self._prepare_slot(
                slot, func, workload_key, m_verify, m_value)["scalar"]  # the builtin flush takes tensors only
            mod = self._candidate(slot, res, paths[job.indices[0]], func, workload_key, m_verify, m_value, cold)
            if mod is None:
                return out
            cache = slot.cache
            first = float(self._time_remote(slot, mod, cache, 2, cold).min())
            calls = int(min(400, max(self.repeat, self.repeat * self.min_repeat_ms * 1e-3 / max(first, 1e-7))))
            samples = self._time_remote(slot, mod, cache, calls, cold)
            res.mean_s, res.std_s = float(samples.min()), float(samples.std())
            res.extra.update(cold_cache=cold, device=f"rpc:{self.key}")
            why = implausible(res.mean_s, traffic, self.target, cold)
            if why is not None:
                res.extra["implausible_s"] = res.mean_s
                res.error, res.mean_s, res.std_s = why, float("inf"), 0.0
            return out

        self._dispatch([_Job("measure", [i]) for i, p in enumerate(paths) if p is not None], run, results)
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
        """``LocalMeasurer.time_rounds`` on one remote server: the alternation only means something
        when every candidate runs on the same device."""
        m_verify = min(m_value, VERIFY_M) if m_value else VERIFY_M
        results, paths = self._builds(func, template_name, workload_key, configs)
        traffic = self._traffic(func, template_name, workload_key, m_value)
        live = [i for i, p in enumerate(paths) if p is not None]

        def run(slot: _Slot, job: _Job) -> dict[int, MeasureResult]:
            out = {i: MeasureResult(config=results[i].config) for i in live}
            cold = traffic is not None and traffic.cold and not self._prepare_slot(
                slot, func, workload_key, m_verify, m_value)["scalar"]
            mods = {i: self._candidate(slot, out[i], paths[i], func, workload_key, m_verify, m_value, cold)
                    for i in live}
            ok = [i for i in live if mods[i] is not None]
            calls: dict[int, int] = {}
            per_round: dict[int, list[float]] = {i: [] for i in ok}
            for r in range(-1, rounds):  # round -1 sizes the call counts
                for i in (ok[r % len(ok):] + ok[: r % len(ok)] if ok else []):
                    samples = self._time_remote(slot, mods[i], slot.cache, 2 if r < 0 else calls[i], cold)
                    if r < 0:
                        calls[i] = int(min(200, max(3, self.round_ms * 1e-3 / max(float(samples.min()), 1e-7))))
                    else:
                        per_round[i].append(float(np.median(samples)))
            for i in ok:
                res = out[i]
                res.mean_s, res.std_s = float(np.median(per_round[i])), float(np.std(per_round[i]))
                res.extra.update(rounds=per_round[i], cold_cache=cold, device=f"rpc:{self.key}")
                why = implausible(res.mean_s, traffic, self.target, cold)
                if why is not None:
                    res.error, res.mean_s = why, float("inf")
            return out

        if live:
            self._dispatch([_Job("rounds", live)], run, results)
        return results
