"""What a newcomer meets first: a sampled run without a seed draws a fresh one and says which; help lists every
method from the registry; a missing checkpoint and a mistyped key are refused at once, with the fix; eval's trace
cache sits beside the target weights cache, not in whatever directory eval runs in."""

import json
import os
import subprocess
import sys

import pytest

from spd.cli import main
from spd.config import GenerateConfig, ServeConfig, did_you_mean, load_config
from spd.errors import UserError
from spd.methods import DECODING_METHODS, TRAINED_METHODS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(capsys, *args):
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- seed -----------------------------------------------------------------------------------------------------------

def test_a_sampled_run_without_a_seed_draws_a_fresh_one_and_a_given_seed_stays():
    sampled = [load_config(GenerateConfig, None, ["temperature=1"]).seed for _ in range(4)]
    assert all(isinstance(seed, int) and 0 <= seed < 2 ** 31 for seed in sampled)
    assert len(set(sampled)) > 1
    assert [load_config(GenerateConfig, None, ["temperature=1", "seed=5"]).seed for _ in range(2)] == [5, 5]
    # greedy ignores the seed: it resolves to 0, so an untrained module (seeded by it) is the same every run
    assert load_config(GenerateConfig, None, []).seed == 0
    assert load_config(ServeConfig, None, []).seed == 0
    # eval and the trainer keep a fixed default: their runs repeat
    from spd.eval.config import EvalConfig
    from spd.train.config import TrainConfig

    assert load_config(EvalConfig, None, ["temperature=1"]).seed == 0
    assert load_config(TrainConfig, None, []).seed == 0


def test_generate_prints_the_seed_it_sampled_with(capsys, tiny_target_dir):
    common = [f"target={tiny_target_dir}", "prompt=Tell me a story about 12 cats.", "max_new_tokens=24",
              "temperature=1", "method=ar", "json=true"]
    first, second = (json.loads(generate(capsys, *common)[1]) for _ in range(2))
    assert isinstance(first["seed"], int) and isinstance(second["seed"], int) and first["seed"] != second["seed"]
    again = json.loads(generate(capsys, *common, f"seed={first['seed']}")[1])       # the printed seed repeats it
    assert again["seed"] == first["seed"] and again["token_ids"] == first["token_ids"]
    five = [json.loads(generate(capsys, *common, "seed=5")[1]) for _ in range(2)]
    assert five[0]["seed"] == five[1]["seed"] == 5 and five[0]["token_ids"] == five[1]["token_ids"]
    code, _, err = generate(capsys, *common[:-1], "seed=5")
    assert code == 0 and err.strip().splitlines()[-1].endswith(" seed=5")           # the stats line
    greedy = json.loads(generate(capsys, *common[:3], "method=ar", "json=true")[1])
    assert greedy["seed"] is None                                                     # greedy used none


# -- help -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "chat", "serve", "eval"])
def test_help_lists_every_method_from_the_registry(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert " | ".join(DECODING_METHODS) in text
    assert "flowspec" in text
    from spd.runtimes import RUNTIMES

    runtime_line = text.split(" runtime ", 1)[1].split(" cuda_graphs ", 1)[0]
    assert all(name in runtime_line for name in RUNTIMES), runtime_line


def test_trainer_help_lists_the_trained_methods(capsys):
    from helpers import load_train_main

    with pytest.raises(SystemExit):
        load_train_main()(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "method spd " + " | ".join(TRAINED_METHODS) in text


def test_the_top_level_help_names_every_method(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in DECODING_METHODS)


# -- a missing checkpoint, before torch -----------------------------------------------------------------------------

PROBE = """
import sys
from spd.cli import main
code = main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "torch not imported")
sys.exit(code)
"""


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"], ["eval"]])
def test_a_missing_checkpoint_is_refused_before_torch_is_imported(tmp_path, command):
    missing = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, "-c", PROBE, *command, f"checkpoint={missing}"], capture_output=True,
                          text=True, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (f"spd-infer: error: checkpoint directory {str(missing)!r} does not exist; pass "
                        "checkpoint=<dir> of a trained module")
    assert proc.stdout.strip() == "torch not imported"
    not_a_module = tmp_path / "empty"
    not_a_module.mkdir()
    proc = subprocess.run([sys.executable, "-c", PROBE, *command, f"checkpoint={not_a_module}"], capture_output=True,
                          text=True, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 2 and "has no config.json; it is not a module checkpoint" in proc.stderr
    assert proc.stdout.strip() == "torch not imported"


# -- mistyped keys --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["generate", "max_new_token=5", "Hi"], "unknown config key 'max_new_token' in 'max_new_token=5' "
                                            "(did you mean max_new_tokens?)"),
    (["generate", "tempreature=1", "Hi"], "(did you mean temperature?)"),
    (["serve", "max_new_token=5"], "unknown config key 'max_new_token' (did you mean max_new_tokens?)"),
    (["eval", "trace_cache=x"], "(did you mean trace_cache_dir?)"),
])
def test_an_unknown_key_suggests_the_nearest(capsys, argv, needle):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("argv,line", [
    (["serve", "port=abc"], "port=abc is not a whole number; give a whole number, e.g. port=8000 (its default)"),
    (["generate", "temperature=hot", "Hi"], "temperature=hot is not a number; give a number, e.g. temperature=0.0 "
                                            "(its default)"),
    (["generate", "json=maybe", "Hi"], "json=maybe is not true or false; give true or false, e.g. json=false "
                                       "(its default)"),
])
def test_a_value_of_the_wrong_type_is_refused_in_the_suites_words(capsys, argv, line):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"spd-infer: error: {line}"]


def test_did_you_mean_reaches_into_sections_and_stays_quiet_when_nothing_is_near():
    from spd.train.config import TrainConfig

    assert did_you_mean(GenerateConfig, "max_new_token") == "max_new_tokens"
    assert did_you_mean(TrainConfig, "steps") == "optim.steps"
    assert did_you_mean(TrainConfig, "model.module_layer") == "model.module_layers"
    assert did_you_mean(TrainConfig, "optim.learning_rate") is None
    assert did_you_mean(GenerateConfig, "colour") is None
    with pytest.raises(UserError, match=r"unknown config key 'optim\.step' \(did you mean optim\.steps\?\)"):
        load_config(TrainConfig, None, ["optim.step=3"])


# -- eval's trace cache ---------------------------------------------------------------------------------------------

def test_evals_trace_cache_defaults_beside_the_target_weights_cache(tmp_path, monkeypatch):
    from spd.eval.config import EvalConfig
    from spd.targets.weight_cache import cache_root

    monkeypatch.chdir(tmp_path)
    default = load_config(EvalConfig, None, []).trace_cache_dir
    assert os.path.isabs(default) and not os.path.abspath(default).startswith(str(tmp_path))
    assert os.path.dirname(default) == cache_root()          # beside targets/, the verified weights
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert load_config(EvalConfig, None, []).trace_cache_dir == str(tmp_path / "elsewhere" / "traces")
    assert load_config(EvalConfig, None, ["trace_cache_dir=mine"]).trace_cache_dir == "mine"


def test_eval_help_says_where_results_and_traces_go(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "output_dir=" in text and "under the current directory" in text
    assert "$SPD_CACHE_DIR (default ~/.cache/spd)/traces" in text
