"""The command line of `spd-infer generate` and `chat`, read so that any prompt arrives verbatim.

`key=value` words are config overrides (text keys such as `prompt=` keep their value as typed); any other word is
the prompt; `-` reads the prompt from standard input, and so does a pipe when no prompt is given; after `--`
every word is prompt text. `--config FILE` and `--help` are the only options.
"""

from __future__ import annotations

import json

import re
import sys
from dataclasses import dataclass, field

from spd.config import OVERRIDE_KEY, field_type, unknown_key
from spd.errors import UserError

STDIN = "-"
OPTION = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*(=.*)?$")


@dataclass
class CommandLine:
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)   # positional prompt words; STDIN for `-`
    help: bool = False

    def prompt_sources(self) -> list[str]:
        keys = [o.split("=", 1)[0] for o in self.overrides]
        named = [k for k in ("prompt", "prompt_file") if k in keys]  # a key given twice: the last value wins
        return [("standard input" if p == STDIN else "a positional argument") for p in self.prompts] + \
            [f"{k}=" for k in named]


def split_command_line(words: list[str], schema: type, command: str) -> CommandLine:
    line = CommandLine()
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            line.prompts += words[i + 1:]
            break
        if word in ("-h", "--help"):
            line.help = True
        elif word == "--config":
            if i + 1 == len(words):
                raise UserError("--config needs a file: --config configs/infer/generate.yaml")
            line.config, i = words[i + 1], i + 1
        elif word.startswith("--config="):
            line.config = word.split("=", 1)[1]
        elif word == STDIN:
            line.prompts.append(STDIN)
        elif OPTION.match(word):
            raise UserError(f"unknown option {word!r}; the options are --config FILE and --help (settings are "
                            f"key=value); if it is the prompt, put it after --: spd-infer {command} -- {word!r}")
        elif "=" in word and OVERRIDE_KEY.match(word.split("=", 1)[0]):
            key = word.split("=", 1)[0]
            if field_type(schema, key) is None:
                raise UserError(f"{unknown_key(schema, key, f' in {_short(word)!r}')}; if that is the prompt, give "
                                f"it as prompt=... or after --: spd-infer {command} -- {_short(word)!r}")
            line.overrides.append(word)
        else:
            line.prompts.append(word)
        i += 1
    return line


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def prompt_text(line: CommandLine, command: str) -> dict:
    """The prompt the command line gives (positional, `-`, `--`), as verbatim config text; a second source is an
    error. prompt= and prompt_file= stay overrides; a prompt given here unsets the other key from a YAML file."""
    sources = line.prompt_sources()
    if len(sources) > 1:
        raise UserError(f"the prompt is given {len(sources)} times ({', '.join(sources)}); give it once "
                        f"(quote a prompt of several words: spd-infer {command} \"...\")")
    named = {o.split("=", 1)[0] for o in line.overrides}
    if line.prompts:
        text = read_stdin() if line.prompts[0] == STDIN else line.prompts[0]
        return {"prompt": text, "prompt_file": None}
    if "prompt_file" in named:
        return {"prompt": None}
    if "prompt" in named:
        return {"prompt_file": None}
    return {}


def read_stdin() -> str:
    try:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    except (OSError, ValueError, AttributeError):  # no standard input at all (closed, or a test harness)
        return ""
    return decode_utf8(data, "standard input")


def stdin_is_piped() -> bool:
    try:
        return sys.stdin is not None and not sys.stdin.isatty()
    except (OSError, ValueError, AttributeError):
        return False


def decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"the prompt from {where} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def resolve_prompt(cfg) -> str:
    """The prompt text of a loaded config: prompt=, else prompt_file=, else a pipe on standard input."""
    if cfg.prompt_file is not None:
        try:
            with open(cfg.prompt_file, "rb") as f:
                text = decode_utf8(f.read(), f"prompt_file={cfg.prompt_file}")
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            raise UserError(f"prompt_file={cfg.prompt_file!r} cannot be read ({exc.strerror}); give a text "
                            "file") from None
    elif cfg.prompt is not None:
        text = cfg.prompt
    else:
        text = read_stdin() if stdin_is_piped() else ""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that were not UTF-8 arrive as lone surrogates
        raise UserError("the prompt is not valid UTF-8 text; check the terminal's encoding") from None
    if not text.strip():
        raise UserError("the prompt is empty; give it as an argument (spd-infer generate \"...\"), prompt=..., "
                        "prompt_file=PATH or on standard input")
    return text


def read_prompts_file(path: str) -> list[str]:
    """prompts_file=: one prompt per non-empty line, or, when every such line is a JSON object, each one's "prompt"."""
    try:
        with open(path, "rb") as f:
            text = decode_utf8(f.read(), f"prompts_file={path}")
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise UserError(f"prompts_file={path!r} cannot be read ({exc.strerror}); give a text or JSONL file") from None
    lines = [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise UserError(f"prompts_file={path!r} holds no prompt; give one per line")
    if not all(line.lstrip().startswith("{") for _, line in lines):
        return [line.rstrip("\r") for _, line in lines]
    prompts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise UserError(f"prompts_file={path!r} line {number} is not valid JSON ({exc}); one object per "
                            "line") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise UserError(f"prompts_file={path!r} line {number} has no \"prompt\" text; write "
                            "{\"prompt\": \"...\"} on every line")
        prompts.append(record["prompt"])
    return prompts
