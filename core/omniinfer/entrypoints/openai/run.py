"""`run_server`: the app under uvicorn, the model loading in a thread, and how the server ends.

* SIGTERM / SIGINT: a graceful shutdown. uvicorn stops accepting connections and closes idle
  ones; running requests may finish for up to `shutdown_timeout_s`; then every request still
  unfinished ends with an OpenAI error (503 `server_shutting_down`; a stream gets an error
  event, then `data: [DONE]`) and the server exits 0.
* The engine fails (a step raised, a worker died): waiting requests get their 500, `/health`
  answers 503 (for a second before the port closes), and the server shuts down and exits 1,
  so that a supervisor restarts it;
  `keep_alive_on_engine_death` keeps it up (answering 503/500) instead.
* The model fails to load: exit 1.
"""

from __future__ import annotations

import asyncio
import signal
import threading

from omniinfer.entrypoints.openai.api_server import ServerState, build_app
from omniinfer.entrypoints.openai.http_guard import H11Protocol
from omniinfer.entrypoints.openai.limits import ServerLimits
from omniinfer.logger import init_logger

logger = init_logger(__name__)

# past the shutdown timeout: time for the ended requests' handlers to send their errors
END_GRACE_S = 5.0
# after an engine failure, /health answers 503 this long before the port closes, so that a
# probe or a load balancer sees why (and drains the instance) rather than a refused connection
ENGINE_DEATH_EXIT_DELAY_S = 1.0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; its graceful shutdown ends what is still running at the timeout."""

        state: ServerState

        async def shutdown(self, sockets=None) -> None:
            state = self.state
            state.is_draining = True
            timeout = state.limits.shutdown_timeout_s
            unfinished = state.ctx.engine.engine.get_num_unfinished_requests() if state.ctx else 0
            logger.info("shutting down: %d request(s) running may finish within %.0f s",
                        unfinished, timeout)
            timer = asyncio.get_running_loop().call_later(
                timeout, state.end_requests,
                f"the server is shutting down; the request did not finish within its "
                f"{timeout:g} s shutdown timeout")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server


def run_server(model: str, engine_kwargs: dict, *, host: str = "127.0.0.1", port: int = 8000,
               model_name: str | None = None, api_key: str | None = None,
               chat_template: str | None = None, stats_interval_s: float = 10.0,
               uvicorn_log_level: str = "info", limits: ServerLimits | None = None,
               keep_alive_on_engine_death: bool = False, metrics_prefix: str = "omniinfer",
               log_requests: bool = False, tools=None, options=None) -> int:
    """Serve until interrupted; the model loads in a thread while /health answers 503.

    Returns 1 when the model failed to load or the engine failed (the server stops then),
    else 0. `options`: serve_options.ServeOptions (sampling defaults, HTTP, reasoning parser)."""
    import uvicorn

    from omniinfer.config import EngineArgs
    from omniinfer.engine.llm_engine import LLMEngine
    from omniinfer.entrypoints.serve_options import GenerationOptions, HttpOptions, ServeOptions

    limits = limits or ServerLimits()
    options = options or ServeOptions(GenerationOptions(), HttpOptions())
    state = ServerState(model_name or model, api_key=api_key, chat_template=chat_template,
                        stats_interval_s=stats_interval_s, limits=limits,
                        metrics_prefix=metrics_prefix, log_requests=log_requests, tools=tools,
                        generation=options.generation, reasoning_parser=options.reasoning_parser)
    http = options.http
    server = _server_class()(uvicorn.Config(
        build_app(state, cors=http), host=host, port=port, log_level=uvicorn_log_level,
        http=H11Protocol, timeout_graceful_shutdown=limits.shutdown_timeout_s + END_GRACE_S,
        root_path=http.root_path, ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile))
    server.state = state
    engine_died = threading.Event()

    def on_engine_dead() -> None:
        engine_died.set()
        if keep_alive_on_engine_death:
            logger.error("the engine failed; serving errors until stopped "
                         "(--keep-alive-on-engine-death)")
            return
        logger.error("the engine failed; the server shuts down in %.0f s (exit status 1)",
                     ENGINE_DEATH_EXIT_DELAY_S)
        timer = threading.Timer(ENGINE_DEATH_EXIT_DELAY_S, setattr, (server, "should_exit", True))
        timer.daemon = True
        timer.start()

    state.on_engine_dead = on_engine_dead

    def load() -> None:
        try:
            state.attach(LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            state.load_error = f"{type(e).__name__}: {e}"
            logger.error("could not load %s: %s", model, state.load_error)
            server.should_exit = True
            return
        logger.info("serving %s as %r at %s://%s:%d%s/v1", model, state.model_name,
                    "https" if http.ssl_certfile else "http", host, port, http.root_path)

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
    return 1 if state.load_error or engine_died.is_set() else 0


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt
