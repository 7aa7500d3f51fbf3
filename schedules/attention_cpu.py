"""CPU fused attention (RoPE inside, causal, GQA, KV cache written in place): prefill and decode.

The import phase emits the untuned kernel of ``perfx_compiler/kernels/attention.py`` tagged with
``perfx.attention`` (shape facts and ``kind``: "prefill" for the symbolic-length function,
"decode" for the one the decode function calls). This template replaces it with the same
kernel built for one configuration:

* prefill: ``q_tile`` queries x ``heads_per_task`` query heads of one kv head per task (rows
  vectorised over the task's queries; ``q_tile`` 1 = one query per task, rows = its heads),
  ``k_tile`` keys per online-softmax step (fully-masked key tiles skipped), ``key_block`` keys
  scored per register block, ``lanes`` vector width;
* decode: the cache split into ``splits`` chunks per kv head across threads, merged by
  log-sum-exp; ``k_tile`` and ``lanes`` as above; ``prefetch``: keys ahead whose k/v rows are
  prefetched (default config only, not searched).

A sliding-window or soft-capped kernel (``window`` / ``softcap`` in the tag, only when set) is
rebuilt as the same variant; its workload key differs from the plain kernel's (another function).

When the merge-projections pass made the kernel read one fused QKV tensor, the built kernel gets
the same rewrite, so the function keeps its signature.
"""

from __future__ import annotations

import json
from typing import Any

from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription

ATTR = "perfx.attention"


def _info(func: Any) -> dict[str, Any] | None:
    attrs = func.attrs
    if attrs is None or ATTR not in attrs:
        return None
    try:
        info = json.loads(str(attrs[ATTR]))
    except ValueError:
        return None
    return info if info.get("kind") in ("prefill", "decode") else None


def _lanes(workload: Workload, target: TargetDescription) -> list[int]:
    widest = vector_lanes(target)
    return [w for w in (4, 8, 16) if w <= widest and workload.dims["D"] % w == 0] or [1]


# Keys ahead whose cached k/v rows the decode kernel prefetches (``prefetch``; 0: none). In the default
# config, not the searched space: the tuner times a kernel with its cache rows warm, where a prefetch
# only costs (docs/decisions/attention-cpu.md). A record (which carries none) gets this distance.
DECODE_PREFETCH = 8


class AttentionCPU(ScheduleTemplate):
    name = "attention_cpu"
    knobs = ("k_tile", "splits", "lanes", "prefetch", "q_tile", "heads_per_task", "key_block")
    # The decode kernel's version, part of its workload key (prefill keeps ``version``): 2 appends the
    # new k/v rows inside the tasks and, with one split, writes the output without partials; the
    # records timed for version 1 (serial append and merge on the launching thread) are retired.
    decode_version = 2

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        info = _info(func)
        if info is None:
            return None
        dims = {"H": int(info["heads"]), "KVH": int(info["kv_heads"]), "D": int(info["head_dim"]),
                "MAXC": int(info["max_context"])}
        decode = info["kind"] == "decode"
        if decode:
            dims["M"] = 1
        winfo = {"kind": info["kind"], "dtype": info.get("dtype", "float32"),
                 "index_dtype": info.get("index_dtype", "int64"), "qkv": len(func.params) == 7}
        # the variant the kernel was built as (absent for plain kernels): apply rebuilds the same one
        winfo.update({k: info[k] for k in ("window", "softcap", "kv_cache") if info.get(k)})
        return make_workload(
            self.name, func, target, dims, symbolic=None if decode else "M", info=winfo,
            version=self.decode_version if decode else self.version,
        )

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        d = workload.dims
        G = d["H"] // d["KVH"]
        tiles = [t for t in (16, 32, 64, 128) if t <= d["MAXC"]] or [d["MAXC"]]
        if workload.info["kind"] == "decode":
            return {"k_tile": tiles, "splits": [1, 2, 3, 4, 6, 8, 16], "lanes": _lanes(workload, target)}
        return {
            "q_tile": [1, 4, 8, 16, 32],
            "k_tile": tiles,
            "heads_per_task": [g for g in range(1, G + 1) if G % g == 0],
            "key_block": [1, 2, 4],
            "lanes": _lanes(workload, target),
        }

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        d = workload.dims
        lanes = _lanes(workload, target)[-1]
        tile = min(64, d["MAXC"])
        if workload.info["kind"] == "decode":
            # One split per kv head when the kv heads divide among the cores (no partials, no serial merge
            # on the launching thread), else kv heads x splits tasks (3 x 2 balance 2 cores); chunks stay
            # >= one tile long (docs/decisions/attention-cpu.md)
            cores = max(1, int(target.cores or 2))
            splits = 1 if d["KVH"] % cores == 0 else 2 if cores <= 2 else 4
            return {"k_tile": tile, "splits": splits, "lanes": lanes, "prefetch": DECODE_PREFETCH}
        G = d["H"] // d["KVH"]
        key_block = next(b for b in (4, 2, 1) if tile % b == 0)  # a cache under 4 positions has a shorter tile
        return {"q_tile": 16, "k_tile": tile, "heads_per_task": G, "key_block": key_block, "lanes": lanes}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        try:
            self._kernel_config(workload, config)
        except ScheduleConfigError:
            return False
        return True

    def _kernel_config(self, workload: Workload, config: dict[str, Any]) -> dict[str, Any]:
        d = workload.dims
        G = d["H"] // d["KVH"]
        lanes = int(config.get("lanes", 16))
        k_tile = int(config.get("k_tile", 64))
        if lanes < 1 or d["D"] % lanes or k_tile < 1:
            raise ScheduleConfigError(f"attention_cpu: bad lanes/k_tile in {config} for {d}")
        if workload.info["kind"] == "decode":
            splits = int(config.get("splits", 2))
            prefetch = int(config.get("prefetch", DECODE_PREFETCH))  # records carry none: see DECODE_PREFETCH
            if splits < 1 or prefetch < 0:
                raise ScheduleConfigError(f"attention_cpu: bad splits/prefetch in {config}")
            return {"body": "split", "k_tile": k_tile, "splits": splits, "lanes": lanes, "prefetch": prefetch}
        q_tile = int(config.get("q_tile", 16))
        hpt = int(config.get("heads_per_task", G))
        if q_tile < 1 or hpt < 1 or G % hpt:
            raise ScheduleConfigError(f"attention_cpu: bad q_tile/heads_per_task in {config} for {d}")
        if q_tile == 1:
            return {"body": "rows", "k_tile": k_tile, "lanes": lanes}
        key_block = int(config.get("key_block", 4))
        if key_block < 1 or k_tile % key_block:
            raise ScheduleConfigError(f"attention_cpu: key_block must divide k_tile in {config}")
        return {"body": "tiled", "k_tile": k_tile, "q_tile": q_tile, "heads_per_task": hpt, "key_block": key_block,
                "lanes": lanes}

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        from perfx_compiler.kernels.attention import cached_attention_kernel
        from perfx_compiler.kernels.attention_qkv import attention_over_qkv

        d = workload.dims
        kcfg = self._kernel_config(workload, config)
        try:
            kernel = cached_attention_kernel(d["H"], d["KVH"], d["D"], d["MAXC"], workload.info["dtype"],
                                             workload.info["index_dtype"], config=kcfg,
                                             window=int(workload.info.get("window", 0)),
                                             softcap=float(workload.info.get("softcap", 0.0)),
                                             kv_cache=workload.info.get("kv_cache", "float32"))
        except ValueError as err:
            raise ScheduleConfigError(str(err)) from err
        if workload.info["qkv"]:
            kernel = attention_over_qkv(kernel)
            if kernel is None:
                raise ScheduleConfigError("attention_cpu: the kernel cannot read a fused QKV tensor")
        if len(kernel.params) != len(func.params):
            raise ScheduleConfigError("attention_cpu: kernel and function signatures differ")
        attrs = {k: v for k, v in func.attrs.items() if k != ATTR} if func.attrs is not None else {}
        return kernel.with_attrs({**attrs, "tirx.is_scheduled": True})


TEMPLATE = AttentionCPU()
