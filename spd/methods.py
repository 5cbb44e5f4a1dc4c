"""Every decoding method, once: its name, the label tables and plots use, how it decodes (a drafter beside the
pipeline, a draft-then-verify chain, or plain AR), which module, if any, it drafts with, and what it does — its
drafter, its features, its exact fast evaluator, its training objective. Config checks, the session, the CLI, eval,
reports, checkpoints and the trainer read it here, so a method is added in one place and nothing else branches on
method names — here, or from another package through an entry point (`installed_methods`).

Torch-free: config checks read it before any model loads. Behaviour is named as "module:attribute" and imported
when first used (`behaviour`), as vLLM's model registry names its classes."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

from spd.errors import UserError

PIPELINE, SEGMENTS, CHAIN, AR = "pipeline", "segments", "chain", "ar"

# the module classes, by the name a Method's `module` and a checkpoint's config give them
MODULE_CLASSES = {"speculation": "spd.models.module:SpeculationModule", "eagle3": "spd.models.eagle3:Eagle3Module"}


@dataclass(frozen=True)
class Plan:
    """Which features a pipelined method's module reads (spd.layout.FeaturePlan): every depth shifted by `shift`
    (1: the step's output states), or depth `single` alone (PPSD: stage 1's output); after_step: it drafts after the
    pipeline step instead of concurrently with it."""
    shift: int = 0
    single: int | None = None
    after_step: bool = False


@dataclass(frozen=True)
class Method:
    name: str
    label: str               # in tables, plots and run labels
    decoder: str             # PIPELINE (spd.runtime.pipeline), SEGMENTS (spd.runtime.segments), CHAIN
                             # (spd.runtime.chain) or AR
    module: str | None       # a MODULE_CLASSES key: "speculation" (spd.models.module), "eagle3"; None: drafts without one
    fast_evaluator: str | None = None   # "module:function" scoring greedy eval from the target's cached traces
    draft_length: int | None = None   # a chain's drafts per target forward when draft_length= is not given
    drafter: str | None = None        # "module:function" building its drafter (keyword arguments, see Session)
    plan: Plan | None = None          # a pipelined method's features
    objective: str | None = None      # "module:class" of its training objective (spd.train.methods)
    replays_trees: bool = False       # its fast evaluator also replays draft trees (W > 1) exactly
    priced: bool = False              # its drafter prices each cycle with this machine's row costs (spd.pricing) and
                                      # may search earlier requests (suffix_memory=)
    draft_model: bool = False         # drafts with a separate draft model (spd.drafters.draft_model, draft_layers=)
    spine: bool = True                # a pipelined tree keeps its spine's child (spd.runtime.pipeline.grow); False:
                                      # the W best by cumulative log q alone
    sources: tuple[str, ...] = ()     # the draft_source= values it takes, its default first (none: no choice)
    device_step: bool = False         # runs through the device step (spd.runtime.device_step, runtime=device)
    device_trees: bool = False        # ... with W > 1 too (trees drafted on the host, or by its device drafter)
    device_drafter: str | None = None  # "module:function" building the drafter that drafts inside the device step
    keys: type | None = None          # its own keys: a dataclass of flat keys (default and meaning beside each, a
                                      # `check`), joined into every decoding command's config (spd.spec.DecodeKeys)
                                      # and handed to drafter factories under the method's name

    def prices(self, source: str | None) -> bool:
        """Its drafter, drafting from `source`, prices each cycle with this machine's row costs (spd.pricing)."""
        return self.priced or source == SUFFIX_MODULE

    @property
    def fast_eval(self) -> bool:
        """Greedy eval can score it from the target's cached traces (spd.eval.fast*)."""
        return self.fast_evaluator is not None

    @property
    def pipelined(self) -> bool:
        """Runs the target as a pipeline of stages (n=, stage_bounds=, runtime=distributed apply)."""
        return self.decoder in (PIPELINE, SEGMENTS)

    @property
    def rows_vary(self) -> bool:
        """Its steps run varying rows a stage (FlowSpec's segments, PipeDec's levels): the measured cost prices each
        step by its rows (spd.eval.calibrate.calibrate_rows)."""
        return self.decoder == SEGMENTS or self.draft_model

    @property
    def chain(self) -> bool:
        return self.decoder == CHAIN

    @property
    def trained(self) -> bool:
        """Drafts with a trained module: has checkpoints, a shipped default, training and calibration."""
        return self.module is not None


# Where a pipelined method's drafts come from: its module alone, or the context lookup where the context's suffix
# matched earlier and the module otherwise (spd.drafters.hybrid); FlowSpec's trees: the context's statistics or its
# lookup (spd.drafters.hybrid.segment_drafter).
# EAGLE-3's: its module alone, or the context's statistics with its module's children beside them, priced
# (spd.drafters.suffix_eagle3).
MODULE, LOOKUP_MODULE, SUFFIX, LOOKUP, SUFFIX_MODULE = "module", "lookup+module", "suffix", "lookup", "suffix+module"

_PIPELINED = dict(module="speculation", sources=(MODULE, LOOKUP_MODULE), fast_evaluator="spd.eval.fast_trace:fast_pipeline_eval",
                  drafter="spd.drafters.hybrid:pipelined_drafter", objective="spd.train.methods:PipelinedObjective",
                  device_step=True, device_drafter="spd.drafters.spd_device:device_drafter")

@dataclass
class SelfDraftKeys:
    """method=selfdraft's own keys (suffix_branches=true reads them too)."""
    branches: int = 6                    # method=selfdraft (and suffix_branches): N, draft branches run beside each
                                         # verification forward (suffix_branches: at most N, as the pricing decides)
    branch_length: int = 6               # method=selfdraft, suffix_branches: L, tokens a draft branch keeps (its
                                         # oldest dropped past L)
    gram: int = 4                        # method=selfdraft, suffix_branches: G, the n-grams its context and corpus
                                         # caches keep (a candidate is the G - 1 tokens after the newest token;
                                         # draft_length caps it)
    corpus_ngrams: bool = True           # method=selfdraft: the ShareGPT datastore's n-grams fill the candidates the
                                         # branches' leave (built once per tokenizer, cached); false: branches alone
    verified_ngrams: bool = True         # method=selfdraft: the prompt's and the verified text's own n-grams join
                                         # the branches' in the context cache (as the authors' code does); false:
                                         # the branches' alone (the paper's text)

    def check(self) -> None:
        for name, low, what in (("branches", 0, "selfdraft's draft branches; 0 = the corpus n-grams alone"),
                                ("branch_length", 1, "tokens a selfdraft branch keeps"),
                                ("gram", 2, "selfdraft's n-gram length: a key and at least one token")):
            if getattr(self, name) < low:
                raise UserError(f"{name}={getattr(self, name)} must be a finite number >= {low} ({what})")


def own_keys(method_keys: type, cfg) -> object:
    """A method's own keys (Method.keys) with a config's values (any object with the flat keys)."""
    return method_keys(**{f.name: getattr(cfg, f.name) for f in fields(method_keys)})


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("spd", "SPD", PIPELINE, plan=Plan(), **_PIPELINED),
    Method("ppsd", "PPSD", PIPELINE, plan=Plan(single=1, after_step=True), **_PIPELINED),
    Method("spd_output_state", "SPD output states", PIPELINE, plan=Plan(shift=1, after_step=True), **_PIPELINED),
    Method("eagle3", "EAGLE-3", CHAIN, "eagle3", fast_evaluator="spd.eval.fast_chain:fast_eagle3_eval",
           draft_length=5, drafter="spd.drafters.suffix_eagle3:chain_drafter",
           objective="spd.train.methods:Eagle3Objective", replays_trees=True, sources=(MODULE, SUFFIX_MODULE),
           device_step=True, device_trees=True, device_drafter="spd.drafters.eagle3_device:device_drafter"),
    # 7: 8 target rows a cycle, which a CPU computes faster than 7; m = 15 is predicted 7% better on 512-token answers
    # but a miss costs it 16 rows, which short answers pay (docs/speed-cpu.md, "The lookup chain's settings")
    Method("lookup", "Context lookup", CHAIN, None, fast_evaluator="spd.eval.fast_chain:fast_lookup_eval",
           draft_length=7, drafter="spd.drafters.lookup:chain_drafter", replays_trees=True, device_step=True,
           device_trees=True),
    # 15: a chain's depth bound; the pricing (spd.pricing) decides each cycle how much of it to draft
    Method("suffix", "Context statistics, priced", CHAIN, None, fast_evaluator="spd.eval.fast_chain:fast_suffix_eval",
           draft_length=15, drafter="spd.drafters.suffix:chain_drafter", replays_trees=True, priced=True,
           device_step=True, device_trees=True),
    # Self-Draft (Multi-Branch Self-Drafting): N draft branches ride in each verification forward, their n-grams and a
    # corpus's are the candidates; 3: a candidate's tokens after its key at the default gram=4 (G - 1)
    Method("selfdraft", "Self-Draft", CHAIN, None, draft_length=3, drafter="spd.drafters.selfdraft:chain_drafter",
           keys=SelfDraftKeys, device_step=True, device_trees=True),
    # PipeDec: a draft model as the first stage grows the tree one layer per step (W = w nodes a layer, children
    # = c per leaf); greedy eval replays it over the target's traces with its draft model running
    Method("pipedec", "PipeDec", PIPELINE, None, drafter="spd.drafters.draft_model:pipelined_drafter",
           draft_model=True, spine=False, fast_evaluator="spd.eval.fast_trace:fast_pipedec_eval", replays_trees=True),
    # FlowSpec: the tree on the controller, score-ordered segments of S nodes flowing through the stages; D = 5 (the
    # paper's D_init and D_exp)
    Method("flowspec", "FlowSpec", SEGMENTS, None, draft_length=5, drafter="spd.drafters.hybrid:segment_drafter",
           sources=(SUFFIX, LOOKUP), fast_evaluator="spd.eval.fast_trace:fast_segment_eval", replays_trees=True),
    Method("ar", "AR", AR, None, device_step=True),
)}

ENTRY_POINTS = "spd.methods"   # the entry-point group through which another package adds a method


def installed_methods() -> list[Method]:
    """The methods other installed packages add: each entry point of the `spd.methods` group names a `Method` (its
    drafter, keys and capabilities live in that package, e.g. `[project.entry-points."spd.methods"] toy =
    "toy.registry:METHOD"`). Read once, when this registry is first imported; a name taken twice is an error."""
    from importlib.metadata import entry_points

    found: list[Method] = []
    for point in entry_points(group=ENTRY_POINTS):
        method = point.load()
        if not isinstance(method, Method):
            raise TypeError(f"entry point {point.name} = {point.value} is not an spd.methods.Method")
        if method.name in METHODS or any(m.name == method.name for m in found):
            raise ValueError(f"entry point {point.name}: method {method.name!r} is already registered")
        found.append(method)
    return found


METHODS.update({m.name: m for m in installed_methods()})

DECODING_METHODS = tuple(METHODS)
TRAINED_METHODS = tuple(name for name, m in METHODS.items() if m.trained)
DRAFTING_METHODS = tuple(name for name, m in METHODS.items() if m.decoder != AR)

DRAFT_SOURCES = tuple(dict.fromkeys(source for m in METHODS.values() for source in m.sources))
METHOD_KEYS = {name: m.keys for name, m in METHODS.items() if m.keys is not None}     # method -> its own keys


def method(name: str) -> Method:
    """The registry entry; callers pass names that passed the config's check."""
    return METHODS[name]


def behaviour(path: str):
    """The function or class a "module:attribute" name of this registry refers to, imported on first use."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def module_class(kind: str):
    """SpeculationModule or Eagle3Module, by a Method's (or a checkpoint's) module kind."""
    return behaviour(MODULE_CLASSES[kind])
