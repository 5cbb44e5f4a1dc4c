"""`spd-infer serve` by the clock: time to first token of a short prompt on a warm server, and tokens/s through the
server against the same configuration decoding in-process (`spd.engine`, what `spd-infer generate` runs), under 1
and 4 concurrent clients. Server and in-process decodes alternate (one client: prompt by prompt; four clients: a
batch of 4 concurrent requests, then the same 4 in-process one after another) so the machine's drift falls on both; every server answer is checked token for token against the in-process one (greedy).

    python bench/serve.py --out docs/results/serve.json [key=value ...]   # keys as for spd-infer serve
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts (each: server and in-process)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttft-repeats", type=int, default=10)
    ap.add_argument("--out", default="docs/results/serve.json")
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
            method = engine.session.method
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
