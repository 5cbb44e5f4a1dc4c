"""Any prompt reaches the tokenizer verbatim, however it is given: a positional argument, prompt=, prompt_file=,
standard input (a pipe or `-`) or after `--`. Checked as a user runs it (subprocesses) and, per character class,
in-process; the ids the CLI decoded from (json `prompt_token_ids`) must equal the tokenizer's own encoding."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from spd.cli import main
from spd.config import GenerateConfig, load_config
from spd.eval.config import EvalConfig
from spd.targets.tiny import save_tiny_target
from launch import run_python

CLASSES = {
    "colon": "Translate: hello",
    "question colons": "Q: 2+2? A:",
    "hash": "#hashtag",
    "brackets": "[draft] fix this",
    "braces": "{\"a\": {b}} and ${interp} and \\${escaped}",
    "quotes": "it's \"quoted\" 'twice'",
    "backslashes": "C:\\path\\to \\n not a newline \\ud83c\\udf0a",
    "newlines": "line one\nline two\r\n\n  indented\tand tabbed\n",
    "emoji": "waves 🌊 and 👩‍💻, ünïcödé, 中文, عربى",
    "leading dash": "- item one\n- item two",
    "code": "def f(s: str) -> dict[str, int]:\n    return {k: 1 for k in s}  # comment",
    "yaml-ish": "key: value\n- [1, 2]\n&anchor *ref !tag",
}
MIXED = "".join(CLASSES.values())
LONG = "".join(chr(32 + (i * 7919) % 95) for i in range(10_000))  # 10,000 printable characters, every class


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny target with a context window long enough for the 10,000-character prompt."""
    path = str(tmp_path_factory.mktemp("long_target"))
    save_tiny_target(path, "llama", seed=0, max_position_embeddings=16384)
    return path


@pytest.fixture(scope="module")
def tokenizer(target):
    return AutoTokenizer.from_pretrained(target)


COMMON = ["max_new_tokens=1", "method=ar", "json=true", "chat_template=false"]


def spawn(target, *args, stdin: bytes | None = None):
    proc = run_python(["-m", "spd.cli", "generate", f"target={target}", *COMMON, *args], input=stdin, text=False,
                      timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""
    return json.loads(proc.stdout)


def encoded(tokenizer, text):
    return tokenizer(text)["input_ids"]


@pytest.mark.parametrize("mode", ["positional", "prompt=", "prompt_file=", "stdin pipe", "dash", "after --"])
def test_every_delivery_is_verbatim(target, tokenizer, tmp_path, mode):
    text = MIXED
    if mode == "positional":
        out = spawn(target, text)
    elif mode == "prompt=":
        out = spawn(target, f"prompt={text}")
    elif mode == "prompt_file=":
        path = tmp_path / "prompt.txt"
        path.write_bytes(text.encode())
        out = spawn(target, f"prompt_file={path}")
    elif mode == "stdin pipe":
        out = spawn(target, stdin=text.encode())
    elif mode == "dash":
        out = spawn(target, "-", stdin=text.encode())
    else:
        out = spawn(target, "--", text)
    assert out["prompt_token_ids"] == encoded(tokenizer, text)


@pytest.mark.parametrize("mode", ["positional", "prompt_file="])
def test_ten_thousand_characters(target, tokenizer, tmp_path, mode):
    if mode == "positional":
        out = spawn(target, LONG)
    else:
        path = tmp_path / "long.txt"
        path.write_bytes(LONG.encode())
        out = spawn(target, f"prompt_file={path}")
    assert out["prompt_token_ids"] == encoded(tokenizer, LONG)


def test_option_like_prompts(target, tokenizer):
    assert spawn(target, "--", "-x --flag")["prompt_token_ids"] == encoded(tokenizer, "-x --flag")
    assert spawn(target, "prompt=--help")["prompt_token_ids"] == encoded(tokenizer, "--help")
    # a word shaped like key=value but with spaces before the `=` is a prompt
    assert spawn(target, "is x = 5?")["prompt_token_ids"] == encoded(tokenizer, "is x = 5?")


def test_chat_template_wraps_the_verbatim_text(target, tokenizer):
    out = spawn(target, MIXED, "chat_template=true")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": MIXED}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert out["prompt_token_ids"] == list(expected)


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("how", ["positional", "prompt="])
def test_each_character_class_in_process(capsys, target, tokenizer, name, how):
    text = CLASSES[name]
    arg = f"prompt={text}" if how == "prompt=" else text
    code = main(["generate", f"target={target}", *COMMON, arg])  # "- item" is a prompt: only -x / --word are options
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["prompt_token_ids"] == encoded(tokenizer, text)


@pytest.mark.parametrize("args,needle", [
    (["one", "two"], "given 2 times"),
    (["Hi", "prompt=Hi"], "given 2 times"),
    (["prompt=Hi", "prompt_file=x.txt"], "given 2 times"),
    (["-x"], "unknown option '-x'"),
    (["--verbose", "Hi"], "after --"),
    (["x=5 means what?"], "unknown config key 'x'"),
    (["prompt_file=/nonexistent/p.txt"], "prompt_file='/nonexistent/p.txt' cannot be read"),
    (["prompt=  \n "], "prompt is empty"),
    (["--config"], "--config needs a file"),
])
def test_prompt_mistakes_are_one_line(capsys, target, args, needle):
    code = main(["generate", f"target={target}", *COMMON, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("spd-infer: error:") and needle in err[0], err


def test_non_utf8_prompt_file_and_stdin(target, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    for args, stdin in [([f"prompt_file={bad}"], b""), (["-"], "café".encode("latin-1"))]:
        proc = run_python(["-m", "spd.cli", "generate", f"target={target}", *COMMON, *args], input=stdin,
                          text=False, timeout=120)
        lines = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "not UTF-8" in lines[0], proc.stderr


def test_empty_stdin_and_no_prompt(target):
    proc = run_python(["-m", "spd.cli", "generate", f"target={target}", *COMMON], timeout=120)  # stdin: empty
    assert proc.returncode == 2 and "the prompt is empty" in proc.stderr


def test_yaml_prompt_is_overridden_by_the_command_line(capsys, target, tokenizer, tmp_path):
    cfg = tmp_path / "gen.yaml"
    cfg.write_text(f"target: {target}\nprompt: from the file\n")
    code = main(["generate", "--config", str(cfg), *COMMON, "from the command line"])
    assert code == 0 and json.loads(capsys.readouterr().out)["prompt_token_ids"] == encoded(tokenizer,
                                                                                            "from the command line")


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=60))
def test_text_keys_are_never_yaml(text):
    """Every string survives prompt= (and eval's free-text keys) unchanged, `${...}` and backslashes included."""
    assert load_config(GenerateConfig, None, [f"prompt={text}"]).prompt == (None if text == "null" else text)
    cfg = load_config(GenerateConfig, None, [], text={"prompt": text})
    assert cfg.prompt == text
    assert load_config(EvalConfig, None, [f"output_dir=x{text}"]).output_dir == f"x{text}"


def test_prompts_with_interpolation_survive_a_yaml_round_trip(tmp_path):
    cfg = load_config(GenerateConfig, None, ["prompt=cost: ${price} \\${x}"])
    from omegaconf import OmegaConf

    path = tmp_path / "saved.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    assert load_config(GenerateConfig, str(path), []).prompt == "cost: ${price} \\${x}"
    assert os.path.getsize(path) > 0
