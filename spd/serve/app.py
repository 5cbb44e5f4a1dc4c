"""The HTTP face of the engine: OpenAI's completions and chat completions (streamed as server-sent events or
whole), the model list, health and Prometheus metrics. Every decode goes through one `DecodeWorker`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from spd.decoding import Request
from spd.errors import PipelineFailure
from spd.corpora.prompts import conversation_ids
from spd.verify.sampling import SamplingParams
from spd.serve.api import ApiError, ChatBody, CompletionBody, Sampling, validation_error
from spd.serve.worker import DecodeWorker, Job, QueueFull

log = logging.getLogger("spd.serve")


class Service:
    """What the routes share: the engine, its worker and metrics, the model's name and the server's keys."""

    def __init__(self, engine, worker: DecodeWorker, cfg):
        self.engine, self.worker, self.metrics, self.cfg = engine, worker, worker.metrics, cfg
        self.model = engine.session.loaded.name
        self.aliases = {self.model, engine.session.spec.target}   # the name the model reports, and the target= it was loaded by
        self.created = int(time.time())
        self.window = getattr(engine.session.loaded.model.config, "max_position_embeddings", None)
        self.vocab = engine.session.loaded.model.config.vocab_size
        self.shutting_down = False

    # -- a request body -> token ids and a Request ------------------------------------------------------------------
    def check(self, body: Sampling, max_tokens: int | None) -> tuple[Request, bool]:
        if body.model is not None and body.model not in self.aliases:
            raise ApiError(404, f"The model '{body.model}' does not exist; this server serves '{self.model}'",
                           param="model", code="model_not_found")
        body.refuse_unsupported()
        method = self.engine.session.spec.method
        if body.method not in (None, method, "ar"):
            raise ApiError(422, f"method={body.method!r}: this server runs {method} (and plain decoding, method=ar); "
                           f"start it with method={body.method} to serve that", param="method")
        if body.method == "ar" and method != "ar" and getattr(self.worker, "plain", True) is None:
            raise ApiError(422, "method='ar': the stage processes decode several requests together here "
                           "(runtime=distributed, max_batch > 1) and AR would relay one at a time; start the server "
                           "with max_batch=1 to serve it", param="method")
        width = self.engine.session.spec.tree.width
        if body.W not in (None, width):
            raise ApiError(422, f"W={body.W}: this server drafts with W={width} (its pipeline is warm for that width); "
                           f"start it with W={body.W} to serve that", param="W")
        base = self.engine.session.params
        params = SamplingParams(temperature=base.temperature if body.temperature is None else body.temperature,
                                top_k=base.top_k if body.top_k is None else max(0, body.top_k),
                                top_p=base.top_p if body.top_p is None else body.top_p)
        new = max_tokens if max_tokens is not None else self.engine.session.spec.max_new_tokens
        return Request(new, params, body.seed), body.method == "ar" and method != "ar"

    def fit(self, ids: list[int], request: Request) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if self.window and len(ids) + request.max_new_tokens > self.window:
            raise ApiError(413, f"prompt ({len(ids)} tokens) + max_tokens ({request.max_new_tokens}) exceeds the "
                           f"context window of {self.window} tokens; shorten the prompt or lower max_tokens",
                           param="messages", code="context_length_exceeded")

    def completion_ids(self, body: CompletionBody) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, str):
            return list(self.engine.session.loaded.tokenizer(prompt)["input_ids"])
        if prompt and all(isinstance(t, int) for t in prompt):
            outside = [t for t in prompt if not 0 <= t < self.vocab]
            if outside:
                raise ApiError(400, f"prompt token ids {outside[:3]} are outside the vocabulary 0..{self.vocab - 1}",
                               param="prompt")
            return list(prompt)
        raise ApiError(422, "a batch of prompts: this server decodes one prompt per request", param="prompt")

    def chat_ids(self, body: ChatBody) -> list[int]:
        tok = self.engine.session.loaded.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(422, f"model {self.model!r} has no chat template; use /v1/completions")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        return conversation_ids(tok, messages)

    # -- running one -----------------------------------------------------------------------------------------------
    def submit(self, ids: list[int], request: Request, body: Sampling, baseline: bool) -> Job:
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        job = Job(ids, request, body.stops(), baseline, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as full:
            raise ApiError(429, f"{full}: {self.worker.max_queue} requests are already waiting for the pipeline",
                           kind="rate_limit_error", headers={"Retry-After": str(full.retry_after_s)}) from None
        except PipelineFailure as failure:
            raise ApiError(500, f"the pipeline failed: {failure}", kind="server_error") from None
        return job

    def spd_object(self, done: dict, baseline: bool) -> dict:
        stats = done["stats"]
        out = {"method": "ar" if baseline else self.engine.session.spec.method, "N": len(done["token_ids"]),
               "token_ids": done["token_ids"], "seconds": round(done["seconds"], 6),
               "tokens_per_s": len(done["token_ids"]) / done["seconds"] if done["seconds"] > 0 else None}
        if stats is not None:
            d = stats.as_dict()
            out.update({k: d[k] for k in ("n", "K", "alpha", "eal", "rollbacks", "m", "cycles", "tau") if k in d})
            out["acceptance"] = {source: {"verified": v, "accepted": a, "rate": a / v if v else None}
                                 for source, (v, a) in d["sources"].items()}
        return out


def usage(prompt_ids: list[int], done: dict) -> dict:
    n = len(done["token_ids"])
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="spd-infer serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = service.metrics

    def answer(error: ApiError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(error.status)).inc()
        log.warning("%s %d: %s", endpoint, error.status, error.message)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: HttpRequest, error: ApiError):
        return answer(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: HttpRequest, error: RequestValidationError):
        return answer(validation_error(error.errors()), request.url.path)

    @app.exception_handler(HTTPException)
    async def on_http(request: HttpRequest, error: HTTPException):
        message = f"no route {request.method} {request.url.path}" if error.status_code in (404, 405) else \
            str(error.detail)
        return answer(ApiError(error.status_code, message), request.url.path)

    @app.middleware("http")
    async def authorize(request: HttpRequest, call_next):
        key = service.cfg.api_key
        if key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization", "") != f"Bearer {key}":
            return answer(ApiError(401, "Incorrect API key provided; send 'Authorization: Bearer <api_key>'",
                                   code="invalid_api_key"), request.url.path)
        return await call_next(request)

    @app.get("/health")
    async def health():
        failure = service.worker.failure
        state = "failed" if failure else ("shutting_down" if service.shutting_down else "ok")
        body = {"status": state, "model": service.model, "method": service.engine.session.spec.method,
                "runtime": service.engine.session.spec.runtime.name, "queue": service.worker.waiting,
                "running": service.worker.busy, "error": failure}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model, "object": "model", "created": service.created,
                                            "owned_by": "spd", "root": service.model}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        request, baseline = service.check(body, body.max_tokens)
        ids = service.completion_ids(body)
        service.fit(ids, request)
        job = service.submit(ids, request, body, baseline)
        return await respond(job, ids, body, baseline, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        request, baseline = service.check(body, body.max_completion_tokens or body.max_tokens)
        ids = service.chat_ids(body)
        service.fit(ids, request)
        job = service.submit(ids, request, body, baseline)
        return await respond(job, ids, body, baseline, "/v1/chat/completions", chat=True)

    async def respond(job: Job, ids, body: Sampling, baseline: bool, endpoint: str, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": service.model}
        if body.stream:
            with_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(job, ids, head, baseline, endpoint, chat, with_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces = []
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    pieces.append(value)
                    continue
                if kind == "error":
                    raise ApiError(value["status"], value["message"], kind="server_error")
                break
        finally:
            job.cancelled.set()   # no-op once done; a handler cancelled mid-way stops its decode
        metrics.latency.labels(endpoint).observe(time.perf_counter() - job.enqueued)
        metrics.requests.labels(endpoint, "200").inc()
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": value["finish_reason"], "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {**head, "choices": [choice], "usage": usage(ids, value), "spd": service.spd_object(value, baseline)}

    async def sse(job: Job, ids, head: dict, baseline: bool, endpoint: str, chat: bool, with_usage: bool):
        """Server-sent events as OpenAI and vLLM send them: every chunk has one choice, the last its finish_reason
        and the suite's `spd` object; only when the request asked (stream_options.include_usage) does a final chunk
        with empty `choices` carry the usage, every other chunk then holding "usage": null."""
        object_name = "chat.completion.chunk" if chat else "text_completion"
        head = {**head, "object": object_name} | ({"usage": None} if with_usage else {})

        def chunk(text: str | None, finish: str | None, first: bool = False, extra: dict | None = None) -> str:
            if chat:
                delta = ({"role": "assistant", "content": ""} if first else {}) | \
                    ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**head, 'choices': [choice], **(extra or {})})}\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield chunk(value, None)
                    continue
                if kind == "error":
                    error = ApiError(value["status"], value["message"], kind="server_error")
                    metrics.requests.labels(endpoint, str(error.status)).inc()
                    log.warning("%s %d: %s", endpoint, error.status, error.message)
                    yield f"data: {json.dumps(error.body())}\n\n"
                    break
                spd = service.spd_object(value, baseline)
                yield chunk(None, value["finish_reason"], extra={"spd": spd})
                if with_usage:
                    final = {**head, "choices": [], "usage": usage(ids, value), "spd": spd}
                    yield f"data: {json.dumps(final)}\n\n"
                metrics.latency.labels(endpoint).observe(time.perf_counter() - job.enqueued)
                metrics.requests.labels(endpoint, "200").inc()
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()   # the client went away mid-stream: the decode stops at its next token

    return app
