"""Pre-packed weights: the weight_layout pass packs linear weights into [N / nb, K, nb] panels at
compile time, and the GEMM (prefill) and GEMV (decode) templates read them as they are.

* pass: structure (packed shapes, matmuls read ``W[n // nb, k, n % nb]``, the tied embedding's
  gather reads the panels, no NT matmul left on a packed weight) and numerics (the packed module
  computes what the unpacked one does, scheduled, through the Relax VM);
* templates: every configuration drawn from the packed spaces vs numpy on fresh random inputs,
  at symbolic M (tails of every mr) and static decode M; configs that do not fit nb are rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from sched_helpers import check_func, sample_configs
from tvm import relax

from perfx_compiler.formats.panels import pack_weight, unpack_weight
from perfx_compiler.passes import PassContext, weight_layout
from perfx_compiler.schedule_template import ScheduleConfigError, find_template
from perfx_compiler.targets import load_target
from perfx_compiler.tune.workloads import packed_linear_func
from schedules._matmul import analyze_matmul, panel_width


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _packed_reference(epilogue: str | None):
    def ref(arrays: list[np.ndarray]) -> np.ndarray:
        x = arrays[0].astype(np.float64)
        y = x @ unpack_weight(arrays[1]).astype(np.float64).T
        if epilogue in ("add", "bias"):
            y = y + arrays[2]
        elif epilogue == "silu_mul":
            y = _silu(y) * arrays[2]
        return y

    return ref


def test_pack_round_trip_and_layout():
    w = np.random.default_rng(1).standard_normal((192, 40)).astype(np.float32)
    wp = pack_weight(w, 64)
    assert wp.shape == (3, 40, 64) and wp.flags.c_contiguous
    assert wp[2, 7, 5] == w[2 * 64 + 5, 7]  # panel p, row k, lane q holds W[p*nb + q, k]
    np.testing.assert_array_equal(unpack_weight(wp), w)


def test_panel_width_per_target():
    assert panel_width(load_target("x86-avx512")) == 64  # 4 zmm
    assert panel_width(load_target("x86-avx2")) == 16  # 2 ymm (16 registers)
    assert panel_width(load_target("arm64-neon")) == 16  # 4 q registers (32 registers)
    rvv = load_target("riscv64-rvv")
    assert panel_width(rvv) == 4 * (rvv.vector_bits // 32)


def _tiny_model() -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """ids -> tied embedding -> two linears (+ residual) -> logits through the tied embedding."""
    bb = relax.BlockBuilder()
    seq = tvm.tirx.Var("seq", "int64")
    ids = relax.Var("ids", relax.TensorType([1, seq], "int64"))
    emb = relax.Var("emb", relax.TensorType([256, 64], "float32"))
    w1 = relax.Var("w1", relax.TensorType([128, 64], "float32"))
    w2 = relax.Var("w2", relax.TensorType([64, 128], "float32"))
    norm = relax.Var("norm", relax.TensorType([64], "float32"))
    with bb.function("prefill", [ids, emb, w1, w2, norm], attrs={"num_input": 1}):
        with bb.dataflow():
            vocab = bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(emb)))  # as the ONNX import does
            ids_ok = bb.emit(relax.op.where(relax.op.less(ids, relax.const(0, "int64")), relax.op.add(ids, relax.op.take(vocab, relax.const(0, "int64"), axis=0)), ids))
            h = bb.emit(relax.op.take(emb, ids_ok, axis=0))
            a = bb.emit(relax.op.matmul(h, relax.op.permute_dims(w1)))
            b = bb.emit(relax.op.matmul(a, relax.op.permute_dims(w2)))
            c = bb.emit(relax.op.multiply(relax.op.add(b, h), norm))
            out = bb.emit_output(relax.op.matmul(c, relax.op.permute_dims(emb)))
        bb.emit_func_output(out)
    rng = np.random.default_rng(7)
    weights = {
        "emb": rng.standard_normal((256, 64)).astype(np.float32),
        "w1": rng.standard_normal((128, 64)).astype(np.float32),
        "w2": rng.standard_normal((64, 128)).astype(np.float32),
        "norm": rng.standard_normal(64).astype(np.float32),  # 1-D: never packed
    }
    return bb.get(), weights


def _run(mod: tvm.IRModule, weights: dict[str, np.ndarray], ids: np.ndarray, target, schedule: bool) -> np.ndarray:
    from perfx_compiler.schedule import apply_schedules

    lower = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ]
    )
    with target.tvm():
        mod = lower(mod)
    if schedule:
        mod = apply_schedules(mod, target, None)
    vm = relax.VirtualMachine(tvm.compile(mod, target.tvm()), tvm.cpu())
    args = [tvm.runtime.tensor(ids)] + [tvm.runtime.tensor(w) for w in weights.values()]
    return vm["prefill"](*args).numpy()


def test_weight_layout_pass_structure_and_numerics(cpu_target):
    mod, weights = _tiny_model()
    nb = panel_width(cpu_target)
    packed_mod, packed = weight_layout.apply(mod, dict(weights), PassContext(target=cpu_target, options=None))
    # Structure: every 2-D weight packed into panels (emb feeds a gather and a matmul: still one copy).
    assert list(packed) == list(weights)
    for name in ("emb", "w1", "w2"):
        n, k = weights[name].shape
        assert packed[name].shape == (n // nb, k, nb), name
        np.testing.assert_array_equal(unpack_weight(packed[name]), weights[name])
    assert packed["norm"] is weights["norm"]
    func = packed_mod["prefill"]
    assert [tuple(int(d) for d in p.ty.shape.values) for p in func.params[1:4]] == [w.shape for w in list(packed.values())[:3]]
    layouts = []
    for gv, f in packed_mod.functions_items():
        if isinstance(f, tvm.tirx.PrimFunc):
            facts = analyze_matmul(f)
            if facts is not None:
                layouts.append((gv.name_hint, facts.layout, facts.nb))
    assert sorted(lay for _, lay, _ in layouts) == ["P", "P", "P"], layouts
    assert all(nb_ == min(nb, n) for (_, _, nb_), n in zip(sorted(layouts), [256, 64, 128], strict=True)), layouts
    body = packed_mod.script()
    assert "take_packed" in body and "R.take(emb" not in body and "R.shape_of(emb)" not in body
    # Numerics: the packed, scheduled module = the unpacked, unscheduled one = float64 numpy.
    ids = np.array([[3, 200, 17, 64, 63, 5, -247]], dtype=np.int64)  # -247 wraps to row 9
    want_mod = _run(relax.transform.FuseTransposeMatmul()(mod), weights, ids, cpu_target, schedule=False)
    got = _run(packed_mod, packed, ids, cpu_target, schedule=True)
    e = weights["emb"].astype(np.float64)
    h = e[ids[0] % 256]
    ref = (((h @ weights["w1"].T) @ weights["w2"].T + h) * weights["norm"]) @ e.T
    scale = np.abs(ref).max()
    assert np.abs(want_mod[0] - ref).max() / scale < 1e-5
    assert np.abs(got[0] - ref).max() / scale < 1e-5


def test_weight_layout_pass_leaves_gpu_targets_nt():
    mod, weights = _tiny_model()
    out, new = weight_layout.apply(mod, dict(weights), PassContext(target=load_target("cuda-sm80"), options=None))
    assert all(new[n] is weights[n] for n in weights)
    assert "NT_matmul" in out.script() and "_packed" not in out.script()


@pytest.mark.parametrize(
    ("M", "K", "N", "epilogue"),
    [
        (None, 96, 192, None),  # symbolic M (prefill): pad path for every mr
        (None, 64, 128, "add"),  # residual epilogue fused into the GEMM
        (None, 48, 64, "silu_mul"),  # one panel (N == nb): TVM folds n // nb to 0
    ],
)
def test_gemm_cpu_packed_every_sampled_config(cpu_target, M, K, N, epilogue):
    nb = min(panel_width(cpu_target), N)
    func = packed_linear_func(M, K, N, nb, epilogue)
    template, workload = find_template(func, cpu_target)
    assert template.name == "gemm_cpu" and workload.info["layout"] == "P" and workload.info["nb"] == nb
    for config in sample_configs(template, workload, cpu_target, n=5, seed=11):
        scheduled = template.apply(func, workload, config, cpu_target)
        check_func(scheduled, func, cpu_target, [1, 7, 33], _packed_reference(epilogue), seed=3)


@pytest.mark.parametrize(("M", "K", "N"), [(1, 128, 192), (1, 64, 64), (3, 96, 128)])
def test_gemv_cpu_packed_every_sampled_config(cpu_target, M, K, N):
    nb = min(panel_width(cpu_target), N)
    func = packed_linear_func(M, K, N, nb)
    template, workload = find_template(func, cpu_target)
    assert template.name == "gemv_cpu" and workload.info["layout"] == "P"
    for config in sample_configs(template, workload, cpu_target, n=6, seed=5):
        scheduled = template.apply(func, workload, config, cpu_target)
        check_func(scheduled, func, cpu_target, [M], _packed_reference(None), seed=9)


def test_config_that_mismatches_the_packing_is_rejected(cpu_target):
    nb = panel_width(cpu_target)
    lanes = nb // 4 if nb >= 16 else 4
    func = packed_linear_func(None, 64, 3 * nb, nb)
    template, workload = find_template(func, cpu_target)
    bad = {**template.default_config(workload, cpu_target), "nr": 3 * lanes * (nb // (4 * lanes) or 1)}
    if nb % bad["nr"] == 0:  # pick a micro-tile wider than the panel instead
        bad["nr"], bad["nc"] = 2 * nb, 2 * nb
    assert not template.is_valid(workload, bad, cpu_target)
    with pytest.raises(ScheduleConfigError):
        template.apply(func, workload, bad, cpu_target)
    # A record tuned for another panel width is another workload: its key never matches.
    other = packed_linear_func(None, 64, 3 * nb, nb // 2 if nb >= 2 * lanes else nb * 3)
    _, other_wl = find_template(other, cpu_target)
    assert other_wl.key != workload.key


def test_broken_packed_schedule_is_detected(cpu_target, monkeypatch):
    """The numeric check can fail: a GEMM that reads the panels transposed must not pass it."""
    nb = min(panel_width(cpu_target), 64)
    func = packed_linear_func(None, 64, 2 * nb, nb)
    template, workload = find_template(func, cpu_target)
    scheduled = template.apply(func, workload, template.default_config(workload, cpu_target), cpu_target)

    def wrong(arrays: list[np.ndarray]) -> np.ndarray:  # weights read as [N, K] instead of panels
        return arrays[0].astype(np.float64) @ arrays[1].reshape(2 * nb, 64).astype(np.float64).T

    with pytest.raises(AssertionError):
        check_func(scheduled, func, cpu_target, [7], wrong, seed=1)
