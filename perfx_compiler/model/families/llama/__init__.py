"""Llama 2/3.x (and SmolLM2, TinyLlama...): the base decoder; llama.cpp permutes its Q/K rows."""

from perfx_compiler.model.families._family import Family

FAMILY = Family(
    name="llama",
    hf_classes=("LlamaForCausalLM",),
    gguf_archs=("llama",),
    gguf_rope_layout="interleaved",
)
