"""`spd-infer generate`: works end to end on a tiny target; bad input is one line on stderr with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from spd.models.checkpoint import save_checkpoint
from spd.cli import main
from spd.methods import METHODS
from spd.models.module import SpeculationModule
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.targets.tiny import save_tiny_target


def run(capsys, *args):
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def checkpoint(tiny_target_dir, tmp_path_factory):
    loaded = load_target(tiny_target_dir)
    staged = StagedTarget(loaded.model, 5)
    module = SpeculationModule.from_target(staged, 1, seed=3)
    path = str(tmp_path_factory.mktemp("ckpt") / "module")
    save_checkpoint(module, loaded, path)
    return path


def test_generate_json_and_ar_agree(capsys, tiny_target_dir):
    code, out, _ = run(capsys, f"target={tiny_target_dir}", "prompt=What is 12*7?", "n=3", "max_new_tokens=24",
                       "json=true")
    assert code == 0
    spd = json.loads(out)
    for key in ("text", "token_ids", "N", "K", "eal", "rollbacks", "tokens_per_s"):
        assert key in spd
    assert spd["N"] == len(spd["token_ids"]) and spd["K"] >= spd["N"]
    code, out, _ = run(capsys, f"target={tiny_target_dir}", "prompt=What is 12*7?", "method=ar",
                       "max_new_tokens=24", "json=true")
    assert code == 0 and json.loads(out)["token_ids"] == spd["token_ids"]


def test_generate_with_checkpoint_and_text_output(capsys, tiny_target_dir, checkpoint):
    code, out, err = run(capsys, f"target={tiny_target_dir}", f"checkpoint={checkpoint}", "prompt=Hello",
                         "max_new_tokens=8")
    assert code == 0
    assert "L′acc=" in err and "rollbacks=" in err and "tokens/s=" in err and "[spd n=5 local, module]" in err


def test_yaml_config_file(capsys, tiny_target_dir, tmp_path):
    cfg = tmp_path / "gen.yaml"
    cfg.write_text(f"target: {tiny_target_dir}\nn: 2\nmax_new_tokens: 5\njson: true\n")
    code = main(["generate", "--config", str(cfg), "prompt=Hi"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["n"] == 2 and out["N"] == 5


BAD = [
    (["colour=blue"], "unknown config key 'colour'"),
    (["n=0"], "n=0"),
    (["n=11"], "n=11"),
    (["max_new_tokens=0"], "max_new_tokens=0"),
    (["max_new_tokens=600"], "context window"),
    (["prompt=  "], "prompt is empty"),
    (["temperature=-1"], "temperature"),
    (["top_p=1.5"], "top_p"),
    (["n=abc"], "n"),
    (["method=beam"], "method"),
    (["stage_bounds=[7,2]", "n=3"], "stage_bounds"),
    (["method=eagle3", "n=5"], "runs no pipeline"),
    (["method=eagle3", "runtime=distributed"], "runtime=local"),
    (["method=eagle3", "draft_length=0"], "draft_length=0"),
    (["method=lookup", "n=3"], "runs no pipeline"),
    (["method=lookup", "runtime=distributed"], "runtime=local"),
    (["method=lookup", "lookup_min_ngram=0"], "lookup_min_ngram=0"),
    (["method=lookup", "lookup_min_ngram=4", "lookup_max_ngram=3"], "lookup_max_ngram=3"),
    (["method=lookup", "checkpoint=some/module"], "drop checkpoint="),
    (["draft_source=ngram"], "draft_source='ngram' is not one of: module, lookup+module"),
    (["method=lookup", "draft_source=module"], "drop draft_source="),
    (["method=eagle3", "draft_source=lookup+module"], "is not one of: module, suffix+module"),
    (["method=eagle3", "W=0"], "W=0"),
    (["method=eagle3", "W=4", "tree_nodes=0"], "tree_nodes=0"),
    (["W=4"], "draft trees need a drafting method"),
    (["method=ar", "W=4"], "draft trees need a drafting method"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_input_is_one_line_exit_2(capsys, tiny_target_dir, args, needle):
    base = [f"target={tiny_target_dir}", "prompt=Hi", "max_new_tokens=4"]
    code, out, err = run(capsys, *base, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spd-infer: error:"), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_bad_checkpoints(capsys, tiny_target_dir, checkpoint, tmp_path):
    base = [f"target={tiny_target_dir}", "prompt=Hi", "max_new_tokens=4"]
    # another target: same architecture, different weights
    other = tmp_path / "other_target"
    save_tiny_target(str(other), seed=1)
    capsys.readouterr()     # transformers' "Writing model shards" bar is the save's, not a refusal's
    cases = [
        ([f"checkpoint={tmp_path / 'missing'}"], "does not exist"),
        ([f"checkpoint={checkpoint}", "n=3"], "n=5"),
        ([f"checkpoint={checkpoint}", f"target={other}"], "fingerprint"),
    ]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "model.safetensors"):
        (corrupt / name).write_bytes(open(os.path.join(checkpoint, name), "rb").read())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    cases.append(([f"checkpoint={corrupt}"], "corrupt"))
    broken_json = tmp_path / "broken_json"
    broken_json.mkdir()
    (broken_json / "config.json").write_text("{not json")
    cases.append(([f"checkpoint={broken_json}"], "corrupt"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(open(os.path.join(checkpoint, "config.json")).read())
    cases.append(([f"checkpoint={no_weights}"], "no model.safetensors"))
    for args, needle in cases:
        code, _, err = run(capsys, *base, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)


@pytest.mark.parametrize("method", ["ppsd", "spd_output_state", "eagle3", "lookup"])
def test_every_drafter_decodes_what_ar_decodes(capsys, tiny_target_dir, method):
    chain = method in ("eagle3", "lookup")
    common = [f"target={tiny_target_dir}", "prompt=What is 12*7?", "max_new_tokens=20", "json=true"]
    code, out, _ = run(capsys, *common, "method=ar")
    ar = json.loads(out)
    code, out, err = run(capsys, *common, f"method={method}", "draft_length=3" if chain else "n=3")
    assert code == 0, err
    got = json.loads(out)
    assert got["method"] == method and got["token_ids"] == ar["token_ids"]
    assert ("tau" in got) == chain
    code, _, err = run(capsys, *common[:-1], f"method={method}")
    assert code == 0 and (" τ=" in err if chain else " L′acc=" in err) and f"[{method} " in err


def test_lookup_inside_the_pipeline_decodes_what_ar_decodes(capsys, tiny_target_dir):
    common = [f"target={tiny_target_dir}", "prompt=What is 12*7?", "max_new_tokens=30", "json=true"]
    ar = json.loads(run(capsys, *common, "method=ar")[1])
    code, out, err = run(capsys, *common, "n=3", "draft_source=lookup+module")
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == ar["token_ids"] and got["draft_source"] == "lookup+module"
    assert got["sources"]["lookup"][1] > 0                 # [verified, accepted]: the lookup drafted and was kept
    code, _, err = run(capsys, *common[:-1], "n=3", "draft_source=lookup+module")
    assert code == 0 and "[spd n=3 local, lookup+module]" in err and "accepted: lookup " in err
    code, out, err = run(capsys, *common, "n=3", "draft_source=lookup+module", "source_pricing=true")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == ar["token_ids"]  # the source priced per step: the same tokens
    code, _, err = run(capsys, *common[:-1], "method=ar")
    assert code == 0 and "[ar local] N=30 " in err          # plain AR in one process has no n


def test_the_default_is_the_fastest_measured_here_and_any_choosing_key_overrides_it(capsys, tiny_target_dir, tmp_path):
    """No key chooses: spd.fastest's configuration for a CPU and the temperature regime, named as the default; the YAML file
    shipped for generate chooses nothing either. A key that asks for SPD (n=, checkpoint=, ...) gets SPD; a runtime is
    not a method: runtime=device runs the default on the device step, runtime=distributed (pipelines only) is refused."""
    from spd.fastest import FASTEST

    common = [f"target={tiny_target_dir}", "prompt=What is 12*7?", "max_new_tokens=30"]
    ar = json.loads(run(capsys, *common, "method=ar", "json=true")[1])
    code, out, _ = run(capsys, *common, "json=true")
    default = json.loads(out)
    greedy = FASTEST["cpu"]["greedy"]
    assert code == 0 and default["method"] == greedy["method"] and default["W"] == greedy.get("W", 1)
    assert default["datastore"] is None       # the datastore joins the default on the default target only
    assert default["weights"] == "float32"    # and the 4-bit blocks on a GGUF target only
    assert default["default"] is True and default["token_ids"] == ar["token_ids"]       # lossless like every method
    code, _, err = run(capsys, *common)
    tree = f" W={greedy['W']} tree_nodes=16" if greedy.get("W", 1) > 1 else ""
    assert code == 0 and f"[{greedy['method']} m={METHODS[greedy['method']].draft_length}{tree}, the default here] N=30 " in err
    code, out, _ = run(capsys, *common, "temperature=1", "json=true")           # sampling: its own regime's default
    assert code == 0 and json.loads(out)["method"] == FASTEST["cpu"]["sampled"]["method"]
    assert main(["generate", "--config", "configs/infer/generate.yaml", *common, "json=true"]) == 0
    assert json.loads(capsys.readouterr().out)["default"] is True
    for key in ("runtime=local", "runtime=device"):
        code, out, _ = run(capsys, *common, key, "json=true")
        chosen = json.loads(out)
        assert code == 0 and chosen["method"] == greedy["method"] and chosen["default"] is True, key
        assert chosen["token_ids"] == ar["token_ids"]
    code, _, err = run(capsys, *common, "runtime=distributed")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"spd-infer: error: runtime=distributed cannot run the default method here (method={greedy['method']} "
        f"W={greedy['W']}); add method= one of spd, ppsd, spd_output_state, pipedec, flowspec, ar")
    for key in ("n=3", "checkpoint=random", "method=spd", "draft_source=lookup+module"):
        code, out, _ = run(capsys, *common, key, "json=true")
        chosen = json.loads(out)
        assert code == 0 and chosen["method"] == "spd" and chosen["default"] is False, key
        assert chosen["token_ids"] == ar["token_ids"]
    yaml = tmp_path / "spd.yaml"
    yaml.write_text("n: 2\n")                                    # a file that sets a choosing key chooses too
    assert main(["generate", "--config", str(yaml), *common, "json=true"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "spd"


def test_the_default_keeps_the_keys_a_user_set_and_the_datastore_is_the_default_targets():
    from omegaconf import OmegaConf

    from spd.config import GenerateConfig
    from spd.fastest import FASTEST, fastest_default

    defaults = OmegaConf.structured(GenerateConfig)
    cfg = OmegaConf.structured(GenerateConfig)
    assert fastest_default(cfg, defaults, set()) == FASTEST["cpu"]["greedy"]
    assert FASTEST["cpu"]["greedy"]["datastore"] == "answers+sharegpt"
    assert "W" not in fastest_default(OmegaConf.merge(cfg, {"W": 1}), defaults, {"W"})       # W=1: a priced chain
    assert "datastore" not in fastest_default(cfg, defaults, {"datastore"})                   # datastore=null: off
    other = OmegaConf.merge(cfg, {"target": "path/to/another/model"})
    assert "datastore" not in fastest_default(other, defaults, {"target"})   # measured on the default target only
    assert fastest_default(OmegaConf.merge(cfg, {"n": 3}), defaults, {"n"}) == {}              # a choosing key
    assert FASTEST["cpu"]["greedy"]["weights"] == "q4"            # the default target is a GGUF: its own blocks
    assert "weights" not in fastest_default(other, defaults, {"target"})     # not a GGUF file: its weights as stored
    assert "weights" not in fastest_default(OmegaConf.merge(cfg, {"dtype": "bfloat16"}), defaults, {"dtype"})
    assert "weights" not in fastest_default(cfg, defaults, {"weights"})       # weights=float32 asked: kept
    assert "weights" not in fastest_default(OmegaConf.merge(cfg, {"compile": True}), defaults, {"compile"})
    assert fastest_default(OmegaConf.merge(cfg, {"dtype": "float32"}), defaults, {"dtype"})["weights"] == "q4"


def test_a_checkpoint_decodes_as_the_method_it_was_trained_as(capsys, tiny_target_dir, tmp_path):
    from spd.models.eagle3 import Eagle3Module

    loaded = load_target(tiny_target_dir)
    ppsd = str(tmp_path / "ppsd")
    save_checkpoint(SpeculationModule.from_target(StagedTarget(loaded.model, 3), 1, method="ppsd"), loaded, ppsd)
    eagle = str(tmp_path / "eagle")
    save_checkpoint(Eagle3Module.from_target(StagedTarget(loaded.model, 1)), loaded, eagle)
    base = [f"target={tiny_target_dir}", "prompt=Hi", "max_new_tokens=6", "json=true"]
    for path, method in ((ppsd, "ppsd"), (eagle, "eagle3")):
        code, out, err = run(capsys, *base, f"checkpoint={path}")
        assert code == 0 and json.loads(out)["method"] == method, err
        code, _, err = run(capsys, *base, f"checkpoint={path}", "method=spd")
        assert code == 2 and f"is a {method} module, not spd" in err


def test_deep_module_warns_but_runs(capsys, tiny_target_dir):
    with pytest.warns(UserWarning, match="no longer hidden"):
        code, out, _ = run(capsys, f"target={tiny_target_dir}", "prompt=Hi", "n=5", "module_layers=3",
                           "max_new_tokens=4", "json=true")
    assert code == 0 and json.loads(out)["N"] == 4


def test_console_script_exit_code_and_no_traceback(tiny_target_dir):
    """The installed entry point, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "spd.cli", "generate", f"target={tiny_target_dir}", "prompt=Hi",
                           "n=0"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("spd-infer: error: n=0")


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "eval"])
def test_help_lists_every_key_with_its_default_and_meaning(capsys, command):
    """A newcomer finds method=, n=, runtime=, temperature=... in `spd-infer <command> --help`: every key of the
    command's structured config, its default and the config's own comment on it (generated, so it cannot drift)."""
    from spd.cli import main
    from spd.cli.keys import key_help
    from spd.config import GenerateConfig, ServeConfig
    from spd.eval.config import EvalConfig

    schema = {"generate": GenerateConfig, "chat": GenerateConfig, "serve": ServeConfig, "eval": EvalConfig}[command]
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    rows = key_help(schema)
    assert {"method", "n", "runtime", "temperature", "max_new_tokens"} <= {key for key, _, _ in rows}
    for key, default, meaning in rows:
        assert meaning, f"{schema.__name__}.{key} has no comment to document it"
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.split()[:1] == [key])
        shown = " ".join(lines[at: at + 2])        # a long default puts the meaning on the next line
        assert default in lines[at] and meaning.split()[0] in shown, shown
