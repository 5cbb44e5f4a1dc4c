"""Why the chain's AR token and the pipelined calibration's AR token differ: cache-resident stages.

`spd.eval.calibrate.calibrate` times each stage alone, many times in a row, and models plain AR as Σ stage + head;
`calibrate_chain` times AR as one whole forward + head. On a CPU whose last-level cache holds one stage's weights
but not the whole model, a stage repeated alone runs from cache while a whole forward streams the weights from
memory. This script times, in one process, every stage of an n-stage split alone (Σ), the same layers as one call,
and one whole `forward_all`, plus the head, each the median of --repeats after warm-up.

    OMP_NUM_THREADS=1 python -m experiments.stage_cache_effect --ns 1,5 --out docs/results/stage_cache_effect.json

The figure's page: docs/speed-cpu.md, "Costs that do not depend on a trained module".
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys

import torch

from spd.targets.timing import median_seconds
from spd.eval.output import write_json
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


def llc() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("L3 cache")), None)


@torch.no_grad()
def time_split(loaded, n: int, context: int, repeats: int) -> dict:
    staged = StagedTarget(loaded.model, n)
    ids = torch.randint(staged.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    cache = staged.new_cache()
    final, hidden = staged.forward_all(ids, cache, 0, set(staged.bounds))
    cache.crop(context)
    position = torch.tensor([context])
    rewind = lambda: cache.crop(context)  # noqa: E731
    stage_s = [median_seconds(lambda s=s: staged.run_stage(s, hidden[staged.bounds[s]][:, context:], position, cache),
                               repeats, staged.device, reset=rewind) for s in range(n)]
    whole_s = median_seconds(lambda: staged.forward_all(ids[:, context:], cache, context), repeats, staged.device,
                              reset=rewind)
    head_s = median_seconds(lambda: staged.logits(final[0, -1]), repeats, staged.device)
    return {"bounds": staged.bounds, "stage_s": stage_s, "sum_stages_s": sum(stage_s), "whole_forward_s": whole_s,
            "head_s": head_s, "ar_by_stages_s": sum(stage_s) + head_s, "ar_whole_s": whole_s + head_s}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1,5")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = load_target("smollm2")
    weights_mb = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 2**20
    result = {"threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "l3_cache": llc(), "weights_MiB": weights_mb, "splits": {}}
    for n in (int(x) for x in args.ns.split(",")):
        result["splits"][str(n)] = time_split(loaded, n, args.context, args.repeats)
        r = result["splits"][str(n)]
        print(f"n={n}: Σ stages {r['sum_stages_s'] * 1e3:.1f} ms, whole forward {r['whole_forward_s'] * 1e3:.1f} ms, "
              f"head {r['head_s'] * 1e3:.1f} ms")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
