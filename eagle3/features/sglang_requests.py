"""The request side of SGLang capture: endpoint pools with bounded concurrency, and one capture() call's session
(an event loop in a thread, a bounded window of sample tasks, one request per pass per sample).

Every response is checked before it is accepted (``sglang_response.parse_response``, over
``infra.sglang_checks.check_capture_response``): echoed id, prompt_tokens, cached_tokens == 0, echoed prompt
ids, exactly one prefill block with one row per token, row width, all values finite. A failed check, a
timeout or a dropped connection retries the sample (bounded, with backoff, preferably on another endpoint;
a managed server that dropped a request is waited for until its supervisor calls it ready and it answers
/health again); when the retries are spent the capture raises ``CaptureError``
naming the sample and the check. A bad sample is never yielded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httpx
import numpy as np

from eagle3.features.sglang_response import ResponsePart, parse_response
from eagle3.features.spec import FeatureSpec, SampleTokens
from infra.sglang_checks import ResponseCheckError, auth_headers, capture_request_body

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
        super().__init__(
            f"sample {sample_id!r}: check {check!r} failed after {num_attempts} attempt(s) "
            f"(last on {endpoint}): {detail}"
        )
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
        self.endpoints = [
            _Endpoint(t.rstrip("/"), None) if isinstance(t, str) else _Endpoint(t.base_url, t) for t in targets
        ]
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


class CaptureSettings(Protocol):
    """What a session reads of its backend (eagle3.features.sglang_backend.SGLangCaptureBackend) and the retry
    count it adds to."""

    spec: FeatureSpec
    api_key: str | None
    aux_targets: list[str | ServerHandle]
    final_targets: list[str | ServerHandle]
    max_concurrency: int
    request_timeout_s: float
    max_retries: int
    retry_backoff_s: float
    ready_timeout_s: float
    check_servers: bool
    packed: bool
    num_retries: int


class LoopThread:
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


class CaptureSession:
    """One capture() call: the HTTP client, the endpoint pools, and a bounded window of sample tasks."""

    def __init__(self, backend: CaptureSettings, samples: list[SampleTokens]):
        self.b, self.samples = backend, samples
        self.tasks: dict[int, asyncio.Task[tuple[ResponsePart, ResponsePart | None]]] = {}
        self.client: httpx.AsyncClient | None = None

    async def open(self) -> None:
        b, spec = self.b, self.b.spec
        k = spec.topk if spec.supervision == "topk_logprobs" else None
        # A packed row is the aux states, then the final one: (num_aux + 1) * H values.
        width = (spec.num_aux + int(b.packed)) * spec.hidden_size
        self.aux = _Pass("aux", _EndpointPool(b.aux_targets, b.max_concurrency), width, k)
        self.final = (
            _Pass("final", _EndpointPool(b.final_targets, b.max_concurrency), spec.hidden_size)
            if spec.supervision == "final_hidden" and not b.packed
            else None
        )
        num_slots = self.aux.pool.num_slots + (self.final.pool.num_slots if self.final else 0)
        self.window = 2 * num_slots  # keeps every slot busy without buffering the whole list
        self.client = httpx.AsyncClient(
            headers=auth_headers(b.api_key),
            timeout=httpx.Timeout(b.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=num_slots),
        )
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
                raise CaptureError(
                    "-",
                    "server_info",
                    f"{endpoint.url} is not a capture_final server "
                    "(needs --enable-return-hidden-states without aux capture)",
                    1,
                    endpoint.url,
                )

    async def _server_info(self, endpoint: _Endpoint) -> dict[str, Any]:
        """GET /server_info; a managed server that is restarting is waited for once, then asked again."""
        assert self.client is not None
        url = endpoint.url
        try:
            resp = await self.client.get(f"{url}/server_info", timeout=30.0)
        except httpx.TransportError as exc:
            if endpoint.handle is None:
                raise CaptureError(
                    "-", "server_info", f"GET /server_info failed: {type(exc).__name__}: {exc}", 1, url
                ) from exc
            await self._wait_ready(endpoint, "-")
            return await self._server_info(_Endpoint(url, None))
        except httpx.HTTPError as exc:
            raise CaptureError(
                "-", "server_info", f"GET /server_info failed: {type(exc).__name__}: {exc}", 1, url
            ) from exc
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
                log.warning(
                    "sample %s, %s pass on %s: %s %s (attempt %d of %d)",
                    sample.id,
                    p.name,
                    endpoint.url,
                    failure.check,
                    failure.detail,
                    attempt + 1,
                    self.b.max_retries + 1,
                )
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
            resp = await asyncio.wait_for(
                self.client.post(f"{endpoint.url}/generate", json=body), self.b.request_timeout_s
            )
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise _Attempt("timeout", f"no answer within {self.b.request_timeout_s} s") from None
        except httpx.TransportError as exc:
            raise _Attempt("transport", f"{type(exc).__name__}: {exc}", server_died=True) from None
        if resp.status_code != 200:
            raise _Attempt(
                "http_status",
                f"HTTP {resp.status_code}: {resp.text[:300]}",
                retryable=resp.status_code not in PERMANENT_STATUS,
            )
        try:
            return await asyncio.to_thread(
                parse_response, resp.content, sample, p.width, p.top_logprobs_num, self.b.spec.vocab_size
            )
        except ResponseCheckError as exc:
            raise _Attempt(exc.check, exc.detail) from None
        finally:
            log.debug("sample %s %s pass: %.2f s", sample.id, p.name, time.monotonic() - t0)


def _check_aux_server(info: dict[str, Any], spec: FeatureSpec, url: str) -> None:
    """The server must capture exactly spec.aux_layer_ids (SGLang's explicit ids use our convention)."""
    if not info.get("enable_return_aux_hidden_states"):
        raise CaptureError(
            "-", "server_info", f"{url} does not capture aux hidden states (launch it in mode capture_aux)", 1, url
        )
    served = info.get("return_aux_hidden_state_layer_ids")
    # Without explicit ids SGLang captures [1, L//2 - 1, L - 4] in the output-of-layer convention.
    layers = spec.num_layers
    served = list(served) if served else [1, layers // 2 - 1, layers - 4]
    if served != list(spec.aux_layer_ids):
        raise CaptureError(
            "-",
            "server_info",
            f"{url} captures layers {served}, the feature spec says {list(spec.aux_layer_ids)}",
            1,
            url,
        )


def _check_packed_server(info: dict[str, Any], url: str) -> None:
    """A capture_packed server returns full hidden states and no 0.5.23 aux capture of its own.

    Which layers it captures is in its process environment (EAGLE3_SGLANG_CAPTURE_LAYERS), which /server_info
    does not show: a managed server gets the spec's layers; for an existing endpoint that is the caller's word.
    """
    if not (info.get("enable_return_hidden_states") or info.get("return_hidden_states_mode") == "full"):
        raise CaptureError(
            "-",
            "server_info",
            f"{url} does not return hidden states (launch it in mode capture_packed: --enable-return-hidden-states)",
            1,
            url,
        )
    if info.get("enable_return_aux_hidden_states"):
        raise CaptureError(
            "-",
            "server_info",
            f"{url} runs SGLang's own aux capture (capture_aux); capture.sglang.server_mode says capture_packed",
            1,
            url,
        )


def _split_packed(part: ResponsePart, spec: FeatureSpec) -> tuple[ResponsePart, ResponsePart | None]:
    """[T, (K + 1) * H] packed rows -> (aux part [T, K * H], final part [T, H] for final_hidden supervision)."""
    cut = spec.num_aux * spec.hidden_size
    aux = dataclasses.replace(part, rows=np.ascontiguousarray(part.rows[:, :cut]))
    if spec.supervision != "final_hidden":
        return aux, None
    return aux, dataclasses.replace(
        part, rows=np.ascontiguousarray(part.rows[:, cut:]), topk_ids=None, topk_logprobs=None
    )


def _check_join(sample: SampleTokens, aux: ResponsePart, final: ResponsePart | None) -> None:
    """Both halves belong to this sample and saw the same prompt (already checked per pass; cheap to repeat)."""
    if final is None:
        return
    if not aux.rid == final.rid == sample.id:
        raise CaptureError(sample.id, "join", f"aux id {aux.rid!r} and final id {final.rid!r} differ", 1, "-")
    if aux.prompt_ids != final.prompt_ids or aux.rows.shape[0] != final.rows.shape[0]:
        raise CaptureError(sample.id, "join", "the aux and final servers saw different input ids", 1, "-")
