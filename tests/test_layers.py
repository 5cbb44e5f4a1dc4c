"""The layering of spd/: targets, models, corpora, verification rules, drafters and the runtime never import the
session, the configs, the engine, eval, the server or the CLI (lower layers never import higher ones), at module level
or inside a function; drafters never import the runtime, models neither, and the bottom parts none of those. The
names leaf's "module:attr" strings are checked as the edges they are. At the bottom, the names every part reads (the methods' registry, the
errors, the runtimes' registry in spd/runtimes.py, the decoder table in spd/decoders.py) import no torch and nothing else from spd, so config
checks read them before anything heavy loads."""

import ast
import os
import subprocess
import sys

import pytest

SPD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spd")
HIGHER = ("spd.session", "spd.config", "spd.engine", "spd.eval", "spd.serve", "spd.cli", "spd.train", "spd.fastest")
NAMES = ("spd.methods", "spd.errors", "spd.runtimes", "spd.decoders")   # the leaf: what a method, an error, a
# runtime is, and which decoder runs where
HEAVY = ("torch", "transformers", "numpy")


def imports(path: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, nested ones included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def within(module: str, parts) -> bool:
    return any(module == p or module.startswith(p + ".") for p in parts)


def higher(module: str) -> bool:
    return within(module, HIGHER)


def source(module: str) -> str:
    path = os.path.join(os.path.dirname(SPD), *module.split("."))
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


def part_imports(part: str, beyond) -> list[str]:
    """`file:line imports module` for every import under spd/<part>/ of a module within `beyond`."""
    bad = []
    for directory, _, names in os.walk(os.path.join(SPD, part)):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                bad += [f"{os.path.relpath(path, SPD)}:{line} imports {module}" for line, module in imports(path)
                        if within(module, beyond)]
    return bad


@pytest.mark.parametrize("part", ["targets", "drafters", "runtime", "models", "corpora", "verify"])
def test_a_lower_part_imports_nothing_above_it(part):
    bad = part_imports(part, HIGHER)
    assert not bad, bad


# below the runtime: the drafters; below them the models; the targets, the corpora and the verification rules at the
# bottom, each knowing none of the others' layers above it
BELOW = [("drafters", ("spd.runtime",)), ("models", ("spd.runtime", "spd.drafters")),
         ("targets", ("spd.runtime", "spd.drafters", "spd.models", "spd.corpora")),
         ("corpora", ("spd.runtime", "spd.drafters", "spd.models", "spd.verify")),
         ("verify", ("spd.runtime", "spd.drafters", "spd.models", "spd.targets", "spd.corpora"))]


@pytest.mark.parametrize("part,above", BELOW)
def test_each_part_stays_below_what_uses_it(part, above):
    bad = part_imports(part, above)
    assert not bad, bad


# where each kind of behaviour the names leaf wires by "module:attr" must live
WIRED = {"drafter": "spd.drafters", "device_drafter": "spd.drafters", "fast_evaluator": "spd.eval",
         "objective": "spd.train", "opener": "spd.runtime"}


def wiring() -> list[tuple[str, str, str]]:
    """(source file, field, "module:attr") for every behaviour the leaf names by string: the methods' drafters, fast
    evaluators and objectives, the module classes, the runtimes' openers."""
    found = []
    for module in NAMES:
        path = source(module)
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg in WIRED and isinstance(node.value, ast.Constant):
                found.append((module, node.arg, node.value.value))
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODULE_CLASSES"
                                                    for t in node.targets):
                found += [(module, "module", v.value) for v in node.value.values]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    node.target.id in WIRED and isinstance(node.value, ast.Constant) and node.value.value:
                found.append((module, node.target.id, node.value.value))
    return found


def test_the_leafs_wiring_names_real_code_in_the_right_layer():
    """The registry's "module:attr" strings are edges of the import graph no import statement shows: each names a
    file that exists and defines the attribute, in the layer its field says (a drafter in spd.drafters, a module
    class in spd.models, ...)."""
    edges = wiring()
    assert len(edges) >= 15 and {field for _, field, _ in edges} >= {"drafter", "fast_evaluator", "objective",
                                                                      "module", "opener"}
    for where, field, target in edges:
        module, _, attr = target.partition(":")
        assert within(module, (WIRED.get(field, "spd.models"),)), (where, field, target)
        path = source(module)
        assert os.path.isfile(path), (where, target)
        names = {n.name for n in ast.parse(open(path, encoding="utf-8").read()).body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert attr in names, (where, target)


@pytest.mark.parametrize("module", NAMES)
def test_the_names_import_no_torch_and_nothing_above_them(module):
    """The leaf's modules import each other at most (a method's own keys raise the leaf's UserError)."""
    allowed = NAMES
    bad = [f"{module}:{line} imports {name}" for line, name in imports(source(module))
           if within(name, HEAVY) or (within(name, ("spd",)) and not within(name, allowed))]
    assert not bad, bad


def test_importing_the_names_loads_nothing_else():
    """What the imports above allow, checked by importing them: a fresh interpreter holds no torch and no other spd
    module afterwards (a package's __init__ counts too)."""
    code = (f"import sys, {', '.join(NAMES)}; "
            f"print(*sorted(m for m in sys.modules if m.split('.')[0] in {('spd',) + HEAVY!r}))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(SPD)).stdout.split()
    assert sorted(loaded) == sorted({"spd", *NAMES}), loaded


def test_the_check_sees_a_nested_import(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from spd.session import open_session\n")
    assert [higher(m) for _, m in imports(str(path))] == [True]
    assert not higher("spd.sessions_of_nothing") and not higher("spd.verify.sampling")


def test_no_decoding_key_is_read_flat_below_the_config_layer():
    """Below the config layer every decoding key is read from the DecodeSpec (spec.tree.width, not cfg.W): one way
    to read a config (bench/code_counts.py counts the reads; the check sees one where there is one)."""
    from bench.code_counts import counts, decoding_keys, flat_reads

    found = counts()["flat_decoding_reads_below_config"]
    assert found["count"] == 0, found["by_file"]
    keys = decoding_keys()
    assert {"W", "temperature", "runtime", "max_new_tokens"} <= keys
    snippet = ast.parse("def f(cfg, engine):\n    return cfg.W, engine.cfg.temperature, cfg.output_dir, spec.tree\n")
    assert sorted(flat_reads(snippet, keys)) == ["W", "temperature"]


def test_drafters_live_in_the_drafters_and_device_sampling_in_the_rules():
    """The device steps draft through spd/drafters/ (no class under spd/runtime/ is a drafter; the pipeline step's
    drafter is spd.drafters.spd_device) and sample through spd/verify/ (the host's warp beside the device's)."""
    drafters = []
    for directory, _, names in os.walk(os.path.join(SPD, "runtime")):
        for name in (n for n in names if n.endswith(".py")):
            tree = ast.parse(open(os.path.join(directory, name), encoding="utf-8").read())
            drafters += [f"{name}:{c.name}" for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and
                         any(getattr(b, "id", getattr(b, "attr", "")).endswith("Drafter") for b in c.bases)]
    assert not drafters, drafters
    pipeline = {m for _, m in imports(source("spd.runtime.device_pipeline"))}
    assert {"spd.drafters.base", "spd.drafters.spd_device", "spd.verify.device_sampling"} <= pipeline
    assert "spd.verify.device_sampling" in {m for _, m in imports(source("spd.runtime.device_step"))}
    assert {m for _, m in imports(source("spd.verify.device_sampling")) if m.startswith("spd")} == \
        {"spd.verify.sampling"}


def test_one_place_chooses_a_decoder_and_code_is_named_only_in_the_registries():
    """bench/code_counts.py: the engine's decoder_for alone picks a decoder (the table's rows); every "module:attr"
    string lies in a names-layer registry, whose wiring the test above checks."""
    from bench.code_counts import counts

    found = counts()
    assert found["decoder_choosers"]["functions"] == ["spd/engine.py:decoder_for"]
    assert found["code_strings_outside_registries"]["count"] == 0 and found["code_strings"]["count"] >= 15
