"""Offline speculative decoding with a transformers target: draft trees, the greedy reference, the decode loop
(draft, verify, commit) and the lossless check. The drafters (EAGLE-3 chain and tree, prompt lookup) are
eagle3.evaluate.proposers.

Everything runs at batch size 1. With greedy verification the output must equal plain greedy decoding of the
target token for token; ``check_lossless`` reports the first difference and whether it is a numerical near-tie.
At temperature > 0 (a Sampler given) verification is speculative sampling (eagle3.evaluate.sampling, the loop's
sampled parts in eagle3.evaluate.sampled_decode): the output is distributed as the target's own sampling.

Loop state. ``context`` = x_0..x_m, the prompt and every committed token. The target's KV cache holds
x_0..x_{m-1}: the last committed token x_m is decided but not yet run. A verify forward runs
[x_m, draft nodes] at positions m + depth (x_m is the root, depth 0) with a tree mask (a node sees the
cache, its ancestors and itself; a chain needs only the causal mask). Row r's argmax is the target's
greedy choice after the path ending at r. Walking down from the root, the child whose token equals its
parent's greedy choice is accepted; the greedy choice after the last accepted node is the bonus token.
Every committed token is thus the target's greedy token after the committed prefix: lossless. The cache
then keeps x_0..x_{m-1} plus the root and accepted rows (a crop for a chain, an index select for a tree).

Counting: the first token comes from the prefill forward (plain greedy needs it too); each verify
forward then commits ``accepted + 1`` tokens (bonus included, as engines count), fewer only where
max_new_tokens or a stop token cuts the output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from eagle3.evaluate.records import LosslessCheck
from eagle3.evaluate.runners import DrafterRunner, StepOut, TargetRunner

# ------------------------------------------------------------------------------------------ drafts, records


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens (target ids) below the root, the last committed token; parents[i] < i, -1 = the root."""

    tokens: list[int]
    parents: list[int]
    # Sampled chain drafts: row i is the distribution (target vocab [N, V]) token i was drawn from; None = every
    # node chosen deterministically (greedy drafting, top-k trees, prompt lookup).
    draft_probs: Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"draft tree parents {self.parents} must satisfy -1 <= parents[i] < i")
        if self.draft_probs is not None and (not self.is_chain() or len(self.draft_probs) != len(self.tokens)):
            raise ValueError("draft probabilities are for a chain: one row per draft token")

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: Tensor | None = None) -> DraftTree:
        """A chain: token i's parent is token i-1 (``draft_probs``: the rows sampled drafts were drawn from)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs)

    def depths(self) -> list[int]:
        """Depth of every node (a child of the root has depth 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def is_chain(self) -> bool:
        """True when every node is the child of the one before (causal attention suffices)."""
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def ancestor_mask(self) -> Tensor:
        """bool [N+1, N+1] over rows (0 = root, i+1 = node i): row r sees row c iff c is r or an ancestor of r."""
        mask = torch.eye(len(self.tokens) + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] |= mask[p + 1]  # the parent's row is complete: parents come first
        return mask


@dataclass(frozen=True)
class VerifyStep:
    """One verify forward of the target."""

    draft_depth: int  # deepest proposed draft position (0 = nothing proposed)
    num_draft_tokens: int  # draft nodes verified (a tree has several per depth)
    accepted: int  # draft tokens accepted (the bonus token not included)
    committed: int  # tokens appended to the output: accepted + 1, fewer where the output ended


@dataclass
class DecodeResult:
    """Generated tokens (prompt excluded), wall time and, for speculative decoding, every verify step."""

    tokens: list[int]
    wall_s: float
    steps: list[VerifyStep] = field(default_factory=list)
    top_ids: list[list[int]] | None = None  # greedy reference: REFERENCE_TOPK ids per generated token
    top_logits: list[list[float]] | None = None  # ... and their logits
    logprob: float | None = None  # sampling: the target's log-prob of the tokens, summed
    outside: tuple[int, int] | None = None  # sampling: (position, token) of the first token the target could not
    # have sampled (probability 0 after top-k/top-p): a broken rule, never a correct decode

    @property
    def accept_len(self) -> float:
        """Tokens committed per verify forward, bonus included (1.0 = no draft token ever accepted)."""
        return sum(s.committed for s in self.steps) / max(len(self.steps), 1)


class Proposer(Protocol):
    """Drafts tokens for the next verify forward."""

    def reset(self) -> None:
        """Forget the previous prompt."""

    def observe(self, aux: Tensor, next_tokens: list[int], start: int) -> None:
        """The target ran indices start.. (aux [q, A*H]); next_tokens[i] is the committed token after each."""

    def propose(self, context: list[int]) -> DraftTree:
        """Draft below the last token of ``context`` (prompt + committed tokens)."""


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # time the GPU work, not its launch
    return time.perf_counter()


# ------------------------------------------------------------------------------------------------ decoding


def _finished(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in stop_ids)


STOP_CHECK_EVERY = 8
"""Greedy reads the device every this many tokens: between reads the host queues the next forwards while the
GPU runs (a read per token serializes them); tokens past a stop are computed, then cut off."""


@torch.no_grad()
def greedy_decode(
    target: TargetRunner, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> DecodeResult:
    """Plain greedy decoding with the KV cache, one forward per token, timed: the reference and the baseline.

    The next forward reads the previous greedy token on the device; the host reads the tokens every
    STOP_CHECK_EVERY tokens (the stop test) and keeps them up to the first stop.
    """
    stops = set(stop_ids)
    start_s = _clock(target.device)
    target.reset()
    out = target.step(prompt, last_only=True, with_aux=False)
    tokens: list[Tensor] = []
    tops: list[tuple[Tensor, Tensor]] = []
    while True:
        token = out.greedy[-1:]  # [1]
        tops.append((out.top_values[-1], out.top_ids[-1]))
        tokens.append(token)
        if len(tokens) >= max_new_tokens:
            break
        if len(tokens) % STOP_CHECK_EVERY == 0 and stops & set(torch.cat(tokens[-STOP_CHECK_EVERY:]).tolist()):
            break
        out = target.step(token, with_aux=False)
    ids = torch.cat(tokens).tolist()
    end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
    # Forwards past the stop (at most STOP_CHECK_EVERY - 1) are not the baseline's work: their share of the time
    # is taken off (prefill included in the scaled part, so the baseline looks a little faster, never slower).
    wall_s = (_clock(target.device) - start_s) * end / len(ids)
    return DecodeResult(
        ids[:end],
        wall_s,
        top_ids=torch.stack([i for _, i in tops[:end]]).tolist(),
        top_logits=torch.stack([v for v, _ in tops[:end]]).tolist(),
    )


def accept_path(tree: DraftTree, greedy: Sequence[int]) -> tuple[list[int], int]:
    """(accepted node indices from the root down, bonus token) given the argmax of every verify row."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, {}).setdefault(token, i)
    path, node = [], -1
    while (child := children.get(node, {}).get(greedy[node + 1])) is not None:
        path.append(child)
        node = child
    return path, greedy[node + 1]


def verify(target: TargetRunner, tree: DraftTree, context: list[int]) -> tuple[list[int], list[int], Tensor]:
    """Run [last token, draft] through the target; returns (new tokens, accepted nodes, aux [a+1, A*H])."""
    out = verify_forward(target, tree, context)
    path, bonus = accept_path(tree, out.greedy.tolist())  # the round's host sync
    return [tree.tokens[i] for i in path] + [bonus], path, keep_accepted(target, len(context) - 1, path, out)


def verify_forward(target: TargetRunner, tree: DraftTree, context: list[int], with_logits: bool = False) -> StepOut:
    """The verify forward: [last committed token, draft nodes] after the cache (tree mask and depth positions)."""
    m = len(context) - 1
    if target.length != m:
        raise RuntimeError(f"target cache holds {target.length} entries, expected {m}")
    chain = tree.is_chain()
    visible = None if chain else tree.ancestor_mask()
    positions = None if chain else [m, *(m + d for d in tree.depths())]  # None: consecutive after the cache
    return target.step([context[-1], *tree.tokens], positions, visible, with_logits=with_logits)


def keep_accepted(target: TargetRunner, m: int, path: list[int], out: StepOut) -> Tensor:
    """Keep the root and the accepted nodes in the target's cache; their aux [a+1, A*H]."""
    rows = [0, *(i + 1 for i in path)]
    target.keep(m, [m + r for r in rows])
    assert out.aux is not None  # (step returns aux unless asked not to)
    return out.aux[: len(rows)] if rows == list(range(len(rows))) else out.aux[rows]  # a slice needs no copy


@torch.no_grad()
def speculative_decode(
    target: TargetRunner,
    proposer: Proposer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    sampled: Any = None,
) -> DecodeResult:
    """Draft, verify, commit; timed from the prefill to the last token, like greedy_decode. Verification is greedy,
    or speculative sampling through ``sampled`` (a fresh eagle3.evaluate.sampled_decode.SampledRounds)."""
    stops = set(stop_ids)
    start_s = _clock(target.device)
    target.reset()
    proposer.reset()
    first = target.step(prompt, last_only=True, with_logits=sampled is not None)  # aux of every prompt row
    aux = first.aux
    assert aux is not None  # (step returns aux unless asked not to)
    tokens = [int(first.greedy[-1]) if sampled is None else sampled.first_token(first)]
    context = [*prompt, tokens[0]]
    proposer.observe(aux, context[1:], 0)
    steps: list[VerifyStep] = []
    while not _finished(tokens, max_new_tokens, stops):
        tree = proposer.propose(context) if sampled is None else sampled.propose(proposer, context)
        start = len(context) - 1
        new, path, aux = verify(target, tree, context) if sampled is None else sampled.verify(target, tree, context)
        committed = 0
        for token in new:
            if _finished(tokens, max_new_tokens, stops):
                break
            tokens.append(token)
            committed += 1
        context.extend(new[:committed])
        steps.append(VerifyStep(max(tree.depths(), default=0), len(tree.tokens), len(path), committed))
        if sampled is not None:
            sampled.commit(len(tokens) - committed, committed)
        if not _finished(tokens, max_new_tokens, stops):
            proposer.observe(aux, new, start)
    result = DecodeResult(tokens, _clock(target.device) - start_s, steps)
    return result if sampled is None else sampled.finish(result)


@torch.no_grad()
def teacher_forced_drafts(
    target: TargetRunner, runner: DrafterRunner, prompt: Sequence[int], generated: Sequence[int]
) -> list[int]:
    """The drafter's first draft token (target ids) for generated[1:], every context fed from the text itself.

    One target forward over prompt + generated and one causal drafter pass: TTT step 0 as training computes
    it. A chain round starting with c context tokens proposes entry c - len(prompt) - 1 of this list, so
    position-1 acceptance far below this list's agreement with ``generated`` means the decode does not give
    the drafter what training did; both low means the drafter itself misses on this text.
    """
    seq = [*prompt, *generated]
    if len(generated) < 2:
        return []
    target.reset()
    runner.reset()
    aux = target.step(seq[:-2]).aux  # [L-2, A*H]: index t's feature with token t+1 predicts token t+2
    assert aux is not None  # (step returns aux unless asked not to)
    _, logits = runner.extend(aux, seq[1:-1], 0)  # [L-2, Vd]
    drafts = runner.to_target_ids(logits[len(prompt) - 1 :].argmax(-1))  # predicts seq[len(prompt)+1:]
    target.reset()
    runner.reset()
    return drafts.tolist()


def draft_hits(drafts: Sequence[int], generated: Sequence[int]) -> int:
    """How many teacher-forced drafts equal the token they predict (drafts[i] predicts generated[i + 1])."""
    return sum(d == t for d, t in zip(drafts, generated[1:]))


# ---------------------------------------------------------------------------------------------- lossless


def check_lossless(
    reference: DecodeResult, tokens: Sequence[int], near_tie_gap: float, dtype: torch.dtype = torch.float32
) -> LosslessCheck:
    """identical, or the first difference: near_tie when the method's token is within ``near_tie_gap`` of the
    reference's top logit there, or within 2 units of ``dtype``'s rounding at that logit (two tokens the target
    can hardly tell apart: summation-order noise of a batched verify forward), else mismatch (a bug)."""
    ref = reference.tokens
    if list(tokens) == list(ref):
        return LosslessCheck("identical")
    pos = next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))
    if pos >= len(ref):
        return LosslessCheck("mismatch", pos, None, int(tokens[pos]))
    assert reference.top_ids is not None and reference.top_logits is not None, "a greedy reference keeps its top-k"
    ids, values = reference.top_ids[pos], reference.top_logits[pos]
    method_token = int(tokens[pos]) if pos < len(tokens) else None
    top2_gap = values[0] - values[1] if len(values) > 1 else None
    token_gap = (
        values[0] - values[ids.index(method_token)] if method_token is not None and method_token in ids else None
    )
    near = token_gap is not None and token_gap <= max(near_tie_gap, 2 * rounding_step(values[0], dtype))
    return LosslessCheck("near_tie" if near else "mismatch", pos, ref[pos], method_token, top2_gap, token_gap)


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s representable numbers at ``value`` (bf16 at 15.3: 0.0625; fp32: ~1e-6)."""
    exponent = math.floor(math.log2(abs(value))) if value else 0
    return torch.finfo(dtype).eps * 2.0**exponent
