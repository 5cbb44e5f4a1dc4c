"""EAGLE-3's draft model (design §2), built from the target's own decoder-layer class.

A bias-free FC fuses the target's hidden states entering layers 2, L//2 and L-3 into one d-wide feature f_i.
The single decoder layer reads concat(norm(embedding of x_{i+1}), norm(h)) (width 2d: its q/k/v projections
are widened) where h is f_i for the first draft and the layer's own pre-norm output for every later one; the
residual stream is h. Its own final norm and head over the draft vocabulary predict x_{i+2}.

Training-time test (`forward_ttt`) and chain decoding (`spd.drafters.eagle3`) both go through `step_rows`, so
training optimises the function decoding runs. The embedding is the target's (H^0), never a parameter here.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from spd.models.attention import _heads, attend, layer_output, queries, rotate
from spd.models.draft_head import DraftHead
from spd.targets.stages import StagedTarget

TTT_STEPS = 7        # unrolled steps of the training-time test
TTT_DECAY = 0.8      # loss weight of step j: 0.8^j


def fused_layers(num_layers: int) -> tuple[int, int, int]:
    """H^l indices EAGLE-3 fuses: the inputs of layers 2, L//2 and L-3 (low, middle, high), clamped to the target."""
    return tuple(min(max(layer, 0), num_layers) for layer in (2, num_layers // 2, num_layers - 3))


class Eagle3Module(DraftHead, nn.Module):
    # the trainer's model.<key>s a checkpoint of this class fixes, which a run continuing it (init_from=) must match
    shape_keys = ("draft_vocab",)

    def __init__(self, target_config, layer_cls, rotary_cls, norm_cls, draft_to_target: torch.Tensor | None = None,
                 fused: tuple[int, ...] | None = None):
        super().__init__()
        d = target_config.hidden_size
        # a head trained elsewhere may fuse other layers (spd.models.formats reads them from its config)
        self.fused = tuple(fused) if fused is not None else fused_layers(target_config.num_hidden_layers)
        cfg = copy.deepcopy(target_config)
        cfg.num_hidden_layers = 1
        if hasattr(cfg, "layer_types"):
            cfg.layer_types = ["full_attention"]
        self.config = cfg
        self.fc = nn.Linear(len(self.fused) * d, d, bias=False)
        self.embed_norm = norm_cls(d, eps=cfg.rms_norm_eps)
        self.hidden_norm = norm_cls(d, eps=cfg.rms_norm_eps)
        layer = layer_cls(cfg, layer_idx=0)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):   # the layer reads [embedding | hidden], 2d wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
        self.layer = layer
        self.rotary = rotary_cls(cfg)
        self._rope_takes_type = "layer_type" in inspect.signature(self.rotary.forward).parameters   # once, not per draft
        self.norm = norm_cls(d, eps=cfg.rms_norm_eps)
        self.build_head(d, target_config, draft_to_target)

    @classmethod
    def untrained(cls, target: StagedTarget, method: str = "eagle3", num_layers: int = 1, seed: int = 0) -> "Eagle3Module":
        """A random EAGLE-3 module (one layer, whatever num_layers says) for a run without a checkpoint."""
        return cls.from_target(target, seed=seed)

    @classmethod
    def from_checkpoint_config(cls, target: StagedTarget, method: str, config: dict,
                               draft_to_target: torch.Tensor | None) -> "Eagle3Module":
        """The module a checkpoint's config.json describes, its weights still to be loaded. A head read from an
        engine's format (spd.models.formats) carries its own layer: the engines' Llama decoder layer at its sizes."""
        layer = config.get("draft_layer")
        if layer is None:
            return cls.from_target(target, draft_to_target=draft_to_target)
        from spd.models.formats.layer import llama_layer_parts

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = cls(*llama_layer_parts(layer, target.config.vocab_size), draft_to_target,
                         fused=config["fused_layers"])
        return module.to(device=target.device, dtype=target.dtype)

    def checkpoint_fields(self, num_layers: int) -> dict:
        """What config.json records beside the target's identity: no pipeline, the chain runs the target whole."""
        return {"method": "eagle3", "n": 1, "stage_bounds": [0, num_layers], "fused_layers": list(self.fused),
                "module_layers": 1,
                "draft_vocab_size": None if self.draft_to_target is None else int(self.draft_to_target.numel())}

    @classmethod
    def from_target(cls, target: StagedTarget, draft_to_target: torch.Tensor | None = None,
                    seed: int = 0) -> "Eagle3Module":
        """Random FC and layer; head and final norm copied from the target (head rows of the draft vocabulary)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = cls(target.config, type(target.layers[0]), type(target.decoder.rotary_emb),
                         type(target.decoder.norm), draft_to_target)
        module.copy_target_output(target)
        return module.to(device=target.device, dtype=target.dtype)

    def layers_needed(self) -> list[int]:
        """Target layers read: the embedding H^0 and the three fused states."""
        return sorted({0, *self.fused})

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """f [..., d] from {layer: H^layer [..., d]}."""
        return self.fc(torch.cat([hidden[layer] for layer in self.fused], dim=-1))

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """cos, sin [B, S, hd] for positions [B, S]."""
        if self._rope_takes_type:
            return self.rotary(like, positions, "full_attention")
        return self.rotary(like, positions)

    def project(self, embedding: torch.Tensor, h: torch.Tensor, cos, sin):
        """q [B, H, S, hd], k and v [B, H_kv, S, hd] of rows (embedding, h) [B, S, d] each, and the output gate
        [B, S, H * hd] of a gated attention (Qwen3.5; else None)."""
        attn = self.layer.self_attn
        x = torch.cat([self.embed_norm(embedding), self.hidden_norm(h)], dim=-1)
        q, gate = queries(attn, x)
        k, v = (_heads(p, x, attn.head_dim) for p in (attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, gate

    def finish(self, h: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output (pre-norm) [B, S, d] from its residual input h and attention output [B, H, S, hd]:
        the rest of the target family's decoder layer, exactly as the speculation module runs it."""
        return layer_output(self.layer, h, attended, gate)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., V_draft] from pre-norm outputs h [..., d]."""
        return self.head(self.norm(h))

    # ---------------------------------------------------------------- training-time test
    def forward_ttt(
        self,
        hidden: dict[int, torch.Tensor],   # {layer: H^layer [B, N, d]}: H^0 and the fused layers
        valid: torch.Tensor | None = None,  # [B, N] bool, False on padding
        steps: int = TTT_STEPS,
    ) -> list[torch.Tensor]:
        """Logits [B, N, V_draft] of every unrolled step j: entry j at row i predicts x_{i+2+j}.

        Step 0 reads (embedding of x_{i+1}, f_i); step j >= 1 reads (embedding of x_{i+1+j}, its own step j-1
        output at row i) at position i + j. A query at (j, i) sees the step-0 keys at rows <= i and the keys of
        steps 1..j at row i only: what the j-th draft after verified position i sees in decoding."""
        emb, f = hidden[0], self.fuse(hidden)
        b, n_pos, _ = f.shape
        device = f.device
        if valid is None:
            valid = torch.ones(b, n_pos, dtype=torch.bool, device=device)
        idx = torch.arange(n_pos, device=device)
        causal = (idx.view(-1, 1) >= idx.view(1, -1)) & valid[:, None, :]          # [B, N, N]
        scaling = self.layer.self_attn.scaling
        outputs, own_k, own_v = [], [], []
        h = f
        shared_k = shared_v = None
        for j in range(steps):
            # the embedding of x_{i+1+j}; rows past the end read a zero row (nothing there is scored)
            e = torch.zeros_like(emb)
            e[:, : n_pos - 1 - j] = emb[:, 1 + j:]
            cos, sin = self.rope((idx + j).expand(b, n_pos), f)
            q, k, v, gate = self.project(e, h, cos, sin)
            if j == 0:
                shared_k, shared_v = k, v
                none = k.new_zeros(*k.shape[:3], 0, k.shape[-1])                    # [B, H_kv, N, 0, hd]
                attended = attend(q, shared_k, shared_v, causal, none, none, None, scaling)
            else:
                own_k.append(k.unsqueeze(3))
                own_v.append(v.unsqueeze(3))
                # the step-0 key of row i itself is in the shared block; steps 1..j at row i are own keys
                attended = attend(q, shared_k, shared_v, causal, torch.cat(own_k, 3), torch.cat(own_v, 3), None,
                                  scaling)
            h = self.finish(h, attended, gate)
            outputs.append(self.logits(h))
        return outputs

    def forward(self, hidden: dict[int, torch.Tensor], valid: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training entry (what DeepSpeed's engine calls)."""
        return self.forward_ttt(hidden, valid)
