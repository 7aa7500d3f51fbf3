"""Tiny random checkpoints of every decoder family PerfX supports, in the three input formats, with the
references to compare against.

Each family's config is small (hidden 64, 4 heads, 2 KV heads) but switches on the features that make
the family different (rope scaling, sliding windows, softcaps, QK-norm, biases, partial rotary, fused
projections, sandwich norms), and every parameter is drawn at random after construction (transformers
zero-inits biases and Gemma's norm offsets), so each feature changes the logits.

- ``make_checkpoint``: an HF folder (config.json, float32 model.safetensors, a tiny byte-level BPE
  tokenizer.json + tokenizer_config.json, generation_config.json)
- ``transformers_logits`` / ``transformers_greedy``: the float64 eager reference
- ``to_gguf`` / ``quantize_gguf`` / ``llamacpp_logits``: llama.cpp's own converter and runtime
- ``to_onnx``: torch.onnx (dynamo) with a KV cache, the layout tests/frontend/test_foreign_decoders.py
  uses (input_ids, attention_mask, position_ids, past_key_values.{i}.key/value -> logits, present.*)

llama.cpp's converter runs unmodified except for what a tiny custom checkpoint cannot satisfy (see
``_CONVERT_SHIM``): our tokenizer's pre-tokenizer hash is unknown to it (written as "gpt-2", which it
is: ByteLevel with GPT-2's split regex), Gemma 2 insists on a SentencePiece tokenizer.model (it gets the
BPE vocabulary, as the converter already does for Gemma 3), and GGUF has no field for Gemma 2's
query_pre_attn_scalar (llama.cpp scales by 1/sqrt(head_dim) except for the 27B model), so the shim folds
sqrt(head_dim / query_pre_attn_scalar) into attn_q: the file computes what transformers computes.
See ``GGUF_NOTES`` for what llama.cpp does not do (Mistral's sliding window).

llama.cpp on these checkpoints (f32 GGUF, f32 KV cache, 16 tokens; max |diff| / max |logit| vs float64
transformers): llama (arch llama, llama3 rope_freqs tensor), qwen2, qwen3, phi3 (partial rotary), glm4 and
glm (arch chatglm) ~2e-7; gemma2 and gemma3 (sliding windows, softcaps, QK-norm, two rope bases) ~5e-4,
ggml's fp16 GELU table; mistral (arch llama) exact on the first SLIDING_WINDOW positions only.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "glm4", "glm")

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "glm4": "Glm4ForCausalLM", "glm": "GlmForCausalLM",
}

SLIDING_WINDOW = 4

# What llama.cpp does differently from transformers on these checkpoints (checked with llama-cpp-python
# 0.3.36): family -> (number of leading positions on which llama.cpp is exact, why). None: all positions.
GGUF_NOTES: dict[str, tuple[int | None, str]] = {
    "mistral": (SLIDING_WINDOW, "llama.cpp runs MistralForCausalLM as arch 'llama', which has no sliding window: "
                                "exact only while the sequence fits in the window"),
}

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|endoftext|>", "<|user|>", "<|assistant|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKENIZER_VOCAB = 384

_CORPUS = """\
Once upon a time, in a small village by the sea, there lived an old fisherman and his granddaughter.
Every morning they walked down to the harbour, mended the nets and talked about the weather, the birds
and the boats that came and went. The girl wanted to know why the tide rose and fell, why the moon
changed its shape, and where the wind went when it stopped blowing.

The compiler reads a model, plans the memory, fuses the operators and writes a program for the target.
A good compiler keeps the numbers exact while it makes the program fast: it checks every layer against
a reference, one token at a time, and reports the largest difference it finds.

In the spring the fields turned green, and the farmers planted wheat, barley and beans. In the summer
the children swam in the river and the old people sat in the shade. In the autumn the leaves fell, and
in the winter the snow covered the roofs, the roads and the hills, and everyone stayed by the fire.

Numbers such as 3, 14, 159 and 2653 appear in tables; words such as attention, window, rotary,
embedding, softcap and normalization appear in papers. "Why?" she asked. "Because," he said, "it works."
"""


def _cache_root() -> Path:
    return Path(os.environ.get("PERFX_TEST_CACHE") or Path.home() / ".cache" / "perfx-test")


def llama_cpp_dir() -> Path:
    """The vendored llama.cpp sources of the llama-cpp-python sdist that tests/setup.sh unpacks."""
    return _cache_root() / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


# ---------------------------------------------------------------------------------------------- tokenizer

def write_tokenizer(dest: Path) -> int:
    """A byte-level BPE (GPT-2 style) trained on a few paragraphs: tokenizer.json + tokenizer_config.json.
    Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [PAD_ID, BOS_ID, EOS_ID]
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    # GPT2Tokenizer: Phi-3's converter takes the BPE path only for that class (else it wants tokenizer.model)
    cfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
           "unk_token": "<unk>", "add_bos_token": False, "add_prefix_space": False, "model_max_length": 256,
           "added_tokens_decoder": added, "clean_up_tokenization_spaces": False}
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size()


# ---------------------------------------------------------------------------------------------- checkpoints

# Sizes at which llama.cpp's K-quants apply (every quantized row a multiple of 256 wide): pass as
# ``make_checkpoint(family, dest, **KQUANT_SIZES)``; at the default sizes Q4_K_M falls back to Q5_0/Q8_0.
KQUANT_SIZES: dict[str, int] = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}


def family_config(family: str, vocab_size: int, **overrides):
    """The transformers config of ``family``'s tiny test model; ``overrides``: config fields (sizes)."""
    import transformers as tf

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    rope = dict(rope_type="default", rope_theta=10000.0)
    if family == "llama":
        # llama3 scaling with an original context of 32: with head_dim 16 and theta 10000 the wavelengths
        # (6.3 .. 19869) fall in all three regimes (kept, smoothed, divided by the factor)
        cls = tf.LlamaConfig
        kw.update(tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))
    elif family == "mistral":
        cls = tf.MistralConfig
        kw.update(sliding_window=SLIDING_WINDOW, tie_word_embeddings=False, rope_parameters=rope)
    elif family == "qwen2":  # QKV biases (always on in Qwen2), tied head
        cls = tf.Qwen2Config
        kw.update(tie_word_embeddings=True, use_sliding_window=False, rope_parameters=rope)
    elif family == "qwen3":  # QK-norm, head_dim 32 != hidden / heads
        cls = tf.Qwen3Config
        kw.update(head_dim=32, tie_word_embeddings=False, use_sliding_window=False, rope_parameters=rope)
    elif family == "gemma2":
        # small caps so the tanh bends the logits; query_pre_attn_scalar = 2 * head_dim
        cls = tf.Gemma2Config
        kw.update(num_hidden_layers=3, sliding_window=SLIDING_WINDOW,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                  tie_word_embeddings=True, rope_parameters=rope)
    elif family == "gemma3":
        # llama.cpp's gemma3 reads no layer pattern from the GGUF the converter writes: it uses 5 sliding
        # layers + 1 full (pattern 6), hence 6 layers. Local rope base 10000 (rope.freq_base_swa), global 1e6.
        # query_pre_attn_scalar = head_dim: llama.cpp scales by 1/sqrt(head_dim) (not for the 27B)
        cls = tf.Gemma3TextConfig
        kw.update(num_hidden_layers=6, sliding_window=SLIDING_WINDOW,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"], final_logit_softcapping=None,
                  attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    elif family == "phi3":  # fused qkv_proj / gate_up_proj, half the head rotated
        cls = tf.Phi3Config
        kw.update(tie_word_embeddings=False, original_max_position_embeddings=256, sliding_window=None,
                  rope_parameters={**rope, "partial_rotary_factor": 0.5})
    elif family in ("glm4", "glm"):  # QKV biases, half the head rotated (interleaved); GLM-4: sandwich norms
        # llama.cpp's chatglm converter (GlmForCausalLM) always writes rope base 10000 (it reads only rope_ratio)
        # and takes its context length from ChatGLM's seq_length (else hidden_size): given here
        cls = tf.Glm4Config if family == "glm4" else tf.GlmConfig
        kw.update(attention_bias=True, tie_word_embeddings=False,
                  rope_parameters={**rope, "partial_rotary_factor": 0.5})
        if family == "glm":
            kw["seq_length"] = kw["max_position_embeddings"]
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kw.update(overrides)
    if family == "gemma2":
        kw.setdefault("query_pre_attn_scalar", 2 * kw["head_dim"])
    if family == "gemma3":
        kw.setdefault("query_pre_attn_scalar", kw["head_dim"])
    if family in ("qwen2", "phi3"):  # these configs derive head_dim = hidden / heads
        if kw.pop("head_dim") != kw["hidden_size"] // kw["num_attention_heads"] and "head_dim" in overrides:
            raise ValueError(f"{family}: head_dim is hidden_size / num_attention_heads")
    return cls(**kw)


def make_checkpoint(family: str, dest: Path, seed: int = 0, config_style: str = "v5",
                    **config_overrides) -> Path:
    """Write ``family``'s tiny random float32 checkpoint as an HF folder at ``dest``; returns ``dest``.
    Every parameter is drawn from normal(0, 0.2). ``config_style``: "v5", config.json as transformers 5
    writes it (``rope_parameters``), or "v4", the keys checkpoints saved by transformers 4 carry
    (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``, ``rope_local_base_freq``; see
    ``legacy_config``); transformers 5 reads both to the same model. ``config_overrides``: config fields,
    e.g. ``KQUANT_SIZES``."""
    import torch
    import transformers as tf

    if config_style not in ("v4", "v5"):
        raise ValueError(f"config_style {config_style!r}: 'v4' or 'v5'")
    dest = Path(dest)
    vocab = write_tokenizer(dest)
    cfg = family_config(family, vocab, **config_overrides)
    cfg.architectures = [ARCHITECTURES[family]]
    torch.manual_seed(seed)
    model = getattr(tf, ARCHITECTURES[family])(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.2)
    model.save_pretrained(dest, safe_serialization=True)
    tf.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                        do_sample=False).save_pretrained(dest)
    if config_style == "v4":
        path = dest / "config.json"
        path.write_text(json.dumps(legacy_config(json.loads(path.read_text())), indent=2, sort_keys=True))
    return dest


def legacy_config(cfg: dict) -> dict:
    """config.json's RoPE keys as transformers 4 wrote them: ``rope_parameters`` becomes ``rope_theta``
    (+ ``rope_local_base_freq`` for Gemma 3's sliding layers), ``partial_rotary_factor`` at the top level
    and ``rope_scaling`` for a non-default rope type."""
    cfg = dict(cfg)
    rp = cfg.pop("rope_parameters", None) or {}
    if "full_attention" in rp:  # Gemma 3: one set per layer type
        if "sliding_attention" in rp:
            cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        rp = rp["full_attention"]
    rp = dict(rp)
    if "rope_theta" in rp:
        cfg["rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:
        cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    return cfg


# ---------------------------------------------------------------------------------------------- transformers

@functools.lru_cache(maxsize=4)
def _hf_model(folder: str):
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()


def transformers_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] (float64) of transformers in float64 with eager attention (which applies
    sliding windows and softcaps)."""
    import torch

    model = _hf_model(str(Path(folder).resolve()))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    return out.logits[0].numpy().astype(np.float64)


def transformers_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    """The next ``n`` greedy tokens after ``ids`` (float64 transformers, no early stop at EOS)."""
    import torch

    model = _hf_model(str(Path(folder).resolve()))
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=PAD_ID)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------------------------------- GGUF

_CONVERT_SHIM = r'''
import math, runpy, sys
from pathlib import Path
root = Path(sys.argv.pop(1))
sys.path.insert(0, str(root))
sys.path.insert(1, str(root / "gguf-py"))
from conversion import base, gemma

_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:  # a tiny tokenizer nobody registered: ByteLevel + GPT-2's split regex
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre

_spm = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    # what it raises with sentencepiece installed: the Llama converter then falls back to tokenizer.json
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _spm(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece

def gemma2_set_vocab(self):
    if (self.dir_model / "tokenizer.model").is_file():
        self._set_vocab_sentencepiece()
    else:  # as the converter's Gemma 3 does
        self._set_vocab_gpt2()
    self.gguf_writer.add_add_space_prefix(False)
gemma.Gemma2Model.set_vocab = gemma2_set_vocab

_g2_modify = gemma.Gemma2Model.modify_tensors
def gemma2_modify_tensors(self, data_torch, name, bid):
    # llama.cpp scales queries by 1/sqrt(head_dim); transformers by query_pre_attn_scalar**-0.5
    if name.endswith("q_proj.weight"):
        data_torch = data_torch * math.sqrt(self.hparams["head_dim"] / self.hparams["query_pre_attn_scalar"])
    yield from _g2_modify(self, data_torch, name, bid)
gemma.Gemma2Model.modify_tensors = gemma2_modify_tensors

sys.argv[0] = str(root / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def to_gguf(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """Convert the HF folder with llama.cpp's convert_hf_to_gguf.py (vendored gguf-py, in a subprocess,
    through ``_CONVERT_SHIM``); returns ``out``."""
    root = llama_cpp_dir()
    script = root / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing: run tests/setup.sh (it unpacks the llama-cpp-python sdist)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-c", _CONVERT_SHIM, str(root), str(folder), "--outfile", str(out), "--outtype", outtype]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder} ({res.returncode}):\n{res.stderr[-3000:]}")
    return out


def quantize_gguf(src: Path, dst: Path, ftype_name: str, pure: bool = False) -> Path:
    """Quantize with llama.cpp (``llama_model_quantize``); ``ftype_name`` e.g. "Q8_0", "Q4_K_M"
    (LLAMA_FTYPE_MOSTLY_<name>). Rows whose width is not a multiple of the type's block (256 for K-quants:
    every matrix here is 64 or 96 wide) fall back to a type llama.cpp picks (Q5_0/Q8_0 and the like);
    ``pure``: one type throughout where it fits."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    params.pure = pure
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype_name}) returned {rc}")
    return dst


def llamacpp_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] (float64) of llama-cpp-python for every position of ``ids``, one batch."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=max(32, len(ids)), n_batch=max(32, len(ids)), logits_all=True,
                n_threads=2, n_threads_batch=2, verbose=False, seed=0, type_k=0, type_v=0)
    try:
        llm.eval(list(ids))
        return np.array(llm.scores[: len(ids)], dtype=np.float64)
    finally:
        llm.close()


# ---------------------------------------------------------------------------------------------- ONNX

def to_onnx(folder: Path, out: Path) -> Path:
    """torch.onnx (dynamo, opset 18) export of the model with its KV cache, as
    tests/frontend/test_foreign_decoders.py exports: inputs input_ids, attention_mask, position_ids,
    past_key_values.{i}.key/value [1, kv_heads, past, head_dim]; outputs logits, present.{i}.key/value;
    seq and past axes dynamic. Every layer keeps its whole past (the sliding-window layers are masked, not
    truncated). tokenizer.json, tokenizer_config.json and config.json go next to the graph."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    class WithCache(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = tf.DynamicCache()  # full-length layers everywhere: the masks do the windowing
            for i in range(n):
                cache.update(past[2 * i], past[2 * i + 1], i)
            o = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True)
            flat = [t for layer in o.past_key_values.layers for t in (layer.keys, layer.values)]
            return (o.logits, *flat)

    s, p = 3, 5
    past = [torch.randn(1, cfg.num_key_value_heads, p, head_dim) for _ in range(2 * n)]
    args = (torch.randint(0, cfg.vocab_size, (1, s)), torch.ones(1, s + p, dtype=torch.int64),
            torch.arange(p, p + s)[None], *past)
    names = [f"past_key_values.{i}.{kind}" for i in range(n) for kind in ("key", "value")]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seq, pl, tot = (torch.export.Dim(k, min=lo, max=2048) for k, lo in (("seq", 1), ("past", 1), ("total", 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            WithCache(model), args, dynamo=True, opset_version=18,
            input_names=["input_ids", "attention_mask", "position_ids", *names],
            output_names=["logits", *[x.replace("past_key_values", "present") for x in names]],
            dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: tot}, "position_ids": {1: seq},
                            "past": tuple({2: pl} for _ in range(2 * n))},
        )
        prog.save(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (out.parent / f).write_bytes((Path(folder) / f).read_bytes())
    return out


def onnx_logits(graph: Path, ids: list[int], prefill: int | None = None) -> np.ndarray:
    """Logits [len(ids), vocab] (float64) of onnxruntime on a ``to_onnx`` graph: the first ``prefill``
    tokens (default all) in one step from an empty cache, the rest one token per step."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(graph), load_external_data=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
    past_names = [i.name for i in proto.graph.input if i.name.startswith("past_key_values.")]
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    past = [np.zeros((1, shapes[nm][1], 0, shapes[nm][3]), np.float32) for nm in past_names]
    ids = list(ids)
    prefill = len(ids) if prefill is None else prefill
    chunks = [ids[:prefill]] + [[t] for t in ids[prefill:]]
    outs, pos = [], 0
    for chunk in chunks:
        s = len(chunk)
        feeds = {"input_ids": np.array([chunk], np.int64), "attention_mask": np.ones((1, pos + s), np.int64),
                 "position_ids": np.arange(pos, pos + s, dtype=np.int64)[None], **dict(zip(past_names, past, strict=True))}
        got = sess.run(None, feeds)
        outs.append(got[0][0])
        past = got[1:]
        pos += s
    return np.concatenate(outs).astype(np.float64)
