"""DFlash drafting in the offline evaluation: one block per round, from the target's states of the committed tokens.

The proposer keeps, for every draft layer, the keys and values of each committed token's context hidden, which is
what SGLang's draft KV cache holds (DFlashWorkerV2._append_target_hidden_sequential; eagle3.drafter.dflash's
context_kv). ``observe`` appends the target's states of the tokens a verify forward committed (the root and the
accepted drafts; after the prefill, the prompt's), and ``propose`` runs ONE block forward: [last committed token,
mask x (K-1)] at positions m .. m+K-1 over every committed entry and the block itself, no causal mask, and drafts
the argmax of the target's lm_head at slots 1 .. K-1 as a chain. eagle3.evaluate.speculate verifies that chain as
any other: the longest prefix equal to the target's greedy tokens is accepted, plus the target's bonus token
(SGLang's compute_dflash_correct_drafts_and_bonus does the same), so greedy decoding stays token-identical to plain
greedy decoding whatever the drafter proposes; the drafter only decides how many tokens a round commits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.dflash import DFlashDrafter, block_forward, context_kv, dflash_weights, project_context
from eagle3.drafter.dflash_blocks import block_input_ids, block_positions
from eagle3.evaluate.speculate import DraftTree


class DFlashProposer:
    """Drafts a block of K-1 tokens per round (module docstring) with a drafter's cached context keys/values."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter.eval()
        self.dims = drafter.dims
        self.weights = dflash_weights(self.drafter)
        self.device = drafter.fc.weight.device
        self.kv: list[tuple[Tensor, Tensor]] | None = None  # per layer: keys, values [1, nKV, C, hd]
        self.num_committed = 0

    def compiled_steps(self) -> list[Any]:
        """The CompiledStep functions it runs (none: the block forward is eager)."""
        return []

    def reset(self) -> None:
        """Forget the previous prompt."""
        self.kv = None
        self.num_committed = 0

    @torch.no_grad()
    def observe(self, aux: Tensor, next_tokens: list[int], start: int) -> None:
        """Commit the target's states aux [q, F*H] of indices start .. start+q-1 (the tokens that follow them are
        not needed: a block reads states only, its anchor brings the token)."""
        if start != self.num_committed:
            raise RuntimeError(f"DFlash context holds {self.num_committed} committed tokens, asked to add at {start}")
        num = aux.shape[0]
        features = aux[None].to(self.device, self.weights.fc.dtype)  # [1, q, F*H]
        context = project_context(self.weights, features, self.dims.rms_norm_eps)  # [1, q, H]
        positions = torch.arange(start, start + num, device=self.device)[None]  # [1, q]
        new = context_kv(self.weights, context, positions, self.dims)  # L x ([1, nKV, q, hd] x 2)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.num_committed = start + num

    @torch.no_grad()
    def propose(self, context: list[int]) -> DraftTree:
        """K-1 drafts after the last token of ``context``, whose earlier tokens are all committed (observed)."""
        if self.kv is None or len(context) - 1 != self.num_committed:
            raise RuntimeError(
                f"DFlash propose with {len(context) - 1} tokens before the anchor, {self.num_committed} observed"
            )
        block = self.dims.block_size
        anchor = torch.tensor([[context[-1]]], device=self.device)  # [1, 1]
        ids = block_input_ids(anchor, block, self.dims.mask_token_id)  # [1, K]
        positions = block_positions(torch.tensor([[self.num_committed]], device=self.device), block)  # [1, K]
        embeds = F.embedding(ids, self.drafter.embed_tokens.weight)  # [1, K, H]
        hidden = block_forward(self.weights, self.kv, embeds, positions, None, self.dims)  # every key visible
        drafts = self.drafter.logits(hidden[:, 1:]).argmax(dim=-1)[0]  # [K-1]
        return DraftTree.chain(drafts.tolist())
