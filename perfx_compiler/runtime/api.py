"""The runtime side of the vLLM-shaped API: ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``,
the model's ``Tokenizer`` and ``load_engine``. ``LLM`` itself lives in ``perfx_compiler/llm.py``, above the
compiler, because it compiles a model it is given; this module imports no compiler code.

Importing this module is cheap: the engine (TVM runtime) loads in ``load_engine``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfx_compiler.errors import ArtifactError
from perfx_compiler.heap import trim_heap
from perfx_compiler.runtime.chat import (
    ChatTemplateError,
    render_chat,
)
from perfx_compiler.runtime.sampling import (
    InvalidRequestError,
    Logprob,
    SamplingParams,
)

__all__ = [
    "ChatTemplateError",
    "CompletionOutput",
    "InvalidRequestError",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "load_engine",
]

CONFIG_NAME = "perfx-config.json"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of one request (seconds; tok/s over engine time only, summed over its n sequences)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    time_to_first_token: float | None = None
    prefill_time: float = 0.0
    decode_time: float = 0.0
    sample_time: float = 0.0
    num_prompt_tokens: int = 0
    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_steps: int = 0
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt_logprobs: None = None  # vLLM attribute; prompt logprobs are not computed


class Tokenizer:
    """A small HF-like face over ``tokenizers.Tokenizer`` that knows the model's special tokens."""

    def __init__(self, backend: Any, model_info: Mapping[str, Any], chat_template: str | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id: int | None = model_info.get("bos_token_id")
        eos = model_info.get("eos_token_ids") or []
        self.eos_token_ids: list[int] = [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.add_bos_token = bool(model_info.get("add_bos_token", False))
        self.bos_token = self._token_text(self.bos_token_id)
        self.eos_token = self._token_text(self.eos_token_id)

    @classmethod
    def from_file(cls, path: str | Path, model_info: Mapping[str, Any], chat_template: str | None = None) -> Tokenizer:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise ArtifactError(
                f"tokenizer file {path} is missing; recompile from a model that has a tokenizer, or run "
                "on token ids with LLM(..., skip_tokenizer_init=True)"
            )
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise ArtifactError(f"tokenizer file {path} cannot be read ({e}); recompile the model") from e
        # tokenizers parses the file through a JSON value tree and frees it; glibc would keep that heap (~190 MB
        # for Gemma 3's 262k-piece vocabulary, twice the tokenizer itself) for as long as the model runs.
        trim_heap()
        return cls(backend, model_info, chat_template)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.backend.id_to_token(int(token_id)) or ""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. BOS is added by the generation loop, per the model's manifest."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        text = render_chat(
            conversation,
            chat_template or self.chat_template,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return self.encode(text) if tokenize else text


class NoTokenizer:
    """The detokenizer of an ``LLM`` made with ``skip_tokenizer_init``: every text is empty (vLLM's
    outputs carry token ids only then)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def load_engine(artifact_dir: str | Path, *, verify: bool = True) -> Any:
    """Load a compiled artifact. Tests replace this to run the API without TVM."""
    from perfx_compiler.runtime.engine import Engine  # imports the TVM runtime

    return Engine(artifact_dir, verify=verify)
