"""What one training step computes: frozen-teacher hidden states and targets, the n+1 feature blocks, the
module's training-layout pass (`SpeculationModule.forward_layout`, the function decoding runs), forward KL."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spd.layout import needed_layers
from spd.targets.stages import StagedTarget


def build_draft_vocab(examples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent assistant tokens of the training data (ids sorted), as the draft vocabulary."""
    counts: Counter = Counter()
    for ex in examples:
        ids, mask = ex["input_ids"], ex["loss_mask"]
        counts.update(ids[t + 1] for t in range(len(ids) - 1) if mask[t])
    top = [tok for tok, _ in counts.most_common(size)]
    if len(top) < size:  # pad with the lowest unused ids so the head has the configured size
        used = set(top)
        top += [t for t in range(vocab_size) if t not in used][: size - len(top)]
    return torch.tensor(sorted(top), dtype=torch.long)


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids [B, N], valid [B, N], loss_mask [B, N]."""
    width = max(len(ex["input_ids"]) for ex in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(examples), width, dtype=torch.bool)
    loss = torch.zeros(len(examples), width, dtype=torch.bool)
    for b, ex in enumerate(examples):
        n = len(ex["input_ids"])
        ids[b, :n] = torch.tensor(ex["input_ids"])
        valid[b, :n] = True
        loss[b, :n] = torch.tensor(ex["loss_mask"])
    return {"input_ids": ids, "valid": valid, "loss_mask": loss}


@dataclass
class TeacherBatch:
    hidden: dict[int, torch.Tensor]   # {layer: H^layer [B, N, d]} for the layers the features need
    probs: torch.Tensor               # [M, V_draft] teacher distribution at kept loss positions (renormalised)
    positions: torch.Tensor           # [M, 2] (batch, position) of the kept loss positions
    excluded: int                     # loss positions dropped: teacher argmax outside the draft vocabulary


@torch.no_grad()
def teacher_pass(staged: StagedTarget, batch: dict, draft_to_target: torch.Tensor | None,
                 layers: list[int] | None = None) -> TeacherBatch:
    """One frozen forward keeping only the needed layers (default: the pipeline features'; H^L always);
    teacher probabilities only at loss positions."""
    ids = batch["input_ids"].to(staged.device)
    capture = frozenset(layers if layers is not None else needed_layers(staged.bounds)) | {staged.num_layers}
    _, hidden = staged.forward_all(ids, cache=None, capture=capture)
    return teacher_targets(staged, hidden, batch, draft_to_target)


@torch.no_grad()
def teacher_targets(staged: StagedTarget, hidden: dict[int, torch.Tensor], batch: dict,
                    draft_to_target: torch.Tensor | None) -> TeacherBatch:
    """The teacher's next-token distribution at the loss positions, from its final hidden state H^L."""
    where = torch.nonzero(batch["loss_mask"].to(staged.device))          # [M, 2]
    h_last = hidden[staged.num_layers]
    logits = staged.logits(h_last[where[:, 0], where[:, 1]].to(staged.dtype)).float()  # [M, V]
    excluded = 0
    if draft_to_target is not None:
        in_draft = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        in_draft[draft_to_target] = True
        keep = in_draft[logits.argmax(-1)]
        excluded = int((~keep).sum())
        where, logits = where[keep], logits[keep][:, draft_to_target]
    return TeacherBatch(hidden=hidden, probs=torch.softmax(logits, -1), positions=where, excluded=excluded)


def kd_loss(student_logits: torch.Tensor, teacher: TeacherBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL(teacher || student) averaged over kept loss positions; also the top-1 agreement per position."""
    rows = student_logits[teacher.positions[:, 0], teacher.positions[:, 1]].float()   # [M, V_draft]
    log_q = F.log_softmax(rows, -1)
    p = teacher.probs
    kl = (p * (torch.log(p.clamp(min=1e-30)) - log_q)).sum(-1)
    agree = (rows.argmax(-1) == p.argmax(-1)).float()
    return kl.mean() if kl.numel() else rows.sum() * 0, agree


def ttt_loss(step_logits: list[torch.Tensor], teacher: TeacherBatch, decay: float = 0.8
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """EAGLE-3's training-time-test loss: sum_j decay^j * forward KL of unrolled step j, and each step's top-1
    agreement. step_logits[j] [B, N, V_draft]: row i predicts x_{i+2+j}, which the teacher's distribution at
    position i+1+j gives, so a kept loss position p is scored by row p-1-j of step j (where that row exists)."""
    total, agreement = None, []
    for j, logits in enumerate(step_logits):
        rows = teacher.positions[:, 1] - 1 - j
        keep = rows >= 0
        scored = TeacherBatch(teacher.hidden, teacher.probs[keep],
                              torch.stack([teacher.positions[keep, 0], rows[keep]], dim=1), 0)
        kl, agree = kd_loss(logits, scored)
        total = decay ** j * kl if total is None else total + decay ** j * kl
        agreement.append(agree)
    return total, agreement
