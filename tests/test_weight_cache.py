"""The safetensors weight cache: a load from it equals a load from the source; it is read, not rebuilt, on the
second load; a damaged or half-written cache is detected and rebuilt, never loaded."""

import glob
import json
import os

import pytest
import torch

import spd.targets.weight_cache as wc
from spd.targets.loaded import read_source
from spd.targets.loading import load_target
from spd.targets.source import resolve_source
from spd.targets.tiny import save_tiny_target
from launch import run_python


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPD_CACHE_DIR", str(root))
    return root


@pytest.fixture
def source_reads(monkeypatch):
    """Counts how often the slow source is read."""
    calls = []

    def counting(source, dtype):
        calls.append(source.name)
        return read_source(source, dtype)

    monkeypatch.setattr(wc, "read_source", counting)
    return calls


def assert_same(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    buffers_a, buffers_b = dict(a.model.named_buffers()), dict(b.model.named_buffers())
    assert all(torch.equal(buffers_a[k], buffers_b[k]) and buffers_a[k].dtype == buffers_b[k].dtype for k in buffers_a)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    assert torch.equal(a.model(ids).logits, b.model(ids).logits)
    assert a.fingerprint == b.fingerprint and a.name == b.name
    text = "Q: 2+2? 🌊 [x]\n#y"
    assert a.tokenizer(text)["input_ids"] == b.tokenizer(text)["input_ids"]
    assert a.tokenizer.chat_template == b.tokenizer.chat_template


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_load_equals_the_source(cache, tiny_target_dir, source_reads, dtype):
    direct = read_source(resolve_source(tiny_target_dir), dtype)
    first = load_target(tiny_target_dir, dtype)
    second = load_target(tiny_target_dir, dtype)
    assert source_reads == [os.path.basename(tiny_target_dir)]  # read once, then the cache
    assert_same(direct, first)
    assert_same(direct, second)
    assert second.model.lm_head.weight is second.model.model.embed_tokens.weight  # tied, as in the source


def test_one_cache_per_dtype(cache, tiny_target_dir):
    a = wc.materialize(tiny_target_dir, torch.float32)
    b = wc.materialize(tiny_target_dir, torch.bfloat16)
    assert a != b and os.path.getsize(f"{b}/model.safetensors") < os.path.getsize(f"{a}/model.safetensors")


def flip_byte(path):
    f = f"{path}/model.safetensors"
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(f, "wb").write(bytes(data))


DAMAGE = {
    "a flipped byte": (flip_byte, "does not match its recorded digest"),
    "truncated weights": (lambda p: os.truncate(f"{p}/model.safetensors", 1000), "bytes, not"),
    "no metadata": (lambda p: os.remove(f"{p}/spd_target.json"), "spd_target.json is missing"),
    "garbled metadata": (lambda p: open(f"{p}/spd_target.json", "w").write("{half"), "unreadable"),
    "no tokenizer": (lambda p: os.remove(f"{p}/tokenizer.json"), "tokenizer.json is missing"),
    "no config": (lambda p: os.remove(f"{p}/config.json"), "config.json is missing"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_cache_is_rebuilt(cache, tiny_target_dir, source_reads, capsys, kind):
    damage, reason = DAMAGE[kind]
    good = load_target(tiny_target_dir)
    path = wc.materialize(tiny_target_dir)
    damage(path)
    assert reason in wc.damage(path)
    rebuilt = load_target(tiny_target_dir)
    notice = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[spd]")]
    assert len(notice) == 1 and "is damaged (" in notice[0] and reason in notice[0] and "rebuilding" in notice[0]
    assert len(source_reads) == 2  # the first build and the rebuild
    assert wc.damage(path) is None
    assert_same(good, rebuilt)


def test_half_written_cache_is_never_seen(cache, tiny_target_dir, source_reads, monkeypatch):
    real_save = wc.save_file

    def crash(state, filename, metadata=None):
        real_save(dict(list(state.items())[:2]), filename, metadata=metadata)
        raise KeyboardInterrupt  # killed in the middle of writing

    monkeypatch.setattr(wc, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        wc.materialize(tiny_target_dir)
    targets = cache / "targets"
    assert os.listdir(targets) == []  # neither the half-written copy nor its temporary directory remains
    monkeypatch.setattr(wc, "save_file", real_save)
    path = wc.materialize(tiny_target_dir)
    assert wc.damage(path) is None and len(source_reads) == 2


def test_a_leftover_temporary_directory_is_ignored(cache, tiny_target_dir):
    path = wc.materialize(tiny_target_dir)
    leftover = os.path.join(os.path.dirname(path), ".tmp-target-crashed")
    os.makedirs(leftover)
    open(os.path.join(leftover, "model.safetensors"), "wb").write(b"\x00" * 10)
    assert wc.materialize(tiny_target_dir) == path


def test_key_follows_content_not_timestamps(cache, tmp_path, source_reads):
    target = tmp_path / "target"
    save_tiny_target(str(target), seed=0)
    first = wc.materialize(str(target))
    for name in os.listdir(target):  # new timestamps, same bytes: the same cache
        os.utime(target / name, (1, 1))
    assert wc.materialize(str(target)) == first and len(source_reads) == 1
    save_tiny_target(str(target), seed=1)  # other weights in the same place: another cache
    second = wc.materialize(str(target))
    assert second != first
    assert_same(read_source(resolve_source(str(target)), torch.float32), load_target(str(target)))
    meta = json.load(open(f"{second}/spd_target.json"))
    assert meta["fingerprint"] != json.load(open(f"{first}/spd_target.json"))["fingerprint"]


def test_cli_rebuilds_a_damaged_cache(cache, tiny_target_dir):
    args = ["-m", "spd.cli", "generate", f"target={tiny_target_dir}", "Hi", "max_new_tokens=4",
            "method=ar", "json=true"]
    env = {**os.environ, "SPD_CACHE_DIR": str(cache)}
    good = run_python(args, env=env, timeout=120)
    assert good.returncode == 0 and good.stderr == ""
    (path,) = glob.glob(f"{cache}/targets/*/")
    flip_byte(path.rstrip("/"))
    again = run_python(args, env=env, timeout=120)
    assert again.returncode == 0 and json.loads(again.stdout)["token_ids"] == json.loads(good.stdout)["token_ids"]
    assert "damaged" in again.stderr and "rebuilding" in again.stderr
