"""Keyed draws (spd.verify.sampling.KeyedDraws): at T = 1 the token at each position is the Gumbel-max draw of the
target's warped p with noise keyed by (the request's key, the position). So a seeded request samples the same text
token for token whether AR decodes it or a draft-then-verify decoder does — at any width, with any drafts, with a
drafter that reads the noise, alone or in a batch — and AR's keyed draws follow the target's distribution (the
chi-square and power of tests/test_lossless_sampling.py). The priced statistics weigh each candidate by its own
noise (spd.pricing.given_noise)."""

import pytest
import torch

from helpers import ar_run, prompt
from spd.decoding import Request
from spd.drafters.base import CHAIN, DRAWS, Cycle, Drafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.pricing import NOISE_SHARE, AcceptancePredictor, Evidence, RowCosts, given_noise
from spd.runtime.batch import BatchDecoder
from spd.runtime.chain import ChainDecoder
from spd.verify.sampling import KeyedDraws, Proposal, SamplingParams, warp
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from spd.verify.tree import DraftTree
from test_lossless_sampling import ALPHA, PARAMS, PROMPT, SHORT, chi2_pvalue, exact_distribution
from test_suffix import CPU_LIKE

SAMPLED = [SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_k=0, top_p=0.9)]


class Clairvoyant(Drafter):
    """Drafts, m deep, what the keyed draws will choose — it runs the target itself and reads the noise — except a
    wrong token wherever the position is a multiple of 3: every draft is chosen by the noise, and cycles end on
    kept runs and on misses alike."""

    capabilities = frozenset({CHAIN, DRAWS})

    def __init__(self, model, params: SamplingParams):
        self.model, self.params, self.draws = model, params, None

    def start(self, prompt_hidden, tokens):
        self.tokens = list(tokens)

    def sampling_draws(self, draws):
        self.draws = draws

    def observe(self, hidden, tokens):
        self.tokens = list(tokens)

    def propose(self, cycle, propose=None):
        root, m, width, budget = cycle.root, cycle.m, cycle.width, cycle.budget
        seq, drafts = list(self.tokens), []
        for _ in range(m):
            with torch.no_grad():
                logits = self.model(torch.tensor([seq])).logits[0, -1]
            token = self.draws.sample(warp(logits, self.params), len(seq))
            if len(seq) % 3 == 0:
                token = (token + 1) % self.model.config.vocab_size
            drafts.append(Proposal(token, source="clairvoyant"))
            seq.append(token)
        return DraftTree.chain(root, drafts)


def test_the_noise_is_a_function_of_key_and_position():
    a, b = KeyedDraws(7, 1000), KeyedDraws(7, 1000)
    assert torch.equal(a.uniforms(5), b.uniforms(5)) and a.uniform(5, 17) == float(b.uniforms(5)[17])
    assert not torch.equal(a.uniforms(5), a.uniforms(6))            # positions differ
    assert not torch.equal(a.uniforms(5), KeyedDraws(8, 1000).uniforms(5))    # keys differ
    u = torch.cat([a.uniforms(t) for t in range(50)])
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01
    # a key and a position a little apart are not the same stream shifted
    assert not torch.equal(KeyedDraws(7, 1000).uniforms(6), KeyedDraws(8, 1000).uniforms(5))
    # the request's key is its seed's: the first draw of its own generator
    assert KeyedDraws.of(Request(4, seed=3).generator("cpu"), 10).key == \
        KeyedDraws.of(Request(4, seed=3).generator("cpu"), 10).key != \
        KeyedDraws.of(Request(4, seed=4).generator("cpu"), 10).key


def splitmix64(x: int) -> int:
    """SplitMix64's finaliser on Python integers, as unsigned 64-bit arithmetic: the reference the tensors match."""
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@pytest.mark.parametrize("key", [0, 7, 2 ** 62 - 1])
def test_the_uniforms_are_splitmix64_bit_for_bit(key):
    """The tensor hash (int64 tensors standing for uint64) equals SplitMix64 on Python integers, every bit."""
    gamma, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    for position in (0, 5, 1 << 40):
        seed = splitmix64(((key ^ splitmix64((position + gamma) & mask)) + gamma) & mask)
        want = [(splitmix64((seed + i * gamma) & mask) >> 11) * 2.0 ** -53 for i in range(1, 301)]
        assert KeyedDraws(key, 300).uniforms(position).tolist() == want


def test_a_step_draws_the_hosts_noise_on_the_device(monkeypatch):
    """The device step computes each row's Gumbel noise from the request's key and its position tensor: bitwise the
    noise of the host's draws at those positions (chain rows and tree rows by depth), with nothing copied in."""
    from spd.decoding import prefill
    from spd.runtime import device_step
    from spd.runtime.device_step import DeviceStep, StepState

    seen = []
    real = device_step.choose
    monkeypatch.setattr(device_step, "choose", lambda logits, params, noise: (seen.append(noise), real(logits, params, noise))[1])
    staged = StagedTarget(tiny_model("llama", num_layers=2), 1)
    vocab = staged.config.vocab_size
    cache, _, _ = prefill(staged, prompt(10, vocab=vocab), max_length=64)
    draws = KeyedDraws(123456789, vocab)
    for tree in (False, True):
        state = StepState(staged, cache, 5, SamplingParams(temperature=1.0))
        step = DeviceStep(staged, state, 5, tree=tree)
        state.key.fill_(draws.key)
        state.position.fill_(10)
        state.depth.copy_(torch.tensor([0, 1, 1, 2, 3]) if tree else torch.arange(5))
        state.parent.copy_(torch.tensor([0, 0, 0, 1, 3]) if tree else (torch.arange(5) - 1).clamp(min=0))
        step.run()
        depths = [0, 1, 1, 2, 3] if tree else range(5)
        host = -torch.log(-torch.log(torch.stack([draws.uniforms(11 + d) for d in depths])))
        assert torch.equal(seen[-1], host)


def test_the_cache_forgets_the_oldest_positions():
    draws = KeyedDraws(1, 10)
    first = draws.uniforms(0).clone()
    for t in range(1, KeyedDraws.KEEP + 5):
        draws.uniforms(t)
    assert len(draws.cache) == KeyedDraws.KEEP and 0 not in draws.cache
    assert torch.equal(draws.uniforms(0), first)                     # drawn again, the same


def test_a_draw_keeps_to_the_support_and_follows_the_noise():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    draws = KeyedDraws(3, 4)
    picks = {draws.sample(probs, t) for t in range(200)}
    assert picks == {1, 3}
    for t in range(50):         # between equal probabilities the noisier token wins
        u = draws.uniforms(t)
        assert draws.sample(probs, t) == (1 if u[1] > u[3] else 3)


@pytest.mark.slow
def test_keyed_ar_samples_the_target_distribution():

    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    dist = exact_distribution(model, PARAMS)
    counts = {}
    for i in range(SHORT):
        key = tuple(ar_run(model, PROMPT, 3, PARAMS, seed=12 * 1_000_003 + i).token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


def test_given_noise_averages_back_to_the_chance():
    grid = torch.linspace(0.0005, 0.9995, 1000).tolist()
    for chance in (0.05, 0.3, 0.5, 0.9):
        assert sum(given_noise(chance, u) for u in grid) / len(grid) == pytest.approx(chance, abs=2e-3)
        assert given_noise(chance, 0.2) < given_noise(chance, 0.8)          # more noise, likelier the draw
    assert given_noise(0.5, 0.7, share=1.0) == pytest.approx(0.7)           # p = 1/2: the formula's chance is u
    # the default trusts the noise with a share of the chance: a candidate whose noise is lowest keeps a floor, one
    # whose noise is highest is not made a certainty (the formula alone overstated both ends)
    share = NOISE_SHARE
    assert 0 < share < 1
    assert given_noise(0.3, 1e-9) == pytest.approx((1 - share) * 0.3)
    assert given_noise(0.3, 1.0) == pytest.approx((1 - share) * 0.3 + share)
    assert given_noise(0.5, 0.7) == pytest.approx((1 - share) * 0.5 + share * 0.7)


def test_the_priced_statistics_draft_by_the_noise():
    """The same candidates, the same predictor: a candidate whose noise is low is priced out, a high one drafted."""
    class Fixed:
        def __init__(self, u):
            self.u = u

        def uniform(self, position, token):
            return self.u

        def chance(self, position):
            return float("nan")         # nothing drawn: no recall

    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    rows = {}
    for u in (0.01, 0.99):
        drafter = SuffixDrafter(1, 4, RowCosts((1.0, 1.3, 1.6)))
        drafter.start(None, tokens)
        drafter.sampling_draws(Fixed(u))
        rows[u] = len(drafter.propose(Cycle(tokens[-1], 2, 1, 2)))
    assert rows[0.01] == 1 and rows[0.99] > 1         # low noise: a plain step; high noise: drafted


def test_the_sampled_prior_is_lower_and_slower_and_not_the_default():
    """At T > 0 a candidate is kept with the target's p of it, not when it is the argmax: the sampled prior
    (AcceptancePredictor.for_sampling, an A/B by the clock) starts lower and a bucket's few
    verdicts move it less; method=suffix's drafter keeps the greedy prior for every request."""
    sampled, greedy = AcceptancePredictor.for_sampling(), AcceptancePredictor()
    e = Evidence("suffix", match=4, share=0.9, support=6.0, depth=1)
    assert sampled.prior(e) < greedy.prior(e) and sampled.prior_weight > greedy.prior_weight
    assert sampled.predict(e) < greedy.predict(e)
    for _ in range(3):                       # the same three misses move the sampled estimate less
        sampled.observe(e, False)
        greedy.observe(e, False)
    assert sampled.predict(e) / sampled.prior(e) > greedy.predict(e) / greedy.prior(e)

    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    for draws in (KeyedDraws(7, 16), None):
        drafter = SuffixDrafter(1, 4, RowCosts((1.0, 1.3, 1.6)))
        drafter.start(None, tokens)
        drafter.sampling_draws(draws)
        assert drafter.predictor.prior_weight == AcceptancePredictor().prior_weight, draws


def test_the_draws_record_each_drawn_tokens_chance():
    """KeyedDraws.chance: the target's (warped) p of the token drawn at a position, NaN where nothing was drawn."""
    draws = KeyedDraws(7, 16)
    probs = torch.softmax(torch.arange(16, dtype=torch.float32) / 4, dim=-1)
    for position in (3, 9):
        token = draws.sample(probs, position)
        assert draws.chance(position) == pytest.approx(float(probs[token]), rel=1e-6)
    assert draws.chance(4) != draws.chance(4)


def test_a_sampled_request_prices_a_candidate_by_its_recalled_chance():
    """At T > 0 a context candidate carries the target's p of its token where the context had it (its recall), and
    the prior leans on it — a candidate the target had been sure of is priced above one it had drawn by luck, the
    rest of the evidence the same; whenever greedy (no draws) the recall is unknown and the prices are the ones
    without it."""
    class Drawn:
        def __init__(self, chance):
            self.p = chance

        def uniform(self, position, token):
            return 0.5

        def chance(self, position):
            return self.p

    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    prices = {}
    for name, draws in (("sure", Drawn(0.95)), ("lucky", Drawn(0.05)), ("greedy", None)):
        drafter = SuffixDrafter(1, 4, RowCosts((1.0, 1.3, 1.6)))
        drafter.start(None, tokens[:3])
        drafter.sampling_draws(draws)
        drafter.observe(None, tokens)            # the answer: drawn with the draws' chance at each position
        nodes, evidence = drafter.candidates(2, 1, 2)
        assert nodes[0].token == 3 and evidence[0].match == 2     # "1 2" was followed by 3 twice
        recalled = evidence[0].recall
        assert (recalled == pytest.approx(draws.p)) if draws else recalled != recalled, name
        prices[name] = drafter.predictor.predict(evidence[0])
    assert prices["sure"] > prices["greedy"] > prices["lucky"]
    # the prompt's positions were not drawn: their tokens carry no recall
    drafter = SuffixDrafter(1, 4, RowCosts((1.0, 1.3, 1.6)))
    drafter.start(None, tokens)
    drafter.sampling_draws(Drawn(0.95))
    assert all(e.recall != e.recall for e in drafter.candidates(2, 1, 2)[1])


def sampled_decoders(model, params):
    staged = StagedTarget(model, 1)
    return {"lookup chain": ChainDecoder(staged, LookupDrafter(1, 3), frozenset(), 4),
            "suffix W=1": ChainDecoder(staged, SuffixDrafter(1, 4, CPU_LIKE), frozenset(), 8),
            "suffix W=4": ChainDecoder(staged, SuffixDrafter(1, 4, CPU_LIKE), frozenset(), 8, 4, 12),
            "suffix W=4 flat": ChainDecoder(staged, SuffixDrafter(1, 4, RowCosts.flat(16)), frozenset(), 8, 4, 15),
            "clairvoyant": ChainDecoder(staged, Clairvoyant(model, params), frozenset(), 4)}


@pytest.mark.parametrize("params", SAMPLED, ids=["top_k", "top_p"])
def test_sampled_chains_and_trees_decode_what_keyed_ar_samples(family_model, untied_target_dir, params):
    """Token for token, per seed, on each family's tiny target and the untied Llama; drafts kept and missed."""
    from spd.targets.loading import load_target

    family, model = family_model
    targets = [(family, model)] + ([("untied", load_target(untied_target_dir).model)] if family == "llama" else [])
    for name, target in targets:
        kept = missed = 0
        for kind, decoder in sampled_decoders(target, params).items():
            for seed in range(3):
                p = prompt(seed + 30, vocab=target.config.vocab_size)
                out = decoder.generate(p, Request(30, params, seed))
                assert out.token_ids == ar_run(target, p, 30, params, seed=seed).token_ids, (name, kind, seed)
                kept += out.stats.accepted
                missed += sum(not ok for _, _, ok in out.stats.verdicts)
        assert kept > 20 and missed > 20, (name, kept, missed)


def test_a_batch_samples_what_each_request_samples_alone(family_model):
    _, model = family_model
    staged = StagedTarget(model, 1)
    params = SAMPLED[0]
    prompts = [prompt(60 + i, 4 + 3 * i, model.config.vocab_size) for i in range(4)]
    batch = BatchDecoder(staged, frozenset(), lambda: SuffixDrafter(1, 4, CPU_LIKE), 8, 4, 12, max_batch=3)
    tickets = [batch.submit(p, Request(25, params, 100 + i)) for i, p in enumerate(prompts)]
    while batch.busy:
        batch.step()
    for i, (ticket, p) in enumerate(zip(tickets, prompts)):
        assert ticket.tokens == ar_run(model, p, 25, params, seed=100 + i).token_ids, i


def test_an_unseeded_request_is_free():

    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    # this model's likeliest 6 tokens under PARAMS come up ~55% of the time, so 8 runs all agreed ~1% of the time
    # (CI saw it); 48 runs all agree with p ~ 1e-12
    outs = {tuple(ar_run(model, PROMPT, 6, PARAMS).token_ids) for _ in range(48)}
    assert len(outs) > 1


def test_the_default_samples_what_method_ar_samples(capsys, tiny_target_dir):
    """`spd-infer generate` at T = 1 with a seed: the default (the priced statistics on a CPU), the lookup chain and
    a draft tree print method=ar's tokens; another seed, other tokens."""
    import json

    from test_cli import run

    common = [f"target={tiny_target_dir}", "prompt=Tell me a story about 12 cats.", "max_new_tokens=30",
              "temperature=1", "top_k=8", "json=true"]
    ar = json.loads(run(capsys, *common, "seed=7", "method=ar")[1])
    for extra in ([], ["method=lookup"], ["method=suffix", "W=4"]):
        code, out, err = run(capsys, *common, "seed=7", *extra)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == ar["token_ids"], extra
    other = json.loads(run(capsys, *common, "seed=8", "method=ar")[1])
    assert other["token_ids"] != ar["token_ids"]


@pytest.mark.parametrize("width,budget", [(1, None), (3, 12)])
def test_the_replay_settles_what_the_sampled_runtime_settles(family_model, width, budget):
    """With keyed draws a sampled answer is a trace like a greedy one: the one replay (spd.eval.fast_chain.replay),
    told the same draws and the target's p of each sampled token, drafts and settles exactly the runtime's cycles — the
    noise-priced drafter, which recalls those p's, included."""
    from spd.eval.fast_chain import replay
    from spd.verify.sampling import top2_margin

    _, model = family_model
    staged, params = StagedTarget(model, 1), SAMPLED[0]
    drafted = 0
    for seed in range(3):
        p = prompt(seed + 150, vocab=model.config.vocab_size)
        request = Request(40, params, seed)
        out = ChainDecoder(staged, SuffixDrafter(1, 4, CPU_LIKE), frozenset(), 8, width, budget).generate(p, request)
        with torch.no_grad():
            logits = model(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:]
        margins = [top2_margin(row) for row in logits]
        chances = [float(warp(row, params)[token]) for row, token in zip(logits, out.token_ids)]
        draws = KeyedDraws.of(request.generator("cpu"), model.config.vocab_size)
        got = replay(SuffixDrafter(1, 4, CPU_LIKE), p, out.token_ids, 8, width, budget or 8, margins=margins,
                     draws=draws, chances=chances)["stats"]
        want = out.stats
        assert (got.N, got.cycles, got.accepted_per_cycle, got.verdicts) == \
            (want.N, want.cycles, want.accepted_per_cycle, want.verdicts), seed
        drafted += want.drafted
    assert drafted > 0


def test_a_draws_support_hashes_the_same_uniforms_as_the_whole_vocabulary():
    """KeyedDraws.draw hashes only its support's uniforms: the values the whole vocabulary's vector holds there."""
    from spd.verify.sampling import keyed_uniforms

    key, positions = torch.tensor(123456789), torch.tensor([0, 7, 4095])
    tokens = torch.tensor([0, 1, 17, 49151, 30000])
    whole = keyed_uniforms(key, positions, 49152)
    assert torch.equal(keyed_uniforms(key, positions, 49152, tokens), whole[:, tokens])


def test_warp_reads_a_large_vocabulary_by_blocks_and_the_host_hashes_a_support_as_the_tensors_do():
    """On a CPU vocabulary of SmolLM2's size warp's top-k threshold comes from the blocks that can hold it
    (spd.verify.sampling.kth_largest: torch.topk's value, ties, tiny and huge k included, so warp's probabilities bit
    for bit), and a draw's uniforms from NumPy's 64-bit arithmetic (host_uniforms: keyed_uniforms' values)."""
    from spd.verify.sampling import host_uniforms, keyed_uniforms, kth_largest
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        x = torch.randn(49152, generator=g) * (1 + trial % 5)
        if trial % 3 == 0:
            x = (x * 2).round() / 2                      # many equal logits
        for k in (1, 2, 50, 768, 769, 5000):
            assert torch.equal(kth_largest(x, k), torch.topk(x, k).values[-1]), k
        for params in (SamplingParams(1.0, top_k=50), SamplingParams(0.7, top_k=50), SamplingParams(1.0, top_k=1)):
            scaled = x / params.temperature
            kth = torch.topk(scaled, params.top_k).values[-1]
            plain = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)
            assert torch.equal(warp(x, params), plain)
    for key in (0, 1, 2 ** 62 - 1, 123456789012345):
        for position in (0, 7, 4095, 10 ** 6):
            tokens = torch.randint(0, 49152, (60,), generator=g)
            want = keyed_uniforms(torch.tensor(key), torch.tensor([position]), 49152, tokens)[0]
            assert torch.equal(host_uniforms(key, position, tokens), want)
