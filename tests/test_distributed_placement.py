"""Where runtime=distributed's processes run and what their hand-offs travel as (spd.runtime.distributed.placement),
checked on a CPU: the CUDA answers are pure functions of the device, the dtype, the GPU count and the environment.
And the one ordering NCCL adds to gloo's: the controller sends rank 1 its rows before it expects rank 1's payload,
since over NCCL the two directions between a pair of ranks share one stream."""

import pytest
import torch

from helpers import controller_parts
from spd.runtime.distributed import comm, controller, launch
from spd.runtime.distributed.placement import HOST, Wire, backend, gpus_apart, on_wire, stage_device
from spd.runtime.distributed.protocol import TAG_HIDDEN, TAG_PAYLOAD, Setup
from spd.runtime.schedule import spd_step

BF16, F32 = torch.bfloat16, torch.float32


def test_a_stage_process_takes_its_local_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert stage_device("cuda", stage=2, count=8) == torch.device("cuda", 3)
    assert stage_device("cuda", stage=2, count=2) == torch.device("cuda", 1)   # fewer GPUs than processes: shared
    assert stage_device("cuda", stage=2, count=1) == torch.device("cuda", 0)
    assert stage_device("cpu", stage=2, count=8) == HOST


def test_without_a_local_rank_the_stages_take_the_gpus_in_turn(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert stage_device("cuda", stage=2, count=8) == torch.device("cuda", 2)
    assert stage_device("cuda", stage=5, count=4) == torch.device("cuda", 1)
    assert stage_device("cuda", stage=5, count=1) == torch.device("cuda")    # one GPU: the run's own device
    assert stage_device("cpu", stage=5, count=4) == HOST
    assert stage_device("cuda", stage=1, env={"LOCAL_RANK": "4"}, count=8) == torch.device("cuda", 4)


def test_hand_offs_go_gpu_to_gpu_only_with_a_gpu_per_process():
    assert gpus_apart("cuda", processes=6, count=6)
    assert gpus_apart("cuda:0", processes=3, count=8)
    assert not gpus_apart("cuda", processes=6, count=5)    # NCCL refuses two ranks on one GPU
    assert not gpus_apart("cuda:1", processes=3, count=8)  # the controller's GPU would be a stage's too
    assert not gpus_apart("cpu", processes=2, count=8)
    assert backend(True) == "cpu:gloo,cuda:nccl"
    assert backend(False) == "gloo"


def test_what_goes_on_the_wire():
    gpu = torch.device("cuda", 1)
    assert on_wire(gpu, BF16, gpus=True) == Wire(gpu, BF16)            # GPU to GPU in the target's dtype
    assert on_wire(gpu, F32, gpus=True) == Wire(gpu, F32)
    assert on_wire(gpu, BF16, gpus=False) == Wire(HOST, F32)           # GPUs shared: through the host
    assert on_wire(HOST, BF16, gpus=True) == Wire(HOST, F32)
    assert on_wire(HOST, F32, gpus=False) == Wire(HOST, F32)
    rows = torch.randn(1, 3, 8).to(BF16)
    sent = rows.to(*on_wire(HOST, BF16, gpus=False))
    assert sent.dtype == F32 and torch.equal(sent.to(BF16), rows)      # widening to float32 loses nothing


def test_the_setup_says_whether_the_hand_offs_go_gpu_to_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch._gpu_hand_offs("cuda", None, world=4)                # spawned here: 4 processes, 4 GPUs
    assert not launch._gpu_hand_offs("cuda", None, world=5)
    assert not launch._gpu_hand_offs("cpu", None, world=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")                        # under torchrun: this node's processes
    monkeypatch.setattr(launch.dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    assert launch._gpu_hand_offs("cuda", 8, world=8)
    monkeypatch.setattr(launch.dist, "get_backend", lambda: "gloo")
    assert not launch._gpu_hand_offs("cuda", 8, world=8)               # the group has no NCCL


@pytest.mark.parametrize("hosted", [False, True])
def test_rank_1_gets_its_rows_before_its_payload_is_expected(monkeypatch, hosted):
    """What the controller posts in one step, in order, with the messages recorded instead of sent."""
    events = []

    class Pending:
        def __init__(self, size, dtype, src, tag, what, device=HOST, **info):
            events.append(("expect", src, tag))

    monkeypatch.setattr(controller.dist, "broadcast_object_list", lambda *args, **kwargs: None)
    monkeypatch.setattr(comm, "recv", lambda *args, **kwargs: None)
    monkeypatch.setattr(comm, "wait", lambda *args, **kwargs: None)
    monkeypatch.setattr(comm, "send", lambda tensor, dst, tag, wire=None: events.append(("send", dst, tag)))
    monkeypatch.setattr(comm, "Pending", Pending)
    n = 2
    parts, cache = controller_parts("tiny-llama", n)
    setup = Setup(cache_dir=cache, n=n, bounds=parts.bounds, capture=[parts.bounds[1]], hosted=hosted)
    stages = controller.DistributedStages(parts, setup)
    stages.solo.capture_on = True
    stages.launch(spd_step(1, 2, n), torch.zeros(1, 1, parts.config.hidden_size), probe=True)
    rows = events.index(("send", 1, TAG_HIDDEN))
    assert rows < events.index(("expect", 1, TAG_PAYLOAD))
    if not hosted:   # rank 2's payload shares no stream with the rows: its receive is posted first, as on gloo
        assert events.index(("expect", 2, TAG_PAYLOAD)) < rows
    assert [s for s, *_ in stages.waiting] == sorted(s for s, *_ in stages.waiting)
