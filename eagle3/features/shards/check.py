"""Validation of captured samples before their rows are written: request echo, shapes, id ranges, finiteness.

Every failure is a ``ShardValidationError`` naming the sample and the problem; nothing of a sample
that fails is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle3.features.fp8 import FP8_DTYPE
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens


class ShardValidationError(ValueError):
    """A captured sample does not match its request or the spec; nothing was written."""

    def __init__(self, sample_id: str | None, problem: str):
        where = f"sample {sample_id!r}: " if sample_id is not None else ""
        super().__init__(where + problem)
        self.sample_id, self.problem = sample_id, problem


def _check_shape(sample_id: str, name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor``, checked to be there and of ``shape``."""
    if tensor is None:
        raise ShardValidationError(sample_id, f"{name} is missing")
    if tuple(tensor.shape) != shape:
        raise ShardValidationError(sample_id, f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
    return tensor


def check_finite(sample_id: str, name: str, tensor: torch.Tensor) -> None:
    """No NaN or inf in ``tensor`` (ShardValidationError naming the first bad token)."""
    values = tensor.float() if tensor.dtype == FP8_DTYPE else tensor
    # A sum is NaN/inf whenever any element is, and is ~300x faster than isfinite on CPUs without AVX2;
    # only a non-finite sum (which may also be an overflow of finite values) pays for the exact check.
    if bool(torch.isfinite(values.sum())):
        return
    bad = ~torch.isfinite(values)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ShardValidationError(sample_id, f"{name} has {int(bad.sum())} non-finite values (first at token {row})")


def _check_ids(sample_id: str, name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ShardValidationError(sample_id, f"{name} outside [0, {vocab_size})")


def check_sample(spec: FeatureSpec, sample: CapturedSample) -> None:
    """Shapes, id ranges and finiteness of one sample against the spec (ShardValidationError naming it)."""
    sid, ids = sample.id, sample.input_ids
    if ids.dim() != 1 or ids.shape[0] == 0:
        raise ShardValidationError(sid, f"input_ids must be a non-empty 1-D tensor, got shape {list(ids.shape)}")
    t = ids.shape[0]
    if t > spec.max_len:
        raise ShardValidationError(sid, f"{t} tokens exceed spec.max_len {spec.max_len}")
    _check_ids(sid, "input_ids", ids, spec.vocab_size)
    _check_shape(sid, "loss_mask", sample.loss_mask, (t,))
    _check_shape(sid, "aux", sample.aux, (t, spec.num_aux * spec.hidden_size))
    check_finite(sid, "aux", sample.aux)
    if spec.supervision == "final_hidden":
        final = _check_shape(sid, "final", sample.final, (t, spec.hidden_size))
        check_finite(sid, "final", final)
    else:
        topk_ids = _check_shape(sid, "topk_ids", sample.topk_ids, (t, spec.topk or 0))
        topk_logprobs = _check_shape(sid, "topk_logprobs", sample.topk_logprobs, (t, spec.topk or 0))
        _check_ids(sid, "topk_ids", topk_ids, spec.vocab_size)
        check_finite(sid, "topk_logprobs", topk_logprobs)


def _check_tokens(sample: CapturedSample, req: SampleTokens) -> None:
    if sample.input_ids.tolist() != list(req.input_ids):
        raise ShardValidationError(sample.id, "input_ids differ from the requested tokens")
    if sample.loss_mask.tolist() != list(req.loss_mask):
        raise ShardValidationError(sample.id, "loss_mask differs from the requested mask")


def check_echo(sample: CapturedSample, req: SampleTokens, position: int) -> None:
    """One streamed sample is the request at its position, with the requested tokens and mask."""
    if sample.id != req.id:
        raise ShardValidationError(
            sample.id,
            f"backend returned ids out of order or wrong ({sample.id!r} at "
            f"position {position}, where {req.id!r} was requested)",
        )
    _check_tokens(sample, req)


def check_against_request(samples: Sequence[CapturedSample], requested: Sequence[SampleTokens]) -> None:
    """The backend echoed exactly the requested ids, in order, with the requested tokens."""
    got, want = [s.id for s in samples], [r.id for r in requested]
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        first = next((g for g, w in zip(got, want) if g != w), None)
        raise ShardValidationError(
            first,
            f"backend returned ids out of order or wrong (missing {missing[:5]}, "
            f"unexpected {extra[:5]}, {len(got)} returned for {len(want)} requested)",
        )
    for sample, req in zip(samples, requested):
        _check_tokens(sample, req)


def check_request_ids(items: Sequence[CapturedSample] | Sequence[SampleTokens]) -> None:
    """At least one sample, and no id twice."""
    if not items:
        raise ShardValidationError(None, "a shard needs at least one sample")
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise ShardValidationError(item.id, "duplicate sample id in one shard")
        seen.add(item.id)


def validate_samples(
    spec: FeatureSpec, samples: Sequence[CapturedSample], requested: Sequence[SampleTokens] | None = None
) -> None:
    """Everything write_shard checks before writing a byte (ids unique, request echoed, each sample sound)."""
    check_request_ids(samples)
    if requested is not None:
        check_against_request(samples, requested)
    for sample in samples:
        check_sample(spec, sample)
