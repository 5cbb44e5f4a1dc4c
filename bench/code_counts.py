"""How many places hold each rule of the suite: counts a newcomer would otherwise find by reading, from the source
alone (ast; no import of the suite, no torch).

    python -m bench.code_counts --out docs/results/code_counts.json

- decoders: classes deriving from `spd.decoding.Decoder` (every loop that yields verified tokens), by file;
- settling loops: functions with a `while` loop that settle drafts (call settle / settle_children / verify_*, or
  index a verdict from `accept`-named tensors) — the places a rule for keeping a draft lives;
- drafter bases and baseless drafters: classes under spd/drafters/ that other drafters derive from (abstract
  methods), and drafter classes there that derive from none of them;
- flat decoding reads below the config layer: `cfg.<key>` (or `<x>.cfg.<key>`) for a key of `spd.spec.DecodeKeys` (its fields and the
  methods' own keys), outside spd/config.py, spd/spec.py, spd/fastest.py, spd/cli/ and the trainer (its own
  structured config);
- places that choose a decoder: functions outside the decoders' own package (spd/runtime/) and the decoder table
  (spd/decoders.py) that construct a decoder class under a branch on a method's decoding kind or a runtime's
  capability, look a row up in the table (`row_for`), or refuse a runtime for a method (a `UserError` whose message
  names both `runtime=` and `method=`);
- strings naming code: "module:attribute" strings naming a module of spd (behaviour imported on first use), by file,
  and how many lie outside the names layer's registries (which tests/test_layers.py checks as import edges);
- files at the top of spd/.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPD = os.path.join(REPO, "spd")
SETTLE_CALLS = {"settle", "settle_children", "verify_greedy", "verify_sampled", "verify_point_mass", "settle_tree",
                "accept_path"}
CONFIG_LAYER = ("spd/config.py", "spd/spec.py", "spd/fastest.py", "spd/cli/", "spd/train/")   # the trainer: its own config
KINDS = {"PIPELINE", "SEGMENTS", "CHAIN", "AR"}                       # spd.methods' decoding kinds
KIND_READS = {"decoder", "chain", "pipelined"}                        # a Method's kind, read as an attribute
CAPABILITIES = {"device_step", "chains", "processes", "reference"}    # a Runtime's, read as an attribute
CAPABILITY_CALLS = {"eager_reference", "runtime"}
TABLE, DECODERS_OWN = "spd/decoders.py", "spd/runtime/"
REGISTRIES = ("spd/methods.py", "spd/runtimes.py", "spd/decoders.py")       # the names layer's
CODE_STRING = re.compile(r"^spd(\.[a-z_0-9]+)+:[A-Za-z_][A-Za-z_0-9]*$")


def python_files(root: str):
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, REPO), ast.parse(open(path, encoding="utf-8").read())


def base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]


def decoding_keys() -> set[str]:
    """Field names of every dataclass in spd/spec.py and of the methods' own key classes (spd/drafters, spd/runtime)."""
    keys = set()
    for rel, tree in python_files(SPD):
        if rel != "spd/spec.py" and not rel.endswith("keys.py") and "Keys" not in open(os.path.join(REPO, rel)).read():
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Keys"):
                keys |= {item.target.id for item in node.body
                         if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return keys


def flat_reads(tree: ast.AST, keys: set[str]) -> list[str]:
    """Every `cfg.<key>` (cfg.W, self.cfg.W, engine.cfg.W) in `tree` for a key in `keys`."""
    return [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in keys and
            (isinstance(n.value, ast.Name) and n.value.id == "cfg" or
             isinstance(n.value, ast.Attribute) and n.value.attr == "cfg")]


def call_name(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) \
        else ""


def reads_kind_or_capability(test: ast.AST) -> bool:
    """A branch's test reads a method's decoding kind or a runtime's capability."""
    return any(isinstance(n, ast.Name) and n.id in KINDS or
               isinstance(n, ast.Attribute) and n.attr in KIND_READS | CAPABILITIES or
               isinstance(n, ast.Call) and call_name(n) in CAPABILITY_CALLS for n in ast.walk(test))


def named(joined: ast.JoinedStr) -> set[str]:
    """The keys an f-string names with a value, as `runtime={...}`: each text piece's last word before a value."""
    keys = set()
    for text, value in zip(joined.values, joined.values[1:]):
        if isinstance(text, ast.Constant) and isinstance(value, ast.FormattedValue) and text.value.endswith("="):
            keys.add(text.value.split()[-1] if text.value.split() else "")
    return keys


def refuses_a_runtime_for_a_method(fn: ast.AST) -> bool:
    """A `raise UserError(f"...")` whose text names a particular runtime (`runtime={...}`) and method."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and call_name(node.exc) == "UserError":
            keys = set().union(*(named(j) for arg in node.exc.args for j in ast.walk(arg)
                                 if isinstance(j, ast.JoinedStr)))
            if any(k.endswith("runtime=") for k in keys) and any(k.endswith("method=") for k in keys):
                return True
    return False


def chooses_a_decoder(fn: ast.AST, decoder_classes: set[str]) -> bool:
    """Constructs a decoder class under a branch on a kind or capability, looks a row up in the decoder table, or
    refuses a runtime for a method."""
    calls = {call_name(n) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    branches = [n.test for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp))]
    return bool(calls & decoder_classes and any(reads_kind_or_capability(t) for t in branches)) or \
        "row_for" in calls or refuses_a_runtime_for_a_method(fn)


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, methods as Class.method."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")


def code_strings(files) -> dict[str, int]:
    found = {}
    for rel, tree in files:
        hits = sum(isinstance(n, ast.Constant) and isinstance(n.value, str) and bool(CODE_STRING.match(n.value))
                   for n in ast.walk(tree))
        if hits:
            found[rel] = hits
    return found


def counts() -> dict:
    files = list(python_files(SPD))
    classes = {node.name: (rel, node) for rel, tree in files for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def derives(name: str, root: str, seen=()) -> bool:
        if name == root:
            return True
        if name not in classes or name in seen:
            return False
        return any(derives(b, root, seen + (name,)) for b in base_names(classes[name][1]))

    decoders = sorted(f"{rel}:{name}" for name, (rel, _) in classes.items() if name != "Decoder" and derives(name, "Decoder"))
    settling = []
    for rel, tree in files:
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            loops = any(isinstance(n, ast.While) for n in ast.walk(fn))
            calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else ""
                     for n in ast.walk(fn) if isinstance(n, ast.Call)}
            if loops and calls & SETTLE_CALLS:
                settling.append(f"{rel}:{fn.name}")
    drafter_files = [(rel, tree) for rel, tree in files if rel.startswith("spd/drafters/")]
    drafter_classes = [(rel, node) for rel, tree in drafter_files for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    bases = sorted(f"{rel}:{node.name}" for rel, node in drafter_classes
                   if any(isinstance(d, ast.Name) and d.id == "abstractmethod" for item in node.body
                          if isinstance(item, ast.FunctionDef) for d in item.decorator_list))
    base_set = {b.split(":")[1] for b in bases}
    def drafts(node: ast.ClassDef) -> bool:          # a class that proposes tokens or rows to verify
        return any(isinstance(item, ast.FunctionDef) and item.name.startswith(("draft", "propose", "advance"))
                   for item in node.body)
    baseless = sorted(f"{rel}:{node.name}" for rel, node in drafter_classes
                      if drafts(node) and f"{rel}:{node.name}" not in bases
                      and not any(derives(node.name, b) for b in base_set))
    keys = decoding_keys()
    flat = {}
    for rel, tree in files:
        if rel.startswith(CONFIG_LAYER):
            continue
        hits = flat_reads(tree, keys)
        if hits:
            flat[rel] = len(hits)
    decoder_classes = {d.split(":")[1] for d in decoders}
    choosers = sorted(f"{rel}:{name}" for rel, tree in files if not rel.startswith(DECODERS_OWN) and rel != TABLE
                      for name, fn in functions(tree) if chooses_a_decoder(fn, decoder_classes))
    strings = code_strings(files)
    outside = {rel: n for rel, n in strings.items() if rel not in REGISTRIES}
    top = sorted(name for name in os.listdir(SPD) if name.endswith(".py"))
    return {"decoders": {"count": len(decoders), "classes": decoders},
            "settling_loops": {"count": len(settling), "functions": sorted(settling)},
            "drafter_bases": {"count": len(bases), "classes": bases},
            "baseless_drafters": {"count": len(baseless), "classes": baseless},
            "flat_decoding_reads_below_config": {"count": sum(flat.values()), "files": len(flat), "by_file": flat},
            "decoder_choosers": {"count": len(choosers), "functions": choosers},
            "code_strings": {"count": sum(strings.values()), "by_file": strings},
            "code_strings_outside_registries": {"count": sum(outside.values()), "by_file": outside},
            "top_level_files": {"count": len(top), "files": top}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.code_counts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the counts as JSON here")
    args = ap.parse_args(argv)
    result = counts()
    for name, entry in result.items():
        print(f"{name:36s} {entry['count']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
