"""A deliberately simple EAGLE-3 training-time-test reference, for checking the optimized path.

One unpacked sequence at a time, python loops over steps, positions and heads, attention written out
score by score, RoPE rotated pair by pair, the alignment spelled with plain indices. It shares nothing
with eagle3.drafter.model, eagle3.drafter.functional or eagle3.drafter.ttt except the parameter tensors it reads
(so gradients can be compared).
Default RoPE only (no llama3 scaling; that is checked against transformers separately).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RefStep:
    """Sums and counts of one TTT step over one sequence."""

    loss_sum: Tensor  # [] soft CE summed over supervised positions (differentiable)
    num_supervised: int  # positions in the loss
    num_predicted: int  # predictions whose token is marked in loss_mask
    num_correct: int
    num_full_correct: int


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x / torch.sqrt((x * x).mean() + eps))


def _rotate(vec: Tensor, pos: int, theta: float) -> Tensor:
    """RoPE on one head vector: pair (i, i + hd/2) turned by pos * theta^(-2i/hd)."""
    half = len(vec) // 2
    first, second = [], []
    for i in range(half):
        angle = pos * theta ** (-2 * i / len(vec))
        c, s = math.cos(angle), math.sin(angle)
        first.append(vec[i] * c - vec[i + half] * s)
        second.append(vec[i + half] * c + vec[i] * s)
    return torch.stack(first + second)


def _attend(
    q: Tensor, keys: list[list[list[Tensor]]], values: list[list[list[Tensor]]], t: int, kv_head: int
) -> Tensor:
    """Query of position t: step 0's keys at positions 0..t, then its own key of every later step."""
    cand_k = [keys[0][s][kv_head] for s in range(t + 1)] + [keys[j][t][kv_head] for j in range(1, len(keys))]
    cand_v = [values[0][s][kv_head] for s in range(t + 1)] + [values[j][t][kv_head] for j in range(1, len(values))]
    scores = torch.stack([torch.dot(q, k) / math.sqrt(len(q)) for k in cand_k])
    weights = torch.softmax(scores, dim=0)
    return sum(w * v for w, v in zip(weights, cand_v))


class ReferenceTTT:
    """The drafter's weights, used one vector at a time."""

    def __init__(self, model) -> None:
        self.w = dict(model.named_parameters())
        self.embed = model.embed_tokens.weight
        d = model.dims
        assert d.rope_scaling is None, "the reference knows default RoPE only"
        self.nh, self.nkv, self.hd, self.eps, self.theta = (
            d.num_attention_heads,
            d.num_key_value_heads,
            d.head_dim,
            d.rms_norm_eps,
            d.rope_theta,
        )

    def _heads(self, vec: Tensor, n: int) -> list[Tensor]:
        return [vec[i * self.hd : (i + 1) * self.hd] for i in range(n)]

    def qkv(self, token: int, feature: Tensor, pos: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Per-head q, k (rotated) and v of one position."""
        w = self.w
        x = torch.cat(
            [
                _rms(self.embed[token], w["midlayer.input_layernorm.weight"], self.eps),
                _rms(feature, w["midlayer.hidden_norm.weight"], self.eps),
            ]
        )
        q = [_rotate(h, pos, self.theta) for h in self._heads(w["midlayer.self_attn.q_proj.weight"] @ x, self.nh)]
        k = [_rotate(h, pos, self.theta) for h in self._heads(w["midlayer.self_attn.k_proj.weight"] @ x, self.nkv)]
        return q, k, self._heads(w["midlayer.self_attn.v_proj.weight"] @ x, self.nkv)

    def finish(self, feature: Tensor, head_outputs: list[Tensor]) -> tuple[Tensor, Tensor]:
        """(pre-norm output, draft logits) of one position from its attention heads."""
        w = self.w
        h = feature + w["midlayer.self_attn.o_proj.weight"] @ torch.cat(head_outputs)
        x = _rms(h, w["midlayer.post_attention_layernorm.weight"], self.eps)
        gate, up = w["midlayer.mlp.gate_proj.weight"] @ x, w["midlayer.mlp.up_proj.weight"] @ x
        out = h + w["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
        return out, w["lm_head.weight"] @ _rms(out, w["norm.weight"], self.eps)


def reference_ttt(
    model, aux: Tensor, ids: list[int], loss_mask: list[int], target_logits: Tensor, t2d: Tensor, steps: int
) -> list[RefStep]:
    """Unroll ``steps`` TTT steps over ONE sequence (aux [T, A*Ht], target_logits [T, V] full vocab)."""
    ref, length = ReferenceTTT(model), len(ids)
    used = [v for v in range(len(t2d)) if t2d[v]]  # draft id i is target id used[i]
    features = [ref.w["fc.weight"] @ aux[t] for t in range(length)]
    keys, values, chain, results = [], [], [True] * length, []
    for k in range(steps):
        # Step k at index t reads token x_{t+1+k} (0 past the end) at RoPE position t + k.
        per_pos = [ref.qkv(ids[t + 1 + k] if t + 1 + k < length else 0, features[t], t + k) for t in range(length)]
        keys.append([p[1] for p in per_pos])
        values.append([p[2] for p in per_pos])
        group = ref.nh // ref.nkv
        outs = [
            ref.finish(features[t], [_attend(per_pos[t][0][h], keys, values, t, h // group) for h in range(ref.nh)])
            for t in range(length)
        ]
        features = [o[0] for o in outs]
        results.append(_score(k, [o[1] for o in outs], loss_mask, target_logits, used, chain))
    return results


def _score(
    k: int, logits: list[Tensor], loss_mask: list[int], target_logits: Tensor, used: list[int], chain: list[bool]
) -> RefStep:
    """Index t predicts token m = t+2+k against the target at j = t+1+k; supervised iff loss_mask[m]."""
    length, loss_sum = len(logits), torch.zeros((), dtype=target_logits.dtype)
    counts = {"sup": 0, "pred": 0, "correct": 0, "full": 0}
    for t in range(length):
        j, m = t + 1 + k, t + 2 + k
        if j >= length:
            chain[t] = False
            continue
        top, draft = int(target_logits[j].argmax()), used[int(logits[t].argmax())]
        chain[t] = chain[t] and draft == top
        if m >= length or not loss_mask[m]:
            continue
        counts["pred"] += 1
        counts["correct"] += int(draft == top)
        counts["full"] += int(chain[t])
        if top not in used:
            continue
        p = torch.softmax(target_logits[j, used], dim=0)
        loss_sum = loss_sum - (p * torch.log_softmax(logits[t], dim=0)).sum()
        counts["sup"] += 1
    return RefStep(loss_sum, counts["sup"], counts["pred"], counts["correct"], counts["full"])


def combined_loss(per_sequence: list[list[RefStep]], step_decay: float = 0.8) -> Tensor:
    """sum_k decay^k * (sum of loss sums over sequences) / (total supervised count), as a masked mean."""
    total = torch.zeros(())
    for k in range(len(per_sequence[0])):
        s = sum(seq[k].loss_sum for seq in per_sequence)
        n = sum(seq[k].num_supervised for seq in per_sequence)
        total = total + step_decay**k * s / max(n, 1)
    return total
