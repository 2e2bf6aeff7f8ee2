"""FakeOpenAIServer: a test double for an OpenAI-compatible chat-completions endpoint.

It speaks the JSON shape SGLang/vLLM/OpenAI return for ``POST /v1/chat/completions`` (id, object,
created, model, choices[0].message.{role, content}, finish_reason, usage) and nothing more; it was
written from the documented shape, not checked against a live SGLang. Answers are deterministic:
``answer to: <last user text> [after N answers]`` where N is the number of assistant messages in
the request, so a test can tell whether a regenerated or an original history was sent.

Knobs (all off by default):
  fail_first      answer the first N requests with ``fail_first_status`` (503; 429 to test rate limits)
  fail_marker     a last user message containing it always gets 503
  bad_marker      ... always gets 400 (not retried)
  empty_marker    ... gets an empty content string
  length_marker   ... is answered with finish_reason "length" (an answer cut at the token cap)
  stall_marker    ... is held ``stall_s`` seconds before the answer (to exercise timeouts)

It binds 127.0.0.1 on a free port, serves from a daemon thread, records every request it
received, and shuts itself down after ``lifetime_s`` or ``max_requests`` so a broken test cannot
leave it running.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHAT_PATH = "/v1/chat/completions"


@dataclass
class RecordedRequest:
    """One request as the server saw it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.body.get("messages", [])

    @property
    def last_user(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m.get("role") == "user"), "")


def fake_answer(messages: list[dict[str, str]]) -> str:
    """The answer the fake gives to a history (tests compute expected output with it)."""
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    num_prior = sum(1 for m in messages if m["role"] == "assistant")
    return f"answer to: {last_user} [after {num_prior} answers]"


@dataclass
class FakeOpenAIServer:
    """Context manager; ``base_url`` ends in /v1 like a real OpenAI-compatible endpoint."""

    fail_first: int = 0
    fail_first_status: int = 503
    fail_marker: str | None = None
    bad_marker: str | None = None
    empty_marker: str | None = None
    length_marker: str | None = None
    stall_marker: str | None = None
    stall_s: float = 5.0
    lifetime_s: float = 60.0
    max_requests: int = 10_000
    requests: list[RecordedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> FakeOpenAIServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False  # a stalled handler must not hold up the test's exit
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._watchdog = threading.Timer(self.lifetime_s, self.stop)
        self._watchdog.daemon = True
        self._watchdog.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and wake any stalled handler (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._watchdog.cancel()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def _record(self, request: RecordedRequest) -> int:
        """Store the request; returns its 1-based sequence number."""
        with self._lock:
            self.requests.append(request)
            return len(self.requests)

    def respond(self, request: RecordedRequest) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) for one recorded chat request."""
        seq = self._record(request)
        text = request.last_user
        if seq > self.max_requests:
            threading.Thread(target=self.stop, daemon=True).start()
            return 503, _error("fake server request budget spent")
        if seq <= self.fail_first:
            return self.fail_first_status, _error("fake overload")
        if _has(text, self.fail_marker):
            return 503, _error("fake overload")
        if _has(text, self.bad_marker):
            return 400, _error("fake bad request")
        if _has(text, self.stall_marker):
            self._stop.wait(self.stall_s)
        content = "" if _has(text, self.empty_marker) else fake_answer(request.messages)
        finish = "length" if _has(text, self.length_marker) else "stop"
        return 200, completion_body(seq, request.body.get("model", "fake"), content, finish)


def _has(text: str, marker: str | None) -> bool:
    return marker is not None and marker in text


def _error(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "fake_error"}


def completion_body(seq: int, model: str, content: str, finish_reason: str = "stop") -> dict[str, Any]:
    num_tokens = len(content.split())
    return {
        "id": f"chatcmpl-fake-{seq}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 0, "completion_tokens": num_tokens, "total_tokens": num_tokens},
    }


def _make_handler(server: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like real servers, so client pooling is exercised

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            if self.path != CHAT_PATH:
                return self._send(404, _error(f"no route {self.path}"))
            try:
                body = json.loads(raw)
            except ValueError:
                return self._send(400, _error("body is not JSON"))
            request = RecordedRequest(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            self._send(*server.respond(request))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test); nothing to tell it

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base-class signature
            pass  # keep pytest output clean

    return Handler
