"""The markdown table bench/wallclock.py prints: one line per row of its report."""

from __future__ import annotations


def per_source(row: dict) -> str:
    """ "lookup 0.62, module 0.09": accepted / verified drafts per draft source."""
    return ", ".join(f"{source} {v['acceptance']:.2f}" for source, v in sorted(row.get("sources", {}).items())) or "—"


def label(row: dict) -> str:
    return _label(row) + (", unkeyed draws" if row.get("keyed") is False else "") + \
        (", blind to the noise" if row.get("by_noise") is False else "") + \
        (f", noise share {row['noise_share']:g}" if "noise_share" in row else "") + \
        (", sampled prior" if row.get("sampled_prior") is True else "") + \
        (", greedy's prior" if row.get("sampled_prior") is False else "") + \
        (f", {row['dtype']}" if row.get("dtype", "float32") != "float32" else "")


def _label(row: dict) -> str:
    if row.get("runtime", "").endswith("batched"):
        where = f", {row['processes']} processes" if row["processes"] > 1 else ""
        return (f"{row['method']}{', ' + row['draft_source'] if row.get('draft_source') else ''}{where}, batched "
                f"{row['max_batch']}")
    if row["method"] == "suffix":
        return f"suffix m={row['draft_length']}" + (f", W={row['W']}, {row['tree_nodes']} nodes" if row["W"] > 1 else "") \
            + (f", datastore={row['datastore']}" if row.get("datastore") else "")
    if row["method"] == "lookup":
        return f"lookup m={row['draft_length']}, n-grams {row['ngrams'][0]}..{row['ngrams'][1]}"
    if row["method"] == "hf_prompt_lookup":
        return f"hf_prompt_lookup {row['draft_length']}"
    tree = f", W={row['W']}" if row.get("W", 1) > 1 else ""
    if row["method"] == "eagle3":
        return f"eagle3 m={row['draft_length']}{tree}" + (f", {row['tree_nodes']} nodes" if tree else "")
    return row["method"] + (f", {row['draft_source']}" if row.get("draft_source") else "") + tree


def equals_ar(row: dict, report: dict) -> str:
    """Greedy rows: prompts decoded to AR's tokens; keyed sampled rows: prompts sampled to AR's (marked "T")."""
    for key, mark in (("greedy_equals_ar", ""), ("sampled_equals_ar", " T")):
        if key in row:
            return f"{row[key]}/{row.get('prompts', report['prompts'])}{mark}"
    return "—"


def markdown(report: dict) -> str:
    lines = ["| set | n | bounds | module | T | method | processes × threads | tokens/s | vs fastest plain | L′acc or τ | "
             "accepted per source | s/step | module s/step | messages µs/step | calibrated tokens/s | rows per cycle | priced out | worst prompt vs AR | = AR (greedy; T: keyed samples) |",
             "|---|---:|---|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        def f(key, spec=".3f", scale=1.0):
            return format(r[key] * scale, spec) if r.get(key) is not None else "—"
        lines.append(f"| {r.get('set', 'eval')} | {r.get('n', '—')} | {r.get('bounds', '—')} {r.get('stage_bounds', '')} | "
                     f"{r.get('module', '—')} | {r['temperature']:g} | {label(r)} ({r['runtime']}) | "
                     f"{r['processes']} × {r['threads_per_process']} | {f('tokens_per_s', '.1f')} | "
                     f"{f('speedup_vs_fastest_plain')} | {f('eal' if 'eal' in r else 'tau')} | "
                     f"{per_source(r)} | "
                     f"{f('s_per_step', '.4f')} | "
                     f"{f('module_s_per_step', '.4f')} | {f('message_us_per_step_median', '.0f')} | "
                     f"{f('calibrated_tokens_per_s', '.1f')} | {f('rows_per_cycle', '.2f')} | "
                     f"{f('priced_out_share', '.2f')} | {f('worst_prompt_vs_ar', '.2f')} | "
                     f"{equals_ar(r, report)} |")
    return "\n".join(lines)
