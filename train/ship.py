"""Copy a trained checkpoint into the package as a shipped module (float16 weights, provenance in config.json).

    python train/ship.py outputs/smollm2_n5_best/checkpoint smollm2-n5 --measured docs/results/acceptance_best.json

Weight matrices are stored in float16 (half the bytes; load_checkpoint widens them to the run's dtype); the
draft-vocabulary map stays int64 and the feature standardisation float32. config.json gains "provenance": the
training command, the hash of the training data, the training tokens, and what --measured (a bench/acceptance.py
or `spd-infer eval` summary JSON) says of its L'acc, with the command that measured it.
"""

import argparse
import json
import os
import sys

def measured_of(path: str, command: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    if "eal_pooled" in data:   # bench/acceptance.py
        keep = ("eal_pooled", "eal_per_dataset", "limit", "max_new_tokens")
        return {"source": path, "command": command, **{k: data[k] for k in keep}}
    if "run" in data:          # spd-infer eval summary.json: L'acc, or EAGLE-3's tau
        metric = "eal_pooled" if "eal_pooled" in data["overall"] else "tau_pooled"
        return {"source": path, "command": command, metric: data["overall"][metric],
                f"{metric.split('_')[0]}_per_dataset": {name: ds[metric] for name, ds in data["datasets"].items()},
                "samples": data["overall"]["samples"], "max_new_tokens": data["run"]["max_new_tokens"],
                "temperature": data["run"]["temperature"]}
    raise SystemExit(f"ship.py: error: {path} is neither a bench/acceptance.py result nor an eval summary.json")


def better_than_shipped(measured: dict, shipped_dir: str) -> tuple[bool, str]:
    """(ship?, why): a new module replaces a shipped one only on a higher L'acc (tau for EAGLE-3) measured the same
    way, so a re-ship is always an improvement on the number the docs quote."""
    path = os.path.join(shipped_dir, "config.json")
    if not os.path.isfile(path):
        return True, f"nothing shipped at {shipped_dir}: shipping"
    with open(path) as f:
        before = (json.load(f).get("provenance") or {}).get("measured") or {}
    metric = "eal_pooled" if "eal_pooled" in measured else "tau_pooled"
    same = ("samples", "max_new_tokens", "temperature", "limit")
    differ = [k for k in same if k in measured and k in before and measured[k] != before[k]]
    if metric not in before or differ:
        raise SystemExit(f"ship.py: error: the shipped module's measurement is not comparable with --measured "
                         f"({', '.join(differ) or metric + ' missing'}); measure both the same way")
    if measured[metric] > before[metric]:
        return True, f"{metric} {measured[metric]:.4f} beats the shipped {before[metric]:.4f}: shipping"
    return False, f"not shipped: {metric} {measured[metric]:.4f} does not beat the shipped {before[metric]:.4f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="train/ship.py")
    ap.add_argument("checkpoint")
    ap.add_argument("name", help="directory name under spd/assets/modules/")
    ap.add_argument("--measured", required=True, help="JSON of the module's measured L'acc")
    ap.add_argument("--measured-command", required=True, help="the command that wrote --measured")
    ap.add_argument("--if-better", action="store_true",
                    help="ship only if --measured beats what the module shipped as NAME measured, on the same "
                         "evaluation (samples, tokens, temperature); otherwise say why and leave it")
    args = ap.parse_args(argv)

    from safetensors.torch import load_file

    from spd.models.checkpoint import float16_state
    from spd.models.weights_dir import write_weights_dir
    from spd.models.shipped import SHIPPED_DIR

    with open(os.path.join(args.checkpoint, "config.json")) as f:
        config = json.load(f)
    training = config.get("training") or {}
    state = load_file(os.path.join(args.checkpoint, "model.safetensors"))
    small = float16_state(state)
    measured = measured_of(args.measured, args.measured_command)
    if args.if_better:
        verdict = better_than_shipped(measured, os.path.join(SHIPPED_DIR, args.name))
        print(verdict[1])
        if not verdict[0]:
            return 0
    config["provenance"] = {"command": training.get("command"), "data_sha256": training.get("data_sha256"),
                            "train_tokens": config.get("train_tokens"), "steps": config.get("step"),
                            "measured": measured}
    dest = os.path.join(SHIPPED_DIR, args.name)
    write_weights_dir(dest, small, config, {"format": config["format"]})
    size = os.path.getsize(os.path.join(dest, "model.safetensors"))
    print(f"shipped {args.checkpoint} -> {dest} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
