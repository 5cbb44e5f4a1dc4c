"""The same decode in the main thread and in one long-lived second thread of the same process: why
`spd-infer serve` decodes in its main thread (spd.serve.worker). Alternates thread, main, thread, main, ...

    python -m experiments.decode_thread --repeats 4 --out docs/results/decode_thread.json [key=value ...]

The figure's page: docs/serving.md, "`spd-infer serve` against the same engine in-process".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading

from spd.eval.output import write_json

PROMPT = "Explain how a hash table works, with an example in Python."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="docs/results/decode_thread.json")
    ap.add_argument("keys", nargs="*", help="spd-infer keys (default: the fastest configuration here)")
    args = ap.parse_args()

    from spd.cli import quiet_libraries
    from spd.config import GenerateConfig, load_config
    from spd.engine import open_engine
    from spd.fastest import apply_fastest_default
    from spd.session import encode_chat

    quiet_libraries()
    cfg = load_config(GenerateConfig, None, [*args.keys, f"max_new_tokens={args.max_tokens}"])
    apply_fastest_default(cfg, GenerateConfig, args.keys)
    with open_engine(cfg) as engine:
        ids = encode_chat(engine.session, [{"role": "user", "content": PROMPT}], args.max_tokens)
        engine.run(ids)   # warm, in the main thread (as the server warms itself)
        asks, answers = queue.Queue(), queue.Queue()

        def second_thread():
            while asks.get() is not None:
                answers.put(engine.run(ids)["seconds"])

        worker = threading.Thread(target=second_thread, daemon=True)
        worker.start()
        main_s, thread_s = [], []
        for _ in range(args.repeats):
            asks.put(True)
            thread_s.append(answers.get())
            main_s.append(engine.run(ids)["seconds"])
        asks.put(None)
        method = engine.session.spec.method
    report = {"method": method, "keys": args.keys, "max_tokens": args.max_tokens, "cores": os.cpu_count(),
              "main_thread_s": main_s, "second_thread_s": thread_s,
              "ratio_median": statistics.median(t / m for t, m in zip(thread_s, main_s)),
              "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
