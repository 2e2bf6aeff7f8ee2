"""Batched generation of token rows with transformers, fast on CUDA (used by regeneration).

Three ways, all transformers' own generation code (no hand-written decoder):
  * ``dynamic``: plain ``model.generate`` with its default dynamic cache, one call per batch of
    prompts, left padded to the longest prompt. Works everywhere; slow on a GPU.
  * ``static``: ``generate`` with ``cache_implementation="static"``. On CUDA transformers compiles the
    decode step (``torch.compile``, CUDA graphs under its default ``CompileConfig``); on CPU it runs
    uncompiled. A compiled graph is specific to (batch size, cache length) (``compile_dynamic``: one graph
    with symbolic sizes, each shape still recording its own CUDA graph), so every call gets the same
    batch size (short batches are filled with copies of a real row, whose answers are dropped) and a
    cache length rounded up to a power of two (few shapes; transformers also keeps the cache length at
    the largest seen so far, ``_previous_max_cache_length``). Prompts are sorted by length and cut into
    batches, so one batch holds similar lengths; the prompt width is rounded up to ``prompt_bucket``.
    ``decode_attention`` picks the one-token decode step's attention (``kv_heads``, ``flex`` or transformers'
    ``sdpa``: eagle3.data.decode_attention).
  * ``continuous``: transformers' continuous batching, ``model.generate_batch`` (finished rows leave
    the batch at once; needs a transformers that ships ``ContinuousBatchingConfig``).

Rows that end at an eos id keep running in ``generate`` until the whole batch is done (static and
dynamic): their tokens after the eos are dropped. ``straggler_rows`` bounds that waste: once a batch is down to
that many running rows it stops, and they go on (a prefill of prompt plus tokens so far) in a batch of that size,
one more compiled shape per cache length. Outputs come back in input order, cut after the
first eos id (which is kept), so all three ways can be compared token for token.

Imports torch, transformers, eagle3.compiling and eagle3.data.decode_attention (both torch only), so the
benchmark runs on a host that has nothing else.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from eagle3.compiling import raise_recompile_limit
from eagle3.data.decode_attention import DecodeAttention, use_decode_attention

Backend = Literal["auto", "static", "dynamic", "continuous"]
STATIC_SHAPES_LIMIT = 32
"""Compiled decode graphs generation may keep: cache lengths (powers of two) x two batch sizes (full, stragglers)."""


@dataclass(frozen=True)
class GenerationSettings:
    """What every generate call uses; ``backend`` is resolved (never "auto") by ``resolve_backend``."""

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 0.0
    backend: Backend = "dynamic"
    batch_size: int = 8
    prompt_bucket: int = 64
    decode_attention: DecodeAttention = "kv_heads"
    straggler_rows: int = 0  # static/dynamic: a batch down to this many running rows hands them to a batch this size
    compile_dynamic: bool = False  # static: one decode graph with symbolic batch and cache sizes
    loop_stop_tokens: int = 0  # static/dynamic: a row stops once its last N new tokens repeat with a period <= N


@dataclass
class ShapeStats:
    """The generate calls of one cache shape (a static cache length, or the dynamic / continuous way)."""

    calls: int = 0
    seconds: float = 0.0
    first_call_s: float = 0.0  # the first call of a shape includes its compile (static on CUDA)


@dataclass
class GenerationStats:
    """Where a TokenGenerator's time went: what its generate calls answered, computed and took.

    ``slot_steps`` counts batch rows x decode steps run (filler copies and rows past their eos included), so
    ``new_tokens / slot_steps`` is the share of the decode work that produced kept tokens.
    """

    calls: int = 0
    rows: int = 0  # real prompts answered
    slots: int = 0  # batch rows run, filler copies of a short batch included
    new_tokens: int = 0  # tokens kept: up to and including each row's first eos
    slot_steps: int = 0  # batch rows x decode steps run (static and dynamic; not known for continuous)
    seconds: float = 0.0  # wall time of the generate calls, the device synchronised (results read back)
    shapes: dict[str, ShapeStats] = field(default_factory=dict)

    def add(self, shape: str, rows: int, slots: int, new_tokens: int, slot_steps: int, seconds: float) -> None:
        """Count one generate call."""
        self.calls, self.rows, self.slots = self.calls + 1, self.rows + rows, self.slots + slots
        self.new_tokens, self.slot_steps = self.new_tokens + new_tokens, self.slot_steps + slot_steps
        self.seconds += seconds
        entry = self.shapes.setdefault(shape, ShapeStats(first_call_s=seconds))
        entry.calls, entry.seconds = entry.calls + 1, entry.seconds + seconds

    def to_json(self) -> dict[str, Any]:
        """The counts, tokens/s, the slot use and each shape's calls, seconds and first call (compile included)."""
        return {
            "calls": self.calls,
            "rows": self.rows,
            "slots": self.slots,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
            "new_tokens_per_s": round(self.new_tokens / self.seconds, 1) if self.seconds else None,
            "slot_use": round(self.new_tokens / self.slot_steps, 4) if self.slot_steps else None,
            "shapes": {
                k: {"calls": v.calls, "seconds": round(v.seconds, 3), "first_call_s": round(v.first_call_s, 3)}
                for k, v in sorted(self.shapes.items())
            },
        }


def resolve_backend(backend: Backend, device: torch.device | str) -> Backend:
    """auto -> static (compiled by transformers) on CUDA, dynamic elsewhere (compile on CPU is slow to warm)."""
    if backend != "auto":
        return backend
    return "static" if torch.device(device).type == "cuda" else "dynamic"


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return -(-n // multiple) * multiple


def static_cache_len(width: int, max_new_tokens: int) -> int:
    """Cache slots for a batch of padded width ``width``: the next power of two, so few graphs are compiled."""
    return 1 << math.ceil(math.log2(width + max_new_tokens))


def cut_after_eos(row: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """The row up to and including its first eos id (the whole row when there is none)."""
    stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
    return row if stop is None else row[: stop + 1]


def left_pad(rows: list[list[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask, both [B, width]; left padding puts every prompt's last token in the last column."""
    ids = [[pad_id] * (width - len(r)) + r for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


# --------------------------------------------------------------------------- the generator


class TokenGenerator:
    """Answers lists of prompt token ids with new token ids, in batches of ``settings.batch_size``."""

    def __init__(self, model: Any, settings: GenerationSettings):
        if settings.backend == "auto":
            settings = GenerationSettings(**{**settings.__dict__, "backend": resolve_backend("auto", _device(model))})
        self.model, self.settings = model, settings
        self.stats = GenerationStats()
        if settings.backend == "static":  # transformers compiles one decode graph per (batch, cache length) on CUDA
            raise_recompile_limit(STATIC_SHAPES_LIMIT)
        # Only the static cache's decode runs our attention; continuous batching refuses unknown attention names.
        use_decode_attention(model, settings.decode_attention if settings.backend == "static" else "sdpa")

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """New tokens per prompt (input order), each cut after its first eos id."""
        if any(not p for p in prompts):
            raise ValueError("an empty prompt cannot be answered (no token to start from)")
        if self.settings.backend == "continuous":
            start = time.perf_counter()
            answers = self._continuous(prompts)
            self.stats.add(
                "continuous", len(prompts), len(prompts), sum(map(len, answers)), 0, time.perf_counter() - start
            )
            return answers
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
        out: list[list[int]] = [[] for _ in prompts]
        size = self.settings.batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, row in zip(chunk, self._answer_batch([prompts[i] for i in chunk]), strict=True):
                out[i] = row
        return out

    def _answer_batch(self, rows: list[list[int]]) -> list[list[int]]:
        """At most batch_size rows -> their new tokens, each cut after its first eos id.

        With ``straggler_rows``, a batch whose running rows drop to that many stops, and those rows go on from
        their prompt plus the tokens so far (a new prefill) in a batch of ``straggler_rows``: the rows that ended
        free their slots instead of riding along to the longest row's end. Greedy tokens are those of one call
        (tested); sampled rows draw their later tokens in the second call, deterministically."""
        s = self.settings
        shrink = s.straggler_rows if 0 < s.straggler_rows < len(rows) else 0
        new, width, looped = self._generate_batch(rows, s.max_new_tokens, s.batch_size, shrink)
        going = [
            i
            for i, r in enumerate(new)
            if len(r) < s.max_new_tokens and not (r and r[-1] in s.eos_ids) and not looped[i]
        ]
        if going:
            done = len(new[going[0]])  # every running row has made the same number of steps
            # The first call's width plus those steps, unrounded: the same cache length as the first call, which
            # transformers keeps as the floor of every later static cache (a longer one would stay for the run).
            rest, _, _ = self._generate_batch(
                [rows[i] + new[i] for i in going],
                s.max_new_tokens - done,
                s.straggler_rows,
                0,
                continued=True,
                at_width=width + done,
            )
            for i, more in zip(going, rest, strict=True):
                new[i] = new[i] + more
        return new

    def _generate_batch(
        self,
        rows: list[list[int]],
        max_new: int,
        batch_size: int,
        stop_at: int,
        continued: bool = False,
        at_width: int | None = None,
    ) -> tuple[list[list[int]], int, list[bool]]:
        """One generate call on at most ``batch_size`` rows (static: filled up to it) -> their new tokens, each cut
        after its first eos id (or where it was found looping), the padded width, and which rows were stopped as
        loops; with ``stop_at`` > 0 the call ends once at most that many real rows are running. ``continued``: the
        rows go on from an earlier call (the stats count them as answered once) at ``at_width`` (static; otherwise
        the width is the longest row rounded up to ``prompt_bucket``)."""
        from transformers import StoppingCriteriaList

        s = self.settings
        start = time.perf_counter()
        longest = max(len(r) for r in rows)
        kwargs = self._sampling_kwargs(max_new)
        real, shape = len(rows), "dynamic"
        width = longest
        if s.backend == "static":
            width = at_width if at_width is not None and at_width >= longest else round_up(longest, s.prompt_bucket)
            rows = rows + [rows[0]] * (batch_size - real)  # a fixed batch size reuses the compiled graph
            kwargs["cache_implementation"] = "static"
            cache_len = static_cache_len(width, max_new)
            _size_static_cache(self.model, cache_len, kwargs)
            if s.compile_dynamic and (config := dynamic_compile_config(self.model)) is not None:
                kwargs["compile_config"] = config
        ids, mask = left_pad(rows, width, s.pad_id)
        device = _device(self.model)
        stops = None
        if stop_at or s.loop_stop_tokens:
            stops = StopWhenFewRun(s.eos_ids, real, stop_at, device, s.loop_stop_tokens, width)
            kwargs["stopping_criteria"] = StoppingCriteriaList([stops])
        with torch.no_grad():  # the mode generate itself runs in, not inference_mode
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        # .tolist() reads the device back: the time below is synchronised
        rows_new = out[:real, width:].tolist()
        looped = stops.loop_lengths(real) if stops is not None else [None] * real
        new = [cut_after_eos(r if n is None else r[:n], s.eos_ids) for r, n in zip(rows_new, looped, strict=True)]
        steps = out.shape[1] - width
        if s.backend == "static":  # the length transformers used: never below the longest of earlier calls
            shape = f"static {len(rows)} x {max(cache_len, getattr(self.model, '_previous_max_cache_length', -1))}"
        self.stats.add(
            shape,
            0 if continued else real,
            len(rows),
            sum(map(len, new)),
            len(rows) * steps,
            time.perf_counter() - start,
        )
        return new, width, [n is not None for n in looped]

    def _sampling_kwargs(self, max_new: int) -> dict[str, Any]:
        s = self.settings
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "eos_token_id": list(s.eos_ids), "pad_token_id": s.pad_id}
        if s.temperature == 0:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=s.temperature)
        return kwargs

    def _continuous(self, prompts: list[list[int]]) -> list[list[int]]:
        """transformers' continuous batching; its KV pages are sized from this call, not from host RAM."""
        from transformers import GenerationConfig

        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError as exc:
            raise RuntimeError(
                "regenerate.generation_backend='continuous' needs a transformers that ships "
                "ContinuousBatchingConfig (generation/configuration_utils.py)"
            ) from exc
        s = self.settings
        page = 64
        longest = max(len(p) for p in prompts) + s.max_new_tokens
        in_flight = min(s.batch_size, len(prompts))
        cbc = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=in_flight * (longest // page + 2),
            max_batch_tokens=max(in_flight, 256),
            max_requests_per_batch=in_flight,
        )
        gc = GenerationConfig(**self._sampling_kwargs(s.max_new_tokens))
        with torch.no_grad():  # the mode generate itself runs in, not inference_mode
            res = self.model.generate_batch(
                inputs=prompts, generation_config=gc, continuous_batching_config=cbc, progress_bar=False
            )
        # Results are keyed "req_<input index>"; generated_tokens ends at the eos (kept) or at max_new_tokens.
        return [cut_after_eos(list(res[f"req_{i}"].generated_tokens), s.eos_ids) for i in range(len(prompts))]


class StopWhenFewRun:
    """A transformers stopping criterion that ends the whole call once at most ``rows`` of its first ``real`` rows
    are running (filler rows after them are not counted); until then it marks only ended rows. A row ends at an
    eos id or, with ``loop_tokens`` N > 0, once it loops: its last N new tokens equal the N before them shifted by
    some period p <= N (``looping``). A looping row's length when it stopped is kept (``loop_lengths``): past it,
    transformers feeds pad ids, which can equal an eos id.

    Tensor ops only: transformers already reads the finished flags back once per step, so this adds no sync."""

    def __init__(
        self, eos_ids: tuple[int, ...], real: int, rows: int, device: torch.device, loop_tokens: int = 0, width: int = 0
    ):
        self.eos = torch.tensor(eos_ids, device=device)
        self.real, self.rows, self.loop_tokens, self.width = real, rows, loop_tokens, width
        self.ended: torch.Tensor | None = None  # [B] bool, sticky: finished rows are fed pad ids afterwards
        self.loop_len: torch.Tensor | None = None  # [B] int64: new tokens when found looping, 0 = not looping

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        ended = torch.isin(input_ids[:, -1], self.eos)  # [B]
        if self.ended is not None:
            ended = ended | self.ended
        if self.loop_tokens and input_ids.shape[1] - self.width >= 2 * self.loop_tokens:
            loops = looping(input_ids, self.loop_tokens) & ~ended  # [B]
            if self.loop_len is None:
                self.loop_len = torch.zeros_like(loops, dtype=torch.long)
            self.loop_len = torch.where(loops, input_ids.shape[1] - self.width, self.loop_len)
            ended = ended | loops
        self.ended = ended
        running = (~ended[: self.real]).sum()
        return ended | (running <= self.rows)  # [B]: all True ends the call

    def loop_lengths(self, real: int) -> list[int | None]:
        """Per real row: its new tokens when it was stopped as a loop, or None (reads the device)."""
        if self.loop_len is None:
            return [None] * real
        return [n or None for n in self.loop_len[:real].tolist()]


def looping(input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B] bool: the last n tokens of each row equal the n before them shifted by some period p in 1..n."""
    tail = input_ids[:, -2 * n :]  # [B, 2n]
    windows = tail.unfold(1, n, 1)  # [B, n + 1, n]: window j starts at j; the last one (j = n) is the tail's end
    return (windows[:, :-1] == windows[:, -1:]).all(-1).any(-1)  # window n - p against the last: period p


def _size_static_cache(model: Any, cache_len: int, kwargs: dict[str, Any]) -> None:
    """Ask generate for a static cache of at least ``cache_len`` slots.

    Newer transformers take ``max_cache_len`` as a generation setting; older ones (no such field,
    where an unknown generate kwarg is an error) size the cache from the longest cache used so far,
    ``model._previous_max_cache_length``, which both read.
    """
    from transformers import GenerationConfig

    if hasattr(GenerationConfig(), "max_cache_len"):
        kwargs["max_cache_len"] = cache_len
    else:
        model._previous_max_cache_length = max(getattr(model, "_previous_max_cache_length", -1), cache_len)


def dynamic_compile_config(model: Any) -> Any:
    """The model's generation compile config (transformers' default if unset) with ``dynamic=True``, or None where
    transformers would not compile (a CPU without its compile forced on): Dynamo then traces the decode step once
    with symbolic batch and cache sizes, where transformers' default (static, then automatic dynamic shapes after a
    change) traces it twice or more, each trace a compile of tens of seconds on a fresh GPU host. CUDA graphs
    still record per shape."""
    import copy

    from transformers import CompileConfig

    base = getattr(model.generation_config, "compile_config", None) or CompileConfig()
    if _device(model).type != "cuda" and not getattr(base, "_compile_all_devices", None):
        return None
    config = copy.copy(base)  # keeps private flags such as _compile_all_devices
    config.dynamic = True
    return config


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device
