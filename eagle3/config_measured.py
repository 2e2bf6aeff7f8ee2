"""The train.measured section: a short real speculative decode during training (eagle3.train.measured,
docs/train.md), whose acceptance can choose the exported checkpoint and stop training early.

eagle3.config_stages nests it in TrainConfig; eagle3.config re-exports the tree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eagle3.config_base import Section


class MeasuredConfig(Section):
    """Measured acceptance during training: greedy chain drafting of the current weights against the target."""

    every_steps: int = Field(0, ge=0)
    """Decode every N optimizer steps and at the last step (0 = off); train.select=measured needs it on."""
    prompts: list[str] = []
    """Prompt sets decoded: named sets or .jsonl prompt files (as evaluate.datasets); empty = evaluate.datasets."""
    num_prompts: int = Field(4, ge=1)
    """Prompts decoded per measurement: the first N of the sets, in order."""
    max_new_tokens: int = Field(64, ge=1)
    """Tokens generated per prompt (fewer where the target emits a stop token)."""
    chain_steps: int = Field(3, ge=1)
    """Draft tokens per round of the chain (topk 1; chain_steps + 1 tokens verified per round)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the decode's target and drafter: auto = bfloat16 on cuda, float32 on cpu."""
    patience: int = Field(0, ge=0)
    """Stop training once this many measurements in a row bring no new best (0 = never stop early)."""

    @model_validator(mode="after")
    def _known_prompts(self) -> MeasuredConfig:
        from eagle3.evaluate.prompts import DATASET_FILES, is_prompt_file

        bad = [p for p in self.prompts if p not in DATASET_FILES and not is_prompt_file(p)]
        if bad:
            raise ValueError(
                f"train.measured.prompts {bad}: each entry is one of {sorted(DATASET_FILES)} or a path to "
                f"a .jsonl prompt file"
            )
        return self
