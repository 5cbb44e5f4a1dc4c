"""Split a frozen HF causal LM into n contiguous stages and run any stage on tokens at their true positions.

The model class is untouched: we call its own embedding, decoder layers, final norm and head, pass explicit
position embeddings, and hand the layers our `LayerKVCache`. Hidden states are the residual stream *before*
the final norm (H^l = output of l layers, H^0 = the family's scaled embedding).
"""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import PreTrainedModel

from spd.layout import stage_bounds
from spd.targets import gated_delta, gqa_attention, invariant_attention, lean_layers, own_rows, panel, prepacked
from spd.targets.kv_cache import LayerKVCache
from spd.targets.linear_states import ROLLBACK

LINEAR = "linear_attention"   # a hybrid's Gated DeltaNet layers (Qwen3.5): a conv and a recurrent state, no K/V


class StagedTarget:
    def __init__(self, model: PreTrainedModel, n: int, explicit_bounds: list[int] | None = None,
                 plain_products: bool = False, plain_attention: bool = False):
        self.model = model
        self.config = model.config
        self.decoder = model.model
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.n = n
        self.bounds = stage_bounds(self.num_layers, n, explicit_bounds)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.hybrid = LINEAR in self.layer_types
        if self.hybrid:
            gated_delta.rowwise(model)      # one arithmetic at every row count, each row on its own path
        self.sliding_window = getattr(self.config, "sliding_window", None)
        rope = self.decoder.rotary_emb
        self._rope_takes_type = "layer_type" in inspect.signature(rope.forward).parameters
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        wanted = invariant_attention.wanted(self.device, self.dtype)
        shapes, head = invariant_attention.target_shapes(model)
        self.row_invariant = wanted and invariant_attention.products_invariant(shapes, head)
        self.prepacked = False      # products from packed weights (spd.targets.prepacked), where as row-invariant
        if self.row_invariant:
            # a row's bits must not depend on how many rows share its forward (spd.targets.invariant_attention)
            self.config._attn_implementation = invariant_attention.KERNEL
            if prepacked.packed_invariant(shapes):
                prepacked.prepack(model)
                self.prepacked = True
        elif wanted:
            warnings.warn("this CPU's bfloat16 products give a row other bits at other row counts for this target's "
                          "shapes: drafted decoding may leave AR's tokens where two logits nearly tie; use "
                          "dtype=float32 for exact equality", stacklevel=2)
        # several query rows of a GQA target attend without repeating the cache (spd.targets.gqa_attention;
        # plain_attention: transformers' SDPA as it is, for a comparison in one process)
        self.groups = gqa_attention.groups_of(self.config)
        self.packed_gqa = not (self.row_invariant or plain_attention) and gqa_attention.wanted(self.device, self.config)
        if self.packed_gqa:
            self.config._attn_implementation = gqa_attention.KERNEL
        elif self.config._attn_implementation in (gqa_attention.KERNEL, own_rows.KERNEL):   # an earlier one's choice
            self.config._attn_implementation = "sdpa"
        # float32 on a CPU: products from panels (spd.targets.panel), flat in cost to ~12 rows and row-invariant
        # (plain_products: F.linear, for a comparison in one process)
        self.panel_level = panel.level_for(shapes) if not plain_products and panel.wanted(self.device, self.dtype) \
            else None
        self.panels = self.panel_level is not None
        if self.panels:
            panel.use_panels(model, self.panel_level)
        if self.device.type == "cpu":
            lean_layers.lean(model)     # Llama layers' forward without its module calls: the same bits, less Python
        # what the products read: a GGUF's own blocks where the loader attached them (spd.targets.blocks; the panel
        # kernel multiplies them, so without panels they go unread)
        self.weights = "q4" if self.panels and any("_blocks" in m.__dict__ for m in model.modules()) else "float32"
        if self.weights == "q4" and not plain_attention:
            # its own row arithmetic (spd.targets.own_rows): masks as they are built, not packed for SDPA's rows
            own_rows.use(model, self.panel_level)
            self.packed_gqa = False

    def attention_near(self, index: int) -> int:
        """The full-attention layer nearest to layer `index` (negative: from the end), the earlier on a tie: where a
        draft layer built from the target's attention layer class (spd.models.module) takes its starting weights."""
        index = index % self.num_layers
        attention = [i for i, kind in enumerate(self.layer_types) if kind != LINEAR]
        return min(attention, key=lambda i: (abs(i - index), i))

    @staticmethod
    def even_bounds(num_layers: int, n: int) -> list[int]:
        return stage_bounds(num_layers, n)

    def _materialised(self) -> torch.Tensor:
        # A pipeline stage's process holds only its own parts (spd.targets.weight_cache); the rest sit on "meta".
        for param in self.model.parameters():
            if param.device.type != "meta":
                return param
        raise ValueError("the target has no materialised parameters")

    @property
    def device(self) -> torch.device:
        return self._materialised().device

    @property
    def exact_rows(self) -> bool:
        """Whether a row of a k-row forward has the bits of the same row run alone — what lets drafted decoding equal
        AR. On a CPU that is a property of the kernels chosen above and their self-checks: float32 from panels,
        bfloat16 through the row-invariant attention and products; a CUDA target's is its own (docs/lossless.md)."""
        if self.device.type != "cpu":
            return True
        return self.panels if self.dtype == torch.float32 else self.row_invariant if self.dtype == torch.bfloat16 \
            else False

    @property
    def dtype(self) -> torch.dtype:
        return self._materialised().dtype

    def new_cache(self, max_length: int | None = None, rollback: int = ROLLBACK) -> LayerKVCache:
        """max_length: a static cache of that many positions (None: one that grows, for unknown lengths).
        rollback: how far back a hybrid's linear-attention layers can return (spd.targets.linear_states)."""
        return LayerKVCache(self.num_layers, max_length=max_length, rollback=rollback)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> H^0 [B, T, d]."""
        return self.decoder.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """H^L [..., d] -> next-token logits [..., V] (final norm, head, optional soft-cap)."""
        out = self.model.lm_head(self.decoder.norm(hidden))
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def _position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str):
        pos = positions.view(1, -1)
        if self._rope_takes_type:
            return self.decoder.rotary_emb(hidden, pos, layer_type)
        return self.decoder.rotary_emb(hidden, pos)

    def _mask(self, positions: torch.Tensor, key_len: int, layer_type: str) -> torch.Tensor | None:
        """Boolean [1, 1, T, key_len] (True = attend), or None when every cached key is visible."""
        sliding = layer_type == "sliding_attention" and self.sliding_window
        if positions.numel() == 1 and not (sliding and key_len > self.sliding_window):
            return None
        if not sliding and int(positions[0]) == 0 and key_len == positions.numel():
            return None  # a fresh causal pass: SDPA's is_causal path, no T x T mask in memory
        keys = torch.arange(key_len, device=positions.device).view(1, -1)
        q = positions.view(-1, 1)
        visible = keys <= q
        if sliding:
            visible = visible & (keys > q - self.sliding_window)
        return visible.view(1, 1, *visible.shape)

    def fixed_mask(self, positions: torch.Tensor, keys: torch.Tensor, layer_type: str) -> torch.Tensor:
        """Boolean [1, 1, T, S] over a whole static cache (keys = arange(S) [1, S]), from position tensors only:
        no value leaves the device, so a CUDA graph can capture it."""
        q = positions.view(-1, 1)
        visible = keys <= q
        if layer_type == "sliding_attention" and self.sliding_window:
            visible = visible & (keys > q - self.sliding_window)
        return visible.view(1, 1, *visible.shape)

    def explicit_mask(self, visible: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
                      layer_type: str) -> torch.Tensor:
        """Boolean [1, 1, T, S] from a caller's structure visible [T, S] (which cached rows each new row may see:
        a draft tree's ancestors) and the rows' positions, with a sliding layer's window applied by position."""
        if layer_type == "sliding_attention" and self.sliding_window:
            visible = visible & (key_positions.view(1, -1) > positions.view(-1, 1) - self.sliding_window)
        return visible.view(1, 1, *visible.shape)

    def attention_mask(self, mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """A forward's mask [1, 1, T, S] as its attention kernel reads it: packed once for every layer where query
        heads are stacked as rows (spd.targets.gqa_attention), additive in the target's dtype."""
        if mask is None or rows == 1 or not self.packed_gqa:
            return mask
        return gqa_attention.pack_mask(mask, self.groups, self.dtype)

    def _layer_mask(self, layer_type: str, positions: torch.Tensor, key_len: int | None,
                    mask_keys: torch.Tensor | None, visible) -> torch.Tensor | None:
        """A forward's mask for layers of `layer_type` as their kernel reads it (run_layers' arguments)."""
        if visible is not None:
            mask = self.explicit_mask(visible[0], positions, visible[1], layer_type)
        elif mask_keys is None:
            mask = self._mask(positions, key_len, layer_type)
        else:
            mask = self.fixed_mask(positions, mask_keys, layer_type)
        return self.attention_mask(mask, positions.numel())

    def _own_layers(self, hidden: torch.Tensor, start: int, end: int, cache, ragged) -> tuple[list, list] | None:
        """Layers start..end-1 and their OwnLayers where they run as one C++ call: a weights=q4 target's full-attention
        Llama layers over a LayerKVCache appended to (or none), float32 rows without autograd."""
        if self.weights != "q4" or ragged is not None or self.config._attn_implementation != own_rows.KERNEL or \
                any(self.layer_types[i] != "full_attention" for i in range(start, end)) or \
                hidden.dtype != torch.float32 or (torch.is_grad_enabled() and hidden.requires_grad):
            return None
        if cache is not None and (type(cache) is not LayerKVCache or cache.write_at is not None):
            return None
        layers = list(self.layers)[start:end]       # a list: slicing the ModuleList builds a module a call
        owns = lean_layers.own_layers(layers)
        return None if owns is None else (layers, owns)

    def run_layers(
        self,
        hidden: torch.Tensor,             # [1, T, d] residual stream entering layer `start`
        positions: torch.Tensor,          # [T] absolute positions (contiguous, following the cache, unless `visible`)
        start: int,
        end: int,
        cache: LayerKVCache | None,
        capture: frozenset[int] | set[int] = frozenset(),
        mask_keys: torch.Tensor | None = None,  # [1, S] arange(S): fixed shapes over a static cache of S positions
        visible: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, S] bool, key positions [S]): explicit
        ragged=None,                      # spd.targets.ragged.RaggedCache: several sequences' rows, masked per sequence
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run layers start..end-1; return H^end and {l: H^l} for captured l in (start, end]. With `visible` the
        rows attend where it says (a tree's rows sit at prefix + depth, appended to the cache in node order); with
        `ragged` each sequence's rows attend to its own cache (`cache` is then that RaggedCache)."""
        captured: dict[int, torch.Tensor] = {}
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[str, torch.Tensor | None] = {}
        # read back only on the sliced path, the one that needs it (a host sync on CUDA)
        key_len = int(positions[-1]) + 1 if mask_keys is None and visible is None and ragged is None else None
        extra = {} if ragged is None else {"ragged": ragged}
        own = self._own_layers(hidden, start, end, cache, ragged)
        if own is not None:
            # a weights=q4 target's layers in one C++ call (spd.targets.lean_layers.run_own): the same bits as
            # layer by layer, without Python between them
            cos, sin = self._position_embeddings(hidden, positions, "full_attention")
            mask = self._layer_mask("full_attention", positions, key_len, mask_keys, visible)
            hidden, outs = lean_layers.run_own(*own, hidden, cache, mask, cos, sin,
                                               [i + 1 in capture for i in range(start, end)])
            return hidden, dict(zip([i + 1 for i in range(start, end) if i + 1 in capture], outs))
        parents = None      # a draft tree's structure, as a linear-attention layer reads it
        for index in range(start, end):
            layer_type = self.layer_types[index]
            if layer_type == LINEAR:
                # a Gated DeltaNet layer: no positions and no mask — a row's past is its parent's state (the row
                # before it, or its tree parent), kept in its sequence's cache (spd.targets.gated_delta)
                # (a fixed-shape step's rows name their parents by position tensors, the cache's parent_at)
                fixed = getattr(cache, "write_at", None) is not None
                if visible is not None and parents is None and not fixed:
                    parents = gated_delta.parents_of(visible[0], positions.numel())
                hidden = self.layers[index](hidden, position_embeddings=None, attention_mask=None, cache=cache,
                                            parents=parents)
                if index + 1 in capture:
                    captured[index + 1] = hidden
                continue
            if layer_type not in rope:
                rope[layer_type] = self._position_embeddings(hidden, positions, layer_type)
                masks[layer_type] = None if ragged is not None else \
                    self._layer_mask(layer_type, positions, key_len, mask_keys, visible)   # ragged: per sequence
            hidden = self.layers[index](
                hidden,
                attention_mask=masks[layer_type],
                position_ids=positions.view(1, -1),
                cache=cache,   # transformers >= 5.24 (the old past_key_values= goes in 5.40)
                position_embeddings=rope[layer_type],
                **extra,
            )
            if index + 1 in capture:
                captured[index + 1] = hidden
        return hidden, captured

    def run_stage(self, stage: int, hidden, positions, cache, capture=frozenset()):
        """Stage s (0-indexed) covers layers bounds[s]..bounds[s+1]-1."""
        return self.run_layers(hidden, positions, self.bounds[stage], self.bounds[stage + 1], cache, capture)

    def forward_all(self, ids: torch.Tensor, cache: LayerKVCache | None, start_pos: int = 0, capture=frozenset(),
                    offsets: torch.Tensor | None = None, visible: torch.Tensor | None = None):
        """Every layer over ids [B, T] at positions start_pos.. (prefill, one AR token, or a right-padded training
        batch with cache=None); returns H^L, {l: H^l}. With `visible` [T, T] (bool: which of these rows each row
        sees) and offsets [T] (each row's position minus start_pos), the rows see the whole cache of start_pos
        positions and, among themselves, what `visible` says: a draft tree's nodes at prefix + depth."""
        positions = torch.arange(start_pos, start_pos + ids.shape[1], device=ids.device)
        explicit = None
        if visible is not None:
            positions = start_pos + offsets.to(ids.device)
            prefix = torch.ones(ids.shape[1], start_pos, dtype=torch.bool, device=ids.device)
            explicit = (torch.cat([prefix, visible.to(ids.device)], 1),
                        torch.cat([torch.arange(start_pos, device=ids.device), positions]))
        h0 = self.embed(ids)
        hidden, captured = self.run_layers(h0, positions, 0, self.num_layers, cache, capture, visible=explicit)
        if 0 in capture:
            captured[0] = h0
        return hidden, captured
