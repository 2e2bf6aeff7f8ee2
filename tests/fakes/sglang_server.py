"""FakeSGLangServer: a TEST DOUBLE that speaks SGLang 0.5.23's native HTTP JSON. It is not SGLang.

Written from a static reading of SGLang 0.5.23 (python/sglang/srt/: ``entrypoints/http_server.py``,
``managers/tokenizer_manager.py``, ``utils/auth.py``); never compared with a live server.
It answers:

  GET  /model_info        model_path, served_model_name, tokenizer_path, is_generation, model_type, architectures...
  GET  /server_info       resolved launch settings (mimicking SGLang: aux capture resets speculative_algorithm,
                          sets return_hidden_states_mode "full"; speculative without --max-running-requests gets
                          48; DFLASH runs one step, top-1, its block size verified; NGRAM's top-k is its max
                          BFS breadth...), internal_states
                          [{avg_spec_accept_length}] since the last flush, version
  GET  /health, /health_generate, /ready   503 while "warming up", then 200 (no auth, like SGLang)
  POST /generate          input_ids or text (a made-up byte tokenizer) -> {output_ids, text, meta_info{id,
                          finish_reason, prompt_tokens, completion_tokens, cached_tokens, hidden_states: [prefill
                          block T x D, one row per later token], input/output_(top_)logprobs, spec_verify_ct,
                          spec_accept_length, spec_accept_rate, ...}, prompt_token_ids}; "stream": true gives
                          server-sent events "data: {...}" (cumulative output_ids), then "data: [DONE]"
  GET/POST /flush_cache   200 "Cache flushed..." (text); resets the acceptance totals of /server_info
  POST /v1/chat/completions   the fake OpenAI server's answer (tests/fakes/openai_server.py fake_answer), status 200

Serving (``FakeServing``, ``--fake-accept-length/-step-s/-spec-step-cost``): both servers output the greedy chain
of ``fake_next_token``; a speculative one (EAGLE3, DFLASH or NGRAM: no drafter is loaded, all pretend alike) reports
ceil(completion / accept_length) verify steps; a target forward
(a token, or a verify step costing ``spec_step_cost``) sleeps ``step_s``. Invented: no figure from it means anything.

Hidden states are deterministic (``fake_hidden_rows``: a function of token id, position and layer),
so tests can check the values a client stores. Top-K log-probs come from ``fake_topk``. NaN and inf
are sent as null, as SGLang's orjson does. With --api-key every other path needs ``Bearer <key>``; like
SGLang's, the process reads flags from ``--config FILE.yaml`` too (``api-key: ...``), the command line winning.

Faults (``Faults``; CLI ``--fake-*``; at run time ``POST /_fake/faults``): short_rows (drop rows),
id_fault "drop"/"alter" (the echoed meta_info.id), cached_tokens (report a prefix-cache hit and omit
those rows, as SGLang does), nan (one null value), stall_s (hold each /generate), die_after (exit the
process after N /generate answers; in-process it stops serving), times (apply faults to the first N
/generate requests only), spec_verify_ct_zero (no verify step ran; SGLang then leaves out the spec_* keys),
short_completion (N tokens fewer than asked), flush_fails (/flush_cache answers 400, as SGLang does when
busy). ``GET /_fake/stats`` counts requests; in-process, ``events`` lists ("flush", "") and
("generate", rid) in arrival order.

Runs in-process (``with FakeSGLangServer(...) as fake: fake.base_url``) or as a process whose command line
mimics ``python -m sglang.launch_server`` (``python -m tests.fakes.sglang_server --model-path M --port P ...``),
so ``infra.sglang.ManagedServer`` can launch, kill and restart it. Either way it exits by itself after
``lifetime_s`` so a broken test cannot leave it running. Its pretend target, flags, faults and serving settings
are in tests/fakes/sglang_model.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.fakes.openai_server import CHAT_PATH, completion_body, fake_answer
from tests.fakes.sglang_model import (
    FAKE_VERSION,
    SPECULATIVE_ALGORITHMS,
    FakeModel,
    FakeServing,
    Faults,
    LaunchArgs,
    build_parser,
    fake_hidden_rows,
    fake_next_token,
    fake_topk,
    merge_config,
)

PUBLIC_PREFIXES = ("/health", "/ready", "/metrics")


@dataclass
class FakeSGLangServer:
    """The fake server; a context manager in-process, or ``main()`` as a process."""

    args: LaunchArgs = field(default_factory=LaunchArgs)
    faults: Faults = field(default_factory=Faults)
    serving: FakeServing = field(default_factory=FakeServing)
    model: FakeModel | None = None
    warmup_s: float = 0.0
    lifetime_s: float = 60.0
    exit_process_on_die: bool = False
    generate_bodies: list[dict[str, Any]] = field(default_factory=list)
    generate_headers: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = self.model or FakeModel.from_path(self.args.model_path)
        self.settings = self.args.resolved(self.model)  # raises like SGLang does on a bad flag combination
        self.speculative = self.settings["speculative_algorithm"] in SPECULATIVE_ALGORITHMS
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._num_generate = 0
        self.num_in_flight = self.max_in_flight = 0
        self._gathered = threading.Event()  # set once hold_until_in_flight requests were in flight together
        self.events: list[tuple[str, str]] = []
        self._spec_totals = [0, 0]  # completion tokens, verify steps since the last flush
        self._httpd: ThreadingHTTPServer | None = None
        self._timer: threading.Timer | None = None
        self._bound_at = 0.0
        self.dead = False

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "fake server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeSGLangServer:
        self._httpd = ThreadingHTTPServer((self.args.host, self.args.port), _handler_class(self))
        self._httpd.daemon_threads = True
        self.args.port = self.settings["port"] = self._httpd.server_address[1]  # port 0 -> the one bound
        self._bound_at = time.monotonic()
        threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-sglang", daemon=True
        ).start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> FakeSGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def die(self) -> None:
        """Exit the process (as a process), or stop answering at once (in-process)."""
        if self.exit_process_on_die:
            os._exit(3)
        self.dead = True
        threading.Thread(target=self.stop, daemon=True).start()

    # ------------------------------------------------------------ endpoint bodies

    def warming_up(self) -> bool:
        return time.monotonic() - self._bound_at < self.warmup_s

    def model_info(self) -> dict[str, Any]:
        assert self.model is not None
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.model_path,
            "tokenizer_path": None if self.args.skip_tokenizer_init else self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.model.model_type,
            "architectures": list(self.model.architectures),
        }

    def server_info(self) -> dict[str, Any]:
        tokens, verify_ct = self._spec_totals  # SGLang's avg_spec_accept_length counts since the last flush
        state = {"avg_spec_accept_length": tokens / verify_ct if verify_ct else 0.0}
        return self.settings | {"launch_command": None, "internal_states": [state], "version": FAKE_VERSION}

    def flush(self, faults: Faults) -> tuple[int, str]:
        """/flush_cache: (status, text) as SGLang answers it; resets the acceptance totals."""
        with self._lock:
            self.events.append(("flush", ""))
            if faults.flush_fails:
                return 400, "Flush cache failed: there are running or waiting requests.\n"
            self._spec_totals = [0, 0]
        return 200, "Cache flushed.\nPlease check backend logs for more details.\n"

    def decode_steps(self, num_tokens: int, verify_ct: int | None) -> list[tuple[float, int]]:
        """(sleep_s, tokens so far) per target forward: one per token, or one per verify step."""
        if verify_ct is None:
            return [(self.serving.step_s, i + 1) for i in range(num_tokens)]
        step_s, num_steps = self.serving.step_s * self.serving.spec_step_cost, max(verify_ct, 1)
        return [(step_s, round(num_tokens * (i + 1) / num_steps)) for i in range(num_steps)]

    def capture_layers(self) -> list[int] | None:
        """Layer blocks a /generate with return_hidden_states gets (num_layers = the post-norm final)."""
        assert self.model is not None
        if self.args.enable_return_aux_hidden_states:
            return list(self.args.return_aux_hidden_state_layer_ids or self.model.default_aux_layers())
        packed = packed_capture_layers()
        if packed is not None and self.settings["return_hidden_states_mode"] == "full":
            return packed + [self.model.num_layers]  # as infra/sglang_plugin does: aux blocks, then the final
        if self.settings["return_hidden_states_mode"] == "full":
            return [self.model.num_layers]
        return None

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count concurrent /generate requests (tests check the client's concurrency bound)."""
        with self._lock:
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
            if self.max_in_flight >= self.serving.hold_until_in_flight:
                self._gathered.set()
        try:
            yield
        finally:
            with self._lock:
                self.num_in_flight -= 1

    def take_faults(self, rid: str = "") -> Faults:
        """The faults for this /generate (Faults() once ``times`` is used up); records its arrival."""
        with self._lock:
            self.events.append(("generate", rid))
            self._num_generate += 1
            active = self.faults.times is None or self._num_generate <= self.faults.times
            return self.faults if active else Faults()

    def generate(self, body: dict[str, Any], faults: Faults) -> tuple[int, dict[str, Any]]:
        """(status, JSON) for one /generate body (the final answer; ``decode_steps`` paces it)."""
        error = self._request_error(body)
        if error:
            return 400, {"error": {"message": error, "type": "invalid_request_error", "code": 400}}
        assert self.model is not None
        ids = self.prompt_ids(body)
        num_new = int(body.get("sampling_params", {}).get("max_new_tokens", 128))
        output_ids = _greedy(ids, max(num_new - faults.short_completion, 0), self.model.vocab_size)
        meta = self._meta(body, ids, output_ids, faults)
        out: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta}
        if not self.args.skip_tokenizer_init:
            out["text"] = "".join(chr(ord("a") + i % 26) for i in output_ids)  # made up: one letter per token
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = ids
        return 200, out

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """input_ids as sent, or the fake's byte tokenization of text (BOS 1, then bytes shifted into the vocab)."""
        assert self.model is not None
        if "text" in body:
            return [1] + [2 + b % (self.model.vocab_size - 2) for b in body["text"].encode()]
        return [int(i) for i in body["input_ids"]]

    def _request_error(self, body: dict[str, Any]) -> str | None:
        if "text" in body:
            if "input_ids" in body or not isinstance(body["text"], str) or not body["text"]:
                return "give either one non-empty text or input_ids, not both"
            return "text needs the tokenizer (--skip-tokenizer-init is set)" if self.args.skip_tokenizer_init else None
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return "the fake accepts one non-empty flat input_ids list per request"
        assert self.model is not None
        if any(not 0 <= i < self.model.vocab_size for i in ids):
            return f"input_ids outside the vocabulary [0, {self.model.vocab_size})"
        if body.get("return_hidden_states") and self.capture_layers() is None:
            return (
                "The server is not configured to return hidden states. Please set "
                "`--enable-return-hidden-states` to enable this feature."
            )
        return None

    def _meta(self, body: dict[str, Any], ids: list[int], output_ids: list[int], faults: Faults) -> dict[str, Any]:
        rid = body.get("rid") or uuid.uuid4().hex
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "length", "length": len(output_ids)},
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(output_ids),
            "cached_tokens": faults.cached_tokens,
            "e2e_latency": 0.001,
        }
        if faults.id_fault == "drop":
            del meta["id"]
        elif faults.id_fault == "alter":
            meta["id"] = f"{rid}-other"
        if body.get("return_hidden_states"):
            meta["hidden_states"] = self._hidden(ids, output_ids, faults)
        if body.get("return_logprob"):
            meta |= self._logprobs(ids, output_ids, int(body.get("top_logprobs_num") or 0))
        if self.speculative:
            meta |= self._spec_meta(len(output_ids), faults)
        return meta

    def _spec_meta(self, num_tokens: int, faults: Faults) -> dict[str, Any]:
        """SGLang's per-request speculative fields; none at all when no verify step ran (as SGLang does)."""
        verify_ct = 0 if faults.spec_verify_ct_zero else math.ceil(num_tokens / self.serving.accept_length)
        with self._lock:
            self._spec_totals[0] += num_tokens
            self._spec_totals[1] += verify_ct
        if verify_ct == 0:
            return {}
        correct = num_tokens - verify_ct  # each verify step emits its accepted drafts plus one bonus token
        proposed = verify_ct * (self.settings["speculative_num_draft_tokens"] - 1)
        return {
            "spec_verify_ct": verify_ct,
            "spec_accept_length": num_tokens / verify_ct,
            "spec_accept_rate": correct / proposed if proposed else 0.0,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
        }

    def _hidden(self, ids: list[int], output_ids: list[int], faults: Faults) -> list[Any]:
        assert self.model is not None
        layers = self.capture_layers() or []
        rows = fake_hidden_rows(ids, layers, self.model.hidden_size)
        block = rows[faults.cached_tokens + faults.short_rows :].tolist()
        if faults.nan and block:
            block[len(block) // 2][0] = None  # what orjson makes of a NaN
        # One row per decoded token after the first, as SGLang appends them.
        later = fake_hidden_rows(ids + output_ids[:-1], layers, self.model.hidden_size)[len(ids) :]
        return [block, *later.tolist()]

    def _logprobs(self, ids: list[int], output_ids: list[int], k: int) -> dict[str, Any]:
        assert self.model is not None
        vocab, seq = self.model.vocab_size, ids + output_ids

        def top(position: int) -> list[list[Any]]:
            top_ids, lps = fake_topk(seq[position], position, k, vocab)
            return [[lp, tok, None] for lp, tok in zip(lps, top_ids)]

        out: dict[str, Any] = {
            "input_token_logprobs": [[None, ids[0], None]] + [[-0.5, t, None] for t in ids[1:]],
            "output_token_logprobs": [[-0.25, t, None] for t in output_ids],
        }
        if k > 0:
            out["input_top_logprobs"] = [None] + [top(t) for t in range(len(ids) - 1)]
            out["output_top_logprobs"] = [top(len(ids) - 1 + j) for j in range(len(output_ids))]
        return out


def packed_capture_layers() -> list[int] | None:
    """The layers infra/sglang_plugin would capture in this process (its package and layers env), else None."""
    from infra.sglang_spec import PLUGIN_LAYERS_ENV, PLUGIN_PACKAGE

    text = os.environ.get(PLUGIN_LAYERS_ENV, "")
    if os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE") != PLUGIN_PACKAGE or not text:
        return None
    return [int(part) for part in text.split(",")]


def two_free_ports() -> int:
    """A free port whose successor is free too: the fake baseline and speculative servers listen on both."""
    from infra.process import free_port, port_bindable

    for _ in range(20):
        port = free_port()
        if port < 65535 and port_bindable("127.0.0.1", port + 1):
            return port
    raise RuntimeError("no two adjacent free ports")


def _partial(out: dict[str, Any], num_tokens: int) -> dict[str, Any]:
    """A streamed chunk before the end: cumulative output, counts so far, no speculative totals yet."""
    meta = {k: v for k, v in out["meta_info"].items() if not k.startswith("spec_") and k != "e2e_latency"}
    chunk = {
        "output_ids": out["output_ids"][:num_tokens],
        "meta_info": meta | {"completion_tokens": num_tokens, "finish_reason": None},
    }
    return chunk | ({"text": out["text"][:num_tokens]} if "text" in out else {})


def _greedy(ids: list[int], num_new: int, vocab_size: int) -> list[int]:
    seq = list(ids)
    for _ in range(num_new):
        seq.append(fake_next_token(seq[-1], len(seq) - 1, vocab_size))
    return seq[len(ids) :]


def _handler_class(fake: FakeSGLangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else small streamed chunks wait for delayed ACKs and arrive in bursts

        def log_message(self, fmt: str, *args: Any) -> None:
            sys.stderr.write(f"fake-sglang: {fmt % args}\n")

        def _send(self, status: int, obj: Any = None) -> None:
            data = b"" if obj is None else obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(obj, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client gave up (timeout test); nothing to answer

        def _authorized(self) -> bool:
            return fake_authorized(self.path, self.headers.get("Authorization"), fake.args.api_key)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            _count(fake, self.path)
            if not self._authorized():
                return self._send(401, {"error": "Unauthorized"})
            if self.path in ("/health", "/health_generate", "/ready"):
                return self._send(503 if fake.warming_up() else 200)
            if self.path.split("?")[0] == "/flush_cache":
                return self._send(*fake.flush(fake.faults))
            routes = {
                "/model_info": fake.model_info,
                "/server_info": fake.server_info,
                "/_fake/stats": lambda: fake.counts | {"max_in_flight": fake.max_in_flight},
            }
            if self.path not in routes:
                return self._send(404, {"detail": "Not Found"})
            return self._send(200, routes[self.path]())

        def do_POST(self) -> None:  # noqa: N802
            _count(fake, self.path)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not self._authorized():
                return self._send(401, {"error": "Unauthorized"})
            if self.path == "/_fake/faults":
                fake.faults = Faults(**body)
                return self._send(200, asdict(fake.faults))
            if self.path.split("?")[0] == "/flush_cache":
                return self._send(*fake.flush(fake.faults))
            if self.path == CHAT_PATH:  # the OpenAI route, answered as the fake OpenAI server answers
                answer = fake_answer(body.get("messages", []))
                return self._send(200, completion_body(fake.counts[CHAT_PATH], str(body.get("model", "")), answer))
            if self.path != "/generate":
                return self._send(404, {"detail": "Not Found"})
            return self._generate(body)

        def _generate(self, body: dict[str, Any]) -> None:
            fake.generate_bodies.append(body)
            fake.generate_headers.append(dict(self.headers))
            faults = fake.take_faults(str(body.get("rid", "")))
            with fake.in_flight():
                fake._gathered.wait(timeout=10)  # a concurrency test sees its requests together, whatever the load
                if faults.stall_s:
                    time.sleep(faults.stall_s)
                if fake.dead:
                    self.close_connection = True
                    return
                status, out = fake.generate(body, faults)
                ok = status == 200
                steps = fake.decode_steps(len(out["output_ids"]), out["meta_info"].get("spec_verify_ct")) if ok else []
                if body.get("stream") and ok:
                    self._stream(out, steps or [(0.0, 0)])
                else:
                    time.sleep(sum(delay for delay, _ in steps))
                    self._send(status, out)
            if faults.die_after is not None and fake._num_generate >= faults.die_after:
                fake.die()

        def _stream(self, out: dict[str, Any], steps: list[tuple[float, int]]) -> None:
            """Server-sent events as SGLang streams /generate: cumulative chunks, then [DONE]."""
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i, (delay, num_tokens) in enumerate(steps):
                    time.sleep(delay)
                    chunk = out if i == len(steps) - 1 else _partial(out, num_tokens)
                    self._write_chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self._write_chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _write_chunk(self, data: bytes) -> None:  # HTTP/1.1 chunked encoding: hex size, data
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    return Handler


def fake_authorized(path: str, authorization: str | None, api_key: str | None) -> bool:
    """SGLang's rule for normal endpoints: health/ready/metrics are open; others need the Bearer key."""
    if api_key is None or path.startswith(PUBLIC_PREFIXES):
        return True
    return authorization == f"Bearer {api_key}"


def _count(fake: FakeSGLangServer, path: str) -> None:
    with fake._lock:
        fake.counts[path] = fake.counts.get(path, 0) + 1


def main(argv: list[str] | None = None) -> None:
    """Run as a process: ``python -m tests.fakes.sglang_server --model-path M --port P ...``."""
    ns = vars(build_parser().parse_args(merge_config(list(sys.argv[1:] if argv is None else argv))))
    launch = LaunchArgs(**{f.name: ns[f.name] for f in fields(LaunchArgs)})
    faults = Faults(**{f.name: v for f in fields(Faults) if (v := ns["fake_" + f.name]) not in (None, False)})
    print(
        f"fake sglang {FAKE_VERSION} (a test double, not SGLang) pid {os.getpid()}: loading {launch.model_path}",
        flush=True,
    )
    time.sleep(ns["fake_startup_s"])
    serving = FakeServing(**{f.name: ns["fake_" + f.name] for f in fields(FakeServing)})
    fake = FakeSGLangServer(
        launch,
        faults,
        serving,
        warmup_s=ns["fake_warmup_s"],
        lifetime_s=ns["fake_lifetime_s"],
        exit_process_on_die=True,
    ).start()
    print(f"fake sglang: serving on {fake.base_url}", flush=True)
    threading.Event().wait(ns["fake_lifetime_s"])
    os._exit(0)


if __name__ == "__main__":
    main()
