"""OpenAI-compatible HTTP server over the continuous-batching scheduler (FastAPI).

    app = create_app(BatchEngine(artifact_dir), api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /reset_prefix_cache`` (as vLLM's: the
next requests start with a cold prefix cache). Every error is OpenAI-shaped JSON
``{"error": {"message", "type", "param", "code"}}``; a full queue answers 503 with
``Retry-After``. A client that disconnects (streaming or not) has its sequences
cancelled, which frees their KV pages at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from perfx_compiler.errors import ContextLengthError, PerfXError
from perfx_compiler.runtime.api import Tokenizer
from perfx_compiler.runtime.chat import ChatTemplateError
from perfx_compiler.runtime.generate import model_info
from perfx_compiler.runtime.sampling import SamplingParams
from perfx_compiler.serve import protocol as P
from perfx_compiler.serve.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from perfx_compiler.serve.scheduler import QueueFull, RequestHandle, Scheduler, SchedulerClosed, StreamEvent

__all__ = ["create_app"]

log = logging.getLogger("perfx.serve")
_DISCONNECT_POLL_S = 0.25
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/reset_prefix_cache"}


def _error(e: P.RequestError) -> JSONResponse:
    return JSONResponse(P.error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


class _ApiKeyMiddleware:
    """Every request needs ``Authorization: Bearer KEY`` (compared in constant time)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = P.RequestError(
                    "missing or invalid API key; send 'Authorization: Bearer <key>'",
                    status=401,
                    type="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _MetricsMiddleware:
    """Counts HTTP responses by endpoint and status (outermost, so 401s count too)."""

    def __init__(self, app: Any, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.on_request(endpoint, int(message["status"]))
            await send(message)

        await self.app(scope, receive, send_wrapper)


class _Run:
    """The scheduler requests of one HTTP request, bridged from the worker thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
        self.handles: list[RequestHandle] = []
        self.finished = 0

    def callback(self, k: int) -> Callable[[StreamEvent], None]:
        def on_event(ev: StreamEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (k, ev))

        return on_event

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    async def events(self, request: Request | None) -> AsyncIterator[tuple[int, StreamEvent]]:
        """Events until every request finished. With ``request``, polls for a client disconnect (also while
        tokens keep coming) and then cancels everything; streaming responses leave that to Starlette."""
        last_check = self.loop.time()
        while self.finished < len(self.handles):
            item: tuple[int, StreamEvent] | None = None
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout=_DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass
            if request is not None and self.loop.time() - last_check >= _DISCONNECT_POLL_S:
                last_check = self.loop.time()
                if await request.is_disconnected():
                    self.cancel()
                    return
            if item is None:
                continue
            if item[1].request_finished:
                self.finished += 1
            yield item


class Server:
    """State shared by the routes: engine, tokenizer, scheduler and metrics."""

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str | None = None,
        max_queue: int = 64,
        max_batch: int | None = None,
        prefill_chunk: int = 256,
        seed: int | None = None,
        retry_after: float = 1.0,
    ) -> None:
        self.engine = engine
        info = model_info(engine)
        self.model_name = model_name or str(info.get("name") or "perfx-model")
        self.max_context = int(engine.max_context)
        self.tokenizer = Tokenizer.from_file(engine.tokenizer_path, info, engine.manifest.get("chat_template"))
        self.scheduler = Scheduler(
            engine,
            self.tokenizer,
            max_queue=max_queue,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            seed=seed,
            retry_after=retry_after,
        )
        self.metrics = ServingMetrics(self.scheduler.stats, self.model_name)
        self.scheduler.observer = self.metrics
        self.created = P.now()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.RequestError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                status=404,
                param="model",
                code="model_not_found",
            )

    def prepare(self, ids: list[int], params: SamplingParams, param: str = "prompt") -> list[int]:
        try:
            prepared = self.scheduler.prepare(ids, params)
        except ContextLengthError as e:
            raise P.RequestError(str(e), param=param, code="context_length_exceeded") from None
        except PerfXError as e:
            raise P.RequestError(str(e), param=param) from None
        if params.max_tokens is not None and len(prepared) + params.max_tokens > self.max_context:
            raise P.RequestError(
                f"this model's maximum context length is {self.max_context} tokens; the request asks for "
                f"{len(prepared) + params.max_tokens} ({len(prepared)} in the prompt, {params.max_tokens} to "
                "generate): reduce the prompt or max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return prepared

    def submit(self, prompts: list[list[int]], params: SamplingParams, run: _Run) -> None:
        try:
            for k, ids in enumerate(prompts):
                run.handles.append(self.scheduler.submit(ids, params, on_event=run.callback(k), prepared=True))
        except QueueFull as e:
            run.cancel()
            raise P.RequestError(
                str(e),
                status=503,
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))},
            ) from None
        except SchedulerClosed as e:
            run.cancel()
            raise P.RequestError(str(e), status=503, type="server_error", code="shutting_down") from None


async def _parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The body as JSON whatever its Content-Type: curl's ``-d`` sends form-urlencoded, and OpenAI's API
    (as vLLM's) reads the JSON anyway; FastAPI's own body parsing would refuse it with a 400."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise P.RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:  # reported by the same handler as FastAPI's own validation errors
        raise RequestValidationError(e.errors()) from None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _completions(srv: Server, body: P.CompletionRequest, request: Request) -> Response:
    srv.check_model(body.model)
    if body.echo:
        raise P.RequestError("echo is not supported", param="echo", code="unsupported_parameter")
    if body.suffix:
        raise P.RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")
    params = body.sampling_params(body.max_tokens, body.logprobs)
    if body.best_of is not None and body.best_of != params.n:
        raise P.RequestError("best_of must equal n (or be left out)", param="best_of")
    raw = body.prompt
    if isinstance(raw, str):
        raw_prompts: list[str | list[int]] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        raw_prompts = [raw]  # one prompt of token ids
    else:
        raw_prompts = list(raw)
    if not raw_prompts:
        raise P.RequestError("prompt must not be empty", param="prompt")
    prompts = [srv.prepare(srv.tokenizer.encode(p) if isinstance(p, str) else list(p), params) for p in raw_prompts]
    return await _generate(srv, "completion", body, params, prompts, request)


async def _chat(srv: Server, body: P.ChatRequest, request: Request) -> Response:
    srv.check_model(body.model)
    if body.tools:
        raise P.RequestError("tools are not supported", param="tools", code="unsupported_parameter")
    top = body.top_logprobs if body.top_logprobs is not None else 0
    if body.top_logprobs is not None and not body.logprobs:
        raise P.RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(max_tokens, top if body.logprobs else None)
    try:
        text = srv.tokenizer.apply_chat_template(
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt is not False,
            **(body.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise P.RequestError(str(e), param="messages") from None
    prompt = srv.prepare(srv.tokenizer.encode(str(text)), params, "messages")
    return await _generate(srv, "chat", body, params, [prompt], request)


async def _generate(
    srv: Server, kind: str, body: Any, params: SamplingParams, prompts: list[list[int]], request: Request
) -> Response:
    run = _Run(asyncio.get_running_loop())
    srv.submit(prompts, params, run)
    rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
    n = params.n
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(srv, kind, rid, run, n, prompts, include_usage, params),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(run.cancel),  # also when the stream never started
        )
    try:
        async for _ in run.events(request):
            pass
    finally:
        run.cancel()  # no-op once finished; frees the pages if the client left
    choices = []
    completion_tokens = 0
    for k, h in enumerate(run.handles):
        for r in h.results:
            if r is None:  # cancelled before it finished: the client is gone
                return Response(status_code=499)
            if r.error:
                raise P.RequestError(r.error, status=500, type="server_error")
            completion_tokens += len(r.token_ids)
            lp = None
            if kind == "chat":
                if r.logprobs is not None:
                    lp = P.chat_logprobs(r.token_ids, r.logprobs, params.logprobs or 0, srv.token_text)
                choice = {"index": k * n + r.index, "message": {"role": "assistant", "content": r.text}}
            else:
                if r.logprobs is not None:
                    lp = P.completion_logprobs(r.token_ids, r.logprobs, params.logprobs or 0, srv.token_text)
                choice = {"index": k * n + r.index, "text": r.text}
            choice.update(logprobs=lp, finish_reason=r.finish_reason, stop_reason=r.stop_reason)
            choices.append(choice)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": P.now(),
            "model": srv.model_name,
            "choices": choices,
            "usage": P.usage(sum(len(p) for p in prompts), completion_tokens),
        }
    )


async def _stream(
    srv: Server,
    kind: str,
    rid: str,
    run: _Run,
    n: int,
    prompts: list[list[int]],
    include_usage: bool,
    params: SamplingParams,
) -> AsyncIterator[str]:
    created = P.now()
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(index: int, payload: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": index, **payload, "logprobs": extra.pop("logprobs", None), "finish_reason": finish}
        choice.update(extra)
        doc: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": srv.model_name}
        doc["choices"] = [choice]
        if include_usage:
            doc["usage"] = None
        return _sse(doc)

    completion_tokens = 0
    try:
        if kind == "chat":
            for i in range(len(prompts) * n):
                yield chunk(i, {"delta": {"role": "assistant", "content": ""}})
        async for k, ev in run.events(None):  # Starlette cancels this generator on a disconnect
            index = k * n + ev.index
            if ev.error:
                yield _sse(P.error_body(ev.error, "server_error"))
                continue
            completion_tokens += len(ev.token_ids)
            finish = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
            if not ev.text and finish is None and ev.logprobs is None:
                continue
            lp = None
            if ev.logprobs is not None:
                make = P.chat_logprobs if kind == "chat" else P.completion_logprobs
                lp = make(ev.token_ids, ev.logprobs, params.logprobs or 0, srv.token_text)
            payload = {"delta": {"content": ev.text}} if kind == "chat" else {"text": ev.text}
            extra = {"stop_reason": ev.stop_reason} if finish else {}
            yield chunk(index, payload, finish, logprobs=lp, **extra)
        if run.finished < len(run.handles):
            return  # the client went away
        if include_usage:
            doc = {"id": rid, "object": obj, "created": created, "model": srv.model_name, "choices": []}
            doc["usage"] = P.usage(sum(len(p) for p in prompts), completion_tokens)
            yield _sse(doc)
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()  # no-op once finished; on a disconnect this frees the sequences' pages


def create_app(
    engine: Any,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = 64,
    max_batch: int | None = None,
    prefill_chunk: int = 256,
    seed: int | None = None,
    retry_after: float = 1.0,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (a ``BatchEngine``); the scheduler runs while the app is up.

    ``model_name`` is the id clients send as "model" (default: the manifest's model name; ``perfx-serve``
    passes the artifact folder's name or ``--served-model-name``)."""
    srv = Server(
        engine,
        model_name=model_name,
        max_queue=max_queue,
        max_batch=max_batch,
        prefill_chunk=prefill_chunk,
        seed=seed,
        retry_after=retry_after,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.scheduler.start()
        try:
            yield
        finally:
            srv.scheduler.shutdown()

    app = FastAPI(title="PerfX", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(P.RequestError)
    async def _on_request_error(request: Request, e: P.RequestError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
            return _error(P.RequestError(msg, code="invalid_json"))
        # Union members appear in loc ('prompt', 'str'): keep the field path only.
        param = ".".join(x for x in loc if x.isidentifier() and x not in _TYPE_NAMES or x.isdigit())
        what = f"'{param}'" if param else "the request body"
        return _error(P.RequestError(f"{what}: {first.get('msg', 'invalid value')}", param=param or None))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        err = P.RequestError(str(e.detail), status=e.status_code, type=kind, headers=getattr(e, "headers", None))
        return _error(err)

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error(P.RequestError(f"internal error: {e}", status=500, type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completions(srv, await _parse_body(request, P.CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat(srv, await _parse_body(request, P.ChatRequest), request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": srv.model_name,
            "object": "model",
            "created": srv.created,
            "owned_by": "perfx",
            "max_model_len": srv.max_context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        alive = srv.scheduler._thread is not None and srv.scheduler._thread.is_alive()
        if not alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, int]:
        try:
            freed = await asyncio.to_thread(srv.scheduler.clear_prefix_cache)
        except SchedulerClosed as e:
            raise P.RequestError(str(e), status=503, type="server_error", code="shutting_down") from None
        return {"freed_pages": freed}

    # Pure ASGI middleware (streaming passes through untouched); the last added runs first.
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(_MetricsMiddleware, metrics=srv.metrics)
    return app
