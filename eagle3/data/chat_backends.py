"""Chat backends of regeneration: an OpenAI-compatible endpoint over HTTP, or transformers in process.

A backend answers one chat history with one assistant message (``ChatBackend.complete``). A failure that
belongs to the row raises ``CompletionError`` (the conversation goes to the errors file); an endpoint that
cannot be reached at all raises ``EndpointUnreachable`` and stops the run (eagle3.data.regenerate).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from eagle3.config import RegenerateConfig

Message = dict[str, str]

# --------------------------------------------------------------------------- backend contract

_JITTER = random.Random()  # retry jitter of its own: drawing it never moves the process's random stream


@dataclass(frozen=True)
class Completion:
    """One generated assistant turn."""

    content: str
    finish_reason: str | None


class CompletionError(Exception):
    """A turn that could not be generated; the conversation goes to the errors file.

    Only this exception marks a row as failed. Anything else raised by a backend is a bug or an
    environment problem and aborts the run, so it cannot poison the journal with thousands of
    error records that a resume would then skip.
    """

    def __init__(self, kind: str, message: str, *, retryable: bool = False, retry_after_s: float = 0.0):
        super().__init__(message)
        self.kind, self.message = kind, message
        self.retryable, self.retry_after_s = retryable, retry_after_s
        self.num_attempts = 1


class EndpointUnreachable(RuntimeError):
    """The endpoint cannot be reached at all (after retries): the run stops instead of failing rows.

    A down or misconfigured server is not a property of a row; recording it as a row error would
    mark every remaining row as done in the journal. Stopping keeps the finished rows, and a re-run
    (or the orchestrator's task retry) resumes once the server is back.
    """


class ChatBackend(Protocol):
    """Something that answers a chat history with one assistant message."""

    max_parallel: int
    """Conversations the runner keeps in flight at once."""

    def session(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Open per-run resources (HTTP client, batcher) inside the running event loop."""
        ...

    async def complete(self, messages: list[Message], request_id: str) -> Completion:
        """Answer the history; raise CompletionError for a failure that belongs to this row."""
        ...


# --------------------------------------------------------------------------- OpenAI-compatible HTTP


def parse_chat_response(payload: Any) -> Completion:
    """Validate an OpenAI chat-completions body and pull out choices[0].message.content."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise CompletionError("invalid_response", f"no choices in response: {str(payload)[:200]}")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise CompletionError("invalid_response", f"choices[0].message.content is {type(content).__name__}, not str")
    if not content.strip():
        raise CompletionError("empty_content", "the model returned an empty answer")
    return Completion(content=content, finish_reason=choices[0].get("finish_reason"))


def _retry_after_s(response: httpx.Response) -> float:
    """Seconds the server asked us to wait (Retry-After in seconds), 0 when absent or unparsable."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "0")))
    except ValueError:
        return 0.0


class OpenAIChatBackend:
    """POST {endpoint}/chat/completions with retries, backoff and a per-request deadline."""

    def __init__(
        self,
        cfg: RegenerateConfig,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 20.0,
    ):
        self.cfg, self.max_parallel = cfg, cfg.max_concurrency
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self._transport = transport
        self._api_key = api_key if api_key is not None else _key_from_env(cfg.api_key_env)
        self._client: httpx.AsyncClient | None = None
        self.num_requests = 0
        self.num_retries = 0

    def __repr__(self) -> str:
        # Never show the key, not even in a traceback's locals.
        return f"OpenAIChatBackend(endpoint={self.cfg.endpoint!r}, model={self.cfg.model!r})"

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        limits = httpx.Limits(max_connections=self.max_parallel, max_keepalive_connections=self.max_parallel)
        async with httpx.AsyncClient(
            base_url=self.cfg.endpoint.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(self.cfg.timeout_s),
            limits=limits,
            transport=self._transport,
        ) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    async def complete(self, messages: list[Message], request_id: str) -> Completion:
        attempt = 1
        while True:
            try:
                return await self._post_once(messages, request_id)
            except CompletionError as exc:
                exc.num_attempts = attempt
                if exc.retryable and attempt <= self.cfg.max_retries:
                    await asyncio.sleep(self._backoff_s(attempt, exc.retry_after_s))
                    self.num_retries += 1
                    attempt += 1
                    continue
                if exc.kind == "transport_error":
                    raise EndpointUnreachable(
                        f"cannot reach {self.cfg.endpoint} after {attempt} attempt(s): {exc.message}"
                    ) from None
                raise

    def _backoff_s(self, attempt: int, retry_after_s: float) -> float:
        # Full jitter keeps many workers that failed together from retrying together.
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        return max(_JITTER.uniform(0.0, ceiling), min(retry_after_s, self.backoff_max_s))

    async def _post_once(self, messages: list[Message], request_id: str) -> Completion:
        if self._client is None:
            raise RuntimeError("OpenAIChatBackend.complete() called outside session()")
        body = {
            "model": self.cfg.model,
            "messages": messages,
            "max_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
        }
        self.num_requests += 1
        try:
            # httpx's timeout bounds each read; the outer deadline bounds the whole request,
            # so a server that trickles bytes cannot hold a worker forever.
            response = await asyncio.wait_for(
                self._client.post("chat/completions", json=body, headers={"X-Request-Id": request_id}),
                timeout=self.cfg.timeout_s,
            )
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise CompletionError("timeout", f"no answer within {self.cfg.timeout_s} s", retryable=True) from None
        except httpx.TransportError as exc:
            raise CompletionError("transport_error", f"{type(exc).__name__}: {exc}", retryable=True) from None
        return _check_response(response)


def _check_response(response: httpx.Response) -> Completion:
    """Map HTTP status to retryable / permanent errors, then validate the body."""
    code = response.status_code
    if code != 200:
        raise CompletionError(
            f"http_{code}",
            f"HTTP {code}: {response.text[:300]}",
            retryable=code == 429 or code >= 500,
            retry_after_s=_retry_after_s(response),
        )
    try:
        payload = response.json()
    except ValueError:
        raise CompletionError("invalid_response", f"body is not JSON: {response.text[:200]!r}") from None
    return parse_chat_response(payload)


def _key_from_env(env_name: str | None) -> str | None:
    """Read the API key from the named variable; a configured but unset variable is an error."""
    if env_name is None:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise ValueError(f"regenerate.api_key_env names {env_name!r}, but that environment variable is not set")
    return key


# --------------------------------------------------------------------------- in-process transformers

# How often the batcher yields to the event loop before cutting a partial batch: after a batch
# finishes, every woken conversation submits its next turn within one or two loop iterations.
_BATCH_GATHER_YIELDS = 8


class HFGenerateBackend:
    """transformers ``generate`` on the k-th turns of several conversations at once.

    Turns depend on earlier answers, so a batch can only hold one pending turn per
    conversation; the runner keeps ``batch_size_conversations`` conversations in flight and a
    small batcher task collects their pending turns into one batch for ``TokenGenerator``
    (``eagle3/data/generate.py``: static cache compiled on CUDA, plain generate, or continuous batching).
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: RegenerateConfig):
        from eagle3.data.generate import GenerationSettings, TokenGenerator

        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.max_parallel = cfg.batch_size_conversations
        self.num_requests = 0
        self.num_retries = 0
        self._pending: list[tuple[list[Message], asyncio.Future[Completion]]] = []
        self._has_work: asyncio.Event | None = None
        self._eos = generation_eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.generator = TokenGenerator(
            model,
            GenerationSettings(
                max_new_tokens=cfg.max_new_tokens,
                eos_ids=self._eos,
                pad_id=int(pad) if pad is not None else self._eos[0],
                temperature=cfg.temperature,
                backend=cfg.generation_backend,
                batch_size=cfg.batch_size_conversations,
                prompt_bucket=cfg.prompt_bucket,
                decode_attention=cfg.decode_attention,
                straggler_rows=cfg.straggler_rows,
                compile_dynamic=cfg.compile_dynamic,
                loop_stop_tokens=cfg.loop_stop_tokens,
            ),
        )

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        self._has_work, self._pending = asyncio.Event(), []
        loop_task = asyncio.create_task(self._batch_loop())
        try:
            yield
        finally:
            self._has_work = None
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task

    async def complete(self, messages: list[Message], request_id: str) -> Completion:
        if self._has_work is None:
            raise RuntimeError("HFGenerateBackend.complete() called outside session()")
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append((messages, future))
        self._has_work.set()
        return await future

    async def _batch_loop(self) -> None:
        assert self._has_work is not None
        while True:
            await self._has_work.wait()
            for _ in range(_BATCH_GATHER_YIELDS):
                if len(self._pending) >= self.max_parallel:
                    break
                await asyncio.sleep(0)
            batch, self._pending = self._pending[: self.max_parallel], self._pending[self.max_parallel :]
            if not self._pending:
                self._has_work.clear()
            self._run_batch(batch)

    def _run_batch(self, batch: list[tuple[list[Message], asyncio.Future[Completion]]]) -> None:
        # Errors go onto the futures, never out of the batcher task, so no caller waits forever.
        live = [(msgs, fut) for msgs, fut in batch if not fut.done()]
        if not live:
            return
        try:
            results = self.generate_batch([msgs for msgs, _ in live])
        except BaseException as exc:  # noqa: BLE001 - re-raised in every waiting conversation
            for _, fut in live:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), result in zip(live, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, CompletionError):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    def generate_batch(self, conversations: list[list[Message]]) -> list[Completion | CompletionError]:
        """Answer several histories in one batch (an error per unusable answer)."""
        tok = self.tokenizer
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        # The template already writes BOS where the model wants one; adding it again would double it.
        rows = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        answers = self.generator.generate(rows)
        self.num_requests += len(conversations)
        return [self.decode(row) for row in answers]

    def decode(self, new_ids: list[int]) -> Completion | CompletionError:
        """New token ids cut after their first eos -> the answer ('stop' or 'length'), an error when empty."""
        stopped = bool(new_ids) and new_ids[-1] in self._eos  # rows come back cut after their first eos
        text = self.tokenizer.decode(new_ids[:-1] if stopped else new_ids, skip_special_tokens=True)
        if not text.strip():
            return CompletionError("empty_content", "the model returned an empty answer")
        return Completion(text, "stop" if stopped else "length")


def generation_eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """End ids from the generation config (e.g. Llama-3's <|eot_id|>) and the tokenizer."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("tokenizer and generation config define no eos token; generation would never stop")
    return tuple(sorted(ids))


def make_backend(cfg: RegenerateConfig, model: Any = None, tokenizer: Any = None) -> ChatBackend:
    """The backend cfg.backend names; the hf backend needs the loaded model and tokenizer."""
    if cfg.backend == "openai":
        return OpenAIChatBackend(cfg)
    if model is None or tokenizer is None:
        raise ValueError("regenerate.backend='hf' needs the target model and tokenizer")
    return HFGenerateBackend(model, tokenizer, cfg)
