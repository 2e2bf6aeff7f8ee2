"""What a benchmark of one SGLang server records: its fixed prompts, its settings, one checked request, one
concurrency level and one whole run, and the per-level arithmetic. infra/sglang_bench.py runs the benchmark and
fills these records; infra/sglang_compare.py compares two runs of them.

Metrics per level:

* output tok/s = sum completion_tokens / wall time of the level (first request sent to last answer);
* latency median and p90 (nearest rank), TTFT median, TPOT median with
  TPOT = (latency - TTFT) / (completion_tokens - 1);
* speculative server: acceptance length = sum completion_tokens / sum spec_verify_ct (the bonus
  token included, as SGLang reports it), plus SGLang's own ``avg_spec_accept_length`` from
  ``/server_info`` since the flush, as a cross-check.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from infra.sglang_spec import SERVING_FIELDS

Prompt = str | list[int]
# Settings a baseline and its speculative twin must share (names of SGLang's ServerArgs fields).
SHARED_SETTINGS = (
    "model_path",
    "tp_size",
    "dp_size",
    "dtype",
    "mem_fraction_static",
    *SERVING_FIELDS,
    "kv_cache_dtype",
    "chunked_prefill_size",
    "context_length",
    "disable_radix_cache",
)
SPEC_SETTINGS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth",
    "speculative_ngram_max_trie_depth",
    "speculative_ngram_match_type",
    "speculative_use_rejection_sampling",
)
_TASKS = (
    "Explain {t} to a new colleague in five short paragraphs.",
    "Write a step-by-step checklist for {t}.",
    "List the ten most common mistakes in {t} and how to avoid each.",
    "Compare two approaches to {t} in a table, then recommend one.",
    "Write a short story in which {t} saves the day.",
    "Draft an email that asks a manager for a budget for {t}.",
    "Summarize the history of {t} as a numbered timeline.",
    "Answer as a tutor: what should a student learn first about {t}, and why?",
)
_TOPICS = (
    "sourdough baking",
    "database indexing",
    "bicycle maintenance",
    "tax filing",
    "garden irrigation",
    "unit testing",
    "marathon training",
    "home networking",
)


def fixed_prompts(num: int) -> list[str]:
    """``num`` distinct, deterministic English prompts (task x topic, then numbered variants)."""
    grid = [task.format(t=topic) for topic in _TOPICS for task in _TASKS]
    return [grid[i % len(grid)] + (f" (variant {i // len(grid)})" if i >= len(grid) else "") for i in range(num)]


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """sha256 of the prompt set: two runs are comparable only with the same digest."""
    return hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()[:16]


def output_digest(output_ids: Sequence[int]) -> str:
    """What identifies a greedy output across runs and engines: sha256 of its token ids as JSON, 16 hex digits."""
    return hashlib.sha256(json.dumps([int(i) for i in output_ids]).encode()).hexdigest()[:16]


class MeasurementError(RuntimeError):
    """Figures that cannot all be right (speedup above the acceptance length, runs that differ)."""


@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark run does; a baseline and a speculative run must use equal settings."""

    concurrency_levels: tuple[int, ...] = (1, 4, 16)
    num_prompts: int = 32
    max_new_tokens: int = 256
    num_warmup: int = 4
    request_timeout_s: float = 600.0
    ignore_eos: bool = True  # False: a request may stop at end of turn (1..max_new_tokens tokens)
    temperature: float = 0.0  # 0: greedy; > 0: every request samples (then top_p, top_k: 0 = all)
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "concurrency_levels", tuple(self.concurrency_levels))
        if not self.concurrency_levels or min(self.concurrency_levels) < 1:
            raise ValueError(f"concurrency_levels {list(self.concurrency_levels)} must be non-empty and >= 1")
        if self.num_prompts < 1 or self.num_warmup < 0 or self.max_new_tokens < 2:
            raise ValueError("num_prompts >= 1, num_warmup >= 0 and max_new_tokens >= 2 (TPOT needs two tokens)")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"temperature >= 0, 0 < top_p <= 1 and top_k >= 0; got {self}")

    @property
    def sampled(self) -> bool:
        """Whether requests sample (outputs then differ between servers by chance, not by numerics)."""
        return self.temperature > 0

    def sampling_params(self) -> dict[str, float | int]:
        """The sampling part of a request's sampling_params: temperature 0, or temperature with top_p and top_k where
        set (SGLang's top_k -1 = all is its default, so 0 is left out)."""
        if not self.sampled:
            return {"temperature": 0}
        return {"temperature": self.temperature, "top_p": self.top_p} | ({"top_k": self.top_k} if self.top_k else {})

    def sampling_words(self) -> str:
        """'temperature 0', or the sampling settings as the reports name them."""
        if not self.sampled:
            return "temperature 0"
        return f"temperature {self.temperature:g} (top-p {self.top_p:g}, top-k {self.top_k or 'all'})"


@dataclass(frozen=True)
class RequestSample:
    """One checked, measured request."""

    prompt_index: int
    latency_s: float
    ttft_s: float
    completion_tokens: int
    cached_tokens: int
    spec_verify_ct: int | None
    output_digest: str
    output_ids: tuple[int, ...] = ()  # the greedy output itself (where two servers diverge, and on what margin)

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        return (self.latency_s - self.ttft_s) / max(self.completion_tokens - 1, 1)


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level of one server."""

    concurrency: int
    num_requests: int
    duration_s: float
    completion_tokens: int
    output_tok_per_s: float
    median_latency_s: float
    p90_latency_s: float
    median_ttft_s: float
    median_tpot_ms: float
    cached_tokens: int
    spec_verify_ct: int | None = None
    accept_length: float | None = None
    server_accept_length: float | None = None
    output_digests: tuple[str, ...] = field(default=(), repr=False)
    # Per prompt, in prompt order: tokens, verify steps (0 on a baseline) and latency; datasets are summed from these.
    completion_by_prompt: tuple[int, ...] = field(default=(), repr=False)
    verify_by_prompt: tuple[int, ...] = field(default=(), repr=False)
    latency_by_prompt: tuple[float, ...] = field(default=(), repr=False)
    output_ids_by_prompt: tuple[tuple[int, ...], ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class BenchResult:
    """A whole run against one server: settings, its /server_info settings and one result per level."""

    base_url: str
    speculative: bool
    settings: BenchSettings
    prompts_digest: str
    server_settings: dict[str, Any]
    levels: tuple[LevelResult, ...]

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (round-trips through ``from_json``)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> BenchResult:
        per_prompt = ("output_digests", "completion_by_prompt", "verify_by_prompt", "latency_by_prompt")
        levels = tuple(
            LevelResult(
                **(
                    lvl
                    | {k: tuple(lvl.get(k, ())) for k in per_prompt}
                    | {"output_ids_by_prompt": tuple(tuple(ids) for ids in lvl.get("output_ids_by_prompt", ()))}
                )
            )
            for lvl in doc["levels"]
        )
        return cls(
            doc["base_url"],
            doc["speculative"],
            BenchSettings(**doc["settings"]),
            doc["prompts_digest"],
            dict(doc["server_settings"]),
            levels,
        )


# ---------------------------------------------------------------- arithmetic (pure, golden-tested)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (q=0.5 median of an odd count is the middle value)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def summarize_level(
    concurrency: int,
    samples: Sequence[RequestSample],
    duration_s: float,
    speculative: bool,
    server_accept_length: float | None = None,
) -> LevelResult:
    """Per-level metrics from checked samples; acceptance length = sum completion / sum verify steps."""
    completion = sum(s.completion_tokens for s in samples)
    verify_ct = sum(s.spec_verify_ct or 0 for s in samples) if speculative else None
    ordered = sorted(samples, key=lambda s: s.prompt_index)
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(samples),
        duration_s=duration_s,
        completion_tokens=completion,
        output_tok_per_s=completion / duration_s,
        median_latency_s=nearest_rank([s.latency_s for s in samples], 0.5),
        p90_latency_s=nearest_rank([s.latency_s for s in samples], 0.9),
        median_ttft_s=nearest_rank([s.ttft_s for s in samples], 0.5),
        median_tpot_ms=1000 * nearest_rank([s.tpot_s for s in samples], 0.5),
        cached_tokens=sum(s.cached_tokens for s in samples),
        spec_verify_ct=verify_ct,
        accept_length=completion / verify_ct if verify_ct else None,
        server_accept_length=server_accept_length,
        output_digests=tuple(s.output_digest for s in ordered),
        completion_by_prompt=tuple(s.completion_tokens for s in ordered),
        verify_by_prompt=tuple(s.spec_verify_ct or 0 for s in ordered),
        latency_by_prompt=tuple(s.latency_s for s in ordered),
        output_ids_by_prompt=tuple(s.output_ids for s in ordered),
    )
