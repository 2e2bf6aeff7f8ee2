"""The drafter's static decode cache: a DrafterRunner with fixed-size key/value tensors and fixed-width forwards,
whose chain and tree rounds run as one call each (the rules that keep it exact: eagle3/evaluate/decode_cache.py).

CHUNK is read through its module (``decode_cache.CHUNK``), so one setting governs every static runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import attention_inputs, rope_cos_sin, step_outputs, upcast
from eagle3.drafter.model import Eagle3Drafter
from eagle3.evaluate import decode_cache
from eagle3.evaluate.decode_cache import bucket, decode_widths, pad_rows, round_up
from eagle3.evaluate.graphs import CompiledStep, CompileSettings, eager_graph_settings
from eagle3.evaluate.runners import DrafterRunner, as_token_tensor
from eagle3.evaluate.sampling import SamplingParams, draw, probabilities


class StaticDrafterRunner(DrafterRunner):
    """DrafterRunner with a fixed-size key/value cache: committed entries, then the round's draft entries.

    Same extend/draft contract; a draft level of q nodes writes q entries after the previous levels' ones,
    and ``extend`` starts again right after the committed entries (dropping the drafts is setting a count).
    """

    keys: Tensor  # [1, nKV, L, hd] post-RoPE, allocated by _allocate (fixed size, written in place)
    values: Tensor  # [1, nKV, L, hd]

    def __init__(
        self,
        drafter: Eagle3Drafter,
        d2t: Tensor,
        capacity: int = 1024,
        compile_settings: CompileSettings = CompileSettings(),
        decode_rows: int | None = None,
    ) -> None:
        super().__init__(drafter, d2t)
        self._num_entries = 0  # committed + the current round's draft entries
        self._rows = torch.arange(decode_cache.CHUNK, device=self.device)
        # Extends (a verify's accepted rows) at the target's one decode width: one compile instead of one per
        # width (Inductor spends seconds on each); a drafter row's rounding never touches losslessness.
        self.widths = decode_widths(decode_rows)
        self.capacity = 0
        if compile_settings.enabled:  # weights are read through a tuple: tell dynamo they never move
            for t in (*self.weights, self.inv_freq):
                torch._dynamo.mark_static_address(t)
        self.step_fn = CompiledStep(self._rows_step, compile_settings, self.device, "drafter forward")
        self.chunk_fn = CompiledStep(
            self._rows_step, eager_graph_settings(compile_settings), self.device, "drafter chunk forward"
        )  # every forward of decode_cache.CHUNK rows
        self._settings = compile_settings
        # ("chain", steps) | ("sampled chain", steps, params) | ("tree", steps, topk, size) -> its round
        self._rounds: dict[tuple, CompiledStep] = {}
        self._draft_targets = self.to_target_ids(torch.arange(len(self.d2t), device=self.device))  # [Vd] target ids
        self._allocate(round_up(capacity))

    def compiled_steps(self) -> list[CompiledStep]:
        return [self.step_fn, self.chunk_fn, *self._rounds.values()]

    def _allocate(self, capacity: int) -> None:
        dims = self.drafter.dims
        shape = (1, dims.num_key_value_heads, capacity, dims.head_dim)
        keys = torch.zeros(shape, dtype=self.weights.k.dtype, device=self.device)  # [1, nKV, L, hd] post-RoPE
        values = torch.zeros_like(keys)
        if self.capacity:
            keys[:, :, : self.capacity], values[:, :, : self.capacity] = self.keys, self.values
        torch._dynamo.mark_static_address(keys)  # written in place by the compiled step: keep one address
        torch._dynamo.mark_static_address(values)
        self.keys, self.values, self.capacity = keys, values, capacity
        self._key_index = torch.arange(capacity, device=self.device)
        for step in (self.step_fn, self.chunk_fn, *self._rounds.values()):  # graphs read the old caches: capture again
            step.clear()

    def _reserve(self, end: int) -> None:
        if end > self.capacity:
            self._allocate(round_up(max(end, 2 * self.capacity)))

    def reset(self) -> None:
        """An empty cache (its memory is kept)."""
        self.num_committed = self._num_entries = 0

    @property
    def num_draft_entries(self) -> int:
        """Entries of the current round's draft nodes."""
        return self._num_entries - self.num_committed

    def _rows_step(
        self, hidden: Tensor, tokens: Tensor, positions: Tensor, write_index: Tensor, visible: Tensor
    ) -> tuple[Tensor, Tensor]:
        """hidden [w, H], tokens/positions/write_index [w], visible bool [w, L] -> (out [w, H], logits [w, Vd])."""
        dims = self.drafter.dims
        cos, sin = rope_cos_sin(self.inv_freq, positions[None], upcast(hidden).dtype)  # [1, 1, w, hd]
        q, k, v = attention_inputs(
            self.weights,
            tokens[None],
            hidden[None],
            cos,
            sin,
            dims.rms_norm_eps,
            dims.num_attention_heads,
            dims.num_key_value_heads,
        )  # [1, nH|nKV, w, hd]
        self.keys.index_copy_(2, write_index, k)
        self.values.index_copy_(2, write_index, v)
        attn = F.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=visible[None, None], enable_gqa=True
        )  # [1, nH, w, hd]
        out, logits = step_outputs(self.weights, hidden[None], attn, dims.rms_norm_eps)  # [1, w, H], [1, w, Vd]
        return out[0], logits[0]

    def _chain_rows(self, hidden: Tensor, logits: Tensor, committed: Tensor, steps: int) -> tuple[Tensor]:
        """The chain round on the device: hidden [1, H] and logits [Vd] of the root, committed long [1] ->
        draft tokens [steps] (target ids). Draft j >= 1 feeds step j-1's output and token at position
        committed - 1 + j, writes entry committed + j - 1 and sees every entry up to it (the committed ones and
        its chain ancestors: what ``draft`` builds from an all-True ancestor row). No host read inside."""
        tokens = []
        for j in range(1, steps + 1):
            token = self.to_target_ids(logits.argmax(-1, keepdim=True))  # [1]
            tokens.append(token)
            if j < steps:
                hidden, logits = self._chain_step(hidden, token, committed, j)
        return (torch.cat(tokens),)

    def _chain_step(self, hidden: Tensor, token: Tensor, committed: Tensor, j: int) -> tuple[Tensor, Tensor]:
        """Draft j + 1's forward in a chain round: draft j's ``token`` [1] after its out ``hidden`` [1, H], at
        position committed - 1 + j, written at entry committed + j - 1 -> (out [1, H], logits [Vd])."""
        write = committed + (j - 1)  # [1]
        visible = (self._key_index <= write)[None, :]  # [1, L]
        hidden, rows = self._rows_step(hidden, token, committed - 1 + j, write, visible)  # [1, H], [1, Vd]
        return hidden, rows[0]

    @torch.no_grad()
    def chain(self, hidden: Tensor, logits: Tensor, steps: int) -> Tensor:
        """A whole chain round in one call (one CUDA graph when compiled): the ``steps`` draft tokens below the root
        (out [1, H], logits [Vd] at the last committed index), as ``steps - 1`` calls of ``draft`` would give them."""
        (tokens,) = self._round(
            ("chain", steps), steps - 1, 1, lambda h, lg, c: self._chain_rows(h, lg, c, steps), hidden, logits
        )
        return tokens

    def _sampled_chain_rows(
        self, hidden: Tensor, logits: Tensor, committed: Tensor, uniforms: Tensor, steps: int, params: SamplingParams
    ) -> tuple[Tensor, Tensor]:
        """_chain_rows with each draft drawn from the drafter's distribution (eagle3.evaluate.sampled_decode's
        sampled_chain, here on the device): uniforms float64 [steps] -> (draft tokens [steps] target ids, the
        distribution each was drawn from over the target vocab [steps, V], 0 outside the draft vocab)."""
        tokens, rows = [], []
        for j in range(1, steps + 1):
            q_draft = probabilities(logits, params)  # [Vd] float64
            token = self.to_target_ids(draw(q_draft, uniforms[j - 1 : j]))  # [1]
            tokens.append(token)
            rows.append(q_draft)
            if j < steps:
                hidden, logits = self._chain_step(hidden, token, committed, j)
        q = torch.stack(rows)  # [steps, Vd]
        q_target = q.new_zeros(steps, self.drafter.dims.vocab_size).index_copy_(1, self._draft_targets, q)
        return torch.cat(tokens), q_target

    @torch.no_grad()
    def sampled_chain(
        self, hidden: Tensor, logits: Tensor, steps: int, params: SamplingParams, uniforms: Tensor
    ) -> tuple[Tensor, Tensor]:
        """A whole sampled chain round in one call (one CUDA graph when compiled), from the root's out [1, H] and
        logits [Vd] and ``uniforms`` float64 [steps]: (draft tokens [steps], their distributions [steps, V])."""
        tokens, q = self._round(
            ("sampled chain", steps, params),
            steps - 1,
            1,
            lambda h, lg, c, u: self._sampled_chain_rows(h, lg, c, u, steps, params),
            hidden,
            logits,
            uniforms,
        )
        return tokens, q

    @torch.no_grad()
    def tree(self, hidden: Tensor, logits: Tensor, steps: int, topk: int, size: int) -> tuple[Tensor, Tensor]:
        """A whole tree round in one call (eagle3/evaluate/tree_draft.py): (tokens [size], parents [size]) of the
        ``size`` best nodes, as EagleProposer's host-built tree would give them."""
        from eagle3.evaluate.tree_draft import tree_rows

        width = bucket(topk)
        tokens, parents = self._round(
            ("tree", steps, topk, size),
            (steps - 1) * topk,
            width,
            lambda h, lg, c: tree_rows(self, h, lg, c, steps, topk, size, width),
            hidden,
            logits,
        )
        return tokens, parents

    def _round(
        self,
        key: tuple,
        num_drafts: int,
        width: int,
        fn: Callable[..., tuple[Tensor, ...]],
        hidden: Tensor,
        logits: Tensor,
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        """Run a whole draft round ``fn(hidden, logits, committed, *inputs)`` (compiled once per ``key``), which
        writes ``num_drafts`` draft entries after the committed ones (its last forward ``width`` rows wide)."""
        self._reserve(self.num_committed + num_drafts + width)
        if key not in self._rounds:
            self._rounds[key] = CompiledStep(fn, self._settings, self.device, f"{key[0]} draft round {key[1:]}")
        committed = self._key_index[self.num_committed : self.num_committed + 1]  # [1] on the device: no copy
        out = self._rounds[key](hidden, logits, committed, *inputs)
        self._num_entries = self.num_committed + num_drafts
        return out

    def _call(
        self, hidden: Tensor, tokens: Tensor, positions: Tensor, at: int, num: int, visible: Tensor
    ) -> tuple[Tensor, Tensor]:
        width = len(positions)
        write = self._rows[:width] + at
        step = self.chunk_fn if width == decode_cache.CHUNK else self.step_fn
        out, logits = step(pad_rows(hidden, width), pad_rows(tokens, width), positions, write, visible)
        return out[:num], logits[:num]

    @torch.no_grad()
    def extend(self, aux: Tensor, next_tokens: Sequence[int] | Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Commit indices start..start+q-1 (DrafterRunner.extend's contract); the round's drafts are dropped."""
        if start != self.num_committed:
            raise ValueError(f"drafter cache holds {self.num_committed} committed entries, asked to extend at {start}")
        tokens = as_token_tensor(next_tokens, self.device)
        hidden = self.drafter.project_aux(aux.to(self.device, self.drafter.fc.weight.dtype))  # [q, H]
        outs = []
        for first in range(0, len(tokens), decode_cache.CHUNK):
            n = min(decode_cache.CHUNK, len(tokens) - first)
            width, at = bucket(n, self.widths), start + first
            self._reserve(at + width)
            write = self._rows[:width] + at  # positions = indices; padding rows continue
            visible = self._key_index[None, :] <= write[:, None]  # causal [w, L]
            outs.append(self._call(hidden[first : first + n], tokens[first : first + n], write, at, n, visible))
        self.num_committed = self._num_entries = start + len(tokens)
        return outs[0] if len(outs) == 1 else tuple(torch.cat(p) for p in zip(*outs))  # type: ignore[return-value]

    def warm_up_widths(self) -> None:
        """One forward at every width (compiling each), then an empty cache."""
        dims = self.drafter.dims
        for width in self.widths:
            self.reset()
            aux = torch.zeros(width, dims.num_aux * dims.target_hidden_size, device=self.device)
            self.extend(aux, torch.zeros(width, dtype=torch.long, device=self.device), 0)
        self.reset()

    @torch.no_grad()
    def draft(self, hidden: Tensor, tokens: Tensor, position: int, ancestors: Tensor) -> tuple[Tensor, Tensor]:
        """One draft level of q nodes (DrafterRunner.draft's contract: ancestors bool [q, D + q])."""
        num, committed, drafts = len(tokens), self.num_committed, self.num_draft_entries
        width, at = bucket(num), committed + drafts
        self._reserve(at + width)
        visible = (self._key_index < committed)[None, :].repeat(width, 1)  # [w, L]: every committed entry
        visible[:num, committed : at + num] = ancestors.to(self.device)
        visible[:, at : at + width] |= torch.eye(width, dtype=torch.bool, device=self.device)  # padding: itself
        positions = torch.full((width,), position, device=self.device)
        out = self._call(hidden, as_token_tensor(tokens, self.device), positions, at, num, visible)
        self._num_entries = at + num
        return out
