"""Static KV caches and fixed-shape forwards for the offline evaluation at batch 1 (on CUDA: CUDA graphs).

The eager runners (eagle3/evaluate/runners.py) grow their caches at every forward and launch every kernel from Python;
at batch 1 a small target is then bound by kernel launches, not by the GPU. The runners here keep fixed-size
caches and run every forward at one of a few widths (fewer rows are padded, more are cut into chunks of CHUNK
rows), so each width is one CUDA graph (eagle3/evaluate/graphs.py), replayed.

Why a static cache stays exact without clean-up:
- Every forward writes its rows at explicit cache indices and attends through an explicit mask over the whole
  cache. A row sees the committed entries, itself and the rows its caller marks (its ancestors), never anything
  past the committed length. Rejected draft rows and padding rows are therefore invisible: rolling back is
  setting the length, and later forwards overwrite those entries before anyone may see them.
- After a tree verify the accepted rows are moved down to consecutive indices (``keep``), which is what the
  dynamic cache's index_select does.
- The target's cache is transformers' StaticCache; only the write position is ours (PositionedStaticCache).
  transformers passes a prepared 4D float mask through unchanged, so the model attends exactly as told.

Bit-exact verification in any dtype (``decode_rows``): a verify row and the single-token forward that plain
greedy runs at the same place compute the same function, but a matrix product of 4 rows and one of 1 row are
different kernels that round differently, which in bf16 is enough to flip a near-tied argmax now and then.
With ``decode_rows`` set, every target forward that is not a long input's chunk (greedy tokens and verifies
alike) runs at that one width, so each row goes through the very same kernels whatever its neighbours are, and
a chain's or n-gram's output is greedy's bit for bit (padding rows only see themselves). A tree verify still
differs: its accepted rows sit at non-consecutive cache indices while verified, so their attention sums the
same keys in another order than greedy's forwards (in bf16 a tree's output can part from greedy at a near-tie),
unless ``gathered_keys`` gives every decode row its keys in sequence order (eagle3/evaluate/gathered.py).

Host reads: the runners never read device values themselves; the decode loops do (one read per verify round,
one per few greedy tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from eagle3.drafter.model import Eagle3Drafter, attention_inputs, rope_cos_sin, step_outputs, upcast
from eagle3.evaluate.gathered import key_order, use_gathered_attention
from eagle3.evaluate.graphs import CompiledStep, CompileSettings, eager_graph_settings
from eagle3.evaluate.runners import REFERENCE_TOPK, DrafterRunner, StepOut, TargetRunner, as_token_tensor

CHUNK = 64
"""Rows per forward of a long input (a prompt): longer inputs run in chunks, the last one padded."""
WIDTHS = (1, 4, 8, CHUNK)
"""The forward widths: a greedy token, chain/n-gram verifies and draft levels, deeper verifies, chunks (the
drafter's draft levels always; the target and the drafter's extends unless they run at one ``decode_rows`` width)."""
CAPACITY_STEP = 256
"""Cache lengths are multiples of this; a longer sequence reallocates (and captures or recompiles) once."""


def bucket(num: int, widths: Sequence[int] | None = None) -> int:
    """The width a forward of ``num`` (1 <= num <= CHUNK) rows runs at: the smallest of ``widths`` (default WIDTHS)
    that holds it."""
    if not 1 <= num <= CHUNK:
        raise ValueError(f"a fixed-width forward takes 1..{CHUNK} rows, got {num}")
    return next(w for w in (widths or WIDTHS) if w >= num)


def decode_widths(decode_rows: int | None) -> tuple[int, ...]:
    """Decode forward widths (target, drafter extends): WIDTHS, or ``decode_rows`` up to it and CHUNK for chunks."""
    if decode_rows is None:
        return WIDTHS
    if not 1 <= decode_rows <= CHUNK:
        raise ValueError(f"decode_rows must be 1..{CHUNK}, got {decode_rows}")
    return (decode_rows, CHUNK) if decode_rows < CHUNK else (CHUNK,)


def _pad_rows(x: Tensor, width: int) -> Tensor:
    """x [n, ...] -> [width, ...] with zero rows appended."""
    return x if len(x) == width else torch.cat([x, x.new_zeros((width - len(x), *x.shape[1:]))])


def _round_up(n: int) -> int:
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def _kv(layer: StaticLayer) -> tuple[Tensor, Tensor]:
    """An allocated layer's keys and values [1, nKV, L, hd] (transformers types both as optional)."""
    assert layer.keys is not None and layer.values is not None, "the layer is allocated"
    return layer.keys, layer.values


# ---------------------------------------------------------------------------------------------- the target

class PositionedStaticCache(StaticCache):
    """transformers' StaticCache writing each forward's rows at ``write_index`` (long [q], set before the forward)
    rather than appending at the layer's running length, so a verify can overwrite rejected rows in place."""

    layers: list[StaticLayer]  # type: ignore[assignment]  # narrower than Cache's: __init__ refuses other layers

    def __init__(self, config: Any, max_cache_len: int) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        other = sorted({type(layer).__name__ for layer in self.layers if type(layer) is not StaticLayer})
        if other:
            raise ValueError(f"the static decode cache needs full-attention layers only; this target has {other}")
        self.write_index: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write key/value states [1, nKV, q, hd] at write_index of layer ``layer_idx``; return the whole layer."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:  # allocates [1, nKV, max_cache_len, hd] (static address, outside compile)
            layer.lazy_initialization(key_states, value_states)
        assert self.write_index is not None, "set before the forward"
        keys, values = _kv(layer)
        keys.index_copy_(2, self.write_index, key_states)
        values.index_copy_(2, self.write_index, value_states)
        return keys, values


class StaticTargetRunner(TargetRunner):
    """TargetRunner over a PositionedStaticCache: the same step/keep/length contract, fixed-width forwards.

    The cache is allocated once and grows (copying its contents, capturing the graphs again) when a sequence
    needs more room; ``reset`` only sets the length to 0. The first forward runs eagerly: it allocates the cache
    outside torch.compile and the graphs, so the cache keeps a static address. ``decode_rows``: see the module.
    """

    cache: PositionedStaticCache
    _key_index: Tensor  # [L] 0..capacity-1

    def __init__(self, model: Any, aux_layer_ids: Sequence[int], capacity: int = 1024,
                 compile_settings: CompileSettings = CompileSettings(), decode_rows: int | None = None,
                 gathered_keys: bool = False) -> None:
        self._length = 0
        super().__init__(model, aux_layer_ids)  # hooks, device; calls reset()
        self._dtype = model.get_input_embeddings().weight.dtype
        self._rows = torch.arange(CHUNK, device=self.device)  # [CHUNK]
        self.widths = decode_widths(decode_rows)
        self.gathered_keys = gathered_keys
        if gathered_keys:  # eagle3/evaluate/gathered.py: trees equal greedy bit for bit at one decode width
            if decode_rows is None:
                raise ValueError("gathered decode keys need decode_rows (one width for greedy and verifies)")
            use_gathered_attention(model)
        self.cache = self._key_index = None  # type: ignore[assignment]  # both set by _allocate below
        decode = self._forward_gathered if gathered_keys else self._forward_rows
        self.step_fn = CompiledStep(decode, compile_settings, self.device, "target forward")
        self.chunk_fn = CompiledStep(self._forward_rows, eager_graph_settings(compile_settings), self.device,
                                     "target chunk forward")
        # Its warm-up moves the destinations onto themselves: moving the real rows again would read sources
        # that the first move overwrote. A copy, not the same tensor twice: Dynamo guards on which arguments
        # alias, so aliased warm-up arguments made the capture call compile again, inside the CUDA graph capture.
        # With graphs, a graph of the eager copies: Inductor took 11.6 s to compile this move on an H200, for a
        # call that copies a few rows per layer and runs only after a tree accepts a branch behind a sibling.
        self.move_fn = CompiledStep(self._move_rows, eager_graph_settings(compile_settings), self.device,
                                    "target cache row move", warmup_args=lambda args: (args[1].clone(), args[1]))
        self._allocate(_round_up(capacity))

    def compiled_steps(self) -> list[CompiledStep]:
        return [self.step_fn, self.chunk_fn, self.move_fn]

    def reset(self) -> None:
        """An empty cache (its memory is kept)."""
        self._length = 0

    @property
    def length(self) -> int:
        """Committed entries (the host's count; the cache beyond it holds stale rows nobody sees)."""
        return self._length

    def _allocate(self, capacity: int) -> None:
        old = self.cache
        self.cache = PositionedStaticCache(self.model.config, capacity)
        if old is not None and old.layers[0].is_initialized:
            for new, previous in zip(self.cache.layers, old.layers):
                old_keys, old_values = _kv(previous)
                new.lazy_initialization(old_keys, old_values)
                keys, values = _kv(new)
                keys[:, :, : old_keys.shape[2]] = old_keys
                values[:, :, : old_values.shape[2]] = old_values
        self.capacity = capacity
        self._key_index = torch.arange(capacity, device=self.device)  # [L]
        for step in (self.step_fn, self.chunk_fn, self.move_fn):  # graphs read the old cache: capture again
            step.clear()

    def _reserve(self, end: int) -> None:
        if end > self.capacity:
            self._allocate(_round_up(max(end, 2 * self.capacity)))

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError("StaticTargetRunner runs through step(); forward is the eager runner's API")

    def _forward_rows(self, ids: Tensor, positions: Tensor, write_index: Tensor,
                      visible: Tensor, **attention: Tensor) -> tuple[Tensor, ...]:
        """ids, positions, write_index long [w]; visible bool [w, L] -> greedy [w], top values, top ids [w, K],
        aux [w, A*H], logits [w, V] fp32. The function torch.compile sees: fixed shapes per width, no host reads."""
        self.cache.write_index = write_index
        mask = torch.zeros(visible.shape, dtype=self._dtype, device=visible.device)
        mask = mask.masked_fill(~visible, torch.finfo(self._dtype).min)[None, None]  # [1, 1, w, L], 0 = attend
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, use_cache=True,
                         **{self._cache_arg: self.cache}, **attention)
        logits = out.logits[0].float()  # [w, V]
        top = logits.topk(REFERENCE_TOPK)
        aux = torch.cat([self._outputs[j][0] for j in self.aux_layer_ids], dim=-1)  # [w, A*H]
        return logits.argmax(-1), top.values, top.indices, aux, logits  # logits: for sampling (an output buffer)

    def _forward_gathered(self, ids: Tensor, positions: Tensor, write_index: Tensor, valid: Tensor,
                          order: Tensor) -> tuple[Tensor, ...]:
        """_forward_rows with each row's keys gathered in sequence order: ``order`` long [w, L] (cache index of
        each row's j-th key), ``valid`` bool [w, L] over that order (eagle3/evaluate/gathered.py)."""
        return self._forward_rows(ids, positions, write_index, valid, key_order=order)

    @torch.no_grad()
    def step(self, tokens: Sequence[int] | Tensor, positions: Sequence[int] | None = None,
             visible: Tensor | None = None, last_only: bool = False, with_aux: bool = True,
             with_logits: bool = False) -> StepOut:
        """Run tokens after the committed entries (TargetRunner.step's contract); they become committed
        (``keep`` rolls back). positions default to the cache indices; ``visible`` bool [q, q] is a tree mask."""
        ids = as_token_tensor(tokens, self.device)
        num, start = len(ids), self._length
        if visible is not None and num > CHUNK:
            raise ValueError(f"a tree verify takes at most {CHUNK} rows, got {num}")
        given = None if positions is None else torch.tensor(list(positions), device=self.device)
        parts = []
        for first in range(0, num, CHUNK):
            n = min(CHUNK, num - first)
            width, at = bucket(n, self.widths), start + first
            self._reserve(at + width)
            write = self._rows[:width] + at  # [w] cache indices (padding rows continue past the real ones)
            pos = write if given is None else torch.cat([given[first:first + n], write[n:]])
            parts.append(self._run(_pad_rows(ids[first:first + n], width), pos, write, at, n, visible))
        self._length = start + num
        # logits [q, V] are joined only when asked for (a long prompt's would be large), and then for the last row only
        logits = (None if not with_logits else parts[-1][4][-1:] if last_only
                  else torch.cat([part[4] for part in parts]))
        greedy, values, top_ids, aux = (parts[0][:4] if len(parts) == 1
                                        else (torch.cat(p) for p in zip(*(part[:4] for part in parts))))
        if last_only:
            greedy, values, top_ids = greedy[-1:], values[-1:], top_ids[-1:]
        return StepOut(greedy, values, top_ids, aux if with_aux else None, logits)

    def _visible(self, at: int, width: int, num: int, tree: Tensor | None) -> Tensor:
        """bool [w, L]: causal over cache indices, or the prefix plus the tree block (padding rows see themselves)."""
        write = self._rows[:width] + at
        if tree is None:
            return self._key_index[None, :] <= write[:, None]
        block = torch.eye(width, dtype=torch.bool)
        block[:num, :num] = tree
        visible = (self._key_index < at)[None, :].repeat(width, 1)  # [w, L]
        visible[:, at:at + width] = block.to(self.device)
        return visible

    def _run(self, ids: Tensor, positions: Tensor, write: Tensor, at: int, num: int,
             tree: Tensor | None) -> tuple[Tensor, ...]:
        chunk = len(ids) == CHUNK != self.widths[0]  # a prompt's chunk, not a decode forward
        fn: Callable[..., tuple[Tensor, ...]]
        masks: tuple[Tensor, ...]
        if self.gathered_keys and not chunk:
            fn, masks = self._forward_gathered, key_order(self._key_index, write, at, num, tree)[::-1]
        else:
            fn, masks = self._forward_rows, (self._visible(at, len(ids), num, tree),)
        if not self.cache.layers[0].is_initialized:  # the first forward allocates the cache: never compiled
            step: Callable[..., tuple[Tensor, ...]] = fn
        else:
            step = self.chunk_fn if chunk else self.step_fn
        out = step(ids, positions, write, *masks)
        return tuple(t[:num] for t in out)

    def warm_up_widths(self) -> None:
        """One forward and one row move at every width (compiling or capturing each), then an empty cache.

        The move too, at the decode widths: a tree's first non-consecutive accept would otherwise compile it
        inside a timed decode (on an H200 with compile on, the first prompt's tree decode took 12.1 s against a
        0.54 s median, and the move was the one step of a tree round the warm-up had not run). Moving rows onto
        themselves leaves the cache as it was. Not at the chunk width, which only an accepted branch of more
        rows than the widest decode width would need."""
        for width in self.widths:
            self.reset()
            self.step(torch.zeros(width, dtype=torch.long, device=self.device))
            if width != CHUNK or len(self.widths) == 1:
                rows = self._rows[:width]
                self.move_fn(rows, rows)
        self.reset()

    @torch.no_grad()
    def keep(self, prefix: int, rows: Sequence[int]) -> None:
        """Keep entries [0, prefix) then ``rows`` (absolute, ascending), moved down to follow the prefix."""
        rows = list(rows)
        target = list(range(prefix, prefix + len(rows)))
        if rows != target:  # a tree's accepted branch: copy its rows down (a chain's are in place already)
            # One fixed-width call (a graph) instead of 4 kernels per layer: padding pairs move stale rows past
            # the kept ones onto themselves (inside the verify's own rows, so inside the cache).
            pad = list(range(prefix + len(rows), prefix + bucket(len(rows), self.widths)))
            self.move_fn(torch.tensor(rows + pad, device=self.device), torch.tensor(target + pad, device=self.device))
        self._length = prefix + len(rows)

    def _move_rows(self, src: Tensor, dst: Tensor) -> tuple[Tensor, ...]:
        """Every layer's entries at ``src`` [w] copied to ``dst`` [w] (read first, so they may overlap)."""
        for layer in self.cache.layers:
            keys, values = _kv(layer)
            keys.index_copy_(2, dst, keys.index_select(2, src))
            values.index_copy_(2, dst, values.index_select(2, src))
        return ()


# --------------------------------------------------------------------------------------------- the drafter

class StaticDrafterRunner(DrafterRunner):
    """DrafterRunner with a fixed-size key/value cache: committed entries, then the round's draft entries.

    Same extend/draft contract; a draft level of q nodes writes q entries after the previous levels' ones,
    and ``extend`` starts again right after the committed entries (dropping the drafts is setting a count).
    """

    keys: Tensor  # [1, nKV, L, hd] post-RoPE, allocated by _allocate (fixed size, written in place)
    values: Tensor  # [1, nKV, L, hd]

    def __init__(self, drafter: Eagle3Drafter, d2t: Tensor, capacity: int = 1024,
                 compile_settings: CompileSettings = CompileSettings(), decode_rows: int | None = None) -> None:
        super().__init__(drafter, d2t)
        self._num_entries = 0  # committed + the current round's draft entries
        self._rows = torch.arange(CHUNK, device=self.device)
        # Extends (a verify's accepted rows) at the target's one decode width: one compile instead of one per
        # width (Inductor spends seconds on each); a drafter row's rounding never touches losslessness.
        self.widths = decode_widths(decode_rows)
        self.capacity = 0
        if compile_settings.enabled:  # weights are read through a tuple: tell dynamo they never move
            for t in (*self.weights, self.inv_freq):
                torch._dynamo.mark_static_address(t)
        self.step_fn = CompiledStep(self._rows_step, compile_settings, self.device, "drafter forward")
        self.chunk_fn = CompiledStep(self._rows_step, eager_graph_settings(compile_settings), self.device,
                                     "drafter chunk forward")  # every forward of CHUNK rows
        self._settings = compile_settings
        self._rounds: dict[tuple, CompiledStep] = {}  # ("chain", steps) | ("tree", steps, topk, size) -> its round
        self._allocate(_round_up(capacity))

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
            self._allocate(_round_up(max(end, 2 * self.capacity)))

    def reset(self) -> None:
        """An empty cache (its memory is kept)."""
        self.num_committed = self._num_entries = 0

    @property
    def num_draft_entries(self) -> int:
        """Entries of the current round's draft nodes."""
        return self._num_entries - self.num_committed

    def _rows_step(self, hidden: Tensor, tokens: Tensor, positions: Tensor, write_index: Tensor,
                   visible: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [w, H], tokens/positions/write_index [w], visible bool [w, L] -> (out [w, H], logits [w, Vd])."""
        dims = self.drafter.dims
        cos, sin = rope_cos_sin(self.inv_freq, positions[None], upcast(hidden).dtype)  # [1, 1, w, hd]
        q, k, v = attention_inputs(self.weights, tokens[None], hidden[None], cos, sin, dims.rms_norm_eps,
                                   dims.num_attention_heads, dims.num_key_value_heads)  # [1, nH|nKV, w, hd]
        self.keys.index_copy_(2, write_index, k)
        self.values.index_copy_(2, write_index, v)
        attn = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=visible[None, None],
                                              enable_gqa=True)  # [1, nH, w, hd]
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
                write = committed + (j - 1)  # [1]
                visible = (self._key_index <= write)[None, :]  # [1, L]
                hidden, rows = self._rows_step(hidden, token, committed - 1 + j, write, visible)  # [1, H], [1, Vd]
                logits = rows[0]
        return (torch.cat(tokens),)

    @torch.no_grad()
    def chain(self, hidden: Tensor, logits: Tensor, steps: int) -> Tensor:
        """A whole chain round in one call (one CUDA graph when compiled): the ``steps`` draft tokens below the root
        (out [1, H], logits [Vd] at the last committed index), as ``steps - 1`` calls of ``draft`` would give them."""
        (tokens,) = self._round(("chain", steps), steps - 1, 1,
                                lambda h, lg, c: self._chain_rows(h, lg, c, steps), hidden, logits)
        return tokens

    @torch.no_grad()
    def tree(self, hidden: Tensor, logits: Tensor, steps: int, topk: int, size: int) -> tuple[Tensor, Tensor]:
        """A whole tree round in one call (eagle3/evaluate/tree_draft.py): (tokens [size], parents [size]) of the
        ``size`` best nodes, as EagleProposer's host-built tree would give them."""
        from eagle3.evaluate.tree_draft import tree_rows

        width = bucket(topk)
        tokens, parents = self._round(("tree", steps, topk, size), (steps - 1) * topk, width,
                                      lambda h, lg, c: tree_rows(self, h, lg, c, steps, topk, size, width), hidden,
                                      logits)
        return tokens, parents

    def _round(self, key: tuple, num_drafts: int, width: int, fn: Callable[..., tuple[Tensor, ...]],
               hidden: Tensor, logits: Tensor) -> tuple[Tensor, ...]:
        """Run a whole draft round ``fn(hidden, logits, committed)`` (compiled once per ``key``), which writes
        ``num_drafts`` draft entries after the committed ones (its last forward ``width`` rows wide)."""
        self._reserve(self.num_committed + num_drafts + width)
        if key not in self._rounds:
            self._rounds[key] = CompiledStep(fn, self._settings, self.device, f"{key[0]} draft round {key[1:]}")
        committed = self._key_index[self.num_committed:self.num_committed + 1]  # [1] on the device: no copy
        out = self._rounds[key](hidden, logits, committed)
        self._num_entries = self.num_committed + num_drafts
        return out

    def _call(self, hidden: Tensor, tokens: Tensor, positions: Tensor, at: int, num: int,
              visible: Tensor) -> tuple[Tensor, Tensor]:
        width = len(positions)
        write = self._rows[:width] + at
        step = self.chunk_fn if width == CHUNK else self.step_fn
        out, logits = step(_pad_rows(hidden, width), _pad_rows(tokens, width), positions, write, visible)
        return out[:num], logits[:num]

    @torch.no_grad()
    def extend(self, aux: Tensor, next_tokens: Sequence[int] | Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Commit indices start..start+q-1 (DrafterRunner.extend's contract); the round's drafts are dropped."""
        if start != self.num_committed:
            raise ValueError(f"drafter cache holds {self.num_committed} committed entries, asked to extend at {start}")
        tokens = as_token_tensor(next_tokens, self.device)
        hidden = self.drafter.project_aux(aux.to(self.device, self.drafter.fc.weight.dtype))  # [q, H]
        outs = []
        for first in range(0, len(tokens), CHUNK):
            n = min(CHUNK, len(tokens) - first)
            width, at = bucket(n, self.widths), start + first
            self._reserve(at + width)
            write = self._rows[:width] + at  # positions = indices; padding rows continue
            visible = self._key_index[None, :] <= write[:, None]  # causal [w, L]
            outs.append(self._call(hidden[first:first + n], tokens[first:first + n], write, at, n, visible))
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
        visible[:num, committed:at + num] = ancestors.to(self.device)
        visible[:, at:at + width] |= torch.eye(width, dtype=torch.bool, device=self.device)  # padding: itself
        positions = torch.full((width,), position, device=self.device)
        out = self._call(hidden, as_token_tensor(tokens, self.device), positions, at, num, visible)
        self._num_entries = at + num
        return out


# ------------------------------------------------------------------------------------------------- factory

def make_runners(model: Any, aux_layer_ids: Sequence[int], drafter: Eagle3Drafter | None, d2t: Tensor | None,
                 static: bool, compile_settings: CompileSettings, capacity: int = 1024,
                 decode_rows: int | None = None,
                 gathered_keys: bool = False) -> tuple[TargetRunner, DrafterRunner | None]:
    """The target runner and one drafter runner (None without a drafter), static or eager."""
    if drafter is not None and d2t is None:
        raise ValueError("a drafter runs with its d2t map (draft-to-target id offsets)")
    if not static:
        if compile_settings.enabled:
            raise ValueError("compiled decoding needs the static cache")
        eager = TargetRunner(model, aux_layer_ids)
        return eager, None if drafter is None or d2t is None else DrafterRunner(drafter, d2t)
    target = StaticTargetRunner(model, aux_layer_ids, capacity, compile_settings, decode_rows, gathered_keys)
    runner = (None if drafter is None or d2t is None
              else StaticDrafterRunner(drafter, d2t, capacity, compile_settings, decode_rows))
    return target, runner
