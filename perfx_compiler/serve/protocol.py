"""OpenAI-compatible request models and response pieces for ``serve/app.py``.

Request models are strict (``"5"`` is not a number, ``1`` is not a boolean) and
ignore fields they do not know, as vLLM does. vLLM's sampling extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``) are accepted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from perfx_compiler.runtime.sampling import InvalidRequestError, Logprob, SamplingParams

MAX_N = 128
MAX_STOPS = 16
MAX_LOGPROBS = 20


class RequestError(Exception):
    """A request the server rejects: becomes an OpenAI-style error JSON with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise RequestError(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise RequestError(f"at most {MAX_STOPS} stop strings are supported", param="stop")
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
        kw: dict[str, Any] = {
            "n": n,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "seed": self.seed,
            "logprobs": logprobs,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_tokens",
            "stop_token_ids",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
        ):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except InvalidRequestError as e:
            msg = str(e).removeprefix("invalid SamplingParams: ")
            param = msg.split(" ", 1)[0] if msg.split(" ", 1)[0] in kw else None
            raise RequestError(msg, param=param) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # extra keys (name, tool_calls...) reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            msg = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise RequestError(
                            f"message {i}: only text content parts are supported", param=f"messages.{i}.content"
                        )
                    texts.append(part["text"])
                msg["content"] = "".join(texts)
            elif content is None:
                msg["content"] = ""
            out.append(msg)
        return out


# -- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top(entries: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, e) for t, e in entries.items() if e.rank is not None and e.rank <= n]
    return sorted(ranked, key=lambda te: te[1].rank or 0)


def completion_logprobs(
    token_ids: list[int], steps: list[dict[int, Logprob]], n: int, decode: Any, offset: int = 0
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for a run of tokens."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for tok, entries in zip(token_ids, steps, strict=False):
        text = decode(tok)
        tokens.append(text)
        lps.append(entries[tok].logprob)
        tops.append({decode(t): e.logprob for t, e in _top(entries, n)} if n else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Logprob]], n: int, decode: Any) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) for a run of tokens."""

    def item(t: int, lp: float) -> dict[str, Any]:
        text = decode(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for tok, entries in zip(token_ids, steps, strict=False):
        entry = item(tok, entries[tok].logprob)
        entry["top_logprobs"] = [item(t, e.logprob) for t, e in _top(entries, n)]
        content.append(entry)
    return {"content": content}
