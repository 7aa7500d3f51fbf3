"""vLLM-shaped offline API: ``LLM`` over the runtime's ``SamplingParams`` / ``RequestOutput``.

    llm = LLM("path/to/artifact")                   # or a model spec: compiled once, then cached
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text, out[0].metrics.decode_tokens_per_s)

Importing this module is cheap: the engine (TVM runtime) loads in ``LLM()``, and the compiler is
imported only when ``model`` is not already an artifact (then compiled once and cached).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler import __version__
from perfx_compiler.artifact_hash import compiler_digest
from perfx_compiler.errors import ArtifactError, ContextLengthError
from perfx_compiler.runtime import api
from perfx_compiler.runtime.api import (
    CONFIG_NAME,
    CompletionOutput,
    InvalidRequestError,
    NoTokenizer,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Tokenizer,
)
from perfx_compiler.runtime.chat import is_conversation_list
from perfx_compiler.runtime.generate import Generation, generate_n
from perfx_compiler.runtime.sampling import make_generator

__all__ = ["LLM", "cache_key", "compiler_digest", "default_cache_root", "resolve_artifact"]


def default_cache_root() -> Path:
    env = os.environ.get("PERFX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "perfx" / "artifacts"


def cache_key(model: str, target: str, options: Mapping[str, Any] | None = None) -> str:
    """Hash of what decides the artifact: model spec (a local file also by size and mtime), target,
    compile options (``knobs`` among them: perfx-compile --knob), the PerfX version and the digest of the
    compiler's own files, tuning records and target files (an edited compiler or a new tuning record must
    not reuse old artifacts). No environment variable changes an artifact (environment.py)."""
    spec: dict[str, Any] = {"model": model, "target": target, "perfx": __version__, "compiler": compiler_digest(),
                            "options": dict(options or {})}
    p = Path(model).expanduser()
    if p.exists():
        p = p.resolve()
        st = p.stat()
        spec.update(model=str(p), size=st.st_size, mtime_ns=st.st_mtime_ns)
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:24]


def resolve_artifact(
    model: str | Path,
    target: str = "host",
    cache_root: str | Path | None = None,
    compile_options: Mapping[str, Any] | None = None,
) -> Path:
    """``model`` itself when it is an artifact dir; otherwise the cached artifact, compiling it on first use
    (``compile_options`` go to ``compile_model`` and into the cache key)."""
    path = Path(model).expanduser()
    if (path / CONFIG_NAME).is_file():
        if compile_options:
            warnings.warn(
                f"{path} is already compiled; ignoring compile options {', '.join(sorted(compile_options))}",
                stacklevel=3,
            )
        return path
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / cache_key(str(model), target, compile_options)
    if (final / CONFIG_NAME).is_file():
        return final

    from perfx_compiler.pipeline import (
        compile_model,  # the compiler: only when we must compile
    )

    # Compile into a private dir and rename, so an interrupted compile never looks like a cached artifact.
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        built = Path(compile_model(str(model), target=target, output_dir=tmp, **dict(compile_options or {})))
        if built.resolve() != tmp.resolve():  # compile_model chose its own directory
            return built
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / CONFIG_NAME).is_file():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _progress(done: int, total: int) -> None:
    # A dependency-free stand-in for tqdm (the runtime does not depend on it).
    sys.stderr.write(f"\rProcessed prompts: {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class LLM:
    """Offline generation on one compiled model (requests run one after another for now)."""

    def __init__(
        self,
        model: str | Path,
        *,
        target: str = "host",
        seed: int = 0,
        verify: bool = True,
        cache_dir: str | Path | None = None,
        skip_tokenizer_init: bool = False,
        **compile_options: Any,
    ) -> None:
        """``model``: an artifact directory, or a model spec (GGUF / HF folder / name) that is
        compiled for ``target`` once and cached under ``cache_dir`` ($PERFX_CACHE_DIR or
        ~/.cache/perfx/artifacts). Extra keyword arguments are compile options (e.g. max_context).
        ``skip_tokenizer_init`` (vLLM's): load no tokenizer, so an artifact without tokenizer.json
        (e.g. from a torch.onnx export) runs; prompts are token ids, outputs have token ids and
        empty text, and ``logits`` works as usual."""
        self.model = str(model)
        self.target = target
        self.artifact_dir = resolve_artifact(model, target, cache_dir, compile_options)
        self.engine = api.load_engine(self.artifact_dir, verify=verify)
        self.manifest: dict[str, Any] = self.engine.manifest
        self.model_info: dict[str, Any] = dict(self.manifest.get("model", {}))
        self.tokenizer: Tokenizer | None = None if skip_tokenizer_init else Tokenizer.from_file(
            self.engine.tokenizer_path, self.model_info, self.manifest.get("chat_template")
        )
        self._rng = np.random.default_rng(seed)  # requests without a seed draw theirs from here
        self._request_counter = itertools.count()

    # -- public API -------------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; None when made with ``skip_tokenizer_init``."""
        return self.tokenizer

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{what} needs the tokenizer, which this LLM skipped (skip_tokenizer_init=True); "
                'give token ids: {"prompt_token_ids": [...]}'
            )
        return self.tokenizer

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Mapping[str, Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt. Prompts: text, token-id lists, or
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts (vLLM's prompt types)."""
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        outputs = []
        for i, ((text, ids), sp) in enumerate(zip(items, params, strict=True)):
            outputs.append(self._run_request(text, ids, sp))
            if use_tqdm:
                _progress(i + 1, len(items))
        return outputs

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (ChatML if none) and generate."""
        conversations = list(messages) if is_conversation_list(messages) else [messages]
        tokenizer = self._need_tokenizer("chat()")
        prompts = [
            str(
                tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    **dict(chat_template_kwargs or {}),
                )
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits of every position [seq, vocab] for exactly ``token_ids`` (no BOS added; cache reset)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidRequestError("logits() needs at least one token id")
        if len(ids) > self.max_context:
            raise ContextLengthError(
                f"{len(ids)} tokens exceed the model's max context of {self.max_context}; "
                f"pass at most {self.max_context} tokens"
            )
        self.engine.reset()
        # The real engine's prefill returns only the last position; prefill_all returns them all.
        run = getattr(self.engine, "prefill_all", None) or self.engine.prefill
        out = np.asarray(run(ids))
        if out.ndim != 2 or out.shape[0] != len(ids):
            raise ArtifactError(
                f"the engine returned logits of shape {out.shape} for {len(ids)} tokens; recompile the artifact"
            )
        return out

    # -- internals --------------------------------------------------------------------------------

    def _normalize_prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
            prompts = [prompts]  # one prompt given as a flat list of token ids
        elif not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
            raise InvalidRequestError("prompts must be a string, a list of strings or a list of token-id lists")
        items: list[tuple[str | None, list[int]]] = []
        for p in prompts:
            if isinstance(p, Mapping):
                if "prompt_token_ids" in p:
                    items.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
                    continue
                p = p.get("prompt")
            if isinstance(p, str):
                items.append((p, self._need_tokenizer("a text prompt").encode(p)))
            elif isinstance(p, Sequence) and all(isinstance(t, (int, np.integer)) for t in p):
                items.append((None, [int(t) for t in p]))
            else:
                raise InvalidRequestError(f"unsupported prompt {p!r:.60}; give a string or a list of token ids")
        return items

    @staticmethod
    def _normalize_params(sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise InvalidRequestError(f"got {len(sp)} SamplingParams for {n} prompts; give one or one per prompt")
        return sp

    def _run_request(self, prompt: str | None, ids: list[int], sp: SamplingParams) -> RequestOutput:
        request_id = str(next(self._request_counter))
        arrival = time.time()
        rng = make_generator(sp.seed, self._rng)
        if self.tokenizer is None and sp.stop_list:
            raise InvalidRequestError("stop strings need the tokenizer (skip_tokenizer_init=True); use stop_token_ids")
        detok = self.tokenizer.backend if self.tokenizer is not None else NoTokenizer()
        gens: list[Generation] = generate_n(self.engine, ids, sp, tokenizer=detok, rng=rng)
        outputs = [
            CompletionOutput(
                index=i,
                text=g.text,
                token_ids=g.token_ids,
                cumulative_logprob=g.cumulative_logprob,
                logprobs=g.logprobs,
                finish_reason=g.finish_reason,
                stop_reason=g.stop_reason,
            )
            for i, g in enumerate(gens)
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=gens[0].prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=_metrics(arrival, gens),
        )


def _metrics(arrival: float, gens: Sequence[Generation]) -> RequestMetrics:
    prefill = sum(g.prefill_time for g in gens)
    decode = sum(g.decode_time for g in gens)
    prefill_tokens = sum(len(g.prompt_token_ids) for g in gens)
    steps = sum(g.num_decode_steps for g in gens)
    ttft = gens[0].time_to_first_token
    return RequestMetrics(
        arrival_time=arrival,
        first_token_time=arrival + ttft,
        finished_time=time.time(),
        time_to_first_token=ttft,
        prefill_time=prefill,
        decode_time=decode,
        sample_time=sum(g.sample_time for g in gens),
        num_prompt_tokens=len(gens[0].prompt_token_ids),
        num_prefill_tokens=prefill_tokens,
        num_generated_tokens=sum(len(g.token_ids) for g in gens),
        num_decode_steps=steps,
        prefill_tokens_per_s=prefill_tokens / prefill if prefill > 0 else None,
        decode_tokens_per_s=steps / decode if decode > 0 else None,
    )
