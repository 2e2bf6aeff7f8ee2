"""The feature contract between capture and training: FeatureSpec, per-sample tensors, backends.

Layer-id convention (written into every spec.json): ``aux_layer_ids[i] = j`` means the OUTPUT
of decoder layer ``j`` (0-based), i.e. HF ``hidden_states[j + 1]`` and the residual stream
ENTERING layer ``j + 1``. SpecForge and SGLang's explicit ids use this convention; speculators
and vLLM name the same tensors by "capture before layer j + 1" ([2, N//2, N-3]).

A shard holds, for all its samples concatenated along tokens (T = total tokens of the shard):
  aux            [T, num_aux * H]   bf16 (or fp8 e4m3 with ``aux_scale`` [T] fp32, per token)
  final          [T, H]             post-norm final hidden (supervision "final_hidden")
  topk_ids       [T, K] int32       (supervision "topk_logprobs")
  topk_logprobs  [T, K] fp32
  input_ids      [T] int32
  loss_mask      [T] uint8
  offsets        [S + 1] int64      sample s is rows offsets[s]:offsets[s+1]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict

FEATURE_FORMAT_VERSION = 1
AUX_CONVENTION: Final = "output_of_layer"
AUX_CONVENTION_TEXT = (
    "aux_layer_ids[i] = j: output of decoder layer j (0-based) = HF hidden_states[j+1] "
    "= residual stream entering layer j+1"
)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class FeatureSpec(BaseModel):
    """What a feature directory holds; saved as features/spec.json and checked by every reader."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    format_version: int = FEATURE_FORMAT_VERSION
    """Version of the shard layout."""
    target_name: str
    """Target slug (config target.name)."""
    target_fingerprint: str
    """eagle3.target.load.fingerprint of the target the states came from."""
    hidden_size: int
    """Target hidden size H."""
    num_layers: int
    """Target decoder layer count."""
    vocab_size: int
    """Target vocabulary size (bounds input_ids and topk_ids)."""
    aux_layer_ids: list[int]
    """Aux layers, ascending, in the convention named by aux_convention."""
    aux_convention: Literal["output_of_layer"] = AUX_CONVENTION
    """Layer-id convention: see AUX_CONVENTION_TEXT."""
    aux_convention_text: str = AUX_CONVENTION_TEXT
    """The convention in words, so a reader without this code knows."""
    supervision: Literal["final_hidden", "topk_logprobs"] = "final_hidden"
    """final_hidden: post-norm last hidden state; topk_logprobs: the target's top-K log-probs per token."""
    topk: int | None = None
    """K for topk_logprobs supervision."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Storage dtype of final (and of aux unless aux_dtype says fp8)."""
    aux_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = "bfloat16"
    """Storage dtype of aux; float8_e4m3fn stores a per-token fp32 scale in aux_scale."""
    max_len: int
    """Maximum tokens per sample (tokenize.max_len)."""
    chat_template_hash: str
    """sha256 of the chat template the samples were rendered with."""
    backend: Literal["hf", "sglang"]
    """Where the states came from."""

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def bytes_per_token(self) -> int:
        """Exact bytes one token costs in a shard (tensor payload, headers excluded)."""
        aux = self.num_aux * self.hidden_size * DTYPE_BYTES[self.aux_dtype]
        aux += 4 if self.aux_dtype == "float8_e4m3fn" else 0
        if self.supervision == "final_hidden":
            sup = self.hidden_size * DTYPE_BYTES[self.dtype]
        else:
            sup = (self.topk or 0) * (4 + 4)
        return aux + sup + 4 + 1  # input_ids int32 + loss_mask uint8

    def save(self, path: Path) -> Path:
        """Write spec.json atomically."""
        from infra.storage import atomic_write_text

        return atomic_write_text(path, self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> FeatureSpec:
        """Read spec.json."""
        return cls.model_validate(json.loads(Path(path).read_text()))


@dataclass
class SampleTokens:
    """One tokenized sample to capture."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class CapturedSample:
    """The target's states for one sample, as a backend returns them (before storage casting)."""

    id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, num_aux * H]
    final: torch.Tensor | None = None  # [T, H], post-norm
    topk_ids: torch.Tensor | None = None  # [T, K]
    topk_logprobs: torch.Tensor | None = None  # [T, K]


class CaptureBackend(Protocol):
    """Turns tokenized samples into captured states, in the order given, validated."""

    def capture(self, samples: list[SampleTokens]) -> Iterator[CapturedSample]:
        """Yield one CapturedSample per input sample, same order, same ids."""
        ...

    def close(self) -> None:
        """Release models, servers and clients."""
        ...
