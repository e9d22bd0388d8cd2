"""Logging: text or JSON lines on stderr, and a request id per HTTP request.

:class:`RequestId` (a pure ASGI middleware, so streaming responses stay streaming) takes the
id from a sane incoming ``X-Request-ID`` or makes one, returns it on every response, and puts
it in :data:`request_id_var` (read by the formatters and by ``app.errors``) and in
``scope["state"]["request_id"]``. :func:`configure_logging` installs one stderr handler on the
root logger, which tierd's, the engine's and uvicorn's loggers (access log included) all reach.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from contextvars import ContextVar
from typing import Any, Literal

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "REQUEST_ID_HEADER",
    "JsonFormatter",
    "RequestId",
    "TextFormatter",
    "configure_logging",
    "current_request_id",
    "quiet_alembic",
    "request_id_var",
    "sane_request_id",
]

REQUEST_ID_HEADER = "X-Request-ID"
request_id_var: ContextVar[str | None] = ContextVar("tierd_request_id", default=None)

_SANE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Loggers whose INFO is noise at start-up (Alembic lists its plugins and each migration step).
_QUIET = ("alembic",)
# uvicorn's loggers: configured here (no handlers of their own, propagating to the root).
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def current_request_id() -> str | None:
    """The id of the HTTP request being handled, or None outside one."""
    return request_id_var.get()


def sane_request_id(value: str | None) -> str | None:
    """``value`` if it is a token fit to echo and log (<=128 of ``[A-Za-z0-9._-]``), else None."""
    if value is not None and _SANE.fullmatch(value):
        return value
    return None


# -- formatters ------------------------------------------------------------------------------


def _ts(record: logging.LogRecord) -> str:
    ms = int(record.msecs)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _ts(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            entry["request_id"] = rid
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
            # uvicorn's access line: (client, method, path, http version, status).
            client, method, path, _version, status = args
            entry.update(client=client, method=method, path=path, status=status)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: message``, with ``[request_id]`` appended inside a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if not rid:
            return line
        first, nl, rest = line.partition("\n")
        return f"{first} [{rid}]{nl}{rest}"


def quiet_alembic(level: int = logging.WARNING) -> None:
    """Alembic's INFO (its plugin list, each migration step) is not for the operator."""
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each record (like logging's last resort), not as it
    was when logging was configured: a caller that swaps stderr for a while (a test runner, an
    embedding) and closes its stand-in must not leave every later record failing on it."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass  # StreamHandler's __init__ and setStream: the stream is always the current stderr


def configure_logging(level: str = "info", fmt: Literal["text", "json"] = "text") -> None:
    """One stderr handler on the root logger, in ``fmt``; uvicorn's loggers propagate to it.

    Run uvicorn with ``log_config=None`` afterwards, so that it keeps this configuration.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = _Stderr()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in _UVICORN:
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
        lg.setLevel(numeric)
    quiet_alembic(numeric)
    # boto's INFO lines ("Found credentials in environment variables.") are noise at every
    # start, and at DEBUG botocore logs the access key id: an object tier's client stays at
    # WARNING whatever tierd's level.
    for name in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(name).setLevel(logging.WARNING)


# -- middleware ------------------------------------------------------------------------------


class RequestId:
    """Pure ASGI middleware: a request id per HTTP request, echoed in ``X-Request-ID``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = None
        for key, value in scope.get("headers", ()):
            if key == b"x-request-id":
                incoming = sane_request_id(value.decode("latin-1"))
                break
        rid = incoming or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = rid
            await send(message)

        token = request_id_var.set(rid)
        await self.app(scope, receive, send_with_id)
        # Not reset when the app raises, on purpose: Starlette's outermost error handler and the
        # server's traceback log run after this frame, in this request's task, and should carry
        # the id too.
        request_id_var.reset(token)
