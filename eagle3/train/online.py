"""Online features (``train.features: online``): the frozen target runs inside the training step.

Offline training reads each sample's aux and final states from the capture stage's shards; online training
computes the same tensors on the training device, row by row, and never writes them anywhere. "The same"
is meant literally:
  * the target is loaded exactly as the capture stage loads it (``target.dtype``, eval mode, the same
    attention choice ``capture.per_sample_attention``) and run through the capture backend's own decoder
    forward and hooks (``HFCaptureBackend.packed_states`` or ``device_states``), so the aux ids, the
    output-of-layer convention and the post-norm final state cannot drift between the two modes;
  * each state is rounded to its storage dtype (``capture.dtype`` / ``capture.aux_dtype``, fp8 included) and
    then to the trainer's compute dtype, as a shard write followed by a shard read would do.
Each document of a packed row is seen as a sample of its own (positions from 0, no attention across
documents), cut to the tokens the row takes, which for a causal model equals cutting the captured states.
``train.online_forward`` says how: ``packed`` runs the whole row in one forward whose attention keeps the
documents apart (a flex document mask on CUDA, SDPA per document on a CPU); ``padded`` runs its documents as
padded batches; ``auto`` is packed where the target's attention allows it and a row fits one forward's budget,
except on a sharded target (``packed_for``). On a CPU the states are bitwise the
captured ones either way; on a GPU the shapes differ from the capture's batches (cuBLAS picks kernels by
shape), so they agree to the rounding of the compute dtype, not bit for bit.

The trainer reads token ids and loss masks from ``tokenized.parquet`` (``TokenReader``, a drop-in for the
ShardReader in the row loader) and hands each collated row to ``OnlineFeatures.fill`` on the device.
Each rank holds a full target copy (``train.target_sharding: replicate``), or, for a target too large for one
GPU, an FSDP2 shard of it (``fsdp``: eagle3.train.target_shard, which also keeps the ranks' forward counts
equal, as its collectives need); ``auto`` picks fsdp on several GPUs when the target would fill half of one.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from eagle3.features.spec import FeatureSpec, SampleTokens
from eagle3.train.state_cache import StateCache

log = logging.getLogger("eagle3.train")


class TokenReader:
    """input_ids [T] int32 and loss_mask [T] uint8 of every tokenized sample, by id (read once, kept in memory)."""

    def __init__(self, tokenized: Path):
        import pyarrow.parquet as pq

        table = pq.read_table(tokenized, columns=["id", "input_ids", "loss_mask"])
        self.path = Path(tokenized)
        self._ids = table.column("input_ids").combine_chunks()
        self._mask = table.column("loss_mask").combine_chunks()
        self._where = {sid: i for i, sid in enumerate(table.column("id").to_pylist())}

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._where

    def get(self, sample_id: str) -> dict[str, Tensor]:
        """One sample's token ids and loss mask (what a shard holds besides the states)."""
        if sample_id not in self._where:
            raise KeyError(f"sample {sample_id!r} is not in {self.path}")
        i = self._where[sample_id]
        ids = torch.from_numpy(self._ids[i].values.to_numpy(zero_copy_only=False).astype("int32"))
        mask = torch.from_numpy(self._mask[i].values.to_numpy(zero_copy_only=False).astype("uint8"))
        return {"input_ids": ids, "loss_mask": mask}


def _storage_round(x: Tensor, dtype_name: str, compute: torch.dtype) -> Tensor:
    """x as a shard stores it and the loader reads it back: storage dtype, then the compute dtype."""
    if dtype_name == "float8_e4m3fn":
        from eagle3.features.fp8 import dequantize_fp8, quantize_fp8

        q, scale = quantize_fp8(x)
        return dequantize_fp8(q, scale, torch.bfloat16).to(compute)  # the reader dequantizes to bf16
    return x.to(getattr(torch, dtype_name)).to(compute)


def packed_for(forward: str, backend: Any, row_tokens: int | None = None, sharded: bool = False) -> bool:
    """train.online_forward resolved for a backend and rows of ``row_tokens``.

    Packed rows need the backend's sliced attention (causal, full, SDPA) and a row that fits its forward budget
    (capture.tokens_per_forward, which the padded batches keep to). auto picks packed where both hold, except
    for a sharded target: there a packed forward that fails could not fall back on one rank alone.
    """
    problem = None
    if not backend.sliced:
        problem = (
            f"the target's attention is {backend.model.config._attn_implementation!r}, not causal full "
            "attention through SDPA"
        )
    elif row_tokens is not None and row_tokens > backend.tokens_per_forward:
        problem = (
            f"a row of {row_tokens} tokens (train.tokens_per_row) is more than one forward may take "
            f"({backend.tokens_per_forward}, capture.tokens_per_forward)"
        )
    if forward == "packed" and problem:
        raise ValueError(f"train.online_forward=packed: {problem}; use padded (or auto)")
    return forward == "packed" or (forward == "auto" and problem is None and not sharded)


def _pad_rows(x: Tensor, length: int, value: float = 0.0) -> Tensor:
    """[n, ...] -> [1, length, ...] filled with ``value`` after row n (the row's padding document)."""
    out = x.new_full((length, *x.shape[1:]), value)
    out[: x.shape[0]] = x
    return out[None]


def _documents(batch: Any, lengths: list[int], host: Any = None) -> list[SampleTokens]:
    """A collated row's real documents as SampleTokens (token ids and loss masks), in row order, read from ``host``
    (the same row still on the host) when the caller has it: on a GPU, reading ``batch`` waits for every kernel
    queued before it."""
    row = batch if host is None else host
    host_ids, host_mask = row.input_ids[0].tolist(), row.loss_mask[0].tolist()  # [T] each
    docs, start = [], 0
    for k, n in enumerate(lengths):
        docs.append(SampleTokens(f"doc{k}", host_ids[start : start + n], host_mask[start : start + n]))
        start += n
    return docs


class OnlineFeatures:
    """Fills a collated row's aux and supervision on the device from the frozen target (module docstring)."""

    def __init__(
        self,
        backend: Any,
        spec: FeatureSpec,
        forward: str = "padded",
        row_tokens: int | None = None,
        sharded: bool = False,
        cache: StateCache | None = None,
    ):
        if cache is not None and sharded:
            # a rank that skips a forward leaves the others waiting in the sharded target's collectives
            raise ValueError(
                "train.feature_cache_gib (and _host_gib) need a whole target per rank: set "
                "train.target_sharding=replicate, or both to 0 for a sharded target"
            )
        self.spec, self.backend, self.cache = spec, backend, cache  # backend: an HFCaptureBackend on the device
        self.backend.model.requires_grad_(False)
        self.packed, self.forward = packed_for(forward, backend, row_tokens, sharded), forward
        # auto, one process: a packed forward that fails falls back to padded (never sharded: see packed_for)
        self.fallback = forward == "auto" and not sharded

    @classmethod
    def from_config(
        cls, cfg: Any, model_dir: Path, spec: FeatureSpec, device: torch.device, info: Any = None
    ) -> OnlineFeatures:
        """The online target of a run: loaded with the capture section's settings, on the training device;
        with ``info`` (the trainer's DistInfo) sharded over the ranks when train.target_sharding resolves to fsdp."""
        from eagle3.features.hf_backend import HFCaptureBackend

        forward, row_tokens = cfg.train.online_forward, cfg.train.tokens_per_row
        gib, host_gib = cfg.train.feature_cache_gib, cfg.train.feature_cache_host_gib
        cache = StateCache(int(gib * 2**30), int(host_gib * 2**30)) if gib > 0 or host_gib > 0 else None
        if info is not None:
            from eagle3.train.target_shard import resolve_sharding, sharded_backend

            if resolve_sharding(cfg.train.target_sharding, info, model_dir, cfg.target.dtype) == "fsdp":
                # every rank must run the same forwards, or the shards' collectives hang
                return cls(
                    sharded_backend(cfg, model_dir, spec, info),
                    spec,
                    forward,
                    row_tokens=row_tokens,
                    sharded=True,
                    cache=cache,
                )
        cap = cfg.capture
        backend = HFCaptureBackend.from_spec(
            model_dir,
            spec,
            device=str(device),
            dtype=cfg.target.dtype,
            tokens_per_forward=cap.tokens_per_forward,
            batch_invariant=cap.per_sample_attention,
        )
        return cls(backend, spec, forward, row_tokens=row_tokens, cache=cache)

    def describe(self) -> str:
        """How rows run through the target, in words (for the trainer's log)."""
        setting = f"(train.online_forward={self.forward})"
        if self.packed:
            how = "flex document mask" if self.backend.input_device.type == "cuda" else "SDPA per document"
            return f"packed: one forward per row ({how}) {setting}"
        return (
            f"padded: each row's documents as padded batches of <= {self.backend.tokens_per_forward} tokens {setting}"
        )

    def _rounded(self, raw: dict[str, Tensor], compute: torch.dtype) -> dict[str, Tensor]:
        """The backend's states rounded as stored, then to the compute dtype."""
        spec = self.spec
        out = {"aux": _storage_round(raw["aux"], spec.aux_dtype, compute)}  # [N, A*H]
        if "final" in raw:
            out["final"] = _storage_round(raw["final"], spec.dtype, compute)  # [N, H]
        else:
            out["topk_ids"], out["topk_logprobs"] = raw["topk_ids"].long(), raw["topk_logprobs"].float()
        return out

    def states(self, documents: list[SampleTokens], compute: torch.dtype) -> dict[str, Tensor]:
        """Concatenated [N, ...] states of ``documents`` in order (padded batches), rounded as stored, on the device."""
        with torch.no_grad():
            return self._rounded(self.backend.device_states(documents), compute)

    def row_states(self, batch: Any, lengths: list[int], compute: torch.dtype, host: Any = None) -> dict[str, Tensor]:
        """[n, ...] states of a collated row's n real tokens: one packed forward, or its documents as batches
        (``host``: the row as the loader made it, read instead of ``batch`` for the documents' tokens)."""
        if self.packed:
            try:
                with torch.no_grad():
                    raw = self.backend.packed_states(batch.input_ids, batch.document_ids, batch.position_ids, lengths)
                return self._rounded(raw, compute)
            except Exception as exc:  # noqa: BLE001 (named in the warning; auto only, never sharded)
                if not self.fallback:
                    raise
                log.warning(
                    "train: the online target's packed forward failed (%s: %s); running each row's "
                    "documents as padded batches from now on (train.online_forward=padded skips the try)",
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
                self.packed = False
        return self.states(_documents(batch, lengths, host), compute)

    def cached_row_states(
        self, batch: Any, lengths: list[int], compute: torch.dtype, ids: tuple[str, ...], host: Any = None
    ) -> dict[str, Tensor]:
        """row_states through the cache (eagle3.train.state_cache): documents it keeps come from it, the others
        from the target (the row's own forward when none is kept), and are kept if the budget allows."""
        assert self.cache is not None and len(ids) == len(lengths), (len(ids), len(lengths))
        pieces = [self.cache.get(sid, n) for sid, n in zip(ids, lengths)]
        missing = [k for k, piece in enumerate(pieces) if piece is None]
        whole_row = len(missing) == len(lengths)
        if missing:
            if whole_row:
                fresh = self.row_states(batch, lengths, compute, host)
            else:
                docs = _documents(batch, lengths, host)
                fresh = self.states([docs[k] for k in missing], compute)
            split = {name: t.split([lengths[k] for k in missing]) for name, t in fresh.items()}
            for j, k in enumerate(missing):
                piece = {name: parts[j] for name, parts in split.items()}
                pieces[k] = piece
                self.cache.put(ids[k], piece)
            if whole_row:
                return fresh  # already the row in order: no second concatenation
        filled = cast(list[dict[str, Tensor]], pieces)  # every missing piece was filled above
        return {name: torch.cat([piece[name] for piece in filled]) for name in filled[0]}  # [n, ...]

    def fill(
        self, batch: Any, lengths: list[int], compute: torch.dtype, ids: tuple[str, ...] = (), host: Any = None
    ) -> Any:
        """The TTTBatch with aux/final (or top-K) of its documents; ``lengths``: tokens of each real document,
        ``ids``: their sample ids (the cache's keys; without them the cache is not used); ``host``: the same row
        still on the host, if the caller has it (spares a wait for the device)."""
        from eagle3.train.data import TOPK_PAD_LOGPROB

        if self.cache is not None and ids:
            states = self.cached_row_states(batch, lengths, compute, ids, host)
        else:
            states = self.row_states(batch, lengths, compute, host)
        length = batch.input_ids.shape[1]
        fields: dict[str, Tensor] = {"aux": _pad_rows(states["aux"], length)}  # [1, T, A*H]
        if "final" in states:
            fields["final_hidden"] = _pad_rows(states["final"], length)  # [1, T, H]
        else:
            fields["topk_ids"] = _pad_rows(states["topk_ids"], length)  # [1, T, K]
            fields["topk_logprobs"] = _pad_rows(states["topk_logprobs"], length, TOPK_PAD_LOGPROB)
        return dataclasses.replace(batch, **fields)

    def close(self) -> None:
        """Drop the backend's handle on the target (the process-wide model cache keeps it)."""
        self.backend.close()
