"""Many sequences per forward (spd.targets.ragged, spd.runtime.batch): each request decodes as it would alone.

Greedy: every request's tokens and statistics equal its solo decode (AR, the lookup chain, EAGLE-3's chain and the
lookup tree), with prompts and answers of different lengths, requests joining mid-decode and waiting for a slot, one
cancelled mid-stream and one ending on EOS. Sampling: the samples of requests that share their forwards with others
follow the target's distribution (chi-square with the power of tests/test_lossless_sampling.py).
"""

import pytest
import torch

from helpers import GREEDY, prompt
from spd.runtime.ar import ARDecoder
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.lookup import LookupDrafter
from spd.models.eagle3 import Eagle3Module
from spd.runtime.batch import BatchDecoder
from spd.runtime.chain import ChainDecoder
from spd.targets.ragged import Segment, forward_segments
from spd.targets.stages import StagedTarget
from spd.verify.tree import DraftTree
from spd.verify.sampling import Proposal
from test_lossless_sampling import ALPHA, LENGTH, PARAMS, PROMPT, SHORT, chi2_pvalue, exact_distribution


def test_ragged_rows_equal_each_sequence_alone(family_model):
    """A step, a chain and a tree of three sequences in one forward: each sequence's states equal its own forward."""
    _, model = family_model
    staged = StagedTarget(model, 1)
    prompts = [prompt(1, 7), prompt(2, 4), prompt(3, 11)]
    tree = DraftTree(20, [Proposal(21), Proposal(22), Proposal(23)], [0, 0, 1])
    feeds = [([13], None), ([14, 15, 16], None), (tree.tokens(), tree)]
    alone, together = [], []
    for p in prompts:
        for caches in (alone, together):
            cache = staged.new_cache(40)
            staged.forward_all(torch.tensor([p]), cache, 0)
            caches.append(cache)
    segments = [Segment.tree(together[i], len(prompts[i]), t or DraftTree.chain(ids[0], [Proposal(x) for x in ids[1:]]))
                for i, (ids, t) in enumerate(feeds)]
    layers = staged.num_layers
    hidden, captured, bounds = forward_segments(staged, [ids for ids, _ in feeds], segments, frozenset({0, 2, layers}))
    for i, (ids, t) in enumerate(feeds):
        extra = dict(offsets=torch.tensor(t.depths()), visible=t.visibility()) if t else {}
        ref, ref_captured = staged.forward_all(torch.tensor([ids]), alone[i], len(prompts[i]), frozenset({0, 2}),
                                               **extra)
        lo, hi = bounds[i], bounds[i + 1]
        torch.testing.assert_close(hidden[:, lo:hi], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(captured[2][:, lo:hi], ref_captured[2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(captured[0][:, lo:hi], ref_captured[0])
        for layer in range(layers):       # the rows went to each sequence's own cache, nowhere else
            assert together[i].lengths[layer] == alone[i].lengths[layer]
            for slot in range(alone[i].lengths[layer]):   # K/V rows, or a linear layer's states after each row
                if alone[i].holds(layer, slot):
                    for mine, ref in zip(together[i].memory(layer, slot), alone[i].memory(layer, slot)):
                        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def solo_decoder(staged, kind, eos):
    if kind == "ar":
        return ARDecoder(staged, eos)
    if kind == "lookup":
        return ChainDecoder(staged, LookupDrafter(min_n=1, max_n=4), eos, 4)
    if kind == "lookup_tree":
        return ChainDecoder(staged, LookupDrafter(min_n=1, max_n=4), eos, 3, width=2, budget=5)
    return ChainDecoder(staged, Eagle3Drafter(EAGLE[staged], staged.embed), eos, 3)


EAGLE = {}


def batch_decoder(staged, kind, eos, max_batch):
    if kind == "ar":
        return BatchDecoder(staged, eos, max_batch=max_batch)
    if kind == "lookup":
        return BatchDecoder(staged, eos, lambda: LookupDrafter(min_n=1, max_n=4), 4, max_batch=max_batch)
    if kind == "lookup_tree":
        return BatchDecoder(staged, eos, lambda: LookupDrafter(min_n=1, max_n=4), 3, 2, 5, max_batch=max_batch)
    return BatchDecoder(staged, eos, lambda: Eagle3Drafter(EAGLE[staged], staged.embed), 3, max_batch=max_batch)


@pytest.mark.parametrize("kind", ["ar", "lookup", "lookup_tree", "eagle3"])
def test_each_request_in_a_batch_decodes_as_it_would_alone(family_model, untied_target_dir, kind):
    """On each family's tiny target (tied: answers loop, the lookup is mostly right) and the untied Llama (answers
    follow the context, the lookup is mostly wrong)."""
    from spd.targets.loading import load_target

    family, model = family_model
    batch_equals_solo(family, model, kind)
    if family == "llama":
        batch_equals_solo("untied", load_target(untied_target_dir).model, kind)


def batch_equals_solo(family, model, kind):
    staged = StagedTarget(model, 1)
    if kind == "eagle3":
        EAGLE[staged] = Eagle3Module.from_target(staged, seed=0)      # random: rollbacks everywhere
    vocab = model.config.vocab_size
    prompts = [prompt(10 + i, length, vocab) for i, length in enumerate([5, 12, 8, 3, 15, 9])]
    lengths = [24, 40, 30, 17, 12, 20]
    requests = [Request(n, GREEDY) for n in lengths]
    solo = [solo_decoder(staged, kind, frozenset()).generate(p, r) for p, r in zip(prompts, requests)]
    # request 2 ends on EOS: the latest token its solo decode produces for the first time (past the first)
    ids = solo[2].token_ids
    firsts = [i for i, t in enumerate(ids[:-1]) if i >= 1 and t not in ids[:i]]
    eos_token = ids[firsts[-1]] if firsts else ids[0]
    eos = frozenset({eos_token})
    solo = [solo_decoder(staged, kind, eos).generate(p, r) for p, r in zip(prompts, requests)]
    assert solo[2].token_ids[-1] == eos_token and len(solo[2].token_ids) < lengths[2]

    batch = batch_decoder(staged, kind, eos, max_batch=3)
    tickets = [batch.submit(p, r) for p, r in zip(prompts[:4], requests[:4])]   # the 4th waits for a slot
    batch.step()
    batch.step()
    tickets[1].cancel()                                                           # mid-stream
    tickets += [batch.submit(p, r) for p, r in zip(prompts[4:], requests[4:])]  # join mid-decode
    max_running = 0
    while batch.busy:
        batch.step()
        max_running = max(max_running, len(batch.running))
    assert max_running == 3 and batch.rows > batch.forwards      # forwards were shared
    for i, (ticket, ref) in enumerate(zip(tickets, solo)):
        if i == 1:
            assert ticket.finish == "cancelled" and 0 < len(ticket.tokens) < len(ref.token_ids)
            assert ticket.tokens == ref.token_ids[:len(ticket.tokens)]
            continue
        assert ticket.tokens == ref.token_ids, (family, kind, i)
        assert ticket.finish == ("stop" if ticket.tokens[-1] == eos_token else "length")
        assert ticket.finish == "stop" or i != 2
        if kind != "ar":
            ours, theirs = ticket.stats.as_dict(), ref.stats.as_dict()
            assert ours == theirs, (i, ours, theirs)


def test_a_stream_from_the_batch_decoder_is_one_request(family_model):
    _, model = family_model
    staged = StagedTarget(model, 1)
    p = prompt(7, 9)
    ref = ARDecoder(staged, frozenset()).generate(p, Request(16, GREEDY)).token_ids
    batch = BatchDecoder(staged, frozenset(), max_batch=2)
    other = batch.submit(prompt(8, 5), Request(40, GREEDY))
    assert batch.generate(p, Request(16, GREEDY)).token_ids == ref
    assert 0 < len(other.tokens) < 40          # the other request advanced in the same forwards
    stream = batch.stream(p, Request(16, GREEDY))
    assert [next(stream) for _ in range(3)] == ref[:3]
    stream.close()                              # cancelled: it leaves at the next cycle
    batch.run()
    assert other.finish == "length" and not batch.busy


@pytest.fixture(scope="module")
def small_vocab_model():
    from spd.targets.tiny import tiny_model

    return tiny_model("llama", seed=3, num_layers=2, vocab_size=16)


def sample_in_company(decoder, seed: int):
    """SHORT seeded samples of PROMPT, 8 per run beside a companion request of another prompt and length; their
    counts and statistics."""
    counts, stats = {}, []
    for base in range(0, SHORT, 8):
        companion = decoder.submit([2, 7, 1, 8, 2, 8, 1], Request(6, PARAMS, 99 + base))
        tickets = [decoder.submit(PROMPT, Request(LENGTH, PARAMS, seed + i)) for i in range(base, min(base + 8, SHORT))]
        decoder.run()
        assert companion.finish == "length"
        for t in tickets:
            counts[tuple(t.tokens)] = counts.get(tuple(t.tokens), 0) + 1
            stats.append(t.stats)
    return counts, stats


@pytest.mark.parametrize("kind", ["ar", "lookup"])
def test_batched_samples_follow_the_target_distribution(small_vocab_model, kind):
    """SHORT seeded samples of PROMPT, decoded 8 at a time beside a request with another prompt and length in every
    forward; the lookup matches one-token suffixes, so it drafts (and is rejected) often."""
    staged = StagedTarget(small_vocab_model, 1)
    new = None if kind == "ar" else (lambda: LookupDrafter(min_n=1, max_n=2))
    batch = BatchDecoder(staged, frozenset(), new, 3, max_batch=9)
    counts, stats = sample_in_company(batch, 5_000_011)
    if kind == "lookup":
        assert sum(s.drafted for s in stats) > SHORT / 2
    assert chi2_pvalue(counts, exact_distribution(small_vocab_model, PARAMS), SHORT) > ALPHA


def test_generate_decodes_a_prompts_file_in_batches(capsys, tiny_target_dir, tmp_path):
    """prompts_file: plain lines or JSONL; each record equals generate's of that prompt alone, in the file's order;
    a bad file is one line and exit 2."""
    import json

    from spd.cli import main

    prompts = ["What is 2+2?", "Name a colour.", "Count to five.", "Say hi.", "Why is the sky blue?"]
    common = [f"target={tiny_target_dir}", "method=lookup", "max_new_tokens=16"]
    solo = []
    for p in prompts:
        assert main(["generate", *common, f"prompt={p}", "json=true"]) == 0
        solo.append(json.loads(capsys.readouterr().out))
    lines = tmp_path / "prompts.txt"
    lines.write_text("\n".join(prompts) + "\n\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(prompts)))
    for path in (lines, jsonl):
        assert main(["generate", *common, f"prompts_file={path}", "max_batch=3"]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["token_ids"] for r in records] == [s["token_ids"] for s in solo]
        assert [r["text"] for r in records] == [s["text"] for s in solo]
        assert all(r["max_batch"] == 3 and r["method"] == "lookup" for r in records)
        assert [r["cycles"] for r in records] == [s["cycles"] for s in solo]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    for args, needle in ([f"prompts_file={bad}"], "line 2"), ([f"prompts_file={tmp_path / 'none'}"], "cannot be read"), \
            ([f"prompts_file={lines}", "prompt=x"], "give it alone"), ([f"prompts_file={lines}", "max_batch=0"], "max_batch=0"):
        assert main(["generate", *common, *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def pipeline_drafter(staged, kind):
    from spd.drafters.hybrid import LookupThenModule
    from spd.drafters.spd_module import ModuleDrafter
    from spd.models.module import SpeculationModule

    module = EAGLE.setdefault(("spd", staged), SpeculationModule.from_target(staged, 1, seed=0))   # random
    if kind == "lookup+module":
        return lambda: LookupThenModule(ModuleDrafter(module), 1, 3)
    return lambda: ModuleDrafter(module)


@pytest.mark.parametrize("kind,width", [("module", 1), ("lookup+module", 1), ("module", 2)])
def test_each_sequence_in_a_shared_pipeline_decodes_as_it_would_alone(family_model, untied_target_dir, kind, width,
                                                                     monkeypatch):
    """SEED's schedule (spd.runtime.seed), n = 3: a random module rolls back almost every step, the lookup accepts
    long runs on the tied targets; W = 2 keeps two branches in flight. Tokens and statistics per sequence — the
    statistics equal only if every draft did, so the modules' drafts made together (W = 1: one pass for every
    sequence the lookup leaves to the module) are each sequence's own."""
    from spd.drafters.spd_module import ModuleDrafter
    from spd.runtime.pipeline import PipelineDecoder
    from spd.runtime.seed import SeedDecoder
    from spd.targets.loading import load_target

    together = []
    alone = ModuleDrafter.propose_together.__func__

    def counted(cls, drafters, views, proposes):
        together.append(len(drafters))
        return alone(cls, drafters, views, proposes)

    monkeypatch.setattr(ModuleDrafter, "propose_together", classmethod(counted))

    family, model = family_model
    targets = [(family, model)] + ([("untied", load_target(untied_target_dir).model)] if family == "llama" else [])
    for name, target in targets:
        staged = StagedTarget(target, 3)
        make = pipeline_drafter(staged, kind)
        vocab = target.config.vocab_size
        prompts = [prompt(20 + i, length, vocab) for i, length in enumerate([5, 12, 8, 3, 9])]
        lengths = [20, 40, 30, 14, 18]
        solo = [PipelineDecoder(staged, make(), frozenset(), width).generate(p, Request(n, GREEDY))
                for p, n in zip(prompts, lengths)]
        seed = SeedDecoder(staged, make, frozenset(), width, max_batch=3)
        tickets = [seed.submit(p, Request(n, GREEDY)) for p, n in zip(prompts[:3], lengths[:3])]
        seed.step()
        seed.step()
        tickets[1].cancel()
        tickets += [seed.submit(p, Request(n, GREEDY)) for p, n in zip(prompts[3:], lengths[3:])]
        seed.run()
        assert seed.hub.rows > seed.hub.forwards                        # stages ran several sequences' rows
        for i, (ticket, ref) in enumerate(zip(tickets, solo)):
            if i == 1:
                assert ticket.finish == "cancelled" and ticket.tokens == ref.token_ids[:len(ticket.tokens)]
                continue
            assert ticket.tokens == ref.token_ids, (name, kind, width, i)
            ours, theirs = ticket.stats.as_dict(), ref.stats.as_dict()
            assert ours == theirs, (name, i)
        if kind == "module":
            assert sum(t.stats.rollbacks for t in tickets) > 10
    if width > 1:
        assert not together                     # each sequence's tree level drafts in its own batched pass
    elif kind == "module":
        assert max(together) == 3               # three sequences' module drafts in one pass


def test_shared_pipeline_samples_follow_the_target_distribution(small_vocab_model):
    """T = 1 through SEED's schedule, n = 2, a random module (rejections and resampling everywhere): 8 samples of
    PROMPT beside a companion with another prompt in every step."""
    from spd.runtime.seed import SeedDecoder

    staged = StagedTarget(small_vocab_model, 2)
    seed = SeedDecoder(staged, pipeline_drafter(staged, "module"), frozenset(), max_batch=9)
    counts, stats = sample_in_company(seed, 7_000_003)
    assert sum(s.rollbacks for s in stats) > SHORT / 4
    assert chi2_pvalue(counts, exact_distribution(small_vocab_model, PARAMS), SHORT) > ALPHA
