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
- files at the top of spd/.
"""

from __future__ import annotations

import argparse
import ast
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPD = os.path.join(REPO, "spd")
SETTLE_CALLS = {"settle", "settle_children", "verify_greedy", "verify_sampled", "verify_point_mass", "settle_tree",
                "accept_path"}
CONFIG_LAYER = ("spd/config.py", "spd/spec.py", "spd/fastest.py", "spd/cli/", "spd/train/")   # the trainer: its own config


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
    top = sorted(name for name in os.listdir(SPD) if name.endswith(".py"))
    return {"decoders": {"count": len(decoders), "classes": decoders},
            "settling_loops": {"count": len(settling), "functions": sorted(settling)},
            "drafter_bases": {"count": len(bases), "classes": bases},
            "baseless_drafters": {"count": len(baseless), "classes": baseless},
            "flat_decoding_reads_below_config": {"count": sum(flat.values()), "files": len(flat), "by_file": flat},
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
