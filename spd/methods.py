"""Every decoding method, once: its name, the label tables and plots use, how it decodes (a drafter beside the
pipeline, a draft-then-verify chain, or plain AR) and which module, if any, it drafts with. Config checks, the
session, the CLI, eval, reports, checkpoints and the trainer read it here, so a method is added in one place.
Torch-free: config checks read it before any model loads."""

from __future__ import annotations

from dataclasses import dataclass

PIPELINE, CHAIN, AR = "pipeline", "chain", "ar"


@dataclass(frozen=True)
class Method:
    name: str
    label: str               # in tables, plots and run labels
    decoder: str             # PIPELINE (spd.runtime.pipeline), CHAIN (spd.runtime.chain) or AR
    module: str | None       # "speculation" (spd.module), "eagle3" (spd.eagle3_module), None: drafts without one
    fast_eval: bool          # greedy eval can score it from the target's cached traces (spd.fast_eval*)
    draft_length: int | None = None   # a chain's drafts per target forward when draft_length= is not given

    @property
    def pipelined(self) -> bool:
        return self.decoder == PIPELINE

    @property
    def chain(self) -> bool:
        return self.decoder == CHAIN

    @property
    def trained(self) -> bool:
        """Drafts with a trained module: has checkpoints, a shipped default, training and calibration."""
        return self.module is not None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("spd", "SPD", PIPELINE, "speculation", fast_eval=True),
    Method("ppsd", "PPSD", PIPELINE, "speculation", fast_eval=True),
    Method("spd_output_state", "SPD output states", PIPELINE, "speculation", fast_eval=True),
    Method("eagle3", "EAGLE-3", CHAIN, "eagle3", fast_eval=True, draft_length=5),
    # 7: 8 target rows a cycle, which a CPU computes faster than 7 (bench/lookup_grid.py); m = 15 measured within
    # 4% of it on 256-token answers (docs/results.md) and costs more on a miss
    Method("lookup", "Context lookup", CHAIN, None, fast_eval=True, draft_length=7),
    Method("ar", "AR", AR, None, fast_eval=False),
)}

DECODING_METHODS = tuple(METHODS)
TRAINED_METHODS = tuple(name for name, m in METHODS.items() if m.trained)
DRAFTING_METHODS = tuple(name for name, m in METHODS.items() if m.decoder != AR)


# Where a pipelined method's drafts come from: its module alone, or the context lookup where the context's suffix
# matched earlier and the module otherwise (spd.drafters.hybrid).
MODULE, LOOKUP_MODULE = "module", "lookup+module"
DRAFT_SOURCES = (MODULE, LOOKUP_MODULE)


def method(name: str) -> Method:
    """The registry entry; callers pass names that passed the config's check."""
    return METHODS[name]
