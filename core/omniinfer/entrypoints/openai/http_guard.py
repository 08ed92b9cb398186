"""What stands between the socket and the handlers: bounded, well-formed requests in; an
OpenAI-shaped answer, on a connection that stays usable, for everything else.

* `RequestGuard` (ASGI middleware): a body over `max_body_bytes` is answered 413 without
  being buffered; a trailing slash is dropped from the path (so `/v1/models/` is served, not
  redirected to a Location built from the client's Host header); any exception a handler
  lets out becomes a 500 in OpenAI's shape instead of a reset connection.
* `parse_body`: Content-Type must be JSON (415 otherwise: a cross-site "simple" POST cannot
  make a keyless server generate), UTF-8, no NaN/Infinity, no lone surrogates; large bodies are
  decoded and validated on a worker thread, in a way that never holds the GIL for long, so
  `/health` answers while a 16 MiB request is parsed.
* `H11Protocol`: uvicorn's, answering a request head over h11's size limit (a 1 MB URL) with
  414/431 instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
import re

import h11
from pydantic import ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornH11Protocol

from omniinfer.entrypoints.openai.protocol import APIError
from omniinfer.logger import init_logger

logger = init_logger(__name__)

LARGE_BODY_BYTES = 256 << 10  # larger bodies are parsed off the event loop
# Decoding this many JSON values with the C scanner holds the GIL for ~10 ms; bodies with
# more (commas are a cheap upper bound) use the pure-Python scanner, which lets the event
# loop run every few milliseconds (measured: a 16 MiB list of ints, 0.17 s in one C call).
MAX_C_SCANNED_VALUES = 1 << 17
DRAIN_LIMIT_BYTES = 64 << 20  # read and drop at most this much of a refused body
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class RequestGuard:
    def __init__(self, app, max_body_bytes):
        self.app = app
        self.max_body_bytes = max_body_bytes  # a callable: the server's current limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
        limit = self.max_body_bytes()
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = True
            await send(message)

        length = _content_length(scope)
        if length is not None and length > limit:
            drained = await _drain(receive)
            await _send_error(send, _too_large(limit), close=not drained)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body", False):
                        await _drain(receive)
                    raise _too_large(limit)
            return message

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as e:  # noqa: BLE001 - the last line: answer, keep the connection
            logger.error("unhandled error in %s %s", scope.get("method"), scope.get("path"),
                         exc_info=e)
            if started:  # a response is under way: end it cleanly, nothing more can be said
                await _end_response(send)
                return
            await _send_error(send, APIError(f"{type(e).__name__}: {e}", 500,
                                             type="InternalServerError"))


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is over this server's limit of {limit} bytes "
                    "(--max-body-bytes)", 413, code="request_too_large")


async def _drain(receive) -> bool:
    """Read and drop the rest of a refused body (answering before the client finished sending
    would make the kernel reset the connection under the answer). False: gave up."""
    drained = 0
    while drained <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return False
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


async def _send_error(send, error: APIError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _end_response(send) -> None:
    try:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception as e:  # noqa: BLE001 - it had ended already
        logger.debug("could not end the response: %s", e)


# ---- bodies -------------------------------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_C_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_PY_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_PY_DECODER.scan_once = json.scanner.py_make_scanner(_PY_DECODER)


def _decode(body: bytes):
    try:
        text = body.decode("utf-8")
        decoder = _PY_DECODER if body.count(b",") > MAX_C_SCANNED_VALUES else _C_DECODER
        data = decoder.decode(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(body):
        _check_unicode(data)
    return data


def _check_unicode(data) -> None:
    """A lone surrogate escape ("\\ud800") decodes to a str no tokenizer or encoder accepts."""
    stack = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                top = where.split(".", 1)[0] or None
                raise APIError(f"{where or 'body'} holds invalid Unicode at character {e.start} "
                               "(a lone surrogate); send valid UTF-8 text", param=top) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{where}.{k}" if where else str(k), k))
                stack.append((f"{where}.{k}" if where else str(k), v))
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(value))


def _validate(body: bytes, model_cls):
    data = _decode(body)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(f"{where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"]
                       else None) from None


def check_content_type(request) -> None:
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(f"Content-Type {content_type or '(none)'!r} is not supported; send the body "
                       "as JSON with 'Content-Type: application/json'", 415,
                       code="unsupported_media_type")


async def parse_body(request, model_cls):
    """The request's body as `model_cls`, or an APIError (400, 413, 415)."""
    body = await request.body()
    check_content_type(request)
    if len(body) <= LARGE_BODY_BYTES:
        return _validate(body, model_cls)
    return await asyncio.to_thread(_validate, body, model_cls)


# ---- the HTTP protocol --------------------------------------------------------------------------
LINGER_S = 2.0  # how long a refused connection keeps reading what its client still sends


class H11Protocol(_UvicornH11Protocol):
    """uvicorn's h11 protocol; a request head over h11's limit (a URL or headers of a megabyte)
    gets 414 (the request line alone is too long) or 431, in OpenAI's JSON, and the connection
    then reads and drops what the client still sends before closing: closing with data unread
    makes the kernel reset the connection, and the client never sees the answer."""

    _is_lingering = False

    def data_received(self, data: bytes) -> None:
        if self._is_lingering:
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data
        if len(buffered) < getattr(self.conn, "_max_incomplete_event_size", 16 << 10):
            super().send_400_response(msg)
            return
        if b"\r\n" not in buffered:
            error = APIError("the request line (the URL) is too long", 414, code="uri_too_long")
        else:
            error = APIError("the request headers are too large", 431,
                             code="request_header_fields_too_large")
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=error.status_code, headers=headers),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._is_lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)
