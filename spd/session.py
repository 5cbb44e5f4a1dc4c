"""Build what a decoding run needs from a config: target, stages, drafter, prompt ids. Shared by CLI commands."""

from __future__ import annotations

import gc
import inspect
import warnings
from dataclasses import dataclass, field, replace

import torch

from spd.models.checkpoint import check_target, checkpoint_method, load_checkpoint, read_checkpoint_config
from spd.config import check_sampling
from spd.decoding import eos_ids_of
from spd.drafters.base import Drafter, check_contract
from spd.drafters.draft_model import DraftLM
from spd.models.eagle3 import Eagle3Module
from spd.errors import UserError
from spd.methods import AR, METHODS, MODULE, behaviour, module_class
from spd.drafters.suffix import Retrieval, SuffixMemory
from spd.models.module import SpeculationModule
from spd.pricing import RowCosts
from spd.corpora.prompts import conversation_ids
from spd.verify.sampling import SamplingParams
from spd.models.shipped import DEFAULT_N, checkpoint_for
from spd.spec import DecodeSpec, Sampling
from spd.runtimes import runtime as runtime_named
from spd.targets.loaded import DTYPES
from spd.targets.loading import LoadedTarget, load_target
from spd.corpora.retrieval import open_datastore
from spd.targets.row_costs import cached_row_costs
from spd.targets.linear_states import ROLLBACK
from spd.targets.source import hybrid_family, resolve_source
from spd.targets.weight_cache import load_parts, materialize
from spd.targets.stages import StagedTarget



@dataclass
class Caches:
    """What a run builds once from its spec beside the models, shared by every drafter and decoder it makes."""
    cache_dir: str | None = None       # runtime=distributed: the target cache the stage processes load from
    balance: dict | None = None        # stage_bounds=balanced: the measured stage times and predicted step
    row_costs: RowCosts | None = None  # suffix with draft_pricing: this machine's forward cost by rows
    memory: SuffixMemory | None = None  # suffix with suffix_memory: earlier requests, one memory for every drafter
    retrieval: Retrieval | None = None  # suffix with datastore=: a corpus's continuations are candidates too


@dataclass
class Session:
    loaded: LoadedTarget
    staged: StagedTarget               # runtime=distributed: the controller's parts only (embedding, head)
    module: SpeculationModule | Eagle3Module | None   # None for the methods that load none
    eos_ids: frozenset[int]
    spec: DecodeSpec                   # resolved: the method (a checkpoint's where none was asked), its draft length
                                       # and source, the module's directory (None: untrained or none), n
    caches: Caches = field(default_factory=Caches)
    draft_model: DraftLM | None = None  # PipeDec: the draft model its first stage runs

    @property
    def params(self) -> SamplingParams:
        s = self.spec.sampling
        return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

    def inputs(self, use_cache: bool | None = None) -> dict:
        """What a drafter factory may ask for, by parameter name (spd.methods names the factories)."""
        spec, caches = self.spec, self.caches
        return dict(spec=spec, lookup=spec.lookup, suffix=spec.suffix, **spec.options,
                    draft_source=spec.draft_source, module=self.module, embed=self.staged.embed,
                    use_cache=spec.module.cache if use_cache is None else use_cache, draft_model=self.draft_model,
                    row_costs=caches.row_costs, memory=caches.memory, retrieval=caches.retrieval,
                    tokenizer=self.loaded.tokenizer, vocab_size=self.loaded.model.config.vocab_size)

    def build(self, factory: str, use_cache: bool | None = None):
        """A "module:function" factory called with the inputs its keyword parameters name: each factory declares
        what it drafts with, and nothing else reaches it."""
        offered = self.inputs(use_cache)
        return behaviour(factory)(**{name: offered[name] for name in asks(factory)})

    def drafter(self, use_cache: bool | None = None) -> Drafter | None:
        """The method's drafter (spd.methods names its factory), checked against its declared capabilities
        (spd.drafters.base.check_contract); None for plain AR. use_cache: None = module_cache."""
        make = METHODS[self.spec.method].drafter
        return None if make is None else check_contract(self.build(make, use_cache))

    @property
    def drafts_with(self) -> str:
        """What drafts, for stats lines and run labels: the method, and for a pipelined one its draft source."""
        method = self.spec.method
        if self.draft_model is not None:
            return f"{method}, draft model of {self.draft_model.layers} layer(s)"
        return f"{method}, {self.spec.draft_source}" if METHODS[method].pipelined else method


def sampling_params(sampling: Sampling) -> SamplingParams:
    """A spec's sampling settings, checked by the config's rule (a library caller's spec has not passed through
    spd.config)."""
    check_sampling(sampling.temperature, sampling.top_k, sampling.top_p)
    return SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def check_device(device: str) -> None:
    """The config's pattern check knows the name; only torch knows whether this machine has it."""
    kind, _, index = device.partition(":")
    if kind == "cuda" and (not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count()):
        raise UserError(f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) here; use "
                        "device=cpu or another index")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={device!r}: MPS is not available on this machine; use device=cpu")


def check_hybrid(spec: DecodeSpec) -> None:
    """A hybrid target (Qwen3.5: linear-attention layers beside attention) keeps its linear layers' states for a
    bounded number of positions (spd.targets.linear_states): another hybrid family, or a step deeper than that, is
    refused before the model loads."""
    family = hybrid_family(resolve_source(spec.target))
    if family is None:
        return
    if family not in ("qwen3_5", "qwen3_5_text"):
        raise UserError(f"target {spec.target!r} is a {family} hybrid; the suite runs Qwen3.5's linear-attention "
                        "layers (Gated DeltaNet), not this family's")
    deepest = max(spec.stages.n or 0, spec.draft_length or 0)
    if deepest > ROLLBACK:
        raise UserError(f"n / draft_length {deepest}: a hybrid target's linear-attention layers keep their states for "
                        f"the last {ROLLBACK} positions, so a step can roll back at most that far; use {ROLLBACK} "
                        "or fewer")


def check_exact_rows(method: str, staged: StagedTarget) -> None:
    """Drafted decoding equals AR only where a row's bits do not depend on the rows beside it; a float32 CPU target
    whose panel kernel failed its self-check at every level (spd.targets.panel) is refused rather than run inexactly
    (bfloat16 whose products fail their check is warned by StagedTarget, as a reduced-precision choice)."""
    if METHODS[method].decoder != AR and staged.dtype == torch.float32 and not staged.exact_rows:
        raise UserError(f"method={method}: this CPU's float32 products give a row other bits at other row counts (no "
                        "panel kernel level passed the row check), so drafted decoding could leave AR's tokens; use "
                        "method=ar (the same tokens), or install a C++ compiler for the panel kernel")


def open_session(cfg) -> Session:
    """Everything a decoding command needs; `cfg` has passed its schema's checks (spd.config.load_config), or is
    any object with the decoding keys (spd.spec.DecodeKeys)."""
    spec = DecodeSpec.of(cfg)
    rt, dtype = spec.runtime, DTYPES[spec.runtime.dtype]
    check_device(rt.device)
    sampling_params(spec.sampling)
    wanted = spec.method
    check_hybrid(spec)
    # the lookup, the suffix statistics, PipeDec's draft model: nothing to load from a checkpoint
    moduleless = wanted is not None and METHODS[wanted].decoder != AR and not METHODS[wanted].trained
    if moduleless and spec.module.checkpoint not in (None, "random"):
        raise UserError(f"method={wanted} loads no module (it drafts with "
                        f"{'a draft model' if METHODS[wanted].draft_model else 'the context'}); drop checkpoint=")
    drafts_with_model = wanted is not None and METHODS[wanted].draft_model
    path = None if moduleless else checkpoint_for(spec.module.checkpoint, spec.target, spec.stages.n,
                                                  spec.stages.bounds,
                                                  wanted if wanted is not None and METHODS[wanted].trained else None)
    ckpt = read_checkpoint_config(path) if path else None
    method = resolve_method(wanted, ckpt, path)
    n = spec.stages.n if spec.stages.n is not None else (ckpt["n"] if ckpt else DEFAULT_N)
    if METHODS[method].chain:   # draft-then-verify runs the target whole
        if spec.stages.n not in (None, 1) or spec.stages.bounds is not None:
            raise UserError(f"method={method} runs no pipeline (the target verifies m drafts in one forward); drop "
                            "n= and stage_bounds=, set the draft length with draft_length=")
        n = 1
    caches = Caches()
    if runtime_named(rt.name).processes:
        if rt.device not in ("cpu", "cuda") and not rt.device.startswith("cuda:"):
            raise UserError(f"device={rt.device!r}: runtime={rt.name} runs on cpu or cuda")
        caches.cache_dir = materialize(spec.target, dtype)  # the stages load their own layers from it; never the whole model here
        # the controller holds no layer, but PipeDec's draft model (the first draft_layers) runs here
        drafted = range(spec.draft_layers) if drafts_with_model else range(0)
        loaded = load_parts(caches.cache_dir, drafted, embed=True, head=True, dtype=dtype, device=rt.device,
                            weights=rt.weights)
    else:
        loaded = load_target(spec.target, dtype, rt.device, rt.weights)
    if ckpt:
        check_target(path, ckpt, loaded)  # before n and bounds: a foreign checkpoint is the real problem
    num_layers = loaded.model.config.num_hidden_layers
    if not 1 <= n <= num_layers:
        raise UserError(f"n={n} stages is impossible for a target with L={num_layers} layers; use 1 <= n <= {num_layers}")
    bounds, caches.balance = resolve_bounds(spec, n, ckpt, path, loaded, caches.cache_dir, METHODS[method].trained)
    try:
        staged = StagedTarget(loaded.model, n, bounds)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    check_exact_rows(method, staged)
    module = open_module(spec, method, ckpt, path, staged, loaded)
    spec = replace(spec, method=method, draft_length=spec.draft_length or METHODS[method].draft_length,
                   draft_source=spec.draft_source or (METHODS[method].sources or (MODULE,))[0],
                   module=replace(spec.module, checkpoint=path if module else None), stages=replace(spec.stages, n=n))
    open_caches(spec, caches, staged, loaded)
    draft_model = None
    if METHODS[method].draft_model:
        if not 1 <= spec.draft_layers <= num_layers:
            raise UserError(f"draft_layers={spec.draft_layers}: the draft model is the target's first k layers, so "
                            f"1 <= k <= {num_layers}")
        draft_model = DraftLM(staged, spec.draft_layers)
    # what is loaded lives as long as the session: out of the collector's walks, which a decode step's garbage
    # otherwise triggers over every object of the model and tokenizer (~2% of a one-row step at weights=q4)
    gc.freeze()
    return Session(loaded, staged, module.eval() if module else None,
                   eos_ids_of(loaded.model.config, loaded.tokenizer), spec, caches, draft_model)


def open_module(spec: DecodeSpec, method: str, ckpt: dict | None, path: str | None, staged: StagedTarget,
                loaded: LoadedTarget) -> SpeculationModule | Eagle3Module | None:
    """The checkpoint's module, an untrained one (checkpoint=random, or no shipped one), or None for the methods
    that draft without one."""
    if not METHODS[method].trained:
        return None
    if ckpt:
        return load_checkpoint(path, staged, loaded)
    if spec.module.layers < 1:
        raise UserError(f"module_layers={spec.module.layers} must be >= 1")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        return module_class(METHODS[method].module).untrained(staged, method, spec.module.layers,
                                                              seed=spec.sampling.seed)


def open_caches(spec: DecodeSpec, caches: Caches, staged: StagedTarget, loaded: LoadedTarget) -> None:
    """What the resolved method's drafter reads beyond the spec: the row costs, the suffix memory and datastore."""
    method, suffix = METHODS[spec.method], spec.suffix
    if method.prices(spec.draft_source):
        tree = spec.tree
        if suffix.draft_pricing:
            # with Self-Draft's branches (spd.drafters.suffix_branches), every row they may add is priced too
            branches = spec.options["selfdraft"]
            side = branches.branches * branches.branch_length \
                if suffix.branches and "suffix" in asks(method.drafter) else 0
            rows = 1 + (tree.nodes if tree.width > 1 else spec.draft_length)
            caches.row_costs = cached_row_costs(staged, rows + side)
        if suffix.memory:
            caches.memory = SuffixMemory(1, spec.lookup.max_ngram)   # the sizes the drafter matches
        if suffix.datastore:
            caches.retrieval = Retrieval(open_datastore(suffix.datastore, loaded.tokenizer,
                                                        loaded.model.config.vocab_size))
    elif suffix.datastore:
        raise UserError(f"datastore= is read by method=suffix (and method=eagle3 draft_source=suffix+module); "
                        f"method={spec.method} drafts without it; drop datastore= or choose method=suffix")


def asks(factory: str | None) -> frozenset[str]:
    """The inputs a "module:function" drafter factory names (Session.inputs offers them); none without one."""
    return frozenset(inspect.signature(behaviour(factory)).parameters) if factory else frozenset()


def resolve_method(wanted: str | None, ckpt: dict | None, path: str | None) -> str:
    """The drafter a run decodes with: the one asked for, else the checkpoint's; a checkpoint of another drafter
    is refused (its weights mean something else)."""
    if wanted is not None and not METHODS[wanted].trained:
        return wanted   # ar, lookup: nothing of the checkpoint's is read but its n (pipeline AR)
    if ckpt is None:
        return wanted or "spd"
    trained = checkpoint_method(path, ckpt)
    if wanted is not None and wanted != trained:
        raise UserError(f"checkpoint {path!r} is a {trained} module, not {wanted}; drop method= or pass a "
                        f"{wanted} checkpoint")
    return trained


def resolve_bounds(spec: DecodeSpec, n: int, ckpt: dict | None, path: str | None, loaded: LoadedTarget,
                   cache_dir: str | None, drafting: bool = True) -> tuple[list[int] | None, dict | None]:
    """Explicit bounds, the checkpoint's, the even split (None), or `balanced`: measured here, and then a
    checkpoint trained for other bounds is refused with the bounds it needs. drafting: a module drafts (its cost
    lands on stage 1 where the controller runs it)."""
    rt, asked = spec.runtime, spec.stages.bounds
    if asked is None:
        return (ckpt["stage_bounds"] if ckpt and ckpt["n"] == n else None), None
    if isinstance(asked, str):
        if asked != "balanced":
            raise UserError(f"stage_bounds={asked!r}: give the inner boundaries as a list (e.g. [10, 20]) or "
                            "'balanced'")
        from spd.runtime.balance import balanced_bounds, cached_profile, controller_costs, stage_costs
        from spd.runtime.stages import hosts_first_stage, launched_world, threads_for

        def full_target() -> StagedTarget:
            num_layers = loaded.model.config.num_hidden_layers
            if runtime_named(rt.name).processes:  # the controller holds no layers: borrow all of them, once, to time them
                whole = load_parts(cache_dir, range(num_layers), embed=True, head=True, dtype=DTYPES[rt.dtype],
                                   device=rt.device)
                return StagedTarget(whole.model, 1)
            return StagedTarget(loaded.model, 1)

        processes = runtime_named(rt.name).processes
        hosted = processes and hosts_first_stage(rt.distributed.controller, n, rt.device, launched_world())
        threads = threads_for(n, rt.distributed.threads_per_stage, hosted) if processes else torch.get_num_threads()
        costs = cached_profile(cache_dir, full_target, threads, rt.dtype, rt.device)
        vocab = loaded.model.config.vocab_size
        draft_vocab = (ckpt.get("draft_vocab_size") or vocab) if ckpt else vocab
        controller_s = controller_costs(costs, ckpt["module_layers"] if ckpt else spec.module.layers,
                                        draft_vocab if drafting else None, vocab) if hosted else 0.0
        bounds = balanced_bounds(costs, n, controller_s)
        stages = stage_costs(bounds, costs, controller_s)
        balance = {"stage_bounds": bounds, "stage_s": stages, "predicted_step_s": max(stages), "threads": threads,
                   "controller_in_stage_1_s": controller_s,
                   "even_stage_s": stage_costs(StagedTarget.even_bounds(len(costs["layer_s"]), n), costs,
                                               controller_s)}
        if ckpt and ckpt["stage_bounds"] != bounds:
            raise UserError(f"checkpoint {path!r} was trained for stage_bounds={ckpt['stage_bounds']}, "
                            f"but the balanced bounds on this machine are {bounds}; pass "
                            f"stage_bounds={ckpt['stage_bounds'][1:-1]} to use it, or train a module with "
                            f"model.stage_bounds={bounds[1:-1]}")
        return bounds, balance
    try:
        return [int(b) for b in asked], None
    except (TypeError, ValueError):
        raise UserError(f"stage_bounds={asked!r}: give the inner boundaries as a list of integers or 'balanced'") from None


def encode_prompt(session: Session, prompt: str | None, chat_template: bool, max_new_tokens: int) -> list[int]:
    if not prompt or not prompt.strip():
        raise UserError("the prompt is empty; pass prompt=\"...\"")
    if chat_template:
        return encode_chat(session, [{"role": "user", "content": prompt}], max_new_tokens)
    return _fits(session, list(_tokenizer(session)(prompt)["input_ids"]), max_new_tokens)


def encode_chat(session: Session, messages: list[dict], max_new_tokens: int) -> list[int]:
    """A conversation through the target's chat template, ending with the generation prompt."""
    tok = _tokenizer(session)
    if not getattr(tok, "chat_template", None):
        raise UserError(f"target {session.loaded.name!r} has no chat template; set chat_template=false")
    return _fits(session, conversation_ids(tok, messages), max_new_tokens)


def _tokenizer(session: Session):
    if session.loaded.tokenizer is None:
        raise UserError(f"target {session.loaded.name!r} has no tokenizer; give a target directory that includes one")
    return session.loaded.tokenizer


def _fits(session: Session, ids: list[int], max_new_tokens: int) -> list[int]:
    window = getattr(session.loaded.model.config, "max_position_embeddings", None)
    if window and len(ids) + max_new_tokens > window:
        raise UserError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                        f"context window of {window}; shorten the prompt or lower max_new_tokens")
    return ids
