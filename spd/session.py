"""Build what a decoding run needs from a config: target, stages, drafter, prompt ids. Shared by CLI commands."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from spd.checkpoint import check_target, checkpoint_method, load_checkpoint, read_checkpoint_config
from spd.decoding import eos_ids_of
from spd.drafters.base import ChainDrafter, Drafter
from spd.drafters.draft_model import DraftLM
from spd.eagle3_module import Eagle3Module
from spd.errors import UserError
from spd.methods import AR, METHODS, MODULE, behaviour, module_class
from spd.drafters.suffix import Retrieval, SuffixMemory
from spd.drafters.selfdraft import corpus_ngrams
from spd.module import SpeculationModule
from spd.pricing import RowCosts
from spd.prompts import conversation_ids
from spd.sampling import SamplingParams
from spd.shipped import DEFAULT_N, checkpoint_for
from spd.runtime import runtime as runtime_named
from spd.targets.loaded import DTYPES
from spd.targets.loading import LoadedTarget, load_target
from spd.retrieval import open_datastore
from spd.targets.row_costs import cached_row_costs
from spd.targets.weight_cache import load_parts, materialize
from spd.targets.stages import StagedTarget



@dataclass
class Session:
    loaded: LoadedTarget
    staged: StagedTarget               # runtime=distributed: the controller's parts only (embedding, head)
    module: SpeculationModule | Eagle3Module | None   # None for method=ar
    params: SamplingParams
    eos_ids: frozenset[int]
    cache_dir: str | None = None       # runtime=distributed: the target cache the stage processes load from
    balance: dict | None = None        # stage_bounds=balanced: the measured stage times and predicted step
    checkpoint: str | None = None      # the module directory drafting (a shipped one by default); None = untrained
    method: str = "spd"                # a name in spd.methods.METHODS
    lookup_ngrams: tuple[int, int] = (2, 8)   # lookup, lookup+module: shortest and longest suffix matched
    draft_source: str = MODULE         # pipelined methods: module | lookup+module
    draft_length: int | None = None    # chain methods: at most m drafts per target forward
    width: int = 1                     # chain methods: draft-tree width W (1 = a chain)
    tree_nodes: int = 16               # W > 1: drafted nodes per verification
    row_costs: RowCosts | None = None  # suffix with draft_pricing: this machine's forward cost by rows
    memory: SuffixMemory | None = None  # suffix with suffix_memory: earlier requests, shared by this session's drafters
    source_pricing: bool = False       # lookup+module: the lookup only where likelier kept (spd.pricing.SourcePricer)
    draft_model: DraftLM | None = None  # PipeDec: the draft model its first stage runs
    children: int | None = None        # pipelined trees: candidates drafted per tip (None: W)
    segment: int = 4                   # FlowSpec: nodes per segment
    retrieval: Retrieval | None = None  # suffix with datastore=: a corpus's continuations are candidates too
    selfdraft: dict | None = None      # selfdraft: its drafter's branches, branch_length, gram and corpus n-grams

    def drafter(self, use_cache: bool = True) -> Drafter | ChainDrafter | None:
        """The method's drafter (spd.methods names its factory); None for plain AR."""
        make = METHODS[self.method].drafter
        if make is None:
            return None
        return behaviour(make)(module=self.module, embed=self.staged.embed, draft_source=self.draft_source,
                               ngrams=self.lookup_ngrams, use_cache=use_cache, row_costs=self.row_costs,
                               memory=self.memory, source_pricing=self.source_pricing, draft_model=self.draft_model,
                               retrieval=self.retrieval, selfdraft=self.selfdraft)

    @property
    def drafts_with(self) -> str:
        """What drafts, for stats lines and run labels: the method, and for a pipelined one its draft source."""
        if self.draft_model is not None:
            return f"{self.method}, draft model of {self.draft_model.layers} layer(s)"
        return f"{self.method}, {self.draft_source}" if METHODS[self.method].pipelined else self.method


def sampling_params(cfg) -> SamplingParams:
    if cfg.temperature < 0:
        raise UserError(f"temperature={cfg.temperature} must be >= 0 (0 = greedy)")
    if not 0 < cfg.top_p <= 1:
        raise UserError(f"top_p={cfg.top_p} must be in (0, 1]")
    if cfg.top_k < 0:
        raise UserError(f"top_k={cfg.top_k} must be >= 0 (0 = off)")
    return SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)


def check_device(device: str) -> None:
    """The config's pattern check knows the name; only torch knows whether this machine has it."""
    kind, _, index = device.partition(":")
    if kind == "cuda" and (not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count()):
        raise UserError(f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) here; use "
                        "device=cpu or another index")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={device!r}: MPS is not available on this machine; use device=cpu")


def open_session(cfg) -> Session:
    """Everything a decoding command needs; `cfg` has passed its schema's checks (spd.config.load_config)."""
    check_device(cfg.device)
    params = sampling_params(cfg)
    wanted = getattr(cfg, "method", None)
    # the lookup, the suffix statistics, PipeDec's draft model: nothing to load from a checkpoint
    moduleless = wanted is not None and METHODS[wanted].decoder != AR and not METHODS[wanted].trained
    if moduleless and cfg.checkpoint not in (None, "random"):
        raise UserError(f"method={wanted} loads no module (it drafts with "
                        f"{'a draft model' if METHODS[wanted].draft_model else 'the context'}); drop checkpoint=")
    drafts_with_model = wanted is not None and METHODS[wanted].draft_model
    path = None if moduleless else \
        checkpoint_for(cfg.checkpoint, cfg.target, cfg.n, cfg.stage_bounds, None if wanted == "ar" else wanted)
    ckpt = read_checkpoint_config(path) if path else None
    method = resolve_method(wanted, ckpt, path)
    n = cfg.n if cfg.n is not None else (ckpt["n"] if ckpt else DEFAULT_N)
    if METHODS[method].chain:   # draft-then-verify runs the target whole
        if cfg.n not in (None, 1) or cfg.stage_bounds is not None:
            raise UserError(f"method={method} runs no pipeline (the target verifies m drafts in one forward); drop "
                            "n= and stage_bounds=, set the draft length with draft_length=")
        n = 1
    runtime = getattr(cfg, "runtime", "local")
    processes = runtime_named(runtime).processes
    cache_dir = None
    if processes:
        if cfg.device not in ("cpu", "cuda") and not cfg.device.startswith("cuda:"):
            raise UserError(f"device={cfg.device!r}: runtime={runtime} runs on cpu or cuda")
        cache_dir = materialize(cfg.target, DTYPES[cfg.dtype])  # the stages load their own layers from it; never the whole model here
        # the controller holds no layer, but PipeDec's draft model (the first draft_layers) runs here
        drafted = range(cfg.draft_layers) if drafts_with_model else range(0)
        loaded = load_parts(cache_dir, drafted, embed=True, head=True, dtype=DTYPES[cfg.dtype], device=cfg.device)
    else:
        loaded = load_target(cfg.target, DTYPES[cfg.dtype], cfg.device)
    if ckpt:
        check_target(path, ckpt, loaded)  # before n and bounds: a foreign checkpoint is the real problem
    num_layers = loaded.model.config.num_hidden_layers
    if not 1 <= n <= num_layers:
        raise UserError(f"n={n} stages is impossible for a target with L={num_layers} layers; use 1 <= n <= {num_layers}")
    drafting = METHODS[method].trained
    bounds, balance = resolve_bounds(cfg, n, ckpt, path, loaded, cache_dir, runtime, drafting)
    try:
        staged = StagedTarget(loaded.model, n, bounds)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not METHODS[method].trained:
        module = None  # plain decoding and the context lookup load no module
    elif ckpt:
        module = load_checkpoint(path, staged, loaded)
    else:
        if cfg.module_layers < 1:
            raise UserError(f"module_layers={cfg.module_layers} must be >= 1")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            module = module_class(METHODS[method].module).untrained(staged, method, cfg.module_layers, seed=cfg.seed)
    ngrams = (getattr(cfg, "lookup_min_ngram", 2), getattr(cfg, "lookup_max_ngram", 8))
    draft_length, width, tree_nodes = (cfg.draft_length or METHODS[method].draft_length, getattr(cfg, "W", 1),
                                       getattr(cfg, "tree_nodes", 16))
    row_costs = memory = retrieval = None
    source = getattr(cfg, "draft_source", None) or (METHODS[method].sources or (MODULE,))[0]
    if METHODS[method].prices(source):
        if getattr(cfg, "draft_pricing", True):
            row_costs = cached_row_costs(staged, 1 + (tree_nodes if width > 1 else draft_length))
        if getattr(cfg, "suffix_memory", False):
            memory = SuffixMemory(1, ngrams[1])        # the sizes the drafter matches (spd.drafters.suffix)
        if getattr(cfg, "datastore", None):
            retrieval = Retrieval(open_datastore(cfg.datastore, loaded.tokenizer, loaded.model.config.vocab_size))
    elif getattr(cfg, "datastore", None):
        raise UserError(f"datastore= is read by method=suffix (and method=eagle3 draft_source=suffix+module); "
                        f"method={method} drafts without it; drop datastore= or choose method=suffix")
    selfdraft = None
    if METHODS[method].drafter == "spd.drafters.selfdraft:chain_drafter":
        gram = getattr(cfg, "gram", 4)
        selfdraft = dict(branches=getattr(cfg, "branches", 6), branch_length=getattr(cfg, "branch_length", 6),
                         gram=gram, corpus=corpus_ngrams(loaded.tokenizer, loaded.model.config.vocab_size, gram)
                         if getattr(cfg, "corpus_ngrams", True) else None)
    draft_model = None
    if METHODS[method].draft_model:
        if not 1 <= cfg.draft_layers <= num_layers:
            raise UserError(f"draft_layers={cfg.draft_layers}: the draft model is the target's first k layers, so "
                            f"1 <= k <= {num_layers}")
        draft_model = DraftLM(staged, cfg.draft_layers)
    return Session(loaded, staged, module.eval() if module else None, params,
                   eos_ids_of(loaded.model.config, loaded.tokenizer), cache_dir, balance, path if module else None,
                   method, ngrams, source,
                   draft_length, width, tree_nodes, row_costs,
                   memory, getattr(cfg, "source_pricing", False), draft_model, getattr(cfg, "children", None),
                   getattr(cfg, "segment", 4), retrieval, selfdraft)


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


def resolve_bounds(cfg, n: int, ckpt: dict | None, path: str | None, loaded: LoadedTarget, cache_dir: str | None,
                   runtime: str, drafting: bool = True) -> tuple[list[int] | None, dict | None]:
    """Explicit bounds, the checkpoint's, the even split (None), or `balanced`: measured here, and then a
    checkpoint trained for other bounds is refused with the bounds it needs. drafting: a module drafts (its cost
    lands on stage 1 where the controller runs it)."""
    spec = cfg.stage_bounds
    if spec is None:
        return (ckpt["stage_bounds"] if ckpt and ckpt["n"] == n else None), None
    if isinstance(spec, str):
        if spec != "balanced":
            raise UserError(f"stage_bounds={spec!r}: give the inner boundaries as a list (e.g. [10, 20]) or "
                            "'balanced'")
        from spd.runtime.balance import balanced_bounds, cached_profile, controller_costs, stage_costs
        from spd.runtime.stages import hosts_first_stage, launched_world, threads_for

        def full_target() -> StagedTarget:
            num_layers = loaded.model.config.num_hidden_layers
            if runtime_named(runtime).processes:  # the controller holds no layers: borrow all of them, once, to time them
                whole = load_parts(cache_dir, range(num_layers), embed=True, head=True, dtype=DTYPES[cfg.dtype],
                                   device=cfg.device)
                return StagedTarget(whole.model, 1)
            return StagedTarget(loaded.model, 1)

        processes = runtime_named(runtime).processes
        hosted = processes and hosts_first_stage(getattr(cfg, "controller", "auto"), n, cfg.device,
                                                                 launched_world())
        threads = threads_for(n, cfg.threads_per_stage, hosted) if processes else torch.get_num_threads()
        costs = cached_profile(cache_dir, full_target, threads, cfg.dtype, cfg.device)
        vocab = loaded.model.config.vocab_size
        draft_vocab = (ckpt.get("draft_vocab_size") or vocab) if ckpt else vocab
        controller_s = controller_costs(costs, ckpt["module_layers"] if ckpt else cfg.module_layers,
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
        return [int(b) for b in spec], None
    except (TypeError, ValueError):
        raise UserError(f"stage_bounds={spec!r}: give the inner boundaries as a list of integers or 'balanced'") from None


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
