"""The README's first command by the clock: `spd-infer generate` with no method key (spd.fastest's default) against
the same line with method=ar, in turns (A B A B ...) so that the machine's drift falls on both, as whole `spd-infer`
processes. tokens/s is the decoding rate each process reports (json=true); the ratio is taken pair by pair.

    python -m bench.first_command --pairs 5 --out docs/results/first_command.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from spd.eval.output import write_json
# (label, prompt, max_new_tokens): the README's first command, and long answers
CASES = [
    ("readme", "What is 12*7?", 64),
    ("long: code", "Write a Python function that checks whether a number is prime, then explain how it works.", 256),
    ("long: explanation", "Explain how a hash table works, with an example in Python.", 256),
]


def decode(prompt: str, max_new_tokens: int, extra: list[str]) -> dict:
    cli = os.path.join(os.path.dirname(sys.executable), "spd-infer")
    out = subprocess.run([cli, "generate", prompt, f"max_new_tokens={max_new_tokens}", "json=true", *extra],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--default-extra", default="", help="keys added to the default's command (e.g. draft_length=15)")
    ap.add_argument("--out", default="docs/results/first_command.json")
    args = ap.parse_args()
    rows = []
    for label, prompt, max_new in CASES:
        default, ar = [], []
        for _ in range(args.pairs):
            default.append(decode(prompt, max_new, args.default_extra.split()))
            ar.append(decode(prompt, max_new, ["method=ar"]))
        assert all(d["token_ids"] == a["token_ids"] for d, a in zip(default, ar)), "the default is not lossless"
        ratios = [d["tokens_per_s"] / a["tokens_per_s"] for d, a in zip(default, ar)]
        first = default[0]
        rows.append({"case": label, "prompt": prompt, "max_new_tokens": max_new, "tokens": len(first["token_ids"]),
                     "default": {"method": first["method"], "tau": first.get("tau"), "m": first.get("m")},
                     "default_tokens_per_s": [d["tokens_per_s"] for d in default],
                     "ar_tokens_per_s": [a["tokens_per_s"] for a in ar],
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
        print(json.dumps({k: rows[-1][k] for k in ("case", "tokens", "ratio_median", "ratio_min", "ratio_max")}),
              file=sys.stderr)
    report = {"rows": rows, "pairs": args.pairs, "default_extra": args.default_extra, "cores": os.cpu_count(),
              "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = ["| case | new tokens | default | τ | default tokens/s (median) | method=ar tokens/s (median) | "
             "default / ar, pair by pair: median (min–max) |", "|---|---:|---|---:|---:|---:|---|"]
    for r in report["rows"]:
        d = r["default"]
        tau = f"{d['tau']:.2f}" if d["tau"] else "—"
        lines.append(f"| {r['case']} | {r['tokens']} | {d['method']}{' m=' + str(d['m']) if d['m'] else ''} | {tau} | "
                     f"{statistics.median(r['default_tokens_per_s']):.1f} | {statistics.median(r['ar_tokens_per_s']):.1f} | "
                     f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
