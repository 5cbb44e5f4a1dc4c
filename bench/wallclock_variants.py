"""The other arms of bench/wallclock.py's A/B runs (--keyed-ab, --prior-ab, --recall-ab): a request without keyed
draws and the context statistics' drafter with one part of its sampled pricing changed. They live here, not in the
product classes, because nothing but these A/Bs chooses them."""

from __future__ import annotations

from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter
from spd.pricing import AcceptancePredictor


class UnkeyedRequest(Request):
    """--keyed-ab's other arm: a sampled request drawing from its generator, without keyed draws."""

    def draws(self, generator, vocab):
        return None


class SuffixVariant(SuffixDrafter):
    """method=suffix's drafter with one part of its sampled pricing changed, for the A/Bs of --keyed-ab (by_noise
    False: blind to the noise), --prior-ab (sampled_prior: a sampled request's predictor starts from
    AcceptancePredictor.for_sampling's prior while it has judged nothing) and --recall-ab (recall False: no
    candidate carries the target's p where the context had it)."""

    DEFAULT = dict(by_noise=True, sampled_prior=False, recall=True)     # SuffixDrafter itself

    def __init__(self, *args, by_noise: bool = True, sampled_prior: bool = False, recall: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_noise, self.sampled_prior, self.recall = by_noise, sampled_prior, recall

    def sampling_draws(self, draws) -> None:
        super().sampling_draws(draws if self.by_noise else None)
        if draws is not None and self.sampled_prior and not self.predictor.counts:
            self.predictor = AcceptancePredictor.for_sampling()

    def _chance(self, position: int) -> float:
        return super()._chance(position) if self.recall else float("nan")
