"""pipeline.GRAPH_PASSES is the one place the graph passes and their order live: every pass module of
perfx_compiler.passes is in it (a new file left out would never run), each runs as a tvm.transform
pass, and a user error raised inside one keeps its type across TVM's pass manager."""

from __future__ import annotations

import pytest
import tvm

from perfx_compiler.errors import PerfXError
from perfx_compiler.passes import GraphState, PassContext, graph_pass, load, pass_modules
from perfx_compiler.pipeline import GRAPH_PASSES, selected_passes


def test_every_pass_module_is_listed_once() -> None:
    assert len(GRAPH_PASSES) == len(set(GRAPH_PASSES))
    assert sorted(pass_modules()) == sorted(GRAPH_PASSES)
    for name in GRAPH_PASSES:
        assert load(name).NAME == name


def test_selection_keeps_pipeline_order() -> None:
    assert selected_passes(None) == GRAPH_PASSES
    assert selected_passes(["weight_layout", "fuse_add_norm"]) == ["fuse_add_norm", "weight_layout"]
    with pytest.raises(PerfXError, match="unknown pass"):
        selected_passes(["fuse_add_norm", "no_such_pass"])


def test_graph_pass_is_a_tvm_pass_and_keeps_user_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load("cast_weights")
    state = GraphState(weights={"w": 1}, ctx=PassContext(target=None, options=None))
    p = graph_pass("cast_weights", state)
    assert isinstance(p, tvm.transform.Pass) and p.info.name == "cast_weights"

    calls = []

    def fake_apply(mod: tvm.IRModule, weights: dict, ctx: PassContext) -> tuple[tvm.IRModule, dict]:
        calls.append(dict(weights))
        if len(calls) == 2:
            raise PerfXError("one line for the user")
        return mod, {**weights, "w": weights["w"] + 1}

    monkeypatch.setattr(module, "apply", fake_apply)
    seq = tvm.transform.Sequential([graph_pass("cast_weights", state) for _ in range(3)])
    mod = tvm.IRModule()
    assert seq(mod).same_as(mod)
    assert calls == [{"w": 1}, {"w": 2}]  # the third pass does not run after the error
    assert state.weights == {"w": 2}
    with pytest.raises(PerfXError, match="one line for the user"):
        state.raise_error()
