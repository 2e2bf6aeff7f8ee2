"""The frozen online target sharded across the training ranks with FSDP2 (``train.target_sharding``).

``replicate`` keeps a full target on every rank (what DDP does with the drafter); ``fsdp`` applies torch's
``fully_shard`` to each decoder layer and then to the whole causal LM (embeddings, final norm, lm_head), over
the default process group's 1-D mesh (the one ``dist.wrap`` shards the drafter over). A rank then holds
about params / world_size of the target, plus one layer gathered at a time during a forward
(``reshard_after_forward=True`` everywhere, the root included). The weights are frozen (requires_grad False)
and the forwards run under no_grad, so no gradient or reduce-scatter ever exists for them.

The forward goes through the root module (``model(..., logits_to_keep=1)``: FSDP2 gathers the root's own
parameters in the root's pre-forward, so the decoder alone cannot be called), and the capture backend's hooks
on the decoder layers and the final norm take the same aux and post-norm states as without sharding; the
one-position logits are discarded. Top-K supervision gathers the root again around the lm_head pass.

Collective rule: an FSDP2 forward is a sequence of all-gathers, so every rank must run the same number of
target forwards in the same order. The trainer gives every rank the same number of rows per step and per
validation pass (``eagle3.train.data``: epochs padded to a multiple of world_size x grad_accum_steps, val to a
multiple of world_size; the step count and the stop flag are agreed on), and fills them in the same order.
Within a row, ``HFCaptureBackend.device_states`` may split the documents into several batches, a number that
differs between ranks; so for each row the ranks agree on the largest batch count (one all-reduce MAX) and a
rank with fewer batches runs one-token dummy batches, discarded, through the same path until it reaches it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.spec import FeatureSpec, SampleTokens
from eagle3.train.dist import DistInfo, all_gather_objects

log = logging.getLogger("eagle3.train")

AUTO_SHARD_SHARE = 0.5
"""target_sharding=auto shards when the target's parameters exceed this share of the smallest free GPU memory."""
DUMMY = SampleTokens("collective-padding", [0], [0])
"""The one-token document a rank runs when it has fewer target forwards in a row than another rank."""

Sharding = Literal["replicate", "fsdp"]


def target_param_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of the target's parameters in ``dtype`` (counted on the meta device: nothing is loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once


def resolve_sharding(setting: str, info: DistInfo, model_dir: Path, dtype: str) -> Sharding:
    """train.target_sharding for this run, the same on every rank.

    fsdp needs a process group (torchrun); a one-process world holds the whole target either way. auto shards
    only on CUDA with more than one rank, when the parameters exceed AUTO_SHARD_SHARE of the smallest free
    memory of any rank's GPU (every rank sees the same list, so all decide alike); on CPU it replicates.
    """
    if setting == "replicate" or not info.initialized:
        if setting == "fsdp":
            log.info("train: target_sharding=fsdp in a one-process world: the target is held whole")
        return "replicate"
    if setting == "fsdp":
        return "fsdp"
    if info.world_size < 2 or info.device.type != "cuda":
        return "replicate"
    need = target_param_bytes(model_dir, dtype)
    free = min(all_gather_objects(torch.cuda.mem_get_info(info.device)[0], info))
    choice: Sharding = "fsdp" if need > AUTO_SHARD_SHARE * free else "replicate"
    log.info(
        "train: online target %.2f GB, smallest free GPU memory %.2f GB: target_sharding=auto -> %s",
        need / 1e9,
        free / 1e9,
        choice,
    )
    return choice


def shard_target(model: Any) -> Any:
    """FSDP2 over ``model`` in place: each decoder layer, then the root; frozen. Returns the model."""
    from torch.distributed.fsdp import fully_shard

    model.requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=True)  # moves the layer to the mesh device, keeps its shard
    fully_shard(model, reshard_after_forward=True)  # embeddings, final norm, lm_head (tied or not), buffers
    return model


class ShardedCaptureBackend(HFCaptureBackend):
    """HFCaptureBackend over an FSDP2-sharded target: root forwards, and the same forward count on every rank."""

    def _forward(self, inputs: Any) -> None:
        # the root forward gathers the root's parameters; the decoder hooks see what model.model would give
        self.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
            logits_to_keep=1,
        )

    def _topk(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.unshard()  # lm_head is a root parameter: gathered for the chunked head pass, then freed
        try:
            return super()._topk(final)
        finally:
            self.model.reshard()

    def device_states(self, samples: Any) -> dict[str, torch.Tensor]:
        """The base states; then dummy batches up to the most batches any rank runs for its row (module doc)."""
        _, groups = self.online_batches(samples)
        most = torch.tensor([len(groups)], dtype=torch.int64, device=self.input_device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        out = super().device_states(samples)
        for _ in range(int(most) - len(groups)):
            self.batch_states([DUMMY])
        return out


def sharded_backend(cfg: Any, model_dir: Path, spec: FeatureSpec, info: DistInfo) -> ShardedCaptureBackend:
    """The online target loaded on the host, sharded layer by layer onto the device, behind the capture backend.

    Loaded outside the process-wide model cache (a sharded model must never be handed to a capture); the host
    copy of each layer is dropped once its shard is on the device, so a GPU never holds the whole target.
    """
    from eagle3.features.hf_models import load_model

    model = shard_target(load_model(Path(model_dir), cfg.target.dtype, "cpu"))
    log.info("train: online target sharded over %d ranks (FSDP2, one layer gathered at a time)", info.world_size)
    cap = cfg.capture
    return ShardedCaptureBackend(
        None,
        spec.aux_layer_ids,
        supervision=spec.supervision,
        topk=spec.topk,
        device=str(info.device),
        model=model,
        tokens_per_forward=cap.tokens_per_forward,
        batch_invariant=cap.per_sample_attention,
    )
