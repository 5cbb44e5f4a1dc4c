"""How long `spd-infer` takes to answer, timed as whole processes from outside (start-up and exit included).

- warm: `spd-infer generate prompt=hi max_new_tokens=1 method=ar` with the weight cache already written (goal < 3 s);
- bad input: the same with `n=0` (goal < 1.5 s): refused before torch is imported;
- cold: the first call on an empty cache (reads the GGUF once, writes the safetensors copy): what every call cost
  before the cache;
- floors, for reading the figures: the interpreter alone, `import torch`, and `import torch` + transformers'
  model base class (what any process that runs an HF model pays before its first line of work).

Each figure: min / median / max over --runs runs (after one warm-up), interleaved so drift hits all alike.

    python -m bench.startup --runs 7 --out docs/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CLI = [sys.executable, "-m", "spd.cli", "generate"]
COMMANDS = {
    "warm": CLI + ["prompt=hi", "max_new_tokens=1", "method=ar"],
    "bad_input": CLI + ["prompt=hi", "max_new_tokens=1", "method=ar", "n=0"],
    "floor_python": [sys.executable, "-c", "pass"],
    "floor_import_torch": [sys.executable, "-c", "import torch"],
    "floor_import_torch_transformers_model": [sys.executable, "-c",
                                              "import torch; from transformers import PreTrainedModel"],
}
EXPECTED_EXIT = {"bad_input": 2}


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True)
    seconds = time.perf_counter() - start
    return seconds, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", default="docs/results/startup.json")
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="spd-startup-cache-")
    env = {**os.environ, "SPD_CACHE_DIR": cache}
    try:
        cold, proc = timed(COMMANDS["warm"], env)
        assert proc.returncode == 0, proc.stderr.decode()
        print(f"cold (first call, empty cache): {cold:.2f} s", file=sys.stderr)
        samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for run in range(args.runs + 1):
            for name, cmd in COMMANDS.items():
                seconds, proc = timed(cmd, env)
                expected = EXPECTED_EXIT.get(name, 0)
                assert proc.returncode == expected, (name, proc.returncode, proc.stderr.decode()[-500:])
                if name == "bad_input":
                    assert proc.stderr.decode().strip().startswith("spd-infer: error: n=0"), proc.stderr
                if run:  # the first round warms the page cache
                    samples[name].append(seconds)
            print(f"round {run}/{args.runs}", file=sys.stderr)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    figures = {name: {"min_s": min(v), "median_s": statistics.median(v), "max_s": max(v), "runs": len(v)}
               for name, v in samples.items()}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "commands": {name: " ".join("python" if c == sys.executable else c for c in cmd) for name, cmd in COMMANDS.items()},
        "cold_first_call_s": cold,
        "figures": figures,
        "goals": {"warm_median_below_3s": figures["warm"]["median_s"] < 3.0,
                  "bad_input_median_below_1_5s": figures["bad_input"]["median_s"] < 1.5},
        "spd_work_beyond_the_import_floor_s": figures["warm"]["median_s"]
        - figures["floor_import_torch_transformers_model"]["median_s"],
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    for name, fig in figures.items():
        print(f"{name:40s} median {fig['median_s']:.2f} s  (min {fig['min_s']:.2f}, max {fig['max_s']:.2f})")
    print(f"cold first call {cold:.2f} s -> {args.out}")


if __name__ == "__main__":
    main()
