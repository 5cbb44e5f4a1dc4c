"""Which decoder runs is one table (spd.decoders.DECODERS), read by one function (spd.engine.decoder_for): every
(method, runtime) pair either gets its decoder from a row of the table, or is refused in one line by the config
check, before any model loads; the refusals are the table's missing rows."""

import os
from types import SimpleNamespace

import pytest

import spd.engine as engine
from spd.config import GenerateConfig, load_config
from spd.decoders import DECODERS, Where, markdown, refusal, row_for
from spd.errors import UserError
from spd.methods import METHODS
from spd.runtimes import RUNTIMES
from spd.spec import DecodeSpec

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "architecture.md")
PAIRS = [(method, rt) for method in METHODS for rt in RUNTIMES]


def keys(method: str, rt: str, *more: str) -> list[str]:
    device = "device=cuda" if RUNTIMES[rt].cuda else "device=cpu"
    return [f"method={method}", f"runtime={rt}", device, *more]


def fake_session(cfg) -> SimpleNamespace:
    """What decoder_for's parts read of a session, without a model: the spec, and stand-ins for the rest."""
    spec = DecodeSpec.of(cfg)
    return SimpleNamespace(spec=spec, staged="staged", eos_ids=frozenset(), module="module", drafter=lambda: "drafter",
                           build=lambda factory: pytest.fail("a device drafter is built only by a device decoder"))


@pytest.fixture
def built(monkeypatch):
    """Every builder replaced by a recorder: decoder_for returns (the row's decoder, what it runs over)."""
    for name in list(engine.BUILDERS):
        monkeypatch.setitem(engine.BUILDERS, name, lambda over, parts, name=name: (name, over))


@pytest.mark.parametrize("method,rt", PAIRS)
def test_every_pair_builds_from_the_table_or_is_refused_in_one_line(built, method, rt):
    """Refused: by the config, a one-line UserError (no model loaded, no session); else the engine's one function
    builds the first row of the table for the pair, one request (and many where a row shares a forward)."""
    try:
        cfg = load_config(GenerateConfig, None, keys(method, rt))
    except UserError as refused:
        message = str(refused)
        assert "\n" not in message and (f"method={method}" in message or f"runtime={rt}" in message), message
        assert row_for(METHODS[method].decoder, Where.of(RUNTIMES[rt]), method=METHODS[method]) is None
        return
    m, where = METHODS[method], Where.of(RUNTIMES[rt])
    row = row_for(m.decoder, where, method=m)
    assert row is not None and refusal(m, RUNTIMES[rt]) is None
    session = fake_session(cfg)
    assert engine.pick_decoder(method, session, "stages", None) == (row.decoder, "stages" if row.over == "stages"
                                                                    else "staged")
    engine_ = SimpleNamespace(session=session, stages="stages")
    batch = row_for(m.decoder, where, batch=True, method=m)
    assert engine.Engine.batch_decoder(engine_, 4) == (batch and (batch.decoder, "stages" if batch.over == "stages"
                                                                  else "staged"))


@pytest.mark.parametrize("method,rt,more,single,batch", [
    ("spd", "local", [], "PipelineDecoder", "SeedDecoder"),
    ("spd", "distributed", [], "PipelineDecoder", "SeedDecoder"),
    ("spd", "device", [], "DevicePipelineDecoder", None),
    ("pipedec", "local", [], "PipelineDecoder", "SeedDecoder"),
    ("flowspec", "distributed", [], "SegmentPipelineDecoder", None),
    ("lookup", "local", [], "ChainDecoder", "BatchDecoder"),
    ("eagle3", "device", ["W=4"], "DeviceChainDecoder", None),
    ("ar", "local", [], "ARDecoder", "BatchDecoder"),
    ("ar", "local", ["device=cuda", "cuda_graphs=true"], "PipelineARDecoder", None),
    ("ar", "distributed", [], "PipelineARDecoder", None),
    ("ar", "streams", [], "PipelineARDecoder", None),
    ("ar", "device", [], "DeviceChainDecoder", None),
])
def test_the_rows_a_run_gets(built, method, rt, more, single, batch):
    cfg = load_config(GenerateConfig, None, keys(method, rt, *more))
    session = fake_session(cfg)
    assert engine.pick_decoder(method, session, "stages", None)[0] == single
    found = engine.Engine.batch_decoder(SimpleNamespace(session=session, stages="stages"), 4)
    assert (found and found[0]) == batch


@pytest.mark.parametrize("method,rt,more,needle", [
    ("lookup", "distributed", [], "method=lookup drafts and verifies in one process (no pipeline); use runtime=local "
                                  "or runtime=device, not runtime=distributed"),
    ("lookup", "streams", [], "method=lookup drafts and verifies in one process (no pipeline); use runtime=local or "
                              "runtime=device, not runtime=streams"),
    ("flowspec", "device", [], "method=flowspec sends its draft tree through the pipeline's stages in segments; use "
                               "runtime=local or runtime=distributed or runtime=streams, not runtime=device"),
    ("pipedec", "device", [], "runtime=device runs method=spd or method=ppsd or method=spd_output_state or "
                              "method=eagle3 or method=lookup or method=suffix or method=selfdraft or method=ar; "
                              "method=pipedec has no device step: use one of those, or runtime=local"),
    ("suffix", "local", ["device=cuda", "cuda_graphs=true"], "cuda_graphs=true covers the pipeline's stage steps and "
     "AR; method=suffix's chain verifies m + 1 tokens at once and runs eagerly here: drop cuda_graphs, or use "
     "runtime=device"),
])
def test_a_missing_row_is_refused_in_one_line(method, rt, more, needle):
    with pytest.raises(UserError) as refused:
        load_config(GenerateConfig, None, keys(method, rt, *more))
    assert str(refused.value) == needle


def test_every_row_names_a_decoder_the_engine_builds():
    """One builder a decoder class, keyed by the class's own name; no builder the table does not name."""
    assert set(engine.BUILDERS) == {row.decoder for row in DECODERS}
    assert engine.BUILDERS["ChainDecoder"] is not engine.BUILDERS["BatchDecoder"]
    kinds = {row.kind for row in DECODERS}
    assert kinds == {m.decoder for m in METHODS.values()}       # every kind decodes somewhere
    assert all(any(row_for(m.decoder, Where.of(rt), method=m) for rt in RUNTIMES.values()) for m in METHODS.values())


def test_the_library_builds_through_the_same_table():
    """build_decoder / build_batch_decoder (the benchmarks', the trainer's) are the table's rows too."""
    from spd.drafters.lookup import LookupDrafter
    from spd.drafters.reference import ReferenceDrafter
    from spd.methods import AR, CHAIN, PIPELINE, SEGMENTS
    from spd.runtime.ar import ARDecoder
    from spd.runtime.batch import BatchDecoder
    from spd.runtime.chain import ChainDecoder
    from spd.runtime.local import LocalStages
    from spd.runtime.pipeline import PipelineARDecoder, PipelineDecoder
    from spd.runtime.seed import SeedDecoder
    from spd.runtime.segments import SegmentPipelineDecoder
    from spd.targets.stages import StagedTarget
    from spd.targets.tiny import tiny_model

    staged = StagedTarget(tiny_model("llama", seed=0).eval(), 2)
    assert type(engine.build_decoder(AR, staged, frozenset())) is ARDecoder
    assert type(engine.build_decoder(AR, staged, frozenset(), stages=LocalStages(staged))) is PipelineARDecoder
    lookup = LookupDrafter()
    assert type(engine.build_decoder(CHAIN, staged, frozenset(), lookup, draft_length=3)) is ChainDecoder
    oracle = ReferenceDrafter([1, 2, 3], staged.config.vocab_size)
    assert type(engine.build_decoder(PIPELINE, staged, frozenset(), oracle)) is PipelineDecoder
    assert type(engine.build_decoder(SEGMENTS, staged, frozenset(), lookup, draft_length=3)) is SegmentPipelineDecoder
    assert type(engine.build_batch_decoder(AR, staged, frozenset(), max_batch=2)) is BatchDecoder
    assert type(engine.build_batch_decoder(PIPELINE, staged, frozenset(), max_batch=2)) is SeedDecoder
    assert engine.build_batch_decoder(SEGMENTS, staged, frozenset(), max_batch=2) is None


def test_the_architecture_page_prints_the_table():
    with open(DOCS, encoding="utf-8") as f:
        assert markdown() in f.read()
