"""SGLang 0.5.23's /generate as this code speaks it: the request bodies (capture, smoke generation, auth header)
and the checks every response passes before it is used (``ResponseCheckError`` names the failed check).

Facts used here (field names, flags, JSON shapes) come from reading SGLang 0.5.23's
python/sglang/srt/entrypoints/http_server.py and python/sglang/srt/managers/tokenizer_manager.py. The
``/generate`` bodies built here are checked in tests against SGLang's own request schema; responses are
only checked against a fake server.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

# Fixed smoke prompt: small ids exist in every vocabulary, including the tiny test targets.
SMOKE_INPUT_IDS = (1, 17, 42, 99, 7, 3, 200, 11)
SMOKE_NEW_TOKENS = 16


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Bearer header SGLang's --api-key middleware expects (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def capture_request_body(input_ids: Sequence[int], rid: str, *, top_logprobs_num: int | None = None) -> dict[str, Any]:
    """A /generate body that returns the prefill hidden-state block for one sample.

    max_new_tokens 1 (0 would switch SGLang to prefill-only mode); a fresh extra_key so even a
    server with the radix cache on recomputes every token; prompt ids echoed for the join check.
    """
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "rid": rid,
        "extra_key": uuid.uuid4().hex,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_hidden_states": True,
        "return_prompt_token_ids": True,
    }
    if top_logprobs_num:
        body |= {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top_logprobs_num}
    return body


def generation_smoke_body(rid: str) -> dict[str, Any]:
    """A greedy /generate body for a serving server's smoke test."""
    return {
        "input_ids": list(SMOKE_INPUT_IDS),
        "rid": rid,
        "sampling_params": {"max_new_tokens": SMOKE_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }


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
    _expect(
        isinstance(body, dict) and isinstance(body.get("meta_info"), dict),
        "shape",
        f"expected an object with meta_info, got {type(body).__name__}",
    )
    meta = body["meta_info"]
    _expect(meta.get("id") == rid, "id", f"meta_info.id is {meta.get('id')!r}, the request's rid was {rid!r}")
    return meta


def check_capture_response(body: Any, *, rid: str, input_ids: Sequence[int], width: int) -> np.ndarray:
    """Validate a capture response and return its prefill block as float32 [T, width]; raise on any doubt."""
    meta = response_meta(body, rid)
    num_tokens = len(input_ids)
    _expect(
        meta.get("prompt_tokens") == num_tokens,
        "prompt_tokens",
        f"server counted {meta.get('prompt_tokens')} prompt tokens, we sent {num_tokens}",
    )
    _expect(
        meta.get("cached_tokens") == 0,
        "cached_tokens",
        f"{meta.get('cached_tokens')} tokens came from the prefix cache, so their rows were not computed",
    )
    echoed = body.get("prompt_token_ids")
    _expect(
        echoed == list(input_ids),
        "prompt_token_ids",
        "the server's echo of the prompt differs from the ids we sent"
        if echoed is not None
        else "no prompt_token_ids in the response (return_prompt_token_ids ignored?)",
    )
    return _prefill_block(meta, num_tokens, width)


def _prefill_block(meta: dict[str, Any], num_tokens: int, width: int) -> np.ndarray:
    hidden = meta.get("hidden_states")
    if not (isinstance(hidden, list) and len(hidden) == 1):
        raise ResponseCheckError(
            "hidden_states",
            "expected exactly [prefill block] for max_new_tokens 1, got "
            + (f"{len(hidden)} chunks" if isinstance(hidden, list) else repr(type(hidden).__name__)),
        )
    block = hidden[0]
    _expect(
        isinstance(block, list) and len(block) == num_tokens,
        "rows",
        f"prefill block has {len(block) if isinstance(block, list) else 'no'} rows for {num_tokens} tokens",
    )
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


def check_generation_response(body: Any, rid: str, *, speculative: bool, vocab_size: int | None = None) -> str:
    """Validate the smoke generation of a serving server (greedy, SMOKE_NEW_TOKENS with ignore_eos; a speculative
    server must show its draft ran); returns what was seen."""
    meta = response_meta(body, rid)
    ids = body.get("output_ids")
    _expect(
        meta.get("completion_tokens") == SMOKE_NEW_TOKENS and isinstance(ids, list) and len(ids) == SMOKE_NEW_TOKENS,
        "completion_tokens",
        f"asked for {SMOKE_NEW_TOKENS} tokens with ignore_eos, got {meta.get('completion_tokens')}",
    )
    upper = vocab_size or 2**31
    _expect(all(isinstance(i, int) and 0 <= i < upper for i in ids), "output_ids", f"ids outside [0, {upper})")
    # One token repeated 16 times from a greedy real model means broken weights or a broken kernel.
    _expect(len(set(ids)) > 1, "output_ids", f"all {len(ids)} generated ids are {ids[0]}")
    if speculative:
        _expect(
            (meta.get("spec_verify_ct") or 0) > 0 and (meta.get("spec_accept_length") or 0) >= 1,
            "speculative",
            f"spec_verify_ct {meta.get('spec_verify_ct')}, "
            f"spec_accept_length {meta.get('spec_accept_length')}: the draft did not run",
        )
    return f"greedy generation of {len(ids)} tokens"
