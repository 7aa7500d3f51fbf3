"""``LLM(model, skip_tokenizer_init=True)`` (vLLM's option) runs an artifact that has no tokenizer.json
(a torch.onnx export has none): token-id prompts in, token ids and empty text out, ``logits`` as usual.
Issue 22 item 8."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.errors import ArtifactError
from perfx_compiler.llm import LLM
from perfx_compiler.runtime.api import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def no_tokenizer_artifact(tmp_path_factory):
    """A tiny model compiled from a description without a tokenizer (what an ONNX export without
    PerfX's tokenizer metadata gives)."""
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    root = tmp_path_factory.mktemp("notok")
    path, _ = write_tiny_gguf(root / "m.gguf", context_length=64)
    desc = load_gguf(path)
    desc.tokenizer_json = None
    art = compile_model(desc, "host", root / "art", progress=False, activations="f32")
    assert not (art / "tokenizer.json").exists()
    return art


def test_token_ids_in_token_ids_out(no_tokenizer_artifact):
    from perfx_compiler.runtime.engine import Engine

    with pytest.raises(ArtifactError, match="skip_tokenizer_init=True"):
        LLM(no_tokenizer_artifact)  # the error says how to run it anyway
    llm = LLM(no_tokenizer_artifact, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    prompt = [5, 17, 42, 9, 100]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}, prompt], params)  # vLLM's TokensPrompt, a bare id list
    for out in outs:
        assert out.prompt is None and out.outputs[0].text == ""
        assert len(out.outputs[0].token_ids) == 6
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids

    # the same tokens as greedy decoding on the engine itself, from the same (BOS-prepared) prompt
    engine = Engine(no_tokenizer_artifact, verify=False)
    ids = outs[0].prompt_token_ids
    tok = int(np.argmax(engine.prefill(ids)[-1]))
    want = [tok]
    for _ in range(5):
        tok = int(np.argmax(engine.decode(tok)))
        want.append(tok)
    assert outs[0].outputs[0].token_ids == want

    logits = llm.logits(prompt)
    engine.reset()
    np.testing.assert_array_equal(logits, engine.prefill_all(prompt))
    assert logits.shape == (len(prompt), engine.vocab_size)

    # what needs text says so, in one line
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="stop strings"):
        llm.generate([prompt], SamplingParams(max_tokens=2, stop=["x"]))
