"""EAGLE-3 heads in the layouts serving engines load, both ways: this suite's module written as the engines' files,
and their files read as this suite's module.

Two layouts (docs/training.md, "Sharing heads"):
- **hf** (what SGLang and vLLM load as `LlamaForCausalLMEagle3`): the layer's tensors under `midlayer.`, `fc`,
  `norm`, `lm_head` over the draft vocabulary, `d2t` (target id - draft id, int64) and `t2d` (bool over the
  target's vocabulary); no embedding (both engines use the target's).
- **speculators** (vLLM's `Eagle3Speculator`): the same tensors with the layer under `layers.0.` and the target's
  embedding as `embed_tokens`; config.json splits into `transformer_layer_config` and `speculators_config`.

Fused layers. This suite's H^k is the state entering layer k (H^0 the embedding), which is vLLM's convention for
`eagle_aux_hidden_state_layer_ids` (id k = HF `hidden_states[k]`). SGLang reads only `eagle_config`'s ids and adds
1 to them (every version since the +1 became conditional adds it when the first id is 1), so the hf layout writes
both: vLLM's ids at the top level and k - 1 under `eagle_config` (first id 1: this suite's default fuses the inputs
of layers 2, L//2, L-3). Reading a head, the top-level ids win; `eagle_config`'s get SGLang's rule; none means
the engines' default (2, L//2, L-3).

The module mapped: `embed_norm` is the engines' `input_layernorm` (it norms the embedding), `hidden_norm` theirs,
the residual stream is the un-normed h (`norm_before_residual: false`), and the target layer's own
`input_layernorm` is never used by the draft, so it is not written (and reads back as ones).
"""

from __future__ import annotations

import os

import torch

from spd.errors import UserError
from spd.models.formats.layer import layer_fields, read_layer_fields

HF, SPECULATORS = "hf", "speculators"
FORMATS = {"sglang": HF, "vllm": HF, "speculators": SPECULATORS}   # what --format takes, and the layout it writes
HF_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LAYER_PREFIX = {HF: "midlayer.", SPECULATORS: "layers.0."}

# this suite's module keys -> the engines' (the layer's under LAYER_PREFIX); draft_to_target becomes d2t and t2d
SHARED = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "head.weight": "lm_head.weight"}
LAYER = {"embed_norm.weight": "input_layernorm.weight", "hidden_norm.weight": "hidden_norm.weight",
         "layer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
         **{f"layer.self_attn.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
         **{f"layer.mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}
UNUSED = ("layer.input_layernorm.weight",)   # the target layer's own input norm: the draft norms its two inputs itself
# EAGLE 3.1's options: norms this suite's module has no place for
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def engine_keys(layout: str) -> dict[str, str]:
    """This suite's key -> the layout's key."""
    return {**SHARED, **{ours: LAYER_PREFIX[layout] + theirs for ours, theirs in LAYER.items()}}


# ------------------------------------------------------------------------------------------------ export
def expressible(module, layout: str) -> None:
    """Refuse, naming the field, a module the engines' Llama layer cannot hold (a Qwen3 layer's q/k norms, Gemma's
    sandwich norms, Qwen3.5's output gate and (1 + w) norms, biases, another activation)."""
    known = set(engine_keys(layout)) | set(UNUSED) | {"draft_to_target"}
    extra = sorted(k for k in module.state_dict() if k not in known)
    if extra:
        raise UserError(f"the module's {extra[0]} has no place in the {layout} layout (its draft layer is Llama's, "
                        f"without {'q/k norms' if 'norm' in extra[0] else 'that tensor'}); this target's heads stay in "
                        "this suite's format")
    act = getattr(module.config, "hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act={act!r} has no place in the {layout} layout (its draft layer is Llama's, silu)")
    attn = module.layer.self_attn
    if attn.q_proj.out_features == 2 * attn.config.num_attention_heads * attn.head_dim:
        raise UserError(f"the module's gated attention (Qwen3.5: q_proj gives each head an output gate) has no place "
                        f"in the {layout} layout (its draft layer is Llama's)")
    if any(family in type(module.norm).__name__ for family in ("Gemma", "Qwen3_5")):
        raise UserError(f"the module's (1 + w) RMSNorm has no place in the {layout} layout (Llama's norm scales by w)")
    fused = list(module.fused)
    if fused != sorted(set(fused)) or fused[0] != 2:
        raise UserError(f"fused layers {fused} cannot be written so that vLLM and every SGLang version read the same "
                        "layers (they must rise from 2)")


def vocab_maps(module, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t [V_draft] int64 (target id - draft id) and t2d [V] bool."""
    draft_to_target = module.draft_to_target
    if draft_to_target is None:
        draft_to_target = torch.arange(vocab)
    draft_to_target = draft_to_target.cpu().long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    return draft_to_target - torch.arange(draft_to_target.numel()), t2d


def engine_state(module, layout: str, embedding: torch.Tensor | None) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    out = {theirs: state[ours].detach().cpu().contiguous() for ours, theirs in engine_keys(layout).items()}
    out["d2t"], out["t2d"] = vocab_maps(module, module.target_vocab_size)
    if layout == SPECULATORS:
        out["embed_tokens.weight"] = embedding.detach().cpu().to(out["fc.weight"].dtype).contiguous()
    return out


def engine_config(module, layout: str, target_config, verifier: str, speculative_tokens: int) -> dict:
    d = target_config.hidden_size
    draft_vocab = module.head.weight.shape[0]
    dtype = str(module.fc.weight.dtype).removeprefix("torch.")
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **layer_fields(module.config),
             "vocab_size": target_config.vocab_size, "num_hidden_layers": 1, "tie_word_embeddings": False,
             "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype}
    vllm_ids = [int(k) for k in module.fused]
    if layout == HF:
        return {**layer, "architectures": [HF_ARCHITECTURES[0]], "draft_vocab_size": draft_vocab,
                "target_hidden_size": d, "norm_before_residual": False,
                "eagle_aux_hidden_state_layer_ids": vllm_ids,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in vllm_ids],
                                 "use_aux_hidden_state": True},
                "spd_verifier": verifier}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "target_hidden_size": d,
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": vllm_ids, "torch_dtype": dtype,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(target_config.architectures or [])}}}


def write_head(module, fmt: str, out: str, target_config, embedding: torch.Tensor, verifier: str,
               speculative_tokens: int = 3) -> dict:
    """Write `module` (an Eagle3Module) into `out` in `fmt` (sglang, vllm, speculators): into a temporary sibling,
    then renamed over `out`, so a refused or failed export leaves nothing. Returns the written config."""
    from spd.models.weights_dir import write_weights_dir

    if fmt not in FORMATS:
        raise UserError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    layout = FORMATS[fmt]
    expressible(module, layout)
    state = engine_state(module, layout, embedding)
    config = engine_config(module, layout, target_config, verifier, speculative_tokens)
    write_weights_dir(out, state, config, {"format": "pt"})
    return config


# ------------------------------------------------------------------------------------------------ import
def layout_of(raw: dict) -> str | None:
    """The engine layout a config.json describes, or None."""
    if "speculators_model_type" in raw:
        return SPECULATORS
    if any(a in HF_ARCHITECTURES for a in raw.get("architectures") or []):
        return HF
    return None


def aux_ids(raw: dict, where: str) -> list[int] | None:
    """The fused layers as this suite's H^k (vLLM's convention) from a head's config; None: the engines' default."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(k) for k in ids]
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:   # SGLang's: the output of layer k (it adds 1 when the first id is 1)
        return [int(k) + 1 for k in ids] if int(ids[0]) == 1 else [int(k) for k in ids]
    return None


def head_config(path: str, raw: dict) -> dict:
    """This suite's checkpoint config for an engine-format head at `path` (its config.json already parsed)."""
    layout = layout_of(raw)
    where = os.path.join(path, "config.json")
    if layout == SPECULATORS:
        if raw["speculators_model_type"] != "eagle3":
            raise UserError(f"{where} is a speculators {raw['speculators_model_type']!r} head; this suite reads "
                            "eagle3 heads")
        layer_raw = raw.get("transformer_layer_config")
        if not isinstance(layer_raw, dict):
            raise UserError(f"{where} lacks transformer_layer_config; it is not a complete speculators head")
        if "norm_before_residual" not in raw:
            raise UserError(f"{where} lacks norm_before_residual (vLLM reads true, speculators false); add it to say "
                            "which residual the head was trained with")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    else:
        layer_raw = raw
        verifier = raw.get("spd_verifier")
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise UserError(f"{where}: num_hidden_layers={raw['num_hidden_layers']}; an EAGLE-3 head has one layer")
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise UserError(f"{where} sets {flag}=true; this suite's EAGLE-3 module has no place for it (its "
                            "residual is the un-normed state, with no extra norms)")
    layer = read_layer_fields(layer_raw, where)
    vocab = layer_raw.get("vocab_size")
    if vocab is None:
        raise UserError(f"{where} lacks vocab_size (the target's vocabulary); it is not a complete EAGLE-3 head")
    target_hidden = raw.get("target_hidden_size") or layer["hidden_size"]
    return {"format": layout, "method": "eagle3", "n": 1, "stage_bounds": None, "module_layers": 1,
            "fused_layers": aux_ids(raw, where), "draft_vocab_size": raw.get("draft_vocab_size"),
            "draft_layer": layer,
            "target": {"name": verifier or "(not recorded)", "hidden_size": int(target_hidden),
                       "vocab_size": int(vocab)}}


def check_head_target(path: str, cfg: dict, target) -> None:
    """An engine-format head carries no fingerprint: it runs on a target of its sizes (hidden size, vocabulary,
    the fused layers inside it); its embedding, where it ships one, must be the target's."""
    config = target.model.config
    ident, d, layer = cfg["target"], config.hidden_size, cfg["draft_layer"]
    for what, theirs, ours in (("hidden size", ident["hidden_size"], d), ("vocabulary", ident["vocab_size"],
                                                                            config.vocab_size),
                               ("draft layer width", layer["hidden_size"], d)):
        if theirs != ours:
            raise UserError(f"head {path!r} was trained for a target with {what} {theirs} ({ident['name']}), "
                            f"this target has {ours}; use the head's own target=")
    num_layers = config.num_hidden_layers
    if cfg["fused_layers"] is None:   # the engines' default, for this target
        from spd.models.eagle3 import fused_layers

        cfg["fused_layers"] = list(fused_layers(num_layers))
    bad = [k for k in cfg["fused_layers"] if not 0 <= k < num_layers]
    if bad:
        raise UserError(f"head {path!r} fuses layer {bad[0]}, which a target of {num_layers} layers does not have; "
                        "use the head's own target=")
    cfg["stage_bounds"] = [0, num_layers]


def weights_file(path: str) -> str:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise UserError(f"head {path!r} has no model.safetensors (or pytorch_model.bin); it is not a complete head")


def stored_dtype(path: str) -> torch.dtype:
    """The dtype a checkpoint's (or a head's) fc weight is stored in."""
    from safetensors import safe_open

    weights = weights_file(path)   # this suite's checkpoints use the same file name
    if not weights.endswith(".safetensors"):
        return read_tensors(path)["fc.weight"].dtype
    with safe_open(weights, "pt") as f:
        return f.get_tensor("fc.weight").dtype


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = weights_file(path)
    try:
        return load_file(weights) if weights.endswith(".safetensors") else \
            torch.load(weights, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise UserError(f"{weights} is corrupt ({str(exc).splitlines()[0]}); re-export the head") from None


def head_state(path: str, cfg: dict, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """This suite's module state (and the draft-vocabulary map) from an engine-format head's tensors."""
    tensors = read_tensors(path)
    layout = cfg["format"]
    if layout == HF and not any(k.startswith("midlayer.") for k in tensors):
        layout = SPECULATORS   # vLLM also reads an hf head whose layer is under layers.0.
    keys = engine_keys(layout)
    missing = [theirs for theirs in keys.values() if theirs not in tensors]
    if missing:
        raise UserError(f"{weights_file(path)} lacks {missing[0]}; it is not a complete EAGLE-3 head")
    extra = sorted(set(tensors) - set(keys.values()) - {"d2t", "t2d", "embed_tokens.weight"})
    if extra:
        raise UserError(f"{weights_file(path)} holds {extra[0]}, which this suite's EAGLE-3 module has no place for")
    state = {ours: tensors[theirs] for ours, theirs in keys.items()}
    state["layer.input_layernorm.weight"] = torch.ones_like(state["norm.weight"])   # never read by the draft
    draft_vocab = state["head.weight"].shape[0]
    if "d2t" in tensors:
        draft_to_target = tensors["d2t"].long() + torch.arange(draft_vocab)
    elif draft_vocab == embedding.shape[0]:
        draft_to_target = None
    else:
        raise UserError(f"{weights_file(path)} has a {draft_vocab}-token head and no d2t; it is not a complete head")
    if draft_to_target is not None:
        if draft_to_target.numel() != draft_vocab or draft_to_target.min() < 0 or \
                draft_to_target.max() >= embedding.shape[0]:
            raise UserError(f"{weights_file(path)}: d2t does not map its {draft_vocab} draft ids into the target's "
                            f"{embedding.shape[0]}-token vocabulary; re-export the head")
        if "t2d" in tensors and int(tensors["t2d"].sum()) != draft_vocab:
            raise UserError(f"{weights_file(path)}: t2d marks {int(tensors['t2d'].sum())} tokens, d2t {draft_vocab}")
        state["draft_to_target"] = draft_to_target
    own = tensors.get("embed_tokens.weight")
    if own is not None and (own.shape != embedding.shape or
                            not torch.allclose(own.float(), embedding.float().cpu(), atol=1e-2, rtol=1e-2)):
        raise UserError(f"head {path!r} ships an embedding that is not this target's; use the head's own target=")
    cfg["draft_vocab_size"] = None if draft_to_target is None else draft_vocab
    return state
