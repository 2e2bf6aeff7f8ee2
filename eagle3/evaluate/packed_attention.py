"""Masked decode attention without copying the cache per query head, for the static decode's forwards of any width.

Through transformers' SDPA path a masked forward on CUDA repeats every layer's keys and values to the query heads
(``repeat_kv``: SmolLM2-135M's 3 key/value heads become 9, a copy of the whole static cache layer in every decode
forward); its own way around that (``pack_gqa``) serves one query row outside torch.compile only. Here the G query
heads of a key/value head become G * w query rows of it, each with its row's mask (the arithmetic is
eagle3.data.decode_attention.kv_head_rows, which generation's one-token step uses too). Greedy and every verify run
it at one width, so their outputs stay bit-identical to each other; against the repeated cache they differ by
rounding only (tests/unit/test_decode_kernels.py: equal to 1e-12 in float64).

Not the default (StaticTargetRunner's ``attention="packed"``, through eagle3.evaluate.static_attention;
``lab/eval_speed.py --attention packed``): on an H100
(bf16, Inductor kernels in CUDA graphs, 1,408 cache entries) the forward with it and fused gate/up products took
2.04 ms at 16 rows against 2.22 without either, but 1.93 ms at one row against 1.58: its one-row attention ran
through cuDNN's flash kernel at 24 us a layer. Which of the two changes moved which width is not separated yet.

``matmul_attention`` (``attention="matmul"``) packs the rows the same way and writes the attention out as two
matrix products and a float32 softmax, so no fused attention kernel is chosen at all: a one-row forward's attention
is a handful of small kernels that Inductor fuses, instead of one flash kernel walking the whole cache serially.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def packed_attention(
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
    """query [1, H, w, D]; key/value [1, Hkv, L, D]; attention_mask [1, 1, w, L] additive (0 = attend), or None
    -> [1, w, H, Dv] (eagle3.data.decode_attention.kv_head_rows). Without a mask or key/value groups: transformers'
    sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eagle3.data.decode_attention import kv_head_rows

    batch, heads = query.shape[:2]
    if attention_mask is None or heads == key.shape[1] or batch != 1 or attention_mask.shape[:2] != (1, 1):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    return kv_head_rows(query, key, value, attention_mask, dropout, scaling), None


def matmul_attention(
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
    """packed_attention's rows and contract, the attention written out: scores = rows @ keys^T [1, Hkv, G*w, L] in at
    least float32, the mask added, softmax, @ values. attention_mask additive or bool (True = attend). Without a mask,
    with dropout or a batch: transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if attention_mask is None or batch != 1 or attention_mask.shape[:2] != (1, 1) or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = heads // kv_heads
    wide = torch.promote_types(query.dtype, torch.float32)  # float32 scores in bf16/fp16, float64 stays float64
    rows = query.reshape(1, kv_heads, groups * q_len, dim)  # [1, Hkv, G*w, D]: group g's row r at g*w + r
    scores = torch.matmul(rows, key.transpose(-1, -2)).to(wide)  # [1, Hkv, G*w, L]
    scores = scores * (dim**-0.5 if scaling is None else scaling)
    mask = attention_mask.expand(1, groups, q_len, length).reshape(1, 1, groups * q_len, length)  # [1, 1, G*w, L]
    bool_mask = mask.dtype == torch.bool  # True = attend; else additive (0 = attend)
    scores = scores.masked_fill(~mask, torch.finfo(wide).min) if bool_mask else scores + mask.to(wide)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [1, Hkv, G*w, L]
    out = torch.matmul(probs, value)  # [1, Hkv, G*w, Dv]
    return out.reshape(1, heads, q_len, out.shape[-1]).transpose(1, 2).contiguous(), None  # [1, w, H, Dv]
