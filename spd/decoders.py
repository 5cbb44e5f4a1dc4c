"""Which decoder runs: every pairing of a method's decoding kind with what a runtime can do, for one request or many
sharing a forward, once (`DECODERS`). The engine builds a run's decoder from the first row that fits
(spd.engine.decoder_for, the one reader); the config refuses a method on a runtime where no row fits, in one line,
before any model loads (`refusal`), with the rows themselves saying what would run instead.

Torch-free, beside the methods (spd.methods) and the runtimes (spd.runtimes): a row names its decoder class by its
class name, which spd.engine builds (tests/test_decoders.py checks each name against the class built)."""

from __future__ import annotations

from dataclasses import dataclass

from spd.methods import AR, CHAIN, LOOKUP_MODULE, METHODS, MODULE, PIPELINE, SEGMENTS, Method
from spd.runtimes import RUNTIMES, Runtime


@dataclass(frozen=True)
class Where:
    """What a decoder would run on: a runtime's capabilities (spd.runtimes.Runtime), with the run's cuda_graphs=
    (the eager reference is a reference runtime without graphs)."""
    device_step: bool = False
    reference: bool = False
    chains: bool = False
    processes: bool = False

    @classmethod
    def of(cls, rt: Runtime, cuda_graphs: bool = False) -> "Where":
        return cls(rt.device_step, rt.reference and not cuda_graphs, rt.chains, rt.processes)


# A row's runtime column: the runtimes it takes, by what they can do. Exclusive of the device step where a kind
# has a row for it, so the row order says nothing a reader must know.
ON = {
    "device step": lambda w: w.device_step,
    "eager reference": lambda w: w.reference and not w.device_step,
    "the whole target": lambda w: w.chains and not w.device_step,
    "stage processes": lambda w: w.processes,
    "any stages": lambda w: not w.device_step,
}

TARGET, STAGES = "target", "stages"    # what a decoder runs over: the staged target here, or the run's executor

# what each kind does, where a runtime runs none of it
DOES = {CHAIN: "drafts and verifies in one process (no pipeline)",
        PIPELINE: "drafts beside the pipeline's stages",
        SEGMENTS: "sends its draft tree through the pipeline's stages in segments",
        AR: "decodes a token a step"}
NEEDS = {"device_step": "device step"}       # a row's method flag, in a refusal's words


@dataclass(frozen=True)
class Row:
    kind: str                            # the method's decoding kind (spd.methods: PIPELINE, SEGMENTS, CHAIN, AR)
    on: str                              # an ON key: the runtimes it takes
    decoder: str                         # its class's name (spd.engine builds it)
    over: str = TARGET                   # TARGET or STAGES
    batch: bool = False                  # many requests share each forward or step
    needs: str | None = None             # a Method flag the method must have (its device step)
    trees: str | None = None             # W > 1 only for a method with this Method flag (None: any W)
    sources: tuple[str, ...] | None = None   # the draft sources it takes (None: any the method has)
    graphs: bool = True                  # cuda_graphs=true is taken (False: the decoder runs eagerly)
    priced_lookup: bool = True           # draft_source=lookup+module with source_pricing=true is taken


DECODERS: tuple[Row, ...] = (
    Row(AR, "device step", "DeviceChainDecoder", needs="device_step"),
    Row(AR, "eager reference", "ARDecoder"),
    Row(AR, "any stages", "PipelineARDecoder", STAGES),
    Row(CHAIN, "device step", "DeviceChainDecoder", needs="device_step", trees="device_trees", sources=(MODULE,)),
    Row(CHAIN, "the whole target", "ChainDecoder", graphs=False),
    Row(PIPELINE, "device step", "DevicePipelineDecoder", needs="device_step", trees="device_trees",
        sources=(MODULE, LOOKUP_MODULE), priced_lookup=False),
    Row(PIPELINE, "any stages", "PipelineDecoder", STAGES),
    Row(SEGMENTS, "any stages", "SegmentPipelineDecoder", STAGES),
    Row(AR, "eager reference", "BatchDecoder", batch=True),
    Row(CHAIN, "eager reference", "BatchDecoder", batch=True),
    Row(PIPELINE, "stage processes", "SeedDecoder", STAGES, batch=True),
    Row(PIPELINE, "eager reference", "SeedDecoder", batch=True),
)


def row_for(kind: str, where: Where, batch: bool = False, method: Method | None = None) -> Row | None:
    """The row a `kind` decodes with on `where` (for `method`: one whose flag it has), or None."""
    for row in DECODERS:
        if row.kind == kind and row.batch == batch and ON[row.on](where) and \
                (row.needs is None or method is None or getattr(method, row.needs)):
            return row
    return None


def takes(method: Method) -> list[str]:
    """The runtimes with a row for one of `method`'s requests."""
    return [name for name, rt in RUNTIMES.items() if row_for(method.decoder, Where.of(rt), method=method)]


def refusal(method: Method, rt: Runtime, cuda_graphs: bool = False, width: int = 1, draft_source: str | None = None,
            source_pricing: bool = False) -> str | None:
    """Why `method` cannot decode one request on `rt` with these keys, in one line; None where a row takes it."""
    where = Where.of(rt, cuda_graphs)
    reference = " or ".join(f"runtime={name}" for name, r in RUNTIMES.items() if r.reference)
    row = row_for(method.decoder, where, method=method)
    if row is None:
        kind_here = [r for r in DECODERS if r.kind == method.decoder and not r.batch and ON[r.on](where)]
        if kind_here:       # a row of its kind is here, for methods with a flag it lacks
            here = " or ".join(f"method={m.name}" for m in METHODS.values() if row_for(m.decoder, where, method=m))
            return (f"runtime={rt.name} runs {here}; method={method.name} has no {NEEDS[kind_here[0].needs]}: use "
                    f"one of those, or {reference}")
        return (f"method={method.name} {DOES[method.decoder]}; use "
                f"{' or '.join(f'runtime={name}' for name in takes(method))}, not runtime={rt.name}")
    if cuda_graphs and not row.graphs:
        graphed = " or ".join(f"runtime={name}" for name, r in RUNTIMES.items() if r.graphs and
                              getattr(row_for(method.decoder, Where.of(r, True), method=method), "graphs", False))
        return (f"cuda_graphs=true covers the pipeline's stage steps and AR; method={method.name}'s chain verifies "
                f"m + 1 tokens at once and runs eagerly here: drop cuda_graphs, or use {graphed}")
    if width > 1 and row.trees is not None and not getattr(method, row.trees):
        return (f"runtime={rt.name} verifies method={method.name}'s chains; W={width} asks for trees: use W=1, or "
                f"{reference}")
    if row.sources is not None and method.sources and draft_source not in (None, *row.sources):
        return (f"runtime={rt.name} drafts method={method.name} from draft_source={' or '.join(row.sources)}; drop "
                f"draft_source={draft_source}, or use {reference}")
    if not row.priced_lookup and draft_source == LOOKUP_MODULE and source_pricing:
        return (f"runtime={rt.name} puts the lookup in front of the module wherever it matches; drop source_pricing, "
                f"or use {reference}")
    return None


def markdown() -> str:
    """The table as docs/architecture.md prints it (tests/test_decoders.py keeps the page equal to it)."""
    def flag(name: str | None, none: str) -> str:
        return f"`{name}`" if name else none

    lines = ["| kind | runtime | requests | decoder | over | methods | W > 1 | draft_source | cuda_graphs | "
             "source_pricing |", "|" + " --- |" * 10]
    for row in DECODERS:
        cells = (row.kind, row.on, "many" if row.batch else "one", f"`{row.decoder}`", row.over,
                 flag(row.needs, "all"), flag(row.trees, "yes"), ", ".join(row.sources) if row.sources else "any",
                 "yes" if row.graphs else "no", "yes" if row.priced_lookup else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
