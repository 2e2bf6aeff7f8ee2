"""The target's static decode cache: transformers' StaticCache written at explicit indices, and the TargetRunner
that runs every forward at a fixed width over it (the rules that keep it exact: eagle3/evaluate/decode_cache.py).

CHUNK is read through its module (``decode_cache.CHUNK``), so one setting governs every static runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from eagle3.evaluate import decode_cache
from eagle3.evaluate.decode_cache import bucket, decode_widths, pad_rows, round_up
from eagle3.evaluate.gathered import key_order
from eagle3.evaluate.graphs import CompiledStep, CompileSettings, eager_graph_settings
from eagle3.evaluate.runners import REFERENCE_TOPK, StepOut, TargetRunner, as_token_tensor
from eagle3.evaluate.static_attention import MaskedAttention, use_static_attention


def _kv(layer: StaticLayer) -> tuple[Tensor, Tensor]:
    """An allocated layer's keys and values [1, nKV, L, hd] (transformers types both as optional)."""
    assert layer.keys is not None and layer.values is not None, "the layer is allocated"
    return layer.keys, layer.values


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

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
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

    def __init__(
        self,
        model: Any,
        aux_layer_ids: Sequence[int],
        capacity: int = 1024,
        compile_settings: CompileSettings = CompileSettings(),
        decode_rows: int | None = None,
        gathered_keys: bool = False,
        name: str = "target",
        attention: MaskedAttention = "sdpa",
    ) -> None:
        self._length = 0
        super().__init__(model, aux_layer_ids)  # hooks, device; calls reset()
        self._dtype = model.get_input_embeddings().weight.dtype
        self._rows = torch.arange(decode_cache.CHUNK, device=self.device)  # [CHUNK]
        self.widths = decode_widths(decode_rows)
        self.gathered_keys = gathered_keys
        if gathered_keys and decode_rows is None:  # eagle3/evaluate/gathered.py: trees equal greedy bit for bit
            raise ValueError("gathered decode keys need decode_rows (one width for greedy and verifies)")
        if gathered_keys and attention != "sdpa":
            raise ValueError(
                f"gathered decode keys bring their own attention: attention {attention!r} is for masked keys"
            )
        if gathered_keys or attention != "sdpa":  # runners of one model each choose per forward (static_attention)
            use_static_attention(model)
        # packed: no copy of the cache per query head (not the default: on an H100 it ran a one-row forward slower,
        # through cuDNN's attention kernel); flex: one-row forwards read only the key blocks in use
        self._attention = {} if attention == "sdpa" else {"masked_attention": attention}
        self._bool_mask = attention == "flex"  # flex_decode takes a bool mask (True = attend); sdpa takes either
        self.cache = self._key_index = None  # type: ignore[assignment]  # both set by _allocate below
        decode = self._forward_gathered if gathered_keys else self._forward_rows
        self.step_fn = CompiledStep(decode, compile_settings, self.device, f"{name} forward")
        self.chunk_fn = CompiledStep(
            self._forward_rows, eager_graph_settings(compile_settings), self.device, f"{name} chunk forward"
        )
        # Its warm-up moves the destinations onto themselves: moving the real rows again would read sources
        # that the first move overwrote. A copy, not the same tensor twice: Dynamo guards on which arguments
        # alias, so aliased warm-up arguments made the capture call compile again, inside the CUDA graph capture.
        # With graphs, a graph of the eager copies: Inductor took 11.6 s to compile this move on an H200, for a
        # call that copies a few rows per layer and runs only after a tree accepts a branch behind a sibling.
        self.move_fn = CompiledStep(
            self._move_rows,
            eager_graph_settings(compile_settings),
            self.device,
            f"{name} cache row move",
            warmup_args=lambda args: (args[1].clone(), args[1]),
        )
        self._allocate(round_up(capacity))

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
            self._allocate(round_up(max(end, 2 * self.capacity)))

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError("StaticTargetRunner runs through step(); forward is the eager runner's API")

    def _forward_rows(
        self, ids: Tensor, positions: Tensor, write_index: Tensor, visible: Tensor, **attention: Tensor
    ) -> tuple[Tensor, ...]:
        """ids, positions, write_index long [w]; visible bool [w, L] -> greedy [w], top values, top ids [w, K],
        aux [w, A*H], logits [w, V] fp32. The function torch.compile sees: fixed shapes per width, no host reads."""
        self.cache.write_index = write_index
        if self._bool_mask:
            mask = visible[None, None]  # [1, 1, w, L], True = attend
        else:
            mask = torch.zeros(visible.shape, dtype=self._dtype, device=visible.device)
            mask = mask.masked_fill(~visible, torch.finfo(self._dtype).min)[None, None]  # [1, 1, w, L], 0 = attend
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=mask,
            use_cache=True,
            **{self._cache_arg: self.cache},
            **self._attention,
            **attention,
        )
        logits = out.logits[0].float()  # [w, V]
        top = logits.topk(REFERENCE_TOPK)
        aux = torch.cat([self._outputs[j][0] for j in self.aux_layer_ids], dim=-1)  # [w, A*H]
        return logits.argmax(-1), top.values, top.indices, aux, logits  # logits: for sampling (an output buffer)

    def _forward_gathered(
        self, ids: Tensor, positions: Tensor, write_index: Tensor, valid: Tensor, order: Tensor
    ) -> tuple[Tensor, ...]:
        """_forward_rows with each row's keys gathered in sequence order: ``order`` long [w, L] (cache index of
        each row's j-th key), ``valid`` bool [w, L] over that order (eagle3/evaluate/gathered.py)."""
        return self._forward_rows(ids, positions, write_index, valid, key_order=order)

    @torch.no_grad()
    def step(
        self,
        tokens: Sequence[int] | Tensor,
        positions: Sequence[int] | None = None,
        visible: Tensor | None = None,
        last_only: bool = False,
        with_aux: bool = True,
        with_logits: bool = False,
    ) -> StepOut:
        """Run tokens after the committed entries (TargetRunner.step's contract); they become committed
        (``keep`` rolls back). positions default to the cache indices; ``visible`` bool [q, q] is a tree mask."""
        ids = as_token_tensor(tokens, self.device)
        num, start = len(ids), self._length
        if visible is not None and num > decode_cache.CHUNK:
            raise ValueError(f"a tree verify takes at most {decode_cache.CHUNK} rows, got {num}")
        given = None if positions is None else torch.tensor(list(positions), device=self.device)
        parts = []
        for first in range(0, num, decode_cache.CHUNK):
            n = min(decode_cache.CHUNK, num - first)
            width, at = bucket(n, self.widths), start + first
            self._reserve(at + width)
            write = self._rows[:width] + at  # [w] cache indices (padding rows continue past the real ones)
            pos = write if given is None else torch.cat([given[first : first + n], write[n:]])
            parts.append(self._run(pad_rows(ids[first : first + n], width), pos, write, at, n, visible))
        self._length = start + num
        # logits [q, V] are joined only when asked for (a long prompt's would be large), and then for the last row only
        logits = None if not with_logits else parts[-1][4][-1:] if last_only else torch.cat([part[4] for part in parts])
        greedy, values, top_ids, aux = (
            parts[0][:4] if len(parts) == 1 else (torch.cat(p) for p in zip(*(part[:4] for part in parts)))
        )
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
        visible[:, at : at + width] = block.to(self.device)
        return visible

    def _run(
        self, ids: Tensor, positions: Tensor, write: Tensor, at: int, num: int, tree: Tensor | None
    ) -> tuple[Tensor, ...]:
        chunk = len(ids) == decode_cache.CHUNK != self.widths[0]  # a prompt's chunk, not a decode forward
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
            if width != decode_cache.CHUNK or len(self.widths) == 1:
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
