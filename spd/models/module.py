"""The speculation module (design §1): one FC per depth, L_s decoder layers of the target's family, norm, head.

`forward_layout` is the training pass over the (n+1)-block layout; `forward_step` is one decoding step for the
newest position. Both run the same `layer_forward`, and both read depths from `spd.layout`. The same module
serves every pipelined drafter; its `plan` (SPD, the output-state ablation, PPSD) says which depths it reads.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch import nn

from spd.models.attention import layer_forward, memory_kv
from spd.models.draft_head import DraftHead
from spd.layout import plan_for
from spd.targets.stages import StagedTarget


FEATURE_NORMS = ("none", "standard")


class SpeculationModule(DraftHead, nn.Module):
    # the trainer's model.<key>s a checkpoint of this class fixes, which a run continuing it (init_from=) must match
    shape_keys = ("module_layers", "draft_vocab", "feature_norm", "fc_bias")

    def __init__(self, target_config, bounds: list[int], num_layers: int, layer_cls, rotary_cls, norm_cls,
                 draft_to_target: torch.Tensor | None = None, feature_norm: str = "none", fc_bias: bool = False,
                 method: str = "spd"):
        super().__init__()
        if feature_norm not in FEATURE_NORMS:
            raise ValueError(f"feature_norm={feature_norm!r} is not one of {FEATURE_NORMS}")
        self.bounds = list(bounds)
        self.n = len(bounds) - 1
        self.plan = plan_for(method)
        self.feature_layers = self.plan.feature_layers(self.bounds)   # {depth k: layers g^k reads}
        d = target_config.hidden_size
        self.feature_norm = feature_norm
        if feature_norm == "standard":
            # Per-dimension shift and scale of every hidden state a feature reads (set by `fit_feature_norm`).
            # The target's residual stream carries a few "massive" dimensions (SmolLM2: 3 of 576 hold about half
            # the squared norm from layer 2 on) and grows ~250x in RMS from H^0 to H^L, so unscaled the FCs see
            # little but those dimensions and the deepest state.
            self._norm_row = {layer: row for row, layer in enumerate(self.plan.needed_layers(self.bounds))}
            self.register_buffer("feature_shift", torch.zeros(len(self._norm_row), d))
            self.register_buffer("feature_scale", torch.ones(len(self._norm_row), d))
        cfg = copy.deepcopy(target_config)
        cfg.num_hidden_layers = num_layers
        if hasattr(cfg, "layer_types"):
            cfg.layer_types = ["full_attention"] * num_layers  # the module always attends over the whole sequence
        self.config = cfg
        # fc_bias: standardised features have mean 0, so bias-free FCs give every row a zero-mean input and the
        # attention has no content-free direction with which RoPE could single out a position (e.g. t-1); a bias
        # per FC_k supplies one (and marks each row's depth).
        self.fc_bias = fc_bias
        # keyed by depth ("0".."n" for SPD): the state-dict names are fc.<k>.weight whatever the plan
        self.fc = nn.ModuleDict({str(k): nn.Linear(len(layers) * d, d, bias=fc_bias)
                                 for k, layers in self.feature_layers.items()})
        self.layers = nn.ModuleList([layer_cls(cfg, layer_idx=i) for i in range(num_layers)])
        self.rotary = rotary_cls(cfg)
        self._rope_takes_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.norm = norm_cls(d, eps=cfg.rms_norm_eps)
        self.build_head(d, target_config, draft_to_target)

    @classmethod
    def untrained(cls, target: StagedTarget, method: str, num_layers: int = 1, seed: int = 0) -> "SpeculationModule":
        """A random module of `method` (spd, ppsd, spd_output_state) for a run without a checkpoint."""
        return cls.from_target(target, num_layers, seed=seed, method=method)

    @classmethod
    def from_checkpoint_config(cls, target: StagedTarget, method: str, config: dict,
                               draft_to_target: torch.Tensor | None) -> "SpeculationModule":
        """The module a checkpoint's config.json describes, its weights still to be loaded."""
        return cls.from_target(target, config["module_layers"], draft_to_target=draft_to_target,
                               feature_norm=config.get("feature_norm", "none"), fc_bias=config.get("fc_bias", False),
                               method=method)

    def checkpoint_fields(self, num_layers: int) -> dict:
        """What config.json records of this module beside the target's identity (spd.models.checkpoint)."""
        return {
            "n": self.n,
            "stage_bounds": self.bounds,
            "method": self.plan.method,
            # indexed by depth k; null where the method reads no feature of that depth
            "feature_layers": [list(self.feature_layers[k]) if k in self.feature_layers else None
                               for k in range(self.n + 1)],
            "module_layers": len(self.layers),
            "draft_vocab_size": None if self.draft_to_target is None else int(self.draft_to_target.numel()),
            "feature_norm": self.feature_norm,
            "fc_bias": self.fc_bias,
        }

    @classmethod
    def from_target(cls, target: StagedTarget, num_layers: int = 1, draft_to_target: torch.Tensor | None = None,
                    seed: int = 0, feature_norm: str = "none", fc_bias: bool = False,
                    method: str = "spd") -> "SpeculationModule":
        """Random layers and FCs; head and final norm copied from the target (head rows of the draft vocabulary)."""
        if num_layers > target.num_layers / target.n:
            warnings.warn(
                f"L_s={num_layers} > L/n={target.num_layers / target.n:g}: the module takes longer than a stage, "
                "so drafting latency is no longer hidden", stacklevel=2)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layer0 = target.layers[0]
            module = cls(target.config, target.bounds, num_layers, type(layer0), type(target.decoder.rotary_emb),
                         type(target.decoder.norm), draft_to_target, feature_norm, fc_bias, method)
        module.copy_target_output(target)
        return module.to(device=target.device, dtype=target.dtype)

    @torch.no_grad()
    def init_selectors(self) -> None:
        """FC_0 = identity on H^0 and FC_k = picks H^{b_k} out of (H^0, H^{m_k}, H^{b_k}): g^k starts as the
        deepest available hidden state instead of noise."""
        for fc in self.fc.values():
            d = fc.weight.shape[0]
            fc.weight.zero_()
            fc.weight[:, -d:].copy_(torch.eye(d, dtype=fc.weight.dtype, device=fc.weight.device))
            if fc.bias is not None:
                fc.bias.zero_()

    @torch.no_grad()
    def init_layers_from(self, target_layers: list[nn.Module]) -> None:
        """Start module layer i as a copy of target_layers[i] (same family, same shapes)."""
        if len(target_layers) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} target layers to copy, got {len(target_layers)}")
        for mine, theirs in zip(self.layers, target_layers):
            mine.load_state_dict(theirs.state_dict())

    @torch.no_grad()
    def fit_feature_norm(self, hidden: dict[int, torch.Tensor]) -> None:
        """Shift and scale from samples {layer: [M, d]} of the target's states: each dimension to mean 0, std 1."""
        for layer, row in self._norm_row.items():
            x = hidden[layer].reshape(-1, hidden[layer].shape[-1]).float()
            self.feature_shift[row] = x.mean(0).to(self.feature_shift.dtype)
            self.feature_scale[row] = (1 / x.std(0).clamp(min=1e-3)).to(self.feature_scale.dtype)

    # ---------------------------------------------------------------- features
    def feature_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """H^layer [..., d] as the FCs read it: raw, or standardised per dimension (feature_norm="standard")."""
        if self.feature_norm == "none":
            return h
        row = self._norm_row[layer]
        return (h - self.feature_shift[row]) * self.feature_scale[row]

    def feature(self, k: int, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """g^k from {layer: H^layer [..., d]}: FC_k over concat(H^0, H^{m_k}, H^{b_k}) (k=0: FC_0(H^0))."""
        parts = [self.feature_input(layer, hidden[layer]) for layer in self.feature_layers[k]]
        return self.fc[str(k)](parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """cos, sin [B, S, hd] for positions [B, S]."""
        if self._rope_takes_type:
            return self.rotary(like, positions, "full_attention")
        return self.rotary(like, positions)

    # ---------------------------------------------------------------- training layout
    def forward_layout(
        self,
        feats: dict[int, torch.Tensor],  # {depth k: g^k at every position [B, N, d]} for k in plan.depths(n)
        occupancy: torch.Tensor,      # [B] in 1..n, simulated per sequence
        valid: torch.Tensor | None = None,  # [B, N] bool, False on padding
    ) -> torch.Tensor:
        """Logits [B, N, V_draft] of the query block; query t sees exactly the G_t of a decoding step."""
        plan, n = self.plan, self.n
        query = feats[plan.query_depth()]
        b, n_pos, _ = query.shape
        if valid is None:
            valid = torch.ones(b, n_pos, dtype=torch.bool, device=query.device)
        grid = plan.depth_grid(n_pos, occupancy.to(valid.device), n)    # [B, N, N]
        idx = torch.arange(n_pos, device=valid.device)
        earlier = idx.view(-1, 1) > idx.view(1, -1)                        # [N, N] key strictly before query
        memory = plan.memory_depth(n)
        shared_mask = (grid == memory) & earlier & valid[:, None, :]       # the memory-depth block
        positions = idx.expand(b, n_pos)
        cos, sin = self.rope(positions, query)
        # Staircase: query t sees block k only at key t-j, iff the rule gives that key depth k (in flight).
        stairs = plan.lag_depths(n)                                        # {lag j: depth k}
        stair_mask = None
        if stairs:
            masks = []
            for j, k in stairs.items():
                key = (idx - j).clamp(min=0)
                masks.append((idx >= j).view(1, -1) & (grid[:, idx, key] == k) & valid[:, key])
            stair_mask = torch.stack(masks, dim=-1)                        # [B, N, len(stairs)]
        hidden = query
        for layer in self.layers:
            shared_k, shared_v = memory_kv(layer, feats[memory], cos, sin)
            extra_k = extra_v = None
            if stairs:
                ks, vs = [], []
                for j, k in stairs.items():
                    k_j, v_j = memory_kv(layer, feats[k], cos, sin)     # [B, H_kv, N, hd]
                    key = (idx - j).clamp(min=0)
                    ks.append(k_j[:, :, key])
                    vs.append(v_j[:, :, key])
                extra_k, extra_v = torch.stack(ks, dim=3), torch.stack(vs, dim=3)
            hidden = layer_forward(layer, hidden, cos, sin, shared_k, shared_v, shared_mask,
                                   extra_k, extra_v, stair_mask)
        return self.head(self.norm(hidden))

    def features(self, hidden: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every feature block the plan reads, {k: g^k [B, N, d]}, from teacher states {l: H^l [B, N, d]}."""
        return {k: self.feature(k, hidden) for k in self.plan.depths(self.n)}

    def forward(self, hidden: dict[int, torch.Tensor], occupancy: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """Training entry (what DeepSpeed's engine calls): teacher hidden states {l: H^l [B, N, d]} -> the plan's
        feature blocks -> `forward_layout` logits [B, N, V_draft]."""
        return self.forward_layout(self.features(hidden), occupancy, valid)

    # ---------------------------------------------------------------- decoding step
    def memory_kv_all_layers(self, rows: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of memory rows [1, S, d] at positions [1, S] (what the depth-n cache stores)."""
        cos, sin = self.rope(positions, rows)
        return [memory_kv(layer, rows, cos, sin) for layer in self.layers]

    def forward_step(
        self,
        query: torch.Tensor,          # [1, 1, d] the newest row (g_t^0 for SPD); [1, Q, d] with `visible`
        t: int | list[int],           # the queries' position (one per query: several sequences' queries)
        cached: list[tuple[torch.Tensor, torch.Tensor]] | None,  # per layer K/V [1, H_kv, S_c, hd] of cached rows
        rows: torch.Tensor,           # [1, S, d] memory rows not in the cache
        positions: torch.Tensor,      # [1, S]
        visible: torch.Tensor | None = None,   # [Q, S_c + S] bool: several queries (one per tree branch), each
                                               # seeing the cached rows and its own branch's rows
    ) -> torch.Tensor:
        """Head logits [V_draft] predicting position t+1 from G_t ([Q, V_draft] for Q queries [1, Q, d], all at t)."""
        fresh = self.memory_kv_all_layers(rows, positions) if rows.shape[1] else None
        at = torch.full((1, query.shape[1]), t, device=query.device) if isinstance(t, int) else \
            torch.tensor([t], device=query.device)
        cos, sin = self.rope(at, query)
        hidden = query
        for index, layer in enumerate(self.layers):
            parts = []
            if cached is not None:
                parts.append(cached[index])
            if fresh is not None:
                parts.append(fresh[index])
            if parts:
                k = torch.cat([p[0] for p in parts], dim=2)
                v = torch.cat([p[1] for p in parts], dim=2)
            else:  # t = 0: no memory yet
                h_kv = layer.self_attn.k_proj.out_features // layer.self_attn.head_dim
                k = v = query.new_zeros(1, h_kv, 0, layer.self_attn.head_dim)
            hidden = layer_forward(layer, hidden, cos, sin, k, v, None if visible is None else visible[None])
        out = self.head(self.norm(hidden))[0]
        return out[-1] if visible is None else out
