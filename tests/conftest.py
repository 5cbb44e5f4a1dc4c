import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
if "SPD_CACHE_DIR" not in os.environ:  # weight caches written by tests stay out of ~/.cache, and go at the end
    import atexit
    import shutil
    import tempfile

    os.environ["SPD_CACHE_DIR"] = tempfile.mkdtemp(prefix="spd-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPD_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# pytest-xdist runs one worker per core (pyproject's addopts): the cores are shared out, not oversubscribed
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, min(2, (os.cpu_count() or 1) // _workers)))

from spd.targets.tiny import FAMILIES, tiny_model  # noqa: E402


@pytest.fixture(scope="session", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny Llama saved as an HF directory with a small byte-level BPE tokenizer and a ChatML template."""
    from spd.targets.tiny import save_tiny_target

    path = tmp_path_factory.mktemp("tiny_target")
    save_tiny_target(str(path), "llama", seed=0)
    return str(path)


@pytest.fixture(scope="session")
def untied_target_dir(tmp_path_factory):
    """A tiny Llama whose greedy answers depend on the whole context (untied head), as an HF directory: a cache
    that lost part of the prompt shows in the tokens (the tied tiny targets mostly repeat their last token)."""
    from spd.targets.tiny import save_tiny_target

    path = tmp_path_factory.mktemp("untied_target")
    save_tiny_target(str(path), "llama", seed=0, tied=False)
    return str(path)


# Modules holding the longest tests (30-120 s each on 2 cores) run first. pytest-xdist's worksteal hands each
# worker a contiguous half of the collection and idle workers steal from the end of a queue, so long tests left at
# the end (alphabetical order put test_train, test_stream_chat and test_smollm2 there) leave a worker idle while the
# other finishes them. Modules stay whole, so their module-scoped fixtures are built once.
LONGEST_FIRST = ("test_lossless_sampling.py", "test_smollm2.py", "test_distributed.py", "test_train.py",
                 "test_distributed_cli.py", "test_stream_chat.py", "test_serve.py", "test_bad_input.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))   # stable: order inside a module kept
