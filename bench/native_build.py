"""The float32 panel kernel as an older revision built it, before the ISA levels: one build with `-march=ARCH`, the
compiler free to vectorise and fuse multiply-adds as it likes for that CPU. The clock's comparison of the AVX2 level
with what an AVX2-only CPU multiplied at before: `-march=znver3` is what `-march=native` gives on an AMD EPYC Milan
(AVX2 + FMA, no AVX-512), and it compiles and runs on any CPU with those instructions.

A clock arm names it with `BENCH_NATIVE_KERNEL=REV:ARCH` beside `SPD_PANEL_LEVEL=avx2` (the old build's panels are
the AVX2 level's: [P, K, 8], zero-padded, checked here), e.g.

    python -m bench.clock --arm "ar avx2: SPD_PANEL_LEVEL=avx2 method=ar" \\
        --arm "ar native: SPD_PANEL_LEVEL=avx2 BENCH_NATIVE_KERNEL=1eb2bdd:znver3 method=ar" ...

Its float32 products then go through the old build while that arm decodes (4-bit blocks are not in it)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch

from spd.targets import panel

ENV = "BENCH_NATIVE_KERNEL"
KERNEL_PATH = "spd/csrc/panel_linear.cpp"


@functools.lru_cache(maxsize=None)
def native_kernel(spec: str):
    """The kernel source at REV built with -O3 -march=ARCH (cached under the torch extensions directory)."""
    rev, sep, arch = spec.partition(":")
    if not sep or not rev or not arch:
        raise SystemExit(f"{ENV}={spec!r}: write it as REV:ARCH, e.g. 1eb2bdd:znver3")
    root = Path(__file__).resolve().parent.parent
    try:
        source = subprocess.run(["git", "show", f"{rev}:{KERNEL_PATH}"], cwd=root, check=True, capture_output=True,
                                text=True).stdout
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{ENV}={spec!r}: git cannot show {KERNEL_PATH} at {rev} ({exc.stderr.strip()})")
    if "linear_blocks" in source or "levels()" in source:
        raise SystemExit(f"{ENV}={spec!r}: {rev}'s kernel already has ISA levels; name a revision before them")
    name = f"spd_native_{rev}_{arch}".replace("-", "_")
    build = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / name
    build.mkdir(parents=True, exist_ok=True)
    path = build / "panel_linear.cpp"
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    from torch.utils.cpp_extension import load

    panel._ninja_on_path()
    print(f"building {rev}'s kernel with -march={arch} in {build}", file=sys.stderr)
    old = load(name=name, sources=[str(path)], build_directory=str(build),
               extra_cflags=["-O3", f"-march={arch}", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    weight = torch.randn(37, 100)
    if not torch.equal(old.pack(weight), panel.pack(weight, "avx2")):
        raise SystemExit(f"{ENV}={spec!r}: that build's panels are not the AVX2 level's (is ARCH without AVX-512?)")
    return old


class _Through:
    """panel's kernel module with its float32 products taken by the old build."""

    def __init__(self, old, new):
        self.old, self.new = old, new

    def linear(self, x, panels, n_out, bias, level):
        if level != panel.LEVELS.index("avx2"):
            raise RuntimeError(f"{ENV}: the arm multiplies at {panel.LEVELS[level]}, not avx2")
        return self.old.linear(x, panels, n_out, bias)

    def __getattr__(self, name):
        return getattr(self.new, name)


def through_native(run, spec: str):
    """`run(key, ids)` with every float32 panel product in it taken by the build `spec` names."""
    old = native_kernel(spec)

    def native_run(key, ids):
        with mock.patch.object(panel, "_EXT", _Through(old, panel._EXT)):
            return run(key, ids)
    return native_run
