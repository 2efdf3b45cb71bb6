"""The request handler of ``persist serve``: mlx-lm's, with the edge an operator needs.

mlx-lm's ``APIHandler`` reads ``Content-Length`` bytes as the client states
them (``-1`` reads until the client closes: a handler thread held forever;
a huge one is a MemoryError), hands the body to generation unchecked, and
answers ``/health`` with its liveness only.  This subclass, before
mlx-lm's code runs:

- reads at most ``max_request_bytes`` (411 without a length, 400 for a bad
  one, 413 past the limit), within the server's request deadline (the
  reaper of ``server_http`` answers 408 and closes a client too slow);
- parses the body strictly and checks every field (``server_requests``):
  400 with a JSON error body naming the field; image parts for a model
  without an image processor are refused here, before mlx-lm would fetch
  their URLs; mlx-lm's own later refusals get the same error body
  (``DocumentedErrors``);
- answers ``GET /health`` (JSON) and ``GET /metrics`` (Prometheus text);
- logs its access lines through ``logging`` (so ``--log-format json`` holds),
  control characters escaped as ``http.server`` does, and counts every
  answer, those ``http.server`` sends itself included.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from mlx_lm.server import APIHandler

from .bounds import RequestLimits
from .disconnect import ClientGone, watching
from .explaining import HEADER, ExplainSlot, explain_asked
from .generation import CLIENT_CLOSED, GenerationFailed, take_error_status
from .hints import RequestHints, take_hints
from .metrics import CONTENT_TYPE
from .request_checks import BadRequest, check_request, normalize, parse_json, public_mark
from .stalls import Progress

if TYPE_CHECKING:
    from .http_edge import DrainingServer

__all__ = ["PersistHandler", "models_without_hf_cache"]

log = logging.getLogger("persist")
access = logging.getLogger("persist.access")
POSTS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
GETS = ("/health", "/metrics", "/v1/models")
KNOWN: dict[str | None, tuple[str, ...]] = {"GET": GETS, "POST": POSTS}
CHUNK = 1 << 16


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None}}


class PersistHandler(APIHandler):
    """One connection (HTTP/1.0: one request).  ``self.server`` is a DrainingServer."""

    server: DrainingServer
    limits = RequestLimits()  # persist serve's subclass holds the operator's (serve.app.serve)
    public_marks = False  # --allow-public-marks: a request may mark its system prompt public
    persist_public_mark = False  # this request marked its system prompt public (checked)
    persist_explain = False  # the client asked for its verdict (serve.explaining)
    persist_hints: RequestHints | None = None  # its retention hints (serve.hints)
    persist_slot: ExplainSlot | None = None  # its verdict, once the lookup ran

    def setup(self) -> None:
        super().setup()
        # every read and write waits at most this long; the reaper bounds the whole request
        self.connection.settimeout(self.server.read_timeout)
        self._token = self.server.deadlines.watch(self.connection, self.server.read_timeout)
        self._code = 0
        # what this connection's client took: a drain cuts off a response nobody reads
        self._progress = Progress(self.wfile)
        self.wfile = self._progress  # type: ignore[assignment]
        self.server.stalls.add(self.connection, self._progress)

    def finish(self) -> None:
        self.server.deadlines.done(self._token)
        self.server.stalls.remove(self._progress)
        super().finish()

    def send_response(self, code: int, message: str | None = None) -> None:
        self._code = code
        super().send_response(code, message)

    def handle_one_request(self) -> None:
        # counted here, so what http.server answers itself (400 for a bad request line,
        # 501 for an unknown method) and mlx-lm's OPTIONS are counted too
        self._code = 0
        try:
            super().handle_one_request()
        finally:
            self._count(self._endpoint(KNOWN.get(getattr(self, "command", None), POSTS + GETS)))

    def log_message(self, format: str, *args: Any) -> None:
        # as http.server does: a request line's ESC or CR never reaches a terminal or log raw
        message = (format % args).translate(self._control_char_table)  # type: ignore[attr-defined]
        access.info("%s %s", self.address_string(), message)

    def _claim(self) -> bool:
        """Take the connection from the reaper; False if it already answered 408."""
        return bool(self.server.deadlines.done(self._token))

    def _endpoint(self, known: tuple[str, ...]) -> str:
        path = (getattr(self, "path", None) or "").split("?")[0]
        if path.startswith("/v1/models"):
            path = "/v1/models"
        return path if path in known else "other"

    def _json(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(data)

    # -- GET -------------------------------------------------------------------

    def do_GET(self) -> None:
        endpoint = self._endpoint(GETS)
        if not self._claim():
            return
        metrics = self.server.metrics
        if endpoint == "/health":
            health = metrics.health()
            self._json(200 if health["generation"]["alive"] else 503, health)
        elif endpoint == "/metrics":
            data = metrics.text()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif endpoint == "/v1/models":
            super().do_GET()
        else:
            self._json(404, _error(f"no such endpoint: GET {self.path}", "not_found"))

    # -- POST ------------------------------------------------------------------

    def do_POST(self) -> None:
        self._post(self._endpoint(POSTS))

    def _count(self, endpoint: str) -> None:
        if self._code:  # nothing sent: the client went away, or the reaper counted its 408
            self.server.metrics.request(endpoint, self._code)

    def _post(self, endpoint: str) -> None:
        raw = self._read_body()
        if raw is None:
            return
        if endpoint == "other":
            self._json(404, _error(f"no such endpoint: POST {self.path}", "not_found"))
            return
        try:
            body = parse_json(raw)
            check_request(endpoint, body, self._takes_images(body), self.public_marks)
            renamed = self.limits.admit(body)
            self.persist_explain = explain_asked(self.headers)
            # read before take_hints strips the persist field mlx-lm never sees
            self.persist_public_mark = public_mark(body)
            self.persist_hints, stripped = take_hints(endpoint, body)
        except BadRequest as e:
            self._json(getattr(e, "status", 400), e.body())
            return
        if normalize(body) or renamed or stripped:
            raw = json.dumps(body).encode()
        # mlx-lm's do_POST reads the body again: from memory, exactly these bytes
        self.path = endpoint  # and routes on the path without its query string
        self.rfile = io.BytesIO(raw)
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(raw))
        take_error_status(0)  # nothing left from an earlier request
        try:
            with watching(self.connection):  # a client that leaves stops its generation
                super().do_POST()
        except Exception as e:  # failed after generation started: answer it if still possible
            self._failed(e)

    def _read_body(self) -> bytes | None:
        """The body, or None once an error was answered (or the reaper closed the client)."""
        length, limit = self.headers.get("Content-Length"), self.server.max_request_bytes
        problem: tuple[int, str] | None = None
        if self.headers.get("Transfer-Encoding") is not None:
            problem = (411, "send the body with a Content-Length (no Transfer-Encoding)")
        elif length is None:
            problem = (411, "a Content-Length header is required")
        elif len(self.headers.get_all("Content-Length") or []) > 1:  # RFC 9112 6.3
            problem = (400, "the Content-Length header was given more than once")
        elif not (length.strip().isascii() and length.strip().isdigit()):
            problem = (400, f"Content-Length must be a number of bytes, not {length!r}")
        elif int(length) > limit:
            problem = (413, f"the body is {int(length)} bytes; this server takes at most {limit}")
        if problem is not None:
            if self._claim():
                self.close_connection = True
                self._json(problem[0], _error(problem[1]))
            return None
        need, parts = int(length or 0), []
        try:
            while need > 0 and (part := self.rfile.read(min(need, CHUNK))):
                parts.append(part)
                need -= len(part)
        except TimeoutError:
            need = -1  # a read that waited read_timeout seconds: the client is too slow
        if not self._claim():
            return None  # the reaper answered 408
        if need != 0:
            code, why = (
                (408, "the body did not arrive in time")
                if need < 0
                else (400, "the body is shorter than its Content-Length")
            )
            self.close_connection = True
            self._json(code, _error(why))
            return None
        return b"".join(parts)

    def _takes_images(self, body: dict[str, Any]) -> bool:
        """Whether the loaded model takes image parts (waits for the model to load)."""
        if not any(isinstance(m, dict) and isinstance(m.get("content"), list)
                   for m in body.get("messages") or ()):  # fmt: skip
            return False
        gen = self.response_generator
        loaded = getattr(gen, "loaded", None)
        if loaded is not None:
            loaded.wait(self.server.read_timeout)
        return getattr(gen.model_provider, "processor", None) is not None

    def end_headers(self) -> None:
        slot = self.persist_slot
        if slot is not None and self._code == 200:
            if getattr(self, "stream", False):  # sent before the answer: the lookup first
                slot.ready.wait(self.server.read_timeout)
            if slot.verdict is not None:
                self.send_header(HEADER, slot.verdict.header())
                self.send_header("Access-Control-Expose-Headers", HEADER)
        super().end_headers()

    def generate_response(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        resp: dict[str, Any] = super().generate_response(*args, **kwargs)
        slot = self.persist_slot
        if slot is not None and slot.verdict is not None and not self.stream:
            resp["persist"] = {"explain": slot.verdict.extension()}
        return resp

    def _set_completion_headers(self, status_code: int = 200) -> None:
        # mlx-lm answers 404 for every exception of generate(); ask which one it was
        code = take_error_status(404) if status_code == 404 else status_code
        if code == CLIENT_CLOSED:  # nobody to answer: skip mlx-lm's error body
            raise ClientGone("the client closed its connection")
        if code >= 400:  # mlx-lm writes {"error": "..."}: the documented shape instead
            self.wfile = DocumentedErrors(self.wfile)  # type: ignore[assignment]
        super()._set_completion_headers(code)

    def _failed(self, e: Exception) -> None:
        if isinstance(e, ClientGone):  # counted as nginx does; nothing left to answer
            self._code, self.close_connection = CLIENT_CLOSED, True
            return
        if isinstance(e, (GenerationFailed, ConnectionError, TimeoutError)):
            log.warning("persist: a request failed during generation: %s", e)
        else:
            log.error("persist: a request failed during generation", exc_info=e)
        if getattr(self, "_headers_buffer", None):  # headers not sent yet: answer properly
            self._headers_buffer: list[bytes] = []
            code = 503 if isinstance(e, GenerationFailed) else 500
            with contextlib.suppress(OSError):  # the client has gone
                self._json(code, _error(str(e), "server_error"))
        self.close_connection = True


class DocumentedErrors:
    """A wfile that rewrites mlx-lm's flat ``{"error": "..."}`` body as
    ``{"error": {"message", "type", "param"}}``, the body every other 4xx/5xx has."""

    def __init__(self, wfile: Any) -> None:
        self._wfile = wfile

    def write(self, data: bytes) -> int:
        with contextlib.suppress(ValueError):  # not one JSON body: written as it is
            flat = json.loads(data)
            if isinstance(flat, dict) and isinstance(flat.get("error"), str):
                data = json.dumps(_error(flat["error"])).encode()
        return int(self._wfile.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wfile, name)


def models_without_hf_cache(scan: Any) -> Any:
    """mlx-lm's ``scan_cache_dir`` for GET /v1/models that answers an empty list when
    there is no Hugging Face cache folder (mlx-lm logs a traceback and sends no body)."""

    def scan_cache_dir(*args: Any, **kwargs: Any) -> Any:
        try:
            return scan(*args, **kwargs)
        except Exception as e:  # CacheNotFound, or a folder it cannot read
            log.debug("persist: no Hugging Face cache to list models from: %s", e)
            return SimpleNamespace(repos=())

    return scan_cache_dir
