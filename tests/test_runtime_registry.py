"""Runtimes are chosen through one registry (spd.runtimes.RUNTIMES): the config, the session, the engine, eval and the
server ask a runtime's capabilities, never its name, so a runtime is added as one entry and its executor."""

import ast
import os
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest

from spd.spec import DecodeSpec

import spd.runtimes as runtimes
from omegaconf import OmegaConf

from spd.config import GenerateConfig, check_decoding, resolve_dtype
from spd.errors import UserError
from spd.runtimes import RUNTIMES, Runtime, eager_reference, runtime
from spd.runtime.local import LocalStages
from spd.runtime.stages import open_stages
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

SPD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spd")


def name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something called `runtime` (a name or an attribute) with a string."""
    def is_runtime(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "runtime") or \
            (isinstance(node, ast.Attribute) and node.attr == "runtime")

    def is_text(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) or \
            isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_text(e) for e in node.elts)

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(is_runtime(a) for a in [node.left, *node.comparators])
            and any(is_text(a) for a in [node.left, *node.comparators])]


def test_no_code_outside_the_registry_branches_on_a_runtime_name():
    found = {}
    for directory, _, names in os.walk(SPD):
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".py") and path != os.path.join(SPD, "runtimes.py"):
                with open(path, encoding="utf-8") as f:
                    lines = name_comparisons(ast.parse(f.read()))
                if lines:
                    found[os.path.relpath(path, SPD)] = lines
    assert not found, f"runtime names compared outside spd/runtimes.py: {found}"


def test_the_scan_catches_a_comparison():
    assert name_comparisons(ast.parse('if cfg.runtime == "local": pass')) == [1]
    assert name_comparisons(ast.parse('ok = runtime in ("local", "streams")')) == [1]
    assert name_comparisons(ast.parse('ok = runtime(cfg.runtime).processes')) == []


def config(**overrides):
    cfg = OmegaConf.merge(OmegaConf.structured(GenerateConfig), overrides)
    resolve_dtype(cfg)
    return cfg


def options(**keys):
    """A spec's runtime options (spd.spec.RuntimeOptions), what the runtime layer reads, from config keys."""
    return DecodeSpec.of(config(**keys)).runtime


def test_capabilities_answer_what_the_names_used_to():
    assert eager_reference(options(runtime="local", cuda_graphs=False))
    assert not eager_reference(options(runtime="local", cuda_graphs=True))
    assert not eager_reference(options(runtime="distributed"))
    assert [r.name for r in RUNTIMES.values() if r.processes] == ["distributed"]
    assert [r.name for r in RUNTIMES.values() if r.cuda] == ["streams"]
    assert {r.name for r in RUNTIMES.values() if r.graphs} == {"local", "streams", "device"}
    assert runtime("streams").executor_kind(True) == "streams_graphs"
    with pytest.raises(UserError, match="runtime='cloud' is not one of: local, distributed, streams, device"):
        runtime("cloud")


@pytest.mark.parametrize("overrides,needle", [
    (dict(runtime="streams"), "runtime=streams runs each stage on a CUDA stream in this process; device=cpu has none"),
    (dict(runtime="distributed", device="cuda", cuda_graphs=True), "cuda_graphs=true is for runtime=local or "
                                                                    "runtime=streams or runtime=device; "
                                                                    "runtime=distributed runs"),
    (dict(runtime="distributed", method="lookup"), "use runtime=local or runtime=device, not runtime=distributed"),
])
def test_the_config_checks_ask_capabilities(overrides, needle):
    with pytest.raises(UserError) as err:
        check_decoding(config(**overrides))
    assert needle in str(err.value)


def test_a_runtime_is_one_registry_entry(monkeypatch):
    """A new runtime: an entry naming its executor's opener; the config accepts it, open_stages opens it, and its
    capabilities (here: like `local` but not the reference) steer the rest."""
    opened = []

    @contextmanager
    def open_mine(staged, options, capture, cache_dir=None, width=1, slots=1):
        opened.append(staged)
        yield LocalStages(staged)

    monkeypatch.setattr(runtimes, "open_mine", open_mine, raising=False)
    mine = Runtime("mine", "the stages in a test's own executor", opener="spd.runtimes:open_mine", chains=True)
    monkeypatch.setitem(RUNTIMES, "mine", mine)
    cfg = config(runtime="mine", method="lookup")
    check_decoding(cfg)            # known, and it takes chains
    assert not eager_reference(DecodeSpec.of(cfg).runtime)
    with pytest.raises(UserError, match="runtime=mine runs the stages in a test's own executor, eagerly"):
        check_decoding(config(runtime="mine", method="ar", cuda_graphs=True, device="cuda"))
    monkeypatch.setitem(RUNTIMES, "mine", replace(mine, chains=False))
    with pytest.raises(UserError, match="not runtime=mine"):
        check_decoding(cfg)
    staged = StagedTarget(tiny_model("llama", seed=0).eval(), 2)
    with open_stages(staged, DecodeSpec.of(cfg).runtime, []) as stages:
        assert isinstance(stages, LocalStages) and opened == [staged]


def test_the_in_process_runtimes_open_their_executors():
    from spd.runtime.streams import GraphStages

    staged = StagedTarget(tiny_model("llama", seed=0).eval(), 2)
    with open_stages(staged, options(runtime="local", cuda_graphs=False), []) as stages:
        assert isinstance(stages, LocalStages)
    with open_stages(staged, options(runtime="local", cuda_graphs=True), []) as stages:
        assert isinstance(stages, GraphStages)     # on CPU its eager twin


@pytest.mark.parametrize("overrides,needle", [
    (dict(runtime="device", method="flowspec"), "method=flowspec sends its draft tree through the pipeline's stages "
                                                "in segments; use runtime=local or runtime=distributed or "
                                                "runtime=streams, not runtime=device"),
    (dict(runtime="device", method="pipedec"), "method=pipedec has no device step: use one of those, or "
                                               "runtime=local"),
    (dict(runtime="device", method="spd", W=4), "runtime=device verifies method=spd's chains; W=4 asks for trees"),
    (dict(runtime="device", method="eagle3", draft_source="suffix+module"),
     "runtime=device drafts method=eagle3 from draft_source=module; drop draft_source=suffix+module"),
    (dict(runtime="device", method="spd", draft_source="lookup+module", source_pricing=True),
     "puts the lookup in front of the module wherever it matches; drop source_pricing"),
    (dict(compile=True), "compile=true compiles the device step of runtime=device; add it, or drop compile"),
])
def test_the_device_runtime_takes_the_methods_that_have_a_step(overrides, needle):
    with pytest.raises(UserError) as err:
        check_decoding(config(**overrides))
    assert needle in str(err.value)
    check_decoding(config(runtime="device", method="lookup", device="cuda", cuda_graphs=True, compile=True))
    for method, width in [("suffix", 4), ("lookup", 4), ("eagle3", 1), ("eagle3", 4), ("spd", 1), ("ppsd", 1),
                          ("ar", 1), ("selfdraft", 1)]:
        check_decoding(config(runtime="device", method=method, W=width))


@pytest.mark.parametrize("keys,kind", [(["method=lookup"], "host"), (["method=ar"], "none"),
                                       (["method=suffix", "W=4"], "host"), (["method=eagle3"], "device"),
                                       (["method=eagle3", "W=3", "tree_nodes=8"], "device"),
                                       (["method=selfdraft", "branches=3", "branch_length=3", "corpus_ngrams=false"], "host"),
                                       (["method=spd", "n=2"], "pipeline"),
                                       (["method=spd", "n=2", "draft_source=lookup+module"], "pipeline")])
def test_runtime_device_decodes_through_the_device_step(tiny_target_dir, keys, kind):
    """The engine builds the device step's decoder for runtime=device (a host drafter, EAGLE-3's module drafting
    inside the step, SPD's pipeline step); its greedy answer is plain AR's."""
    from spd.config import load_config
    from spd.engine import open_engine
    from spd.runtime.device_chain import DeviceChainDecoder
    from spd.runtime.device_pipeline import DevicePipelineDecoder

    def answer(*keys):
        cfg = load_config(GenerateConfig, None, [f"target={tiny_target_dir}", "max_new_tokens=24", *keys])
        with open_engine(cfg) as engine:
            out = engine.run([5, 9, 3, 5, 9, 3, 7, 5, 9])
            return out["token_ids"], engine.decoder
    device, decoder = answer(*keys, "runtime=device")
    if kind == "pipeline":
        assert isinstance(decoder, DevicePipelineDecoder)
        assert decoder.drafter.lookup == ((2, 8) if "draft_source=lookup+module" in keys else None)
    else:
        assert isinstance(decoder, DeviceChainDecoder)
        assert (decoder.drafter is not None, decoder.device_drafter is not None) == (kind == "host", kind == "device")
        assert decoder.width == (3 if "W=3" in keys else 4 if "W=4" in keys else 1)
    assert device == answer("method=ar")[0]


@pytest.mark.parametrize("device,dtype,expected", [("cpu", None, "float32"), ("cuda", None, "bfloat16"),
                                                   ("cuda:1", "float32", "float32"), ("cpu", "bfloat16", "bfloat16")])
def test_the_default_dtype_is_bfloat16_on_cuda_and_float32_elsewhere(device, dtype, expected):
    from spd.config import load_config
    from spd.eval.config import EvalConfig

    keys = [f"device={device}"] + ([f"dtype={dtype}"] if dtype else [])
    assert load_config(GenerateConfig, None, keys).dtype == expected
    assert load_config(EvalConfig, None, keys).dtype == expected
