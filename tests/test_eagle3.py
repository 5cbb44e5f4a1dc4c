"""EAGLE-3: the training-time test computes exactly what chain decoding runs, chain decoding is lossless (greedy
token-equal to AR, sampling distribution-equal), and the 0.8^j loss weighting."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.models.eagle3 import Eagle3Module, fused_layers
from spd.runtime.chain import ChainDecoder
from spd.targets.stages import StagedTarget
from spd.train.objective import TeacherBatch, collate, ttt_loss
from spd.verify.sampling import Proposal


def eagle(model, seed=0, draft_vocab=None, scale=None):
    staged = StagedTarget(model, 1)
    module = Eagle3Module.from_target(staged, draft_to_target=draft_vocab, seed=seed).eval()
    return staged, module


def test_fused_layers_are_the_inputs_of_layers_2_half_and_l_minus_3():
    assert fused_layers(30) == (2, 15, 27)       # SmolLM2-135M
    assert fused_layers(36) == (2, 18, 33)
    assert fused_layers(2) == (2, 1, 0)          # tiny targets: clamped into 0..L


class RecordingDrafter(Eagle3Drafter):
    """Records the draft logits of every chain step (j, position the chain started from)."""

    def __init__(self, module, embed):
        super().__init__(module, embed)
        self.records = []

    def chain(self, m, choose):
        def record(logits):
            self.records.append((self.rows - 1, len(recorded), logits))
            recorded.append(None)
            return choose(logits)
        recorded = []
        return super().chain(m, record)


@pytest.mark.parametrize("m", [1, 3, 6])
def test_chain_drafts_equal_the_training_time_test(family_model, m):
    """Draft j after verified position i (chain decoding, cached rows, temporary rows) equals unrolled step j at row
    i of one batched training-time-test pass over the final sequence: same inputs, keys, mask and positions."""
    _, model = family_model
    staged, module = eagle(model, seed=m)
    p = prompt(m + 3)
    drafter = RecordingDrafter(module, staged.embed)
    out = ChainDecoder(staged, drafter, frozenset(), m).generate(p, Request(30, GREEDY))
    sequence = p + out.token_ids
    batch = collate([{"input_ids": sequence, "loss_mask": [True] * len(sequence)}], pad_id=0)
    capture = frozenset(module.layers_needed())
    _, hidden = staged.forward_all(batch["input_ids"], None, capture=capture)
    with torch.no_grad():
        steps = module.forward_ttt(hidden, steps=m)
    checked = 0
    for i, j, logits in drafter.records:
        # step j >= 1 read the drafts before it; compare only where those were the target's own tokens
        drafts_before = [int(torch.argmax(l)) for (ii, jj, l) in drafter.records if ii == i and jj < j]
        if drafts_before != sequence[i + 2: i + 2 + j]:
            continue
        expected = module.target_logits(steps[j][0, i])
        finite = torch.isfinite(expected)
        torch.testing.assert_close(logits[finite], expected[finite], atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= out.stats.cycles            # every cycle's first draft, at least


def test_ttt_mask_hides_later_rows_and_other_rows_later_steps(family_model):
    _, model = family_model
    staged, module = eagle(model, seed=1)
    ids = torch.tensor([prompt(5, length=8)])
    _, hidden = staged.forward_all(ids, None, capture=frozenset(module.layers_needed()))
    with torch.no_grad():
        base = module.forward_ttt(hidden, steps=3)
        # change the target's states at row 5 only: step-0 rows <= 4 and every step at rows < 5 must not move
        # (row 4's step-0 input reads x_5's embedding, which is unchanged, and its own f_4)
        changed = {l: h.clone() for l, h in hidden.items()}
        for layer in module.fused:
            changed[layer][0, 5] += 1.0
        moved = module.forward_ttt(changed, steps=3)
    for j in range(3):
        torch.testing.assert_close(moved[j][0, :5], base[j][0, :5])
        assert not torch.allclose(moved[j][0, 5], base[j][0, 5])


def test_ttt_loss_weights_step_j_by_0_8_to_the_j():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 5, generator=g), -1)
    positions = torch.tensor([[0, 3], [0, 4], [0, 1]])          # loss positions (batch, position)
    teacher = TeacherBatch({}, probs, positions, 0)
    logits = [torch.randn(1, 6, 5, generator=g) for _ in range(3)]
    loss, agree = ttt_loss(logits, teacher)
    # by hand: step j scores teacher position p with row p - 1 - j, where that row is >= 0
    expected = 0.0
    for j in range(3):
        rows = [(k, p - 1 - j) for k, (_, p) in enumerate(positions.tolist()) if p - 1 - j >= 0]
        kls = []
        for k, row in rows:
            log_q = torch.log_softmax(logits[j][0, row], -1)
            kls.append(float((probs[k] * (probs[k].log() - log_q)).sum()))
        expected += 0.8 ** j * sum(kls) / len(kls)
        assert agree[j].numel() == len(rows)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_chain_greedy_equals_ar(family_model, m):
    family, model = family_model
    vocab = torch.arange(0, model.config.vocab_size, 2)
    for seed in range(2):
        p = prompt(seed + 80)
        ar = ar_run(model, p, 40)
        staged, module = eagle(model, seed=seed, draft_vocab=vocab if seed else None)
        out = ChainDecoder(staged, Eagle3Drafter(module, staged.embed), frozenset(), m).generate(p, Request(40, GREEDY))
        assert out.token_ids == ar.token_ids, (family, m, seed)
        assert out.stats.N == 40 and out.stats.cycles >= 39 / (m + 1)


def test_chain_with_an_oracle_drafter_settles_m_plus_one_per_cycle(family_model):
    _, model = family_model
    p = prompt(9)
    reference = p + ar_run(model, p, 40).token_ids
    staged, module = eagle(model)

    class Oracle(Eagle3Drafter):
        def chain(self, m, choose):
            super().chain(m, choose)                # the module's own work still runs (greedy: no q)
            start = self.rows + 1                  # the first position after the verified sequence
            return [Proposal(reference[start + j]) for j in range(m)]

    out = ChainDecoder(staged, Oracle(module, staged.embed), frozenset(), 4).generate(p, Request(40, GREEDY))
    assert out.token_ids == reference[len(p):]
    assert out.stats.cycles == 8 and out.stats.tau == pytest.approx(39 / 8)   # 5 tokens a cycle, 4 at the end
