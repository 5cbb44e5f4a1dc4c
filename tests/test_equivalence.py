"""Training/inference equivalence: at every decoding step (warm-up, steady state, after rollbacks) the module's
logits equal one batched pass in the training layout for the same (position, occupancy)."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.base import AFTER_STEP, WrappedDrafter
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.verify.sampling import Proposal
from spd.targets.stages import StagedTarget
from spd.train.objective import collate, teacher_pass


class RecordingDrafter(WrappedDrafter):
    """Runs the module every step and records its logits, but drafts the target's own token except every
    `wrong_every`-th position — so the trace holds long steady-state stretches *and* rollbacks."""

    def __init__(self, inner: ModuleDrafter, reference: list[int], wrong_every: int):
        super().__init__(inner)
        self.reference, self.wrong_every = reference, wrong_every
        self.records = []

    def propose(self, view, propose):
        t = view.t
        logits = self.inner.draft_logits(view)
        self.records.append((t, view.occupancy, [s.token for s in view.in_flight], logits))
        token = self.reference[t + 1]
        if (t + 1) % self.wrong_every == 0:
            token = (token + 1) % logits.numel()
        return Proposal(token)


def layout_logits(staged, module, tokens, occupancy):
    """The trainer's own forward: its teacher pass (hidden states in one batched pass) and the module's
    training entry (all n+1 feature blocks, one training-layout pass) — exactly what DeepSpeed's engine calls."""
    batch = collate([{"input_ids": tokens, "loss_mask": [True] * len(tokens)}], pad_id=0)
    teacher = teacher_pass(staged, batch, None)
    logits = module(teacher.hidden, torch.tensor([occupancy]), batch["valid"])
    return module.target_logits(logits[0])


@pytest.mark.parametrize("n,use_cache,layers,feature_norm,fc_bias,method", [
    (2, True, 1, "none", False, "spd"), (3, False, 2, "standard", True, "spd"), (5, True, 2, "none", False, "spd"),
    (6, True, 1, "standard", True, "spd"),
    (3, True, 1, "none", False, "spd_output_state"), (5, False, 2, "standard", True, "spd_output_state"),
    (1, True, 1, "none", False, "spd_output_state"),
    (3, True, 2, "standard", True, "ppsd"), (5, False, 1, "none", False, "ppsd")])
def test_runtime_logits_equal_training_layout(family_model, n, use_cache, layers, feature_norm, fc_bias, method):
    family, model = family_model
    p = prompt(5)
    reference = p + ar_run(model, p, 60).token_ids
    staged = StagedTarget(model, n)
    draft_vocab = torch.arange(0, model.config.vocab_size, 3) if n == 5 else None
    module = SpeculationModule.from_target(staged, layers, draft_to_target=draft_vocab, seed=n,
                                           feature_norm=feature_norm, fc_bias=fc_bias, method=method).eval()
    if fc_bias:  # large enough that a path which dropped the biases would differ
        for fc in module.fc.values():
            torch.nn.init.normal_(fc.bias, std=0.5)
    if feature_norm == "standard":  # statistics far from the identity, so a path that skipped them would differ
        g = torch.Generator().manual_seed(n)
        module.feature_shift.copy_(torch.randn(module.feature_shift.shape, generator=g))
        module.feature_scale.copy_(torch.rand(module.feature_scale.shape, generator=g) * 3 + 0.2)
    drafter = RecordingDrafter(ModuleDrafter(module, use_cache), reference, wrong_every=9)
    out = PipelineDecoder(staged, drafter, frozenset()).generate(p, Request(40, GREEDY))
    assert out.stats.rollbacks > 0
    assert drafter.has(AFTER_STEP) == (method != "spd")
    seen = {a for _, a, _, _ in drafter.records}
    assert seen == set(range(1, n + 1)), seen  # warm-up and steady state both visited
    # One layout pass per occupancy over the whole reference covers every step whose sequence is a prefix of it
    # (causality: row t only depends on positions <= t); steps with a wrong in-flight token get their own pass.
    with torch.no_grad():
        per_occupancy = {a: layout_logits(staged, module, reference, a) for a in range(1, n + 1)}
        for t, a, slot_tokens, logits in drafter.records:
            # The sequence at the step: verified prefix of the final output, then the in-flight tokens.
            tokens = reference[: t + 1 - len(slot_tokens)] + slot_tokens
            assert len(tokens) == t + 1
            if tokens == reference[: t + 1]:
                expected = per_occupancy[a][t]
            else:
                expected = layout_logits(staged, module, tokens, a)[t]
            finite = torch.isfinite(expected)
            assert torch.equal(finite, torch.isfinite(logits))
            torch.testing.assert_close(logits[finite], expected[finite], atol=1e-5, rtol=1e-5)
    assert len(drafter.records) == out.stats.K
