"""A `spd-infer serve` process on a free loopback port for tests: start it, talk to it, read its metrics, stop it
(and whatever it left running)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from spd.cli import main

KEY = "test-key"
READY = re.compile(r"at http://([\d.]+):(\d+)/v1 — ready")


class ServerProcess:
    """`python -m spd.cli serve ...` on port 0; `url` once its ready line is printed."""

    def __init__(self, *args: str, startup_s: float = 180):
        self.proc = subprocess.Popen([sys.executable, "-m", "spd.cli", "serve", "port=0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        found = threading.Event()
        self.port = None

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = READY.search(line)
                if m:
                    self.port = int(m.group(2))
                    found.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not found.wait(startup_s):
            self.proc.kill()
            raise AssertionError(f"no ready line: {''.join(self.lines)}")
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=120)

    def post(self, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, headers={**headers, "content-type": "application/json"},
                          timeout=120, **kw)

    def metrics(self) -> dict:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def greedy_answers_at_once(srv: ServerProcess, model: str, questions: list[str], max_tokens: int) -> list[list[int]]:
    """Each question as its own chat request, all sent at once (so the server batches them): each answer's ids."""
    from concurrent.futures import ThreadPoolExecutor

    client = srv.client()

    def ask(question):
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                              max_tokens=max_tokens, temperature=0)
        return chat.model_extra["spd"]["token_ids"]
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


def generate_json(capsys, *args) -> dict:
    code = main(["generate", *args, "json=true"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def kill_all(srv: ServerProcess) -> None:
    """Whatever a failed assertion left running: the server and its stage processes."""
    for pid in [*children(srv.proc.pid), srv.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    srv.proc.wait(10)


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")
