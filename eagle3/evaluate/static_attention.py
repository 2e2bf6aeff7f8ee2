"""The static decode's attention, chosen per forward: one function registered with transformers for every static
target runner of a model, each runner passing its own choice with each forward.

The evaluation runs two static runners over one model (the reference, gathered keys at 16 rows, and the one-row
speed baseline, masked keys): a model has one attention implementation, so one runner switching it would switch
the other's too. Here the model is switched once, to ``static_attention``, which reads the forward's keyword
arguments (transformers passes a forward's extra keyword arguments down to the attention function):

  * ``key_order`` long [w, L]: the row's keys gathered in sequence order (eagle3/evaluate/gathered.py);
  * else ``masked_attention``: ``sdpa`` (transformers' own, the default and what a forward without it runs),
    ``packed`` or ``matmul`` (eagle3/evaluate/packed_attention.py) or ``flex``
    (eagle3.data.decode_attention.flex_decode: one-row forwards with a bool mask over the key blocks in use; other
    shapes fall back to sdpa).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

MaskedAttention = Literal["sdpa", "packed", "matmul", "flex"]
"""The masked (not gathered) decode's attention: transformers' sdpa (the cache repeated per query head under
torch.compile), the packed grouped-query one through sdpa or written out as matrix products (matmul), or flex over
the key blocks in use at one row."""

STATIC_ATTENTION = "eagle3_static_decode"
"""Name under which ``static_attention`` is registered with transformers."""


def static_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """query [1, H, w, D]; key/value [1, Hkv, L, D]; attention_mask [1, 1, w, L] -> [1, w, H, Dv], by the forward's
    ``key_order`` (gathered keys) or ``masked_attention`` (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eagle3.data.decode_attention import flex_decode
    from eagle3.evaluate.gathered import gathered_attention
    from eagle3.evaluate.packed_attention import matmul_attention, packed_attention

    order = kwargs.pop("key_order", None)
    kind = kwargs.pop("masked_attention", "sdpa")
    if order is not None:
        return gathered_attention(query, key, value, attention_mask, order, dropout, scaling)
    fn = {"sdpa": sdpa_attention_forward, "packed": packed_attention, "matmul": matmul_attention, "flex": flex_decode}[
        kind
    ]
    return fn(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def use_static_attention(model: Any) -> None:
    """Register ``static_attention`` (with the sdpa mask) and switch the model to it; ValueError for a model on
    another attention than sdpa (its layers would not run these kernels' inputs)."""
    from eagle3.features.attention import use_attention

    if model.config._attn_implementation not in ("sdpa", STATIC_ATTENTION):
        raise ValueError(
            f"gathered keys, packed and flex decode attention need a target on sdpa attention, not "
            f"{model.config._attn_implementation!r}"
        )
    use_attention(model, STATIC_ATTENTION, static_attention)
