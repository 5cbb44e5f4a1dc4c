"""EAGLE-3 beside the context statistics (`method=eagle3 draft_source=suffix+module`): EAGLE-3's children join the
statistics' candidates with its q as their evidence, the gate skips its passes where the statistics are sure, its
cache is left as the chain leaves it, greedy decoding — chain or tree, any pricing — is the target's own, the replay
settles what the runtime settles, sampling keeps the target's distribution, and eval scores it fast exactly as the
runtime decodes it."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.suffix_eagle3 import EAGLE3, SuffixEagle3Drafter
from spd.models.eagle3 import Eagle3Module
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_chain import fast_tree_stats
from spd.pricing import RowCosts
from spd.runtime.chain import ChainDecoder
from spd.targets.stages import StagedTarget
from test_lossless_sampling import PARAMS
from test_suffix import CPU_LIKE


def make(model, costs=None, width=4, depth=1, gate=1.0, seed=0):
    staged = StagedTarget(model, 1)
    module = Eagle3Module.from_target(staged, seed=seed).eval()
    return staged, SuffixEagle3Drafter(Eagle3Drafter(module, staged.embed), costs, 4, width, depth, gate)


def started(model, tokens, **kw):
    """A drafter that has seen tokens[:-1] as the prompt and tokens[-1] as the target's first token."""
    staged, drafter = make(model, **kw)
    with torch.no_grad():
        _, captured = staged.forward_all(torch.tensor([tokens[:-1]]), None, 0, frozenset(drafter.layers_needed()))
    drafter.start(captured, tokens)
    return drafter


@pytest.mark.parametrize("depth", [1, 2])
def test_eagle3_children_join_the_statistics_candidates(family_model, depth):
    _, model = family_model
    p = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    drafter = started(model, p, depth=depth)
    nodes, evidence = drafter.candidates(m=3, width=2, budget=8)
    suffix = [i for i, e in enumerate(evidence) if e.source == "suffix"]
    eagle = [i for i, e in enumerate(evidence) if e.source == EAGLE3]
    assert suffix and eagle and drafter.consulted == 1
    assert all(nodes[i].parent < i for i in range(len(nodes)))                   # parents first
    roots = [nodes[i].token for i in range(len(nodes)) if nodes[i].parent == -1]
    assert len(roots) == len(set(roots))                                          # no child twice
    # EAGLE-3's root children are the top of its q, with q as their share
    log_q = drafter.eagle._log_q(drafter.eagle.last_h)[-1]
    top = torch.topk(log_q, 4)
    for i in eagle:
        if nodes[i].parent == -1:
            assert nodes[i].token in top.indices.tolist()
            assert evidence[i].share == pytest.approx(float(log_q[nodes[i].token].detach().exp()), rel=1e-5)
    assert max(nodes[i].depth for i in eagle) == depth
    assert drafter.eagle.kv.get_seq_length() == drafter.eagle.rows                # the drafts' rows dropped


def test_the_gate_skips_eagle3_where_the_statistics_are_sure(family_model):
    _, model = family_model
    p = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10]          # "... 9 10" was followed by 11 twice
    drafter = started(model, p, gate=0.0)           # a gate of 0: any statistics' candidate is sure enough
    _, evidence = drafter.candidates(m=3, width=2, budget=8)
    assert evidence and all(e.source == "suffix" for e in evidence) and drafter.consulted == 0
    drafter = started(model, p, gate=1.01)          # never sure enough
    _, evidence = drafter.candidates(m=3, width=2, budget=8)
    assert any(e.source == EAGLE3 for e in evidence) and drafter.consulted == 1


# a gentle curve: each row 2% dearer. Each source is calibrated on its own verdicts (spd.pricing), so on CPU_LIKE's a
# random module's children seldom pay for a chain's rows (a tiny Gemma3's never did over three prompts)
GENTLE = RowCosts(tuple(1.0 + 0.02 * i for i in range(20)))


@pytest.mark.parametrize("width,budget,costs,depth", [(1, None, None, 1), (1, None, GENTLE, 2),
                                                      (4, 12, CPU_LIKE, 1), (3, 12, RowCosts.flat(20), 2)])
def test_greedy_decodes_what_ar_decodes(family_model, width, budget, costs, depth):
    family, model = family_model
    staged, drafter = make(model, costs, width=max(width, 2), depth=depth)
    drafted = []
    grow = drafter.propose
    drafter.propose = lambda *a: drafted.append(grow(*a)) or drafted[-1]
    decoder = ChainDecoder(staged, drafter, frozenset(), 6, width, budget)
    for seed in range(3):
        p = prompt(seed + 170, vocab=model.config.vocab_size)
        out = decoder.generate(p, Request(40, GREEDY))
        assert out.token_ids == ar_run(model, p, 40).token_ids, (family, seed)
    by_source = [sum(pr.source == source for tree in drafted for pr in tree.proposals) for source in ("suffix", EAGLE3)]
    assert all(by_source), by_source          # both sources' nodes were drafted (and verified: output = AR)


@pytest.mark.parametrize("width,budget", [(1, None), (3, 12)])
def test_the_replay_settles_what_the_runtime_settles(family_model, width, budget):
    _, model = family_model
    for seed in range(2):
        p = prompt(seed + 180, vocab=model.config.vocab_size)
        staged, runtime = make(model, CPU_LIKE, depth=2, seed=seed)
        _, replayed = make(model, CPU_LIKE, depth=2, seed=seed)
        out = ChainDecoder(staged, runtime, frozenset(), 6, width, budget).generate(p, Request(40, GREEDY))
        trace = record_greedy_trace(staged, p, 40, frozenset(), runtime.layers_needed())
        got = fast_tree_stats(replayed, trace, 6, width, budget or 6)
        want = out.stats
        assert (got["stats"].N, got["stats"].cycles, got["stats"].accepted_per_cycle, got["stats"].verdicts) == \
            (want.N, want.cycles, want.accepted_per_cycle, want.verdicts)
        assert sum(got["rows_per_cycle"]) == want.drafted + want.cycles


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution():
    """T = 1: the statistics' and EAGLE-3's deterministic children verified by one draw of p per node, priced on a
    CPU-like curve (chi-square with the power of tests/test_lossless_sampling.py)."""
    from spd.targets.tiny import tiny_model
    from test_lossless_sampling import ALPHA, SHORT, chi2_pvalue, exact_distribution, sample_chain

    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    dist = exact_distribution(model, PARAMS)
    staged, drafter = make(model, CPU_LIKE, width=2, depth=2, seed=1)
    verdicts = []
    counts = sample_chain(ChainDecoder(staged, drafter, frozenset(), 2, 4, 8), SHORT, seed=11, verdicts=verdicts)
    kept = sum(ok for _, _, ok in verdicts)
    assert sum(ok for _, source, ok in verdicts if source == EAGLE3) > SHORT * 0.05     # EAGLE-3's children kept
    assert len(verdicts) - kept > SHORT * 0.05                                          # nodes missed, often
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.parametrize("width", [1, 4])
def test_eval_scores_it_fast_as_the_runtime_decodes_it(capsys, tiny_target_dir, tmp_path, width):
    """Greedy eval replays the runtime's own drafter over the traces; each sample equals the step-by-step runtime's
    (which is checked against AR)."""
    from test_eval import fast_equals_runtime

    fast_equals_runtime(capsys, tiny_target_dir, tmp_path,
                        ["method=eagle3", "draft_source=suffix+module", "limit=1", "draft_length=4", f"W={width}",
                         "tree_nodes=8", "max_new_tokens=24", "calibrate=false"])
