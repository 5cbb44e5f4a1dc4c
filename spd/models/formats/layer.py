"""The serving engines' EAGLE-3 draft layer: a Llama decoder layer whose q/k/v read 2d-wide rows, described by the
fields a head's config.json gives (the engines build it from those, whatever the target's own layer class is)."""

from __future__ import annotations

from spd.errors import UserError

# the config.json fields that size the draft layer, and what an absent one means (Llama's defaults)
LAYER_FIELDS = {"hidden_size": None, "intermediate_size": None, "num_attention_heads": None,
                "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}


def rope_fields(config) -> dict:
    """rope_theta and rope_scaling as the engines read them, from a transformers config (rope_parameters in
    transformers 5, the two flat fields before)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    return {"rope_theta": float(theta), "rope_scaling": params if params.get("rope_type", "default") != "default" else None}


def layer_fields(config) -> dict:
    """What config.json records of a draft layer built from the target's config (the module's own copy)."""
    out = {key: getattr(config, key) for key in LAYER_FIELDS if key not in ("rope_theta", "rope_scaling")}
    if out["head_dim"] is None:
        out["head_dim"] = config.hidden_size // config.num_attention_heads
    return {**out, **rope_fields(config)}


def read_layer_fields(config: dict, where: str) -> dict:
    """The draft layer's fields from a head's config dict; a required one missing is refused in one line."""
    missing = [k for k, default in LAYER_FIELDS.items() if default is None and k != "head_dim" and k not in config]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}; it does not describe an EAGLE-3 draft layer "
                        "(re-export the head)")
    out = {k: config.get(k, default) for k, default in LAYER_FIELDS.items()}
    if out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["hidden_act"] != "silu":
        raise UserError(f"{where}: hidden_act={out['hidden_act']!r}; the engines' EAGLE-3 layer is Llama's (silu)")
    return out


def llama_layer_parts(fields: dict, vocab_size: int):
    """(config, layer class, rotary class, norm class) of the engines' draft layer, for Eagle3Module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    rope = {"rope_type": "default", **(fields["rope_scaling"] or {}), "rope_theta": fields["rope_theta"]}
    sizes = {k: v for k, v in fields.items() if k not in ("rope_theta", "rope_scaling")}
    config = LlamaConfig(**sizes, rope_parameters=rope, vocab_size=vocab_size, num_hidden_layers=1,
                         attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    return config, LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaRMSNorm
