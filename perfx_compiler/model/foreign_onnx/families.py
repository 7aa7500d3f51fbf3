"""Which decoder families the foreign-ONNX reader recovers, and the check that keeps it from
mis-reading one silently.

The graph shows most features by its structure (``graph_features``); what it cannot show reliably
(which layers slide, the window, the sliding layers' RoPE base) comes from the config.json next to
the file, read by the family's own ``hf_features`` (``model/families/``). When config.json names an
architecture, every feature the graph shows must be the one the family's config gives: a
difference means the reader missed something, and the file is refused in one line.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from perfx_compiler.errors import UnsupportedModelError
from perfx_compiler.model.description import FEATURE_DEFAULTS, FEATURES, ModelConfig
from perfx_compiler.model.families import family_for_hf_class, hf_classes
from perfx_compiler.model.families._family import Family, HFConfig, missing_features

# features the graph shows, and the defaults of a model without them (ModelConfig's)
GRAPH_FEATURES: dict[str, Any] = {k: FEATURE_DEFAULTS[k] for k in (
    "qk_norm", "sandwich_norms", "mlp_activation", "embedding_scale", "query_scale", "attn_softcap", "final_softcap",
    "rotary_dim")}
# features only config.json gives (checked against the graph where it can tell)
CONFIG_FEATURES = ("sliding_window", "sliding_layers", "rope_local_theta")
# A family whose config sets a feature outside these (one added to ModelConfig later) is refused until
# the reader learns it: no list of families here, a new family folder with known features just reads.
RECOVERED = (*GRAPH_FEATURES, *CONFIG_FEATURES)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_ADVICE = "compile the model's Hugging Face folder or GGUF instead"


def hf_family(hf: dict[str, Any], source: str) -> Family | None:
    """The family config.json names (None without an architecture); unknown or not read from ONNX: refused."""
    archs = hf.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        return None
    family = family_for_hf_class(archs[0])
    if family is None:
        missing = missing_features(hf)
        detail = f" (it needs {', '.join(missing)})" if missing else ""
        raise UnsupportedModelError(f"{source}: config.json names architecture '{archs[0]}'{detail}, which PerfX "
                                    f"does not read; it reads {', '.join(hf_classes())}")
    unrecovered = [f for f in family_features(family, hf) if f in FEATURES and f not in RECOVERED]
    if unrecovered:
        raise UnsupportedModelError(
            f"{source}: config.json names {archs[0]} ({family.name}), whose features "
            f"({', '.join(unrecovered)}) the ONNX reader does not recover; {_ADVICE}")
    return family


def family_features(family: Family, hf: dict[str, Any]) -> list[str]:
    """The features (beyond Llama's) config.json gives the family, by name."""
    defaults = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
    defaults.update(sliding_layers=[], mlp_activation="silu")
    defaults.pop("tie_word_embeddings")  # a layout choice, not a feature
    names = sorted(k for k, v in expected_features(family, hf).items() if k in defaults and defaults[k] != v)
    return names + (["interleaved RoPE"] if family.hf_rope_layout == "interleaved" else [])


def expected_features(family: Family, hf: dict[str, Any]) -> dict[str, Any]:
    """The features config.json gives the family (GRAPH_FEATURES' defaults where it sets none)."""
    out = dict(GRAPH_FEATURES)
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    out["mlp_activation"] = _ACTIVATIONS.get(act, act)
    out.update(family.hf_features(HFConfig(hf)))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-6 * max(abs(float(a)), abs(float(b)), 1e-30)
    return a == b


def reconcile(family: Family, hf: dict[str, Any], found: dict[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """The features to use: the graph's, each checked against the family's config.json (in the config's
    exact spelling once equal); plus the config-only ones. A difference: UnsupportedModelError."""
    want = expected_features(family, hf)
    found = dict(found)
    layout = "interleaved" if found.pop("interleaved", False) else "rotate_half"
    out = dict(found)
    wrong = []
    if layout != family.hf_rope_layout:
        wrong.append(f"RoPE pairs (config {family.hf_rope_layout}, graph {layout})")
    for key in GRAPH_FEATURES:
        got, exp = found[key], want[key]
        if key == "rotary_dim":  # full rotary: 0 or head_dim alike
            got, exp = got or head_dim, exp or head_dim
        elif key == "query_scale":
            got, exp = got or head_dim ** -0.5, exp or head_dim ** -0.5
        if not _same(got, exp):
            wrong.append(f"{key} (config {want[key]!r}, graph {found[key]!r})")
        out[key] = want[key]
    if wrong:
        raise UnsupportedModelError(
            f"{source}: config.json names {family.hf_classes[0]}, but the graph differs from it in {', '.join(wrong)}: "
            f"the ONNX reader did not recover this model's structure; {_ADVICE}")
    if want.get("attention_bias"):
        out["attention_bias"] = True  # zero biases where the graph has none (Qwen2 always declares them)
    for key in CONFIG_FEATURES:
        if key in want:
            out[key] = want[key]
    local = found.get("rope_local_theta", 0.0)
    if local and not _same(local, out.get("rope_local_theta", 0.0)) or bool(local) != bool(out.get("rope_local_theta")):
        raise UnsupportedModelError(
            f"{source}: the graph's sliding-layer RoPE base {local or 'none'} is not config.json's "
            f"{out.get('rope_local_theta') or 'none'}; {_ADVICE}")
    return out


# what a decoder without config.json may show: none of these come with per-layer windows in any family
_SAFE_WITHOUT_CONFIG = ("qk_norm",)


def check_without_config(found: dict[str, Any], source: str) -> None:
    """A graph with no config.json naming its architecture: refuse features that come with what only the
    config tells (Gemma's sliding layers and window, Phi-3's window), rather than run them without it."""
    extra = sorted(k for k, v in GRAPH_FEATURES.items() if k not in _SAFE_WITHOUT_CONFIG and found[k] != v)
    if found.get("rope_local_theta"):
        extra.append("a second RoPE base (sliding layers)")
    if extra:
        raise UnsupportedModelError(
            f"{source}: the graph shows {', '.join(extra)}, but no config.json next to it names the architecture, "
            "and which layers use a sliding window (and its size) cannot be read from the graph; put the model's "
            f"config.json next to the .onnx file, or {_ADVICE}")
