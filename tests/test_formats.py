"""EAGLE-3 heads in the engines' layouts: the export writes the fields and tensors SGLang, vLLM and speculators read;
reading an export back drafts exactly what the original drafts, cycle by cycle; bad heads are refused in one line."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import GREEDY, ROOT, ar_run, prompt
from spd.models.checkpoint import load_checkpoint, save_checkpoint
from spd.cli import main as spd_infer
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.models.eagle3 import Eagle3Module
from spd.errors import UserError
from spd.models.formats.eagle3 import aux_ids, write_head
from spd.runtime.chain import ChainDecoder
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.targets.tiny import save_tiny_target, tiny_model

LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm"]
HF_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *(f"midlayer.{p}.weight" for p in LAYER)}
SPECULATORS_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
                       *(f"layers.0.{p}.weight" for p in LAYER)}
DRAFT_VOCAB = torch.tensor([5, 9, 2, 40, 7, 1, 0, 3, 11, 64, 100, 127, 12, 13, 14, 15])


def load_export_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("spd_export", os.path.join(ROOT, "train", "export.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


class RecordingDrafter(Eagle3Drafter):
    """Every chain's drafted tokens, in order."""

    def __init__(self, module, embed):
        super().__init__(module, embed)
        self.chains = []

    def chain(self, m, propose):
        drafts = super().chain(m, propose)
        self.chains.append([d.token for d in drafts])
        return drafts


def drafted_chains(staged, module, prompt_ids, max_new=40, m=4):
    drafter = RecordingDrafter(module, staged.embed)
    out = ChainDecoder(staged, drafter, frozenset(), m).generate(prompt_ids, Request(max_new, GREEDY))
    return out.token_ids, drafter.chains


@pytest.fixture(scope="module")
def llama(untied_target_dir):
    model = load_target(untied_target_dir).model
    staged = StagedTarget(model, 1)
    module = Eagle3Module.from_target(staged, draft_to_target=DRAFT_VOCAB, seed=3).eval()
    return model, staged, module


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_export_writes_the_engines_fields_and_tensors(tmp_path, llama, fmt):
    model, staged, module = llama
    d, vocab, layers = model.config.hidden_size, model.config.vocab_size, model.config.num_hidden_layers
    cfg = write_head(module, fmt, str(tmp_path / fmt), model.config, model.get_input_embeddings().weight, "tiny")
    assert json.loads((tmp_path / fmt / "config.json").read_text()) == cfg
    tensors = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert set(tensors) == (SPECULATORS_TENSORS if fmt == "speculators" else HF_TENSORS)
    head = (cfg["transformer_layer_config"] if fmt == "speculators" else cfg)
    assert head["model_type"] == "llama" and head["num_hidden_layers"] == 1 and head["vocab_size"] == vocab
    assert head["tie_word_embeddings"] is False and head["hidden_size"] == d
    assert cfg["draft_vocab_size"] == len(DRAFT_VOCAB) and cfg["target_hidden_size"] == d
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, layers // 2, layers - 3] == list(module.fused)
    if fmt == "speculators":
        assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny"
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert torch.equal(tensors["embed_tokens.weight"], model.get_input_embeddings().weight.detach())
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        # SGLang reads eagle_config's ids as the outputs of layers k (adding 1): the same states vLLM's ids name
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, layers // 2 - 1, layers - 4]
    assert tensors["fc.weight"].shape == (d, 3 * d)
    assert tensors[("layers.0." if fmt == "speculators" else "midlayer.") + "self_attn.q_proj.weight"].shape[1] == 2 * d
    assert tensors["lm_head.weight"].shape == (len(DRAFT_VOCAB), d)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"] + torch.arange(len(DRAFT_VOCAB)), DRAFT_VOCAB)   # target id - draft id
    assert tensors["t2d"].shape == (vocab,) and set(tensors["t2d"].nonzero().flatten().tolist()) == \
        set(DRAFT_VOCAB.tolist())
    # the draft's embedding norm is the engines' input_layernorm; the target layer's own input norm is not written
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    assert torch.equal(tensors[prefix + "input_layernorm.weight"], module.embed_norm.weight.detach())


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_an_export_read_back_drafts_what_the_original_drafts(tmp_path, llama, untied_target_dir, fmt):
    """Import of the export: the same logits for every training-time-test step, and decoding drafts the same chain
    every cycle, greedy = AR."""
    model, staged, module = llama
    loaded = load_target(untied_target_dir)
    write_head(module, fmt, str(tmp_path / "head"), model.config, model.get_input_embeddings().weight, "tiny")
    again = load_checkpoint(str(tmp_path / "head"), staged, loaded).eval()
    assert again.fused == module.fused and torch.equal(again.draft_to_target, DRAFT_VOCAB)
    ids = torch.tensor([prompt(4, length=10, vocab=model.config.vocab_size)])
    _, hidden = staged.forward_all(ids, None, capture=frozenset(module.layers_needed()))
    with torch.no_grad():
        for a, b in zip(module.forward_ttt(hidden, steps=3), again.forward_ttt(hidden, steps=3)):
            assert torch.equal(a, b)
    for seed in (1, 2):
        p = prompt(seed, vocab=model.config.vocab_size)
        tokens, chains = drafted_chains(staged, module, p)
        tokens_again, chains_again = drafted_chains(staged, again, p)
        assert chains_again == chains and tokens_again == tokens == ar_run(model, p, 40).token_ids


def test_ids_in_either_engines_convention_read_as_the_same_layers():
    assert aux_ids({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}, "x") == [2, 15, 27]          # vLLM's
    assert aux_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, "x") == [2, 15, 27]  # SGLang's
    assert aux_ids({"eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, "x") == [2, 15, 27]
    assert aux_ids({}, "x") is None     # the engines' default for the target: (2, L//2, L-3)


def test_a_head_without_ids_fuses_the_engines_default_layers(tmp_path, llama, untied_target_dir):
    model, staged, module = llama
    out = tmp_path / "head"
    write_head(module, "vllm", str(out), model.config, model.get_input_embeddings().weight, "tiny")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    again = load_checkpoint(str(out), staged, load_target(untied_target_dir))
    assert again.fused == module.fused == (2, 5, 7)


@pytest.mark.parametrize("family, field", [("qwen3", "k_norm"), ("gemma3", "feedforward_layernorm")])
def test_a_layer_the_engines_cannot_hold_is_refused_naming_its_field(tmp_path, family, field):
    model = tiny_model(family)
    module = Eagle3Module.from_target(StagedTarget(model, 1))
    with pytest.raises(UserError, match=field) as info:
        write_head(module, "sglang", str(tmp_path / "head"), model.config, model.get_input_embeddings().weight, "x")
    assert "\n" not in str(info.value)
    assert not os.listdir(tmp_path)          # nothing written


# ------------------------------------------------------------------------------------------- the commands
@pytest.fixture(scope="module")
def trained_dir(untied_target_dir, tmp_path_factory):
    """An EAGLE-3 checkpoint in this suite's format for the untied tiny target directory."""
    loaded = load_target(untied_target_dir)
    module = Eagle3Module.from_target(StagedTarget(loaded.model, 1), draft_to_target=DRAFT_VOCAB, seed=5)
    path = str(tmp_path_factory.mktemp("eagle3") / "checkpoint")
    save_checkpoint(module, loaded, path)
    return path


def generate(capsys, *args):
    code = spd_infer(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_command_and_eagle3_checkpoint_of_its_output_decode_as_ar(capsys, tmp_path, trained_dir,
                                                                         untied_target_dir, fmt):
    export = load_export_main()
    out = str(tmp_path / fmt)
    assert export([trained_dir, "--format", fmt, "--out", out, "--target", untied_target_dir]) == 0
    assert "exported" in capsys.readouterr().out
    common = [f"target={untied_target_dir}", "prompt=Tell me a story", "max_new_tokens=24", "json=true"]
    code, ar_out, err = generate(capsys, *common, "method=ar")
    assert code == 0, err
    results = []
    for checkpoint in (trained_dir, out):
        code, text, err = generate(capsys, *common, "method=eagle3", f"checkpoint={checkpoint}")
        assert code == 0, err
        results.append(json.loads(text))
    assert results[0]["token_ids"] == results[1]["token_ids"] == json.loads(ar_out)["token_ids"]
    assert results[0]["tau"] == results[1]["tau"] and results[0]["sources"] == results[1]["sources"]  # drafts kept


def refused(capsys, argv, *, command=spd_infer):
    code = command(argv)
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_heads_are_refused_in_one_line(capsys, tmp_path, trained_dir, untied_target_dir):
    export = load_export_main()
    good = str(tmp_path / "good")
    assert "--target" in refused(capsys, [trained_dir, "--format", "speculators", "--out", good], command=export)
    assert export([trained_dir, "--format", "speculators", "--out", good, "--target", untied_target_dir]) == 0
    capsys.readouterr()
    common = ["generate", f"target={untied_target_dir}", "prompt=hi", "max_new_tokens=4", "method=eagle3"]

    def variant(name, edit_config=None, edit_tensors=None):
        path = tmp_path / name
        path.mkdir()
        cfg = json.loads((tmp_path / "good" / "config.json").read_text())
        tensors = load_file(str(tmp_path / "good" / "model.safetensors"))
        if edit_config:
            edit_config(cfg)
        if edit_tensors:
            edit_tensors(tensors)
        (path / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)

    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "neither" in refused(capsys, [*common, f"checkpoint={nothing}"])
    missing = variant("no_residual", lambda c: c.pop("norm_before_residual"))
    assert "norm_before_residual" in refused(capsys, [*common, f"checkpoint={missing}"])
    no_layer = variant("no_layer", lambda c: c["transformer_layer_config"].pop("num_attention_heads"))
    assert "num_attention_heads" in refused(capsys, [*common, f"checkpoint={no_layer}"])
    no_fc = variant("no_fc", edit_tensors=lambda t: t.pop("fc.weight"))
    assert "fc.weight" in refused(capsys, [*common, f"checkpoint={no_fc}"])
    wide = variant("wide", lambda c: c.update(target_hidden_size=64))
    assert "hidden size 64" in refused(capsys, [*common, f"checkpoint={wide}"])
    vocab = variant("vocab", lambda c: c["transformer_layer_config"].update(vocab_size=999))
    assert "vocabulary 999" in refused(capsys, [*common, f"checkpoint={vocab}"])
    # the same sizes, another target: its embedding gives it away
    other = str(tmp_path / "other_target")
    save_tiny_target(other, "llama", seed=1, tied=False)
    assert "embedding" in refused(capsys, ["generate", f"target={other}", *common[2:], f"checkpoint={good}"])
    authors = tmp_path / "authors"
    authors.mkdir()
    torch.save({"state_dict": {}, "config": {"num_stages": 4}}, str(authors / "speculation_head_final.pt"))
    assert "SPD authors' head" in refused(capsys, [*common, f"checkpoint={authors}"])
    # the export: a head that is no EAGLE-3 head, or a format field it cannot fill, writes nothing
    out = tmp_path / "out"
    assert "neither" in refused(capsys, [str(nothing), "--format", "vllm", "--out", str(out)], command=export)
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_the_shipped_head_round_trips_drafting_the_same_chains(capsys, tmp_path, fmt):
    """The shipped SmolLM2 EAGLE-3 head through train/export.py and back: the same chain drafted every cycle, greedy
    = AR, on two everyday prompts."""
    from spd.corpora.prompts import chat_prompt_ids
    from spd.models.shipped import checkpoint_for

    shipped = checkpoint_for(None, "smollm2", None, None, "eagle3")
    assert shipped is not None, "no EAGLE-3 head ships for the default target"
    out = str(tmp_path / fmt)
    assert load_export_main()([shipped, "--format", fmt, "--out", out]) == 0
    capsys.readouterr()
    loaded = load_target("smollm2")
    staged = StagedTarget(loaded.model, 1)
    original = load_checkpoint(shipped, staged, loaded).eval()
    again = load_checkpoint(out, staged, loaded).eval()
    for text in ("Give me three tips for staying focused while studying.", "What is the capital of France?"):
        ids = chat_prompt_ids(loaded.tokenizer, text)
        tokens, chains = drafted_chains(staged, original, ids, max_new=48, m=5)
        tokens_again, chains_again = drafted_chains(staged, again, ids, max_new=48, m=5)
        assert chains_again == chains and tokens_again == tokens == ar_run(loaded.model, ids, 48).token_ids
        assert len(chains) < 48          # drafts were kept: a trained head


def test_eval_scores_an_engine_format_head_as_it_scores_the_original(capsys, tmp_path, trained_dir, untied_target_dir):
    """`spd-infer eval method=eagle3 checkpoint=<export>` puts a head from another tool in the table: the same samples
    and tokens per forward as the head it was exported from."""
    export = str(tmp_path / "export")
    assert load_export_main()([trained_dir, "--format", "vllm", "--out", export, "--target", untied_target_dir]) == 0
    rows = {}
    for name, checkpoint in (("ours", trained_dir), ("hf", export)):
        out = str(tmp_path / name)
        code = spd_infer(["eval", f"target={untied_target_dir}", f"output_dir={out}",
                          f"trace_cache_dir={tmp_path}/traces", "method=eagle3", f"checkpoint={checkpoint}",
                          "limit=1", "max_new_tokens=12", "draft_length=3", "calibrate=false", "wandb.mode=disabled"])
        assert code == 0, capsys.readouterr().err
        with open(os.path.join(out, "samples.jsonl")) as f:
            rows[name] = [json.loads(line) for line in f]
        with open(os.path.join(out, "summary.json")) as f:
            assert json.load(f)["run"]["checkpoint"] == checkpoint
    assert len(rows["ours"]) == 3
    keep = ("question_id", "mode", "text", "N", "K", "tau")
    assert [{k: r.get(k) for k in keep} for r in rows["hf"]] == [{k: r.get(k) for k in keep} for r in rows["ours"]]
