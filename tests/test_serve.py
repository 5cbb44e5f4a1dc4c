"""`spd-infer serve` as a real server process on a free loopback port, driven by the `openai` client and raw HTTP:
the answers equal `spd-infer generate`'s, streamed or not; sampling is reproducible by seed; many clients share
one pipeline; disconnects, bad requests, a full queue, SIGTERM / Ctrl-C and a dead stage process are survived or
end the server cleanly; /metrics parses and agrees with the responses."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_process import KEY, ServerProcess, alive, children, generate_json, kill_all, metric
from spd.cli import main

SPD = ["method=spd", "n=3", "max_new_tokens=24"]


@pytest.fixture(scope="module")
def server(tiny_target_dir):
    srv = ServerProcess(f"target={tiny_target_dir}", *SPD, f"api_key={KEY}", "max_queue=64")
    try:
        yield srv
        assert srv.stop() == 0, "".join(srv.lines)
    finally:
        kill_all(srv)


def test_chat_and_completion_equal_generate_streamed_or_not(server, tiny_target_dir, capsys):
    client = server.client()
    question = "What is 12*7?"
    reference = generate_json(capsys, f"target={tiny_target_dir}", *SPD, f"prompt={question}")
    chat = client.chat.completions.create(model=tiny_target_dir,
                                          messages=[{"role": "user", "content": question}], max_tokens=24,
                                          temperature=0)
    spd = chat.model_extra["spd"]
    assert spd["token_ids"] == reference["token_ids"]
    assert chat.choices[0].message.content == reference["text"]
    assert chat.usage.completion_tokens == len(reference["token_ids"])
    assert chat.usage.prompt_tokens == len(reference["prompt_token_ids"])
    assert (spd["K"], spd["rollbacks"]) == (reference["K"], reference["rollbacks"]) and spd["n"] == 3
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=[{"role": "user", "content": question}], model=tiny_target_dir, max_tokens=24, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == reference["text"] and len(pieces) > 2

    plain = generate_json(capsys, f"target={tiny_target_dir}", *SPD, "chat_template=false", "prompt=Once upon a time")
    done = client.completions.create(model=tiny_target_dir, prompt="Once upon a time", max_tokens=24, temperature=0)
    assert done.model_extra["spd"]["token_ids"] == plain["token_ids"] and done.choices[0].text == plain["text"]
    streamed = list(client.completions.create(model=tiny_target_dir, prompt="Once upon a time", max_tokens=24,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain["text"]
    last = streamed[-1]
    assert last.usage.completion_tokens == len(plain["token_ids"])
    assert last.model_extra["spd"]["token_ids"] == plain["token_ids"]
    assert not last.choices and all(c.choices and c.usage is None for c in streamed[:-1])
    # without stream_options no chunk has empty choices (naive clients read choices[0]), and none has usage
    for stream in (client.completions.create(model=tiny_target_dir, prompt="Once upon a time", max_tokens=24,
                                             temperature=0, stream=True),
                   client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], model=tiny_target_dir,
                                                  max_tokens=8, temperature=0, stream=True)):
        chunks = list(stream)
        assert all(len(c.choices) == 1 and c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].model_extra["spd"]["N"] >= 1
    assert [m.id for m in client.models.list().data] == [chat.model]


def test_seeded_sampling_is_reproducible_and_the_seed_matters(server):
    client = server.client()

    def ask(seed):
        out = client.completions.create(model=server_model(client), prompt="Tell me", max_tokens=24, temperature=1.0,
                                        seed=seed)
        return out.model_extra["spd"]["token_ids"]

    first = ask(5)
    assert ask(5) == first
    assert any(ask(seed) != first for seed in (6, 7, 8))


def server_model(client) -> str:
    return client.models.list().data[0].id


def test_stop_strings_end_the_answer_before_them(server):
    client = server.client()
    full = client.completions.create(model=server_model(client), prompt="Once", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = client.completions.create(model=server_model(client), prompt="Once", max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=server_model(client), prompt="Once", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_many_clients_share_one_pipeline(server):
    """8 concurrent clients x 5 requests: all answered, greedy answers right, metrics add up, nothing left queued."""
    client = server.client()
    model = server_model(client)
    prompts = [f"Question number {i}" for i in range(5)]
    expected = {p: client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in prompts}
    before = server.metrics()

    def one_client(c):
        out = []
        for i, p in enumerate(prompts):
            if (c + i) % 2:
                r = client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0)
                out.append((p, r.choices[0].text, r.usage.completion_tokens))
            else:
                chunks = list(client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
                out.append((p, "".join(ch.choices[0].text for ch in chunks if ch.choices),
                            chunks[-1].usage.completion_tokens))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(one_client, range(8)) for r in rs]
    assert len(results) == 40
    assert all(text == expected[p] for p, text, _ in results)
    after = server.metrics()
    tokens = sum(n for _, _, n in results)
    assert metric(after, "spd_tokens_total") - metric(before, "spd_tokens_total") == tokens
    answered = metric(after, "spd_requests_total", endpoint="/v1/completions", status=200) - \
        metric(before, "spd_requests_total", endpoint="/v1/completions", status=200)
    assert answered == 40
    assert metric(after, "spd_queue_depth") == 0 and metric(after, "spd_requests_running") == 0
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["queue"] == 0 and not health["running"]


def test_metrics_agree_with_a_response(server):
    client = server.client()
    before = server.metrics()
    r = client.chat.completions.create(model=server_model(client), messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=24, temperature=0)
    after = server.metrics()
    spd = r.model_extra["spd"]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta[("spd_tokens_total", ())] == spd["N"] == r.usage.completion_tokens
    assert delta[("spd_steps_total", ())] == spd["K"]
    assert delta[("spd_rollbacks_total", ())] == spd["rollbacks"]
    accepted = sum(s["accepted"] for s in spd["acceptance"].values())
    verified = sum(s["verified"] for s in spd["acceptance"].values())
    assert delta[("vllm:spec_decode_num_accepted_tokens_total", ())] == accepted
    assert delta[("vllm:spec_decode_num_drafts_total", ())] == verified == spd["N"] - 1
    assert delta[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == accepted
    assert verified - accepted == spd["rollbacks"]
    assert delta[("spd_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 1
    assert after[("spd_eal", ())] > 0


def test_a_chain_is_counted_the_way_vllm_counts_drafts():
    """Cycles that proposed tokens are drafts; acceptances by position inside each cycle; τ as spd_eal."""
    from prometheus_client import generate_latest

    from spd.metrics import ChainStats
    from spd.serve.metrics import ServerMetrics

    m = ServerMetrics(n=1)
    m.decoded(ChainStats(m=3, N=7, cycles=4, accepted=3, drafted=6, drafting_cycles=3,
                         accepted_per_cycle=[2, 0, 1, 0], sources={"lookup": [5, 3]}))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    assert values[("vllm:spec_decode_num_drafts_total", ())] == 3
    assert values[("vllm:spec_decode_num_draft_tokens_total", ())] == 6
    assert values[("vllm:spec_decode_num_accepted_tokens_total", ())] == 3
    per_pos = {dict(k[1])["position"]: v for k, v in values.items()
               if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 2, "1": 1}
    assert values[("spd_steps_total", ())] == 4 and values[("spd_tokens_total", ())] == 7
    assert values[("spd_drafts_accepted_total", (("source", "lookup"),))] == 3
    assert values[("spd_eal", ())] == 1.5


def test_a_client_that_disconnects_mid_stream_cancels_its_decode(server):
    client = server.client()
    model = server_model(client)
    expected = client.completions.create(model=model, prompt="After the break", max_tokens=20, temperature=0)
    before = server.metrics()
    body = {"model": model, "prompt": "A long story", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]   # a few tokens, then hang up
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["running"]:
        assert time.monotonic() < deadline, "the cancelled decode kept running"
        time.sleep(0.1)
    produced = metric(server.metrics(), "spd_tokens_total") - metric(before, "spd_tokens_total")
    assert 0 < produced < 400
    again = client.completions.create(model=model, prompt="After the break", max_tokens=20, temperature=0)
    assert again.model_extra["spd"]["token_ids"] == expected.model_extra["spd"]["token_ids"]


@pytest.mark.parametrize("body, status, needle", [
    ('{"prompt": "Hi", ', 400, "not valid JSON"),
    ({"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "Hi", "frobnicate": 1}, 400, "Unrecognized request argument supplied: frobnicate"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": [100000]}, 400, "outside the vocabulary"),
    ({"prompt": "Hi", "n": 2}, 422, "n=2"),
    ({"prompt": "Hi", "logprobs": 3}, 422, "logprobs"),
    ({"prompt": "Hi", "method": "eagle3"}, 422, "method='eagle3'"),
    ({"prompt": "Hi", "W": 4}, 422, "W=4"),
    ({"prompt": "Hi " * 3000, "max_tokens": 8}, 413, "context window"),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "gpt-4"),
])
def test_bad_requests_get_openai_errors_and_the_server_is_unharmed(server, body, status, needle):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"]
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_keys_routes_and_chat_shapes(server):
    assert server.post("/v1/completions", {"prompt": "Hi"}, key=None).status_code == 401
    assert server.post("/v1/completions", {"prompt": "Hi"}, key="wrong").json()["error"]["code"] == "invalid_api_key"
    assert server.post("/v1/nothing", {"prompt": "Hi"}).status_code == 404
    assert server.post("/v1/chat/completions", {"messages": []}).status_code == 400
    assert server.post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 4,
             "temperature": 0}
    assert server.post("/v1/chat/completions", parts).json()["choices"][0]["message"]["role"] == "assistant"
    as_ar = server.post("/v1/chat/completions", {**parts, "method": "ar"}).json()
    assert as_ar["spd"]["method"] == "ar"
    assert as_ar["choices"][0]["message"] == server.post("/v1/chat/completions", parts).json()["choices"][0]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200   # health and metrics need no key


@pytest.mark.parametrize("args, needle", [
    (["bogus=1"], "bogus"),
    (["port=70000"], "port=70000"),
    (["max_queue=0"], "max_queue"),
    (["prompt=Hi"], "serve takes its prompts from requests"),
    (["--config", "configs/infer/serve.yaml", "shutdown_timeout_s=-1"], "shutdown_timeout_s"),
])
def test_bad_serve_command_lines_are_one_line_exit_2(capsys, args, needle):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_taken_port_is_refused_before_loading(capsys, server, tiny_target_dir):
    assert main(["serve", f"target={tiny_target_dir}", f"port={server.port}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{server.port}" in err and "port=0" in err


def test_a_full_queue_answers_429_with_retry_after(tiny_target_dir):
    srv = ServerProcess(f"target={tiny_target_dir}", "method=ar", "max_queue=1")
    try:
        body = {"prompt": "Hi", "max_tokens": 400, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: srv.post("/v1/completions", body), range(6)))
        codes = sorted(r.status_code for r in answers)
        assert 200 in codes and 429 in codes, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1 and refused.json()["error"]["type"] == "rate_limit_error"
        assert srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
        assert srv.stop() == 0
    finally:
        kill_all(srv)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_with_a_request_in_flight_ends_the_server_cleanly(tiny_target_dir, sig, code):
    """runtime=distributed: the stage processes must be gone too."""
    srv = ServerProcess(f"target={tiny_target_dir}", "method=spd", "n=2", "runtime=distributed",
                        "controller=own_process", "shutdown_timeout_s=2")
    try:
        signal_in_flight(srv, sig, code)
    finally:
        kill_all(srv)


def signal_in_flight(srv: ServerProcess, sig, code: int) -> None:
    stages = children(srv.proc.pid)
    assert len(stages) >= 2
    body = {"prompt": "Hi", "max_tokens": 450, "temperature": 0, "stream": True}
    outcome, streaming = {}, threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                lines = 0
                for _ in r.iter_lines():
                    lines += 1
                    streaming.set()
                outcome["lines"] = lines
        except httpx.HTTPError as exc:
            outcome["error"] = type(exc).__name__
        streaming.set()

    client = threading.Thread(target=stream)
    client.start()
    assert streaming.wait(30) and not outcome, outcome   # tokens are flowing: the signal finds a decode in flight
    start = time.monotonic()
    assert srv.stop(sig, timeout=30) == code, "".join(srv.lines)
    assert time.monotonic() - start < 20
    client.join(30)
    assert outcome, "the client hung"
    for pid in stages:
        assert not alive(pid), f"stage process {pid} outlived the server"
    assert "Traceback" not in "".join(srv.lines), "".join(srv.lines)


def test_a_dead_stage_process_answers_500_and_ends_the_server(tiny_target_dir):
    srv = ServerProcess(f"target={tiny_target_dir}", "method=spd", "n=2", "runtime=distributed",
                        "controller=first_stage", "timeout_s=5")
    try:
        stage = children(srv.proc.pid)
        assert stage
        os.kill(stage[0], signal.SIGKILL)
        r = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 50, "temperature": 0})
        assert r.status_code == 500 and "stage" in r.json()["error"]["message"]
        assert srv.proc.wait(30) == 1
        assert "Traceback" not in "".join(srv.lines)
    finally:
        kill_all(srv)
