"""The target's attention in capture and online training: per-sample slices, packed documents, or plain SDPA.

One attention function (and one mask function) is registered with transformers under ``ATTENTION``; what it
does depends on the context the caller sets around a forward:

* ``Samples(lengths)``: a right-padded batch [B, L]. SDPA runs on each sample's unpadded prefix, exactly
  the call transformers makes for a lone sample, so a batched sample equals the sample run alone (batch
  invariance; eagle3.features.hf_backend explains where that holds).
* ``PackedDocs(lengths, block_mask)``: one row [1, T] holding documents back to back, positions restarting at 0 in
  each; a token attends causally within its own document only. With a flex_attention BlockMask (built on CUDA) the
  whole row is one compiled flex_attention call, which skips the masked blocks: attention costs each
  document's own length, and the linear layers run once over the row (its padding included) instead of over
  its documents padded to the longest. Without one (CPU) SDPA runs on each document's slice, the per-sample
  call again, so a packed row equals its documents run alone.
* neither: transformers' own SDPA and mask, unchanged. A cached model switched to this attention behaves
  as an SDPA model wherever no context is set.

Both contexts drop the [B, 1, L, L] mask: the attention slices (or masks by blocks) itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ATTENTION = "eagle3_per_sample_sdpa"
"""Name under which the attention (and its mask function) is registered with transformers."""


@dataclass(frozen=True)
class Samples:
    """A right-padded batch: the unpadded length of each row."""

    lengths: tuple[int, ...]


@dataclass(frozen=True)
class PackedDocs:
    """One packed row: the length of each document in order (they sum to the row), and its flex mask if any."""

    lengths: tuple[int, ...]
    block_mask: Any = None  # torch BlockMask over [T, T] (document-causal), or None: SDPA per document


_CONTEXT: contextvars.ContextVar[Samples | PackedDocs | None] = contextvars.ContextVar("eagle3_attention", default=None)


@contextlib.contextmanager
def attention_context(context: Samples | PackedDocs | None) -> Iterator[None]:
    """Run the forwards inside with ``context`` (None: plain SDPA)."""
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def document_block_mask(document_ids: torch.Tensor, num_real: int | None = None, compile: bool | None = None) -> Any:
    """A flex BlockMask for one row: token q sees token k when k <= q and both are in one document.

    document_ids: [T] int64, non-decreasing (documents are contiguous). Tokens from ``num_real`` on (the row's
    padding, whose states are dropped) see only themselves, so their blocks off the diagonal are skipped.
    ``compile``: build it with torch.compile (None: on CUDA, where the eager build of a long row is slow).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids
    real = docs.shape[0] if num_real is None else num_real
    # a tensor, not an int: create_block_mask compiles mask_mod, and an int in its closure would be baked into the
    # graph, one recompile per row length
    real_key = torch.arange(docs.shape[0], device=docs.device) < real  # [T] bool

    def mask_mod(batch: Any, head: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (docs[q] == docs[kv]) & (real_key[kv] | (q == kv))

    seq = docs.shape[0]
    return create_block_mask(
        mask_mod, 1, None, seq, seq, device=docs.device, _compile=docs.is_cuda if compile is None else compile
    )


def _sdpa(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _sliced(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: Sequence[tuple[int, int, int]],
    **kwargs: Any,
) -> torch.Tensor:
    """SDPA per (row, start, end) span of q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, L, Hq, Dv] (rest zero)."""
    batch, heads, seq, _ = query.shape
    out = query.new_zeros(batch, seq, heads, value.shape[-1])  # [B, L, Hq, Dv]
    for b, start, end in spans:
        part, _ = _sdpa(
            module,
            query[b : b + 1, :, start:end],
            key[b : b + 1, :, start:end],
            value[b : b + 1, :, start:end],
            None,
            **kwargs,
        )  # [1, n, Hq, Dv]
        out[b, start:end] = part[0]
    return out


def _flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scaling: float | None
) -> torch.Tensor:
    """flex_attention (compiled on CUDA) over the row's document mask: q [1, Hq, T, D] -> [1, T, Hq, Dv]."""
    from eagle3.drafter.functional import flex_attention_over

    return flex_attention_over(query, key, value, block_mask, scale=scaling).transpose(1, 2).contiguous()


def attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention (module docstring); q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, L, Hq, Dv]."""
    context = _CONTEXT.get()
    same_length = query.shape[2] == key.shape[2]  # no cache: the contexts describe whole rows
    if isinstance(context, Samples) and len(context.lengths) == query.shape[0] and same_length:
        return _sliced(module, query, key, value, [(b, 0, n) for b, n in enumerate(context.lengths)], **kwargs), None
    if isinstance(context, PackedDocs):
        if query.shape[0] != 1 or not same_length or sum(context.lengths) != query.shape[2]:
            # plain SDPA here would attend across documents: never silently
            raise ValueError(
                f"a packed row is one row of {sum(context.lengths)} tokens without a cache; the "
                f"attention got q {tuple(query.shape)}, k {tuple(key.shape)}"
            )
        if context.block_mask is not None:
            return _flex(query, key, value, context.block_mask, kwargs.get("scaling")), None
        ends = itertools.accumulate(context.lengths)
        spans = [(0, end - n, end) for n, end in zip(context.lengths, ends)]
        return _sliced(module, query, key, value, spans, **kwargs), None
    return _sdpa(module, query, key, value, attention_mask, **kwargs)


def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No [B, 1, L, L] mask under a context (the attention slices or masks by blocks); else the SDPA mask."""
    from transformers.masking_utils import sdpa_mask

    return None if _CONTEXT.get() is not None else sdpa_mask(*args, **kwargs)


def use_attention(model: Any, name: str, function: Any, mask_function: Any = None) -> None:
    """Register ``function`` with transformers under ``name``, with ``mask_function`` (default: transformers'
    sdpa mask), and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, mask_function or ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def supports_sliced_attention(config: Any) -> bool:
    """Causal full attention through SDPA: dropping the mask loses nothing (no sliding windows)."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is None


def enable(model: Any) -> bool:
    """Switch a model to this attention when that is exact for it; returns whether it did."""
    if not supports_sliced_attention(model.config):
        return False
    use_attention(model, ATTENTION, attention, mask)
    return True


def per_sample_for(setting: bool | str | None, device: torch.device) -> bool:
    """capture.per_sample_attention resolved: auto (or None) = per-sample on CPU only.

    On a CPU the per-sample calls cost little and buy bitwise batch invariance; on a GPU one attention launch
    per sample and layer leaves it idle (30 layers x thousands of short samples), so padded batches win.
    """
    if setting in ("auto", None):
        return torch.device(device).type == "cpu"
    return bool(setting)
