"""The engine: one configured decoder, kept warm (target, module, stage processes), that every consumer reads —
`spd-infer generate`, `chat`, `eval` and `serve`. It picks the decoder once, from the session's method and the
runtime, and hands out its stream of verified tokens; each request brings its own length, sampling and seed."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from spd.runtime.ar import ARDecoder
from spd.decoding import Decoder, GenerationResult, Request
from spd.drafters.base import check_contract
from spd.decoders import STAGES, Where, row_for
from spd.methods import AR, METHODS, PIPELINE, SEGMENTS, Method
from spd.runtimes import runtime
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


@dataclass
class Parts:
    """What any decoder of the table (spd.decoders.DECODERS) is built from; each builder reads what its class takes.
    stages: the run's executor (None: `staged` itself, stage after stage). drafter: one request's; new_drafter: a
    fresh one for each request of a batch; device_drafter: the method's drafter inside the device step, made when a
    device decoder is built (None where it drafts on the host)."""
    staged: StagedTarget
    eos_ids: frozenset[int]
    stages: StageExecutor | None = None
    drafter: object = None
    new_drafter: Callable | None = None
    device_drafter: Callable[[], object] = lambda: None
    width: int = 1
    draft_length: int | None = None
    tree_nodes: int | None = None
    children: int | None = None
    spine: bool = True
    segment: int = 4
    capture: frozenset = frozenset()
    observe: Callable | None = None
    max_batch: int = 1
    compile: str | None = None          # the device step's torch.compile backend (None: eager)
    cuda_graphs: bool = False

    @property
    def budget(self) -> int | None:
        """A chain's drafted nodes a cycle: a tree's node budget (W > 1), else its depth decides."""
        return self.tree_nodes if self.width > 1 else None


def device_chain(over, p: Parts) -> DeviceChainDecoder:
    inside = p.device_drafter()
    return DeviceChainDecoder(over, p.eos_ids, None if inside is not None else p.drafter, p.draft_length or 1,
                              p.compile, p.cuda_graphs, width=p.width, budget=p.budget, device_drafter=inside)


# how each decoder the table names is built, over the staged target or the run's executor (`over`)
BUILDERS: dict[str, Callable[..., Decoder]] = {cls.__name__: build for cls, build in (
    (ARDecoder, lambda over, p: ARDecoder(over, p.eos_ids, p.capture, p.observe)),
    (PipelineARDecoder, lambda over, p: PipelineARDecoder(over, p.eos_ids)),
    (DeviceChainDecoder, device_chain),
    (ChainDecoder, lambda over, p: ChainDecoder(over, p.drafter, p.eos_ids, p.draft_length, p.width, p.budget)),
    (DevicePipelineDecoder, lambda over, p: DevicePipelineDecoder(over, p.device_drafter(), p.eos_ids, p.compile,
                                                                  p.cuda_graphs)),
    (PipelineDecoder, lambda over, p: PipelineDecoder(over, p.drafter, p.eos_ids, p.width, p.children, p.spine)),
    (SegmentPipelineDecoder, lambda over, p: SegmentPipelineDecoder(over, p.drafter, p.eos_ids, p.segment,
                                                                    p.draft_length, p.width, p.tree_nodes)),
    (BatchDecoder, lambda over, p: BatchDecoder(over, p.eos_ids, max_batch=p.max_batch, capture=p.capture)
        if p.new_drafter is None else       # plain AR: no draft rows, whatever the session's tree
        BatchDecoder(over, p.eos_ids, p.new_drafter, p.draft_length, p.width, p.budget, p.max_batch, p.capture)),
    (SeedDecoder, lambda over, p: SeedDecoder(over, p.new_drafter, p.eos_ids, p.width, p.max_batch, p.children,
                                              p.spine)),
)}


def decoder_for(kind: str, where: Where, parts: Parts, batch: bool = False, method: Method | None = None):
    """The one place a decoder is chosen: the first row of spd.decoders.DECODERS for `kind` on `where` (one request,
    or many sharing each forward), built from `parts`. None for a batch where no row shares a forward (one request at
    a time there); a single request with no row is a bug of the caller (the config refused it, spd.decoders.refusal)."""
    row = row_for(kind, where, batch, method)
    if row is None:
        if batch:
            return None
        raise ValueError(f"no decoder for kind={kind} on {where} (spd.decoders.DECODERS)")
    over = parts.stages if row.over == STAGES and parts.stages is not None else parts.staged
    return BUILDERS[row.decoder](over, parts)


# the library's calls, without a runtime: stages=None is the eager reference, an executor any stages'
LIBRARY = {True: Where(reference=True, chains=True), False: Where(chains=True)}


def build_decoder(kind: str, staged: StagedTarget, eos_ids: frozenset[int], drafter=None, *,
                  stages: StageExecutor | None = None, width: int = 1, draft_length: int | None = None,
                  tree_nodes: int | None = None, children: int | None = None, spine: bool = True, segment: int = 4,
                  capture=frozenset(), observe=None) -> Decoder:
    """A decoder of the table for a library caller (the trainer's evals, the cost calibration, the trace recorder,
    the benchmarks). kind: a method's decoding kind (spd.methods: PIPELINE, SEGMENTS, CHAIN, AR). stages: the
    executor a pipeline runs on (None: `staged` in this process, stage after stage); for AR, stages given means AR
    relayed through them (fixed-shape steps, stage processes), None the plain eager loop, whose `capture` /
    `observe` record a greedy trace (spd.eval.fast). A chain verifies on `staged` whole: draft_length drafts a
    cycle, or a tree of tree_nodes nodes of up to `width` children each. A pipeline keeps `width` nodes a level from
    `children` candidates per tip (None: width) by the `spine` rule (spd.runtime.pipeline.grow); FlowSpec's
    (SEGMENTS) sends its trees of depth draft_length, `width` children a node and tree_nodes nodes through the
    stages `segment` nodes a step."""
    return decoder_for(kind, LIBRARY[stages is None], Parts(staged, eos_ids, stages, drafter, width=width,
                                                            draft_length=draft_length, tree_nodes=tree_nodes,
                                                            children=children, spine=spine, segment=segment,
                                                            capture=capture, observe=observe))


def build_batch_decoder(kind: str, staged: StagedTarget, eos_ids: frozenset[int], new_drafter=None, *,
                        max_batch: int, width: int = 1, draft_length: int | None = None,
                        tree_nodes: int | None = None, children: int | None = None, spine: bool = True,
                        capture=frozenset()) -> BatchDecoder | SeedDecoder | None:
    """Many requests per target forward, in this process: AR and the chains on the whole target
    (spd.runtime.batch), a pipelined method's sequences sharing its stages (spd.runtime.seed). new_drafter() makes
    each request's own drafter; capture: layers every request keeps for its observe (AR's trace recorder)."""
    return decoder_for(kind, LIBRARY[True], Parts(staged, eos_ids, new_drafter=new_drafter, width=width,
                                                  draft_length=draft_length, tree_nodes=tree_nodes, children=children,
                                                  spine=spine, capture=capture, max_batch=max_batch), batch=True)


def session_parts(method: str, session: Session, stages, drafter=None, **more) -> Parts:
    """The session's parts for `method`'s decoder: its target, executor, tree and runtime options."""
    spec, tree, m = session.spec, session.spec.tree, METHODS[method]
    return Parts(session.staged, session.eos_ids, stages, drafter,
                 device_drafter=lambda: check_contract(session.build(m.device_drafter)) if m.device_drafter else None,
                 width=tree.width, draft_length=spec.draft_length, tree_nodes=tree.nodes, children=tree.children,
                 spine=m.spine, segment=tree.segment, compile="inductor" if spec.runtime.compile else None,
                 cuda_graphs=spec.runtime.cuda_graphs, **more)


def where(session: Session) -> Where:
    options = session.spec.runtime
    return Where.of(runtime(options.name), options.cuda_graphs)


def pick_decoder(method: str, session: Session, stages, drafter) -> Decoder:
    """The decoder for `method` over this session's stages (AR where the method drafts nothing)."""
    return decoder_for(METHODS[method].decoder, where(session), session_parts(method, session, stages, drafter),
                       method=METHODS[method])


class Engine:
    """What one configured command decodes with, reused across prompts (chat turns, eval prompts, server
    requests) so the stage processes start once. default: no key chose the method (spd.fastest's for this
    device; the stats line says so)."""

    def __init__(self, cfg, session: Session, stages, drafter, default: bool = False):
        self.cfg, self.session, self.stages, self.drafter = cfg, session, stages, drafter
        self.default = default
        self.decoder = pick_decoder(session.spec.method, session, stages, drafter)
        self._baseline: Decoder | None = None

    @property
    def baseline(self) -> Decoder:
        """Plain AR over the same stages: the reference eval checks every greedy sample against."""
        if self._baseline is None:
            self._baseline = self.decoder if METHODS[self.session.spec.method].decoder == AR else \
                pick_decoder("ar", self.session, self.stages, None)
        return self._baseline

    def batch_decoder(self, max_batch: int, method: str | None = None) -> BatchDecoder | SeedDecoder | None:
        """Many requests decoded together with this engine's method (or `method`, e.g. "ar" for a server's
        per-request baseline): in this process, or a pipelined method's sequences in the stage processes
        (runtime=distributed); None where the stages run as fixed-shape steps (streams, cuda_graphs) or AR would
        relay through stage processes (one request at a time there)."""
        s = self.session
        m = METHODS[method or s.spec.method]
        parts = session_parts(m.name, s, self.stages, new_drafter=None if m.drafter is None else s.drafter,
                              max_batch=max_batch)
        return decoder_for(m.decoder, where(s), parts, batch=True, method=m)

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
                "tokens_per_s": result.tokens_per_s, "decode_seconds": result.decode_seconds,
                "decode_tokens_per_s": result.decode_tokens_per_s, "weights": s.staged.weights,
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
