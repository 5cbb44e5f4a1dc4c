"""The eval output directory: its resolved config, the per-sample JSONL it resumes from, atomic summary files."""

from __future__ import annotations

import json
import os

from spd.errors import UserError
from spd.paths import check_writable_dir, read_run_config

CONFIG_FILE, SAMPLES_FILE = "config.json", "samples.jsonl"
# keys that may change between a run and its resumption: they select work or outputs, not the numbers
RESUMABLE_KEYS = {"limit", "datasets", "resume", "output_dir", "wandb", "calibrate", "trace_cache_dir", "batch_size"}


def write_json(path: str, payload) -> None:
    """payload as JSON at path, whole or not at all (a temporary file renamed), its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(path + ".tmp", path)


def check_output_dir(directory: str, resolved: dict, resume: bool) -> None:
    """Read-only preflight: the directory can hold this eval (new, empty, or this config's run to resume)."""
    check_writable_dir(directory, "output_dir")
    config_path = os.path.join(directory, CONFIG_FILE)
    if os.path.isdir(directory) and os.listdir(directory):
        if not os.path.isfile(config_path):
            raise UserError(f"output_dir={directory!r} is not empty and was not written by `spd-infer eval`; "
                            "choose a new or empty directory")
        previous = read_run_config(config_path, f"delete {directory!r} or choose a new output_dir")
        if "datasets" not in previous or _fixed(previous) != _fixed(resolved):
            raise UserError(f"output_dir={directory!r} holds an eval with a different config; use a new output_dir "
                            "(only limit, datasets and wandb may change when resuming)")
        if not resume:
            raise UserError(f"output_dir={directory!r} already holds results and resume=false; use a new output_dir")


class EvalOutput:
    """Opened once the run is known to start (check_output_dir passed, the model loaded): only then is anything
    written."""

    def __init__(self, directory: str, resolved: dict):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        write_json(os.path.join(directory, CONFIG_FILE), resolved)
        self.samples = self._read_samples()

    def _read_samples(self) -> list[dict]:
        path = os.path.join(self.directory, SAMPLES_FILE)
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line torn by an interruption: that sample is redone
                        break
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return rows

    def done(self) -> set[tuple[str, str]]:
        return {(r["dataset"], str(r["question_id"])) for r in self.samples}

    def append(self, record: dict) -> None:
        with open(os.path.join(self.directory, SAMPLES_FILE), "a") as f:
            f.write(json.dumps(record) + "\n")
        self.samples.append(record)


def _fixed(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in RESUMABLE_KEYS}
