"""What differs between the methods the trainer distils (`method=`): the module it builds, the teacher layers
it reads, the loss of one micro-batch and the held-out evaluation. Everything else (data, DeepSpeed, the
teacher-feature cache, checkpoints, resume, W&B) is the one loop in `spd.train.loop`.

- pipelined drafters (spd, spd_output_state, ppsd): the speculation module in the training layout of its plan,
  with simulated occupancy, forward KL;
- eagle3: EAGLE-3's draft model under the training-time test, sum_j 0.8^j forward KL.
"""

from __future__ import annotations

import torch

from spd.drafters.eagle3 import Eagle3Drafter
from spd.models.eagle3 import TTT_DECAY, TTT_STEPS, Eagle3Module, fused_layers
from spd.errors import UserError
from spd.layout import needed_layers, sample_occupancy
from spd.models.module import SpeculationModule
from spd.models.module_init import init_previous_token_head
from spd.targets.stages import LINEAR, StagedTarget
from spd.train.evaluate import decode_heldout, evaluate
from spd.train.objective import kd_loss, ttt_loss


class PipelinedObjective:
    """SPD, its output-state ablation and PPSD: one speculation module, read through the method's plan."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.weights = list(cfg.occupancy_weights) if cfg.occupancy_weights else None

    def layers(self, staged: StagedTarget) -> list[int]:
        # every pipelined plan reads a subset of SPD's layers, so one teacher-feature cache serves all three
        return needed_layers(staged.bounds)

    def build(self, staged: StagedTarget, draft, feature_samples) -> SpeculationModule:
        cfg, m = self.cfg, self.cfg.model
        module = SpeculationModule.from_target(staged, m.module_layers, draft_to_target=draft, seed=cfg.seed,
                                               feature_norm=m.feature_norm, fc_bias=m.fc_bias, method=cfg.method)
        if m.feature_norm == "standard" and not cfg.resume:  # on resume the statistics come with the state
            module.fit_feature_norm(feature_samples())
        if m.init_fc == "select":
            module.init_selectors()
        if m.init_layers:
            L = staged.num_layers
            if len(m.init_layers) != m.module_layers or not all(0 <= i < L for i in m.init_layers):
                raise UserError(f"model.init_layers={list(m.init_layers)} needs {m.module_layers} "
                                f"target layer indices in 0..{L - 1}")
            linear = [i for i in m.init_layers if staged.layer_types[i] == LINEAR]
            if linear:
                attention = [i for i, kind in enumerate(staged.layer_types) if kind != LINEAR]
                raise UserError(f"model.init_layers={list(m.init_layers)}: layer(s) {linear} of this hybrid target "
                                f"are linear attention, and the module's layers attend; pick from {attention}")
            module.init_layers_from([staged.layers[i] for i in m.init_layers])
        if m.init_attention == "previous":
            init_previous_token_head(module)
        return module

    def step(self, engine, hidden, teacher, valid, generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Loss of one micro-batch, top-1 per scored position, and top-1 hits grouped by occupancy."""
        occ = sample_occupancy(valid.shape[0], self.cfg.model.n, generator, self.cfg.p_full, self.weights)
        occ = occ.to(valid.device)
        loss, top1 = kd_loss(engine(hidden, occ, valid), teacher)
        groups: dict[str, list[float]] = {}
        for a, hit in zip(occ[teacher.positions[:, 0]].tolist(), top1.tolist()):
            groups.setdefault(f"train/top1_a{a}", []).append(hit)
        return loss, top1, groups

    def evaluate(self, module, staged, tokenizer, held, held_convs, draft) -> dict:
        return evaluate(module, staged, tokenizer, held, held_convs, draft, self.cfg)


class Eagle3Objective:
    """EAGLE-3: fused low/middle/high states, one widened layer, the training-time test over TTT_STEPS steps."""

    def __init__(self, cfg):
        self.cfg = cfg

    def layers(self, staged: StagedTarget) -> list[int]:
        return sorted({0, *fused_layers(staged.num_layers), staged.num_layers})

    def build(self, staged: StagedTarget, draft, feature_samples) -> Eagle3Module:
        return Eagle3Module.from_target(staged, draft_to_target=draft, seed=self.cfg.seed)

    def step(self, engine, hidden, teacher, valid, generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
        loss, agreement = ttt_loss(engine(hidden, valid), teacher, TTT_DECAY)
        groups = {f"train/top1_step{j}": hits.tolist() for j, hits in enumerate(agreement)}
        return loss, agreement[0], groups

    @torch.no_grad()
    def evaluate(self, module, staged, tokenizer, held, held_convs, draft) -> dict:
        from spd.engine import build_decoder
        from spd.methods import CHAIN
        from spd.train.objective import collate, teacher_pass

        module.eval()
        kls, first = [], []
        for ex in held:
            batch = collate([ex], tokenizer.pad_token_id or 0)
            teacher = teacher_pass(staged, batch, draft, self.layers(staged))
            loss, agreement = ttt_loss(module(teacher.hidden, batch["valid"].to(staged.device)), teacher)
            kls.append(float(loss))
            first.append(agreement[0])
        whole = StagedTarget(staged.model, 1)
        stats = decode_heldout(lambda eos: build_decoder(CHAIN, whole, eos, Eagle3Drafter(module, whole.embed),
                                                         draft_length=TTT_STEPS), staged, tokenizer, held_convs, self.cfg)
        module.train()
        cycles = sum(s.cycles for s in stats)
        return {"eval/ttt_loss": sum(kls) / max(1, len(kls)),
                "eval/top1": torch.cat(first).mean().item() if first else float("nan"),
                "eval/tau": sum(s.N - 1 for s in stats) / cycles if cycles else float("nan")}


def objective_for(cfg):
    """The training objective spd.methods names for cfg.method."""
    from spd.methods import METHODS, behaviour

    return behaviour(METHODS[cfg.method].objective)(cfg)
