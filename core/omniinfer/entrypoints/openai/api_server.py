"""The FastAPI app behind `omniinfer serve`, and `run_server` (uvicorn + a loader thread).

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health (503 while loading, 500 after an engine failure), /metrics (Prometheus), /version.
Every error is OpenAI's JSON shape. With an API key, everything but /health, /metrics and
/version needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import threading

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from omniinfer.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from omniinfer.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from omniinfer.entrypoints.openai.serving_chat import create_chat_completion
from omniinfer.entrypoints.openai.serving_common import ServingContext
from omniinfer.entrypoints.openai.serving_completion import create_completion
from omniinfer.logger import init_logger
from omniinfer.version import __version__

logger = init_logger(__name__)


class ServerState:
    """What the app serves: nothing while the model loads, then a `ServingContext`."""

    def __init__(self, model_name: str, *, api_key: str | None = None,
                 chat_template: str | None = None, stats_interval_s: float = 10.0):
        self.model_name = model_name
        self.api_key = api_key or None
        self.chat_template = chat_template
        self.stats_interval_s = stats_interval_s
        self.ctx: ServingContext | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics(model_name, stats_fn=lambda: self.ctx.engine.stats()
                                     if self.ctx else {})

    def attach(self, engine) -> None:
        """Serve a loaded `LLMEngine` (starts its engine thread)."""
        from omniinfer.engine.llm_engine import load_tokenizer
        from omniinfer.entrypoints.openai.async_engine import AsyncLLMEngine

        tokenizer = load_tokenizer(engine.config.model.tokenizer)
        async_engine = AsyncLLMEngine(engine, metrics=self.metrics,
                                      stats_interval_s=self.stats_interval_s)
        self.ctx = ServingContext(async_engine, tokenizer, model_name=self.model_name,
                                  chat_template=self.chat_template)

    def ready(self) -> ServingContext:
        if self.load_error is not None:
            raise APIError(f"the model failed to load: {self.load_error}", 500,
                           type="InternalServerError")
        if self.ctx is None:
            raise APIError("the model is still loading; retry when GET /health answers 200", 503,
                           type="ServiceUnavailableError")
        if self.ctx.engine.is_dead:
            raise APIError(f"the engine stopped after an error: {self.ctx.engine.dead_error}", 500,
                           type="InternalServerError", code="engine_dead")
        return self.ctx

    def shutdown(self) -> None:
        if self.ctx is not None:
            self.ctx.engine.shutdown()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code)


async def _parse(request: Request, model_cls):
    try:
        body = await request.json()
    except Exception:  # noqa: BLE001 - any decoding problem is the client's
        raise APIError("the request body is not valid JSON") from None
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(f"{where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"]
                       else None) from None


async def _until_disconnect(request: Request, work):
    """Run `work` unless the client goes away first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():  # the client left: nobody reads this
            return Response(status_code=499)
        raise


class _SSE(StreamingResponse):
    """Server-sent events whose iterator is always closed, so a gone client aborts its requests."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="omniinfer", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_ops_routes(app, state)
    app.include_router(_api_routes(state))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        return _error(APIError(str(e.detail), e.status_code, type="NotFoundError"
                               if e.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        logger.exception("unhandled error in a request")
        return _error(APIError(f"{type(e).__name__}: {e}", 500, type="InternalServerError"))


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /version and /metrics: never behind the API key (probes and scrapers)."""

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=500)
        if state.ctx is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.ctx.engine.is_dead:
            return JSONResponse({"status": "error", "error": state.ctx.engine.dead_error},
                                status_code=500)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _api_routes(state: ServerState) -> APIRouter:
    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    state.api_key.encode()):
            raise APIError("invalid or missing API key; send 'Authorization: Bearer <key>'", 401,
                           type="authentication_error", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authorize)])

    @api.get("/v1/models")
    async def models():
        ctx = state.ready()
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": now(), "owned_by": "omniinfer",
            "root": ctx.model_path, "parent": None, "max_model_len": ctx.max_model_len}]}

    @api.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        result = await _until_disconnect(request, create_completion(state.ready(), body))
        return _SSE(result) if body.stream and not isinstance(result, Response) else result

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        result = await _until_disconnect(request, create_chat_completion(state.ready(), body))
        return _SSE(result) if body.stream and not isinstance(result, Response) else result

    @api.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest)
        ctx = state.ready()
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = ctx.render_chat([m.as_template_input() for m in body.messages],
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=False, kwargs=None)
            ids = ctx.tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = ctx.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"tokens": list(ids), "count": len(ids), "max_model_len": ctx.max_model_len}

    @api.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        ctx = state.ready()
        ctx.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(f"tokens holds token id {bad[0]}; allowed: 0 <= id < vocab size "
                           f"{ctx.vocab_size}", param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return api


def run_server(model: str, engine_kwargs: dict, *, host: str = "127.0.0.1", port: int = 8000,
               model_name: str | None = None, api_key: str | None = None,
               chat_template: str | None = None, stats_interval_s: float = 10.0,
               uvicorn_log_level: str = "info") -> int:
    """Serve until interrupted; the model loads in a thread while /health answers 503.

    Returns 1 when the model failed to load (the server stops then), else 0."""
    import uvicorn

    from omniinfer.config import EngineArgs
    from omniinfer.engine.llm_engine import LLMEngine

    state = ServerState(model_name or model, api_key=api_key, chat_template=chat_template,
                        stats_interval_s=stats_interval_s)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=host, port=port,
                                           log_level=uvicorn_log_level, timeout_graceful_shutdown=5))

    def load() -> None:
        try:
            state.attach(LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            state.load_error = f"{type(e).__name__}: {e}"
            logger.error("could not load %s: %s", model, state.load_error)
            server.should_exit = True
            return
        logger.info("serving %s as %r at http://%s:%d/v1", model, state.model_name, host, port)

    threading.Thread(target=load, name="omniinfer-load", daemon=True).start()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: make that
    # a quiet exit (status 0) instead of a traceback or a kill
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if is_main else None
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if is_main:
            signal.signal(signal.SIGTERM, previous)
        state.shutdown()
    return 1 if state.load_error else 0


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt
