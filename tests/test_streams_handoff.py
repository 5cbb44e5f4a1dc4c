"""runtime=streams' hand-offs between CUDA streams, checked on CPU through stand-in streams.

A tensor a stage makes on its stream and another stream reads (the next stage reads its output, the caller's
stream reads the captured features and the exiting logits) must be `record_stream`-ed to the reader, or the caching
allocator may hand its memory out again while the reader still has work queued on it. On CPU `StreamStages` has no
streams; here it is given stand-ins, and `torch.cuda.stream`, `torch.cuda.current_stream` and
`Tensor.record_stream` are replaced by recorders, so the bookkeeping runs exactly as it would on a GPU while the
arithmetic stays on the CPU. Checked at W = 1 (a chain: node ids are positions) and W = 4 (tree levels: node ids
are not positions, the case that was keyed wrongly)."""

from contextlib import contextmanager

import pytest
import torch

import spd.runtime.executor as executor_module
import spd.runtime.local as local_module
from spd.decoding import Request
from spd.runtime.streams import StreamStages
from spd.verify.sampling import SamplingParams
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

from helpers import ar_run, prompt
from test_pipeline_tree import tree_decoder

CALLER = "caller"


class StandInStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture
def recorded(monkeypatch):
    """{storage: set of streams it was recorded to}, and under "mask_made_on" the stream current whenever a tree
    level's mask tensors were made."""
    records: dict[int, set[str]] = {}
    current = [CALLER]

    @contextmanager
    def stream(s):
        current.append(s.name)
        try:
            yield
        finally:
            current.pop()

    def record_stream(self, s):
        records.setdefault(storage(self), set()).add(s.name if isinstance(s, StandInStream) else s)

    made_on = []

    def level_mask(*args):   # the tree level's mask tensors: made on the stage's stream, which reads them
        made_on.append(current[-1])
        return executor_module.level_mask(*args)

    monkeypatch.setattr(local_module, "level_mask", level_mask)
    records["mask_made_on"] = made_on
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandInStream(CALLER))
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return records


class CheckedStreams(StreamStages):
    """After every launch: each stage's captured features are recorded to the caller's stream, each hidden state
    left for the next stage to that stage's stream, the exiting logits to the caller's."""

    def __init__(self, target, records):
        super().__init__(target, cuda_graphs=False)
        self.streams = [StandInStream(f"stage{s}") for s in range(self.n)]
        self.records, self.checked = records, {"features": 0, "hidden": 0, "tree_rows": 0}

    def launch(self, step, entering, flight=None):
        before = dict(self.hidden)
        super().launch(step, entering, flight)
        for node, layers in self._out.features.items():
            for h in layers.values():
                assert CALLER in self.records.get(storage(h), ()), f"features of node {node} not recorded"
                self.checked["features"] += 1
                self.checked["tree_rows"] += flight is not None and flight.nodes[node].pos != node
        for node, h in self.hidden.items():
            if node in before and before[node] is h:
                continue                               # made by an earlier step
            stage = next(s for s, pos in enumerate(step.work) if step.runs(s) and
                         pos == (node if flight is None else flight.nodes[node].pos))
            assert f"stage{stage + 1}" in self.records.get(storage(h), ()), \
                f"hidden state of node {node} (stage {stage}) not recorded to stage {stage + 1}'s stream"
            self.checked["hidden"] += 1
        if self._out.exit_logits is not None:
            assert CALLER in self.records.get(storage(self._out.exit_logits), ())


@pytest.mark.parametrize("width", [1, 4])
def test_stream_handoffs_are_recorded(recorded, width):
    model = tiny_model("llama")
    ids = prompt(3, 10)
    stages = CheckedStreams(StagedTarget(model, 3), recorded)
    out = tree_decoder(model, 3, width, executor=stages).generate(ids, Request(24, SamplingParams()))
    assert out.token_ids == ar_run(model, ids, 24).token_ids
    assert stages.checked["features"] > 0 and stages.checked["hidden"] > 0
    if width > 1:
        assert stages.checked["tree_rows"] > 0      # tree nodes whose id is not their position were checked
        made_on = recorded["mask_made_on"]
        assert made_on and CALLER not in made_on, "a tree level's mask was made on the caller's stream"
