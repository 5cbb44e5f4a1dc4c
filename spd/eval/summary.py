"""Pool per-sample records into per-dataset and overall figures (design §3): ΣN/ΣK pooled, and the mean of
per-sample ratios, each labelled as such."""

from __future__ import annotations

from collections import Counter
from statistics import mean

from spd.methods import METHODS

METHOD_NAMES = {name: m.label for name, m in METHODS.items()}


def _mean(values):
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def pool_sources(samples: list[dict]) -> dict:
    """Per draft source (module, lookup): drafts verified, accepted, and the acceptance rate, pooled."""
    totals: dict[str, list[int]] = {}
    for s in samples:
        for source, (verified, accepted) in s.get("sources", {}).items():
            counts = totals.setdefault(source, [0, 0])
            counts[0] += verified
            counts[1] += accepted
    return {source: {"verified": v, "accepted": a, "acceptance": a / v if v else None}
            for source, (v, a) in sorted(totals.items())}


def pool_chain(samples: list[dict]) -> dict:
    """Draft-then-verify samples (EAGLE-3, the context lookup): tau = settled tokens per target forward, bonus token included."""
    total_n, cycles = sum(s["N"] for s in samples), sum(s["cycles"] for s in samples)
    histogram: Counter = Counter()
    for s in samples:
        histogram.update({int(k): v for k, v in s["accepted_histogram"].items()})
    checked = [s for s in samples if s.get("ar_match") is not None]
    return {
        "samples": len(samples), "N": total_n, "cycles": cycles, "m": samples[0]["m"],
        "tau_pooled": (total_n - len(samples)) / cycles if cycles else None,
        "tau_mean_of_ratios": _mean(s["tau"] for s in samples),
        "accepted_histogram": {str(k): histogram[k] for k in sorted(histogram)},
        "sources": pool_sources(samples),
        "ar_checked": len(checked), "ar_match": sum(bool(s["ar_match"]) for s in checked),
        "tokens_per_s": _mean(s.get("tokens_per_s") for s in samples),
        "ar_tokens_per_s": _mean(s.get("ar_tokens_per_s") for s in samples),
    }


def pool(samples: list[dict]) -> dict:
    """Figures for one group of samples that share n (or, for EAGLE-3's chain, m)."""
    if not samples:
        return {}
    if "tau" in samples[0]:
        return pool_chain(samples)
    n = samples[0]["n"]
    total_n, total_k = sum(s["N"] for s in samples), sum(s["K"] for s in samples)
    histogram: Counter = Counter()
    for s in samples:
        histogram.update({int(k): v for k, v in s["accepted_run_histogram"].items()})
    step_rows: Counter = Counter()
    for s in samples:
        step_rows.update(s.get("step_rows", {}))
    checked = [s for s in samples if s.get("ar_match") is not None]
    return {
        "samples": len(samples), "N": total_n, "K": total_k,
        "alpha_pooled": total_n / total_k if total_k else None,
        "eal_pooled": n * total_n / total_k if total_k else None,
        "alpha_mean_of_ratios": _mean(s["alpha"] for s in samples),
        "eal_mean_of_ratios": _mean(s["eal"] for s in samples),
        "rollbacks": sum(s["rollbacks"] for s in samples),
        "accepted_run_histogram": {str(k): histogram[k] for k in sorted(histogram)},
        "sources": pool_sources(samples),
        "step_rows": dict(sorted(step_rows.items())),     # steps by their rows per stage (prices varying rows)
        "ar_checked": len(checked), "ar_match": sum(bool(s["ar_match"]) for s in checked),
        # wall-clock means over the samples that were really decoded (None for fast-evaluated ones)
        "tokens_per_s": _mean(s.get("tokens_per_s") for s in samples),
        "ar_tokens_per_s": _mean(s.get("ar_tokens_per_s") for s in samples),
    }


def summarise(samples: list[dict], datasets: list[str]) -> dict:
    per = {ds: pool([s for s in samples if s["dataset"] == ds]) for ds in datasets}
    return {"datasets": {ds: v for ds, v in per.items() if v}, "overall": pool(samples)}
