"""The engine: one configured decoder, kept warm (target, module, stage processes), that every consumer reads —
`spd-infer generate`, `chat`, `eval` and `serve`. It picks the decoder once, from the session's method and the
runtime, and hands out its stream of verified tokens; each request brings its own length, sampling and seed."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from spd.runtime.ar import ARDecoder
from spd.decoding import Decoder, GenerationResult, Request
from spd.drafters.base import check_contract
from spd.methods import AR, CHAIN, LOOKUP_MODULE, METHODS, PIPELINE, SEGMENTS
from spd.runtimes import eager_reference, runtime
from spd.runtime.batch import BatchDecoder
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.runtime.device_pipeline import DevicePipelineDecoder
from spd.runtime.executor import StageExecutor
from spd.runtime.pipeline import PipelineARDecoder, PipelineDecoder
from spd.runtime.seed import SeedDecoder
from spd.runtime.segments import SegmentPipelineDecoder
from spd.runtime.stages import open_stages, sequences_together
from spd.targets.stages import StagedTarget
from spd.verify.sampling import SamplingParams
from spd.session import Session, open_session


def build_decoder(kind: str, staged: StagedTarget, eos_ids: frozenset[int], drafter=None, *,
                  stages: StageExecutor | None = None, width: int = 1, draft_length: int | None = None,
                  tree_nodes: int | None = None, children: int | None = None, spine: bool = True, segment: int = 4,
                  capture=frozenset(), observe=None) -> Decoder:
    """Every decoder of the suite is built here. kind: a method's decoding kind (spd.methods: PIPELINE, CHAIN, AR).
    stages: the executor a pipeline runs on (None: `staged` in this process, stage after stage); for AR, stages
    given means AR relayed through them (fixed-shape steps, stage processes), None means the plain eager loop, whose
    `capture` / `observe` record a greedy trace (spd.eval.fast). A chain verifies on `staged` whole: draft_length
    drafts a cycle, or a tree of tree_nodes nodes of up to `width` children each. A pipeline keeps `width` nodes a
    level from `children` candidates per tip (None: width) by the `spine` rule (spd.runtime.pipeline.grow); FlowSpec's
    (SEGMENTS) sends its trees of depth draft_length, `width` children a node and tree_nodes nodes through the
    stages `segment` nodes a step."""
    if kind == AR:
        return ARDecoder(staged, eos_ids, capture, observe) if stages is None else PipelineARDecoder(stages, eos_ids)
    if kind == CHAIN:
        return ChainDecoder(staged, drafter, eos_ids, draft_length, width, tree_nodes if width > 1 else None)
    if kind == SEGMENTS:
        return SegmentPipelineDecoder(stages if stages is not None else staged, drafter, eos_ids, segment,
                                      draft_length, width, tree_nodes)
    return PipelineDecoder(stages if stages is not None else staged, drafter, eos_ids, width, children, spine)


def build_batch_decoder(kind: str, staged: StagedTarget, eos_ids: frozenset[int], new_drafter=None, *,
                        max_batch: int, width: int = 1, draft_length: int | None = None,
                        tree_nodes: int | None = None, children: int | None = None, spine: bool = True,
                        capture=frozenset()) -> BatchDecoder | SeedDecoder:
    """Many requests per target forward, in this process: AR and the chains on the whole target
    (spd.runtime.batch), a pipelined method's sequences sharing its stages (spd.runtime.seed). new_drafter() makes
    each request's own drafter; capture: layers every request keeps for its observe (AR's trace recorder)."""
    if kind == PIPELINE:
        return SeedDecoder(staged, new_drafter, eos_ids, width, max_batch, children, spine)
    if kind == AR:
        return BatchDecoder(staged, eos_ids, max_batch=max_batch, capture=capture)
    return BatchDecoder(staged, eos_ids, new_drafter, draft_length, width, tree_nodes if width > 1 else None,
                        max_batch, capture)


def pick_decoder(method: str, cfg, session: Session, stages, drafter) -> Decoder:
    """The decoder for `method` over this session's stages (AR where the method drafts nothing)."""
    s, spec = session, session.spec
    tree, kind = spec.tree, METHODS[method].decoder
    if runtime(spec.runtime.name).device_step and kind == PIPELINE:
        lookup = (spec.lookup.min_ngram, spec.lookup.max_ngram) if spec.draft_source == LOOKUP_MODULE else None
        return DevicePipelineDecoder(s.staged, s.module, s.eos_ids, "inductor" if spec.runtime.compile else None,
                                     spec.runtime.cuda_graphs, lookup)
    if runtime(spec.runtime.name).device_step:     # the config check let only methods with a device step through
        inside = METHODS[method].device_drafter
        inside = check_contract(s.build(inside)) if inside else None
        return DeviceChainDecoder(s.staged, s.eos_ids, drafter if kind == CHAIN and inside is None else None,
                                  spec.draft_length or 1, "inductor" if spec.runtime.compile else None,
                                  spec.runtime.cuda_graphs, width=tree.width,
                                  budget=tree.nodes if tree.width > 1 else None, device_drafter=inside)
    if kind == AR and eager_reference(spec.runtime):
        stages = None            # the plain loop; elsewhere AR relays through the same fixed-shape or remote steps
    return build_decoder(kind, s.staged, s.eos_ids, drafter, stages=stages, width=tree.width,
                         draft_length=spec.draft_length, tree_nodes=tree.nodes, children=tree.children,
                         spine=METHODS[method].spine, segment=tree.segment)


class Engine:
    """What one configured command decodes with, reused across prompts (chat turns, eval prompts, server
    requests) so the stage processes start once. default: no key chose the method (spd.fastest's for this
    device; the stats line says so)."""

    def __init__(self, cfg, session: Session, stages, drafter, default: bool = False):
        self.cfg, self.session, self.stages, self.drafter = cfg, session, stages, drafter
        self.default = default
        self.decoder = pick_decoder(session.spec.method, cfg, session, stages, drafter)
        self._baseline: Decoder | None = None

    @property
    def baseline(self) -> Decoder:
        """Plain AR over the same stages: the reference eval checks every greedy sample against."""
        if self._baseline is None:
            self._baseline = self.decoder if METHODS[self.session.spec.method].decoder == AR else \
                pick_decoder("ar", self.cfg, self.session, self.stages, None)
        return self._baseline

    def batch_decoder(self, max_batch: int, method: str | None = None) -> BatchDecoder | SeedDecoder | None:
        """Many requests decoded together with this engine's method (or `method`, e.g. "ar" for a server's
        per-request baseline): in this process, or a pipelined method's sequences in the stage processes
        (runtime=distributed); None where the stages run as fixed-shape steps (streams, cuda_graphs) or AR would
        relay through stage processes (one request at a time there)."""
        s, tree = self.session, self.session.spec.tree
        method = method or s.spec.method
        kind = METHODS[method].decoder
        new_drafter = None if kind == AR else s.drafter
        if kind == SEGMENTS:
            return None             # FlowSpec's segments decode one request at a time
        if runtime(s.spec.runtime.name).processes and kind == PIPELINE:
            return SeedDecoder(self.stages, new_drafter, s.eos_ids, tree.width, max_batch, tree.children,
                               METHODS[method].spine)
        if not eager_reference(s.spec.runtime):
            return None
        return build_batch_decoder(kind, s.staged, s.eos_ids, new_drafter, max_batch=max_batch, width=tree.width,
                                   draft_length=s.spec.draft_length, tree_nodes=tree.nodes, children=tree.children,
                                   spine=METHODS[method].spine)

    def request(self, max_new_tokens: int | None = None, params: SamplingParams | None = None,
                seed: int | None = None) -> Request:
        """A request with the configuration's values where the caller gives none."""
        spec = self.session.spec
        return Request(spec.max_new_tokens if max_new_tokens is None else max_new_tokens,
                       self.session.params if params is None else params, spec.sampling.seed if seed is None else seed)

    def stream(self, prompt_ids: list[int], request: Request | None = None) -> Iterator[int]:
        return self.decoder.stream(prompt_ids, request or self.request())

    def run(self, prompt_ids: list[int], request: Request | None = None, on_token=None) -> dict:
        """Decode to the end; the record `json=true` prints and the stats line reads."""
        return self.record(prompt_ids, self.decoder.generate(prompt_ids, request or self.request(), on_token))

    def record(self, prompt_ids: list[int], result: GenerationResult) -> dict:
        s, spec = self.session, self.session.spec
        tree, method = spec.tree, METHODS[spec.method]
        stats = result.stats.as_dict() if result.stats else {"N": len(result.token_ids), "K": None, "alpha": None,
                                                              "eal": None, "rollbacks": None}
        return {"text": s.loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True),
                "token_ids": result.token_ids, "prompt_token_ids": prompt_ids, "method": spec.method,
                "draft_source": spec.draft_source if method.sources else None,
                "segment": tree.segment if method.decoder == SEGMENTS else None,
                "draft_layers": s.draft_model.layers if s.draft_model else None,
                "children": (tree.children or tree.width) if method.decoder == PIPELINE and tree.width > 1 else None,
                "W": tree.width,
                "tree_nodes": tree.nodes if tree.width > 1 or method.decoder == SEGMENTS else None,
                "runtime": spec.runtime.name,
                "processes": getattr(self.stages, "world", 1), "n": s.staged.n, "stage_bounds": s.staged.bounds,
                "balance": s.caches.balance, "datastore": spec.suffix.datastore if s.caches.retrieval else None,
                "checkpoint": spec.module.checkpoint, "dtype": spec.runtime.dtype, **stats, "seconds": result.seconds,
                "tokens_per_s": result.tokens_per_s,
                "default": self.default}


@contextmanager
def open_engine(cfg, default: bool = False, session: Session | None = None):
    """The session (opened here unless given) and its stages (stage processes for runtime=distributed), closed
    on exit."""
    session = session or open_session(cfg)
    report_balance(session)
    spec = session.spec
    drafter = session.drafter() if METHODS[spec.method].decoder != AR else None
    capture = drafter.layers_needed(session.staged.bounds) if drafter else []
    # the control rows carry a flight of n * width nodes: FlowSpec's, S a stage and as many verified in one walk
    segments = METHODS[spec.method].decoder == SEGMENTS
    with open_stages(session.staged, spec.runtime, capture, session.caches.cache_dir,
                     2 * spec.tree.segment if segments else spec.tree.width, sequences_together(cfg)) as stages:
        yield Engine(cfg, session, stages, drafter, default)


def report_balance(session: Session) -> None:
    if session.caches.balance:
        b = session.caches.balance
        print(f"[spd] stage_bounds=balanced -> {b['stage_bounds']}: stage times "
              f"{', '.join(f'{t * 1e3:.2f}' for t in b['stage_s'])} ms (even split: "
              f"{', '.join(f'{t * 1e3:.2f}' for t in b['even_stage_s'])} ms), predicted step "
              f"{b['predicted_step_s'] * 1e3:.2f} ms at {b['threads']} thread(s)", file=sys.stderr)
