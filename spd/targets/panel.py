"""float32 products on a CPU from weights packed once into panels, for the few rows a drafted forward carries.

On these CPUs MKL's `F.linear` steps at 4 rows: SmolLM2's products cost 1.8x their one-row time at 4 rows and stay
above it to 15 (docs/speed-cpu.md, "The forward's row costs"), so a draft tree of 4..15 rows paid most of a second
forward and the pricing kept drafts small. The kernel in spd/csrc/panel_linear.cpp streams each weight once per call
and multiplies every row against it while it is in registers: the products cost their weight's memory time up to
~12 rows. Every output element is the same sequence of operations whatever the row count, so a row's products do
not depend on the rows beside it (float32 attention stays SDPA's, as before).

One build holds three ISA levels — AVX-512, AVX2 + FMA, portable — whose order of operations is written out in the
code (explicit fused multiply-adds, no contraction by the compiler), so the row property holds on every x86 CPU by
construction, not by one compiler's choices for one CPU. A process multiplies at one level: the highest this CPU runs
whose self-check passes (`level_for`: a row's bits at 1..17 rows, for the target's shapes and shapes that reach every
tile and remainder; the verdict cached per machine and build), or the level `SPD_PANEL_LEVEL` names. Where no level
passes, or the kernel cannot be built (no compiler), targets keep `F.linear` and drafted decoding is refused
(spd.targets.stages.StagedTarget.exact_rows).

The kernel is compiled the first time a process needs it (torch.utils.cpp_extension, about half a minute; kept where
torch keeps the extensions it builds, by its source and torch's version) and imported from there afterwards. Like
spd.targets.prepacked, a Linear keeps its weight (the state dict, an embedding tied to the head and the weight cache
read it) and its panels are packed again after an in-place change of the weight; autograd, other dtypes and devices
take `F.linear`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from spd.paths import cache_root
from spd.targets.linears import SwappedLinear

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = CSRC / "panel_linear.cpp"
SOURCES = (SOURCE, CSRC / "llama_layer.cpp", CSRC / "panel_kernel.h", CSRC / "row_ops.h", CSRC / "panel_api.h",
           CSRC / "level_avx512.h")
PLAIN_ENV = "SPD_PLAIN_PRODUCTS"     # set to 1: float32 targets keep F.linear (for comparisons)
LEVEL_ENV = "SPD_PANEL_LEVEL"        # portable | avx2 | avx512: multiply at this level (for comparisons and tests)
LEVELS = ("portable", "avx2", "avx512")     # lowest first; the build's ids are their indices
LANES = {"portable": 8, "avx2": 8, "avx512": 16}   # output features a panel holds at each level
# shapes whose products reach every tile and remainder of every level (up to 17 rows), tails of a panel and of a
# block of inputs included: checked beside the target's own
CHECK_SHAPES = ((37, 100), (64, 8), (130, 33), (576, 40))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
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
    return hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES)).hexdigest()[:12]


def build_key() -> str:
    """One build for every CPU of an architecture: its levels are chosen at run time."""
    return hashlib.sha256(f"{source_key()} {platform.machine()} {torch.__version__}".encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled kernel module, or None where it cannot be built here (warned once)."""
    build = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / \
        f"{NAME}-{build_key()}"
    built = build / f"{NAME}.so"
    if built.exists() and not (build / "lock").exists():     # built: import it (cpp_extension's check costs ~3 s)
        return _import(built)
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        build.mkdir(parents=True, exist_ok=True)
        print(f"building the float32 product kernel (once, ~40 s) in {build}", file=sys.stderr)
        # no -march=native: each level's instructions are named where it is defined, and no multiply-add is fused
        # but where the code says (spd/csrc/panel_kernel.h says why)
        return load(name=NAME, sources=[str(p) for p in SOURCES if p.suffix == ".cpp"], build_directory=str(build),
                    extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a missing compiler, ninja or header: the plain products still decode as before
        warnings.warn(f"float32 CPU products keep F.linear: the panel kernel could not be built here "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", stacklevel=2)
        return None


def levels() -> tuple[str, ...]:
    """The levels this CPU executes, lowest first (none without the kernel)."""
    ext = extension()
    return () if ext is None else tuple(ext.levels())


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and os.environ.get(PLAIN_ENV, "") in ("", "0")


def pack(weight: torch.Tensor, level: str) -> torch.Tensor:
    """weight [N, K] -> panels [ceil(N / lanes), K, lanes] for `level` (16 lanes at avx512, else 8)."""
    return extension().pack(weight.detach().contiguous(), LEVELS.index(level))


def product(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None,
            level: str) -> torch.Tensor:
    """x [..., K] times the packed weight [n_out, K]^T (+ bias) -> [..., n_out], at `level` (the panels' own)."""
    return extension().linear(x, panels, n_out, bias, LEVELS.index(level))


def product_blocks(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None, level: str,
                   bits: int) -> torch.Tensor:
    """x [..., K] times a GGUF weight's blocks packed for `level` (spd.targets.blocks.pack; bits 4 or 8)."""
    return extension().linear_blocks(x, panels, n_out, bias, LEVELS.index(level), bits)


def _usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.requires_grad


def panels_of(module: torch.nn.Linear) -> tuple[torch.Tensor, int, int] | None:
    """The module's panels, level id and bits (0: float32 panels; 4 or 8: a GGUF weight's own blocks,
    spd.targets.blocks), packed again if its weight changed since; None where they cannot be used."""
    weight, level = module.weight, module.__dict__.get("_panel_level")
    from_blocks = "_blocks" in module.__dict__ and weight.device.type == "meta"     # load_parts left it unloaded
    if level is None or not (_usable(weight) or from_blocks):
        return None
    held = module.__dict__.get("_panels")
    if held is None or held[0] is not weight or held[1] != weight._version or held[3] != level:
        quantized = module.__dict__.get("_blocks")
        if quantized is not None and quantized[1] == weight._version:    # blocks of the weight as it was loaded
            from spd.targets.blocks import pack as pack_blocks

            panels, bits = pack_blocks(quantized[0], LANES[level])
        else:
            panels, bits = pack(weight, level), 0
        held = weight, weight._version, panels, level, LEVELS.index(level), bits
        module.__dict__["_panels"] = held      # beside the parameters: no state dict entry
    return held[2], held[4], held[5]


class PanelLinear(SwappedLinear):
    """An nn.Linear (its class swapped in place) that multiplies float32 rows from its weight's panels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this ~200 times: the held panels are checked inline, the rest only when they are stale
        weight, held = self.weight, self.__dict__.get("_panels")
        if held is None or held[0] is not weight or held[1] != weight._version:
            packed = panels_of(self)
        else:
            packed = held[2], held[4], held[5]
        if packed is None or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, weight, self.bias)
        if packed[2]:
            return _EXT.linear_blocks(x, packed[0], weight.shape[0], self.bias, packed[1], packed[2])
        return _EXT.linear(x, packed[0], weight.shape[0], self.bias, packed[1])


_EXT = None       # the kernel module once a model multiplies from panels


def use_panels(model: torch.nn.Module, level: str) -> None:
    """Every Linear of `model` multiplies from panels at `level` (packed now where the weight is held here: a
    pipeline stage's process holds only its own layers)."""
    global _EXT
    _EXT = extension()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module) in (torch.nn.Linear, PanelLinear):
            module.__class__ = PanelLinear
            module.__dict__["_panel_level"] = level
            panels_of(module)


def _verdict_file() -> Path:
    """Where this machine's self-check verdicts for this build are kept."""
    machine = hashlib.sha256(f"{build_key()} {_cpu_flags()}".encode()).hexdigest()[:16]
    return Path(cache_root()) / "panel_checks" / f"{machine}.json"


def _ones_blocks(d_out: int, d_in: int, bits: int) -> dict[str, torch.Tensor]:
    # a weight of ones as GGUF blocks (q = 1, d = 1, m = 0), in spd.targets.blocks' layout
    groups = d_in // 32
    ones = {"d": torch.ones(d_out, groups)}
    if bits == 8:
        return ones | {"q8": torch.ones(d_out, groups, 32, dtype=torch.int8)}
    word = sum(1 << (4 * j) for j in range(8))
    return ones | {"m": torch.zeros(d_out, groups), "q": torch.full((d_out, groups, 4), word, dtype=torch.int32)}


def _check(level: str, shapes: tuple[tuple[int, int], ...], rows: int) -> bool:
    from spd.targets.blocks import pack as pack_blocks
    from spd.targets.invariant_attention import same_bits_at_every_row_count

    def product_for(d_in: int, d_out: int, bits: int):
        if bits:
            panels, _ = pack_blocks(_ones_blocks(d_out, d_in, bits), LANES[level])
            return lambda x, w: product_blocks(x.float(), panels, d_out, None, level, bits)
        panels = pack(torch.ones(d_out, d_in), level)
        return lambda x, w: product(x.float(), panels, d_out, None, level)

    # float32 panels at every shape; a GGUF's 4- and 8-bit blocks where the inputs come in whole blocks of 32
    return all(same_bits_at_every_row_count(i, o, product_for(i, o, bits), rows)
               for i, o in shapes for bits in ((0, 4, 8) if i % 32 == 0 else (0,)))


@functools.lru_cache(maxsize=None)
def panels_invariant(shapes: tuple[tuple[int, int], ...], level: str, rows: int = 17) -> bool:
    """The self-check: whether the kernel at `level` gives a row the same bits in a call of 1 row as of 2..`rows`, for
    these (in, out) shapes and CHECK_SHAPES (inputs that make a sum's order visible, as
    invariant_attention.products_invariant). Kept on disk per machine and build, so a start-up reads it."""
    if level not in levels():
        return False
    shapes = tuple(sorted(set(shapes) | set(CHECK_SHAPES)))
    key = f"{level} {rows} {shapes} blocks"
    path = _verdict_file()
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    if key not in verdicts:
        verdicts[key] = _check(level, shapes, rows)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(verdicts, indent=0))
            tmp.replace(path)          # whole or not at all: two processes may check at once
        except OSError:
            pass                       # an unwritable cache: checked again next time
    return bool(verdicts[key])


def level_for(shapes: tuple[tuple[int, int], ...]) -> str | None:
    """The level a target of these shapes multiplies at: SPD_PANEL_LEVEL's if set (None if this CPU cannot run it
    or it fails the self-check), else the highest this CPU runs that passes; None where none does."""
    forced = os.environ.get(LEVEL_ENV, "")
    if forced:
        if forced not in LEVELS:
            raise ValueError(f"{LEVEL_ENV}={forced!r}: one of {', '.join(LEVELS)}")
        return forced if panels_invariant(shapes, forced) else None
    return next((level for level in reversed(levels()) if panels_invariant(shapes, level)), None)
