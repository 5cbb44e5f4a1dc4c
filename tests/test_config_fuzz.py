"""Property: whatever keys, values, words and config files are thrown at an entry point, its command-line and
config handling ends in exit 0 (the command would start: stubbed here) or exit 2 with one `<command>: error:`
line; never a traceback, and nothing written when it refuses."""

import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import spd.cli.chat
import spd.cli.generate
import spd.cli.serve
import spd.eval.harness
import spd.train.loop
from spd.cli import main as spd_infer
from spd.config import GenerateConfig, ServeConfig
from spd.eval.config import EvalConfig
from spd.train.config import TrainConfig
from helpers import load_train_main, snapshot

train_main = load_train_main()


class Started(Exception):
    """Raised by the stubbed command body: parsing and checks accepted the input."""


def keys_of(schema, prefix=""):
    import dataclasses
    import typing

    out = []
    for name, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):
            out += keys_of(kind, f"{prefix}{name}.")
        elif name != "check":
            out.append(prefix + name)
    return out


NASTY = ["", "null", "~", "true", "[1,", "{a: b}", "[]", "{}", "${x}", "${oc.env:HOME}", "a: b", "- x", "nan", "inf",
         "-inf", "1e999", "-1", "0", "99999999999999999999999", "0x10", "'quoted", '"', "\\", "#", "?", "|", ">",
         "!!python/object:os.system", "*alias", "&anchor", "\x00", "🌊", "\ud7ff", "\n", "[1, 2, 3]", "1.5", "-0"]
values = st.one_of(st.sampled_from(NASTY), st.text(max_size=12), st.integers().map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(str))


def words(schema):
    key = st.one_of(st.sampled_from(keys_of(schema)), st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,6})?", fullmatch=True))
    pair = st.builds(lambda k, v: f"{k}={v}", key, values)
    loose = st.one_of(st.sampled_from(["-", "--", "--config", "-x", "--help-me", "=", "=5", "a=b=c", ".=1"]),
                      st.text(min_size=1, max_size=12))
    return st.lists(st.one_of(pair, pair, loose), max_size=6)


config_files = st.one_of(st.none(), st.binary(max_size=64),
                         st.sampled_from([b"n: [1,", b"- 1\n- 2", b"n: 3\nmax_new_tokens: 4", b"{}", b"",
                                          b"wandb: {mode: online}", b"optim: 5", b"\xff\xfe"]))


@pytest.fixture
def stubbed(monkeypatch):
    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(spd.cli.generate, "generate", start)
    monkeypatch.setattr(spd.cli.chat, "chat", start)
    monkeypatch.setattr(spd.cli.serve, "serve", start)
    monkeypatch.setattr(spd.eval.harness, "run_eval", start)
    monkeypatch.setattr(spd.train.loop, "train", start)


def check(run, command, argv, config, tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        if config is not None:
            with open("fuzz.yaml", "wb") as f:
                f.write(config)
            argv = ["--config", "fuzz.yaml", *argv]
        before = snapshot(tmp_path)
        try:
            code = run(argv)
        except Started:
            code = 0
        except SystemExit as exc:  # argparse's own usage errors (train/run.py --config with no value)
            code = exc.code
        err = capsys.readouterr().err
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            lines = err.strip().splitlines()
            assert lines and (lines[-1].startswith(f"{command}: error:") or "usage:" in err), (argv, err)
            assert "Traceback" not in err
            assert snapshot(tmp_path) == before, argv
    finally:
        os.chdir(cwd)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(argv=words(GenerateConfig), config=config_files)
def test_generate_command_line(stubbed, tmp_path, capsys, argv, config):
    check(lambda a: spd_infer(["generate", *a]), "spd-infer", ["target=tiny-llama", *argv], config, tmp_path, capsys)


@FUZZ
@given(argv=words(GenerateConfig), config=config_files)
def test_chat_command_line(stubbed, tmp_path, capsys, argv, config):
    check(lambda a: spd_infer(["chat", *a]), "spd-infer", ["target=tiny-llama", *argv], config, tmp_path, capsys)


@FUZZ
@given(argv=words(ServeConfig), config=config_files)
def test_serve_command_line(stubbed, tmp_path, capsys, argv, config):
    check(lambda a: spd_infer(["serve", *a]), "spd-infer", ["target=tiny-llama", *argv], config, tmp_path, capsys)


@FUZZ
@given(argv=words(EvalConfig), config=config_files)
def test_eval_command_line(stubbed, tmp_path, capsys, argv, config):
    check(lambda a: spd_infer(["eval", *a]), "spd-infer", [a for a in argv if a != "--help-me"], config, tmp_path,
          capsys)


@FUZZ
@given(argv=words(TrainConfig), config=config_files)
@example(argv=["_______=- x", "_______._="], config=None)   # a key below an override's list: once a ValueError
def test_train_command_line(stubbed, tmp_path, capsys, argv, config):
    check(train_main, "train/run.py", [a for a in argv if not a.startswith("-")], config, tmp_path, capsys)
