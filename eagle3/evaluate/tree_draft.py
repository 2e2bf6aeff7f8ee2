"""An EAGLE-2-style draft tree built on the device, for the static drafter runner: one call per round.

The same tree as ``proposers.EagleProposer._tree`` (which builds it on the host, reading the device at every
depth), computed with fixed shapes so torch.compile can record it as one CUDA graph:
  * depth 1: the root's top-k children (score = their log-prob);
  * depth d >= 2: the k frontier nodes run through the drafter together (width ``bucket(k)``, padding rows
    see only themselves), each proposes its top-k children (score = parent score + log-prob), and the k best
    of those k*k by (-score, pool index) become the next frontier;
  * the pool holds every proposed node in the host's order (depth by depth, parent row by parent row, child
    rank), and the verified tree is the ``size`` best by (-score, depth, index), listed in pool order.
Draft entries: depth d's frontier writes rows committed + (d-1)*k .. + k - 1 (as ``draft`` would); a node sees
every committed entry and the entries of its ancestors and itself (``anc``: [k, (steps-1)*k] over the round's
draft entries). Scores are added exactly as on the host: the parent's score is rounded to float32 first
(the host rebuilds it with ``torch.tensor`` from Python floats), the log-probs are in the drafter's upcast dtype.
Capturable as one CUDA graph: no host reads and no host-to-device copies (writing a Python scalar into a device
tensor copies a CPU scalar, which a capture refuses: on an H200 the round then fell back to launching every kernel
from Python, 12.7-17.8 ms per round against 5.6 ms for a chain of 7). Orders are computed by counting (``_order``)
rather than with torch.sort, whose stable CUDA path may use CUB's segmented sort, known not to be capturable
(NVIDIA/cccl issue 5661).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import upcast


def _order(scores: Tensor) -> Tensor:
    """Indices of ``scores`` [n] by descending score, ties by index: torch.sort(-scores, stable=True).indices, from an
    [n, n] comparison (n is at most a few hundred here) instead of a sort kernel."""
    index = torch.arange(scores.shape[0], device=scores.device)
    ahead = (scores[None, :] > scores[:, None]) | (
        (scores[None, :] == scores[:, None]) & (index[None, :] < index[:, None])
    )
    return torch.empty_like(index).scatter_(0, ahead.sum(-1), index)  # [n]: the element of each rank


def _ascending(values: Tensor) -> Tensor:
    """Distinct integers [n] in ascending order (torch.sort(values).values), by the same counting."""
    rank = (values[None, :] < values[:, None]).sum(-1)  # [n]
    return torch.empty_like(values).scatter_(0, rank, values)


def tree_rows(
    runner: Any, hidden: Tensor, logits: Tensor, committed: Tensor, steps: int, topk: int, size: int, width: int
) -> tuple[Tensor, Tensor]:
    """Root out [1, H] and logits [Vd], committed long [1] -> (tokens [size] target ids, parents [size], -1 = root).

    ``runner``: a StaticDrafterRunner (its _rows_step writes the draft entries); ``width``: bucket(topk).
    """
    k, device = topk, hidden.device
    logp, ids = F.log_softmax(upcast(logits), dim=-1).topk(k)  # [k]
    scores, tokens = [logp], [runner.to_target_ids(ids)]  # per depth: [k] (depth 1), then [k*k]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device)  # pool indices of the frontier
    front_scores, front_tokens = logp, tokens[0]
    front_hidden = hidden.expand(k, -1)  # [k, H]: every depth-1 node's parent is the root
    num_draft = (steps - 1) * k
    anc = torch.zeros(k, max(num_draft, 1), dtype=torch.bool, device=device)  # [k, D] ancestors and self
    rows = torch.arange(k, device=device)
    entries = torch.arange(anc.shape[1], device=device)  # [D]
    offset = runner._key_index - committed  # [L]: index into the round's draft entries
    in_round = (offset >= 0) & (offset < num_draft)
    base = k  # pool size so far
    for depth in range(1, steps):
        first = (depth - 1) * k
        anc = anc | (entries[None, :] == (first + rows)[:, None])  # each node sees itself (no scalar write: a CPU copy)
        write = committed + first + torch.arange(width, device=device)  # [w]
        seen = (runner._key_index < committed)[None, :]  # [1, L]: every committed entry
        visible = torch.cat(
            [
                seen | (in_round[None, :] & anc[:, offset.clamp(0, anc.shape[1] - 1)]),  # [k, L]
                seen | (runner._key_index[None, :] == write[k:, None]),
            ]
        )  # padding rows: themselves
        pad = width - k
        out, level = runner._rows_step(
            torch.cat([front_hidden, front_hidden.new_zeros(pad, front_hidden.shape[1])]),
            torch.cat([front_tokens, front_tokens.new_zeros(pad)]),
            (committed - 1 + depth).expand(width),
            write,
            visible,
        )
        out, level = out[:k], level[:k]  # [k, H], [k, Vd]
        child_logp, child_ids = F.log_softmax(upcast(level), dim=-1).topk(k, dim=-1)  # [k, k]
        child_scores = (front_scores.float()[:, None] + child_logp).reshape(-1)  # [k*k], parent row major
        child_tokens = runner.to_target_ids(child_ids).reshape(-1)
        scores.append(child_scores)
        tokens.append(child_tokens)
        parents.append(frontier[:, None].expand(k, k).reshape(-1))  # each frontier node, k times
        order = _order(child_scores)[:k]  # (-score, index)
        parent_row = order // k
        frontier, front_scores, front_tokens = base + order, child_scores[order], child_tokens[order]
        front_hidden, anc = out[parent_row], anc[parent_row]
        base += k * k
    all_scores, all_tokens, all_parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents)
    best = _order(all_scores)[:size]  # (-score, depth, index): pool order is depth-major
    keep = _ascending(best)  # listed by (depth, index)
    new_index = torch.full_like(all_parents, -1)
    new_index[keep] = torch.arange(len(keep), device=device)
    kept_parents = all_parents[keep]
    return all_tokens[keep], torch.where(kept_parents >= 0, new_index[kept_parents.clamp(min=0)], -1)
