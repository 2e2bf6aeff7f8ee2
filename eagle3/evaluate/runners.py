"""Eager KV-cache runners of the offline evaluation, at batch 1: the target with transformers' DynamicCache, the
EAGLE-3 drafter with a growing key/value tensor. eagle3/evaluate/static_target.py and static_drafter.py hold their
static-cache (and compiled) counterparts; eagle3/evaluate/speculate.py drives either through the same methods
(step, keep, extend, draft).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import attention_inputs, rope_cos_sin, rope_inv_freq_on, step_outputs, upcast
from eagle3.drafter.model import Eagle3Drafter, step_weights

REFERENCE_TOPK = 5
"""Top logits the greedy reference keeps per token, to tell a numerical near-tie from a real mismatch."""


@dataclass
class StepOut:
    """What the decode loops read from a target forward: per row the greedy token, the top logits, the aux states."""

    greedy: Tensor  # [q] long, argmax of each row's logits (argmax, not topk[0]: one tie rule everywhere)
    top_values: Tensor  # [q, REFERENCE_TOPK] fp32 logits
    top_ids: Tensor  # [q, REFERENCE_TOPK]
    aux: Tensor | None  # [q, A*H]; None without with_aux
    logits: Tensor | None = None  # [q, V] fp32; only with with_logits (sampling reads the whole distribution)


def as_token_tensor(tokens: Sequence[int] | Tensor, device: torch.device) -> Tensor:
    """long [q] on ``device``: a device tensor passes through (no host round trip), a list is copied once."""
    if isinstance(tokens, Tensor):
        return tokens.to(device, torch.long).reshape(-1)
    return torch.tensor(list(tokens), dtype=torch.long, device=device)


# ---------------------------------------------------------------------------------------------- the target


class TargetRunner:
    """A transformers causal LM at batch 1: one DynamicCache, forward hooks taking the aux layers' outputs.

    Aux ids are in the output-of-layer convention (features/spec.py): id j is the output of decoder layer j.
    """

    def __init__(self, model: Any, aux_layer_ids: Sequence[int]) -> None:
        self.model = model.eval()
        self.aux_layer_ids = list(aux_layer_ids)
        layers = model.model.layers
        if any(not 0 <= j < len(layers) for j in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} out of range for a {len(layers)}-layer target")
        self.device = model.get_input_embeddings().weight.device
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self._outputs: dict[int, Tensor] = {}
        self._hooks = [layers[j].register_forward_hook(self._keeper(j)) for j in sorted(set(self.aux_layer_ids))]
        self.cache: Any = None
        self.reset()

    def _keeper(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self._outputs[layer] = output[0] if isinstance(output, tuple) else output  # [1, q, H]

        return hook

    def compiled_steps(self) -> list[Any]:
        """The CompiledStep functions it runs (none here: the static runners have them)."""
        return []

    def reset(self) -> None:
        """An empty cache."""
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            self.cache = DynamicCache()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def length(self) -> int:
        """Entries in the KV cache."""
        return self.cache.get_seq_length()

    @torch.no_grad()
    def forward(
        self,
        tokens: Sequence[int] | Tensor,
        positions: Sequence[int] | None = None,
        visible: Tensor | None = None,
        last_only: bool = False,
        with_aux: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """(fp32 logits [q, V] (or [1, V] with last_only), aux [q, A*H] (None without with_aux)) of tokens run
        after the cache.

        positions default to consecutive after the cache; ``visible`` (bool [q, q]) replaces causal
        attention among the new tokens (every cached entry stays visible): the tree mask.
        """
        start, num = self.length, len(tokens)  # tokens: a list or a device tensor [q]
        positions = range(start, start + num) if positions is None else positions
        kwargs: dict[str, Any] = {
            self._cache_arg: self.cache,
            "use_cache": True,
            "position_ids": torch.tensor([list(positions)], device=self.device),
        }
        if visible is not None:
            kwargs["attention_mask"] = self._additive_mask(start, visible)
        if last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=as_token_tensor(tokens, self.device)[None], **kwargs)
        aux = torch.cat([self._outputs[j][0] for j in self.aux_layer_ids], dim=-1) if with_aux else None
        return out.logits[0].float(), aux

    def step(
        self,
        tokens: Sequence[int] | Tensor,
        positions: Sequence[int] | None = None,
        visible: Tensor | None = None,
        last_only: bool = False,
        with_aux: bool = True,
        with_logits: bool = False,
    ) -> StepOut:
        """forward, reduced to what the decode loops read (greedy tokens, top logits, aux, with_logits: the logits);
        same arguments."""
        logits, aux = self.forward(tokens, positions, visible, last_only, with_aux)
        top = logits.topk(REFERENCE_TOPK)
        return StepOut(logits.argmax(-1), top.values, top.indices, aux, logits if with_logits else None)

    def _additive_mask(self, start: int, visible: Tensor) -> Tensor:
        """[1, 1, q, start + q] float mask (0 = attend): transformers passes a 4D mask through as it is."""
        num = visible.shape[0]
        # Built on the device: only the small [q, q] tree block crosses from the host, not the O(L) prefix.
        allowed = torch.cat(
            [torch.ones(num, start, dtype=torch.bool, device=self.device), visible.to(self.device)], dim=1
        )
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def keep(self, prefix: int, rows: Sequence[int]) -> None:
        """Keep cache entries [0, prefix) followed by ``rows`` (absolute, ascending); drop everything else."""
        rows = list(rows)
        if rows == list(range(prefix, prefix + len(rows))):
            select: Any = slice(0, prefix + len(rows))  # a chain: a crop
        else:
            select = torch.tensor([*range(prefix), *rows], device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ValueError("sliding-window attention layers are not supported by the offline evaluation")
            if isinstance(select, slice):
                layer.keys, layer.values = layer.keys[..., select, :], layer.values[..., select, :]
            else:
                layer.keys, layer.values = layer.keys.index_select(-2, select), layer.values.index_select(-2, select)


# --------------------------------------------------------------------------------------------- the drafter


class DrafterRunner:
    """The EAGLE-3 drafter with a KV cache: committed entries, then the current round's draft entries.

    Built from the functional step of eagle3.drafter.functional (attention_inputs / step_outputs, the same code the
    compiled training step runs), so it computes what the TTT unroll computes (a test checks it); only the
    attention reads a cache.
    """

    def __init__(self, drafter: Eagle3Drafter, d2t: Tensor) -> None:
        self.drafter = drafter.eval()
        dims = drafter.dims
        self.device = drafter.fc.weight.device
        self.d2t = d2t.to(self.device, torch.long)  # [Vd]
        self.weights = step_weights(self.drafter)
        self.inv_freq = rope_inv_freq_on(dims.head_dim, dims.rope_theta, dims.rope_scaling, self.device)
        self.keys: Tensor | None = None  # [1, nKV, L, hd] post-RoPE
        self.values: Tensor | None = None  # [1, nKV, L, hd]
        self.num_committed = 0

    def compiled_steps(self) -> list[Any]:
        """The CompiledStep functions it runs (none here: the static runners have them)."""
        return []

    def reset(self) -> None:
        """An empty cache."""
        self.keys = self.values = None
        self.num_committed = 0

    @property
    def num_draft_entries(self) -> int:
        """Entries of the current round's draft nodes."""
        return (0 if self.keys is None else self.keys.shape[2]) - self.num_committed

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target ids (d2t holds the offsets)."""
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def _run(self, hidden: Tensor, tokens: Tensor, positions: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [q, H], tokens/positions [q], visible bool [q, L + q] -> (pre-norm out [q, H], logits [q, Vd])."""
        dims = self.drafter.dims
        cos, sin = rope_cos_sin(self.inv_freq, positions[None], upcast(hidden).dtype)  # [1, 1, q, hd]
        q, k, v = attention_inputs(
            self.weights,
            tokens[None],
            hidden[None],
            cos,
            sin,
            dims.rms_norm_eps,
            dims.num_attention_heads,
            dims.num_key_value_heads,
        )  # [1, nH|nKV, q, hd]
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        attn = F.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=visible[None, None], enable_gqa=True
        )  # [1, nH, q, hd]; no repeated copy of the cache
        out, logits = step_outputs(self.weights, hidden[None], attn, dims.rms_norm_eps)  # [1, q, H], [1, q, Vd]
        return out[0], logits[0]

    def extend(self, aux: Tensor, next_tokens: Sequence[int], start: int) -> tuple[Tensor, Tensor]:
        """Commit indices start..start+q-1 (feature fc(aux), the token after each, position = index), causal.

        The previous round's draft entries are dropped first. Returns (out [q, H], logits [q, Vd]).
        """
        if start != self.num_committed:
            raise ValueError(f"drafter cache holds {self.num_committed} committed entries, asked to extend at {start}")
        self._drop_drafts()
        num = len(next_tokens)
        visible = torch.ones(num, start + num, dtype=torch.bool, device=self.device).tril(start)  # causal
        hidden = self.drafter.project_aux(aux.to(self.device, self.drafter.fc.weight.dtype))  # [q, H]
        tokens = torch.tensor(list(next_tokens), device=self.device)
        out = self._run(hidden, tokens, torch.arange(start, start + num, device=self.device), visible)
        self.num_committed = start + num
        return out

    def draft(self, hidden: Tensor, tokens: Tensor, position: int, ancestors: Tensor) -> tuple[Tensor, Tensor]:
        """Run draft nodes at one depth: hidden [q, H] = their parents' outputs, tokens [q] target ids.

        ``ancestors`` bool [q, D + q] says which of the round's draft entries (D earlier ones, then these)
        each node sees: its ancestors and itself. Every committed entry is visible.
        """
        num = len(tokens)
        visible = torch.cat(
            [torch.ones(num, self.num_committed, dtype=torch.bool, device=self.device), ancestors.to(self.device)],
            dim=1,
        )
        positions = torch.full((num,), position, device=self.device)
        return self._run(hidden, tokens, positions, visible)

    def _drop_drafts(self) -> None:
        if self.keys is not None and self.values is not None and self.num_draft_entries:  # (set together)
            self.keys = self.keys[:, :, : self.num_committed]
            self.values = self.values[:, :, : self.num_committed]
