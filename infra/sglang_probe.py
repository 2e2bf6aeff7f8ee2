"""The readiness probe of an SGLang server: model_info -> health_generate -> server_info -> our own checked
forward pass (SGLang's http_server.py), each compared with the launch spec and the ProbeExpectations."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from infra.sglang_checks import (
    SMOKE_INPUT_IDS,
    ResponseCheckError,
    auth_headers,
    capture_request_body,
    check_capture_response,
    check_generation_response,
    generation_smoke_body,
)
from infra.sglang_modes import CAPTURE_MODES, SGLANG_VERSIONS
from infra.sglang_spec import ServerSpec, ServerSpecError


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


def probe_ready(
    spec: ServerSpec,
    expect: ProbeExpectations,
    *,
    timeout_s: float,
    is_alive: Callable[[], bool] = lambda: True,
    poll_s: float = 1.0,
) -> ReadyReport:
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


def _poll(
    client: httpx.Client, path: str, deadline: float, is_alive: Callable[[], bool], poll_s: float
) -> httpx.Response:
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
                raise ServerCheckError(
                    f"GET {path} answered {resp.status_code}: {resp.text[:200]} "
                    "(wrong API key, or not an SGLang server?)"
                )
            last = f"HTTP {resp.status_code}"
        time.sleep(poll_s)
    raise TimeoutError(f"GET {path} did not answer 200 before the startup deadline (last: {last})")


def _check_model_info(info: dict[str, Any], spec: ServerSpec, expect: ProbeExpectations) -> None:
    if info.get("model_path") != spec.model_path:
        raise ServerCheckError(
            f"/model_info says model_path {info.get('model_path')!r}, expected "
            f"{spec.model_path!r}: another server owns port {spec.port}?"
        )
    if expect.architectures is not None and list(info.get("architectures") or []) != list(expect.architectures):
        raise ServerCheckError(
            f"/model_info architectures {info.get('architectures')} != expected {list(expect.architectures)}"
        )


def _check_server_info(server_info: dict[str, Any], spec: ServerSpec, expect: ProbeExpectations) -> None:
    missing = object()
    wrong = [
        f"{key}: server has {server_info.get(key, 'nothing')!r}, expected {value!r}"
        for key, value in spec.expected_server_info().items()
        if server_info.get(key, missing) != value
    ]
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
        return check_generation_response(body, rid, speculative=spec.speculative, vocab_size=expect.vocab_size)
    except ResponseCheckError as exc:
        raise ServerCheckError(f"smoke /generate: {exc}") from exc
    except httpx.HTTPError as exc:
        raise ServerCheckError(f"smoke /generate failed: {type(exc).__name__}: {exc}") from exc
