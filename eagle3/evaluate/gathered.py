"""Decode attention over each row's keys in sequence order, so a tree verify equals greedy bit for bit.

A tree verify writes its nodes at consecutive cache indices, so a node's ancestors sit at indices that are not
its sequence positions (its siblings' entries lie between them). Attending through a mask over the physical
cache then reduces the same keys in other tiles than greedy's forward of that token did, and in bf16 the
output can part from greedy at a near-tie. Here every decode forward (greedy tokens and verifies alike, all
``decode_rows`` wide) gives each row an explicit key order, ``order`` long [w, L]: the cache index of its j-th
key in sequence order (the committed prefix, then its ancestors and itself), and ``valid`` bool [w, L]
(j < the row's key count). The row's keys are gathered into that order and attended as one batch element of
their own; a greedy row's order is the identity. A row's keys, their positions in the gathered sequence and the
kernel (batch element, one query) are then the same whether the row was a greedy token or a tree node, so are
its logits. The price is the gather: every decode forward reads w copies of the cache instead of one.

Prompt chunks run the plain masked path (no ``key_order``): greedy and every method prefill the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gathered_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    order: Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> tuple[Tensor, None]:
    """query [1, H, w, D]; key/value [1, Hkv, L, D] (the whole static cache layer); ``order`` long [w, L];
    attention_mask [1, 1, w, L] in sequence order (0 = attend) -> [1, w, H, Dv]. Reached through
    eagle3.evaluate.static_attention, from a forward given ``key_order``."""
    assert attention_mask is not None, "key_order comes with its mask"
    _, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    flat = order.reshape(-1)  # [w * L]
    keys = key[0].index_select(1, flat).view(kv_heads, width, length, dim).transpose(0, 1)  # [w, Hkv, L, D]
    # [w, Hkv, L, Dv]
    values = value[0].index_select(1, flat).view(kv_heads, width, length, value.shape[-1]).transpose(0, 1)
    # The query heads sharing a key/value head become query rows of it (no repeated cache).
    rows = query[0].transpose(0, 1).reshape(width, kv_heads, heads // kv_heads, dim)  # [w, Hkv, G, D]
    mask = attention_mask[0, 0][:, None, None, :]  # [w, 1, 1, L]
    out = F.scaled_dot_product_attention(
        rows, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [w, Hkv, G, D]
    # [1, w, H, Dv] (the layout sdpa_attention_forward returns; Dv differs from D under MLA)
    return out.reshape(1, width, heads, out.shape[-1]), None


def key_order(key_index: Tensor, write: Tensor, at: int, num: int, tree: Tensor | None) -> tuple[Tensor, Tensor]:
    """(order long [w, L], valid bool [w, L]) of the w rows written at ``write`` [w] after ``at`` committed entries.

    No tree: each row's keys are the cache up to its own index (order = identity). A tree (bool [num, num],
    ancestors and self, parents before children): row r's keys are the committed prefix, then the indices of its
    ancestors and itself in depth order. Padding rows (r >= num) see only themselves."""
    width, length = len(write), len(key_index)
    if tree is None:
        return key_index[None, :].repeat(width, 1), key_index[None, :] <= write[:, None]  # [w, L] each
    count = torch.ones(width, dtype=torch.long)
    order_host = torch.arange(length).repeat(width, 1)  # [w, L], built here: no read from the device
    for r in range(width):
        if r < num:
            path = at + torch.nonzero(tree[r].cpu(), as_tuple=True)[0]  # ancestors and self, in depth order
            order_host[r, at : at + len(path)] = path
            count[r] = at + len(path)
        else:
            order_host[r, 0] = at + r
    valid = torch.arange(length)[None, :] < count[:, None]  # [w, L]
    return order_host.to(key_index.device), valid.to(key_index.device)
