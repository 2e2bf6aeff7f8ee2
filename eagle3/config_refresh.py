"""The refresh section of the run config: new prompts folded into a run's data, a warm-started candidate trained for
a bounded budget, and the gate that decides whether it replaces the promoted drafter (eagle3.refresh, docs/refresh.md).

eagle3.config holds the rest of the tree and re-exports this section.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from eagle3.config_base import Section


class GateConfig(Section):
    """When a refreshed candidate replaces the promoted drafter: both measured on one frozen prompt file."""

    prompts: str | None = None
    """JSONL of gate prompts ({"id", "dataset", "category", "text"}); None = frozen from evaluate.* at first use."""
    chain_steps: int = Field(3, ge=1)
    """Draft steps of the chain (topk 1) both drafters are measured with."""
    min_gain: float = Field(0.05, ge=0)
    """Promote only if the candidate's overall acceptance length beats the promoted one's by at least this."""
    max_drop: float = Field(0.1, ge=0)
    """... and no dataset or category loses more than this much acceptance length."""


class RefreshConfig(Section):
    """A refresh (python -m eagle3.refresh): prompts since the watermark, answered by the target, a warm-started
    candidate, the gate, an atomic promotion."""

    prompts: str | None = None
    """Folder of *.jsonl files, or one growing JSONL file, a prompt a line (docs/refresh.md); None = refresh off."""
    regenerate: bool = True
    """Answer the new prompts with the target (regenerate.* backend and settings); false = keep the records' answers."""
    max_prompts: int | None = Field(None, ge=1)
    """Fold in at most this many new lines per refresh (the rest wait for the next one); None = all."""
    max_steps: int = Field(200, ge=1)
    """Training budget of a candidate in optimizer steps (its LR schedule spans them)."""
    lr: float | None = Field(None, gt=0)
    """Peak learning rate of a candidate; None = train.lr."""
    init_from: str | None = None
    """SGLang EAGLE-3 export whose weights start training (lm_head rows matched by target id); None = seeded init."""
    gate: GateConfig = GateConfig()
    """When a candidate is promoted."""

    @model_validator(mode="after")
    def _gate_prompts_not_empty(self) -> RefreshConfig:
        if self.gate.prompts == "" or self.prompts == "" or self.init_from == "":
            raise ValueError(
                "refresh.prompts, refresh.init_from and refresh.gate.prompts take a path or null, not an empty string"
            )
        return self
