"""`spd-infer <command> --help`'s list of keys: every key of the command's structured config, its default and the
config's own comment on it. The configs' documentation is those comments, so the help is generated from them and
cannot drift from the code. Computed only when help is asked for."""

from __future__ import annotations

import argparse
import dataclasses
import re


_FIELD = re.compile(r"^\s+(\w+)\s*:[^#]*?(?:#\s?(.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(.*)$")


def _field_comments(schema: type) -> dict[str, str]:
    """{field: the comment written beside it in the schema's source, with its continuation lines, or else the comment
    block right above it}."""
    import inspect

    notes: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):
        last, above = None, []
        for line in inspect.getsource(cls).splitlines()[1:]:
            field_line, comment = _FIELD.match(line), _COMMENT.match(line)
            if comment:   # indented past the fields: a trailing comment's next line; level with them: above the next
                continued = len(line) - len(line.lstrip()) > 4
                if continued and last is not None and notes.get(last):
                    notes[last] += " " + comment.group(1).strip()
                else:
                    above.append(comment.group(1).strip())
                continue
            if field_line and not line.lstrip().startswith(("def ", "@", "return", "if ", "raise")):
                last = field_line.group(1)
                notes[last] = (field_line.group(2) or "").strip() or " ".join(above)
            else:
                last = None
            above = []
    return notes


_LIST = re.compile(r"^\s*\w+(?:\s*\|\s*\w+)+")


def method_meaning(schema: type, meaning: str) -> str:
    """A `method` key's help names the methods spd.methods registers (a schema's `method_choices`, else every decoding
    method), never a list written by hand: a list of method names leading the comment is replaced by the registry's."""
    from spd.methods import DECODING_METHODS, METHODS

    listed = " | ".join(getattr(schema, "method_choices", DECODING_METHODS))
    lead = _LIST.match(meaning)
    if lead and all(word.strip() in METHODS for word in lead.group(0).split("|")):
        return listed + meaning[lead.end():]
    return f"{listed}; {meaning}" if meaning else listed


def key_help(schema: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every key of a structured config, nested sections as section.key."""
    notes = _field_comments(schema)
    if "method" in notes:
        notes["method"] = method_meaning(schema, notes["method"])
    rows = []
    for f in dataclasses.fields(schema):
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            rows += key_help(type(default), f"{prefix}{f.name}.")
            continue
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        rows.append((prefix + f.name, shown, notes.get(f.name, "")))
    return rows


def keys_epilog(schema: type, width: int = 118) -> str:
    """The `--help` list of a command's keys: name, default, and the schema's own comment on it, wrapped."""
    import textwrap

    rows = key_help(schema)
    name_w = max(len(k) for k, _, _ in rows) + 2
    default_w = 12
    lines = ["keys (key=value on the command line or in --config's YAML; unknown keys are refused):"]
    for key, default, meaning in rows:
        head = f"  {key:<{name_w}}{default:<{default_w - 1}} "
        if len(head) > 2 + name_w + default_w and meaning:   # a long default: the meaning on the next line
            lines.append(head.rstrip())
            head = " " * (2 + name_w + default_w)
        wrapped = textwrap.wrap(meaning, width - len(head)) or [""]
        lines.append((head + wrapped[0]).rstrip())
        lines += [" " * len(head) + more for more in wrapped[1:]]
    return "\n".join(lines)


class KeysParser(argparse.ArgumentParser):
    """An argument parser whose help ends with `schema`'s keys (subcommands made by add_parser get this class too,
    and pass schema=)."""

    def __init__(self, *args, schema: type | None = None, **kwargs):
        if schema is not None:
            kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.schema = schema
        self.notes = self.epilog          # a command's own notes, after its keys

    def format_help(self) -> str:
        if self.schema is not None:
            self.epilog = keys_epilog(self.schema) + (f"\n\n{self.notes}" if self.notes else "")
        return super().format_help()
