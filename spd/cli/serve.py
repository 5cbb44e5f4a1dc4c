"""`spd-infer serve`: the OpenAI-compatible server (spd.serve) over one warm engine.

Load everything once (target, module, stage processes), decode a few tokens to warm the caches, then listen.
SIGTERM or Ctrl-C: stop accepting, give in-flight requests `shutdown_timeout_s` to finish, cancel the rest, close
the stage processes; exit 0 (130 for Ctrl-C). A pipeline that fails mid-decode ends the server with exit 1."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading

import uvicorn

from spd.engine import open_engine
from spd.errors import UserError
from spd.methods import METHODS
from spd.serve.app import Service, build_app
from spd.serve.metrics import ServerMetrics
from spd.serve.batching import BatchWorker
from spd.serve.worker import DecodeWorker


class Server(uvicorn.Server):
    """uvicorn's server in a thread of its own (decodes run in the main thread, spd.serve.worker), stopped by the
    main thread's signal handlers or by a failed pipeline, and told which."""

    def __init__(self, config: uvicorn.Config, service: Service, ready_line: str):
        super().__init__(config)
        self.service, self.ready_line = service, ready_line
        self.stopped_by: int | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame) -> None:
        if self.stopped_by is None:   # in-flight work gets the grace period, then is cancelled at a token
            grace = threading.Timer(self.service.cfg.shutdown_timeout_s, self.service.worker.cancel_all)
            grace.daemon = True
            grace.start()
        self.stopped_by = self.stopped_by or sig
        self.service.shutting_down = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, file=sys.stderr, flush=True)

    def fail(self, message: str) -> None:
        """The pipeline is gone: stop serving and exit non-zero."""
        print(f"[serve] the pipeline failed, shutting down: {message}", file=sys.stderr, flush=True)
        self.exit_code = 1
        self.service.shutting_down = True
        self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another host= or port= "
                        "(port=0 picks a free one)") from None
    return sock


def warm_up(engine) -> None:
    """A few tokens through every part a request uses, so the first request pays no first-call costs."""
    ids = list(engine.session.loaded.tokenizer("Hello")["input_ids"]) or [0]
    for decoder in {id(d): d for d in (engine.decoder, engine.baseline)}.values():
        for _ in decoder.stream(ids, engine.request(max_new_tokens=4)):
            pass


def terminated(sig, frame):
    raise SystemExit(0)   # SIGTERM while loading: unwind, so the stage processes are closed


def serve(cfg, default: bool = False) -> int:
    logging.basicConfig(level=logging.WARNING, format="[serve] %(message)s")   # one line per refused request
    sock = listen(cfg.host, cfg.port)   # before loading: a taken port is refused at once
    previous = {sig: signal.signal(sig, terminated) for sig in (signal.SIGTERM,)}
    server: Server | None = None
    try:
        with open_engine(cfg, default) as engine:
            warm_up(engine)
            batch = engine.batch_decoder(cfg.max_batch) if cfg.max_batch > 1 else None
            metrics = ServerMetrics(engine.session.staged.n)
            if batch is not None:
                plain = engine.batch_decoder(cfg.max_batch, "ar") if engine.session.spec.method != "ar" else None
                hello = list(engine.session.loaded.tokenizer("Hello")["input_ids"]) or [0]
                for decoder in filter(None, (batch, plain)):
                    for _ in decoder.stream(hello, engine.request(max_new_tokens=4)):
                        pass
                worker = BatchWorker(engine, metrics, cfg.max_queue, batch, plain, on_fatal=lambda m: server.fail(m))
            else:
                worker = DecodeWorker(engine, metrics, cfg.max_queue, on_fatal=lambda message: server.fail(message))
            service = Service(engine, worker, cfg)
            host, port = sock.getsockname()[:2]
            s = engine.session
            how = f"{s.drafts_with}, n={s.staged.n}" if METHODS[s.spec.method].pipelined else s.spec.method
            together = f", up to {cfg.max_batch} requests per forward" if batch is not None else ""
            ready = (f"[serve] {service.model} ({how}{', the default here' if default else ''}, runtime={cfg.runtime}"
                     f"{together}) at http://{host}:{port}/v1 — ready")
            config = uvicorn.Config(build_app(service), log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=cfg.shutdown_timeout_s + 10)   # a backstop
            server = Server(config, service, ready)
            for sig in (signal.SIGTERM, signal.SIGINT):   # uvicorn installs none outside the main thread
                previous.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, server.handle_exit)
            http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="spd-http", daemon=True)
            http.start()
            worker.serve(http.is_alive)
            worker.stop()
            http.join(cfg.shutdown_timeout_s + 15)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if server is not None and not server.started:
        print("[serve] the HTTP server did not start", file=sys.stderr)
        return 1
    if server is not None and server.stopped_by == signal.SIGINT:
        print("[serve] interrupted", file=sys.stderr)
        return 130
    return server.exit_code if server is not None else 0
