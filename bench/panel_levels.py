"""The float32 panel kernel's speed at each ISA level this CPU runs, beside torch's own float32 `F.linear` — MKL as
it runs here, and MKL held to AVX2 (`MKL_ENABLE_INSTRUCTIONS=AVX2`, a child process) for the comparison the AVX2
level must win on an AVX2-only CPU. SmolLM2-135M's product shapes (in, out) at 1..16 rows; one product's median time
over rounds that take turns, and a forward's worth (the layer's seven products x 30 layers + the head) per row count.

    python -m bench.panel_levels --out docs/results/panel_levels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: q and o (576 -> 576), k and v (576 -> 192), gate and up (576 -> 1536), down (1536 -> 576), the head
SHAPES = {"q,o": (576, 576, 2), "k,v": (576, 192, 2), "gate,up": (576, 1536, 2), "down": (1536, 576, 1)}
LAYERS, HEAD = 30, (576, 49152)
ROWS = (1, 2, 4, 8, 12, 16)


def _time(fn, rounds: int) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def arms() -> dict:
    """Every arm's products, by name: `F.linear`, and the panel kernel at each level this CPU runs."""
    from spd.targets import panel

    out = {"F.linear": lambda w: (lambda x: F.linear(x, w))}
    for level in panel.levels():
        def make(w, level=level):
            packed = panel.pack(w, level)
            return lambda x: panel.product(x, packed, w.shape[0], None, level)
        out[f"panel {level}"] = make
    return out


def measure(names: list[str] | None, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(o, i, generator=g) for name, (i, o, _) in {**SHAPES, "head": (*HEAD, 1)}.items()}
    made = {arm: {name: make(w) for name, w in weights.items()} for arm, make in arms().items()
            if names is None or arm in names}
    result = {}
    for rows in ROWS:
        xs = {name: torch.randn(rows, w.shape[1], generator=g) for name, w in weights.items()}
        per = {arm: {} for arm in made}
        for name in weights:            # the arms take turns on each product
            for arm, fns in made.items():
                per[arm][name] = _time(lambda: fns[name](xs[name]), rounds)
        for arm, times in per.items():
            forward = LAYERS * sum(times[n] * k for n, (_, _, k) in SHAPES.items()) + times["head"]
            result.setdefault(arm, {})[str(rows)] = {"forward_ms": round(forward * 1e3, 3),
                                                      **{f"{n}_us": round(t * 1e6, 1) for n, t in times.items()}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:                      # MKL_ENABLE_INSTRUCTIONS is read when MKL starts: a process of its own
        print(json.dumps(measure(["F.linear"], args.rounds)))
        return
    rows = measure(None, args.rounds)
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    child = subprocess.run([sys.executable, "-m", "bench.panel_levels", "--child", "--rounds", str(args.rounds)],
                           env=env, capture_output=True, text=True, check=True)
    rows["F.linear (MKL held to AVX2)"] = json.loads(child.stdout)["F.linear"]
    out = {"command": "python -m bench.panel_levels " + " ".join(sys.argv[1:]),
           "cpu": torch.backends.cpu.get_cpu_capability(), "machine": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for arm, by_rows in rows.items():
        print(f"{arm:30s}", "  ".join(f"{r}:{v['forward_ms']:7.2f}" for r, v in by_rows.items()), "ms a forward")


if __name__ == "__main__":
    main()
