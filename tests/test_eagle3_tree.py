"""EAGLE-3's dynamic tree (W > 1, design §8): greedy output is the target's, each expanded node's children are the
top-W of the draft model's q along that node's own path (its rows see its ancestors and nothing else), the
budget and the width hold, and `spd-infer generate` decodes with it what `method=ar` decodes."""

import json

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.drafters.base import Cycle
from spd.cli import main
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.models.eagle3 import Eagle3Module
from spd.runtime.chain import ChainDecoder
from spd.verify.sampling import propose
from spd.targets.stages import StagedTarget


def drafter_after(model, p: list[int], seed: int = 0, draft_vocab=None):
    """A drafter that has seen the prompt and the target's first token (as chain decoding leaves it)."""
    staged = StagedTarget(model, 1)
    module = Eagle3Module.from_target(staged, draft_to_target=draft_vocab, seed=seed).eval()
    drafter = Eagle3Drafter(module, staged.embed)
    ids = torch.tensor([p])
    with torch.no_grad():
        out, captured = staged.forward_all(ids, None, 0, frozenset(drafter.layers_needed()))
    first = int(staged.logits(out[0, -1]).argmax())
    drafter.start(captured, p + [first])
    return staged, drafter, first


@pytest.mark.parametrize("width,budget", [(2, 6), (4, 16)])
def test_tree_greedy_equals_ar(family_model, width, budget):
    family, model = family_model
    vocab = torch.arange(0, model.config.vocab_size, 2)
    for seed in range(2):
        p = prompt(seed + 120)
        ar = ar_run(model, p, 40)
        staged = StagedTarget(model, 1)
        module = Eagle3Module.from_target(staged, draft_to_target=vocab if seed else None, seed=seed).eval()
        decoder = ChainDecoder(staged, Eagle3Drafter(module, staged.embed), frozenset(), 4, width, budget)
        out = decoder.generate(p, Request(40, GREEDY))
        assert out.token_ids == ar.token_ids, (family, width, seed)
        assert out.stats.drafted == budget * out.stats.cycles    # every cycle drafted a full tree


@pytest.mark.parametrize("seed", [0, 1])
def test_children_are_the_top_w_of_q_along_their_own_path(family_model, seed):
    _, model = family_model
    p = prompt(seed + 130)
    _, drafter, first = drafter_after(model, p, seed)
    tree = drafter.propose(Cycle(first, 4, 3, 12), None)
    assert len(tree) == 13 and max(tree.depths()) <= 4
    depths = tree.depths()
    for node in range(len(tree)):
        children = tree.children(node)
        assert len(children) <= 3
        if not children:
            continue
        # the draft model's q at `node`, computed as the chain computes it, with the path's tokens forced
        h = drafter.last_h
        for j, step in enumerate(tree.path(node)[1:], start=1):
            h = drafter._run(drafter.embed(torch.tensor([[tree.token(step)]])), h, drafter.rows - 1 + j)
        drafter.kv.crop(drafter.rows)
        top = set(torch.topk(drafter._log_q(h)[-1], 3).indices.tolist())
        assert {tree.token(c) for c in children} <= top, (node, depths[node])


def test_width_one_is_the_chain(family_model):
    _, model = family_model
    p = prompt(140)
    _, drafter, first = drafter_after(model, p)
    chain = drafter.chain(4, lambda logits: propose(logits, GREEDY, None))
    tree = drafter.propose(Cycle(first, 4, 1, 16), lambda logits: propose(logits, GREEDY, None))
    assert tree.is_chain() and [pr.token for pr in tree.proposals] == [pr.token for pr in chain]


def test_generate_with_a_tree_decodes_what_ar_decodes(capsys, tiny_target_dir):
    common = [f"target={tiny_target_dir}", "prompt=What is 12*7?", "max_new_tokens=24", "json=true"]
    assert main(["generate", *common, "method=eagle3", "W=4", "tree_nodes=8"]) == 0
    out, err = capsys.readouterr()
    tree = json.loads(out)
    assert main(["generate", *common, "method=ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert tree["token_ids"] == ar["token_ids"] and tree["W"] == 4 and tree["tree_nodes"] == 8
    assert tree["drafted"] == 8 * tree["cycles"]
