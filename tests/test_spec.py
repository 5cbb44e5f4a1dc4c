"""One decoding spec (spd.spec): every decoding key is declared once, in DecodeKeys, and every decoding command's
config takes the same keys from it; DecodeSpec.of gives their typed view; the drafter factories name the typed
options they draft with, and nothing else reaches them."""

import ast
import dataclasses
import inspect
import os
import textwrap
import typing
from types import SimpleNamespace

import pytest

from spd.config import GenerateConfig, ServeConfig, load_config
from spd.eval.config import EvalConfig
from spd.methods import METHOD_KEYS, SelfDraftKeys
from spd.spec import DecodeKeys, DecodeSpec, SharedKeys, own_defaults

SPD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spd")
KEYS = [f.name for f in dataclasses.fields(DecodeKeys)]
CONFIGS = (GenerateConfig, ServeConfig, EvalConfig)


def declared(cls) -> list[str]:
    """The names a class's own body annotates, read from its source (a default set by own_defaults is no
    declaration: it writes no line)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return [item.target.id for item in tree.body[0].body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]


def test_every_decoding_key_is_declared_once():
    """Across every class the decoding commands' configs are made of, each key of DecodeKeys is written once: in
    SharedKeys, or in one method's own keys (spd.methods, Method.keys)."""
    where = {}
    for schema in CONFIGS:
        for cls in schema.__mro__:
            if dataclasses.is_dataclass(cls):
                for name in declared(cls):
                    where.setdefault(name, set()).add(cls.__qualname__)
    owners = {"SharedKeys"} | {keys.__qualname__ for keys in METHOD_KEYS.values()}
    assert {key: where.get(key) for key in KEYS if len(where.get(key, ())) != 1 or not where[key] <= owners} == {}
    assert sorted(declared(SharedKeys) + [k for keys in METHOD_KEYS.values() for k in declared(keys)]) == sorted(KEYS)
    assert declared(DecodeKeys) == []          # it only joins them


@pytest.mark.parametrize("schema", CONFIGS)
def test_the_decoding_commands_take_the_same_keys(schema):
    assert issubclass(schema, DecodeKeys)
    hints, keys = typing.get_type_hints(schema), typing.get_type_hints(DecodeKeys)
    assert {k: hints[k] for k in KEYS} == keys          # a config may change a default, never a key's type


def test_eval_keeps_the_papers_protocol_as_its_defaults():
    generate, evaluate = load_config(GenerateConfig, None, []), load_config(EvalConfig, None, [])
    assert (evaluate.max_new_tokens, evaluate.top_k, evaluate.seed) == (512, 50, 0)
    assert (generate.max_new_tokens, generate.top_k) == (128, 0)
    differ = {k for k in KEYS if k != "seed" and generate[k] != evaluate[k]}
    assert differ == {"max_new_tokens", "top_k"}
    with pytest.raises(TypeError, match="not DecodeKeys keys"):
        own_defaults(max_tokens=5)


def test_every_key_has_one_place_in_the_view_and_the_same_type():
    paths = DecodeSpec.key_paths()
    assert sorted(paths) == sorted(KEYS)
    assert len(set(paths.values())) == len(paths)
    keys = typing.get_type_hints(DecodeKeys)
    for key, path in paths.items():
        owner = DecodeSpec
        *groups, name = path.split(".")
        if groups[:1] == ["options"]:          # a method's own keys: options.<method>.<key>
            owner, groups = METHOD_KEYS[groups[1]], groups[2:]
        for group in groups:
            owner = typing.get_type_hints(owner)[group]
        assert typing.get_type_hints(owner)[name] == keys[key], key


@pytest.mark.parametrize("schema", CONFIGS)
def test_the_spec_carries_a_configs_values(schema):
    words = ["method=suffix", "W=4", "tree_nodes=9", "lookup_min_ngram=3", "lookup_max_ngram=6", "temperature=1",
             "top_k=7", "seed=11", "suffix_memory=true", "datastore=answers", "branches=2", "stage_bounds=[3, 6]",
             "module_cache=false", "controller=first_stage", "max_new_tokens=5"]
    cfg = load_config(schema, None, words)
    spec = DecodeSpec.of(cfg)
    for key, path in DecodeSpec.key_paths().items():
        value = cfg[key]
        assert spec.at(path) == (tuple(value) if key == "stage_bounds" else value), key
    assert (spec.tree.width, spec.lookup.min_ngram, spec.suffix.memory, spec.sampling.seed) == (4, 3, True, 11)
    assert spec.options["selfdraft"] == SelfDraftKeys(branches=2)
    assert spec.stages.bounds == (3, 6) and spec.runtime.distributed.controller == "first_stage"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tree.width = 2


def python_files(top: str):
    for directory, _, names in os.walk(top):
        yield from (os.path.join(directory, name) for name in sorted(names) if name.endswith(".py"))


def factories() -> list[tuple[str, ast.FunctionDef]]:
    """The drafter factories of spd/drafters: their module-level functions named *_drafter (every one the method
    registry names among them)."""
    from spd.methods import METHODS

    found = []
    for path in python_files(os.path.join(SPD, "drafters")):
        module = "spd.drafters." + os.path.splitext(os.path.basename(path))[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found += [(f"{module}:{node.name}", node) for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.endswith("_drafter")]
    named = {path for m in METHODS.values() for path in (m.drafter, getattr(m, "device_drafter", None)) if path}
    assert named <= {name for name, _ in found}
    return found


def bare_session(**keys):
    """A Session around a spec alone: enough for the drafters that read no model."""
    from spd.session import Session

    loaded = SimpleNamespace(tokenizer=None, model=SimpleNamespace(config=SimpleNamespace(vocab_size=16)))
    return Session(loaded=loaded, staged=SimpleNamespace(embed=None), module=None, eos_ids=frozenset(),
                   spec=DecodeSpec.of(DecodeKeys(**keys)))


def test_the_drafter_factories_take_only_what_they_name():
    """No **kwargs swallowing what a factory does not read; every parameter is keyword-only and one an open
    Session offers (Session.inputs), so a misspelt one fails on the first drafter."""
    offered = set(bare_session().inputs())
    for name, node in factories():
        args = node.args
        assert args.kwarg is None, f"{name} takes **{args.kwarg.arg}"
        assert not args.args and not args.posonlyargs and args.vararg is None, f"{name}: keyword-only parameters"
        assert {a.arg for a in args.kwonlyargs} <= offered, name


def test_a_drafter_is_built_from_its_typed_options():
    from spd.drafters.hybrid import LookupThenModule
    from spd.drafters.lookup import LookupDrafter
    from spd.drafters.selfdraft import SelfDraftDrafter
    from spd.drafters.suffix import SuffixDrafter

    lookup = bare_session(method="lookup", lookup_min_ngram=3, lookup_max_ngram=5).drafter()
    assert isinstance(lookup, LookupDrafter) and (lookup.min_n, lookup.max_n) == (3, 5)
    suffix = bare_session(method="suffix", lookup_max_ngram=6).drafter()
    assert isinstance(suffix, SuffixDrafter) and (suffix.min_n, suffix.max_n, suffix.costs) == (1, 6, None)
    selfdraft = bare_session(method="selfdraft", branches=2, branch_length=3, gram=5, corpus_ngrams=False).drafter()
    assert isinstance(selfdraft, SelfDraftDrafter) and (selfdraft.n, selfdraft.length, selfdraft.gram) == (2, 3, 5)
    segments = bare_session(method="flowspec", draft_source="lookup", lookup_min_ngram=4).drafter()
    assert isinstance(segments, LookupDrafter) and segments.min_n == 4
    assert bare_session(method="ar").drafter() is None
    spd = bare_session(method="spd", draft_source="lookup+module", source_pricing=True, module_cache=False)
    spd.module = SimpleNamespace(plan=SimpleNamespace(after_step=False), n=2)     # what ModuleDrafter reads first
    pipelined = spd.drafter()
    assert isinstance(pipelined, LookupThenModule) and pipelined.priced and not pipelined.inner.use_cache
    assert spd.drafter(use_cache=True).inner.use_cache


def test_the_session_owns_its_models_caches_and_spec():
    from spd.session import Session

    assert [f.name for f in dataclasses.fields(Session)] == ["loaded", "staged", "module", "eos_ids", "spec", "caches",
                                                             "draft_model"]
