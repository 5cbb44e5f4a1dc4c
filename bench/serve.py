"""`spd-infer serve` by the clock: time to first token of a short prompt on a warm server, and tokens/s through the
server against the same configuration decoding in-process (`spd.engine`, what `spd-infer generate` runs), under 1
and 4 concurrent clients. Server and in-process decodes alternate (one client: prompt by prompt; four clients: a
batch of 4 concurrent requests, then the same 4 in-process one after another) so the machine's drift falls on both; every server answer is checked token for token against the in-process one (greedy).

    python -m bench.serve --out docs/results/serve.json [key=value ...]   # keys as for spd-infer serve

With --clients 1,2,4,8 it measures concurrency instead: for each number C of clients, C threads each send
--per-client streamed chat requests back to back (everyday prompts, each client starting at its own), --rounds
times; the aggregate tokens/s of the round, every request's time to first token (its wait in the queue included)
and to its end, and every answer checked token for token against the same prompt decoded alone in-process.

    python -m bench.serve --clients 1,2,4,8 --out docs/results/serve_clients_default.json [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from spd.eval.output import write_json

SHORT = "What is 12*7?"
PROMPTS = ["What is 12*7?",
           "Write a Python function that checks whether a number is prime, then explain how it works.",
           "Explain how a hash table works, with an example in Python.",
           "Give me three tips for writing clear documentation."]
READY = re.compile(r"at http://[\d.]+:(\d+)/v1 — ready")


def start_server(keys: list[str]) -> tuple[subprocess.Popen, str]:
    cli = os.path.join(os.path.dirname(sys.executable), "spd-infer")
    proc = subprocess.Popen([cli, "serve", "port=0", *keys], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        m = READY.search(line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, f"http://127.0.0.1:{m.group(1)}"
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def ttft(url: str, max_tokens: int) -> tuple[float, float]:
    """Seconds from sending a streamed chat request to its first text, and to its end."""
    body = {"messages": [{"role": "user", "content": SHORT}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    out = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    return {"token_ids": out["spd"]["token_ids"], "wall_s": time.perf_counter() - start}


EVERYDAY = ["What is 12*7?", "Give me three tips for writing clear documentation.",
            "Explain how a hash table works, with an example in Python.", "Write a haiku about autumn rain.",
            "What should I pack for a weekend hiking trip?", "Summarise the plot of Romeo and Juliet in a paragraph.",
            "How do I make a good cup of coffee at home?", "Write a Python function that reverses a string."]


def streamed(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request: seconds to its first text and to its end, and its token ids."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    first, last = None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            last = chunk
    return {"prompt": prompt, "ttft_s": first, "wall_s": time.perf_counter() - start,
            "token_ids": last["spd"]["token_ids"]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def sweep(url: str, solo: dict, clients: list[int], rounds: int, per_client: int, max_tokens: int) -> dict:
    out = {}
    for c in clients:
        runs = []
        for _ in range(rounds):
            def client(i):
                return [streamed(url, EVERYDAY[(i + k) % len(EVERYDAY)], max_tokens) for k in range(per_client)]

            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                answers = [a for batch in pool.map(client, range(c)) for a in batch]
            wall = time.perf_counter() - start
            for a in answers:
                assert a["token_ids"] == solo[a["prompt"]], f"the server's answer differs from solo: {a['prompt']!r}"
            tokens = sum(len(a["token_ids"]) for a in answers)
            runs.append({"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                         "ttft_s": [a["ttft_s"] for a in answers], "request_s": [a["wall_s"] for a in answers]})
        ttfts = [t for r in runs for t in r["ttft_s"]]
        out[str(c)] = {"rounds": runs, "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
                       "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
                       "ttft_max_s": max(ttfts), "request_max_s": max(t for r in runs for t in r["request_s"])}
        print(f"{c} clients: {out[str(c)]['tokens_per_s_median']:.1f} tokens/s, time to first token p50 "
              f"{out[str(c)]['ttft_p50_s']:.2f} s p95 {out[str(c)]['ttft_p95_s']:.2f} s", file=sys.stderr)
    one = out[str(clients[0])]["tokens_per_s_median"]
    for c in clients:
        out[str(c)]["vs_first"] = out[str(c)]["tokens_per_s_median"] / one
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts (each: server and in-process)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttft-repeats", type=int, default=10)
    ap.add_argument("--out", default="docs/results/serve.json")
    ap.add_argument("--clients", default=None, help="e.g. 1,2,4,8: the concurrency sweep instead (see above)")
    ap.add_argument("--per-client", type=int, default=2, help="sweep: requests each client sends back to back")
    ap.add_argument("keys", nargs="*", help="spd-infer serve keys, e.g. method=spd n=2 runtime=distributed")
    args = ap.parse_args()

    from spd.cli import quiet_libraries
    from spd.config import ServeConfig, load_config
    from spd.engine import open_engine
    from spd.fastest import apply_fastest_default
    from spd.session import encode_chat

    quiet_libraries()
    cfg = load_config(ServeConfig, None, [*args.keys, f"max_new_tokens={args.max_tokens}"])
    apply_fastest_default(cfg, ServeConfig, args.keys)
    proc, url = start_server(args.keys)
    if args.clients:
        try:
            with open_engine(cfg) as engine:
                solo = {p: engine.run(encode_chat(engine.session, [{"role": "user", "content": p}],
                                                  args.max_tokens))["token_ids"] for p in EVERYDAY}
                method = engine.session.spec.method
            clients = [int(c) for c in args.clients.split(",")]
            result = sweep(url, solo, clients, args.rounds, args.per_client, args.max_tokens)
        finally:
            proc.terminate()
            code = proc.wait(60)
        write_json(args.out, {"method": method, "keys": args.keys, "max_tokens": args.max_tokens,
                              "per_client": args.per_client, "cores": os.cpu_count(), "clients": result,
                              "server_exit_code": code, "command": " ".join(["python", *sys.argv])})
        return 0
    try:
        with open_engine(cfg) as engine:
            ids = {p: encode_chat(engine.session, [{"role": "user", "content": p}], args.max_tokens) for p in PROMPTS}
            engine.run(ids[SHORT])   # warm, as the server warmed itself
            ttfts = [ttft(url, 32) for _ in range(args.ttft_repeats)]
            inproc_ttft = []
            for _ in range(args.ttft_repeats):   # the in-process analogue: prompt ids to the first verified token
                start = time.perf_counter()
                stream = engine.stream(ids[SHORT], engine.request(max_new_tokens=32))
                next(stream)
                inproc_ttft.append(time.perf_counter() - start)
                stream.close()   # cancelled at its first token, as a client that hangs up
            pairs = []
            for _ in range(args.rounds):
                for p in PROMPTS:
                    served = ask(url, p, args.max_tokens)
                    local = engine.run(ids[p])
                    assert served["token_ids"] == local["token_ids"], f"the server's answer differs: {p!r}"
                    n = len(local["token_ids"])
                    pairs.append({"prompt": p, "tokens": n, "server_tokens_per_s": n / served["wall_s"],
                                  "inprocess_tokens_per_s": n / local["seconds"]})
            # 4 clients at once, against the same 4 requests decoded in-process one after another, round by round
            rounds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                with ThreadPoolExecutor(4) as pool:
                    answers = list(pool.map(lambda p: ask(url, p, args.max_tokens), PROMPTS))
                four_wall = time.perf_counter() - start
                start = time.perf_counter()
                local = [engine.run(ids[p]) for p in PROMPTS]
                serial_wall = time.perf_counter() - start
                assert [a["token_ids"] for a in answers] == [r["token_ids"] for r in local]
                tokens = sum(len(r["token_ids"]) for r in local)
                rounds.append({"tokens": tokens, "server_tokens_per_s": tokens / four_wall,
                               "inprocess_serial_tokens_per_s": tokens / serial_wall,
                               "ratio": serial_wall / four_wall})
            method = engine.session.spec.method
    finally:
        proc.terminate()
        code = proc.wait(60)
    ratios = [r["server_tokens_per_s"] / r["inprocess_tokens_per_s"] for r in pairs]
    report = {
        "method": method, "keys": args.keys, "max_tokens": args.max_tokens, "cores": os.cpu_count(),
        "ttft_s": {"median": statistics.median(t for t, _ in ttfts), "min": min(t for t, _ in ttfts),
                   "max": max(t for t, _ in ttfts)},
        "inprocess_ttft_s": {"median": statistics.median(inproc_ttft), "min": min(inproc_ttft),
                             "max": max(inproc_ttft)},
        "one_client": {"pairs": pairs, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                       "ratio_max": max(ratios),
                       "server_tokens_per_s_median": statistics.median(r["server_tokens_per_s"] for r in pairs),
                       "inprocess_tokens_per_s_median": statistics.median(r["inprocess_tokens_per_s"] for r in pairs)},
        "four_clients": {"rounds": rounds, "requests_per_round": len(PROMPTS),
                         "ratio_median": statistics.median(r["ratio"] for r in rounds),
                         "ratio_min": min(r["ratio"] for r in rounds), "ratio_max": max(r["ratio"] for r in rounds)},
        "server_exit_code": code, "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("method", "ttft_s")} |
                     {"one_client_ratio": report["one_client"]["ratio_median"],
                      "four_clients_ratio": report["four_clients"]["ratio_median"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
