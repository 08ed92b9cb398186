"""The FastAPI app behind `omniinfer serve` (`run.py` runs it under uvicorn).

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/v1/models/{id} (404 in OpenAI's shape for an id not served),
/openapi.json, /health (503 while loading, while shutting down and once the engine or a
worker has failed; 500 if loading failed), /metrics (Prometheus), /version. Every error is
OpenAI's JSON shape (http_guard.py makes sure of it). With an API key, everything but
/health, /metrics and /version needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from omniinfer.entrypoints.openai.http_guard import RequestGuard, parse_body
from omniinfer.entrypoints.openai.limits import ServerLimits
from omniinfer.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from omniinfer.entrypoints.openai.protocol import (
    GENERATION_DEFAULTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from omniinfer.entrypoints.openai.serving_chat import create_chat_completion, render_messages
from omniinfer.entrypoints.openai.serving_common import ServingContext
from omniinfer.entrypoints.openai.serving_completion import create_completion
from omniinfer.logger import init_logger
from omniinfer.version import __version__

logger = init_logger(__name__)

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


class ServerState:
    """What the app serves: nothing while the model loads, then a `ServingContext`."""

    def __init__(self, model_name: str, *, api_key: str | None = None,
                 chat_template: str | None = None, stats_interval_s: float = 10.0,
                 limits: ServerLimits | None = None, metrics_prefix: str = "omniinfer",
                 log_requests: bool = False, tools=None, generation=None, reasoning_parser=None):
        self.model_name = model_name
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (reasoning.ReasoningParser)
        self.generation = generation  # GenerationOptions (--generation-config ...); None: 'auto'
        self.log_requests = log_requests
        self.tools = tools  # ToolConfig: --enable-auto-tool-choice, --tool-call-parser
        self.api_key = api_key or None
        self.chat_template = chat_template
        self.stats_interval_s = stats_interval_s
        self.limits = limits or ServerLimits()
        self.ctx: ServingContext | None = None
        self.load_error: str | None = None
        self.is_draining = False  # a graceful shutdown has begun: no new requests
        self.on_engine_dead = None  # called from the engine thread once the engine has failed
        self.metrics = ServerMetrics(model_name, stats_fn=lambda: self.ctx.engine.stats()
                                     if self.ctx else {}, health_fn=self.health_error,
                                     prefix=metrics_prefix)

    def attach(self, engine) -> None:
        """Serve a loaded `LLMEngine` (starts its engine thread)."""
        from omniinfer.engine.llm_engine import load_tokenizer
        from omniinfer.entrypoints.openai.async_engine import AsyncLLMEngine

        tokenizer = load_tokenizer(engine.config.model.tokenizer, engine.config.model.trust_remote_code)
        async_engine = AsyncLLMEngine(engine, metrics=self.metrics,
                                      stats_interval_s=self.stats_interval_s,
                                      on_dead=lambda: self.on_engine_dead and self.on_engine_dead())
        self.metrics.bind(engine.config.model.max_model_len)
        defaults = None
        if self.generation is not None:
            defaults = self.generation.defaults(engine.config.model.generation_config, GENERATION_DEFAULTS)
        self.ctx = ServingContext(async_engine, tokenizer, model_name=self.model_name,
                                  chat_template=self.chat_template, limits=self.limits,
                                  log_requests=self.log_requests, generation_defaults=defaults)
        if self.tools is not None:
            self.ctx.tools = self.tools
        self.ctx.reasoning_parser = self.reasoning_parser

    def health_error(self) -> str | None:
        """Why the engine cannot serve (failed, or a worker died), or None."""
        return self.ctx.engine.check_health() if self.ctx is not None else None

    def ready(self) -> ServingContext:
        if self.load_error is not None:
            raise APIError(f"the model failed to load: {self.load_error}", 500,
                           type="InternalServerError")
        if self.ctx is None:
            raise APIError("the model is still loading; retry when GET /health answers 200", 503,
                           type="ServiceUnavailableError")
        if self.is_draining:
            raise APIError("the server is shutting down", 503, type="ServiceUnavailableError",
                           code="server_shutting_down")
        if (error := self.health_error()) is not None:
            raise APIError(f"the engine stopped after an error: {error}", 500,
                           type="InternalServerError", code="engine_dead")
        return self.ctx

    def end_requests(self, message: str) -> None:
        """End every unfinished request with an error (`message`); the engine stays up."""
        if self.ctx is not None:
            self.ctx.engine.end_all(message)

    def shutdown(self) -> None:
        if self.ctx is not None:
            self.ctx.engine.shutdown()
            self.ctx.close()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code)


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


def build_app(state: ServerState, cors=None) -> FastAPI:
    """The app; `cors` (serve_options.HttpOptions) adds CORS headers when it names origins."""
    # /openapi.json is one of the API routes (behind the key); no docs pages
    app = FastAPI(title="omniinfer", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestGuard, max_body_bytes=lambda: state.limits.max_body_bytes)
    if cors is not None and cors.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)
    _add_error_handlers(app)
    _add_ops_routes(app, state)
    app.include_router(_api_routes(state, app))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    # (anything else a handler lets out is answered by RequestGuard: a 500 in this shape)
    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        return _error(APIError(str(e.detail), e.status_code, type="NotFoundError"
                               if e.status_code == 404 else "invalid_request_error"))


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /version and /metrics: never behind the API key (probes and scrapers)."""

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=500)
        if state.ctx is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if (error := state.health_error()) is not None:  # reads the executor: a dead worker
            return JSONResponse({"status": "error", "error": error}, status_code=503)
        if state.is_draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _body(model_cls) -> dict:
    """The OpenAPI description of a JSON request body (the handlers parse it themselves)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model_cls.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model_cls in REQUEST_MODELS:
            model_schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model_cls.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def _api_routes(state: ServerState, app: FastAPI) -> APIRouter:
    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    state.api_key.encode()):
            raise APIError("invalid or missing API key; send 'Authorization: Bearer <key>'", 401,
                           type="authentication_error", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authorize)])

    def model_card(ctx: ServingContext) -> dict:
        return {"id": ctx.model_name, "object": "model", "created": now(), "owned_by": "omniinfer",
                "root": ctx.model_path, "parent": None, "max_model_len": ctx.max_model_len}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state.ready())]}

    @api.get("/v1/models/{model_id:path}")  # ids may hold slashes ("org/name")
    async def model(model_id: str):
        ctx = state.ready()
        ctx.check_model(model_id)
        return model_card(ctx)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return _openapi(app)

    @api.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        result = await _until_disconnect(request, create_completion(state.ready(), body))
        return _SSE(result) if body.stream and not isinstance(result, Response) else result

    @api.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        result = await _until_disconnect(request, create_chat_completion(state.ready(), body))
        return _SSE(result) if body.stream and not isinstance(result, Response) else result

    @api.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest)
        ctx = state.ready()
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = await render_messages(ctx, body.messages,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=False, kwargs=None)
            ids = await ctx.tokenize(text, add_special_tokens=False, param="messages")
        else:
            ids = await ctx.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @api.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest)
        ctx = state.ready()
        ctx.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(f"tokens holds token id {bad[0]}; allowed: 0 <= id < vocab size "
                           f"{ctx.vocab_size}", param="tokens")
        return {"prompt": await ctx.detokenize(body.tokens)}

    return api
