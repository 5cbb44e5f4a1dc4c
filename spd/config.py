"""Structured configs (OmegaConf): dataclass defaults <- YAML file <- `key=value` overrides; unknown keys are errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from dataclasses import dataclass
from typing import Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spd.decoders import refusal       # torch-free: the names and capabilities only
from spd.runtimes import RUNTIMES, runtime
from spd.targets import DTYPE_NAMES, WEIGHT_NAMES
from spd.targets.source import resolve_source
from spd.errors import UserError
from spd.methods import AR, DECODING_METHODS, METHOD_KEYS, METHODS, PIPELINE, own_keys
from spd.spec import DecodeKeys


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbSection:
    mode: str = "offline"               # offline | online | disabled (never a login call in code)
    project: str = "spd"                # the W&B project a run is logged to
    name: Optional[str] = None          # the run's name (None: W&B picks one)

    @staticmethod
    def check(section) -> None:
        if section.mode not in WANDB_MODES:
            raise UserError(f"wandb.mode={section.mode!r} is not one of: {', '.join(WANDB_MODES)}")


@dataclass
class GenerateConfig(DecodeKeys):
    """`spd-infer generate` and `chat`: the decoding keys (spd.spec.DecodeKeys) and where the prompts come from."""
    prompt: Optional[str] = None         # taken verbatim; or prompt_file=, a positional argument, standard input
    prompt_file: Optional[str] = None    # a UTF-8 text file whose whole content is the prompt
    prompts_file: Optional[str] = None   # many prompts: one per line, or JSONL objects with a "prompt" field; one
                                         # JSON record per prompt on standard output, in order
    max_batch: int = 8                   # prompts_file (generate) or requests (serve) decoded together: one forward
                                         # per cycle (AR and the chains, runtime=local), one pipeline step (SPD's
                                         # pipeline, local or distributed); 1 = one at a time
    chat_template: bool = True           # wrap the prompt as a user turn with the generation prompt
    json: bool = False                   # print one JSON object instead of text + a stats line

    @staticmethod
    def check(cfg) -> None:
        check_decoding(cfg)
        at_least(cfg, "max_batch", 1, " (sequences decoded together; 1 = one at a time)")


@dataclass
class ServeConfig(GenerateConfig):
    """`spd-infer serve`: generate's keys (the defaults every request starts from) and where to listen."""
    host: str = "127.0.0.1"              # 0.0.0.0 listens on every interface
    port: int = 8000                     # 0 = any free port (printed when ready)
    api_key: Optional[str] = None        # when set, /v1/* require `Authorization: Bearer <api_key>`
    max_queue: int = 32                  # requests waiting for the pipeline; more are answered 429
    shutdown_timeout_s: float = 10.0     # SIGTERM / Ctrl-C: in-flight requests get this long to finish

    @staticmethod
    def check(cfg) -> None:
        GenerateConfig.check(cfg)
        if cfg.prompt is not None or cfg.prompt_file is not None or cfg.prompts_file is not None:
            raise UserError("serve takes its prompts from requests; drop prompt/prompt_file/prompts_file")
        if not 0 <= cfg.port <= 65535:
            raise UserError(f"port={cfg.port} must be in [0, 65535] (0 = any free port)")
        at_least(cfg, "max_queue", 1, " (requests that may wait)")
        if not (math.isfinite(cfg.shutdown_timeout_s) and cfg.shutdown_timeout_s >= 0):
            raise UserError(f"shutdown_timeout_s={cfg.shutdown_timeout_s} must be >= 0 seconds")
        if cfg.api_key is not None and not cfg.api_key.strip():
            raise UserError("api_key is empty; give a key or drop api_key")


def field_type(schema: type, dotted: str):
    """The declared type of `a.b.c` in a dataclass schema, or None where the key does not exist."""
    kind = schema
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(kind):
            return None
        hints = typing.get_type_hints(kind)
        if part not in hints:
            return None
        kind = hints[part]
    return kind


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every key of a dataclass schema, nested sections as section.key."""
    keys = []
    for name, kind in typing.get_type_hints(schema).items():
        keys += schema_keys(kind, f"{prefix}{name}.") if dataclasses.is_dataclass(kind) else [prefix + name]
    return keys


def did_you_mean(schema: type, key: str) -> str | None:
    """The schema's key nearest to a mistyped one (difflib), e.g. max_new_tokens for max_new_token; None if none is
    near. A key's last part is matched alone too, so `steps` finds optim.steps and `model.layer` model.module_layers."""
    import difflib

    keys = schema_keys(schema)
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if near:
        return near[0]
    last = {}
    for k in keys:
        last.setdefault(k.rsplit(".", 1)[-1], k)
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(last), n=1, cutoff=0.75)
    return last[near[0]] if near else None


def unknown_key(schema: type, key: str, where: str = "") -> str:
    """"unknown config key 'max_new_token' (did you mean max_new_tokens?)" — the start of the refusal."""
    near = did_you_mean(schema, key)
    return f"unknown config key {key!r}{where}" + (f" (did you mean {near}?)" if near else "")


def _is_text(kind) -> bool:
    return kind is str or (typing.get_origin(kind) is typing.Union and set(typing.get_args(kind)) == {str, type(None)})


def escape_interpolation(text: str) -> str:
    """OmegaConf reads `${...}` in a string as an interpolation; escape it so the text comes back verbatim."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not OVERRIDE_KEY.match(key):
        raise UserError(f"override {item!r} is not key=value (e.g. n=5)")
    return key, value


OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


CONTROLLERS = ("auto", "own_process", "first_stage")
DEVICE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")


def full_key(cfg, key: str) -> str:
    """`optim.steps`, not `steps`, for a key inside a section."""
    try:
        return cfg._get_full_key(key) or key
    except AttributeError:  # a plain namespace (library callers)
        return key


def one_of(cfg, key: str, choices) -> None:
    if cfg[key] not in choices:
        raise UserError(f"{full_key(cfg, key)}={cfg[key]!r} is not one of: {', '.join(map(str, choices))}")


def at_least(cfg, key: str, low: float, what: str = "") -> None:
    value = cfg[key]
    if value is not None and not (math.isfinite(value) and value >= low):
        raise UserError(f"{full_key(cfg, key)}={value} must be a finite number >= {low:g}{what}")


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """A request's sampling settings, by one rule wherever they come from: a config (check_decoding) or a library
    caller's DecodeSpec (spd.session.open_session)."""
    for key, value, low, what in (("temperature", temperature, 0, " (0 = greedy)"), ("top_k", top_k, 0, " (0 = off)")):
        if not (math.isfinite(value) and value >= low):
            raise UserError(f"{key}={value} must be a finite number >= {low:g}{what}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise UserError(f"top_p={top_p} must be in (0, 1]")


def check_tree(cfg) -> None:
    """W > 1: which methods draft trees."""
    trees = ", ".join(name for name, m in METHODS.items() if m.decoder != AR)
    if cfg.method is None or METHODS[cfg.method].decoder == AR:
        raise UserError(f"W={cfg.W}: draft trees need a drafting method; add method= one of {trees}, or use W=1")


def check_blocks(cfg) -> None:
    """weights=q4 multiplies a GGUF file's own blocks, in float32 rows, on a CPU (spd.targets.blocks)."""
    if not resolve_source(cfg.target).gguf_file:
        raise UserError(f"weights=q4 multiplies a GGUF file's own 4- and 8-bit blocks; target={cfg.target} is not a "
                        ".gguf file: use weights=float32 or a .gguf target")
    if cfg.dtype != "float32" or cfg.device != "cpu":
        raise UserError(f"weights=q4 runs float32 rows on a CPU (dtype={cfg.dtype}, device={cfg.device} asked); "
                        "set dtype=float32 device=cpu or use weights=float32")
    if cfg.get("compile"):
        raise UserError("weights=q4 multiplies in the suite's own kernel, which torch.compile cannot trace (a compiled "
                        "step multiplies float32 weights with F.linear); use compile=false or weights=float32")


def check_decoding(cfg) -> None:
    """The keys every decoding command shares (spd.spec.DecodeKeys: generate, chat, serve, eval): what can be refused
    before any model loads."""
    if cfg.method is not None:
        one_of(cfg, "method", DECODING_METHODS)
    one_of(cfg, "dtype", DTYPE_NAMES)
    one_of(cfg, "weights", WEIGHT_NAMES)
    if cfg.weights == "q4":
        check_blocks(cfg)
    one_of(cfg, "runtime", tuple(RUNTIMES))
    one_of(cfg, "controller", CONTROLLERS)
    if not DEVICE.match(cfg.device):
        raise UserError(f"device={cfg.device!r} is not a device; use cpu, cuda, cuda:<index> or mps")
    at_least(cfg, "n", 1, " (pipeline stages)")
    at_least(cfg, "draft_length", 1, " (a chain's draft tokens per cycle)")
    for keys in METHOD_KEYS.values():        # each method's own keys check themselves
        own_keys(keys, cfg).check()
    at_least(cfg, "lookup_min_ngram", 1, " (tokens a context match needs)")
    at_least(cfg, "W", 1, " (children per draft-tree node; 1 = a chain)")
    at_least(cfg, "tree_nodes", 1, " (drafted nodes per verification)")
    at_least(cfg, "children", 1, " (candidates drafted per tip)")
    at_least(cfg, "draft_layers", 1, " (the draft model's layers)")
    at_least(cfg, "segment", 1, " (nodes per segment)")
    if cfg.children is not None and (cfg.method is None or METHODS[cfg.method].decoder != PIPELINE):
        raise UserError(f"children={cfg.children} sets a pipelined tree's candidates per tip; add method=pipedec "
                        "(or spd), or drop children=")
    if cfg.W > 1:
        check_tree(cfg)
    if cfg.draft_source is not None:
        sources = METHODS[cfg.method or "spd"].sources
        if not sources:
            raise UserError(f"draft_source={cfg.draft_source} chooses a pipelined drafter's source; method={cfg.method} "
                            "has none: drop draft_source= (method=lookup is the lookup on its own)")
        if cfg.draft_source not in sources:
            raise UserError(f"{full_key(cfg, 'draft_source')}={cfg.draft_source!r} is not one of: {', '.join(sources)} "
                            f"(method={cfg.method or 'spd'}'s sources)")
    if cfg.lookup_max_ngram < cfg.lookup_min_ngram:
        raise UserError(f"lookup_max_ngram={cfg.lookup_max_ngram} is below lookup_min_ngram={cfg.lookup_min_ngram}; "
                        "raise it")
    on_cuda = cfg.device.startswith("cuda")
    rt = runtime(cfg.runtime)
    if rt.cuda and not on_cuda:
        others = " / ".join(f"runtime={r.name}" for r in RUNTIMES.values() if not r.cuda)
        raise UserError(f"runtime={rt.name} runs {rt.help}; device={cfg.device} has none: use device=cuda, or "
                        f"{others}")
    if cfg.cuda_graphs and not on_cuda:
        raise UserError(f"cuda_graphs=true replays CUDA graphs; device={cfg.device} has none: use device=cuda or "
                        "drop cuda_graphs")
    if cfg.cuda_graphs and not rt.graphs:
        graphed = " or ".join(f"runtime={r.name}" for r in RUNTIMES.values() if r.graphs)
        raise UserError(f"cuda_graphs=true is for {graphed}; runtime={rt.name} runs {rt.help}, eagerly")
    # a method the runtime runs no decoder for, or keys its decoder does not take (spd.decoders' rows)
    refused = refusal(METHODS[cfg.method or "spd"], rt, cfg.cuda_graphs, cfg.W, cfg.draft_source, cfg.source_pricing)
    if refused:
        raise UserError(refused)
    if cfg.compile and not rt.device_step:
        stepped = " or ".join(f"runtime={r.name}" for r in RUNTIMES.values() if r.device_step)
        raise UserError(f"compile=true compiles the device step of {stepped}; add it, or drop compile")
    at_least(cfg, "max_new_tokens", 1, " (tokens to generate)")
    at_least(cfg, "module_layers", 1)
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    at_least(cfg, "seed", 0)  # and below 2**63: check_numbers
    at_least(cfg, "threads_per_stage", 1)
    if not 0 <= cfg.master_port <= 65535:
        raise UserError(f"master_port={cfg.master_port} must be in [0, 65535] (0 = any free port)")
    if not (math.isfinite(cfg.timeout_s) and cfg.timeout_s > 0):
        raise UserError(f"timeout_s={cfg.timeout_s} must be a positive number of seconds")
    bounds = cfg.stage_bounds
    if bounds is not None and bounds != "balanced" and not (
            OmegaConf.is_list(bounds) and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)):
        raise UserError(f"stage_bounds={bounds!r}: give the inner boundaries as a list of integers (e.g. [10, 20]) "
                        "or 'balanced'")


def load_config(schema: type, path: str | None, overrides: list[str], text: dict | None = None):
    """Merge schema defaults, an optional YAML file and `key=value` overrides; check the result with the schema's
    `check` (ranges, enumerations: everything that needs no model or data); return it read-only.

    Values of text keys (`prompt=`, `label=`, paths) are taken verbatim, never parsed as YAML, so `: `, `#`,
    brackets and quotes survive; `null` unsets an optional one. Other values are YAML (`n=5`, `[10, 20]`).
    `text` sets keys to values that are already text (a prompt read from a file, stdin or a positional argument)."""
    base = OmegaConf.structured(schema)
    try:
        layers = [base]
        if path is not None:
            layers.append(read_config_file(path))
        parsed, verbatim = [], {}
        for item in overrides:
            key, value = split_override(item)
            kind = field_type(schema, key)
            if kind is not None and _is_text(kind) and not (value == "null" and kind is not str):
                verbatim[key] = escape_interpolation(value)
            else:
                parsed.append(item)
        layers.append(OmegaConf.from_dotlist(parsed))
        for key, value in (text or {}).items():
            verbatim[key] = None if value is None else escape_interpolation(value)
        text_layer = OmegaConf.create()
        for key, value in verbatim.items():
            OmegaConf.update(text_layer, key, value, force_add=True)
        layers.append(text_layer)
        cfg = OmegaConf.merge(*layers)
        OmegaConf.to_container(cfg, resolve=True)  # a bad interpolation (in a YAML file) fails here, as a UserError
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        first = str(exc).splitlines()[0]
        if "not in struct" in first or "Key '" in first and "not" in first:
            raise UserError(f"{unknown_key(schema, str(key))}; valid keys: {', '.join(base.keys())}") from None
        raise UserError(wrong_type(base, str(key), first) or f"bad value for config key {key!r}: {first}") from None
    except ValueError as exc:  # overrides that cannot stack, e.g. a=[x] then a.b=: a key below a list's
        raise UserError(f"{_mistyped(base, overrides)}: no override can set a key inside a list value "
                        f"({str(exc).splitlines()[0]})") from None
    except TypeError:  # omegaconf: a mapping given to a list key (or the reverse) is a TypeError, not its own error
        raise UserError(f"{_mistyped(base, overrides)}: the value's shape does not fit the key (a list key needs "
                        "[a, b], a section needs its own keys)") from None
    except yaml.YAMLError as exc:  # a value YAML cannot read, e.g. n=[1,
        raise UserError(f"an override is not valid YAML ({_yaml_problem(exc)}); quote or fix it") from None
    check_numbers(cfg)
    resolve_dtype(cfg)
    run_checks(schema, cfg)
    resolve_seed(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def resolve_dtype(cfg) -> None:
    """dtype=null: bfloat16 on a CUDA device (a user's 8B target fits one GPU), float32 elsewhere (the CPU
    reference), so everything downstream sees a dtype's name."""
    if "dtype" in cfg and cfg.dtype is None and "device" in cfg:
        cfg.dtype = "bfloat16" if str(cfg.device).startswith("cuda") else "float32"


def resolve_seed(cfg) -> None:
    """seed=null (generate, chat, serve): a fresh seed for this run when it samples, 0 when it is greedy (which
    ignores it; an untrained module stays the same run to run), so everything downstream sees an int. eval's default
    is a fixed seed (0), and the trainer's too."""
    if "seed" in cfg and cfg.seed is None:
        import secrets

        cfg.seed = secrets.randbelow(2 ** 31) if cfg.temperature > 0 else 0


KINDS = {"Integer": "a whole number", "Float": "a number", "Boolean": "true or false"}


def wrong_type(base, key: str, message: str) -> str | None:
    """A value of the wrong type, in the suite's words: what the key takes and its default (OmegaConf's own message
    names Python types), or None for any other error."""
    found = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", message) or \
        re.search(r"Value '(.*)' is not a valid (bool)", message)
    if not found:
        return None
    kind = KINDS.get(found[2], "true or false" if found[2] == "bool" else found[2].lower())
    default = OmegaConf.select(base, key)
    shown = json.dumps(default) if isinstance(default, bool) else default
    return f"{key}={found[1]} is not {kind}; give {kind}" + (f", e.g. {key}={shown} (its default)"
                                                               if default is not None else "")


def _mistyped(base, overrides: list[str]) -> str:
    """Which `key=value` cannot be merged into the schema (a config file's value, when none of them)."""
    for item in overrides:
        try:
            OmegaConf.merge(base, OmegaConf.from_dotlist([item]))
        except (TypeError, OmegaConfBaseException, yaml.YAMLError):
            return f"bad value for config key {split_override(item)[0]!r}"
    return "a value in the config file has the wrong shape"


def run_checks(schema: type, cfg) -> None:
    """Each section's `check` (nested sections first), then the schema's own."""
    for name, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):
            run_checks(kind, cfg[name])
    check = getattr(schema, "check", None)
    if check is not None:
        check(cfg)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(exc, 'problem', None) or type(exc).__name__}{where}"


def read_config_file(path: str):
    """A YAML mapping of config keys, or a one-line UserError naming what is wrong with the file."""
    if not os.path.exists(path):
        raise UserError(f"config file {path!r} does not exist")
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} is not a file; give a YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            data = OmegaConf.create(f.read())  # OmegaConf's YAML reader (1e-4 is a float), parsed once
    except UnicodeDecodeError:
        raise UserError(f"config file {path!r} is not text (not UTF-8); give a YAML file") from None
    except yaml.YAMLError as exc:
        raise UserError(f"config file {path!r} is not valid YAML ({_yaml_problem(exc)}); fix it") from None
    except AssertionError:  # omegaconf asserts on a document that is a single value (e.g. `0`)
        raise UserError(f"config file {path!r} holds a single value, not a mapping of keys to values "
                        "(key: value lines)") from None
    if not OmegaConf.is_dict(data):
        raise UserError(f"config file {path!r} holds a YAML list, not a mapping of keys to values (key: value lines)")
    return data


def check_numbers(cfg, prefix: str = "") -> None:
    """Every number in every schema is finite and fits in 64 bits: nan/inf and 20-digit integers are typos."""
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            check_numbers(value, name + ".")
            continue
        for item in (value if OmegaConf.is_list(value) else [value]):
            if isinstance(item, float) and not math.isfinite(item):
                raise UserError(f"{name}={item} is not a finite number")
            if isinstance(item, int) and not isinstance(item, bool) and not -2**63 <= item < 2**63:
                raise UserError(f"{name}={item} is out of range (it must fit in 64 bits)")


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg)

