"""SGLangCaptureBackend: target hidden states from SGLang 0.5.23 capture servers, over HTTP JSON.

Each sample is one ``POST /generate`` (``infra.sglang.capture_request_body``): ``input_ids``, ``rid`` =
sample id, a fresh ``extra_key``, ``max_new_tokens`` 1 at temperature 0, ``return_hidden_states``, the
prompt ids echoed back, and for top-K supervision ``return_logprob`` / ``logprob_start_len`` 0 /
``top_logprobs_num`` K. The aux pass goes to servers launched in mode ``capture_aux`` (rows are
num_aux * H wide); supervision ``final_hidden`` needs a second pass on ``capture_final`` servers (rows
H wide), because SGLang does not return the final hidden state in aux mode. The two halves are joined
by sample id, and both echoes of the prompt must equal the ids we sent.

Every response is checked before it is accepted (``sglang_response.parse_response``, over
``infra.sglang.check_capture_response``): echoed id, prompt_tokens, cached_tokens == 0, echoed prompt
ids, exactly one prefill block with one row per token, row width, all values finite. A failed check, a
timeout or a dropped connection retries the sample (bounded, with backoff, preferably on another endpoint;
a managed server that dropped a request is waited for until its supervisor calls it ready and it answers
/health again); when the retries are spent the capture raises ``CaptureError``
naming the sample and the check. A bad sample is never yielded.

Cost of the JSON path: a row is sent as decimal text, about 10-12 bytes per value, and SGLang builds
the Python floats in its scheduler process. One sample of T tokens is T x (num_aux + 1) x H values over
the two passes: T = 4096 at H = 4096 is 67 M values, roughly 700 MB of JSON, seconds of parsing on each
side, and a stalled scheduler meanwhile. That is fine for tests and modest datasets. A binary path would
need a server that writes the tensors itself and returns only their keys: a patched SGLang (like
SpecForge's spec-capture sink), or an ``SGLANG_EXTERNAL_MODEL_PACKAGE`` model wrapper whose forward
writes ``<sample id>.safetensors`` (aux + final, one pass) into a shared directory and whose response
names the file; the client would then check shape/finiteness from the file. Not built here.

Config: ``capture.sglang.endpoints`` are aux-capture servers; for final_hidden with existing servers
``from_config`` also reads ``capture.sglang.final_endpoints`` once that field exists. Empty endpoints
launch managed servers (``infra.sglang.ManagedServer``) that this backend stops in ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import numpy as np

from eagle3.config import RunConfig
from eagle3.features.sglang_response import ResponsePart, parse_response, to_captured_sample
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from infra.gpus import check_gpus_free
from infra.process import RestartPolicy
from infra.sglang import (
    ManagedServer,
    ProbeExpectations,
    ResponseCheckError,
    ServerSpec,
    auth_headers,
    capture_request_body,
)
from infra.sglang_spec import Mode

log = logging.getLogger(__name__)
T = TypeVar("T")
# Client errors that no retry can fix (bad request, auth, wrong path): fail at once.
PERMANENT_STATUS = (400, 401, 403, 404, 422)

class ServerHandle(Protocol):
    """A server we can wait on after it died (infra.sglang.ManagedServer is one)."""

    @property
    def base_url(self) -> str: ...

    def wait_ready(self, timeout_s: float) -> None: ...  # returns once the server answers again


class CaptureError(RuntimeError):
    """A sample whose capture could not be validated within the retry budget."""

    def __init__(self, sample_id: str, check: str, detail: str, num_attempts: int, endpoint: str):
        super().__init__(f"sample {sample_id!r}: check {check!r} failed after {num_attempts} attempt(s) "
                         f"(last on {endpoint}): {detail}")
        self.sample_id, self.check, self.detail = sample_id, check, detail


class _Attempt(Exception):
    """One failed attempt: which check, why, and whether retrying can help."""

    def __init__(self, check: str, detail: str, *, retryable: bool = True, server_died: bool = False):
        super().__init__(detail)
        self.check, self.detail, self.retryable, self.server_died = check, detail, retryable, server_died


@dataclass
class _Endpoint:
    url: str
    handle: ServerHandle | None
    in_flight: int = 0


class _EndpointPool:
    """Endpoints of one pass with at most ``max_concurrency`` requests in flight on each."""

    def __init__(self, targets: Sequence[str | ServerHandle], max_concurrency: int):
        self.endpoints = [_Endpoint(t.rstrip("/"), None) if isinstance(t, str) else _Endpoint(t.base_url, t)
                          for t in targets]
        self.max_concurrency = max_concurrency
        self._cond = asyncio.Condition()

    @property
    def num_slots(self) -> int:
        return len(self.endpoints) * self.max_concurrency

    async def acquire(self, avoid: _Endpoint | None) -> _Endpoint:
        """The least busy endpoint with a free slot, not the one that just failed if another is free."""
        async with self._cond:
            while True:
                free = [e for e in self.endpoints if e.in_flight < self.max_concurrency]
                if free:
                    chosen = min(free, key=lambda e: (e is avoid, e.in_flight))
                    chosen.in_flight += 1
                    return chosen
                await self._cond.wait()

    async def release(self, endpoint: _Endpoint) -> None:
        async with self._cond:
            endpoint.in_flight -= 1
            self._cond.notify()


@dataclass(frozen=True)
class _Pass:
    """One kind of request: where it goes and what its rows must look like."""

    name: str
    pool: _EndpointPool
    width: int
    top_logprobs_num: int | None = None


class SGLangCaptureBackend:
    """CaptureBackend over SGLang servers (several endpoints, or sglang-router replicas, share the work).

    Endpoints are base URLs, or handles with ``wait_ready`` (a ManagedServer) that are waited on after a
    dropped connection. Before the first request each endpoint's /server_info must show the capture
    mode and exactly the spec's aux layers; pass ``check_servers=False`` for a router that does not
    forward /server_info (the per-response checks still apply). The caller owns the servers.
    """

    def __init__(self, spec: FeatureSpec, aux_endpoints: Sequence[str | ServerHandle],
                 final_endpoints: Sequence[str | ServerHandle] = (), *, api_key: str | None = None,
                 max_concurrency: int = 4, request_timeout_s: float = 600.0, max_retries: int = 2,
                 retry_backoff_s: float = 0.5, ready_timeout_s: float = 1800.0, check_servers: bool = True,
                 owned_servers: Sequence[ManagedServer] = (), packed: bool = False):
        if not aux_endpoints:
            raise ValueError("SGLangCaptureBackend needs at least one aux endpoint")
        if packed and final_endpoints:
            raise ValueError("capture_packed servers return the final state themselves: give no final_endpoints")
        if spec.supervision == "final_hidden" and not final_endpoints and not packed:
            raise ValueError("supervision final_hidden needs final_endpoints: servers in mode capture_final "
                             "(SGLang returns no final hidden state from an aux-capture server)")
        if spec.supervision == "topk_logprobs" and not spec.topk:
            raise ValueError("supervision topk_logprobs needs spec.topk")
        self.spec, self.api_key = spec, api_key
        self.aux_targets, self.final_targets = list(aux_endpoints), list(final_endpoints)
        self.max_concurrency, self.request_timeout_s = max_concurrency, request_timeout_s
        self.max_retries, self.retry_backoff_s, self.ready_timeout_s = max_retries, retry_backoff_s, ready_timeout_s
        self.check_servers, self.owned_servers = check_servers, list(owned_servers)
        self.packed = packed
        self.num_retries = 0

    @classmethod
    def from_config(cls, cfg: RunConfig, model_dir: Path, spec: FeatureSpec) -> SGLangCaptureBackend:
        """capture.sglang settings -> a backend on existing endpoints, or on managed servers it launches (as the
        run's server section says) and owns.

        Managed: a capture_aux server on ``port`` and, for final_hidden, a capture_final server on
        ``port + 1``, on the same GPUs (each gets half the memory unless mem_fraction_static is set).
        """
        sg, server = cfg.capture.sglang, cfg.server
        managed = _MANAGED.get(sg.endpoints[0]) if sg.endpoints else None
        api_key = managed.api_key if managed is not None else None
        api_key = api_key or (os.environ.get(server.api_key_env) if server.api_key_env else None)
        kwargs: dict[str, Any] = dict(max_concurrency=sg.max_concurrency, request_timeout_s=sg.request_timeout_s,
                                      ready_timeout_s=server.startup_timeout_s,
                                      packed=sg.server_mode == "capture_packed")
        if sg.endpoints:  # this process's managed servers come as handles: a restart is waited for, not failed on
            return cls(spec, [_MANAGED.get(u, u) for u in sg.endpoints],
                       [_MANAGED.get(u, u) for u in sg.final_endpoints], api_key=api_key, **kwargs)
        api_key = api_key or secrets.token_hex(16)
        servers = _launch_servers(cfg, model_dir, spec, api_key)
        return cls(spec, servers[:1], servers[1:], api_key=api_key, owned_servers=servers, **kwargs)

    def capture(self, samples: list[SampleTokens]) -> Iterator[CapturedSample]:
        """Yield one validated CapturedSample per input sample, in order; raise CaptureError on a bad one."""
        if not samples:
            return
        loop, session = _LoopThread(), _Session(self, list(samples))
        try:
            loop.run(session.open())
            for index in range(len(samples)):
                yield to_captured_sample(samples[index], loop.run(session.result(index)))
        finally:
            loop.run(session.aclose())
            loop.close()

    def close(self) -> None:
        """Stop the servers this backend launched (clients live only inside capture())."""
        for server in self.owned_servers:
            server.stop()
        self.owned_servers = []


class _LoopThread:
    """An event loop in a daemon thread, so requests keep flowing while the caller writes shards."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-capture", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the loop thread and wait for its result (exceptions propagate)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class _Session:
    """One capture() call: the HTTP client, the endpoint pools, and a bounded window of sample tasks."""

    def __init__(self, backend: SGLangCaptureBackend, samples: list[SampleTokens]):
        self.b, self.samples = backend, samples
        self.tasks: dict[int, asyncio.Task[tuple[ResponsePart, ResponsePart | None]]] = {}
        self.client: httpx.AsyncClient | None = None

    async def open(self) -> None:
        b, spec = self.b, self.b.spec
        k = spec.topk if spec.supervision == "topk_logprobs" else None
        # A packed row is the aux states, then the final one: (num_aux + 1) * H values.
        width = (spec.num_aux + int(b.packed)) * spec.hidden_size
        self.aux = _Pass("aux", _EndpointPool(b.aux_targets, b.max_concurrency), width, k)
        self.final = (_Pass("final", _EndpointPool(b.final_targets, b.max_concurrency), spec.hidden_size)
                      if spec.supervision == "final_hidden" and not b.packed else None)
        num_slots = self.aux.pool.num_slots + (self.final.pool.num_slots if self.final else 0)
        self.window = 2 * num_slots  # keeps every slot busy without buffering the whole list
        self.client = httpx.AsyncClient(headers=auth_headers(b.api_key),
                                        timeout=httpx.Timeout(b.request_timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=num_slots))
        if b.check_servers:
            await self._check_servers()

    async def aclose(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    async def result(self, index: int) -> tuple[ResponsePart, ResponsePart | None]:
        for i in range(index, min(index + self.window, len(self.samples))):
            if i not in self.tasks:
                self.tasks[i] = asyncio.create_task(self._capture_one(self.samples[i]))
        try:
            return await self.tasks[index]
        finally:
            del self.tasks[index]  # a finished sample's arrays belong to the caller now

    async def _check_servers(self) -> None:
        """The width check cannot see WHICH layers a server captures: compare /server_info with the spec."""
        for endpoint in self.aux.pool.endpoints:
            info = await self._server_info(endpoint)
            if self.b.packed:
                _check_packed_server(info, endpoint.url)
            else:
                _check_aux_server(info, self.b.spec, endpoint.url)
        for endpoint in self.final.pool.endpoints if self.final else []:
            info = await self._server_info(endpoint)
            if info.get("return_hidden_states_mode") != "full" or info.get("enable_return_aux_hidden_states"):
                raise CaptureError("-", "server_info", f"{endpoint.url} is not a capture_final server "
                                   "(needs --enable-return-hidden-states without aux capture)", 1, endpoint.url)

    async def _server_info(self, endpoint: _Endpoint) -> dict[str, Any]:
        """GET /server_info; a managed server that is restarting is waited for once, then asked again."""
        assert self.client is not None
        url = endpoint.url
        try:
            resp = await self.client.get(f"{url}/server_info", timeout=30.0)
        except httpx.TransportError as exc:
            if endpoint.handle is None:
                raise CaptureError("-", "server_info", f"GET /server_info failed: {type(exc).__name__}: {exc}", 1,
                                   url) from exc
            await self._wait_ready(endpoint, "-")
            return await self._server_info(_Endpoint(url, None))
        except httpx.HTTPError as exc:
            raise CaptureError("-", "server_info", f"GET /server_info failed: {type(exc).__name__}: {exc}", 1,
                               url) from exc
        if resp.status_code != 200:
            raise CaptureError("-", "server_info", f"GET /server_info answered {resp.status_code}", 1, url)
        return resp.json()

    async def _capture_one(self, sample: SampleTokens) -> tuple[ResponsePart, ResponsePart | None]:
        passes = [self.aux] + ([self.final] if self.final else [])
        tasks = [asyncio.create_task(self._fetch(p, sample)) for p in passes]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        if self.b.packed:
            return _split_packed(parts[0], self.b.spec)
        final = parts[1] if len(parts) > 1 else None
        _check_join(sample, parts[0], final)
        return parts[0], final

    async def _fetch(self, p: _Pass, sample: SampleTokens) -> ResponsePart:
        """One pass for one sample, retried (bounded) until a response passes every check."""
        avoid: _Endpoint | None = None
        for attempt in range(self.b.max_retries + 1):
            if attempt:
                self.b.num_retries += 1
                await asyncio.sleep(self.b.retry_backoff_s * 2 ** (attempt - 1))
            endpoint = await p.pool.acquire(avoid)
            try:
                return await self._attempt(p, endpoint, sample)
            except _Attempt as failure:
                last = failure
                log.warning("sample %s, %s pass on %s: %s %s (attempt %d of %d)", sample.id, p.name,
                            endpoint.url, failure.check, failure.detail, attempt + 1, self.b.max_retries + 1)
            finally:
                await p.pool.release(endpoint)
            if not last.retryable:
                break
            if last.server_died and endpoint.handle is not None:
                await self._wait_ready(endpoint, sample.id)
            avoid = endpoint
        raise CaptureError(sample.id, last.check, f"{p.name} pass: {last.detail}", attempt + 1, endpoint.url)

    async def _wait_ready(self, endpoint: _Endpoint, sample_id: str) -> None:
        """Wait until a managed server that dropped a request is ready and answers again (its supervisor's call)."""
        assert endpoint.handle is not None
        try:
            await asyncio.to_thread(endpoint.handle.wait_ready, self.b.ready_timeout_s)
        except Exception as exc:  # the supervisor gave up: nothing left to retry on
            raise CaptureError(sample_id, "server", str(exc), 1, endpoint.url) from exc

    async def _attempt(self, p: _Pass, endpoint: _Endpoint, sample: SampleTokens) -> ResponsePart:
        assert self.client is not None
        body = capture_request_body(sample.input_ids, sample.id, top_logprobs_num=p.top_logprobs_num)
        t0 = time.monotonic()
        try:
            resp = await asyncio.wait_for(self.client.post(f"{endpoint.url}/generate", json=body),
                                          self.b.request_timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise _Attempt("timeout", f"no answer within {self.b.request_timeout_s} s") from None
        except httpx.TransportError as exc:
            raise _Attempt("transport", f"{type(exc).__name__}: {exc}", server_died=True) from None
        if resp.status_code != 200:
            raise _Attempt("http_status", f"HTTP {resp.status_code}: {resp.text[:300]}",
                           retryable=resp.status_code not in PERMANENT_STATUS)
        try:
            return await asyncio.to_thread(parse_response, resp.content, sample, p.width, p.top_logprobs_num,
                                           self.b.spec.vocab_size)
        except ResponseCheckError as exc:
            raise _Attempt(exc.check, exc.detail) from None
        finally:
            log.debug("sample %s %s pass: %.2f s", sample.id, p.name, time.monotonic() - t0)


def _check_aux_server(info: dict[str, Any], spec: FeatureSpec, url: str) -> None:
    """The server must capture exactly spec.aux_layer_ids (SGLang's explicit ids use our convention)."""
    if not info.get("enable_return_aux_hidden_states"):
        raise CaptureError("-", "server_info", f"{url} does not capture aux hidden states "
                           "(launch it in mode capture_aux)", 1, url)
    served = info.get("return_aux_hidden_state_layer_ids")
    # Without explicit ids SGLang captures [1, L//2 - 1, L - 4] in the output-of-layer convention.
    layers = spec.num_layers
    served = list(served) if served else [1, layers // 2 - 1, layers - 4]
    if served != list(spec.aux_layer_ids):
        raise CaptureError("-", "server_info", f"{url} captures layers {served}, the feature spec says "
                           f"{list(spec.aux_layer_ids)}", 1, url)


def _check_packed_server(info: dict[str, Any], url: str) -> None:
    """A capture_packed server returns full hidden states and no 0.5.23 aux capture of its own.

    Which layers it captures is in its process environment (EAGLE3_SGLANG_CAPTURE_LAYERS), which /server_info
    does not show: a managed server gets the spec's layers; for an existing endpoint that is the caller's word.
    """
    if not (info.get("enable_return_hidden_states") or info.get("return_hidden_states_mode") == "full"):
        raise CaptureError("-", "server_info", f"{url} does not return hidden states "
                           "(launch it in mode capture_packed: --enable-return-hidden-states)", 1, url)
    if info.get("enable_return_aux_hidden_states"):
        raise CaptureError("-", "server_info", f"{url} runs SGLang's own aux capture (capture_aux); "
                           "capture.sglang.server_mode says capture_packed", 1, url)


def _split_packed(part: ResponsePart, spec: FeatureSpec) -> tuple[ResponsePart, ResponsePart | None]:
    """[T, (K + 1) * H] packed rows -> (aux part [T, K * H], final part [T, H] for final_hidden supervision)."""
    cut = spec.num_aux * spec.hidden_size
    aux = dataclasses.replace(part, rows=np.ascontiguousarray(part.rows[:, :cut]))
    if spec.supervision != "final_hidden":
        return aux, None
    return aux, dataclasses.replace(part, rows=np.ascontiguousarray(part.rows[:, cut:]), topk_ids=None,
                                    topk_logprobs=None)


def _check_join(sample: SampleTokens, aux: ResponsePart, final: ResponsePart | None) -> None:
    """Both halves belong to this sample and saw the same prompt (already checked per pass; cheap to repeat)."""
    if final is None:
        return
    if not aux.rid == final.rid == sample.id:
        raise CaptureError(sample.id, "join", f"aux id {aux.rid!r} and final id {final.rid!r} differ", 1, "-")
    if aux.prompt_ids != final.prompt_ids or aux.rows.shape[0] != final.rows.shape[0]:
        raise CaptureError(sample.id, "join", "the aux and final servers saw different input ids", 1, "-")


def _launch_servers(cfg: RunConfig, model_dir: Path, spec: FeatureSpec, api_key: str) -> list[ManagedServer]:
    """Start the capture_aux (and for final_hidden the capture_final) server; stop both if either fails."""
    sg, server = cfg.capture.sglang, cfg.server
    modes: list[Mode]
    if sg.server_mode == "capture_packed":
        modes = ["capture_packed"]
    else:
        modes = ["capture_aux"]
        if spec.supervision == "final_hidden":
            modes.append("capture_final")
    mem = sg.mem_fraction_static or (0.8 / len(modes) if len(modes) > 1 else None)
    check_gpus_free(_gpu_indices(server.tp_size * sg.dp_size), allow_shared=cfg.capture.allow_shared_gpus)
    servers: list[ManagedServer] = []
    try:
        for offset, mode in enumerate(modes):
            server_spec = ServerSpec(str(model_dir), mode, port=sg.port + offset, host=server.host,
                                     allow_remote=server.allow_remote_host, tp_size=server.tp_size,
                                     dp_size=sg.dp_size, api_key=api_key, mem_fraction_static=mem,
                                     attention_backend=server.attention_backend,
                                     aux_layer_ids=tuple(spec.aux_layer_ids) if mode != "capture_final" else None,
                                     extra_args=tuple(server.extra_args), python=server.python,
                                     module=server.launch_module)
            managed = ManagedServer(server_spec, cfg.run_dir / "logs" / f"sglang-{mode}.log",
                                    expect=ProbeExpectations(hidden_size=spec.hidden_size, vocab_size=spec.vocab_size),
                                    startup_timeout_s=server.startup_timeout_s,
                                    policy=RestartPolicy(max_restarts=sg.max_restarts))
            managed.check_port()  # both ports, before the first launch spends minutes loading weights
            servers.append(managed)
        for managed in servers:
            managed.start()
    except BaseException:
        for managed in servers:
            managed.stop()
        raise
    return servers


def _gpu_indices(num_gpus: int) -> list[int]:
    """The GPUs a server will use: the first of CUDA_VISIBLE_DEVICES (when numeric), else 0..n-1."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip().isdigit()]
    return [int(d) for d in visible[:num_gpus]] if visible else list(range(num_gpus))


_MANAGED: dict[str, ManagedServer] = {}
"""Base URL -> the server ``managed_endpoints`` runs in this process (its API key, and its restarts to wait for)."""


@contextlib.contextmanager
def managed_endpoints(cfg: RunConfig, model_dir: Path, spec: FeatureSpec) -> Iterator[RunConfig]:
    """Launch the capture servers once for a whole capture and yield a config that points at them.

    Shard tasks (threads of this process) then build backends on existing endpoints (no launch per
    shard); the API key is handed over in this process's memory (``_MANAGED``), never through
    ``os.environ``, which every child process would inherit. Servers stop on exit.
    """
    sg = cfg.capture.sglang
    if sg.endpoints:
        yield cfg
        return
    env = cfg.server.api_key_env
    api_key = (os.environ.get(env) if env else None) or secrets.token_hex(16)
    servers = _launch_servers(cfg, model_dir, spec, api_key)
    urls = [server.spec.base_url for server in servers]
    _MANAGED.update({server.spec.base_url: server for server in servers})
    try:
        sglang = sg.model_copy(update={"endpoints": urls[:1], "final_endpoints": urls[1:]})
        yield cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"sglang": sglang})})
    finally:
        for server in servers:
            server.stop()
        for url in urls:
            _MANAGED.pop(url, None)
