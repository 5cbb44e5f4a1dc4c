"""Trees and EAGLE-3's module through the device step (spd.runtime.device_step): a tree of W children a node verified
under its ancestor mask with its accepted path moved down in the cache, and EAGLE-3's chain and tree drafted inside
the step.
Lossless (greedy = AR, keyed sampling = AR's keyed draws, the target's distribution by chi-square with its power
check), compiled whole with `fullgraph=True`, and no host read inside a step."""

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.eagle3_device import Eagle3DeviceDrafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.models.eagle3 import Eagle3Module
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from test_device_step import SAMPLED, HostReads, answer_counts, keep_argmax_drafts
from test_lossless_sampling import ALPHA, PARAMS, SHORT, chi2_pvalue, exact_distribution




def tree_decoder(target, drafter=SuffixDrafter, width=4, budget=12, compile=None):
    return DeviceChainDecoder(StagedTarget(target, 1), frozenset(), drafter(), 6, compile, width=width,
                              budget=budget)


def eagle3_decoder(target, k=4, compile=None, width=1, budget=None):
    staged = StagedTarget(target, 1)
    module = Eagle3Module.from_target(staged, seed=1)
    return DeviceChainDecoder(staged, frozenset(), None, k, compile, width=width, budget=budget,
                              device_drafter=Eagle3DeviceDrafter(module, staged.embed)), module


def lookup():
    return LookupDrafter(min_n=1, max_n=4)


@pytest.mark.parametrize("drafter", [SuffixDrafter, lookup], ids=["suffix", "lookup"])
def test_trees_greedy_and_keyed_equal_ar(family_model, untied_target_dir, drafter):
    family, model = family_model
    branched = 0
    for target in (model, load_target(untied_target_dir).model):
        device = tree_decoder(target, drafter)
        for case, (params, seed) in enumerate([(GREEDY, None), (GREEDY, None), (SAMPLED, 3), (SAMPLED, 4)]):
            p = prompt(40 + case, vocab=target.config.vocab_size)
            assert device.generate(p, Request(40, params, seed)).token_ids == \
                ar_run(target, p, 40, params, seed=seed).token_ids, (family, params)
            branched += device.stats.accepted
    assert branched > 0


def test_a_tree_path_off_the_first_branch_is_moved_down(untied_target_dir):
    """A tree whose accepted path runs through a later sibling: its rows must be moved down before the next cycle
    reads them, or the untied target's next tokens differ from AR's."""
    target = load_target(untied_target_dir).model
    p = prompt(61, vocab=target.config.vocab_size)
    reference = ar_run(target, p, 30).token_ids
    answer = reference

    class Decoy(LookupDrafter):
        """Each cycle: a wrong first child, then the right continuation as the second child's branch."""
        def propose(self, cycle, propose):
            root = cycle.root
            from spd.verify.sampling import Proposal
            from spd.verify.tree import DraftTree
            done = len(self.tokens) - len(p)
            tree = DraftTree(root)
            truth = answer[done: done + 3]
            tree.add(0, Proposal((truth[0] + 1) % target.config.vocab_size if truth else 1))
            node = 0
            for token in truth:
                node = tree.add(node, Proposal(token))
            return tree

        def start(self, hidden, tokens):
            self.tokens = list(tokens)

        def observe(self, hidden, tokens):
            self.tokens = list(tokens)

    device = DeviceChainDecoder(StagedTarget(target, 1), frozenset(), Decoy(), 4, width=2, budget=6)
    assert device.generate(p, Request(30, GREEDY)).token_ids == reference
    assert device.stats.accepted >= 2 * device.stats.cycles - 2      # the second branch was kept, cycle after cycle


def tree_counts(model, samples: int, seed: int) -> dict:
    return answer_counts(tree_decoder(model, lookup, width=2, budget=6), samples, seed)


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model("llama", seed=3, num_layers=2, vocab_size=16)


def test_the_tree_samples_the_target_distribution(small_vocab_model, monkeypatch):
    """T = 1 with top-k and top-p, the lookup's W = 2 trees: the chi-square passes; a step that keeps a draft
    whenever it is the target's argmax (not the keyed draw) is rejected by the same test."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    assert chi2_pvalue(tree_counts(small_vocab_model, SHORT, 21), dist, SHORT) > ALPHA
    keep_argmax_drafts(monkeypatch)
    assert chi2_pvalue(tree_counts(small_vocab_model, SHORT, 22), dist, SHORT) < ALPHA


def test_eagle3_greedy_and_keyed_equal_ar(family_model, untied_target_dir):
    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        device, _ = eagle3_decoder(target)
        for params, seed in [(GREEDY, None), (SAMPLED, 5)]:
            p = prompt(80, vocab=target.config.vocab_size)
            assert device.generate(p, Request(40, params, seed)).token_ids == \
                ar_run(target, p, 40, params, seed=seed).token_ids, (family, params)


def test_eagle3_drafts_on_the_device_what_its_host_drafter_drafts():
    """The same module drafts the same chains inside the step as spd.drafters.eagle3 does on the host, cycle by
    cycle (a wrong slot, position or feature row would change them)."""
    target = tiny_model("llama", num_layers=4)
    device, module = eagle3_decoder(target)
    host_drafter = Eagle3Drafter(module, device.target.embed)
    host = ChainDecoder(StagedTarget(target, 1), host_drafter, frozenset(), 4)
    on_device, on_host = [], []
    draft, chain = device.device_drafter.propose, host_drafter.chain

    def record_device(root, choose=None):
        draft(root, choose)
        on_device.append(device.device_drafter.drafts.tolist())

    def record_host(m, propose):
        out = chain(m, propose)
        on_host.append([proposal.token for proposal in out])
        return out
    device.device_drafter.propose, host_drafter.chain = record_device, record_host
    p = prompt(12, vocab=target.config.vocab_size)
    assert device.generate(p, Request(40, GREEDY)).token_ids == host.generate(p, Request(40, GREEDY)).token_ids
    assert device.stats.accepted_per_cycle == host.stats.accepted_per_cycle
    assert on_device[: len(on_host)] == on_host and len(on_host) == host.stats.cycles
    assert len({token for chain in on_host for token in chain}) > 3      # drafts that vary: the rows were read


def test_eagle3_trees_equal_ar(family_model, untied_target_dir, small_vocab_model):
    """EAGLE-3's dynamic tree drafted inside the step: greedy and keyed sampling equal AR's on every family; on the
    16-token vocabulary its W = 3 children are often the target's choice, so paths through the tree are kept."""
    family, model = family_model
    kept = 0
    for target in (model, load_target(untied_target_dir).model, small_vocab_model):
        device, _ = eagle3_decoder(target, 4, width=3, budget=10)
        for params, seed in [(GREEDY, None), (SAMPLED, 3), (SAMPLED, 4)]:
            p = prompt(12, vocab=target.config.vocab_size)
            assert device.generate(p, Request(40, params, seed)).token_ids == \
                ar_run(target, p, 40, params, seed=seed).token_ids, (family, params)
            kept += device.stats.accepted
    assert kept > 0


def test_eagle3_trees_on_the_device_are_its_host_trees():
    """Inside the step the module grows the tree spd.drafters.eagle3 grows on the host: the same nodes in the same
    rows under the same parents, cycle by cycle (a wrong temporary slot, ancestor mask or tie would change them)."""
    target = tiny_model("llama", num_layers=4)
    device, module = eagle3_decoder(target, 4, width=3, budget=10)
    host_drafter = Eagle3Drafter(module, device.target.embed)
    host = ChainDecoder(StagedTarget(target, 1), host_drafter, frozenset(), 4, width=3, budget=10)
    on_device, on_host = [], []
    device_tree, host_tree = device.device_drafter.propose, host_drafter.propose

    def record_device(root, choose=None):
        device_tree(root, choose)
        drafts, tree = device.device_drafter.drafts, device.device_drafter.tree
        on_device.append((drafts.tolist(), tree.parent[1: len(drafts) + 1].tolist()))

    def record_host(cycle, propose):
        out = host_tree(cycle, propose)
        on_host.append((out.tokens()[1:], list(out.parents)))
        return out
    device.device_drafter.propose, host_drafter.propose = record_device, record_host
    p = prompt(12, vocab=target.config.vocab_size)
    assert device.generate(p, Request(40, GREEDY)).token_ids == host.generate(p, Request(40, GREEDY)).token_ids
    assert on_device[: len(on_host)] == on_host and len(on_host) == host.stats.cycles
    assert len({tuple(parents) for _, parents in on_host}) > 1      # shapes that vary: the scores were read


def test_the_eagle3_tree_samples_the_target_distribution(small_vocab_model, monkeypatch):
    """T = 1, EAGLE-3's W = 3 trees on a 16-token vocabulary: the chi-square passes; keeping a node whenever it is
    the target's argmax is rejected by the same test."""
    dist = exact_distribution(small_vocab_model, PARAMS)

    def counts(seed):
        return answer_counts(eagle3_decoder(small_vocab_model, 3, width=3, budget=8)[0], SHORT, seed)
    assert chi2_pvalue(counts(23), dist, SHORT) > ALPHA
    keep_argmax_drafts(monkeypatch)
    assert chi2_pvalue(counts(24), dist, SHORT) < ALPHA


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["tree", "eagle3", "eagle3_tree"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_step_compiles_whole_and_reads_nothing_back(params, kind, family):
    """torch.compile(fullgraph=True) traces the tree's and EAGLE-3's whole step (a graph break would raise), and an
    eager step reads no value back (the decoder's one read a cycle happens after it); on the hybrid, each tree
    row's linear-attention states follow its parent's by position tensors."""
    target = tiny_model(family, num_layers={"llama": 2, "qwen3_5": 4}[family])
    p = prompt(5, vocab=target.config.vocab_size)
    request = Request(24, params, 1)
    make = {"tree": lambda c: tree_decoder(target, lookup, 2, 6, c),
            "eagle3": lambda c: eagle3_decoder(target, 4, c)[0],
            "eagle3_tree": lambda c: eagle3_decoder(target, 3, c, width=2, budget=6)[0]}[kind]
    assert make("aot_eager").generate(p, request).token_ids == ar_run(target, p, 24, params, seed=1).token_ids
    device = make(None)
    device.generate(p, request)
    step = device.steps[max(device.steps)]
    with HostReads() as mode:
        step.run()
    assert mode.reads == []
