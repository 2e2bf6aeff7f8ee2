"""The drafters of offline speculative decoding: EAGLE-3 chain and tree drafting from the drafter's cached state,
and prompt lookup (n-grams); each proposes a DraftTree for the next verify forward (eagle3.evaluate.speculate).

EAGLE-3 at inference (the TTT alignment of eagle3/drafter/alignment.py). The drafter's cache holds, for every index
t < m, the key/value of (feature fc(g_t), token x_{t+1}, position t), g_t being the target's aux states at
t. Its output at t = m-1 (token x_m) predicts x_{m+1}, draft token 1. Draft step j >= 1 feeds its own
previous pre-norm output with draft token j at position m-1+j (TTT step j at index m-1) and attends to
every cached entry plus the draft entries of its ancestors (TTT's diagonal). After verification the
draft entries are dropped and the committed rows are recomputed from the target's real aux states, as
SGLang does: features g_m..g_{m+a}, tokens [accepted..., bonus], positions m..m+a. Draft logits are over
the draft vocab: target id = draft id + d2t[draft id].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import upcast
from eagle3.drafter.model import Eagle3Drafter
from eagle3.evaluate.runners import DrafterRunner
from eagle3.evaluate.speculate import DraftTree

# ------------------------------------------------------------------------------------------------ EAGLE-3


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index in the pool, -1 = the root
    depth: int
    score: float  # cumulative draft log-prob


class EagleProposer:
    """EAGLE-3 drafting: a chain (topk 1) or an EAGLE-2-style tree, from the drafter's cached state.

    Tree (as SGLang): the root's top-k children form depth 1; at every further depth each of the k
    frontier nodes is run through the drafter and proposes its top-k children, and the k best of those
    k*k by cumulative log-prob become the next frontier. Of all nodes proposed, the best
    ``num_draft_tokens - 1`` by cumulative log-prob are verified (num_draft_tokens counts the root, as
    SGLang's --speculative-num-draft-tokens). A child never scores above its parent, so the kept set is
    a tree. ``steps`` is the depth; chain and tree run ``steps - 1`` drafter forwards per round.
    ``runner`` replaces the eager DrafterRunner (a static-cache one of eagle3.evaluate.static_drafter, possibly
    shared by several proposers of one process: each round starts from its own observe).
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        d2t: Tensor,
        steps: int,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        runner: Any = None,
    ) -> None:
        if steps < 1 or topk < 1 or topk > len(d2t):
            raise ValueError(f"need steps >= 1 and 1 <= topk <= draft vocab {len(d2t)}, got {steps}, {topk}")
        self.runner = runner if runner is not None else DrafterRunner(drafter, d2t)
        self.steps, self.topk = steps, topk
        self.num_draft_tokens = num_draft_tokens or steps + 1
        self._root: tuple[Tensor, Tensor] | None = None  # (out [1, H], logits [Vd]) at the last committed index

    def reset(self) -> None:
        self.runner.reset()
        self._root = None

    def observe(self, aux: Tensor, next_tokens: list[int], start: int) -> None:
        out, logits = self.runner.extend(aux, next_tokens, start)
        self._root = (out[-1:], logits[-1])

    def propose(self, context: list[int]) -> DraftTree:
        if self._root is None:
            raise RuntimeError("EagleProposer.propose before observe: the drafter has no state")
        return self._chain() if self.topk == 1 else self._tree()

    @property
    def root(self) -> tuple[Tensor, Tensor]:
        """(drafter out [1, H], logits [Vd]) at the last committed index: where a round's drafting starts."""
        if self._root is None:
            raise RuntimeError("EagleProposer drafting before observe: the drafter has no state")
        return self._root

    def _chain(self) -> DraftTree:
        assert self._root is not None, "observe() first"
        hidden, logits = self._root
        if hasattr(self.runner, "chain"):  # the static runner drafts the whole chain in one (compiled) call
            return DraftTree.chain(self.runner.chain(hidden, logits, self.steps).tolist())  # one device sync
        root_position = self.runner.num_committed - 1
        tokens = []
        for j in range(1, self.steps + 1):
            token = self.runner.to_target_ids(logits.argmax(-1, keepdim=True))  # [1]
            tokens.append(token)
            if j < self.steps:
                ancestors = torch.ones(
                    1, self.runner.num_draft_entries + 1, dtype=torch.bool, device=self.runner.device
                )
                hidden, logits = self.runner.draft(hidden, token, root_position + j, ancestors)
                logits = logits[0]
        return DraftTree.chain(torch.cat(tokens).tolist())  # one device sync per round

    def _children(self, nodes: list[_Node], parents: list[int], logits: Tensor, depth: int) -> list[int]:
        """Add the top-k children of each parent (logits [P, Vd]); returns the new pool indices."""
        scores, ids = F.log_softmax(upcast(logits), dim=-1).topk(self.topk, dim=-1)  # [P, k]
        base = torch.tensor([nodes[p].score if p >= 0 else 0.0 for p in parents], device=scores.device)
        score_rows, id_rows = (scores + base[:, None]).tolist(), self.runner.to_target_ids(ids).tolist()
        start = len(nodes)
        for row, p in enumerate(parents):
            nodes.extend(_Node(t, p, depth, s) for t, s in zip(id_rows[row], score_rows[row]))
        return list(range(start, len(nodes)))

    def _tree(self) -> DraftTree:
        assert self._root is not None, "observe() first"
        root_hidden, root_logits = self._root
        if hasattr(self.runner, "tree"):  # the static runner builds the tree on the device in one call
            tokens, parents = self.runner.tree(
                root_hidden, root_logits, self.steps, self.topk, self.num_draft_tokens - 1
            )
            return DraftTree(tokens.tolist(), parents.tolist())
        root_position = self.runner.num_committed - 1
        nodes: list[_Node] = []
        frontier = self._children(nodes, [-1], root_logits[None], 1)
        hidden_of: dict[int, Tensor] = {-1: root_hidden[0]}  # pool index -> its drafter output
        entry_of: dict[int, int] = {}  # pool index -> its draft entry
        for depth in range(1, self.steps):
            first_entry = self.runner.num_draft_entries
            ancestors = torch.zeros(len(frontier), first_entry + len(frontier), dtype=torch.bool)
            for row, f in enumerate(frontier):
                entry_of[f] = first_entry + row
                a = f
                while a >= 0:
                    ancestors[row, entry_of[a]] = True
                    a = nodes[a].parent
            hidden = torch.stack([hidden_of[nodes[f].parent] for f in frontier])  # [k, H]
            tokens = torch.tensor([nodes[f].token for f in frontier], device=self.runner.device)
            out, logits = self.runner.draft(hidden, tokens, root_position + depth, ancestors)
            hidden_of.update({f: out[row] for row, f in enumerate(frontier)})
            candidates = self._children(nodes, frontier, logits, depth + 1)
            frontier = sorted(candidates, key=lambda i: (-nodes[i].score, i))[: self.topk]
        return _best_subtree(nodes, self.num_draft_tokens - 1)


def _best_subtree(nodes: list[_Node], size: int) -> DraftTree:
    """The ``size`` best nodes by cumulative log-prob (ties: shallower first), parents before children."""
    best = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:size]
    keep = sorted(best, key=lambda i: (nodes[i].depth, i))
    index = {old: new for new, old in enumerate(keep)}
    parents = [-1 if nodes[i].parent < 0 else index[nodes[i].parent] for i in keep]
    return DraftTree([nodes[i].token for i in keep], parents)


# ------------------------------------------------------------------------------------------------- n-grams


class NgramProposer:
    """Prompt-lookup drafting: what followed the latest earlier occurrence of the context's last n tokens.

    n runs from max_ngram down to min_ngram; the lookup window is the whole context (prompt + generated);
    up to num_tokens tokens are proposed, none when no n-gram recurs.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram and num_tokens >= 1, got {min_ngram}, {max_ngram}, {num_tokens}"
            )
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens

    def reset(self) -> None:
        pass

    def observe(self, aux: Tensor, next_tokens: list[int], start: int) -> None:
        pass

    def propose(self, context: list[int]) -> DraftTree:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            suffix = context[-n:]
            for i in range(len(context) - n - 1, -1, -1):  # latest first; i + n < len: a continuation exists
                if context[i : i + n] == suffix:
                    return DraftTree.chain(context[i + n : i + n + self.num_tokens])
        return DraftTree.chain([])
