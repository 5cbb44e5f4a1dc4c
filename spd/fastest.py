"""What `spd-infer generate` and `chat` decode with when no key chooses: the fastest lossless configuration that
the clock (bench/) measured for this kind of device and temperature regime (greedy or sampled; docs/speed-cpu.md).

Torch-free: it is read before any model loads. Any key that describes an SPD pipeline or a module (method=,
checkpoint=, n=, stage_bounds=, draft_source=, ...) on the command line, or set away from its default in a YAML
file, means the user chose, and nothing is changed. A runtime is not a method: `runtime=device` alone runs the default
method on the device step, and where the default cannot run on the runtime asked for, the command is refused in one
line naming the methods that can.
"""

from __future__ import annotations

from spd.targets.source import DEFAULT_TARGET

# device type -> temperature regime -> the keys of the fastest lossless row. 2-core CPUs: the clock over the
# eval and everyday sets, the whole field in one run (docs/speed-cpu.md, "The whole field by the clock"): the priced
# context statistics' trees (W = 4) with the target's own answers and ShareGPT's continuations beside them ran 2.98x /
# 1.276x / 2.20x / 1.279x of the suite's AR (everyday T = 0, T = 1, eval T = 0, T = 1), the fastest plain decoding in
# every cell, and 1.84-2.22x of transformers' prompt lookup; the datastore was measured on the default target only
# (fastest_default). On CUDA the bfloat16 table measured on one H200 (docs/gpu.md, "The figures"), where AR through
# CUDA graphs was the fastest of the suite's rows and SPD ran below it.
# A GGUF target on a CPU decodes from the file's own 4- and 8-bit blocks (weights=q4, a target of its own whose AR
# every method equals): the default there ran faster than over the float32 weights in every cell of the clock
# (docs/speed-cpu.md, "The default at 4-bit weights, beside llama.cpp") in about half the memory.
FASTEST = {"cpu": {"greedy": {"method": "suffix", "W": 4, "datastore": "answers+sharegpt", "weights": "q4"},
                   "sampled": {"method": "suffix", "W": 4, "datastore": "answers+sharegpt", "weights": "q4"}},
           "cuda": {"greedy": {"method": "ar", "cuda_graphs": True}, "sampled": {"method": "ar", "cuda_graphs": True}}}

# keys that ask for SPD's pipeline or a module: a user who sets one of them gets what they asked for
CHOOSING_KEYS = ("method", "checkpoint", "n", "stage_bounds", "draft_source", "module_layers",
                 "module_cache", "threads_per_stage", "controller")


def device_type(device: str) -> str:
    return device.split(":")[0]


def fastest_default(cfg, defaults, given: set[str]) -> dict:
    """The keys to set on `cfg`: nothing where a choosing key was given on the command line (`given`, whatever its
    value) or differs from its default in `defaults` (set by a YAML file); of the fastest row's other keys, those the
    user set (W=1, datastore=null) are kept. The datastore was measured on the default target only: another target
    gets it by asking (it is built once for that target's tokenizer)."""
    if any(key in given or cfg[key] != defaults[key] for key in CHOOSING_KEYS):
        return {}
    regime = "greedy" if cfg.temperature == 0 else "sampled"
    chosen = dict(FASTEST.get(device_type(cfg.device), {}).get(regime, {}))
    if cfg.target != DEFAULT_TARGET:
        chosen.pop("datastore", None)
    gguf = cfg.target == DEFAULT_TARGET or str(cfg.target).endswith(".gguf")
    if not (gguf and cfg.dtype in (None, "float32") and not cfg.get("compile")):
        chosen.pop("weights", None)     # the blocks are a GGUF file's, multiplied in float32 rows
    return {key: value for key, value in chosen.items() if key not in given and cfg[key] == defaults[key]}


def apply_fastest_default(cfg, schema: type, overrides: list[str]) -> bool:
    """Set the fastest configuration's keys on `cfg` (a config of `schema`, read-only as load_config returns it)
    unless the user chose; True when it did (the stats line says so). overrides: the command line's key=value words.
    Every entry point that decodes with "the default" resolves it here."""
    from omegaconf import OmegaConf, read_write

    given = {word.split("=", 1)[0] for word in overrides}
    defaults = OmegaConf.structured(schema)
    chosen = fastest_default(cfg, defaults, given)
    if chosen and cfg.runtime != defaults.runtime:
        refuse_if_unrunnable(cfg, chosen, defaults)
    with read_write(cfg):
        cfg.update(chosen)
    return bool(chosen)


def refuse_if_unrunnable(cfg, chosen: dict, defaults) -> None:
    """The default method, on the runtime the user asked for, passes the decoding checks, or the command is refused
    naming the methods that run there (as the user would give them: method= alone)."""
    from omegaconf import OmegaConf

    from spd.config import check_decoding
    from spd.errors import UserError
    from spd.methods import DECODING_METHODS

    def passes(keys: dict) -> bool:
        trial = OmegaConf.merge(cfg, keys)
        try:
            check_decoding(trial)
        except UserError:
            return False
        return True

    if passes(chosen):
        return
    plain = {key: defaults[key] for key in chosen}       # the fastest row's other keys back at their defaults
    runs = [name for name in DECODING_METHODS if passes({**plain, "method": name})]
    what = " ".join(f"{key}={value}" for key, value in chosen.items())
    raise UserError(f"runtime={cfg.runtime} cannot run the default method here ({what}); add method= one of "
                    f"{', '.join(runs) or 'none'}")
