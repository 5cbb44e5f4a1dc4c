"""The device step (spd.runtime.device_step): a draft-then-verify cycle as one function of device tensors. Lossless
(greedy = AR, keyed sampling = AR's keyed draws, the target's distribution by chi-square), compiled whole with
`fullgraph=True`, and no host read inside a step: the decoder reads one buffer a cycle."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request, prefill
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.runtime.device_chain import DeviceChainDecoder
from spd.runtime.device_step import DeviceStep, StepState
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from test_lossless_sampling import ALPHA, LENGTH, PARAMS, PROMPT, SHORT, chi2_pvalue, exact_distribution



SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
LAYERS = {"llama": 2, "qwen3_5": 4}     # the hybrid's: three linear-attention layers, then attention


def decoder(target, k, compile=None, drafter=LookupDrafter):
    """k = 0: plain AR through the step; else the lookup's (or `drafter`'s) chain of up to k drafts a cycle."""
    drafter = (LookupDrafter(min_n=1, max_n=4) if drafter is LookupDrafter else drafter()) if k else None
    return DeviceChainDecoder(StagedTarget(target, 1), frozenset(), drafter, k, compile)


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_greedy_equals_ar(family_model, untied_target_dir, k):
    """Tied tiny targets loop (the lookup is right most of the time), the untied one does not: both paths."""
    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        device = decoder(target, k)
        for seed in range(2):
            p = prompt(seed + 50, vocab=target.config.vocab_size)
            assert device.generate(p, Request(40, GREEDY)).token_ids == ar_run(target, p, 40).token_ids, \
                (family, k, seed)
    if k:
        assert device.stats.accepted > 0 and device.stats.cycles < 39          # drafts were kept: several tokens a cycle


def test_the_priced_statistics_chain_equals_ar(family_model, untied_target_dir):
    """The priced context statistics (method=suffix W=1) read the target's margin from the cycle's one read."""
    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        for params, seed in [(GREEDY, None), (SAMPLED, 4)]:
            device = decoder(target, 15, drafter=SuffixDrafter)
            p = prompt(seed or 90, vocab=target.config.vocab_size)
            assert device.generate(p, Request(40, params, seed)).token_ids == \
                ar_run(target, p, 40, params, seed=seed).token_ids, (family, params)
        assert device.stats.drafted > 0


@pytest.mark.parametrize("k", [0, 4])
def test_keyed_sampling_equals_ar(family_model, untied_target_dir, k):
    """A seeded request samples AR's own text: the step chooses by the same keyed Gumbel-max draw."""
    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        device = decoder(target, k)
        for seed in range(3):
            p = prompt(seed + 70, vocab=target.config.vocab_size)
            request = Request(30, SAMPLED, seed)
            assert device.generate(p, request).token_ids == ar_run(target, p, 30, SAMPLED, seed=seed).token_ids, \
                (family, k, seed)


def answer_counts(device, samples: int, seed: int) -> dict:
    """How often each answer to PROMPT comes out of `device` over `samples` seeded requests (T = 1, PARAMS)."""
    counts = {}
    for i in range(samples):
        key = tuple(device.generate(PROMPT, Request(LENGTH, PARAMS, seed * 1_000_003 + i)).token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def sample_counts(model, samples: int, seed: int) -> dict:
    return answer_counts(decoder(model, 4), samples, seed)


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model("llama", seed=3, num_layers=2, vocab_size=16)


def keep_argmax_drafts(monkeypatch) -> None:
    """A broken verdict for the power checks: the step keeps a draft whenever it is the target's argmax, not the
    keyed draw."""
    choose = DeviceStep.choose

    def argmax_for_drafts(self, logits):
        chosen = choose(self, logits)
        return torch.where(self.rows < self.state.drafts, logits.argmax(-1), chosen) if len(chosen) > 1 else chosen
    monkeypatch.setattr(DeviceStep, "choose", argmax_for_drafts)


def test_the_chain_samples_the_target_distribution(small_vocab_model):
    """T = 1 with top-k and top-p, the lookup's chain (PROMPT's tokens recur, so drafts are verified): a chi-square
    against the enumerated distribution (tests/test_lossless_sampling.py shows it rejects a 5% TV shift)."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    assert chi2_pvalue(sample_counts(small_vocab_model, SHORT, 11), dist, SHORT) > ALPHA


def test_an_acceptance_that_ignores_the_draw_is_caught(small_vocab_model, monkeypatch):
    """The power check on this path: a step that keeps a draft whenever it is the target's argmax (not the keyed
    draw) changes the distribution, and the same chi-square rejects it."""
    keep_argmax_drafts(monkeypatch)
    dist = exact_distribution(small_vocab_model, PARAMS)
    assert chi2_pvalue(sample_counts(small_vocab_model, SHORT, 12), dist, SHORT) < ALPHA


class HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's value back to the host (a sync on a device), and the copies into
    one host buffer."""
    READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "item"}

    def __init__(self):
        super().__init__()
        self.reads, self.copies_to = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.READS:
            self.reads.append(name)
        if name == "copy_":
            self.copies_to[args[0].data_ptr()] = self.copies_to.get(args[0].data_ptr(), 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_step_reads_nothing_back(params, family):
    """A hybrid's linear-attention rows too: their states are read and written by position tensors."""
    staged = StagedTarget(tiny_model(family, num_layers=LAYERS[family]), 1)
    cache, _, _ = prefill(staged, prompt(10, vocab=staged.config.vocab_size), max_length=64)
    state = StepState(staged, cache, 5, params)
    step = DeviceStep(staged, state, 5)
    state.tokens.copy_(torch.tensor([5, 9, 3, 5, 9]))
    state.drafts.fill_(4)
    state.position.fill_(10)
    step.run()                                  # the cache's buffers exist before counting
    with HostReads() as mode:
        out = step.run()
    assert mode.reads == []
    assert 1 <= int(out[0]) <= 5


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_decode_reads_one_buffer_a_cycle(monkeypatch, family):
    """Greedy, the lookup's chain: after the prefill, no value is read back but the one buffer a cycle."""
    target = tiny_model(family, num_layers=LAYERS[family])
    device = decoder(target, 4)
    buffers = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):          # the decoder's host buffer: the only tensor made with pin_memory=
        out = real_zeros(*args, **kwargs)
        if "pin_memory" in kwargs:
            buffers.append(out)
        return out
    monkeypatch.setattr(torch, "zeros", zeros)
    stream = device.stream(prompt(3, vocab=target.config.vocab_size), Request(48, GREEDY))
    next(stream)                         # the prefill and its first token
    with HostReads() as mode:
        rest = list(stream)
    assert len(rest) == 47 and device.stats.cycles < 47
    assert mode.reads == []
    assert mode.copies_to.get(buffers[0].data_ptr()) == device.stats.cycles


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k, family", [(0, "llama"), (4, "llama"), (4, "qwen3_5")])
def test_the_step_compiles_whole(params, k, family):
    """torch.compile(fullgraph=True) traces the whole step: a graph break (a host read, a data-dependent shape)
    would raise. aot_eager traces without generating code, which the inductor test below does once. The hybrid's
    linear-attention rows compile too."""
    target = tiny_model(family, num_layers=LAYERS[family])
    p = prompt(5, vocab=target.config.vocab_size)
    request = Request(24, params, 1)
    assert decoder(target, k, compile="aot_eager").generate(p, request).token_ids == \
        ar_run(target, p, 24, params, seed=1).token_ids


def test_the_graph_twin_equals_ar():
    """cuda_graphs=True captures the step on CUDA; elsewhere the same step runs eagerly, which is what this checks."""
    target = tiny_model("llama", num_layers=2)
    p = prompt(7, vocab=target.config.vocab_size)
    device = DeviceChainDecoder(StagedTarget(target, 1), frozenset(), LookupDrafter(1, 4), 4, cuda_graphs=True)
    assert device.generate(p, Request(24, GREEDY)).token_ids == ar_run(target, p, 24).token_ids


@pytest.mark.slow
def test_the_step_compiled_by_inductor_equals_ar():
    target = tiny_model("llama", num_layers=2)
    p = prompt(6, vocab=target.config.vocab_size)
    assert decoder(target, 4, compile="inductor").generate(p, Request(24, GREEDY)).token_ids == \
        ar_run(target, p, 24).token_ids


@pytest.mark.slow
def test_a_sampled_step_compiled_by_inductor_draws_the_eager_steps_tokens():
    """The sampled step through Inductor (keyed noise, warp from tensors, the draw) gives the eager step's tokens over
    128 of them, vectorised: an argmax over the keyed noise's integer hash compiled for the CPU crashed or chose
    tokens outside the vocabulary here (first_max's reason)."""
    from spd.verify.sampling import SamplingParams

    target = StagedTarget(tiny_model("llama", num_layers=2), 1)
    p = prompt(5, vocab=target.config.vocab_size)
    request = Request(128, SamplingParams(temperature=1.0), seed=3)
    eager = DeviceChainDecoder(target, frozenset(), None, 1).generate(p, request).token_ids
    compiled = DeviceChainDecoder(target, frozenset(), None, 1, "inductor").generate(p, request).token_ids
    assert compiled == eager and len(set(eager)) > 10


def test_the_graph_captures_the_compiled_step(monkeypatch):
    """compile= and cuda_graph= together: the compiled step's warm-ups (which compile it), then its capture into the
    given pool, then replays — the order recorded through stand-ins for the CUDA calls a CPU lacks."""
    from contextlib import contextmanager, nullcontext

    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    @contextmanager
    def graph(_, pool=None):
        events.append(("capture", pool))
        yield
        events.append("captured")

    class Stream:
        def __init__(self, *_):
            pass

        def wait_stream(self, _):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda _: nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda _: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _=None: Stream())
    staged = StagedTarget(tiny_model("llama", num_layers=2), 1)
    cache, _, _ = prefill(staged, prompt(10, vocab=staged.config.vocab_size), max_length=64)
    state = StepState(staged, cache, 5, GREEDY)
    step = DeviceStep(staged, state, 5)
    step.choose_runner(True, "aot_eager", pool="the decoder's pool")
    compiled = step.body
    assert compiled != step.step                                  # the compiled function is what runs
    step.body = lambda: (events.append("compiled step"), compiled())[1]
    state.position.fill_(10)
    for _ in range(3):
        step.run()
    assert events == ["compiled step", "compiled step", ("capture", "the decoder's pool"), "compiled step",
                      "captured", "replay", "replay", "replay"]
    assert int(state.position) == 10                              # warm-ups and capture undone; the replays ran nothing


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ar_launches_the_next_cycle_before_it_reads_the_last(monkeypatch, params):
    """Where nothing drafts on the host (AR here), cycle k + 1 is launched before cycle k's values are read (two
    host slots, alternating), and the output is still AR's; a decode launches at most one cycle it does not read."""
    target = tiny_model("llama", num_layers=2)
    p = prompt(8, vocab=target.config.vocab_size)
    order = []
    launch, collect = DeviceChainDecoder.launch, DeviceChainDecoder.collect
    monkeypatch.setattr(DeviceChainDecoder, "launch",
                        lambda self, *a: (order.append(("launch", a[-1])), launch(self, *a))[1])
    monkeypatch.setattr(DeviceChainDecoder, "collect",
                        lambda self, host, slot: (order.append(("read", slot)), collect(self, host, slot))[1])
    out = decoder(target, 0).generate(p, Request(12, params, 1))
    assert out.token_ids == ar_run(target, p, 12, params, seed=1).token_ids
    assert order[:5] == [("launch", 0), ("launch", 1), ("read", 0), ("launch", 0), ("read", 1)]
    reads = [slot for kind, slot in order if kind == "read"]
    assert len(reads) == 11 and reads == [i % 2 for i in range(11)]
    assert len(order) - len(reads) <= len(reads) + 1


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
                                    SamplingParams(0.9, top_k=40, top_p=0.6), SamplingParams(1.0, top_k=1000)])
def test_the_settings_as_tensors_warp_bit_for_bit(params):
    """The device step's warp (settings read from tensors, all rows at once) gives spd.verify.sampling.warp's bits,
    row by row, ties included."""
    from spd.verify.device_sampling import DeviceSampling
    from spd.verify.sampling import warp

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, :50] = logits[1, 0]                          # a tie across the top-k and top-p thresholds
    sampling = DeviceSampling(torch.device("cpu"), SamplingParams(0.5, top_k=3))
    sampling.set(params)                                   # refilled, as for a new request
    warped = sampling.warp(logits)                         # every row at once
    for row, mine in zip(logits, warped):
        assert torch.equal(mine, warp(row, params))


def test_a_new_requests_settings_reuse_the_built_steps():
    """Another temperature, top-k or top-p refills the state's tensors: the same steps (nothing built again) serve
    it, and each request's output is AR's keyed draws under its own settings."""
    from spd.runtime.device_step import Graphed

    target = tiny_model("llama", num_layers=2)
    p = prompt(9, vocab=target.config.vocab_size)
    device = decoder(target, 4)
    device.generate(p, Request(16, SAMPLED, 1))
    steps, built = dict(device.steps), Graphed.builds
    for params in (SamplingParams(0.7, top_k=5), SamplingParams(1.2, top_p=0.5), SAMPLED):
        assert device.generate(p, Request(16, params, 2)).token_ids == ar_run(target, p, 16, params, seed=2).token_ids
        assert device.steps == steps
    assert Graphed.builds == built


def test_first_max_is_argmax_ties_to_the_lowest_index():
    """The sampled draw's reduction (a max, then the lowest index holding it) answers as argmax does, ties and -inf
    included."""
    from spd.verify.device_sampling import first_max

    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[3, [7, 200]] = 50.0                                  # a tie: the lower index wins
    x[5, :290] = float("-inf")                             # most of a row outside warp's support
    assert first_max(x)[3] == 7
    assert torch.equal(first_max(x), x.argmax(-1))
