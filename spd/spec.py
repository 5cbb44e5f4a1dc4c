"""One decoding spec. The keys every decoding command shares (generate, chat, serve, eval) are declared once, flat —
the command line's and YAML's `method=suffix W=4 temperature=1` — each beside its meaning: the shared ones in
`SharedKeys`, a method's own in its registry entry (spd.methods, Method.keys); `DecodeKeys` joins them and every
command's config inherits it. `DecodeSpec` is the typed view a run decodes with: the method, the options groups, each
method's own keys (`options`), the module, the stages, the runtime and the sampling. `DecodeSpec.of(cfg)` builds it from a
config; spd.session resolves what a config leaves open (the checkpoint's method, the method's draft length and
source).

Torch-free: the configs and their checks read it before any model loads."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from spd.methods import METHOD_KEYS, own_keys


@dataclass
class SharedKeys:
    target: str = "smollm2"              # "smollm2", an HF model directory, a .gguf file, or tiny-<family>
    checkpoint: Optional[str] = None     # module directory; None = the shipped one for the run's n, random = untrained
    method: Optional[str] = None         # spd | ppsd | spd_output_state | eagle3 | lookup | suffix | selfdraft | pipedec | ar (plain AR
                                         # through the same stage runner); None = the checkpoint's, and where no key
                                         # chooses, the fastest lossless for the device (spd.fastest), else spd
    draft_length: Optional[int] = None   # method=eagle3 | lookup | suffix: at most m drafts per target forward; None
                                         # = the method's own (eagle3 5, lookup 7, suffix 15)
    W: int = 1                           # draft-tree width (1 = a chain): branches kept in SPD's pipeline, children per
                                         # node in a chain's tree; W > 1 needs method=
    tree_nodes: int = 16                 # W > 1, chain methods: drafted nodes per verification (the tree's budget);
                                         # flowspec: N, the nodes of each tree it grows
    children: Optional[int] = None       # W > 1, pipelined methods: candidates drafted per tip, the W best kept
                                         # (PipeDec's c; None = W)
    draft_layers: int = 1                # method=pipedec: its draft model is the target's first k layers, final norm
                                         # and head (an early exit)
    segment: int = 4                     # method=flowspec: S, the tree's nodes per segment (one segment enters a step)
    draft_source: Optional[str] = None   # spd, ppsd, spd_output_state: module | lookup+module (the context lookup's token
                                         # where the context's suffix matched earlier, else the module's draft); flowspec:
                                         # suffix | lookup (its trees from the context's statistics or lookup); eagle3:
                                         # module | suffix+module (the context's statistics with EAGLE-3's children
                                         # beside them, priced); None = the method's first
    lookup_min_ngram: int = 2            # lookup, lookup+module, suffix: shortest suffix of the context that may match
                                         # earlier
    lookup_max_ngram: int = 8            # lookup, lookup+module, suffix: longest suffix compared (the longest match wins)
    draft_pricing: bool = True           # suffix: each cycle drafts what this machine's row costs and the run's own
                                         # verdicts say pays (spd.pricing); false: every candidate up to the budget
    source_pricing: bool = False         # lookup+module: the lookup drafts only where this request's verdicts predict
                                         # it likelier kept than the module (off: measured 1% below the plain rule)
    suffix_memory: bool = False          # suffix: earlier requests' prompts and answers (chat turns, a server's
                                         # requests) join the context searched — speed only, never the output
    suffix_branches: bool = False        # suffix: Self-Draft's draft branches (branches=, branch_length=, gram=) ride
                                         # beside the tree where this machine's row costs say they pay, their
                                         # n-grams candidates too (spd.drafters.suffix_branches) — speed only, never
                                         # the output (off by default: docs/speed-cpu.md)
    datastore: Optional[str] = None      # suffix: a corpus's continuations of the context's suffix are candidates
                                         # too — sharegpt (built once per tokenizer, cached), answers (the target's
                                         # own, shipped), a datastore file, your own text (a .txt file, or .jsonl
                                         # of {"text": ...} lines; built once, cached), or several joined by +
                                         # (spd.corpora.retrieval); speed only, never the output
    n: Optional[int] = None              # pipeline stages; None = the checkpoint's n, else 5
    stage_bounds: Any = None             # explicit inner boundaries b_1..b_{n-1}, or "balanced" (by measured cost)
    module_layers: int = 1               # L_s of a randomly initialised module
    module_cache: bool = True            # cache K/V of depth-n memory rows (exact: they never change)
    max_new_tokens: int = 128            # at most this many tokens after the prompt (end of sequence stops sooner;
                                         # eval: 512, the paper's protocol)
    temperature: float = 0.0             # 0 = greedy
    top_k: int = 0                       # sample among the k likeliest tokens (0 = off; eval: 50, the paper's sampled
                                         # setting with T=1 and top-p 1.0)
    top_p: float = 1.0                   # sample within the smallest set of probability >= top_p (1 = off)
    seed: Optional[int] = None           # sampling's seed; None = a fresh one per run, printed in the stats line and
                                         # the JSON record (seed=) so the run can be repeated; greedy ignores it; eval
                                         # (default 0) seeds each prompt from (seed, dataset, question_id)
    dtype: Optional[str] = None          # float32 | bfloat16 | float16: the target's and the module's weights
                                         # (None: bfloat16 on CUDA, float32 elsewhere, the reference)
    weights: str = "float32"             # float32 | q4: a GGUF target's products from its own 4- and 8-bit blocks
                                         # (Q4_1, Q8_0) on a CPU: a target of its own (its AR the reference), 5 bits
                                         # read a weight;
                                         # the default where no key chooses the method, on a GGUF target
    device: str = "cpu"                  # cpu | cuda | cuda:N | mps
    runtime: str = "local"               # local (stages one after another, the reference) | distributed (a process
                                         # per stage) | streams (one CUDA stream per stage, launched together; CUDA
                                         # only) | device (each cycle one fixed-shape step on the device, no host
                                         # read inside). A runtime never changes the method
    cuda_graphs: bool = False            # each stage's one-token step (runtime=device: the whole step) replayed as a
                                         # CUDA graph (CUDA only)
    compile: bool = False                # runtime=device: the step through torch.compile (fullgraph, inductor)
    threads_per_stage: Optional[int] = None  # distributed: intra-op threads per process (None: cores // processes)
    controller: str = "auto"             # distributed: own_process (n + 1 processes) | first_stage (the controller
                                         # runs stage 1 too: n processes) | auto (first_stage where n + 1 processes
                                         # would outnumber the CPU cores; under torchrun, what its world size says)
    master_addr: str = "127.0.0.1"       # distributed: where the controller hosts the rendezvous
    master_port: int = 0                 # distributed: 0 = any free port
    timeout_s: float = 20.0              # distributed: longest wait for any message inside a generation


@dataclass
class DecodeKeys(*METHOD_KEYS.values(), SharedKeys):
    """Every decoding key: the shared ones above and each method's own (spd.methods, Method.keys)."""


def own_defaults(**values):
    """A config's own defaults for keys it inherits from DecodeKeys (eval's paper protocol): the key, its type and
    its meaning stay declared once. Goes below @dataclass, which then reads the new defaults."""
    hints = typing.get_type_hints(DecodeKeys)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise TypeError(f"own_defaults: {', '.join(unknown)} are not DecodeKeys keys")

    def apply(cls):
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in values.items():
            annotations[name] = hints[name]
            setattr(cls, name, value)
        cls.__annotations__ = annotations
        return cls
    return apply


def key(name: str):
    """A view field set by the flat key `name` (W= sets TreeOptions.width); a field without one is set by the key of
    its own name."""
    return field(metadata={"key": name})


# The typed view. Its fields carry no defaults: every value comes from DecodeKeys (their defaults and meaning live
# there), so a spec is made by DecodeSpec.of and nothing is declared twice.

@dataclass(frozen=True)
class TreeOptions:
    width: int = key("W")
    nodes: int = key("tree_nodes")
    children: Optional[int]
    segment: int


@dataclass(frozen=True)
class LookupOptions:
    min_ngram: int = key("lookup_min_ngram")
    max_ngram: int = key("lookup_max_ngram")
    source_pricing: bool


@dataclass(frozen=True)
class SuffixOptions:
    draft_pricing: bool
    memory: bool = key("suffix_memory")
    branches: bool = key("suffix_branches")
    datastore: Optional[str]


@dataclass(frozen=True)
class ModuleOptions:
    checkpoint: Optional[str]
    layers: int = key("module_layers")
    cache: bool = key("module_cache")


@dataclass(frozen=True)
class StageOptions:
    n: Optional[int]
    bounds: Any = key("stage_bounds")


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    seed: Optional[int]


@dataclass(frozen=True)
class DistributedOptions:
    threads_per_stage: Optional[int]
    controller: str
    master_addr: str
    master_port: int
    timeout_s: float


@dataclass(frozen=True)
class RuntimeOptions:
    name: str = key("runtime")
    device: str
    dtype: Optional[str]
    weights: str
    cuda_graphs: bool
    compile: bool
    distributed: DistributedOptions


@dataclass(frozen=True)
class DecodeSpec:
    target: str
    method: Optional[str]
    draft_length: Optional[int]
    draft_source: Optional[str]
    draft_layers: int
    max_new_tokens: int
    tree: TreeOptions
    lookup: LookupOptions
    suffix: SuffixOptions
    options: Mapping[str, Any]           # each method's own keys (spd.methods, Method.keys), by method name
    module: ModuleOptions
    stages: StageOptions
    sampling: Sampling
    runtime: RuntimeOptions

    @classmethod
    def of(cls, cfg) -> "DecodeSpec":
        """The typed view of a config's decoding keys (a loaded config, a DecodeKeys, any object with the keys)."""
        return _view(cls, cfg)

    @classmethod
    def key_paths(cls) -> dict[str, str]:
        """{flat key: its dotted place in the spec}, e.g. {"W": "tree.width", "temperature": "sampling.temperature"}."""
        return dict(_paths(cls))

    def at(self, path: str):
        """The value at a dotted place, e.g. spec.at("tree.width")."""
        value = self
        for part in path.split("."):
            value = value[part] if isinstance(value, Mapping) else getattr(value, part)
        return value


def _view(kind: type, cfg):
    values = {}
    for f, hint in _fields(kind):
        if f.name == "options":
            values[f.name] = MappingProxyType({name: own_keys(keys, cfg) for name, keys in METHOD_KEYS.items()})
        elif dataclasses.is_dataclass(hint):
            values[f.name] = _view(hint, cfg)
        else:
            values[f.name] = _plain(getattr(cfg, f.metadata.get("key", f.name)))
    return kind(**values)


def _paths(kind: type, prefix: str = ""):
    for f, hint in _fields(kind):
        if f.name == "options":
            yield from ((k.name, f"{prefix}options.{name}.{k.name}")
                        for name, keys in METHOD_KEYS.items() for k in dataclasses.fields(keys))
        elif dataclasses.is_dataclass(hint):
            yield from _paths(hint, f"{prefix}{f.name}.")
        else:
            yield f.metadata.get("key", f.name), prefix + f.name


def _fields(kind: type):
    hints = typing.get_type_hints(kind)
    return [(f, hints[f.name]) for f in dataclasses.fields(kind)]


def _plain(value):
    """A config's list (an OmegaConf ListConfig: stage_bounds) as a tuple, so the frozen view holds no config node."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return value
    return tuple(value)
