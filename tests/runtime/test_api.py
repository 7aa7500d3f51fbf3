"""The vLLM-shaped API (LLM / SamplingParams / RequestOutput) and perfx-run, on FakeEngines."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import perfx_compiler
from perfx_compiler import llm as api
from perfx_compiler.cli import run as cli
from perfx_compiler.errors import ContextLengthError
from perfx_compiler.llm import LLM
from perfx_compiler.runtime.api import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
)
from perfx_compiler.runtime.sampling import InvalidRequestError

SCRIPT = "hello world 😀 café, bye"


def test_package_exports_lazily() -> None:
    assert perfx_compiler.__version__ == "0.1.0"
    from perfx_compiler import LLM as L
    from perfx_compiler import CompletionOutput as C
    from perfx_compiler import RequestOutput as R
    from perfx_compiler import SamplingParams as S

    assert (L, S, R, C) == (LLM, SamplingParams, RequestOutput, CompletionOutput)
    assert "LLM" in dir(perfx_compiler)
    with pytest.raises(AttributeError):
        perfx_compiler.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("last_only", [False, True])
def test_generate_returns_vllm_shaped_outputs(fake_artifacts, last_only) -> None:
    llm = LLM(str(fake_artifacts(SCRIPT, last_only=last_only)))
    outs = llm.generate(["Hi", "Yo"], SamplingParams(temperature=0.0, max_tokens=50))
    assert len(outs) == 2 and all(isinstance(o, RequestOutput) for o in outs)
    o = outs[0]
    assert o.request_id != outs[1].request_id and o.prompt == "Hi" and o.finished
    bos = llm.get_tokenizer().bos_token_id
    assert o.prompt_token_ids == [bos, *llm.get_tokenizer().encode("Hi")]
    c = o.outputs[0]
    assert isinstance(c, CompletionOutput) and c.index == 0
    assert c.text == SCRIPT and c.finish_reason == "stop" and c.stop_reason is None
    assert c.cumulative_logprob is None and c.logprobs is None
    m = o.metrics
    assert m.prefill_tokens_per_s > 0 and m.decode_tokens_per_s > 0 and m.time_to_first_token > 0
    assert m.num_prompt_tokens == len(o.prompt_token_ids) and m.num_generated_tokens == len(c.token_ids)


def test_prompt_forms(fake_artifacts) -> None:
    llm = LLM(str(fake_artifacts(SCRIPT)))
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    ids = llm.get_tokenizer().encode("Hi")
    by_text = llm.generate("Hi", sp)[0]
    assert llm.generate([ids], sp)[0].outputs[0].token_ids == by_text.outputs[0].token_ids
    assert llm.generate(ids, sp)[0].prompt is None  # a flat id list is one prompt
    assert llm.generate({"prompt_token_ids": ids}, sp)[0].prompt_token_ids == by_text.prompt_token_ids
    assert llm.generate({"prompt": "Hi"}, sp)[0].prompt == "Hi"
    assert len(llm.generate(["a", "b"], [sp, SamplingParams(max_tokens=1)])[1].outputs[0].token_ids) == 1
    with pytest.raises(InvalidRequestError):
        llm.generate(["a", "b"], [sp])
    assert len(llm.generate("Hi")[0].outputs[0].token_ids) <= 16  # default SamplingParams


def test_n_and_seed_reproducibility(fake_artifacts) -> None:
    art = str(fake_artifacts())
    sp = SamplingParams(n=3, temperature=1.0, top_k=50, max_tokens=8, seed=42)
    a = LLM(art).generate("Hi", sp)[0]
    b = LLM(art).generate("Hi", sp)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    # Unseeded requests are reproducible through the LLM's seed, and differ across seeds.
    free = SamplingParams(temperature=1.0, max_tokens=8)
    assert LLM(art, seed=1).generate("Hi", free)[0].outputs[0].token_ids == \
        LLM(art, seed=1).generate("Hi", free)[0].outputs[0].token_ids
    assert LLM(art, seed=1).generate("Hi", free)[0].outputs[0].token_ids != \
        LLM(art, seed=2).generate("Hi", free)[0].outputs[0].token_ids


def test_logprobs_requested(fake_artifacts) -> None:
    llm = LLM(str(fake_artifacts(SCRIPT)))
    c = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=3, logprobs=1))[0].outputs[0]
    assert len(c.logprobs) == 3 and c.cumulative_logprob <= 0


@pytest.mark.parametrize("last_only", [False, True])
def test_logits_every_position(fake_artifacts, last_only) -> None:
    llm = LLM(str(fake_artifacts(max_context=8, last_only=last_only)))
    out = llm.logits([104, 105, 106])
    assert out.shape == (3, llm.get_tokenizer().vocab_size) and out.dtype == np.float32
    assert np.array_equal(out[0], llm.engine.table[104])
    assert np.array_equal(llm.logits([104])[0], out[0])  # cache was reset
    with pytest.raises(ContextLengthError):
        llm.logits(list(range(9)))


def test_context_overflow_is_one_line(fake_artifacts) -> None:
    llm = LLM(str(fake_artifacts(max_context=8)))
    with pytest.raises(ContextLengthError) as ei:
        llm.generate("hello world, this is long")
    assert "\n" not in str(ei.value) and "max context of 8" in str(ei.value)


def test_chat_uses_model_template_or_chatml(fake_artifacts) -> None:
    llm = LLM(str(fake_artifacts(SCRIPT)))
    msgs = [{"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=2))
    assert out[0].prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert len(llm.chat([msgs, msgs])) == 2
    tpl = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    llm2 = LLM(str(fake_artifacts(SCRIPT, chat_template=tpl)))
    r = llm2.chat(msgs, add_generation_prompt=False)[0]
    assert r.prompt == "<s>[user] Hi\n"
    bos = llm2.get_tokenizer().bos_token_id
    assert r.prompt_token_ids.count(bos) == 1  # the template's BOS is not doubled


def test_tokenizer_facade(fake_artifacts) -> None:
    tok = LLM(str(fake_artifacts())).get_tokenizer()
    assert tok.decode(tok.encode("héllo 😀")) == "héllo 😀"
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)


def test_non_artifact_model_is_compiled_once_and_cached(monkeypatch, tmp_path, fake_artifacts, tokenizer) -> None:
    # by path: several test folders have a module named conftest
    import importlib.util

    spec = importlib.util.spec_from_file_location("runtime_conftest", Path(__file__).with_name("conftest.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    write_artifact = helpers.write_artifact

    calls = []

    def compile_model(model, target="host", output_dir=None, **options):
        calls.append((model, target, *options.values()))
        return write_artifact(Path(output_dir), tokenizer)

    monkeypatch.setitem(sys.modules, "perfx_compiler.pipeline", types.SimpleNamespace(compile_model=compile_model))
    cache = tmp_path / "cache"
    a = LLM("hf:some/model", target="x86-avx2", cache_dir=cache)
    b = LLM("hf:some/model", target="x86-avx2", cache_dir=cache)
    assert calls == [("hf:some/model", "x86-avx2")]
    assert a.artifact_dir == b.artifact_dir and a.artifact_dir.parent == cache
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp dirs left
    LLM("hf:some/model", target="host", cache_dir=cache)  # another target is another artifact
    LLM("hf:some/model", target="host", cache_dir=cache, max_context=128)  # options are in the key
    assert calls[1:] == [("hf:some/model", "host"), ("hf:some/model", "host", 128)]
    with pytest.warns(UserWarning, match="already compiled"):
        LLM(str(a.artifact_dir), max_context=64)


def test_default_cache_root_honours_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PERFX_CACHE_DIR", str(tmp_path))
    assert api.default_cache_root() == tmp_path
    monkeypatch.delenv("PERFX_CACHE_DIR")
    assert api.default_cache_root() == Path.home() / ".cache" / "perfx" / "artifacts"


# -- perfx-run ------------------------------------------------------------------------------------


def test_cli_json_schema(fake_artifacts, capsys) -> None:
    art = str(fake_artifacts(SCRIPT))
    assert cli.main([art, "--prompt", "Hi", "--max-tokens", "40", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "prompt_token_ids", "prefill_tokens_per_s", "decode_tokens_per_s",
            "finish_reason"} <= set(doc)
    assert doc["text"] == SCRIPT and doc["finish_reason"] == "stop"
    assert all(isinstance(t, int) for t in doc["token_ids"] + doc["prompt_token_ids"])
    assert doc["prefill_tokens_per_s"] > 0 and doc["decode_tokens_per_s"] > 0


def test_cli_plain_output_and_sampling_flags(fake_artifacts, capsys) -> None:
    art = str(fake_artifacts(SCRIPT))
    argv = [art, "--prompt", "Hi", "--max-tokens", "40", "--stop", "o w", "--temperature", "0"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "hell"
    assert "prefill:" in lines[-1] and "decode:" in lines[-1] and "tok/s" in lines[-1]
    seeded = [art, "--prompt", "Hi", "--max-tokens", "5", "--temperature", "1", "--top-p", "0.9",
              "--top-k", "40", "--seed", "3", "--json", "--chat", "--no-verify"]
    cli.main(seeded)
    first = json.loads(capsys.readouterr().out)["token_ids"]
    cli.main(seeded)
    assert json.loads(capsys.readouterr().out)["token_ids"] == first


def test_cli_user_error_is_one_line_exit_2(fake_artifacts, capsys) -> None:
    art = str(fake_artifacts(max_context=4))
    assert cli.main([art, "--prompt", "a long prompt here", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("perfx-run: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert cli.main([art, "--prompt", "a long prompt here", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert cli.main([art, "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_cache_key_follows_the_compiler_files(monkeypatch) -> None:
    """An edited compiler, template, target file or tuning record must not reuse an artifact cached by the
    old one: the digest of those files is part of LLM()'s cache key."""
    digest = api.compiler_digest()
    assert len(digest) == 12 and digest == api.compiler_digest()
    key = api.cache_key("smollm2-135m", "host", {"max_context": 64})
    monkeypatch.setattr(api, "compiler_digest", lambda: "0" * 12)
    assert api.cache_key("smollm2-135m", "host", {"max_context": 64}) != key
