"""DFlash drafting with a fixed-size draft KV cache, so a round is one fixed-shape call (compiled, a CUDA graph).

``DFlashProposer`` grows its per-layer context keys and values with a concatenation every round and runs the block
over exactly the committed entries: every round has new shapes, so it runs eagerly. Here each layer's keys and
values live in tensors of ``capacity`` entries (allocated once, doubled when a prompt outgrows them, as
eagle3.evaluate.static_drafter does), ``observe`` writes the new entries in place, and ``propose`` runs the block
over the whole capacity with ``block_visibility`` hiding every entry at or after the committed count: a call whose
shapes never change, which eagle3.evaluate.graphs.CompiledStep compiles and captures. The drafts are the same
function of the committed context as the growing cache's (hidden entries get softmax weight 0); they can differ
only where rounding in a different summation order turns a near-tie, which changes acceptance, never the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle3.drafter.dflash import DFlashDrafter, block_forward, context_kv, project_context
from eagle3.drafter.dflash_blocks import block_input_ids, block_positions, block_visibility
from eagle3.evaluate.decode_cache import round_up
from eagle3.evaluate.dflash_decode import DFlashProposer
from eagle3.evaluate.graphs import CompiledStep, CompileSettings
from eagle3.evaluate.speculate import DraftTree


class StaticDFlashProposer(DFlashProposer):
    """DFlashProposer over a fixed-size context cache: one fixed-shape block call per round (module docstring)."""

    def __init__(self, drafter: DFlashDrafter, capacity: int = 1024, settings: CompileSettings = CompileSettings()):
        super().__init__(drafter)
        self.capacity = 0
        self.keys: list[Tensor] = []  # per layer [1, nKV, capacity, hd], post-RoPE
        self.values: list[Tensor] = []
        self._settings = settings
        if settings.enabled:  # weights are read through tuples: tell dynamo they never move
            for t in self._weight_tensors():
                torch._dynamo.mark_static_address(t)
        self.step = CompiledStep(self._block_step, settings, self.device, "DFlash block")
        self._anchor = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._committed = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._allocate(round_up(capacity))

    def _weight_tensors(self) -> list[Tensor]:
        w = self.weights
        return [
            w.fc,
            w.hidden_norm,
            w.norm,
            *(t for layer in w.layers for t in layer),
            self.drafter.lm_head.weight,
            self.drafter.embed_tokens.weight,
        ]

    def compiled_steps(self) -> list[CompiledStep]:
        return [self.step]

    def _allocate(self, capacity: int) -> None:
        d = self.dims
        shape = (1, d.num_key_value_heads, capacity, d.head_dim)
        keys, values = [], []
        for i in range(d.num_hidden_layers):
            k = torch.zeros(shape, dtype=self.weights.fc.dtype, device=self.device)
            v = torch.zeros_like(k)
            if self.capacity:
                k[:, :, : self.capacity], v[:, :, : self.capacity] = self.keys[i], self.values[i]
            torch._dynamo.mark_static_address(k)  # written in place between calls: keep one address
            torch._dynamo.mark_static_address(v)
            keys.append(k)
            values.append(v)
        self.keys, self.values, self.capacity = keys, values, capacity
        self.step.clear()  # graphs read the old tensors: capture again

    def reset(self) -> None:
        """Forget the previous prompt (its entries stay, hidden by the committed count)."""
        self.num_committed = 0
        self.kv = None

    @torch.no_grad()
    def observe(self, aux: Tensor, next_tokens: list[int], start: int) -> None:
        """As DFlashProposer.observe, the entries written in place at start .. start+q-1."""
        if start != self.num_committed:
            raise RuntimeError(f"DFlash context holds {self.num_committed} committed tokens, asked to add at {start}")
        num = aux.shape[0]
        # +1: the block's anchor sits at position num_committed, inside the positions the cache covers
        if start + num + 1 > self.capacity:
            self._allocate(round_up(max(start + num + 1, 2 * self.capacity)))
        features = aux[None].to(self.device, self.weights.fc.dtype)  # [1, q, F*H]
        context = project_context(self.weights, features, self.dims.rms_norm_eps)  # [1, q, H]
        positions = torch.arange(start, start + num, device=self.device)
        for (k, v), keys, values in zip(
            context_kv(self.weights, context, positions[None], self.dims), self.keys, self.values, strict=True
        ):
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)
        self.num_committed = start + num
        self.kv = list(zip(self.keys, self.values, strict=True))  # DFlashProposer's "observed" marker

    def _block_step(self, anchor: Tensor, committed: Tensor) -> tuple[Tensor]:
        """anchor [1, 1] token, committed [1, 1] entries -> drafts [K-1] (target ids), over the whole cache."""
        d = self.dims
        ids = block_input_ids(anchor, d.block_size, d.mask_token_id)  # [1, K]
        positions = block_positions(committed, d.block_size)  # [1, K]
        visible = block_visibility(committed, self.capacity, d.block_size)  # [1, 1, K, capacity + K]
        embeds = self.drafter.embed_tokens.weight[ids]  # [1, K, H]
        ctx = list(zip(self.keys, self.values, strict=True))
        hidden = block_forward(self.weights, ctx, embeds, positions, visible, d)  # [1, K, H]
        return (self.drafter.logits(hidden[:, 1:]).argmax(dim=-1)[0],)

    @torch.no_grad()
    def propose(self, context: list[int]) -> DraftTree:
        """K-1 drafts after the last token of ``context``, whose earlier tokens are all committed (observed)."""
        if not self.kv or len(context) - 1 != self.num_committed:
            raise RuntimeError(
                f"DFlash propose with {len(context) - 1} tokens before the anchor, {self.num_committed} observed"
            )
        self._anchor.fill_(context[-1])
        self._committed.fill_(self.num_committed)
        (drafts,) = self.step(self._anchor, self._committed)
        return DraftTree.chain(drafts.tolist())
