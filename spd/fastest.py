"""What `spd-infer generate` and `chat` decode with when no key chooses: the fastest lossless configuration that
bench/wallclock.py measured for this kind of device (docs/results.md, "The whole field by the clock").

Torch-free: it is read before any model loads. Any key that describes an SPD pipeline or a module (method=,
checkpoint=, n=, stage_bounds=, runtime=, draft_source=, ...) on the command line, or set away from its default in
a YAML file, means the user chose, and nothing is changed: `runtime=local` alone decodes with SPD, the reference.
"""

from __future__ import annotations

# device type -> the keys of the fastest lossless row: 2-core CPUs (bench/wallclock.py); on CUDA the H200 visit's
# bfloat16 table (docs/results.md, "The first prepared visit"), where AR through CUDA graphs ran 242 tokens/s and
# SPD with graphs 47 (the lookup chain was not measured there)
FASTEST = {"cpu": {"method": "lookup"}, "cuda": {"method": "ar", "cuda_graphs": True}}

# keys that ask for SPD's pipeline or a module: a user who sets one of them gets what they asked for
CHOOSING_KEYS = ("method", "checkpoint", "n", "stage_bounds", "runtime", "draft_source", "module_layers",
                 "module_cache", "cuda_graphs", "threads_per_stage", "controller")


def device_type(device: str) -> str:
    return device.split(":")[0]


def fastest_default(cfg, defaults, given: set[str]) -> dict:
    """The keys to set on `cfg`: nothing where a choosing key was given on the command line (`given`, whatever its
    value) or differs from its default in `defaults` (set by a YAML file)."""
    if any(key in given or cfg[key] != defaults[key] for key in CHOOSING_KEYS):
        return {}
    return dict(FASTEST.get(device_type(cfg.device), {}))


def apply_fastest_default(cfg, schema: type, overrides: list[str]) -> bool:
    """Set the fastest configuration's keys on `cfg` (a config of `schema`, read-only as load_config returns it)
    unless the user chose; True when it did (the stats line says so). overrides: the command line's key=value words.
    Every entry point that decodes with "the default" resolves it here."""
    from omegaconf import OmegaConf, read_write

    given = {word.split("=", 1)[0] for word in overrides}
    chosen = fastest_default(cfg, OmegaConf.structured(schema), given)
    with read_write(cfg):
        cfg.update(chosen)
    return bool(chosen)
