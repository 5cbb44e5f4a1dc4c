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


def pytest_generate_tests(metafunc):
    """family_model runs every tiny family, the hybrid (Qwen3.5) among them."""
    if "family_model" in metafunc.fixturenames:
        metafunc.parametrize("family_model", FAMILIES, indirect=True, scope="session")


@pytest.fixture(scope="session")
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


def _machine_line() -> str:
    from spd.targets import panel

    bf16 = "oneDNN's" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch's own (no oneDNN bfloat16 here)"
    levels = ", ".join(panel.levels()) or "none (the kernel cannot be built here)"
    return f"cpu: {torch.backends.cpu.get_cpu_capability()}; float32 panel levels proved: {levels}; bfloat16 products: {bf16}"


def pytest_report_header(config):
    """The CPU's ISA level and the kernel levels this run proves (tests/test_panel.py runs each of them), so a log says
    which machine's exactness it shows."""
    return _machine_line()


def pytest_terminal_summary(terminalreporter):
    """The same line at the end, which `-q` (the README's command) shows where it hides the header."""
    terminalreporter.write_line(_machine_line())
