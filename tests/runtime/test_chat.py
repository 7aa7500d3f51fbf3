"""Chat templates: ChatML fallback, HF-compatible environment, sandboxing, one-line errors."""

from __future__ import annotations

import pytest

from perfx_compiler.errors import PerfXError
from perfx_compiler.runtime.chat import (
    CHATML_TEMPLATE,
    ChatTemplateError,
    is_conversation_list,
    render_chat,
)

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <b>!"},
]

# A Llama-3 style template: bos_token, header tags, raise_exception, generation prompt.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def test_chatml_fallback_exact_text() -> None:
    assert render_chat(CONV) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <b>!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(CONV, None, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert render_chat(CONV, "") == render_chat(CONV, CHATML_TEMPLATE)


def test_model_template_with_bos_and_generation_prompt() -> None:
    out = render_chat(CONV, LLAMA3, bos_token="<|begin_of_text|>")
    assert out.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert out.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "<b>" in out  # no HTML autoescaping


def test_raise_exception_becomes_one_line_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError) as ei:
        render_chat([{"role": "tool\nx", "content": "x"}], LLAMA3)
    assert isinstance(ei.value, PerfXError)
    assert "Unknown role" in str(ei.value) and "\n" not in str(ei.value)


def test_syntax_error_is_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat(CONV, "{% for m in messages %}{{ m.content }")


def test_sandbox_blocks_attribute_escapes() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_chat(CONV, evil)
    with pytest.raises(ChatTemplateError):  # immutable sandbox: no mutating the caller's data
        render_chat(CONV, "{{ messages.append(1) }}")


def test_hf_environment_features() -> None:
    tpl = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{% generation %}[gen]{% endgeneration %}"
        "{{ strftime_now('%Y') | length }}"
        "{{ tools | tojson }}"
    )
    out = render_chat(CONV, tpl, tools=[{"name": "<f>"}])
    assert out == '{"role": "system", "content": "Be brief."}[gen]4[{"name": "<f>"}]'


def test_missing_content_defaults_to_empty_and_input_is_not_mutated() -> None:
    conv = [{"role": "user"}]
    assert "user\n<|im_end|>" in render_chat(conv)
    assert conv == [{"role": "user"}]


@pytest.mark.parametrize("bad", ["hello", [], [{"content": "no role"}], [["nested"]]])
def test_bad_conversations(bad) -> None:
    with pytest.raises(ChatTemplateError) as ei:
        render_chat(bad)
    assert "\n" not in str(ei.value)


def test_is_conversation_list() -> None:
    assert not is_conversation_list(CONV)
    assert is_conversation_list([CONV, CONV])
    assert not is_conversation_list("text")
    assert not is_conversation_list([])
