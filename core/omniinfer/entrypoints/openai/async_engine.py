"""AsyncLLMEngine: one thread steps an `LLMEngine`; asyncio callers stream its outputs.

    event loop (HTTP handlers)              engine thread
    generate() -> ("add", ...) ----------->  drain commands: add_request / abort_request
                 <- future result/error ---  step() -> RequestOutputs
    async for out in stream  <-------------  one call_soon_threadsafe per step per event loop

The `LLMEngine` is touched only by the engine thread, so it needs no locks: add and abort
are commands queued for the thread and run between steps, which is how a new request joins
the running batch. A request whose consumer goes away (client disconnect, cancellation)
queues an abort, which frees its blocks at the next step boundary. If a step raises, or a
worker dies (noticed at once, idle or busy, through the executor's `on_failure`), every
waiting caller gets `EngineDeadError` instead of hanging, and so does every later call.

A dead worker normally makes the step in flight raise within a second (gloo fails an
operation whose peer's socket closed). Should the engine thread still be inside that step
`STUCK_STEP_GRACE_S` after the executor reported the failure (a collective that never
noticed: it would wait for the process group's timeout, minutes), a watchdog ends every
request itself. The engine thread then only leaves: the request table it shares with the
watchdog is guarded by a lock, taken between steps, never during one.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from omniinfer.engine.llm_engine import LLMEngine
from omniinfer.engine.outputs import RequestOutput
from omniinfer.logger import init_logger
from omniinfer.sampling.params import SamplingParams

logger = init_logger(__name__)

STUCK_STEP_GRACE_S = 5.0  # a worker failed: how long the step in flight has to raise by itself


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can be served any more."""


class RequestEndedError(RuntimeError):
    """The server ended the request before it finished (e.g. at the end of a graceful shutdown)."""


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_tokens: int = 0  # generated tokens seen so far (all samples)
    last_token_time: float | None = None  # monotonic time of the last step that added tokens


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # a closed event loop: its callers are gone
        loop.call_soon_threadsafe(fn, *args)


_IDLE = {f"num_{state}{unit}": 0 for state in ("running", "waiting", "swapped")
         for unit in ("", "_requests")}


def _deliver(batch: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class AsyncLLMEngine:
    """Serve an `LLMEngine` to asyncio code from a dedicated thread.

    `metrics` (optional) receives `on_request_output(out, ...)` for every output and
    `log_stats(stats)` every `stats_interval_s` seconds while there is work (0 disables).
    `on_dead` (optional) is called from the engine thread once the engine has failed.
    """

    def __init__(self, engine: LLMEngine, *, metrics=None, stats_interval_s: float = 10.0,
                 on_dead=None):
        self.engine = engine
        self.metrics = metrics
        self.stats_interval_s = stats_interval_s
        self.on_dead = on_dead
        engine.executor.on_failure = self._on_worker_failure
        self._lock = threading.Lock()  # self._requests and the dying: the engine thread vs the watchdog
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[str, _Request] = {}
        self._stop = False
        self.dead_error: str | None = None
        self.last_stats: dict = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="omniinfer-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio side -------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def stats(self) -> dict:
        """The engine's counters after the latest step (a snapshot; safe from any thread)."""
        return self.last_stats

    async def generate(self, request_id: str, prompt, params: SamplingParams,
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs (text and tokens so far) until it finishes.

        Raises ValueError/TypeError for input the engine refuses (nothing is queued then) and
        EngineDeadError once the engine loop has failed. Leaving the iteration early aborts
        the request."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        request = _Request(loop, asyncio.Queue())
        added = loop.create_future()
        self._send(("add", request_id, prompt, params, request, added))
        if self.dead_error is not None or self._stop:  # the loop may have stopped before it saw the add
            added.cancel()
            self._check_alive()
        finished = False
        try:
            await added
            while True:
                item = await request.queue.get()
                while not request.queue.empty():  # outputs are cumulative: keep only the latest
                    if isinstance(item, BaseException) or item.finished:
                        break
                    item = request.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def end_all(self, message: str) -> None:
        """End every unfinished request now: its caller gets RequestEndedError(message)."""
        self._send(("end_all", message))

    def check_health(self) -> str | None:
        """Why the engine cannot serve (its loop failed, or a worker has died and the loop has
        not noticed yet), or None. Cheap; safe from any thread."""
        if self.dead_error is not None:
            return self.dead_error
        try:
            self.engine.executor.check_health()
        except Exception as e:  # noqa: BLE001 - that is the answer
            return f"{type(e).__name__}: {e}"
        return None

    def _wake(self) -> None:
        self._wakeup.set()

    def _on_worker_failure(self) -> None:
        """The executor's report (from its watcher thread): wake the loop, and start the
        watchdog in case the step in flight never returns."""
        self._wake()
        watchdog = threading.Timer(STUCK_STEP_GRACE_S, self._end_if_stuck)
        watchdog.daemon = True
        watchdog.start()

    def _end_if_stuck(self) -> None:
        with self._lock:
            if self.dead_error is not None or self._stop:
                return  # the loop noticed by itself
            try:
                self.engine.executor.check_health()
                return  # (a failure the executor no longer reports: nothing to do)
            except Exception as e:  # noqa: BLE001 - the failure is the point
                error = e
            self.dead_error = f"{type(error).__name__}: {error}"
            logger.error("the engine thread is still inside a step %.0f s after a worker failed; "
                         "ending every request now: %s", STUCK_STEP_GRACE_S, self.dead_error)
            self._fail_all(EngineDeadError(f"the engine stopped after an error: {self.dead_error}"))
            self.last_stats = dict(self.last_stats, **_IDLE)
        if self.on_dead is not None:
            self.on_dead()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread (waiting callers get EngineDeadError); the engine stays usable."""
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread and shut the engine down (its workers, processes)."""
        self.stop(timeout_s)
        self.engine.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error}")
        if self._stop:
            raise EngineDeadError("the engine is shut down")

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        last_log = time.monotonic()
        while not self._stop:
            self._wakeup.clear()
            with self._lock:
                if self.dead_error is not None:  # the watchdog ended everything meanwhile
                    return
                self._drain_commands()
            try:
                engine.executor.check_health()  # a dead worker fails the engine even when idle
                outputs = engine.step() if engine.has_unfinished_requests() else None
            except BaseException as e:  # noqa: BLE001 - reported to every caller, then stop
                self._fail(e)
                return
            if outputs is not None:
                with self._lock:
                    self._dispatch(outputs)
            else:
                self.last_stats = engine.stats()
                self._wakeup.wait(timeout=1.0)
            now = time.monotonic()
            if self.stats_interval_s and now - last_log >= self.stats_interval_s:
                if self.metrics is not None:
                    self.metrics.log_stats(self.last_stats, now - last_log)
                last_log = now
        with self._lock:
            self._fail_all(EngineDeadError("the engine is shut down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, request, added = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    _post(request.loop, _resolve, added, e)
                    continue
                self._requests[request_id] = request
                if self.metrics is not None:
                    self.metrics.on_request_added(params)
                _post(request.loop, _resolve, added, None)
            elif command[0] == "end_all":
                self._end_all(RequestEndedError(command[1]))
            elif command[1] in self._requests:  # abort of a request still running
                self.engine.abort_request(command[1])
                del self._requests[command[1]]
                if self.metrics is not None:
                    self.metrics.on_finished_reason("abort")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        self.last_stats = self.engine.stats()
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_step(*self.engine.last_step_tokens)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue
            if self.metrics is not None:
                self.metrics.on_request_output(out, request, now)
            if out.finished:
                del self._requests[out.request_id]
            batches.setdefault(request.loop, []).append((request.queue, out))
        for loop, batch in batches.items():
            _post(loop, _deliver, batch)

    def _end_all(self, error: RequestEndedError) -> None:
        self.engine.abort_request(list(self._requests))
        if self.metrics is not None:
            for _ in self._requests:
                self.metrics.on_finished_reason("abort")
        self._fail_all(error, commands=False)
        self.last_stats = self.engine.stats()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.dead_error is not None:  # the watchdog reported it; the step raised at last
                logger.debug("the stuck step ended: %s: %s", type(error).__name__, error)
                return
            self.dead_error = f"{type(error).__name__}: {error}"
            logger.error("engine step failed; the engine loop stops: %s", self.dead_error,
                         exc_info=error)
            self._fail_all(EngineDeadError(f"the engine stopped after an error: {self.dead_error}"))
        try:  # nothing runs any more: say so in the stats (and /metrics)
            self.engine.abort_request(list(self.engine.groups))
            self.last_stats = dict(self.engine.stats(), **_IDLE)
        except Exception as e:  # noqa: BLE001 - a broken engine may not even manage that
            logger.debug("could not release the failed engine's requests: %s", e)
            self.last_stats = dict(self.last_stats, **_IDLE)
        if self.on_dead is not None:
            self.on_dead()

    def _fail_all(self, error: RuntimeError, commands: bool = True) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request in self._requests.values():
            batches.setdefault(request.loop, []).append((request.queue, error))
        self._requests.clear()
        for loop, batch in batches.items():
            _post(loop, _deliver, batch)
        while commands:  # requests queued but never added
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _post(command[4].loop, _resolve, command[5], error)
