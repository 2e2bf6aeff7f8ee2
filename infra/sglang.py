"""A managed SGLang 0.5.23 server: request/response checks, readiness, supervision.

``ServerSpec`` (infra/sglang_spec.py, re-exported here) describes a server (model, mode, TP/DP,
port, flags) and builds its argv; tests check every argv against SGLang's own argument parser.
``ManagedServer`` launches it in its own process
group with a log file, reports ready only after the probe of ``probe_ready`` (model_info ->
health_generate -> server_info -> our own checked forward pass), restarts it with backoff when it
dies, and kills the whole group on exit. Every error names the log file and shows its tail.

The API key reaches the server in a 0600 YAML file beside the log (``--config``, removed on stop), not
on its command line, and the server's environment has no variable holding the key. SGLang itself
writes the key into its log (the startup ``server_args=`` line) and returns it from /server_info to
key holders, so the log of a server with a key is created 0600 too.

Facts used here (field names, flags, JSON shapes) come from reading SGLang 0.5.23's
python/sglang/srt/entrypoints/http_server.py and python/sglang/srt/managers/tokenizer_manager.py. The
``/generate`` bodies built here are checked in tests against SGLang's own request schema; responses are
only checked against a fake server.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from infra.process import ProcessDiedError, RestartPolicy, SupervisedProcess, port_bindable, port_in_use
from infra.sglang_spec import (  # noqa: F401 (re-exported: callers import the spec from infra.sglang)
    CAPTURE_MODES,
    LAUNCH_MODULE,
    MODES,
    SGLANG_VERSION,
    SGLANG_VERSIONS,
    Mode,
    ServerSpec,
    ServerSpecError,
    dflash_serving_pair,
    serving_pair,
)
from infra.storage import private_write_text

HEALTH_POLL_S = 0.5  # between /health checks of a server its supervisor calls ready

# Fixed smoke prompt: small ids exist in every vocabulary, including the tiny test targets.
SMOKE_INPUT_IDS = (1, 17, 42, 99, 7, 3, 200, 11)
SMOKE_NEW_TOKENS = 16


# ---------------------------------------------------------------- requests and response checks


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Bearer header SGLang's --api-key middleware expects (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def capture_request_body(input_ids: Sequence[int], rid: str, *, top_logprobs_num: int | None = None) -> dict[str, Any]:
    """A /generate body that returns the prefill hidden-state block for one sample.

    max_new_tokens 1 (0 would switch SGLang to prefill-only mode); a fresh extra_key so even a
    server with the radix cache on recomputes every token; prompt ids echoed for the join check.
    """
    body: dict[str, Any] = {"input_ids": list(input_ids), "rid": rid, "extra_key": uuid.uuid4().hex,
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                            "return_hidden_states": True, "return_prompt_token_ids": True}
    if top_logprobs_num:
        body |= {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top_logprobs_num}
    return body


def generation_smoke_body(rid: str) -> dict[str, Any]:
    """A greedy /generate body for a serving server's smoke test."""
    return {"input_ids": list(SMOKE_INPUT_IDS), "rid": rid,
            "sampling_params": {"max_new_tokens": SMOKE_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}


class ResponseCheckError(ValueError):
    """A /generate response that must not be used; ``check`` names the failed check."""

    def __init__(self, check: str, detail: str):
        super().__init__(f"check {check!r} failed: {detail}")
        self.check = check
        self.detail = detail


def _expect(ok: bool, check: str, detail: str) -> None:
    if not ok:
        raise ResponseCheckError(check, detail)


def response_meta(body: Any, rid: str) -> dict[str, Any]:
    """meta_info of a single-request response, after checking it echoes ``rid``."""
    _expect(isinstance(body, dict) and isinstance(body.get("meta_info"), dict), "shape",
            f"expected an object with meta_info, got {type(body).__name__}")
    meta = body["meta_info"]
    _expect(meta.get("id") == rid, "id", f"meta_info.id is {meta.get('id')!r}, the request's rid was {rid!r}")
    return meta


def check_capture_response(body: Any, *, rid: str, input_ids: Sequence[int], width: int) -> np.ndarray:
    """Validate a capture response and return its prefill block as float32 [T, width]; raise on any doubt."""
    meta = response_meta(body, rid)
    num_tokens = len(input_ids)
    _expect(meta.get("prompt_tokens") == num_tokens, "prompt_tokens",
            f"server counted {meta.get('prompt_tokens')} prompt tokens, we sent {num_tokens}")
    _expect(meta.get("cached_tokens") == 0, "cached_tokens",
            f"{meta.get('cached_tokens')} tokens came from the prefix cache, so their rows were not computed")
    echoed = body.get("prompt_token_ids")
    _expect(echoed == list(input_ids), "prompt_token_ids",
            "the server's echo of the prompt differs from the ids we sent" if echoed is not None
            else "no prompt_token_ids in the response (return_prompt_token_ids ignored?)")
    return _prefill_block(meta, num_tokens, width)


def _prefill_block(meta: dict[str, Any], num_tokens: int, width: int) -> np.ndarray:
    hidden = meta.get("hidden_states")
    if not (isinstance(hidden, list) and len(hidden) == 1):
        raise ResponseCheckError("hidden_states", "expected exactly [prefill block] for max_new_tokens 1, got "
                                 + (f"{len(hidden)} chunks" if isinstance(hidden, list)
                                    else repr(type(hidden).__name__)))
    block = hidden[0]
    _expect(isinstance(block, list) and len(block) == num_tokens, "rows",
            f"prefill block has {len(block) if isinstance(block, list) else 'no'} rows for {num_tokens} tokens")
    bad = next((i for i, row in enumerate(block) if not isinstance(row, list) or len(row) != width), None)
    if bad is not None:
        got = len(block[bad]) if isinstance(block[bad], list) else "no"
        raise ResponseCheckError("width", f"row {bad} has {got} values, expected {width}")
    try:
        rows = np.asarray(block, dtype=np.float32)
    except (TypeError, ValueError):
        # SGLang serializes with orjson, which writes NaN and inf as null.
        raise ResponseCheckError("finite", "null or non-numeric values in the hidden states") from None
    num_bad = int(rows.size - np.isfinite(rows).sum())
    _expect(num_bad == 0, "finite", f"{num_bad} non-finite values in the hidden states")
    return rows


# ---------------------------------------------------------------- readiness probe


class ServerCheckError(RuntimeError):
    """The server answers, but not as the spec says (wrong model, settings, or smoke result): no restart helps."""


class ServerGoneError(RuntimeError):
    """The server process died (or is being stopped) while we waited for it."""


@dataclass(frozen=True)
class ReadyReport:
    """What the readiness probe saw; exists only after a checked smoke forward."""

    base_url: str
    model_info: dict[str, Any]
    version: str | None
    smoke: str
    elapsed_s: float


@dataclass(frozen=True)
class ProbeExpectations:
    """What the probe compares the server against, beyond the spec itself."""

    hidden_size: int | None = None
    architectures: tuple[str, ...] | None = None
    vocab_size: int | None = None
    versions: tuple[str, ...] | None = SGLANG_VERSIONS  # releases this code's flags and JSON are checked against


def probe_ready(spec: ServerSpec, expect: ProbeExpectations, *, timeout_s: float,
                is_alive: Callable[[], bool] = lambda: True, poll_s: float = 1.0) -> ReadyReport:
    """model_info, then health_generate, then server_info, then our own checked forward (SGLang's http_server.py)."""
    if spec.mode in CAPTURE_MODES and expect.hidden_size is None:
        raise ServerSpecError("a capture server's readiness needs hidden_size to check the smoke rows")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with httpx.Client(base_url=spec.base_url, headers=auth_headers(spec.api_key), timeout=30.0) as client:
        info = _poll(client, "/model_info", deadline, is_alive, poll_s).json()
        _check_model_info(info, spec, expect)
        _poll(client, "/health_generate", deadline, is_alive, poll_s)
        server_info = _poll(client, "/server_info", deadline, is_alive, poll_s).json()
        _check_server_info(server_info, spec, expect)
        smoke = _smoke(client, spec, expect, deadline)
    return ReadyReport(spec.base_url, info, server_info.get("version"), smoke, time.monotonic() - t0)


def _poll(client: httpx.Client, path: str, deadline: float, is_alive: Callable[[], bool],
          poll_s: float) -> httpx.Response:
    """GET until 200; connection errors and 503 mean "not yet", 401/404 mean "never"."""
    last = "no answer"
    while time.monotonic() < deadline:
        if not is_alive():
            raise ServerGoneError(f"server process ended while waiting for {path} ({last})")
        try:
            resp = client.get(path, timeout=max(1.0, min(30.0, deadline - time.monotonic())))
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}"
        else:
            if resp.status_code == 200:
                return resp
            if resp.status_code in (401, 403, 404):
                raise ServerCheckError(f"GET {path} answered {resp.status_code}: {resp.text[:200]} "
                                       "(wrong API key, or not an SGLang server?)")
            last = f"HTTP {resp.status_code}"
        time.sleep(poll_s)
    raise TimeoutError(f"GET {path} did not answer 200 before the startup deadline (last: {last})")


def _check_model_info(info: dict[str, Any], spec: ServerSpec, expect: ProbeExpectations) -> None:
    if info.get("model_path") != spec.model_path:
        raise ServerCheckError(f"/model_info says model_path {info.get('model_path')!r}, expected "
                               f"{spec.model_path!r}: another server owns port {spec.port}?")
    if expect.architectures is not None and list(info.get("architectures") or []) != list(expect.architectures):
        raise ServerCheckError(f"/model_info architectures {info.get('architectures')} != "
                               f"expected {list(expect.architectures)}")


def _check_server_info(server_info: dict[str, Any], spec: ServerSpec, expect: ProbeExpectations) -> None:
    missing = object()
    wrong = [f"{key}: server has {server_info.get(key, 'nothing')!r}, expected {value!r}"
             for key, value in spec.expected_server_info().items() if server_info.get(key, missing) != value]
    version = str(server_info.get("version"))
    if expect.versions and not any(version == v or version.startswith(v + ".") for v in expect.versions):
        wrong.append(f"version: server runs {version!r}, this code speaks SGLang {', '.join(expect.versions)}")
    if wrong:
        raise ServerCheckError("/server_info does not match the launch spec:\n  " + "\n  ".join(wrong))


def _post_generate(client: httpx.Client, body: dict[str, Any], deadline: float) -> Any:
    resp = client.post("/generate", json=body, timeout=max(5.0, min(300.0, deadline - time.monotonic())))
    if resp.status_code != 200:
        raise ServerCheckError(f"smoke /generate answered HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def _smoke(client: httpx.Client, spec: ServerSpec, expect: ProbeExpectations, deadline: float) -> str:
    """The decisive step: a real forward whose result we check ourselves."""
    rid = f"readiness-smoke-{uuid.uuid4().hex[:12]}"
    try:
        if spec.mode in CAPTURE_MODES:
            assert expect.hidden_size is not None
            width = spec.row_width(expect.hidden_size)
            body = _post_generate(client, capture_request_body(SMOKE_INPUT_IDS, rid), deadline)
            rows = check_capture_response(body, rid=rid, input_ids=SMOKE_INPUT_IDS, width=width)
            return f"capture forward: {rows.shape[0]} rows x {rows.shape[1]} finite values"
        body = _post_generate(client, generation_smoke_body(rid), deadline)
        return _check_generation(body, rid, spec, expect)
    except ResponseCheckError as exc:
        raise ServerCheckError(f"smoke /generate: {exc}") from exc
    except httpx.HTTPError as exc:
        raise ServerCheckError(f"smoke /generate failed: {type(exc).__name__}: {exc}") from exc


def _check_generation(body: Any, rid: str, spec: ServerSpec, expect: ProbeExpectations) -> str:
    meta = response_meta(body, rid)
    ids = body.get("output_ids")
    _expect(meta.get("completion_tokens") == SMOKE_NEW_TOKENS and isinstance(ids, list)
            and len(ids) == SMOKE_NEW_TOKENS, "completion_tokens",
            f"asked for {SMOKE_NEW_TOKENS} tokens with ignore_eos, got {meta.get('completion_tokens')}")
    upper = expect.vocab_size or 2**31
    _expect(all(isinstance(i, int) and 0 <= i < upper for i in ids), "output_ids", f"ids outside [0, {upper})")
    # One token repeated 16 times from a greedy real model means broken weights or a broken kernel.
    _expect(len(set(ids)) > 1, "output_ids", f"all {len(ids)} generated ids are {ids[0]}")
    if spec.speculative:
        _expect((meta.get("spec_verify_ct") or 0) > 0 and (meta.get("spec_accept_length") or 0) >= 1,
                "speculative", f"spec_verify_ct {meta.get('spec_verify_ct')}, "
                f"spec_accept_length {meta.get('spec_accept_length')}: the draft did not run")
    return f"greedy generation of {len(ids)} tokens"


# ---------------------------------------------------------------- supervision


class ServerStartError(RuntimeError):
    """A managed server did not become ready; the message names the log and shows its tail."""


def key_file_for(log_path: Path) -> Path:
    """Where a managed server's API key file lives: hidden, beside its log, named for SGLang's YAML check."""
    return log_path.with_name(f".{log_path.stem}.api-key.yaml")


def env_without_secret(env: Mapping[str, str], secret: str | None) -> dict[str, str]:
    """``env`` minus every variable whose value is the secret (the server gets its key from the key file)."""
    return {k: v for k, v in env.items() if not secret or v != secret}


def _make_private(path: Path) -> None:
    """Create ``path`` (or keep it) readable by this user only: SGLang logs its API key at startup."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def launch_env(spec: ServerSpec, env: Mapping[str, str] | None) -> dict[str, str]:
    """The caller's environment (default ours) plus what the spec's mode needs; PYTHONPATH is prepended to."""
    merged = dict(os.environ if env is None else env)
    for key, value in spec.launch_env().items():
        merged[key] = value + os.pathsep + merged[key] if key == "PYTHONPATH" and merged.get(key) else value
    return merged


class ManagedServer:
    """An SGLang server we launch, probe, restart when it dies, and kill as a group (context manager).

    After ``start()`` a watchdog thread checks the child every ``watch_s`` seconds; when it died, the
    server is marked not ready, restarted with backoff and probed again. Clients that hit a dead
    server call ``wait_ready()`` and retry once it returns.
    """

    def __init__(self, spec: ServerSpec, log_path: Path, *, expect: ProbeExpectations = ProbeExpectations(),
                 startup_timeout_s: float = 1800.0, policy: RestartPolicy = RestartPolicy(),
                 env: Mapping[str, str] | None = None, cwd: Path | None = None, poll_s: float = 1.0,
                 watch_s: float = 2.0):
        if spec.mode in CAPTURE_MODES and expect.hidden_size is None:
            raise ServerSpecError("a capture server needs expect.hidden_size: its smoke check compares row widths")
        self.spec, self.expect, self.startup_timeout_s = spec, expect, startup_timeout_s
        self.poll_s, self.watch_s = poll_s, watch_s
        self.key_file = key_file_for(Path(log_path)) if spec.api_key else None
        self.process = SupervisedProcess(spec.argv(str(self.key_file) if self.key_file else None), log_path,
                                         env=env_without_secret(launch_env(spec, env), spec.api_key),
                                         cwd=cwd, policy=policy, secret_flags=("--api-key",))
        self.report: ReadyReport | None = None
        self._ready, self._stopping = threading.Event(), threading.Event()
        self._failure: BaseException | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def api_key(self) -> str | None:
        return self.spec.api_key

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def num_restarts(self) -> int:
        return self.process.num_restarts

    @property
    def ready(self) -> bool:
        """True only between a passed probe and the next death or stop."""
        return self._ready.is_set() and self._failure is None and not self._stopping.is_set()

    def check_port(self) -> None:
        """ServerStartError unless this server's port is free to listen on (call before a slow launch)."""
        if port_in_use(self.spec.host, self.spec.port):
            # The probe would talk to that server instead of ours, and might even find it healthy.
            raise ServerStartError(f"{self.spec.host}:{self.spec.port} already answers: stop that server "
                                   "(a stale one?) or pick another port")
        try:
            bindable = port_bindable(self.spec.host, self.spec.port)
        except OSError as exc:
            raise ServerStartError(f"{self.spec.host}:{self.spec.port} cannot be listened on: {exc}") from exc
        if not bindable:
            raise ServerStartError(f"{self.spec.host}:{self.spec.port} is held by another socket (nothing "
                                   "answers there, but the server could not bind it): pick another port")

    def start(self) -> ReadyReport:
        """Launch and probe, restarting a child that dies during start-up; ServerStartError if never ready."""
        self.check_port()
        if self.key_file is not None:
            private_write_text(self.key_file, self.spec.key_file_text())
            _make_private(self.log_path)
        self.process.start()
        try:
            self.report = self._bring_up()
        except BaseException:
            self._stopping.set()
            self.process.stop()
            raise
        self._watchdog = threading.Thread(target=self._watch, name=f"sglang-watchdog-{self.spec.port}", daemon=True)
        self._watchdog.start()
        return self.report

    def _alive(self) -> bool:
        return not self._stopping.is_set() and self.process.alive()

    def _bring_up(self) -> ReadyReport:
        """Probe until ready; a death restarts (bounded by the policy), a failed check stops for good."""
        while True:
            try:
                report = probe_ready(self.spec, self.expect, timeout_s=self.startup_timeout_s,
                                     is_alive=self._alive, poll_s=self.poll_s)
            except ServerGoneError:
                if self._stopping.is_set():
                    raise
                self._restart()
                continue
            except (ServerCheckError, TimeoutError) as exc:
                raise ServerStartError(self.process.failure_message(f"SGLang server not ready: {exc}")) from exc
            self._ready.set()
            return report

    def _restart(self) -> None:
        try:
            self.process.restart(self._stopping)
        except ProcessDiedError as exc:
            raise ServerStartError(str(exc)) from exc

    def _watch(self) -> None:
        while not self._stopping.wait(self.watch_s):
            if self.process.alive():
                continue
            self._ready.clear()
            try:
                self._restart()
                self.report = self._bring_up()
            except BaseException as exc:  # recorded for wait_ready(); a watchdog must not die silently
                self._failure = exc
                self.process.stop()  # a child that failed its checks must not keep the GPUs
                self._ready.set()  # wake waiters so they see the failure
                return

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the server is ready again and answers /health; raise if the supervisor gave up or time runs
        out. The supervisor's word alone is not enough: a server whose listener is gone can still be alive for a
        moment (SGLang's main process takes a while to exit after a fatal error), so until /health answers the
        supervisor is asked again, and it notices the death and restarts."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._wait_supervised(max(deadline - time.monotonic(), 0.0))
            if self._answers_health():
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(self.process.failure_message(f"SGLang server at {self.base_url} is called ready "
                                                                f"but did not answer /health within {timeout_s:.0f} s"))
            time.sleep(HEALTH_POLL_S)

    def _wait_supervised(self, timeout_s: float) -> None:
        """Block until the supervisor calls the server ready (after a restart if it died)."""
        if self._ready.is_set() and self._failure is None and not self.process.alive():
            self._ready.clear()  # the client saw the death before the watchdog did
        if not self._ready.wait(timeout_s):
            raise TimeoutError(self.process.failure_message(f"SGLang server at {self.base_url} not ready "
                                                            f"again within {timeout_s:.0f} s"))
        if self._stopping.is_set():
            raise ServerGoneError(f"SGLang server at {self.base_url} was stopped")
        if self._failure is not None:
            raise ServerStartError(str(self._failure)) from self._failure

    def _answers_health(self) -> bool:
        """GET /health answers 200 (no key needed: SGLang serves it to anyone); a refused connection is False."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=HEALTH_POLL_S * 10).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Stop watching, then kill the whole process group (idempotent); wakes wait_ready() callers."""
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=max(30.0, self.watch_s * 2))
        self.process.stop()
        if self.key_file is not None:
            self.key_file.unlink(missing_ok=True)
        self._ready.set()  # waiters wake, see _stopping and raise instead of blocking until their timeout

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
