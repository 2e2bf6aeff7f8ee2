"""One SGLang capture response, parsed and checked: rows, top-K, and the CapturedSample they become.

``parse_response`` runs off the event loop (JSON of T x width floats is slow to parse); any failed
check raises ``infra.sglang_checks.ResponseCheckError`` naming the check, which the backend turns into a
retry. Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eagle3.features.spec import CapturedSample, SampleTokens
from infra.sglang_checks import ResponseCheckError, check_capture_response

_loads: Callable[[bytes | str], Any]
try:  # orjson parses the huge float arrays several times faster; plain json is the fallback
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - orjson ships with prefect, but is not our dependency
    _loads = json.loads


@dataclass
class ResponsePart:
    """A validated response half: rows and, in the aux pass with top-K supervision, the top-K."""

    rid: str
    prompt_ids: list[int]
    rows: np.ndarray  # [T, width] float32
    topk_ids: np.ndarray | None = None  # [T, K] int32
    topk_logprobs: np.ndarray | None = None  # [T, K] float32


def parse_response(
    content: bytes, sample: SampleTokens, width: int, top_logprobs_num: int | None, vocab_size: int
) -> ResponsePart:
    """Parse and check one /generate response body for ``sample``: rows ``width`` wide, top-K when asked for."""
    try:
        body = _loads(content)
    except ValueError as exc:
        raise ResponseCheckError("json", f"response is not JSON: {exc}") from None
    rows = check_capture_response(body, rid=sample.id, input_ids=sample.input_ids, width=width)
    part = ResponsePart(sample.id, list(body["prompt_token_ids"]), rows)
    if top_logprobs_num:
        part.topk_ids, part.topk_logprobs = check_topk(
            body["meta_info"], num_tokens=len(sample.input_ids), k=top_logprobs_num, vocab_size=vocab_size
        )
    return part


def check_topk(
    meta: dict[str, Any], *, num_tokens: int, k: int, vocab_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-K of the target's next-token distribution at every prompt position: (ids int32, logprobs fp32) [T, K].

    SGLang's input_top_logprobs[i] is the distribution that predicted token i (entry 0 is None), so
    position t's own prediction is input_top_logprobs[t + 1]; the last position's is
    output_top_logprobs[0], the distribution the one generated token was drawn from.
    """
    inputs, outputs = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
    got = len(inputs) if isinstance(inputs, list) else "no"
    _require(
        isinstance(inputs, list) and len(inputs) == num_tokens,
        f"input_top_logprobs has {got} entries for {num_tokens} tokens",
    )
    _require(isinstance(outputs, list) and len(outputs) >= 1, "output_top_logprobs is missing or empty")
    assert isinstance(inputs, list) and isinstance(outputs, list)  # (_require checked both)
    rows = [*inputs[1:], outputs[0]]
    bad = next((t for t, row in enumerate(rows) if not isinstance(row, list) or len(row) != k), None)
    _require(bad is None, f"position {bad} has no list of {k} (logprob, token id) entries")
    try:
        logprobs = np.asarray([[entry[0] for entry in row] for row in rows], dtype=np.float32)
        ids = np.asarray([[entry[1] for entry in row] for row in rows], dtype=np.int64)
    except (TypeError, ValueError, IndexError):
        raise ResponseCheckError("topk", "a top-K entry is not a (logprob, token id, ...) triple") from None
    _require(bool(np.isfinite(logprobs).all() and (logprobs <= 1e-4).all()), "top-K logprobs must be finite and <= 0")
    upper = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    _require(bool(((ids >= 0) & (ids < upper)).all()), f"top-K token ids outside [0, {upper})")
    return ids.astype(np.int32), logprobs


def _require(ok: bool, detail: str) -> None:
    if not ok:
        raise ResponseCheckError("topk", detail)


def to_captured_sample(sample: SampleTokens, parts: tuple[ResponsePart, ResponsePart | None]) -> CapturedSample:
    """numpy float32 -> torch float32; the shard writer casts to the storage dtype."""
    aux, final = parts
    return CapturedSample(
        id=sample.id,
        input_ids=torch.tensor(sample.input_ids, dtype=torch.long),
        loss_mask=torch.tensor(sample.loss_mask, dtype=torch.uint8),
        aux=torch.from_numpy(aux.rows),
        final=torch.from_numpy(final.rows) if final is not None else None,
        topk_ids=torch.from_numpy(aux.topk_ids) if aux.topk_ids is not None else None,
        topk_logprobs=torch.from_numpy(aux.topk_logprobs) if aux.topk_logprobs is not None else None,
    )
