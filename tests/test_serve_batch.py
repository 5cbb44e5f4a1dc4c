"""`spd-infer serve` with requests sharing forwards (max_batch > 1, the lookup chain and AR): every concurrent client
gets its own solo answer, seeds reproduce whatever else runs beside them, one client hanging up or hitting a stop
string leaves the others untouched, the queue beyond the batch answers 429, and SIGTERM with a full batch in flight
exits cleanly."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_process import ServerProcess, generate_json, kill_all, metric

LOOKUP = ["method=lookup", "max_new_tokens=24", "max_batch=4"]


@pytest.fixture(scope="module")
def server(tiny_target_dir):
    srv = ServerProcess(f"target={tiny_target_dir}", *LOOKUP, "max_queue=64")
    try:
        yield srv
        assert srv.stop() == 0, "".join(srv.lines)
    finally:
        kill_all(srv)


def completion(srv, prompt: str, **extra) -> dict:
    r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_clients_each_get_their_solo_answer(server, tiny_target_dir, capsys):
    """12 clients at once (4 decode together, the rest queue), lookup and per-request method=ar mixed, streamed or
    not: each answer equals `spd-infer generate` of its prompt alone, and the metrics add up."""
    assert "up to 4 requests per forward" in "".join(server.lines)
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    solo = {p: generate_json(capsys, f"target={tiny_target_dir}", *LOOKUP, "chat_template=false", f"prompt={p}")
            for p in prompts}
    before = server.metrics()

    def one(i):
        p = prompts[i % len(prompts)]
        extra = {"method": "ar"} if i % 3 == 0 else {}
        if i % 2:
            body = completion(server, p, **extra)
            return p, body["spd"]["token_ids"], body["spd"]["method"]
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": p, "max_tokens": 24, "temperature": 0, "stream": True, **extra}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        import json
        last = json.loads(lines[-1][6:])
        return p, last["spd"]["token_ids"], last["spd"]["method"]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    for i, (p, ids, method) in enumerate(results):
        assert ids == solo[p]["token_ids"], i
        assert method == ("ar" if i % 3 == 0 else "lookup")
    after = server.metrics()
    assert metric(after, "spd_tokens_total") - metric(before, "spd_tokens_total") == \
        sum(len(ids) for _, ids, m in results if m == "lookup")           # plain AR drafts nothing, as before
    assert metric(after, "spd_requests_running") == 0 and metric(after, "spd_queue_depth") == 0
    assert not httpx.get(f"{server.url}/health").json()["running"]


def test_a_seed_gives_the_same_sample_alone_or_in_company(server):
    alone = completion(server, "Tell me", temperature=1.0, seed=5)["spd"]["token_ids"]
    with ThreadPoolExecutor(4) as pool:
        company = list(pool.map(lambda s: completion(server, "Tell me" if s == 5 else f"Other {s}", temperature=1.0,
                                                     seed=s)["spd"]["token_ids"], [5, 6, 7, 8]))
    assert company[0] == alone
    assert any(c != alone for c in company[1:])


def test_a_client_leaving_or_stopping_does_not_touch_the_others(server):
    expected = completion(server, "After the break")["spd"]["token_ids"]
    full = completion(server, "Once")["choices"][0]["text"]
    stop = full[3:6]
    before = server.metrics()
    others = []

    def steady():
        others.append(completion(server, "After the break")["spd"]["token_ids"])

    threads = [threading.Thread(target=steady) for _ in range(2)]
    for t in threads:
        t.start()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "A long story", "max_tokens": 400, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]                           # a few tokens, then hang up
    assert any(line.startswith("data: ") for line in got)
    cut = completion(server, "Once", stop=[stop])
    for t in threads:
        t.join(60)
    assert others == [expected, expected]
    assert cut["choices"][0]["text"] == full[: full.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["running"]:
        assert time.monotonic() < deadline, "the cancelled decode kept running"
        time.sleep(0.1)
    produced = metric(server.metrics(), "spd_tokens_total") - metric(before, "spd_tokens_total")
    assert produced < 400 + 2 * 24 + 24


def test_beyond_the_batch_and_the_queue_requests_get_429(tiny_target_dir):
    srv = ServerProcess(f"target={tiny_target_dir}", "method=ar", "max_batch=2", "max_queue=1")
    try:
        body = {"prompt": "Hi", "max_tokens": 400, "temperature": 0}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: srv.post("/v1/completions", body), range(8)))
        codes = sorted(r.status_code for r in answers)
        assert 1 <= codes.count(200) <= 3 and 429 in codes, codes           # 2 decoding + 1 waiting, at most
        refused = next(r for r in answers if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1
        assert srv.stop() == 0
    finally:
        kill_all(srv)


def test_sigterm_with_a_full_batch_in_flight_exits_cleanly(tiny_target_dir):
    srv = ServerProcess(f"target={tiny_target_dir}", "method=lookup", "max_batch=3", "shutdown_timeout_s=1")
    outcomes, flowing = [], threading.Semaphore(0)

    def stream(i):
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                              json={"prompt": f"Tale {i}", "max_tokens": 450, "temperature": 0, "stream": True}) as r:
                first = True
                for _ in r.iter_lines():
                    if first:
                        flowing.release()
                        first = False
            outcomes.append("ended")
        except httpx.HTTPError as exc:
            outcomes.append(type(exc).__name__)

    try:
        clients = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for c in clients:
            c.start()
        for _ in clients:
            assert flowing.acquire(timeout=30)                              # three decodes in flight
        start = time.monotonic()
        assert srv.stop(signal.SIGTERM, timeout=30) == 0, "".join(srv.lines)
        assert time.monotonic() - start < 20
        for c in clients:
            c.join(30)
        assert len(outcomes) == 3
        assert "Traceback" not in "".join(srv.lines), "".join(srv.lines)
    finally:
        kill_all(srv)


def test_distributed_pipeline_serves_concurrent_clients_together(tiny_target_dir, capsys):
    """runtime=distributed, spd n = 3 (a random module: rollbacks every few tokens), max_batch = 3: five clients at
    once share the stage processes' steps (SEED's schedule), each gets runtime=local's solo answer, one hanging up
    mid-stream leaves the others alone, per-request method=ar is refused in one line, and SIGTERM with requests in
    flight exits cleanly."""
    spd = ["method=spd", "n=3", "max_new_tokens=20", "threads_per_stage=1"]
    srv = ServerProcess(f"target={tiny_target_dir}", *spd, "runtime=distributed", "max_batch=3", "max_queue=16",
                        "shutdown_timeout_s=1")
    try:
        assert "up to 3 requests per forward" in "".join(srv.lines)
        prompts = [f"Story {i}: once upon a time" for i in range(5)]
        solo = {p: generate_json(capsys, f"target={tiny_target_dir}", *spd, "chat_template=false", f"prompt={p}")
                for p in prompts}

        def hang_up():
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                              json={"prompt": "A long story", "max_tokens": 400, "stream": True}) as r:
                lines = r.iter_lines()
                return [next(lines) for _ in range(3)]

        with ThreadPoolExecutor(6) as pool:
            left = pool.submit(hang_up)
            answers = list(pool.map(lambda p: completion(srv, p, max_tokens=20), prompts))
            assert left.result()
        for p, body in zip(prompts, answers):
            assert body["spd"]["token_ids"] == solo[p]["token_ids"], p
            assert body["spd"]["rollbacks"] == solo[p]["rollbacks"]
        refused = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "method": "ar"})
        assert refused.status_code == 422 and "max_batch=1" in refused.json()["error"]["message"]
        streams = [threading.Thread(target=hang_up) for _ in range(2)]
        for t in streams:
            t.start()
        time.sleep(1.0)
        assert srv.stop(signal.SIGTERM, timeout=30) == 0, "".join(srv.lines)
        assert "Traceback" not in "".join(srv.lines), "".join(srv.lines)
    finally:
        kill_all(srv)
