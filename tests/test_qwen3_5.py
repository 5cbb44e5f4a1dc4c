"""Hybrid targets (Qwen3.5: Gated DeltaNet layers beside gated attention): one arithmetic at every row count, states
after a rollback equal to a fresh prefill's (the device step's too), both directory layouts through the CLI decoding =
AR, the fixed-shape runtimes = AR, what a hybrid cannot run refused in one line, and training and evaluation on a
hybrid teacher.

Every method × runtime (trees and the device step included) runs on the hybrid through the `family_model` tests
(tests/conftest.py); this file holds what only a hybrid has."""

import json
import os

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from helpers import GREEDY, ar_run, prompt
from launch import run_python
from spd.cli import main
from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter
from spd.runtime.device_chain import DeviceChainDecoder
from spd.targets.kv_cache import LayerKVCache
from spd.targets.stages import LINEAR, StagedTarget
from spd.targets.tiny import tiny_model, tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hybrid():
    return StagedTarget(tiny_model("qwen3_5"), 3)


def linear_layers(staged):
    return [i for i, kind in enumerate(staged.layer_types) if kind == LINEAR]


def test_the_tiny_hybrids_have_the_layouts_the_stages_need(hybrid):
    assert hybrid.hybrid and hybrid.layer_types[0] == LINEAR and hybrid.layer_types[3] == "full_attention"
    five = StagedTarget(hybrid.model, 5)        # bounds [0, 2, 4, 6, 8, 10]: 2 and 6 cut runs of linear layers
    assert any(five.layer_types[b - 1] == five.layer_types[b] == LINEAR for b in five.bounds[1:-1])
    first = StagedTarget(tiny_model("qwen3_5", full_first=True), 3)
    assert first.layer_types[0] == "full_attention" and first.hybrid


def test_a_linear_layer_gives_a_row_the_same_bits_in_any_forward(hybrid):
    """Rows fed one at a time (AR) and together (a verification) leave each linear layer's output and states
    bitwise equal, where the layer's input is the same (the first layer reads the embedding)."""
    ids = torch.tensor([prompt(1, 14)])
    one = hybrid.new_cache()
    hybrid.forward_all(ids[:, :6], one)
    alone = [hybrid.forward_all(ids[:, p: p + 1], one, p, capture={1})[1][1] for p in range(6, 14)]
    many = hybrid.new_cache()
    hybrid.forward_all(ids[:, :6], many)
    together = hybrid.forward_all(ids[:, 6:], many, 6, capture={1})[1][1]
    assert torch.equal(torch.cat(alone, 1), together)
    assert all(torch.equal(a, b) for a, b in zip(one.memory(0), many.memory(0)))
    for layer in linear_layers(hybrid):     # deeper layers read attention outputs: float32 rounding apart
        for a, b in zip(one.memory(layer), many.memory(layer)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_transformers_forward_agrees(hybrid):
    ids = torch.tensor([prompt(2, 16)])
    with torch.no_grad():
        reference = hybrid.model(ids).logits[0]
    hidden, _ = hybrid.forward_all(ids, hybrid.new_cache())
    torch.testing.assert_close(hybrid.logits(hidden[0]), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kept", [0, 1, 3, 6])
def test_a_rollback_leaves_the_states_of_a_fresh_prefill(hybrid, kept):
    """Six drafts verified in one forward, `kept` of them accepted: every layer's conv window and recurrent state
    (and K/V) equal a fresh prefill of the prompt and the kept drafts; the next token decodes the same from both."""
    p, drafts = prompt(3, 10), [5, 9, 33, 2, 71, 40]
    cache = hybrid.new_cache()
    hybrid.forward_all(torch.tensor([p]), cache)
    hybrid.forward_all(torch.tensor([drafts]), cache, len(p))
    cache.crop(len(p) + kept)
    fresh = hybrid.new_cache()
    hybrid.forward_all(torch.tensor([p + drafts[:kept]]), fresh)
    for layer in range(hybrid.num_layers):
        for after, want in zip(cache.memory(layer), fresh.memory(layer)):
            if layer == 0:
                assert torch.equal(after, want)
            else:
                torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)
    nxt, _ = hybrid.forward_all(torch.tensor([[7]]), cache, len(p) + kept)
    want, _ = hybrid.forward_all(torch.tensor([[7]]), fresh, len(p) + kept)
    torch.testing.assert_close(nxt, want, atol=1e-5, rtol=1e-5)


def test_a_rollback_beyond_the_kept_positions_is_refused(hybrid):
    cache = LayerKVCache(hybrid.num_layers, rollback=4)
    hybrid.forward_all(torch.tensor([prompt(4, 8)]), cache)
    hybrid.forward_all(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache, 8)
    cache.crop(10)                                    # 4 back: still held
    with pytest.raises(ValueError, match="keeps its states for the last 4"):
        cache.crop(5)


def test_tree_rows_see_their_own_paths(hybrid):
    """A tree forward (siblings side by side) gives each node the logits of its own path decoded as a chain."""
    from spd.verify.tree import DraftTree
    from spd.verify.sampling import Proposal

    p = prompt(5, 9)
    tree = DraftTree.chain(0, [Proposal(t) for t in (4, 8)])
    tree.add(0, Proposal(11))                        # a sibling of node 1, under node 0
    tree.add(2, Proposal(13))
    cache = hybrid.new_cache()
    hybrid.forward_all(torch.tensor([p]), cache)
    hidden, _ = hybrid.forward_all(torch.tensor([tree.tokens()]), cache, len(p), offsets=torch.tensor(tree.depths()),
                                   visible=tree.visibility())
    for node in range(len(tree)):
        path = [tree.token(i) for i in tree.path(node)]
        chain, _ = hybrid.forward_all(torch.tensor([p + path]), hybrid.new_cache())
        torch.testing.assert_close(hidden[0, node], chain[0, -1], atol=1e-5, rtol=1e-5)


def test_the_device_tree_leaves_the_states_of_a_fresh_prefill(hybrid, monkeypatch):
    """The device step (fixed shapes, states read and written by position tensors, an accepted path off the first
    branch moved down): after every cycle, each linear layer's states after the last verified position equal a
    fresh prefill's of the verified tokens, and the output is AR's."""
    model = hybrid.model
    staged = StagedTarget(model, 1)
    device = DeviceChainDecoder(staged, frozenset(), SuffixDrafter(), 6, width=4, budget=12)
    read, checked = DeviceChainDecoder.read, []

    def checked_read(self, state, host):
        values = read(self, state, host)
        fed = int(state.position)
        fresh = staged.new_cache()
        staged.forward_all(torch.tensor([reference[:fed]]), fresh)
        linear = state.cache.linear
        ring = linear.ring_index(torch.tensor([fed - 1]))
        for layer in linear_layers(staged):
            for kept, want in zip(linear.rows(layer), fresh.memory(layer)):
                torch.testing.assert_close(kept[ring][0], want, atol=1e-5, rtol=1e-5)
        checked.append(fed)
        return values
    monkeypatch.setattr(DeviceChainDecoder, "read", checked_read)
    rejected = 0
    for seed in (70, 71):
        p = prompt(seed, 8) * 3                   # repeats: the suffix drafter's trees find continuations
        reference = p + ar_run(model, p, 40).token_ids
        out = device.generate(p, Request(24, GREEDY))
        assert p + out.token_ids == reference[: len(p) + 24]
        rejected += out.stats.drafted - out.stats.accepted
    assert rejected > 0 and len(checked) >= 6


def save_multimodal(path, model, tokenizer):
    """The released Qwen3.5 layout: Qwen3_5ForConditionalGeneration, the language model under
    model.language_model, a vision tower beside it."""
    config = Qwen3_5Config(text_config=model.config.to_dict(),
                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                              out_hidden_size=model.config.hidden_size, patch_size=4,
                                              temporal_patch_size=1, spatial_merge_size=1))
    whole = Qwen3_5ForConditionalGeneration(config)
    whole.model.language_model.load_state_dict(model.model.state_dict())
    whole.lm_head.load_state_dict(model.lm_head.state_dict())
    whole.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    model, tokenizer = tiny_target("qwen3_5", tied=False)
    text, multimodal = tmp_path_factory.mktemp("qwen3_5_text"), tmp_path_factory.mktemp("qwen3_5_vl")
    model.save_pretrained(text)
    tokenizer.save_pretrained(text)
    save_multimodal(multimodal, model, tokenizer)
    return str(text), str(multimodal)


def generate(capsys, *args):
    code = main(["generate", "prompt=What is 12*7?", "max_new_tokens=20", "json=true", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["token_ids"], err


@pytest.mark.parametrize("layout", ["text", "multimodal"])
def test_both_directory_layouts_decode_like_ar(capsys, hybrid_dirs, layout):
    target = hybrid_dirs[layout == "multimodal"]
    ar, err = generate(capsys, f"target={target}", "method=ar")
    assert ("vision tower is not loaded" in err) == (layout == "multimodal")
    for method in (["method=spd", "n=3"], ["method=eagle3"], []):     # [] = the default (trees of suffix drafts)
        tokens, _ = generate(capsys, f"target={target}", *method)
        assert tokens == ar, method


@pytest.mark.parametrize("args", [["method=spd", "n=3", "runtime=device"],
                                  ["method=eagle3", "runtime=device", "W=2"]], ids=["spd", "eagle3-tree"])
def test_the_fixed_shape_runtimes_decode_like_ar(capsys, hybrid_dirs, args):
    """The device step keeps the linear layers' states by position (compiled whole: tests/test_device_*.py; the
    fixed-shape stage executors that CUDA graphs and streams capture: tests/test_static_cache.py)."""
    ar, _ = generate(capsys, f"target={hybrid_dirs[0]}", "method=ar")
    tokens, _ = generate(capsys, f"target={hybrid_dirs[0]}", *args)
    assert tokens == ar


def test_stage_processes_decode_like_ar(capsys, hybrid_dirs):
    ar, _ = generate(capsys, f"target={hybrid_dirs[0]}", "method=ar")
    tokens, _ = generate(capsys, f"target={hybrid_dirs[0]}", "method=spd", "n=3", "runtime=distributed")
    assert tokens == ar


@pytest.mark.parametrize("args, needle", [
    (["method=lookup", "draft_length=40"], "keep their states for the last 32"),
])
def test_what_a_hybrid_cannot_run_is_refused_in_one_line(capsys, args, needle):
    code = main(["generate", "target=tiny-qwen3_5", "prompt=hi", "max_new_tokens=4", *args])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_another_family_of_hybrid_is_refused_before_it_loads(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                                                     "layer_types": ["linear_attention", "full_attention"]}))
    code = main(["generate", f"target={tmp_path}", "prompt=hi", "max_new_tokens=4"])
    _, err = capsys.readouterr()
    assert code == 2 and "qwen3_next hybrid" in err and len(err.strip().splitlines()) == 1, err


ENV = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("method", ["spd", "ppsd", "spd_output_state", "eagle3"])
def test_a_hybrid_teacher_trains_each_method_and_eval_scores_it(capsys, tmp_path, method):
    out = tmp_path / "run"
    proc = run_python([os.path.join(ROOT, "train", "run.py"), "--config",
                       os.path.join(ROOT, "configs", "train", "debug_qwen3_5.yaml"), f"output_dir={out}",
                       f"data.path={os.path.join(ROOT, 'data', 'debug_conversations.jsonl')}", f"method={method}",
                       "optim.steps=8", "eval_decodes=1"], env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = json.loads((out / "checkpoint" / "config.json").read_text())
    assert ckpt["method"] == method and ckpt["training"]["steps"] == 8
    if method in ("spd", "eagle3"):         # eval records AR traces of the hybrid and scores the module on them
        code = main(["eval", "target=tiny-qwen3_5", f"checkpoint={out / 'checkpoint'}", f"output_dir={tmp_path / 'eval'}",
                     f"trace_cache_dir={tmp_path / 'traces'}", "max_new_tokens=8", "limit=1", "wandb.mode=disabled"])
        _, err = capsys.readouterr()
        assert code == 0, err
        rows = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(row["ar_match"] for row in rows if row.get("ar_match") is not None)


def test_teacher_features_equal_the_pipelines(hybrid):
    """The trainer's batch forward (transformers' chunked linear attention, no cache) and the decode's row-by-row
    stages give every depth's hidden states within float32 rounding: the training layout holds on a hybrid."""
    ids = torch.tensor([prompt(6, 20)])
    layers = set(range(hybrid.num_layers + 1))
    _, batch = hybrid.forward_all(ids, None, capture=layers)
    _, decode = hybrid.forward_all(ids, hybrid.new_cache(), capture=layers)
    for layer in layers:
        torch.testing.assert_close(batch[layer], decode[layer], atol=1e-5, rtol=1e-5)
    assert ar_run(hybrid.model, prompt(6, 10), 12).token_ids   # and the reference loop decodes


@pytest.fixture(scope="module")
def small_hybrid():
    # linear, linear, linear, attention; untied, so that its next-token distributions spread (8 outcomes at top_k=2)
    return tiny_model("qwen3_5", seed=0, num_layers=4, vocab_size=16, tied=False)


@pytest.mark.slow
def test_spd_samples_the_hybrids_distribution(small_hybrid):
    from test_lossless_sampling import ALPHA, PARAMS, SHORT, chi2_pvalue, exact_distribution, sample_spd

    dist = exact_distribution(small_hybrid, PARAMS)
    counts, rollbacks = sample_spd(small_hybrid, n=2, samples=SHORT, seed=0)
    assert rollbacks > SHORT * 0.2          # rejections, and so rollbacks of the linear layers' states, were common
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
def test_a_broken_verifier_is_caught_on_the_hybrid(small_hybrid, monkeypatch):
    """The same test's power on the hybrid: accepting every draft (sampling from q, not p) fails it."""
    import spd.verify.sampling
    from test_lossless_sampling import ALPHA, PARAMS, chi2_pvalue, exact_distribution, sample_spd

    monkeypatch.setattr(spd.verify.sampling, "verify_sampled", lambda draft, p, q, g: (True, draft))
    dist = exact_distribution(small_hybrid, PARAMS)
    counts, _ = sample_spd(small_hybrid, n=2, samples=1500, seed=1)
    assert chi2_pvalue(counts, dist, 1500) < ALPHA


@pytest.mark.parametrize("kind", ["ar", "spd", "suffix_tree", "lookup_chain"])
def test_a_reused_decoder_decodes_as_a_fresh_one(kind):
    """Generations of growing and shrinking prompts on one decoder (a chat's turns, a server's requests) each give
    what a fresh decoder gives: a new prompt leaves no state of the last one in the linear layers."""
    from spd.drafters.lookup import LookupDrafter
    from spd.drafters.spd_module import ModuleDrafter
    from spd.drafters.suffix import SuffixDrafter
    from spd.decoding import Request
    from spd.engine import build_decoder
    from spd.methods import AR, CHAIN, PIPELINE
    from spd.models.module import SpeculationModule

    model = tiny_model("qwen3_5", tied=False)

    def fresh():
        staged = StagedTarget(model, 3 if kind == "spd" else 1)
        if kind == "ar":
            return build_decoder(AR, staged, frozenset())
        if kind == "spd":
            return build_decoder(PIPELINE, staged, frozenset(),
                                 ModuleDrafter(SpeculationModule.from_target(staged, 1, seed=1)))
        if kind == "suffix_tree":
            return build_decoder(CHAIN, staged, frozenset(), SuffixDrafter(), draft_length=8, width=4, tree_nodes=12)
        return build_decoder(CHAIN, staged, frozenset(), LookupDrafter(1, 4), draft_length=5)
    reused = fresh()
    first = prompt(7, 12)
    answer = reused.generate(first, Request(16)).token_ids
    for ids in (first + answer + prompt(8, 5), prompt(9, 6), prompt(10, 40)):   # a second turn, shorter, longer
        assert reused.generate(ids, Request(16)).token_ids == fresh().generate(ids, Request(16)).token_ids


def test_requests_batched_together_decode_as_each_alone(capsys, hybrid_dirs, tmp_path):
    """max_batch > 1: the rows of several sequences in one forward, each running its linear layers' rows against its
    own states — in this process (chains, SPD's shared stages) and over stage processes."""
    texts = ["What is 12*7?", "Write a function that adds two numbers.", "The quick brown fox jumps."]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n")
    target = f"target={hybrid_dirs[0]}"
    alone = [generate(capsys, target, f"prompt={text}", "method=ar")[0] for text in texts]
    for method in (["method=spd", "n=3"], ["method=spd", "n=3", "runtime=distributed"], ["method=suffix"]):
        code = main(["generate", target, f"prompts_file={tmp_path / 'prompts.txt'}", "max_batch=3",
                     "max_new_tokens=20", "json=true", *method])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert [json.loads(line)["token_ids"] for line in out.splitlines() if line.strip()] == alone, method


def test_a_server_answers_as_generate_on_the_hybrid(capsys, hybrid_dirs):
    """`spd-infer serve` on a Qwen3.5 directory: two clients at once (their rows in shared forwards), each answer
    equal to AR's from `generate`."""
    from serve_process import KEY, ServerProcess, greedy_answers_at_once, kill_all

    target = hybrid_dirs[0]
    questions = ["What is 12*7?", "Name a colour."]
    references = [generate(capsys, f"target={target}", "method=ar", f"prompt={q}")[0] for q in questions]
    srv = ServerProcess(f"target={target}", "method=spd", "n=3", "max_new_tokens=20", f"api_key={KEY}")
    try:
        assert greedy_answers_at_once(srv, target, questions, 20) == references
        assert srv.stop() == 0, "".join(srv.lines)
    finally:
        kill_all(srv)
