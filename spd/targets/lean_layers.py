"""A Llama decoder layer's forward as one function on a CPU: the same tensor operations, in the same order, as
transformers' LlamaDecoderLayer, its attention, MLP and RMSNorms (so the same bits — tests/test_lean_layers.py),
without the ~15 module calls, keyword-renaming and kernel-hub wrappers a layer pays for in Python. Where every
product multiplies from panels (float32 or a GGUF's blocks), the work before and after the attention is one C++ call
each (spd/csrc/llama_layer.cpp: the same ATen operators, from C++); the attention and the cache stay in Python, where
the suite's kernels for them are. A one-row step of SmolLM2 over 4-bit blocks spent more time in Python's calls than
in its products.

Only a layer of exactly transformers' Llama classes is swapped (its attention, MLP and norms too): other families
keep their own forward."""

from __future__ import annotations

import weakref

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from spd.targets import own_rows, panel
from spd.targets.kv_cache import LayerKVCache


def _norm(norm: llama.LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward, op for op
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


BEFORE, AFTER = ("q_proj", "k_proj", "v_proj"), ("o_proj", "gate_proj", "up_proj", "down_proj")


def _packs(layer: llama.LlamaDecoderLayer):
    """The layer's seven products as the C++ glue takes them — (panels, outputs, biases, bits) before and after
    the attention, and their level — or None where any of them does not multiply from panels (F.linear, bfloat16).
    Kept on the layer while its weights are the same tensors at the same versions (checked without module lookups:
    a step calls this 30 times)."""
    held = layer.__dict__.get("_lean")
    if held is not None and layer in OWN and all(p["weight"] is w and w._version == v and d.get("_panels") is h
                                for p, d, w, v, h in held[0]):
        return held[1]
    attn, mlp = layer.self_attn, layer.mlp
    modules = [getattr(attn, n) for n in BEFORE] + [getattr(mlp if n != "o_proj" else attn, n) for n in AFTER]
    packs = _pack(modules)
    # what the packs were read from: each weight at its version, and its panels (packed again at another level)
    layer.__dict__["_lean"] = [(m._parameters, m.__dict__, m.weight, m.weight._version, m.__dict__.get("_panels"))
                               for m in modules], packs
    OWN[layer] = _own(layer, packs)
    return packs


# a layer's OwnLayer (a C++ object: kept beside the module, not in it, so the module still deep-copies)
OWN: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def _own(layer: llama.LlamaDecoderLayer, packs):
    """The layer as the C++ OwnLayer (spd.targets.own_rows) where every product reads a GGUF's blocks, else None."""
    attn = layer.self_attn
    if packs is None or not (all(packs[0][3]) and all(packs[1][3])) or "_row_level" not in attn.__dict__:
        return None
    (before, after, level), n1, n2 = packs, layer.input_layernorm, layer.post_attention_layernorm
    return panel._EXT.OwnLayer(n1.weight.detach(), n1.variance_epsilon, *before, n2.weight.detach(),
                               n2.variance_epsilon, *after, level, attn.head_dim, attn.scaling)


def own_layers(layers: list) -> list | None:
    """The layers as OwnLayers (all of them), or None where any is not one. A step asks this for the same layers
    every forward: the answer is kept with what it was read from (each layer's packs, checked as `_packs` checks
    them, in one pass over the stage's weights instead of 30 calls)."""
    held = STACKS.get(layers[0]) if layers else None
    if held is not None and held[0] == tuple(layers) and \
            all(layer.__dict__.get("_lean") is lean for layer, lean in held[2]) and \
            all(p["weight"] is w and w._version == v and d.get("_panels") is h for p, d, w, v, h in held[3]):
        return held[1]
    out = _own_stack(layers)
    if out is not None:
        leans = [(layer, layer.__dict__["_lean"]) for layer in layers]
        STACKS[layers[0]] = tuple(layers), out, leans, [check for _, lean in leans for check in lean[0]]
    return out


# a stage's OwnLayers, keyed by its first layer: (its layers, their OwnLayers, each layer's packs record, the weights
# those were read from)
STACKS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _own_stack(layers: list) -> list | None:
    out = []
    for layer in layers:
        if type(layer) is not LeanLlamaLayer or not layer.silu:
            return None
        _packs(layer)
        own = OWN.get(layer)
        if own is None:
            return None
        out.append(own)
    return out


def run_own(layers: list, owns: list, hidden: torch.Tensor, cache, mask, cos, sin, capture: list[bool]):
    """Layers (their OwnLayers `owns`) over hidden [B, T, d] in one C++ call, the rows appended to `cache` (a
    LayerKVCache, or None); returns the last output and the outputs of the layers `capture` marks."""
    keys, values, starts = [], [], []
    if cache is not None:
        attn = layers[0].self_attn              # a Llama's layers share their key and value shapes
        shape = (*hidden.shape[:1], attn.config.num_key_value_heads, hidden.shape[1], attn.head_dim)
        for layer in layers:
            k, v, start = cache.reserve(layer.self_attn.layer_idx, shape, hidden)
            keys.append(k)
            values.append(v)
            starts.append(start)
    out = panel._EXT.own_layers(hidden, owns, keys, values, starts, mask, cos, sin, capture)
    return out[0], out[1:]


def _pack(modules: list[torch.nn.Module]):
    # q, k, v, o, gate, up, down -> what _packs returns
    packed = []
    for m in modules:
        held = m.__dict__.get("_panels")
        if held is not None and held[0] is m.weight and held[1] == m.weight._version:
            packed.append((held[2], held[4], held[5]))
        elif isinstance(m, panel.PanelLinear) and (again := panel.panels_of(m)) is not None:
            packed.append(again)
        else:
            return None
    if len({level for _, level, _ in packed}) != 1:
        return None
    sides = []
    for part in (slice(0, 3), slice(3, 7)):
        ms, ps = modules[part], packed[part]
        sides.append(([p for p, _, _ in ps], [m.weight.shape[0] for m in ms], [m.bias for m in ms],
                      [b for _, _, b in ps]))
    return sides[0], sides[1], packed[0][1]


class LeanLlamaLayer(llama.LlamaDecoderLayer):
    """LlamaDecoderLayer with its forward written out (the class swapped in place by `lean`)."""

    suite_plain = llama.LlamaDecoderLayer       # transformers' own, for spd.targets.linears.plain_products

    def _attend(self, q, k, v, attention_mask, cache, kwargs: dict) -> torch.Tensor:
        """The rows' keys and values into the cache, and the attention the config names (the suite's kernels)."""
        attn = self.self_attn
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, llama.eager_attention_forward)
        return attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)[0]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}   # what the attention forwards
        packs = _packs(self) if hidden_states.dtype == torch.float32 and self.silu else None
        if packs is not None and not (torch.is_grad_enabled() and hidden_states.requires_grad):
            # the norm, products and rotation in one C++ call, the attention here, the rest in another
            before, after, level = packs
            cos, sin = position_embeddings
            own = OWN.get(self)
            if own is not None and kwargs.get("ragged") is None and type(cache) is LayerKVCache and \
                    cache.write_at is None and attn.config._attn_implementation == own_rows.KERNEL:
                # a GGUF's blocks: the target's own row arithmetic (spd.targets.own_rows), the layer one C++ call
                shape = (hidden_states.shape[0], attn.config.num_key_value_heads, hidden_states.shape[1],
                         attn.head_dim)
                keys, values, start = cache.reserve(attn.layer_idx, shape, hidden_states)
                return own.forward(hidden_states, keys, values, start, attention_mask, cos, sin)
            if own is not None:
                # the same arithmetic around another cache's update or attention (a ragged batch's segments)
                q, k, v = panel._EXT.own_before_attention(
                    hidden_states, self.input_layernorm.weight, self.input_layernorm.variance_epsilon, *before,
                    level, cos, sin, attn.head_dim)
                rest = (hidden_states, self.post_attention_layernorm.weight,
                        self.post_attention_layernorm.variance_epsilon, *after, level)
                return panel._EXT.own_after_attention(self._attend(q, k, v, attention_mask, cache, kwargs), *rest)
            q, k, v = panel._EXT.llama_before_attention(
                hidden_states, self.input_layernorm.weight, self.input_layernorm.variance_epsilon, *before, level,
                cos, sin, attn.head_dim)
            out = self._attend(q, k, v, attention_mask, cache, kwargs)
            return panel._EXT.llama_after_attention(
                out, hidden_states, self.post_attention_layernorm.weight,
                self.post_attention_layernorm.variance_epsilon, *after, level)
        residual = hidden_states                                            # [B, T, d]
        h = _norm(self.input_layernorm, hidden_states)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj.forward(h).view(shape).transpose(1, 2)              # [B, H, T, hd]
        k = attn.k_proj.forward(h).view(shape).transpose(1, 2)              # [B, H_kv, T, hd]
        v = attn.v_proj.forward(h).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                       # [B, 1, T, hd]
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        out = self._attend(q, k, v, attention_mask, cache, kwargs)
        out = attn.o_proj.forward(out.reshape(*shape[:-2], -1).contiguous())
        hidden_states = residual + out
        residual = hidden_states
        h = _norm(self.post_attention_layernorm, hidden_states)
        h = mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
        return residual + h


def _plain(layer: torch.nn.Module) -> bool:
    """A layer of exactly transformers' Llama classes, in eval mode (training keeps transformers' own forward)."""
    return (type(layer) is llama.LlamaDecoderLayer and type(layer.self_attn) is llama.LlamaAttention
            and type(layer.mlp) is llama.LlamaMLP and not layer.training
            and all(type(n) is llama.LlamaRMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)))


def lean(model: torch.nn.Module) -> int:
    """Swap every plain Llama decoder layer of `model` for LeanLlamaLayer; returns how many were swapped."""
    count = 0
    for module in model.modules():
        if _plain(module):
            module.__class__ = LeanLlamaLayer
            module.silu = module.mlp.config.hidden_act == "silu"     # what the C++ glue's MLP applies
            count += 1
    return count
