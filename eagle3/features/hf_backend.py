"""In-process transformers capture backend: forward hooks, token-budget batches, no lm_head pass.

Per batch we run only the decoder (``model.model``): forward hooks on ``model.model.layers[j]``
take the OUTPUT of layer j for every aux id (spec.py's convention), and a hook on
``model.model.norm`` takes the final post-norm state. ``output_hidden_states=True`` is never used:
it would keep all N+1 states of the batch alive. With top-K supervision, lm_head is applied to the
post-norm rows in token chunks so that [chunk, vocab] fp32 logits bound the memory. The target is loaded once
per process (eagle3.features.hf_models).

Batches (eagle3.features.batching) hold samples in the given order while the sum of their padded lengths fits
``tokens_per_forward`` (a longer sample runs alone); inputs are right-padded with an attention
mask and each sample's rows are gathered back on the device, so padding is never copied out.

Batch invariance: GEMMs and SDPA pick their reduction order by shape, so a padded sample would
otherwise come out a few ulps different from the same sample run alone. For causal full-attention
models we therefore register an attention function (eagle3.features.attention) that runs SDPA per
sample on its unpadded slice (exactly the call HF makes for a lone sample) and skip building the
padding mask; the same function runs online training's packed rows (``packed_states``). On CPU
this makes batched == unbatched bitwise (tested; GEMMs with very few rows, under ~12, can still
differ on MKL); the same inputs in the same batches are bitwise reproducible either way.
``torch.use_deterministic_algorithms`` is not needed for that on CPU; on CUDA cuBLAS may still
vary with the batch shape, so only same-batching reproducibility holds there. MoE targets (DeepSeek-V3)
are not batch-invariant even on CPU: each expert's GEMM runs over the tokens the whole batch routes to it
(MLA attention itself is, tested).

On CUDA, each batch's outputs are copied to pinned host memory on a side stream with
``non_blocking=True`` while the next batch's forward is already queued, and synchronised (one event
per batch, never per tensor) only when that batch is handed out; nothing in the forward loop waits
for the GPU otherwise. The pinned buffers come from torch's caching host allocator, so they are
reused across batches. By default each batch is cloned into pageable memory when handed out (pinned
memory stays ~2 batches); with ``pinned_handoff`` the samples are views of the pinned buffers
themselves, which saves that memcpy on the capture thread and pins as much as the writers hold.
``capture_many`` runs one pipeline through several groups (shards): batches never span a group, so
each shard is batched exactly as ``capture`` would batch it alone, but the GPU does not drain
between shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.features.attention import (
    ATTENTION,
    PackedDocs,
    Samples,
    attention_context,
    document_block_mask,
    enable,
    per_sample_for,
)
from eagle3.features.batching import auto_tokens_per_forward, plan_batches
from eagle3.features.hf_models import device_lock, get_model
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens

LOGITS_CHUNK_BYTES = 1 << 28
"""fp32 logits kept at once by the top-K pass (256 MiB)."""


@dataclass
class _Inputs:
    """One padded batch: ids/mask [B, L] on the input device, gather index [N] of the valid rows."""

    samples: list[SampleTokens]
    lengths: list[int]
    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor | None  # [B, L] int64; None for a packed row (its documents are in ``packed``)
    rows: torch.Tensor  # [N] int64 into the flattened [B * L] positions
    position_ids: torch.Tensor | None = None  # [1, T] packed rows only: positions restart in each document
    packed: PackedDocs | None = None  # packed rows only: the documents and their attention mask


@dataclass
class _Launched:
    """A batch whose forward has been queued and whose outputs are (being) copied to the host."""

    group: int  # index of the group (shard) the batch belongs to
    samples: list[SampleTokens]
    lengths: list[int]
    host: dict[str, torch.Tensor]  # name -> [N, ...] on the CPU (pinned on CUDA)
    ready: Any  # torch.cuda.Event or None


def _keep_rows(store: dict, name: Any, rows_for: Any) -> Any:
    """A forward hook that keeps only the valid rows of a module's output: [B, L, H] -> [N, H]."""

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # [B, L, H]
        store[name] = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows_for(hidden.device))

    return hook


class HFCaptureBackend:
    """CaptureBackend over an in-process transformers causal LM (CPU, one GPU, or device_map='auto')."""

    def __init__(
        self,
        model_dir: Path | None,
        aux_layer_ids: Sequence[int],
        *,
        supervision: str = "final_hidden",
        topk: int | None = None,
        device: str = "auto",
        dtype: str = "float32",
        tokens_per_forward: int | str = 4096,
        device_map: str | None = None,
        model: Any = None,
        batch_invariant: bool | str | None = None,
        pinned_handoff: bool = False,
    ):
        if supervision == "topk_logprobs" and not topk:
            raise ValueError("topk_logprobs supervision needs topk >= 1")
        if model is None:
            assert model_dir is not None, "either model_dir or model"
            model = get_model(Path(model_dir), dtype, device, device_map)
        self.model = model
        self.decoder = self.model.model
        num_layers = len(self.decoder.layers)
        if any(not 0 <= j < num_layers for j in aux_layer_ids):
            raise ValueError(f"aux_layer_ids {list(aux_layer_ids)} out of range for {num_layers} layers")
        self.aux_layer_ids, self.supervision, self.topk = list(aux_layer_ids), supervision, topk
        self.pinned_handoff = pinned_handoff
        self.input_device = self.decoder.embed_tokens.weight.device
        wants_per_sample = per_sample_for(batch_invariant, self.input_device)
        if model is not None:
            enable(self.model)
        self.sliced = self.model.config._attn_implementation == ATTENTION  # per-sample and packed rows possible
        self.per_sample = wants_per_sample and self.sliced
        if tokens_per_forward == "auto":
            weight_dtype = self.decoder.embed_tokens.weight.dtype
            tokens_per_forward = auto_tokens_per_forward(
                self.model.config, len(self.aux_layer_ids) + 1, weight_dtype, self.input_device
            )
        self.tokens_per_forward = int(tokens_per_forward)
        self.lock = device_lock(self.input_device)
        self._copy_stream = torch.cuda.Stream(self.input_device) if self.input_device.type == "cuda" else None

    @classmethod
    def from_spec(cls, model_dir: Path, spec: FeatureSpec, **kwargs: Any) -> HFCaptureBackend:
        """A backend capturing exactly what ``spec`` describes (aux ids, supervision, K)."""
        return cls(model_dir, spec.aux_layer_ids, supervision=spec.supervision, topk=spec.topk, **kwargs)

    # ---- inputs and forward --------------------------------------------------------------------

    def _inputs(self, samples: list[SampleTokens]) -> _Inputs:
        lengths = [len(s.input_ids) for s in samples]
        for s, n in zip(samples, lengths):
            if n == 0:
                raise ValueError(f"sample {s.id!r} has no tokens")
        seq = max(lengths)
        ids = torch.zeros((len(samples), seq), dtype=torch.long)  # [B, L]; pad id 0 is masked out
        mask = torch.zeros((len(samples), seq), dtype=torch.long)  # [B, L]
        for b, (s, n) in enumerate(zip(samples, lengths)):
            ids[b, :n] = torch.as_tensor(s.input_ids, dtype=torch.long)
            mask[b, :n] = 1
        rows = torch.cat([torch.arange(n) + b * seq for b, n in enumerate(lengths)])  # [N]
        return _Inputs(samples, lengths, self._to_device(ids), self._to_device(mask), rows)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.input_device.type == "cuda":
            return tensor.pin_memory().to(self.input_device, non_blocking=True)
        return tensor.to(self.input_device)

    def _run_decoder(self, inputs: _Inputs, store: dict | None) -> None:
        """model.model forward (no lm_head); with ``store``, hooks fill it with [N, H] rows per output."""
        handles = []
        if store is not None:
            by_device: dict[torch.device, torch.Tensor] = {}

            def rows_for(device: torch.device) -> torch.Tensor:
                if device not in by_device:
                    by_device[device] = inputs.rows.to(device, non_blocking=True)
                return by_device[device]

            handles = [
                self.decoder.layers[j].register_forward_hook(_keep_rows(store, j, rows_for))
                for j in sorted(set(self.aux_layer_ids))
            ]
            handles.append(self.decoder.norm.register_forward_hook(_keep_rows(store, "final", rows_for)))
        context = inputs.packed or (Samples(tuple(inputs.lengths)) if self.per_sample else None)
        try:
            with attention_context(context):
                self._forward(inputs)
        finally:
            for handle in handles:
                handle.remove()

    def _forward(self, inputs: _Inputs) -> None:
        """The decoder alone (no lm_head); the hooks keep what is needed."""
        self.decoder(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
        )

    def _outputs(self, store: dict) -> dict[str, torch.Tensor]:
        """Hook rows -> aux [N, A*H] (+ final [N, H] or top-K [N, K]) on the input device."""
        dev = self.input_device
        out = {"aux": torch.cat([store[j].to(dev) for j in self.aux_layer_ids], dim=-1)}  # [N, A*H]
        if self.supervision == "final_hidden":
            out["final"] = store["final"].to(dev)  # [N, H]
        else:
            out["topk_ids"], out["topk_logprobs"] = self._topk(store["final"])
        return out

    def _topk(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-norm rows [N, H] -> top-K ids [N, K] int32 and log-probs [N, K] fp32 (full-vocab log_softmax)."""
        assert self.topk is not None  # (topk_logprobs supervision checks it is set)
        head = self.model.get_output_embeddings()
        vocab = head.weight.shape[0]
        chunk = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))
        final = final.to(head.weight.device)
        ids, logprobs = [], []
        for start in range(0, final.shape[0], chunk):
            logits = head(final[start : start + chunk]).float()  # [c, V]
            values, indices = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)  # [c, K]
            ids.append(indices.to(torch.int32))
            logprobs.append(values)
        dev = self.input_device
        return torch.cat(ids).to(dev), torch.cat(logprobs).to(dev)

    # ---- host copies -----------------------------------------------------------------------------

    def _to_host(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """CPU: as is. CUDA: async copies into pinned buffers on the copy stream, plus the event to wait on."""
        if self._copy_stream is None:
            return tensors, None
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.input_device))
        host = {}
        with torch.cuda.stream(stream):
            for name, tensor in tensors.items():
                host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # keep the allocator from reusing it before the copy ends
            event = torch.cuda.Event()
            event.record(stream)
        return host, event

    def _launch(self, group: int, samples: list[SampleTokens]) -> _Launched:
        inputs = self._inputs(samples)
        store: dict = {}
        with self.lock, torch.no_grad():
            self._run_decoder(inputs, store)
            host, ready = self._to_host(self._outputs(store))
        return _Launched(group, samples, inputs.lengths, host, ready)

    def device_states(self, samples: Sequence[SampleTokens]) -> dict[str, torch.Tensor]:
        """[N, ...] states of ``samples`` concatenated in their order, left on the device (online training).

        The same decoder forward, hooks and outputs as ``capture``; batches are planned over the samples
        sorted longest first (less padding), and the rows are put back in the given order.
        """
        order, groups = self.online_batches(samples)
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        for group in groups:
            batch = [samples[order[g]] for g in group]
            outputs, start = self.batch_states(batch), 0
            for g, sample in zip(group, batch):
                n = len(sample.input_ids)
                pieces[order[g]] = {name: t[start : start + n] for name, t in outputs.items()}
                start += n
        return {name: torch.cat([pieces[i][name] for i in range(len(samples))]) for name in pieces[0]}

    def online_batches(self, samples: Sequence[SampleTokens]) -> tuple[list[int], list[list[int]]]:
        """(sample indices longest first, groups of positions in that order): the batches ``device_states`` runs."""
        order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
        lengths = [len(samples[i].input_ids) for i in order]
        # No cap on padding: on the H200 a 25% cap (more, smaller forwards per row) halved online training's
        # tokens/s for a SmolLM2-sized target, whose forwards cost launches more than padded FLOPs (docs/train.md).
        return order, plan_batches(lengths, self.tokens_per_forward)

    def batch_states(self, batch: list[SampleTokens]) -> dict[str, torch.Tensor]:
        """One forward over ``batch``: its [N, ...] outputs concatenated in order, on the device."""
        inputs = self._inputs(batch)
        store: dict = {}
        with self.lock:
            self._run_decoder(inputs, store)
        return self._outputs(store)

    def packed_states(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor,
        position_ids: torch.Tensor,
        lengths: Sequence[int],
        flex: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """One forward over a packed row, documents kept apart by the attention: [sum(lengths), ...] outputs.

        input_ids, document_ids, position_ids: [1, T] on the input device, documents contiguous, positions
        restarting at 0 in each; ``lengths``: the tokens of each real document, in row order (the rest of the
        row is padding, a document of its own). On CUDA the whole row runs with a flex document mask (one shape, one
        compile); elsewhere only the real tokens run, with SDPA per document (attention module docstring). ``flex``
        overrides that choice (None: flex on CUDA); on a CPU flex_attention runs uncompiled, a reference for the CUDA
        path.
        """
        if not self.sliced:
            raise ValueError(
                "packed rows need causal full attention through SDPA "
                f"(this target uses {self.model.config._attn_implementation!r})"
            )
        flex = self.input_device.type == "cuda" if flex is None else flex
        num_real, num_pad = sum(lengths), input_ids.shape[1] - sum(lengths)
        if flex:  # the whole row, one shape: the padding runs as a document of its own
            packed = PackedDocs(
                (*lengths, num_pad) if num_pad else tuple(lengths), document_block_mask(document_ids[0], num_real)
            )
        else:
            input_ids, position_ids = input_ids[:, :num_real], position_ids[:, :num_real]
            packed = PackedDocs(tuple(lengths))
        inputs = _Inputs(
            [],
            [input_ids.shape[1]],
            input_ids,
            None,
            torch.arange(num_real, device=input_ids.device),
            position_ids=position_ids,
            packed=packed,
        )
        store: dict = {}
        with self.lock:
            self._run_decoder(inputs, store)
        return self._outputs(store)

    def _finish(self, launched: _Launched) -> Iterator[tuple[int, CapturedSample]]:
        host = launched.host
        if launched.ready is not None:
            launched.ready.synchronize()
            if not self.pinned_handoff:
                # Pageable copies let the pinned buffers return to the cache: pinned memory stays ~2 batches.
                host = {name: tensor.clone() for name, tensor in host.items()}
        start = 0
        for sample, n in zip(launched.samples, launched.lengths):
            part = {name: tensor[start : start + n] for name, tensor in host.items()}  # views: no copy
            start += n
            yield (
                launched.group,
                CapturedSample(
                    id=sample.id,
                    input_ids=torch.as_tensor(sample.input_ids, dtype=torch.int32),
                    loss_mask=torch.as_tensor(sample.loss_mask, dtype=torch.uint8),
                    **part,
                ),
            )

    # ---- CaptureBackend ----------------------------------------------------------------------------

    def batches(self, samples: Sequence[SampleTokens]) -> list[list[SampleTokens]]:
        """The token-budget batches ``capture`` runs, in order."""
        groups = plan_batches([len(s.input_ids) for s in samples], self.tokens_per_forward)
        return [[samples[i] for i in group] for group in groups]

    def capture(self, samples: Sequence[SampleTokens]) -> Iterator[CapturedSample]:
        """Yield one CapturedSample per input, same order; batch k+1 is queued before batch k is handed out."""
        for _, sample in self.capture_many([samples]):
            yield sample

    def capture_many(self, groups: Iterable[Sequence[SampleTokens]]) -> Iterator[tuple[int, CapturedSample]]:
        """(group index, sample) for every sample of every group, in order, through one pipeline.

        Each group is batched on its own (exactly as ``capture(group)``), but the first batch of
        group g+1 is queued before the last batch of group g is handed out. ``groups`` is read
        lazily, one group ahead of the samples handed out.
        """
        pending: _Launched | None = None
        for group, batch in self._group_batches(groups):
            launched = self._launch(group, batch)
            if pending is not None:
                yield from self._finish(pending)
            pending = launched
        if pending is not None:
            yield from self._finish(pending)

    def _group_batches(self, groups: Iterable[Sequence[SampleTokens]]) -> Iterator[tuple[int, list[SampleTokens]]]:
        for group, samples in enumerate(groups):
            for batch in self.batches(samples):
                yield group, batch

    def forward_only(self, samples: Sequence[SampleTokens]) -> None:
        """The same decoder forwards as ``capture`` with every output discarded (the benchmark's baseline)."""
        for batch in self.batches(samples):
            inputs = self._inputs(batch)
            with self.lock, torch.no_grad():
                self._run_decoder(inputs, None)
        if self.input_device.type == "cuda":
            torch.cuda.synchronize(self.input_device)

    def close(self) -> None:
        """Drop this backend's handle on the model (the process-wide cache keeps it for later shards)."""
        with contextlib.suppress(AttributeError):
            del self.model, self.decoder
