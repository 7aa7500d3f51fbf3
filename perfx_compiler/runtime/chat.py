"""Chat prompts: render the model's Jinja chat template, or ChatML when it has none.

The environment mirrors Hugging Face ``apply_chat_template`` (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a non-escaping ``tojson``,
``raise_exception``, ``strftime_now``) so templates shipped in tokenizer_config.json
render the same text here. jinja2 is imported lazily: plain completion never needs it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

from perfx_compiler.errors import PerfXError

# Used when the artifact carries no template (base models): the widely used ChatML layout.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(PerfXError):
    """The chat template rejected the conversation, or could not be parsed."""


Message = Mapping[str, Any]


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's version: no HTML escaping (jinja's builtin would turn '<' into '\u003c').
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a runtime dependency
        raise ChatTemplateError("chat templates need jinja2; install it with 'pip install jinja2'") from e

    class _GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF marks assistant spans with it): rendered as-is."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the model's chat template does not parse (line {e.lineno}: {_one_line(e.message)}); "
            "pass a chat_template explicitly or prompt without chat"
        ) from e


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """A conversation as a list of plain dicts, each with a string 'role'."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("a conversation must be a list of {'role': ..., 'content': ...} messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role' (and 'content')")
        msg = dict(m)
        msg.setdefault("content", "")
        out.append(msg)
    if not out:
        raise ChatTemplateError("the conversation is empty; give at least one message")
    return out


def is_conversation_list(obj: Any) -> bool:
    """True for a list of conversations (list of lists of messages), False for one conversation."""
    return (
        isinstance(obj, Sequence)
        and not isinstance(obj, (str, bytes))
        and len(obj) > 0
        and all(isinstance(c, Sequence) and not isinstance(c, (str, bytes, Mapping)) for c in obj)
    )


def render_chat(
    messages: Sequence[Message],
    template: str | None = None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template`` (ChatML when None).

    ``extra`` is passed to the template as-is (e.g. ``tools``, ``documents``,
    ``enable_thinking``). Errors raised by the template (``raise_exception``) or
    while rendering become one-line ``ChatTemplateError``s.
    """
    import jinja2

    msgs = validate_messages(messages)
    compiled = _compile(template if template else CHATML_TEMPLATE)
    try:
        return compiled.render(
            messages=msgs,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:
        raise ChatTemplateError(f"rendering the chat template failed: {_one_line(e)}") from e
