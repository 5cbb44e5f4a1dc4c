"""runtime=distributed: one process per stage + the controller (this test process), over gloo on this machine; or,
with controller=first_stage, the controller running stage 1 itself (n processes in all).

Token-identical to runtime=local for greedy and seeded sampling, with drafts accepted and rejected; plain
pipeline-parallel AR equals AR; a killed stage stops everything within 30 s with one line per survivor.
"""

import os
import signal
import time

import pytest
import torch

from helpers import GREEDY, RankedDrafter, ScriptedDrafter, ar_run, controller_parts, distributed_runtime, ended_on_rejection, prompt
from spd.runtime.ar import ARDecoder
from spd.decoding import Request
from spd.drafters.hybrid import with_draft_source
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.distributed.comm import PipelineFailure
from spd.runtime.local import LocalStages
from spd.runtime.pipeline import PipelineARDecoder, PipelineDecoder
from spd.runtime.stages import open_stages
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.weight_cache import load_parts
from spd.targets.stages import StagedTarget

SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-llama")


@pytest.mark.parametrize("n, controller", [(2, "own_process"), (2, "first_stage"), (3, "first_stage")])
def test_distributed_equals_local_greedy_and_sampled(tiny, n, controller):
    staged = StagedTarget(tiny.model, n)
    module = SpeculationModule.from_target(staged, 1, seed=n).eval()
    p = prompt(7, vocab=tiny.model.config.vocab_size)
    reference = p + ar_run(tiny.model, p, 80).token_ids

    def decode(stages, params, seed):
        drafter = ScriptedDrafter(ModuleDrafter(module), tiny.model, wrong_every=5)
        return PipelineDecoder(stages, drafter, frozenset()).generate(p, Request(40, params, seed))

    runs = [(GREEDY, 0), (SAMPLED, 1), (SAMPLED, 2)]
    local = [decode(staged, params, seed) for params, seed in runs]
    parts, cache = controller_parts("tiny-llama", n)
    with open_stages(parts, distributed_runtime(controller=controller), module_layers(n, staged), cache) as stages:
        assert len(stages.processes.procs) == (n - 1 if controller == "first_stage" else n)
        remote = [decode(stages, params, seed) for params, seed in runs]   # one set of processes, several prompts
        remote_ar = PipelineARDecoder(stages, frozenset()).generate(p, Request(40, GREEDY))
    for mine, theirs in zip(remote, local):
        assert mine.token_ids == theirs.token_ids
        assert (mine.stats.K, mine.stats.rollbacks) == (theirs.stats.K, theirs.stats.rollbacks)
    assert local[0].token_ids == reference[len(p): len(p) + 40]    # greedy = the target's own decode
    for run in local:                                              # both paths ran: accepted and rejected drafts
        assert run.stats.rollbacks > 0 and run.stats.N - run.stats.rollbacks > 1
    assert remote_ar.token_ids == reference[len(p): len(p) + 40]


def module_layers(n, staged):
    return ModuleDrafter(SpeculationModule.from_target(staged, 1)).layers_needed(staged.bounds)


@pytest.mark.parametrize("n, controller", [(2, "first_stage"), (3, "own_process")])
def test_a_one_token_prompt_is_a_prefill_too(tiny, n, controller):
    """A prompt of one token once went between processes under the one-token step's tag, and the next stage,
    waiting for a prefill, timed out (found by `spd-infer serve`'s warm-up)."""
    staged = StagedTarget(tiny.model, n)
    module = SpeculationModule.from_target(staged, 1, seed=n).eval()
    p = prompt(5, length=1, vocab=tiny.model.config.vocab_size)
    parts, cache = controller_parts("tiny-llama", n)
    with open_stages(parts, distributed_runtime(controller=controller), module_layers(n, staged), cache) as stages:
        spd = PipelineDecoder(stages, ModuleDrafter(module), frozenset()).generate(p, Request(20, GREEDY))
        relayed = PipelineARDecoder(stages, frozenset()).generate(p, Request(20, GREEDY))
    assert spd.token_ids == relayed.token_ids == ar_run(tiny.model, p, 20).token_ids


def test_pipeline_ar_locally_equals_ar(tiny):
    p = prompt(3, vocab=tiny.model.config.vocab_size)
    for n in (1, 3):
        assert PipelineARDecoder(StagedTarget(tiny.model, n), frozenset()).generate(p, Request(30, GREEDY)).token_ids == \
            ARDecoder(StagedTarget(tiny.model, 1), frozenset()).generate(p, Request(30, GREEDY)).token_ids


@pytest.mark.parametrize("controller", ["own_process", "first_stage"])
def test_a_killed_stage_stops_every_process(tiny, capfd, controller):
    n = 3
    staged = StagedTarget(tiny.model, n)
    module = SpeculationModule.from_target(staged, 1).eval()
    p = prompt(5, vocab=tiny.model.config.vocab_size)
    parts, cache = controller_parts("tiny-llama", n)
    with pytest.raises(PipelineFailure) as failure:
        with open_stages(parts, distributed_runtime(controller=controller), module_layers(n, staged), cache) as stages:
            procs = stages.processes.procs
            hosted = controller == "first_stage"
            victim = procs[0 if hosted else 1]  # stage 2 of 3

            def kill_mid_generation(step):
                if step == 20:
                    os.kill(victim.pid, signal.SIGKILL)

            drafter = ScriptedDrafter(ModuleDrafter(module), tiny.model, wrong_every=7, on_step=kill_mid_generation)
            start = time.monotonic()
            PipelineDecoder(stages, drafter, frozenset()).generate(p, Request(250, GREEDY))
    assert time.monotonic() - start < 30
    assert "stage 2/3" in str(failure.value) and "SIGKILL" in str(failure.value)
    for proc in procs:  # open_stages waited for them: every one has ended, none with success
        assert proc.poll() is not None and proc.returncode != 0, proc.returncode
    err = capfd.readouterr().err
    survivors = [line for line in err.splitlines() if line.startswith("spd-infer: error:")]
    assert len(survivors) == len(procs) - 1, (err, [proc.returncode for proc in procs])
    assert all("Traceback" not in line for line in survivors)


def test_distributed_draws_what_the_chi_square_tested_local_runtime_draws(tmp_path):
    """test_lossless_sampling's chi-square run (its model, module, prompt and seeds) through stage processes: each
    seeded continuation is the local one token for token, so the local test's verdict covers this runtime without
    drawing thousands of samples across processes (2,000 here would take 80 s)."""
    from test_lossless_sampling import LENGTH, PARAMS, PROMPT, exact_distribution

    from spd.targets.tiny import tiny_model

    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    model.save_pretrained(tmp_path / "target")
    n, samples = 2, 200
    module = SpeculationModule.from_target(StagedTarget(model, n), 1, seed=1).eval()  # random: many rejections
    local = PipelineDecoder(StagedTarget(model, n), ModuleDrafter(module), frozenset())
    controller, cache = controller_parts(str(tmp_path / "target"), n)
    with open_stages(controller, distributed_runtime(controller="first_stage"), module_layers(n, controller),
                     cache) as stages:   # two processes: what n = 2 runs on two cores
        remote = PipelineDecoder(stages, ModuleDrafter(module), frozenset())
        rollbacks, seen = 0, set()
        for seed in range(samples):
            mine = remote.generate(PROMPT, Request(LENGTH, PARAMS, seed))
            theirs = local.generate(PROMPT, Request(LENGTH, PARAMS, seed))
            assert mine.token_ids == theirs.token_ids and mine.stats.rollbacks == theirs.stats.rollbacks
            rollbacks += theirs.stats.rollbacks
            seen.add(tuple(mine.token_ids))
    assert rollbacks > samples * 0.2   # the residual-resampling path, through the processes, often
    assert seen == set(exact_distribution(model, PARAMS))   # every continuation the warped target allows


@pytest.mark.slow
def test_smollm2_n5_distributed_equals_local():
    """The real target, five stage processes + the controller, drafting with the shipped n = 5 module (its drafts are
    kept and rejected within a few tokens): greedy and seeded sampling, same tokens and statistics as local."""
    from spd.models.checkpoint import load_checkpoint
    from spd.models.shipped import checkpoint_for

    n = 5
    controller, cache = controller_parts("smollm2", n)
    smollm2 = load_parts(cache, range(30), embed=True, head=True, dtype=torch.float32)  # the whole target, loaded once
    staged = StagedTarget(smollm2.model, n)
    module = load_checkpoint(checkpoint_for(None, "smollm2", n, None), staged, smollm2).eval()
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12*7? Explain step by step."}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    runs = [(GREEDY, 0), (SamplingParams(temperature=1.0, top_k=50), 1)]

    def decode(stages, params, seed):
        return PipelineDecoder(stages, ModuleDrafter(module), frozenset()).generate(list(ids), Request(24, params, seed))

    local = [decode(staged, params, seed) for params, seed in runs]
    with open_stages(controller, distributed_runtime(controller="own_process"), module_layers(n, staged), cache) as stages:
        remote = [decode(stages, params, seed) for params, seed in runs]
    for mine, theirs in zip(remote, local):
        assert mine.token_ids == theirs.token_ids
        assert (mine.stats.K, mine.stats.rollbacks) == (theirs.stats.K, theirs.stats.rollbacks)
        assert theirs.stats.rollbacks > 0 and sum(theirs.stats.accepted_runs) > 0   # drafts rejected and kept


@pytest.mark.slow
def test_smollm2_reused_stage_processes_decode_like_ar():
    """A two-turn chat on the real target (here, not in test_reuse.py: that module keeps a pipeline open,
    and a second one cannot form beside it in one process): n = 2 stage processes, an untrained module (rejections nearly
    every step), a short prompt and then a much longer one, greedy and seeded T = 1, each generation as a fresh
    in-process decoder gives it (greedy: the target's own decode)."""
    from spd.targets.weight_cache import load_parts

    n = 2
    controller, cache = controller_parts("smollm2", n)
    smollm2 = load_parts(cache, range(30), embed=True, head=True, dtype=torch.float32)
    staged = StagedTarget(smollm2.model, n)
    module = SpeculationModule.from_target(staged, 1).eval()
    long = "Please write a long detailed paragraph about the history of the Roman empire, then list five emperors."
    chats = [[{"role": "user", "content": "Hi."}],
             [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": long}],
             [{"role": "user", "content": "Thanks."}]]
    prompts = [list(smollm2.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]) for c in chats]
    runs = [(p, params, seed) for params, seed in ((GREEDY, 0), (SAMPLED, 1)) for p in prompts]

    def decode(stages, drafter, p, params, seed):
        return PipelineDecoder(stages, drafter, frozenset()).generate(p, Request(24, params, seed))

    with open_stages(controller, distributed_runtime(controller="first_stage"),
                     ModuleDrafter(module).layers_needed(staged.bounds), cache) as stages:
        drafter = ModuleDrafter(module)
        reused = [decode(stages, drafter, *run) for run in runs]
    fresh = [decode(LocalStages(staged), ModuleDrafter(module), *run) for run in runs]
    whole = StagedTarget(smollm2.model, 1)
    for (p, params, _), mine, theirs in zip(runs, reused, fresh):
        assert mine.token_ids == theirs.token_ids and mine.stats.as_dict() == theirs.stats.as_dict()
        if params.greedy:
            assert mine.token_ids == ARDecoder(whole, frozenset()).generate(p, Request(24, GREEDY)).token_ids
    assert ended_on_rejection(reused[0]) and len(prompts[1]) > len(prompts[0]) + 24


@pytest.mark.parametrize("n, controller, source", [(3, "first_stage", "module"), (3, "own_process", "lookup+module")])
def test_distributed_trees_equal_local(tiny, n, controller, source):
    """W = 4: each stage process masks its level by the flight its control row carries and prunes what a kept child
    dropped; greedy and seeded sampling decode exactly as runtime=local does (whose losslessness the chi-square
    test proves), kept later children, corrections and restarts included; with lookup+module, lookup children
    too."""
    staged = StagedTarget(tiny.model, n)
    module = SpeculationModule.from_target(staged, 1, seed=n).eval()
    p = prompt(9, vocab=tiny.model.config.vocab_size)

    def decode(stages, params, seed):
        ranked = RankedDrafter(ModuleDrafter(module), tiny.model, [0, 1, 3, 0, 2, 7])
        drafter = with_draft_source(ranked, source, 2, 4)
        return PipelineDecoder(stages, drafter, frozenset(), 4).generate(p, Request(30, params, seed))

    runs = [(GREEDY, 0), (SAMPLED, 1)]
    local = [decode(staged, params, seed) for params, seed in runs]
    parts, cache = controller_parts("tiny-llama", n)
    with open_stages(parts, distributed_runtime(controller=controller), module_layers(n, staged), cache,
                     width=4) as stages:
        remote = [decode(stages, params, seed) for params, seed in runs]
    for mine, theirs in zip(remote, local):
        assert mine.token_ids == theirs.token_ids
        assert mine.stats.as_dict() == theirs.stats.as_dict()
    assert local[0].token_ids == ar_run(tiny.model, p, 30).token_ids
    assert local[0].stats.stage_rows[0] > local[0].stats.K
    if source == "module":
        assert local[0].stats.rollbacks > 0
    else:   # the tied tiny target repeats itself: greedy, the lookup is always right; sampled, it is not
        assert local[0].stats.sources["lookup"][0] > 0 and local[1].stats.rollbacks > 0


@pytest.mark.parametrize("controller, width, source", [("own_process", 1, "module"), ("first_stage", 1, "lookup+module"),
                                                       ("first_stage", 2, "module")])
def test_sequences_sharing_the_stage_processes_decode_as_each_would_alone(tiny, controller, width, source):
    """SEED's schedule over runtime=distributed, n = 3, max_batch = 3: five requests whose prompts and lengths differ,
    greedy beside seeded T = 1 in the same steps (one sending its exit's argmax, the others their logits), two
    joining as others leave, one cancelled mid-decode, one ending on its end-of-sequence token. Each one's tokens and
    statistics equal its solo decode in this process, and the stage processes carried several sequences per step."""
    from spd.runtime.seed import SeedDecoder

    n = 3
    staged = StagedTarget(tiny.model, n)
    module = SpeculationModule.from_target(staged, 1, seed=n).eval()
    vocab = tiny.model.config.vocab_size

    def drafter():
        ranked = RankedDrafter(ModuleDrafter(module), tiny.model, [0, 1, 3, 0, 2, 7])
        return with_draft_source(ranked, source, 2, 4)

    prompts = [prompt(30 + i, length, vocab) for i, length in enumerate([5, 12, 8, 3, 9])]
    requests = [Request(20, GREEDY), Request(40, SAMPLED, 1), Request(30, SAMPLED, 2), Request(14, GREEDY),
                Request(18, SAMPLED, 3)]
    eos = frozenset([PipelineDecoder(staged, drafter(), frozenset(), width).generate(prompts[3], requests[3])
                     .token_ids[6]])
    solo = [PipelineDecoder(staged, drafter(), eos, width).generate(p, r) for p, r in zip(prompts, requests)]
    parts, cache = controller_parts("tiny-llama", n)
    with open_stages(parts, distributed_runtime(controller=controller), module_layers(n, staged), cache, width=width,
                     slots=3) as stages:
        seed = SeedDecoder(stages, drafter, eos, width, max_batch=3)
        tickets = [seed.submit(p, r) for p, r in zip(prompts[:3], requests[:3])]
        seed.step()
        seed.step()
        tickets[1].cancel()
        tickets += [seed.submit(p, r) for p, r in zip(prompts[3:], requests[3:])]
        seed.run()
        assert stages.most == 3 and not stages.held
        alone = PipelineDecoder(stages, drafter(), eos, width).generate(prompts[0], requests[0])   # slot 0, alone
    assert alone.token_ids == solo[0].token_ids
    for i, (ticket, ref) in enumerate(zip(tickets, solo)):
        if i == 1:
            assert ticket.finish == "cancelled" and ticket.tokens == ref.token_ids[:len(ticket.tokens)]
            continue
        assert ticket.tokens == ref.token_ids, (i, ticket.tokens, ref.token_ids)
        assert ticket.stats.as_dict() == ref.stats.as_dict(), i
    assert tickets[3].finish == "stop" and len(tickets[3].tokens) <= 7
    assert sum(t.stats.rollbacks for t in tickets) > 5


@pytest.mark.slow
def test_smollm2_sequences_sharing_two_stage_processes_decode_as_alone():
    """The real target under SEED's schedule across processes, as `spd-infer serve method=spd n=2
    runtime=distributed draft_source=lookup+module` runs it: the shipped n = 2 module, 4 eval prompts of different
    lengths, 3 at a time (the 4th joins as the first leaves), greedy beside seeded T = 1. Each sequence decodes what
    it decodes alone in this process; a greedy difference is allowed only at a near-tie (top-2 margin under 1e-4) and
    is counted — none occurred in the run that added this test."""
    from spd.models.checkpoint import load_checkpoint, read_checkpoint_config
    from spd.drafters.hybrid import LookupThenModule
    from spd.corpora.prompts import chat_prompt_ids, load_questions
    from spd.runtime.seed import SeedDecoder
    from spd.models.shipped import checkpoint_for

    n = 2
    path = checkpoint_for(None, "smollm2", n, None)
    bounds = read_checkpoint_config(path)["stage_bounds"]                     # the shipped module's balanced split
    controller, cache = controller_parts("smollm2", n)
    controller = StagedTarget(controller.model, n, bounds)
    smollm2 = load_parts(cache, range(30), embed=True, head=True, dtype=torch.float32)
    staged = StagedTarget(smollm2.model, n, bounds)
    module = load_checkpoint(path, staged, smollm2).eval()
    drafter = lambda: LookupThenModule(ModuleDrafter(module))                   # noqa: E731
    questions = [q for ds in ("mt_bench", "gsm8k", "humaneval") for q in load_questions(ds)[:2]][:4]
    prompts = [chat_prompt_ids(smollm2.tokenizer, q["turns"][0]) for q in questions]
    requests = [Request(32, GREEDY), Request(20, SamplingParams(temperature=1.0, top_k=50), 4), Request(40, GREEDY),
                Request(24, GREEDY)]
    solo = [PipelineDecoder(staged, drafter(), frozenset()).generate(p, r) for p, r in zip(prompts, requests)]
    with open_stages(controller, distributed_runtime(controller="first_stage"), module_layers(n, staged),
                     cache, slots=3) as stages:
        seed = SeedDecoder(stages, drafter, frozenset(), max_batch=3)
        tickets = [seed.submit(p, r) for p, r in zip(prompts, requests)]
        seed.run()
        assert stages.most == 3
    near_ties = 0
    for p, ticket, ref in zip(prompts, tickets, solo):
        if ticket.tokens != ref.token_ids:
            at = next(i for i, (a, b) in enumerate(zip(ticket.tokens, ref.token_ids)) if a != b)
            logits = smollm2.model(torch.tensor([p + ref.token_ids[:at]])).logits[0, -1]
            top = torch.topk(logits.float(), 2).values
            assert ticket.request.params.greedy and float(top[0] - top[1]) < 1e-4, at
            near_ties += 1
    assert near_ties == 0
    assert sum(t.stats.rollbacks for t in tickets) > 0
