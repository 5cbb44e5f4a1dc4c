"""float32 products on a CPU from weights packed once into panels, for the few rows a drafted forward carries.

On these CPUs MKL's `F.linear` steps at 4 rows: SmolLM2's products cost 1.8x their one-row time at 4 rows and stay
above it to 15 (docs/speed-cpu.md, "The forward's row costs"), so a draft tree of 4..15 rows paid most of a second
forward and the pricing kept drafts small. The kernel in spd/csrc/panel_linear.cpp streams each weight once per call
and multiplies every row against it while it is in registers: the products cost their weight's memory time up to
~12 rows. Every output element is the same sequence of operations whatever the row count, so a row's products do
not depend on the rows beside it (checked for the target's shapes when it loads, as spd.targets.invariant_attention
checks bfloat16's products; float32 attention stays SDPA's, as before).

The kernel is compiled for this CPU the first time a process needs it (torch.utils.cpp_extension, about half a minute;
kept where torch keeps the extensions it builds, by its source, this CPU and torch's version) and imported from there
afterwards. Where it cannot be built (no compiler), targets keep `F.linear` and say so once. Like spd.targets.prepacked, a Linear keeps its weight
(the state dict, an embedding tied to the head and the weight cache read it) and its panels are packed again after an
in-place change of the weight; autograd, other dtypes and devices take `F.linear`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from spd.targets.linears import SwappedLinear

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "panel_linear.cpp"
PLAIN_ENV = "SPD_PLAIN_PRODUCTS"     # set to 1: float32 targets keep F.linear (for comparisons)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


NAME = "spd_panel_linear"


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's (a dependency) sits beside the venv's python, which a
    process started as .venv/bin/python does not have on PATH."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.lru_cache(maxsize=None)
def source_key() -> str:
    """The kernel's source digest: a row-cost profile measured with another version is measured again."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled kernel module, or None where it cannot be built here (warned once)."""
    key = hashlib.sha256(f"{source_key()} {_cpu_flags()} {torch.__version__}".encode()).hexdigest()[:16]
    build = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / \
        f"{NAME}-{key}"
    built = build / f"{NAME}.so"
    if built.exists() and not (build / "lock").exists():     # built: import it (cpp_extension's check costs ~3 s)
        return _import(built)
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        build.mkdir(parents=True, exist_ok=True)
        print(f"building the float32 product kernel for this CPU (once, ~30 s) in {build}", file=sys.stderr)
        return load(name=NAME, sources=[str(SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a missing compiler, ninja or header: the plain products still decode exactly as before
        warnings.warn(f"float32 CPU products keep F.linear: the panel kernel could not be built here "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", stacklevel=2)
        return None


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and os.environ.get(PLAIN_ENV, "") in ("", "0")


_EXT = None       # the kernel module once a weight has been packed with it


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels [ceil(N / lanes), K, lanes]."""
    global _EXT
    _EXT = extension()
    return _EXT.pack(weight.detach().contiguous())


def product(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times the packed weight [n_out, K]^T (+ bias) -> [..., n_out]."""
    return extension().linear(x, panels, n_out, bias)


def _usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.requires_grad


def panels_of(module: torch.nn.Linear) -> torch.Tensor | None:
    """The module's panels, packed again if its weight changed since; None where they cannot be used."""
    weight = module.weight
    if not _usable(weight):
        return None
    held = module.__dict__.get("_panels")
    if held is None or held[0] is not weight or held[1] != weight._version:
        held = weight, weight._version, pack(weight)
        module.__dict__["_panels"] = held      # beside the parameters: no state dict entry
    return held[2]


class PanelLinear(SwappedLinear):
    """An nn.Linear (its class swapped in place) that multiplies float32 rows from its weight's panels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this ~200 times: the held panels are checked inline, the rest only when they are stale
        weight, held = self.weight, self.__dict__.get("_panels")
        if held is None or held[0] is not weight or held[1] != weight._version:
            held = (None, None, panels_of(self))
        panels = held[2]
        if panels is None or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, weight, self.bias)
        return _EXT.linear(x, panels, weight.shape[0], self.bias)


def use_panels(model: torch.nn.Module) -> None:
    """Every Linear of `model` multiplies from panels (packed now where the weight is held here: a pipeline stage's
    process holds only its own layers)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module) in (torch.nn.Linear, PanelLinear):
            module.__class__ = PanelLinear
            panels_of(module)


@functools.lru_cache(maxsize=None)
def panels_invariant(shapes: tuple[tuple[int, int], ...], rows: int = 17) -> bool:
    """Whether the kernel is built here and gives a row the same bits in a call of 1 row as of 2..`rows`, for these
    (in, out) shapes (inputs that make a sum's order visible, as invariant_attention.products_invariant)."""
    from spd.targets.invariant_attention import same_bits_at_every_row_count

    if extension() is None:
        return False

    def product_for(d_in: int, d_out: int):
        panels = pack(torch.ones(d_out, d_in))
        return lambda x, w: product(x.float(), panels, d_out, None)

    return all(same_bits_at_every_row_count(i, o, product_for(i, o), rows) for i, o in shapes)
