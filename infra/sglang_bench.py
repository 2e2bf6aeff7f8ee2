"""Benchmark one serving SGLang server (0.5.16 or 0.5.23); infra/sglang_compare.py compares two runs.

Hygiene (as in SGLang's python/sglang/benchmark/serving.py): the same fixed prompts for every server, temperature
0 (or the settings' sampling), a fixed ``max_new_tokens`` with ``ignore_eos``, and before each measured concurrency
level some warmup requests followed by ``POST /flush_cache``. Every answer is checked (HTTP 200, meta_info with
the request's id, ``completion_tokens == max_new_tokens``, verify steps on a speculative server and
none on a baseline) before it counts. Requests stream (server-sent events), so the time to the first
token is measured per request. The records a run fills, and the metrics per level, are
infra/sglang_bench_records.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import httpx

from infra.sglang_bench_records import (  # noqa: F401 (MeasurementError re-exported: callers import it from here)
    SHARED_SETTINGS,
    SPEC_SETTINGS,
    BenchResult,
    BenchSettings,
    LevelResult,
    MeasurementError,
    Prompt,
    RequestSample,
    fixed_prompts,
    output_digest,
    prompts_digest,
    summarize_level,
)
from infra.sglang_checks import ResponseCheckError, auth_headers, response_meta

ProgressFn = Callable[[int, int, dict[str, Any]], None]
clock: Callable[[], float] = time.perf_counter  # every timing here reads this; tests swap in a scripted clock


class BenchmarkError(RuntimeError):
    """A request or answer the benchmark cannot count; the message names the server, request and check."""


# ---------------------------------------------------------------- one request


def bench_request_body(
    prompt: Prompt,
    rid: str,
    max_new_tokens: int,
    ignore_eos: bool = True,
    sampling: dict[str, float | int] | None = None,
) -> dict[str, Any]:
    """A streamed /generate body, greedy unless ``sampling`` (BenchSettings.sampling_params) samples: exactly
    ``max_new_tokens`` tokens, or up to them with ``ignore_eos`` off."""
    body: dict[str, Any] = {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
    params = {"max_new_tokens": max_new_tokens, **(sampling or {"temperature": 0}), "ignore_eos": ignore_eos}
    return body | {"rid": rid, "stream": True, "sampling_params": params}


def check_bench_answer(
    final: Any, *, rid: str, max_new_tokens: int, speculative: bool, ignore_eos: bool = True
) -> dict[str, Any]:
    """The last streamed chunk's checked meta_info; ResponseCheckError names the failed check."""
    if final is None:
        raise ResponseCheckError("stream", "the stream ended without a data chunk")
    meta = response_meta(final, rid)
    got = meta.get("completion_tokens")
    if not ignore_eos and isinstance(got, int) and 1 <= got <= max_new_tokens:
        pass  # stopped at end of turn, or at the cap
    elif got != max_new_tokens:
        raise ResponseCheckError(
            "completion_tokens",
            f"{got} tokens for max_new_tokens {max_new_tokens} with "
            "ignore_eos: the server stopped early or ignored the sampling params",
        )
    ids = final.get("output_ids")
    if not isinstance(ids, list) or len(ids) != got:
        raise ResponseCheckError(
            "output_ids",
            f"{len(ids) if isinstance(ids, list) else 'no'} output ids for {got} "
            "tokens (incremental streaming output is not supported)",
        )
    verify_ct = meta.get("spec_verify_ct")
    if speculative and not (isinstance(verify_ct, int) and verify_ct > 0):
        raise ResponseCheckError("spec_verify_ct", f"spec_verify_ct is {verify_ct!r}: the draft did not run")
    if not speculative and verify_ct is not None:
        raise ResponseCheckError("spec_verify_ct", "the baseline server reports verify steps: it is speculative")
    return meta


async def _stream_generate(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[Any, float | None]:
    """POST a streamed /generate; (last data chunk, clock() time of the first chunk with tokens)."""
    last, first_at = None, None
    async with client.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            raise ResponseCheckError("http_status", f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            payload = line[len("data:") :].strip() if line.startswith("data:") else None
            if payload is None or payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            if not isinstance(chunk, dict) or "error" in chunk:
                raise ResponseCheckError(
                    "stream_error", str(chunk.get("error") if isinstance(chunk, dict) else chunk)[:300]
                )
            if first_at is None and (chunk.get("output_ids") or chunk.get("text")):
                first_at = clock()
            last = chunk
    return last, first_at


async def measure_request(
    client: httpx.AsyncClient,
    prompt: Prompt,
    index: int,
    *,
    max_new_tokens: int,
    speculative: bool,
    label: str,
    ignore_eos: bool = True,
    sampling: dict[str, float | int] | None = None,
) -> RequestSample:
    """Send one prompt, check the answer, time it; BenchmarkError names the request and the check."""
    rid = f"bench-{label}-{index}-{uuid.uuid4().hex[:8]}"
    t0 = clock()
    body = bench_request_body(prompt, rid, max_new_tokens, ignore_eos, sampling)
    try:
        final, first_at = await _stream_generate(client, body)
        meta = check_bench_answer(
            final, rid=rid, max_new_tokens=max_new_tokens, speculative=speculative, ignore_eos=ignore_eos
        )
    except ResponseCheckError as exc:
        raise BenchmarkError(f"{client.base_url} request {rid} (prompt {index}): {exc}") from exc
    except (httpx.HTTPError, ValueError) as exc:
        raise BenchmarkError(f"{client.base_url} request {rid} (prompt {index}): {type(exc).__name__}: {exc}") from exc
    end = clock()
    digest = output_digest(final["output_ids"])
    return RequestSample(
        index,
        end - t0,
        (first_at or end) - t0,
        meta["completion_tokens"],
        int(meta.get("cached_tokens") or 0),
        meta.get("spec_verify_ct"),
        digest,
        tuple(int(i) for i in final["output_ids"]),
    )


# ---------------------------------------------------------------- levels and runs


async def run_requests(
    client: httpx.AsyncClient, prompts: Sequence[Prompt], concurrency: int, measure: Callable[..., Any]
) -> tuple[list[RequestSample], float]:
    """Keep ``concurrency`` requests in flight until every prompt is answered; (samples, wall seconds)."""
    pending = list(enumerate(prompts))
    samples: list[RequestSample] = []

    async def worker() -> None:
        while pending:
            index, prompt = pending.pop(0)
            samples.append(await measure(client, prompt, index))

    t0 = clock()
    tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(prompts)))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return samples, clock() - t0


async def flush_cache(client: httpx.AsyncClient) -> None:
    """POST /flush_cache; SGLang refuses (400) while requests run, so a failure means the server was not idle."""
    resp = await client.post("/flush_cache")
    if resp.status_code != 200:
        raise BenchmarkError(
            f"{client.base_url} POST /flush_cache answered {resp.status_code}: {resp.text[:200]} "
            "(the next level would start with a warm prefix cache)"
        )


async def server_settings(client: httpx.AsyncClient) -> dict[str, Any]:
    """The shared and speculative settings plus the version from /server_info."""
    resp = await client.get("/server_info")
    if resp.status_code != 200:
        raise BenchmarkError(f"{client.base_url} GET /server_info answered {resp.status_code}")
    info = resp.json()
    return {key: info.get(key) for key in (*SHARED_SETTINGS, *SPEC_SETTINGS, "version")}


async def _server_accept_length(client: httpx.AsyncClient) -> float | None:
    """SGLang's own acceptance length since the last flush (a cross-check; None when not reported)."""
    resp = await client.get("/server_info")
    states = (resp.json().get("internal_states") if resp.status_code == 200 else None) or [{}]
    value = states[0].get("avg_spec_accept_length")
    return float(value) if isinstance(value, (int, float)) else None


class _Counter:
    """Requests done across all levels, forwarded to a ProgressFn."""

    def __init__(self, total: int, progress: ProgressFn | None):
        self.done, self.total, self.progress = 0, total, progress

    def tick(self, level: int) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, {"concurrency": level})


async def run_level(
    client: httpx.AsyncClient,
    prompts: Sequence[Prompt],
    warmup: Sequence[Prompt],
    concurrency: int,
    settings: BenchSettings,
    speculative: bool,
    counter: _Counter,
) -> LevelResult:
    """Warmup at this concurrency, flush the cache, then measure every prompt."""

    def measure(label: str) -> Callable[..., Any]:
        async def one(client: httpx.AsyncClient, prompt: Prompt, index: int) -> RequestSample:
            sample = await measure_request(
                client,
                prompt,
                index,
                max_new_tokens=settings.max_new_tokens,
                speculative=speculative,
                label=label,
                ignore_eos=settings.ignore_eos,
                sampling=settings.sampling_params(),
            )
            counter.tick(concurrency)
            return sample

        return one

    if warmup:
        await run_requests(client, warmup, concurrency, measure(f"warmup-c{concurrency}"))
    await flush_cache(client)
    samples, duration_s = await run_requests(client, prompts, concurrency, measure(f"c{concurrency}"))
    server_accept = await _server_accept_length(client) if speculative else None
    return summarize_level(concurrency, samples, duration_s, speculative, server_accept)


async def run_benchmark_async(
    base_url: str,
    prompts: Sequence[Prompt],
    settings: BenchSettings,
    *,
    speculative: bool,
    api_key: str | None = None,
    progress: ProgressFn | None = None,
) -> BenchResult:
    """Every level in order against one server (already ready); see the module doc."""
    if len(prompts) != settings.num_prompts:
        raise ValueError(f"{len(prompts)} prompts given, settings say num_prompts {settings.num_prompts}")
    warmup: Sequence[Prompt] = fixed_prompts(settings.num_prompts + settings.num_warmup)[settings.num_prompts :]
    if prompts and not isinstance(prompts[0], str):  # token ids: every prompt is a list
        warmup = [list(cast("list[int]", prompts[i % len(prompts)]))[::-1] for i in range(settings.num_warmup)]
    counter = _Counter(len(settings.concurrency_levels) * (settings.num_prompts + settings.num_warmup), progress)
    limits = httpx.Limits(max_connections=max(settings.concurrency_levels) + 2)
    async with httpx.AsyncClient(
        base_url=base_url,
        headers=auth_headers(api_key),
        limits=limits,
        timeout=httpx.Timeout(settings.request_timeout_s),
    ) as client:
        found = await server_settings(client)
        levels = [
            await run_level(client, prompts, warmup, level, settings, speculative, counter)
            for level in settings.concurrency_levels
        ]
    return BenchResult(base_url, speculative, settings, prompts_digest(prompts), found, tuple(levels))


def run_benchmark(
    base_url: str,
    prompts: Sequence[Prompt],
    settings: BenchSettings,
    *,
    speculative: bool,
    api_key: str | None = None,
    progress: ProgressFn | None = None,
) -> BenchResult:
    """Synchronous wrapper of ``run_benchmark_async`` (its own event loop)."""
    return asyncio.run(
        run_benchmark_async(base_url, prompts, settings, speculative=speculative, api_key=api_key, progress=progress)
    )
