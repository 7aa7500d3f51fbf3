"""Third-party decoder graphs compiled by PerfX: tiny random transformers models exported with
torch.onnx (dynamo, past_key_values, dynamic seq + past axes) and onnxruntime-genai builds (int4
MatMulNBits + GroupQueryAttention, fp32) from the same kind of HF folder. PerfX logits (prefill +
16 decode steps) must match onnxruntime running the very same file."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from genai_testgraph import kernel_weights_desc

from perfx_compiler.cli.compile import main as compile_main
from perfx_compiler.cli.run import main as run_main
from perfx_compiler.errors import UnsupportedModelError
from perfx_compiler.model.foreign_onnx.decoder_io import OrtDecoder
from perfx_compiler.model.onnx_read import load_onnx
from perfx_compiler.model.reference import ReferenceModel
from perfx_compiler.pipeline import compile_model
from perfx_compiler.runtime.engine import Engine

pytest.importorskip("onnxruntime")
PROMPT = [5, 17, 33, 9, 100, 61, 7]
DECODE_STEPS = 16
MISTRAL_WINDOW = 200


def _need(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        print(f"skipping: {module} is not installed ({why})")
        pytest.skip(f"{module} not installed; pip install {module.replace('_', '-')} ({why})")


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.hf import write_hf_folder
    from perfx_compiler.model.testing import write_tiny_gguf

    root = tmp_path_factory.mktemp("foreign_hf")
    out = {}
    for arch, bias in (("llama", False), ("qwen2", True)):
        path, _ = write_tiny_gguf(root / f"{arch}.gguf", arch=arch, with_bias=bias, tied=False, hidden=64, heads=4,
                                  kv_heads=2, ffn=96, context_length=256, seed=3)
        out[arch] = write_hf_folder(load_gguf(path), root / f"hf_{arch}")
    # Mistral: Llama's weights under MistralForCausalLM, with a sliding window (200) larger than the
    # tokens the checks use (23) but smaller than max_position_embeddings (256).
    mistral = root / "hf_mistral"
    shutil.copytree(out["llama"], mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=MISTRAL_WINDOW)
    (mistral / "config.json").write_text(json.dumps(cfg))
    out["mistral"] = mistral
    return out


def torch_export(folder: Path, out: Path, dtype: str = "float32", with_config: bool = False,
                 opset: int = 18, dynamo: bool = True) -> Path:
    """transformers model + DynamicCache, exported with torch.onnx dynamo: seq and past axes dynamic.
    ``dtype="float16"``: model.half() (weights, activations and KV in fp16). ``with_config``: the
    model's config.json goes next to the graph too (architecture name, sliding window).
    ``dynamo=False``: the TorchScript exporter (what optimum-cli uses) at ``opset``, with dynamic_axes.
    ``dynamo=True, opset=17``: see ``dynamo_opset17``."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if dtype == "float16":
        model = model.half()
    cfg = model.config
    n = cfg.num_hidden_layers

    class WithCache(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = transformers.DynamicCache(config=self.m.config)
            for i in range(n):
                cache.update(past[2 * i], past[2 * i + 1], i)
            o = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True)
            flat = [t for layer in o.past_key_values.layers for t in (layer.keys, layer.values)]
            return (o.logits, *flat)

    s, p = 3, 4
    past = [torch.randn(1, cfg.num_key_value_heads, p, cfg.head_dim, dtype=getattr(torch, dtype)) for _ in range(2 * n)]
    args = (torch.randint(0, cfg.vocab_size, (1, s)), torch.ones(1, s + p, dtype=torch.int64),
            torch.arange(p, p + s)[None], *past)
    names = [f"past_key_values.{i}.{kind}" for i in range(n) for kind in ("key", "value")]
    io_names = dict(input_names=["input_ids", "attention_mask", "position_ids", *names],
                    output_names=["logits", *[x.replace("past_key_values", "present") for x in names]])
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not dynamo:
            axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "total"}, "position_ids": {1: "seq"},
                    "logits": {1: "seq"}, **{x: {2: "past"} for x in io_names["input_names"][3:]},
                    **{x: {2: "total"} for x in io_names["output_names"][1:]}}
            torch.onnx.export(WithCache(model), args, str(out), dynamo=False, opset_version=opset,
                              dynamic_axes=axes, **io_names)
        else:
            seq, pl, tot = (torch.export.Dim(k, min=lo, max=2048) for k, lo in (("seq", 1), ("past", 1), ("total", 2)))
            prog = torch.onnx.export(
                WithCache(model), args, dynamo=True, opset_version=18, **io_names,
                dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: tot}, "position_ids": {1: seq},
                                "past": tuple({2: pl} for _ in range(2 * n))},
            )
            prog.save(str(out))
            if opset == 17:
                dynamo_opset17(out)
    for f in ("tokenizer.json", "tokenizer_config.json", *(["config.json"] if with_config else [])):
        (out.parent / f).write_bytes((folder / f).read_bytes())
    return out


def dynamo_opset17(path: Path) -> None:
    """The dynamo exporter's graph at opset 17, weights as external data. torch 2.13 cannot write it
    itself: asked for opset 17 it exports at 18 and tries onnx's version converter, but onnxscript hands
    the converter the initializers as graph inputs, so ReduceMean's axes look non-constant, the
    converter asserts and torch keeps opset 18. The same converter on the saved file works; it leaves
    ReduceMean's noop_with_empty_axes (an opset-18 attribute, default 0) behind, which the opset-17
    checker and onnxruntime reject, so it is dropped."""
    import onnx.version_converter

    m = onnx.version_converter.convert_version(onnx.load(str(path)), 17)
    for node in m.graph.node:
        if node.op_type.startswith("Reduce") and node.op_type != "ReduceSum":
            kept = [a for a in node.attribute if a.name != "noop_with_empty_axes"]
            del node.attribute[:]
            node.attribute.extend(kept)
    onnx.checker.check_model(m)
    onnx.save_model(m, str(path), save_as_external_data=True, location="model.onnx.data")


@pytest.fixture(scope="session")
def torch_graphs(hf_folders, tmp_path_factory) -> dict[str, Path]:
    _need("torch", "torch.onnx export tests")
    _need("transformers", "torch.onnx export tests")
    root = tmp_path_factory.mktemp("torch_onnx")
    return {arch: torch_export(folder, root / arch / "model.onnx") for arch, folder in hf_folders.items()}


@pytest.fixture(scope="session")
def mistral_graph(hf_folders, tmp_path_factory) -> Path:
    _need("torch", "torch.onnx export tests")
    _need("transformers", "torch.onnx export tests")
    return torch_export(hf_folders["mistral"], tmp_path_factory.mktemp("torch_mistral") / "model.onnx",
                        with_config=True)


@pytest.fixture(scope="session")
def fp16_graph(hf_folders, tmp_path_factory) -> Path:
    _need("torch", "torch.onnx export tests")
    _need("transformers", "torch.onnx export tests")
    return torch_export(hf_folders["llama"], tmp_path_factory.mktemp("torch_fp16") / "model.onnx", dtype="float16")


def genai_build(folder: Path, out: Path, precision: str, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(folder), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache")]
    if extra:
        cmd += ["--extra_options", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return out / "model.onnx"


@pytest.fixture(scope="session")
def genai_graphs(hf_folders, tmp_path_factory) -> dict[str, Path]:
    _need("onnxruntime_genai", "onnxruntime-genai format tests")
    root = tmp_path_factory.mktemp("genai")
    # accuracy_level=1: onnxruntime multiplies by the dequantized int4 weights in fp32, as PerfX does
    # (its default level 4 quantizes activations to int8 on the fly).
    return {
        "int4": genai_build(hf_folders["llama"], root / "int4", "int4", "accuracy_level=1"),
        "int4_zp": genai_build(hf_folders["qwen2"], root / "int4_zp", "int4", "accuracy_level=1", "is_symmetric=false"),
        "fp32": genai_build(hf_folders["qwen2"], root / "fp32", "fp32"),
    }


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def compare_engine(artifact: Path, graph: Path, reference: ReferenceModel | None = None,
                   ort_model: onnx.ModelProto | None = None) -> float | tuple[float, float]:
    """Max relative logits error of PerfX vs onnxruntime over prefill + 16 greedy decode steps
    (and vs ``reference``, the float64 model, when given). ``ort_model``: the graph onnxruntime runs
    (default: the file)."""
    eng, ref = Engine(artifact), OrtDecoder(graph, model=ort_model)
    want = ref.step(PROMPT)[-1]
    got = eng.prefill(PROMPT)[0]
    errs = [_rel(got, want)]
    ref_errs = [] if reference is None else [_rel(got, reference.forward(PROMPT)[-1])]
    tok = int(np.argmax(want))
    for _ in range(DECODE_STEPS):
        want = ref.step([tok])[-1]
        got = eng.decode(tok)
        errs.append(_rel(got, want))
        if reference is not None:
            ref_errs.append(_rel(got, reference.forward([tok])[-1]))
        tok = int(np.argmax(want))
    return max(errs) if reference is None else (max(errs), max(ref_errs))


def test_torch_llama_gqa_compiles_and_matches_onnxruntime(torch_graphs, tmp_path):
    desc = load_onnx(torch_graphs["llama"])
    c = desc.config
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == ("llama", 4, 2, 16, 10000.0)
    assert desc.tokenizer_json is not None
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False)
    err = compare_engine(art, torch_graphs["llama"])
    print(f"torch.onnx llama: max rel err {err:.2e}")
    assert err < 1e-3


@pytest.fixture(scope="session")
def opset17_graphs(hf_folders, tmp_path_factory) -> dict[str, Path]:
    _need("torch", "torch.onnx export tests")
    _need("transformers", "torch.onnx export tests")
    root = tmp_path_factory.mktemp("torch_opset17")
    return {"dynamo_llama": torch_export(hf_folders["llama"], root / "dynamo" / "model.onnx", opset=17),
            "torchscript_qwen2": torch_export(hf_folders["qwen2"], root / "torchscript" / "model.onnx",
                                              opset=17, dynamo=False)}


@pytest.mark.parametrize("key", ["dynamo_llama", "torchscript_qwen2"])
def test_torch_opset17_compiles_and_matches_onnxruntime(opset17_graphs, key, tmp_path):
    graph = opset17_graphs[key]
    m = onnx.load(str(graph), load_external_data=False)
    assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [17]
    means = [n for n in m.graph.node if n.op_type == "ReduceMean"]
    # RMSNorm's mean in its opset-17 form: axes as an attribute, not an input
    assert means and all(len(n.input) == 1 and any(a.name == "axes" for a in n.attribute) for n in means)
    if key == "dynamo_llama":
        assert (graph.parent / "model.onnx.data").stat().st_size > 100_000  # weights as external data
    desc = load_onnx(graph)
    c = desc.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (4, 2, 16, 10000.0)
    assert c.attention_bias == (key == "torchscript_qwen2") and desc.tokenizer_json is not None
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False)
    err = compare_engine(art, graph)
    print(f"torch.onnx opset 17 ({key}): max rel err {err:.2e}")
    assert err < 1e-3


def test_torch_qwen2_bias_recognised(torch_graphs):
    desc = load_onnx(torch_graphs["qwen2"])
    assert desc.config.attention_bias and np.any(desc.weights["model.layers.0.self_attn.q_proj.bias"])
    ref, ort_dec = ReferenceModel(desc), OrtDecoder(torch_graphs["qwen2"])
    errs = [_rel(ref.forward(PROMPT)[-1], ort_dec.step(PROMPT)[-1])]
    errs += [_rel(ref.forward([t])[-1], ort_dec.step([t])[-1]) for t in range(40, 48)]
    assert max(errs) < 1e-4


def test_genai_int4_cli_compile_and_run(genai_graphs, tmp_path, capsys):
    graph = genai_graphs["int4"]
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(graph), load_external_data=False).graph.node)
    out = tmp_path / "art"
    # float activations: this compares with onnxruntime at 1e-3 (int8 activations: tests/passes/test_activations_int8.py)
    assert compile_main([str(graph), "--target", "host", "-o", str(out), "--quiet", "--no-batching",
                         "--activations", "f32"]) == 0
    err = compare_engine(out, graph)
    print(f"genai int4 (symmetric): max rel err {err:.2e}")
    assert err < 1e-3
    # auto -> the file's own int4 blocks on PerfX's int4 kernels (passes/onnx_int4_passthrough.py)
    manifest = json.loads((out / "perfx-config.json").read_text())
    names = {w["name"] for w in manifest["weights"]}
    assert manifest["quantization"] == "onnx"
    assert "model_layers_0_self_attn_qkv_proj_weight_q4" in names and "lm_head_weight_q4" in names
    assert not [n for n in names if n.endswith(("_proj_weight", "lm_head_weight"))]
    assert run_main([str(out), "--prompt", "Once upon a time", "--max-tokens", "4", "--json"]) == 0
    assert '"token_ids"' in capsys.readouterr().out


def test_genai_int4_zero_points_and_fp32_match_onnxruntime(genai_graphs):
    for key in ("int4_zp", "fp32"):
        desc = load_onnx(genai_graphs[key])
        assert desc.config.architecture == "qwen2" and desc.config.max_context == 256
        ref, ort_dec = ReferenceModel(desc), OrtDecoder(genai_graphs[key])
        errs = [_rel(ref.forward(PROMPT)[-1], ort_dec.step(PROMPT)[-1])]
        errs += [_rel(ref.forward([t])[-1], ort_dec.step([t])[-1]) for t in range(40, 56)]
        print(f"genai {key}: max rel err {max(errs):.2e}")
        assert max(errs) < 1e-3


def test_genai_int4_zero_points_qkv_bias_compiled(genai_graphs, tmp_path):
    """The builder's asymmetric int4 (packed zero points) Qwen2 (QKV biases) on PerfX's int4 kernels."""
    desc = load_onnx(genai_graphs["int4_zp"])
    assert all(t.zeros is not None for _, t, _ in desc.quantized.values())
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False, activations="f32")
    manifest = json.loads((art / "perfx-config.json").read_text())
    assert manifest["quantization"] == "onnx"
    assert "model_layers_0_self_attn_qkv_proj_weight_q4_zero" in {w["name"] for w in manifest["weights"]}
    err, ref_err = compare_engine(art, genai_graphs["int4_zp"], ReferenceModel(kernel_weights_desc(desc)))
    print(f"genai int4 zero points (qwen2): max rel err {err:.2e}, vs fp64 on the kernels' weights {ref_err:.2e}")
    # the kernels hold float16 scales (the file's are float32): exact on those weights, and within
    # 1e-3 of onnxruntime (this model: ~9e-4, the scale rounding's whole effect)
    assert ref_err < 1e-4 and err < 1e-3


def test_unsupported_ops_one_line_error_no_output(genai_graphs, tmp_path, capsys):
    m = onnx.load(str(genai_graphs["fp32"]))
    nodes = [n for n in m.graph.node if n.op_type == "Sigmoid"]
    for i, n in enumerate(nodes):
        n.op_type, n.domain = ("FancyGate", "com.example") if i % 2 else ("FancyGate2", "")
    m.opset_import.append(onnx.helper.make_opsetid("com.example", 3))
    bad = tmp_path / "bad" / "model.onnx"
    bad.parent.mkdir()
    onnx.save(m, str(bad))
    out = tmp_path / "never"
    assert compile_main([str(bad), "--target", "host", "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "com.example::FancyGate (opset 3" in err and "FancyGate2 (opset 22" in err
    assert nodes[0].name in err and nodes[1].name in err
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_torch_mistral_sliding_window(mistral_graph, tmp_path):
    desc = load_onnx(mistral_graph)
    # the window comes from config.json, on every layer, as the HF folder's reader has it (the kernels mask it)
    c = desc.config
    assert (c.architecture, c.sliding_window, c.sliding_layers) == ("mistral", MISTRAL_WINDOW, list(range(c.num_layers)))
    assert c.max_context > MISTRAL_WINDOW
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False)
    err = compare_engine(art, mistral_graph)
    print(f"torch.onnx mistral: max rel err {err:.2e}")
    assert err < 1e-3


def test_torch_fp16_export_matches_onnxruntime(fp16_graph, tmp_path):
    m = onnx.load(str(fp16_graph))
    assert sum(t.data_type == onnx.TensorProto.FLOAT16 for t in m.graph.initializer) >= 10  # fp16 weights
    desc = load_onnx(fp16_graph)  # weights upcast to float32 (exactly: every fp16 is a float32)
    assert desc.config.rope_theta == 10000.0  # fitted from the fp16-rounded inv_freq
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False)
    err, ref_err = compare_engine(art, fp16_graph, ReferenceModel(desc))
    print(f"torch.onnx llama fp16: vs onnxruntime {err:.2e}, vs fp64 reference {ref_err:.2e}")
    # PerfX computes in fp32 on the fp16 weights: it must match the float64 model tightly. onnxruntime
    # keeps activations and the KV cache in fp16 (unit roundoff 2^-11 = 4.9e-4, one rounding per op and
    # a few dozen ops per layer, partly cancelling): allow 8 units.
    assert ref_err < 1e-4
    assert err < 8 * 2.0 ** -11


@pytest.fixture(scope="session")
def genai_mistral(hf_folders, tmp_path_factory) -> Path:
    _need("onnxruntime_genai", "onnxruntime-genai format tests")
    return genai_build(hf_folders["mistral"], tmp_path_factory.mktemp("genai_mistral") / "int4", "int4",
                       "accuracy_level=1")


def test_genai_mistral_int4_sliding_window(genai_mistral, tmp_path):
    desc = load_onnx(genai_mistral)  # genai_config.json: type mistral, decoder.sliding_window.window_size
    assert (desc.config.architecture, desc.config.max_context) == ("mistral", MISTRAL_WINDOW)
    # float activations: compared with onnxruntime (accuracy_level=1) at 1e-3
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False, activations="f32")
    assert json.loads((art / "perfx-config.json").read_text())["quantization"] == "onnx"
    err = compare_engine(art, genai_mistral)
    print(f"genai mistral int4: max rel err {err:.2e}")
    assert err < 1e-3
    with pytest.raises(UnsupportedModelError, match=f"sliding window of {MISTRAL_WINDOW}"):
        load_onnx(genai_mistral, max_context=MISTRAL_WINDOW + 1)


@pytest.fixture(scope="session")
def genai_fp16(hf_folders, tmp_path_factory) -> Path:
    _need("onnxruntime_genai", "onnxruntime-genai format tests")
    return genai_build(hf_folders["llama"], tmp_path_factory.mktemp("genai_fp16") / "fp16", "fp16")


def test_genai_fp16_multi_head_attention(genai_fp16, tmp_path):
    m = onnx.load(str(genai_fp16))
    # the fp16 CPU build: MatMul + RotaryEmbedding + MultiHeadAttention (K/V repeated per head), fp16 weights
    assert {"MultiHeadAttention", "RotaryEmbedding"} <= {n.op_type for n in m.graph.node}
    assert all(t.data_type == onnx.TensorProto.FLOAT16 for t in m.graph.initializer if len(t.dims) == 2)
    desc = load_onnx(genai_fp16)
    assert (desc.config.num_heads, desc.config.num_kv_heads, desc.config.rope_theta) == (4, 2, 10000.0)
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False)
    # onnxruntime cannot run this file unshared (past/present as separate buffers) with the builder's
    # value_info: its shape annotations make the memory planner reuse a [1, seq, .] buffer for
    # [1, total, .]. Without them the same nodes and weights run.
    del m.graph.value_info[:]
    err, ref_err = compare_engine(art, genai_fp16, ReferenceModel(desc), ort_model=m)
    print(f"genai fp16: vs onnxruntime {err:.2e}, vs fp64 reference {ref_err:.2e}")
    assert ref_err < 1e-4
    assert err < 8 * 2.0 ** -11  # onnxruntime computes in fp16 (see test_torch_fp16_export_matches_onnxruntime)


@pytest.fixture(scope="session")
def genai_int4_fp16(hf_folders, tmp_path_factory) -> Path:
    _need("onnxruntime_genai", "onnxruntime-genai format tests")
    # the builder's fp16 int4 form is its CUDA one (fp16 activations, fp16 MatMulNBits scales);
    # building needs no GPU, and onnxruntime's CPU kernels run it
    root = tmp_path_factory.mktemp("genai_int4_fp16")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf_folders["llama"]),
           "-o", str(root / "out"), "-p", "int4", "-e", "cuda", "-c", str(root / "cache")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return root / "out" / "model.onnx"


def test_genai_int4_fp16_scales_exact_on_int4_kernels(genai_int4_fp16, tmp_path):
    desc = load_onnx(genai_int4_fp16)
    tables = [t for _, t, _ in desc.quantized.values()]
    assert len(tables) == 15 and all(t.scales.dtype == np.float16 for t in tables)  # q/k/v/o/gate/up/down x2 + head
    art = compile_model(desc, "host", tmp_path / "art", progress=False, batching=False, activations="f32")
    assert json.loads((art / "perfx-config.json").read_text())["quantization"] == "onnx"
    # fp16 scales: the kernels hold exactly the file's weights, so the reference is the file's model
    err, ref_err = compare_engine(art, genai_int4_fp16, ReferenceModel(desc))
    print(f"genai int4 fp16: vs onnxruntime {err:.2e}, vs fp64 reference {ref_err:.2e}")
    assert ref_err < 1e-4
    assert err < 8 * 2.0 ** -11  # onnxruntime computes in fp16 (see test_torch_fp16_export_matches_onnxruntime)
