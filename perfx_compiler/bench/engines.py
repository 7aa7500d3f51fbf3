"""Engines the benchmark drives, behind one small interface.

Every engine runs greedy generation over token ids (no tokenizer in the timed path) and
reports how many weight bytes one decode step reads. A decode of n tokens is one call where the
engine has a many-step loop (``decode_many``: PerfX's C++ greedy loop; llama.cpp's ``llama_decode``
per token without the bindings' per-token bookkeeping), so no engine pays Python per token. Engines are created inside a worker
subprocess (``perfx_compiler.bench.worker``), so their imports, threads and peak RSS stay
apart; the thread count is set before the engine's library is imported.

    perfx     PerfX artifact (perfx_compiler.runtime.engine.Engine)
    llama.cpp llama-cpp-python on the GGUF file
    ort-genai onnxruntime-genai model folder (int4, built by its model builder)
    ort       plain onnxruntime on PerfX's emitted fp32 ONNX graph (IOBinding, ping-pong KV buffers)
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ENGINES = ("perfx", "llama.cpp", "ort-genai", "ort")


class BenchEngine(ABC):
    """Greedy generation over token ids; ``reset`` starts a new sequence."""

    name: str = ""

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def prefill(self, ids: Sequence[int]) -> int:
        """Run the prompt; return the greedy next token."""

    @abstractmethod
    def decode(self, token: int) -> int:
        """Run one token; return the greedy next token."""

    @abstractmethod
    def weight_bytes_per_token(self) -> int:
        """Weight bytes one decode step reads (embedding lookups count as one row, i.e. nothing)."""

    def info(self) -> dict[str, Any]:
        return {}


# ----------------------------------------------------------------------------------------- PerfX
def streamed_weight_names(manifest: dict[str, Any]) -> set[str]:
    """The weights a decode step reads whole: everything but RoPE tables and an untied embedding
    (symmetric int4 formats store no zero-point array: every stored array is read)."""
    tied = bool(manifest["model"].get("tie_word_embeddings", True))
    return {w["name"] for w in manifest["weights"]
            if not (w["name"].startswith("rope_") or (not tied and w["name"].startswith("model_embed_tokens")))}


def perfx_weight_bytes(manifest: dict[str, Any]) -> int:
    """Decode-step weight bytes of an artifact (``streamed_weight_names``)."""
    streamed = streamed_weight_names(manifest)
    return sum(int(w["nbytes"]) for w in manifest["weights"] if w["name"] in streamed)


def weight_format(manifest: dict[str, Any]) -> str:
    """What the artifact's matrices really are: dtype mix of its 2-D weights, e.g. 'float32' or 'uint8+float16'."""
    dtypes = sorted(
        {w["dtype"] for w in manifest["weights"] if len(w["shape"]) >= 2 and not w["name"].startswith("rope_")}
    )
    return "+".join(dtypes)


class PerfXEngine(BenchEngine):
    name = "perfx"

    def __init__(self, artifact: str | Path, threads: int):
        os.environ["TVM_NUM_THREADS"] = str(threads)
        from perfx_compiler.runtime.engine import Engine

        self.engine = Engine(artifact, verify=False)
        self.artifact = Path(artifact)

    def reset(self) -> None:
        self.engine.reset()

    def prefill(self, ids: Sequence[int]) -> int:
        return int(np.argmax(self.engine.prefill(ids)))

    def decode(self, token: int) -> int:
        return int(np.argmax(self.engine.decode(token)))

    def decode_many(self, token: int, n: int) -> int:
        """``n`` greedy steps after ``token`` in one call (``Engine.decode_greedy``, what ``LLM.generate``
        runs for greedy requests); the last token."""
        return self.engine.decode_greedy(token, n)[-1] if n > 0 else int(token)

    def weight_bytes_per_token(self) -> int:
        return perfx_weight_bytes(self.engine.manifest)

    def info(self) -> dict[str, Any]:
        m = self.engine.manifest
        return {"quantization": m.get("quantization", ""), "weight_format": weight_format(m),
                "thread_pool": self.engine.thread_pool, "decode_path": self.engine.decode_path}


# ----------------------------------------------------------------------------------------- llama.cpp
def gguf_weight_bytes(path: str | Path) -> int:
    """Bytes of a GGUF's tensors one decode step reads (the token embedding only when it is also the output)."""
    from perfx_compiler.model.gguf_header import read_gguf_header

    reader = read_gguf_header(path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        if t.name == "rope_freqs.weight":
            continue
        total += int(t.n_bytes)
    return total


def gguf_types(path: str | Path) -> str:
    """The GGUF's 2-D tensor types, most bytes first (e.g. 'Q4_0+Q8_0')."""
    from perfx_compiler.model.gguf_header import read_gguf_header

    sizes: dict[str, int] = {}
    for t in read_gguf_header(path).tensors:
        if len(t.shape) >= 2:
            sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return "+".join(k for k, _ in sorted(sizes.items(), key=lambda kv: -kv[1]))


class LlamaCppEngine(BenchEngine):
    name = "llama.cpp"

    def __init__(self, gguf_path: str | Path, threads: int, n_ctx: int = 1024, n_batch: int = 512,
                 flash_attn: bool = True):
        import llama_cpp

        kwargs: dict[str, Any] = dict(
            model_path=str(gguf_path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.llm = llama_cpp.Llama(**kwargs, flash_attn=flash_attn)
        self.flash_attn = flash_attn
        self.path = Path(gguf_path)
        self.version = getattr(llama_cpp, "__version__", "")
        self._lc = llama_cpp
        self.n_vocab = int(self.llm.n_vocab())

    def _next(self) -> int:
        """argmax of the last evaluated token's logits, read in place from llama.cpp's output buffer.
        (``Llama.scores`` is not it: with ``logits_all=False`` the bindings no longer copy logits there,
        so its rows stay zero and their argmax is token 0.)"""
        logits = self._lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def reset(self) -> None:
        self.llm.reset()  # eval() drops cache cells past n_tokens

    def prefill(self, ids: Sequence[int]) -> int:
        self.llm.eval(list(ids))
        return self._next()

    def decode(self, token: int) -> int:
        self.llm.eval([token])
        return self._next()

    def decode_many(self, token: int, n: int) -> int:
        """``n`` greedy steps as llama.cpp's own programs run them: ``llama_decode`` of a one-token batch
        (positions follow the cache), then the argmax of its logits; no ``Llama.eval`` bookkeeping per
        token. The last token."""
        lc, ctx = self._lc, self.llm._ctx.ctx
        buf = (lc.llama_token * 1)()
        for _ in range(n):
            buf[0] = token
            rc = lc.llama_decode(ctx, lc.llama_batch_get_one(buf, 1))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at position {self.llm.n_tokens}")
            self.llm.n_tokens += 1  # Llama's count of cached tokens, so eval()/reset() stay in step
            token = self._next()
        return token

    def weight_bytes_per_token(self) -> int:
        return gguf_weight_bytes(self.path)

    def info(self) -> dict[str, Any]:
        return {"quantization": gguf_types(self.path), "weight_format": gguf_types(self.path), "version": self.version,
                "flash_attn": self.flash_attn}


# ----------------------------------------------------------------------------------------- onnx helpers
def onnx_weight_bytes(path: str | Path) -> int:
    """Initializer bytes of an ONNX model, skipping tensors read only by Gather (embedding lookups)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    consumers: dict[str, set[str]] = {}

    def walk(graph: Any) -> None:
        for node in graph.node:
            for inp in node.input:
                consumers.setdefault(inp, set()).add(node.op_type)
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    walk(attr.g)

    walk(model.graph)
    total = 0
    for init in model.graph.initializer:
        ops = consumers.get(init.name, set())
        if ops and ops <= {"Gather", "GatherBlockQuantized"}:
            continue
        n = int(np.prod(init.dims)) if len(init.dims) else 1
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        if init.data_type in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4):
            total += (n + 1) // 2
        else:
            total += n * itemsize
    return total


# ----------------------------------------------------------------------------------------- onnxruntime-genai
class OrtGenaiEngine(BenchEngine):
    name = "ort-genai"

    def __init__(self, folder: str | Path, threads: int, max_length: int = 1024):
        import onnxruntime_genai as og

        self.og = og
        self.folder = Path(folder)
        cfg = json.loads((self.folder / "genai_config.json").read_text())
        opts = cfg["model"]["decoder"].setdefault("session_options", {})
        if opts.get("intra_op_num_threads") != threads:
            opts["intra_op_num_threads"] = threads
            opts["inter_op_num_threads"] = 1
            (self.folder / "genai_config.json").write_text(json.dumps(cfg, indent=2))
        self.model = og.Model(str(self.folder))
        self.max_length = max_length
        self.gen: Any = None
        self.onnx_file = self.folder / cfg["model"]["decoder"]["filename"]

    def reset(self) -> None:
        params = self.og.GeneratorParams(self.model)
        # min_length = max_length: the EOS logit is masked, generation never stops early.
        params.set_search_options(max_length=self.max_length, min_length=self.max_length, do_sample=False)
        self.gen = self.og.Generator(self.model, params)
        self._pending = False

    def prefill(self, ids: Sequence[int]) -> int:
        self.gen.append_tokens(np.asarray(ids, dtype=np.int32))
        self.gen.generate_next_token()  # samples from the prompt's logits (no model run)
        return int(self.gen.get_next_tokens()[0])

    def decode(self, token: int) -> int:
        # generate_next_token runs the model on the token it sampled last, then samples the next one.
        self.gen.generate_next_token()
        return int(self.gen.get_next_tokens()[0])

    def weight_bytes_per_token(self) -> int:
        return onnx_weight_bytes(self.onnx_file)

    def info(self) -> dict[str, Any]:
        meta = self.folder / "perfx-bench.json"
        precision = json.loads(meta.read_text()).get("precision", "") if meta.is_file() else ""
        return {
            "quantization": precision,
            "weight_format": "onnx MatMulNBits" if precision == "int4" else precision,
            "version": getattr(self.og, "__version__", ""),
        }


# ----------------------------------------------------------------------------------------- plain onnxruntime
class OrtEngine(BenchEngine):
    """PerfX's emitted ONNX graph (fp32, full-cache outputs) on onnxruntime's CPU provider."""

    name = "ort"

    def __init__(self, onnx_path: str | Path, threads: int):
        import onnxruntime as ort

        self.ort = ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.path = Path(onnx_path)
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        ins = {i.name: i for i in self.sess.get_inputs()}
        self.cache_in = [n for n in ins if n.startswith("cache_")]
        shape = [int(d) for d in ins[self.cache_in[0]].shape]
        # Two buffer sets: a step reads one and writes the other (outputs cannot alias inputs).
        self.bufs = [
            {n: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for n in self.cache_in} for _ in range(2)
        ]
        self.cur = 0
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0

    def _run(self, ids: Sequence[int]) -> int:
        ids_arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        b = self.sess.io_binding()
        b.bind_cpu_input("input_ids", ids_arr)
        b.bind_cpu_input("past_len", np.array([self.pos], dtype=np.int64))
        src, dst = self.bufs[self.cur], self.bufs[1 - self.cur]
        for n in self.cache_in:
            b.bind_ortvalue_input(n, src[n])
            b.bind_ortvalue_output(n.replace("cache_k.", "cache_k_out.").replace("cache_v.", "cache_v_out."), dst[n])
        b.bind_output("logits")
        self.sess.run_with_iobinding(b)
        logits = b.get_outputs()[0].numpy()
        self.cur = 1 - self.cur
        self.pos += ids_arr.shape[1]
        return int(np.argmax(logits[0, -1]))

    def prefill(self, ids: Sequence[int]) -> int:
        return self._run(ids)

    def decode(self, token: int) -> int:
        return self._run([token])

    def weight_bytes_per_token(self) -> int:
        return onnx_weight_bytes(self.path)

    def info(self) -> dict[str, Any]:
        return {"quantization": "f32", "weight_format": "float32", "version": self.ort.__version__}


def create_engine(kind: str, path: str | Path, threads: int, **kw: Any) -> BenchEngine:
    """Build the engine ``kind`` (one of ENGINES) on ``path`` with ``threads`` threads."""
    if kind == "perfx":
        return PerfXEngine(path, threads)
    if kind == "llama.cpp":
        return LlamaCppEngine(path, threads, **kw)
    if kind == "ort-genai":
        return OrtGenaiEngine(path, threads, **kw)
    if kind == "ort":
        return OrtEngine(path, threads)
    raise ValueError(f"unknown engine {kind!r}; known: {', '.join(ENGINES)}")
