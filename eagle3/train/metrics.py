"""What the trainer reports: FLOPs and MFU, metrics.jsonl (+ TensorBoard when installed), progress.json.

FLOP count of one packed row of T tokens (what ``drafter_row_flops`` returns; 2 FLOPs per multiply-add):
    per token and TTT step   qkv 2*2H*(nH+2nKV)*hd + o 2*nH*hd*H + mlp 2*3*H*I + lm_head 2*H*Vd
    once per token           fc 2*A*Ht*H (the aux projection runs at step 0 only)
    attention of step k      causal part over step-0 keys: T(T+1)/2 query-key pairs, diagonal part: k*T
                             pairs; each pair costs 4*hd per query head (QK^T and PV)
    training                 x3 for everything above (backward = 2x forward: input and weight gradients;
                             the attention backward is counted as 2x its forward too)
    supervision              2*Ht*V per token, forward only (the frozen target lm_head over final_hidden)
Padding tokens are counted: the step computes them. Packed documents are counted as one causal
sequence (the flex kernel skips whole blocks across documents, so this over-counts packed rows a little).
MFU = FLOPs / (step seconds x peak dense bf16 FLOP/s of the device).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.drafter.model import DrafterDims
from eagle3.run.progress import finite_or_none
from infra.storage import atomic_write_json

log = logging.getLogger("eagle3.train")

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}
"""Dense bf16 tensor-core peak by GPU name fragment (vendor datasheets, SXM parts)."""


def drafter_row_flops(
    dims: DrafterDims, seq_len: int, ttt_steps: int, supervision_from_final: bool = True
) -> dict[str, float]:
    """FLOPs of one training step over one packed row (module docstring): parts and ``total``."""
    h, t, hd = dims.hidden_size, seq_len, dims.head_dim
    per_token_step = (
        2 * 2 * h * (dims.num_attention_heads + 2 * dims.num_key_value_heads) * hd
        + 2 * dims.num_attention_heads * hd * h
        + 2 * 3 * h * dims.intermediate_size
        + 2 * h * dims.draft_vocab_size
    )
    linear = t * (ttt_steps * per_token_step + 2 * dims.num_aux * dims.target_hidden_size * h)
    pairs = ttt_steps * t * (t + 1) / 2 + t * ttt_steps * (ttt_steps - 1) / 2  # causal + diagonal, all steps
    attention = pairs * 4 * hd * dims.num_attention_heads
    supervision = 2 * t * dims.target_hidden_size * dims.vocab_size if supervision_from_final else 0.0
    out = {"linear_forward": float(linear), "attention_forward": float(attention), "supervision": float(supervision)}
    out["total"] = 3 * (out["linear_forward"] + out["attention_forward"]) + out["supervision"]
    return out


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of a CUDA device by name, None when unknown (or on CPU: no MFU there)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the peak (None without a known peak)."""
    return None if peak is None or seconds <= 0 else flops / seconds / peak


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
    """'step N/M loss ... acc_0 ... lr ... tok/s ... grad_norm ...' (one line per step on rank 0)."""
    line = (
        f"step {record['step']}/{total_steps} epoch {record['epoch']} loss {record['loss']:.4f} "
        f"acc_0 {record.get('acc_0', 0.0):.3f} lr {record['lr']:.3e} tok/s {record['tokens_per_s']:.0f} "
        f"grad_norm {record['grad_norm']:.3f}"
    )
    if record.get("mfu") is not None:
        line += f" mfu {record['mfu']:.3f}"
    return line


class MetricsWriter:
    """Appends one JSON object per line to train/metrics.jsonl (rank 0), and to TensorBoard if it imports."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = Path(path), enabled
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tb = _tensorboard_writer(self.path.parent / "tensorboard")

    def keep_until(self, step: int) -> None:
        """Drop records of steps after ``step`` (a resumed run redoes them; duplicates would confuse plots)."""
        if not self.enabled or not self.path.is_file():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        from infra.storage import atomic_write_text

        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        """One record (train step or eval) as a JSON line, flushed at once."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        if self._tb is not None:
            prefix = record.get("type", "train")
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        """Flush TensorBoard."""
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(log_dir: Path) -> Any:
    """A SummaryWriter when torch.utils.tensorboard imports (tensorboard is optional), else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(log_dir))


def read_metrics(path: Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of one type from a metrics.jsonl file, in order."""
    if not Path(path).is_file():
        return []
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("type") == kind]


class ProgressWriter:
    """Rewrites train/progress.json atomically at most every ``every_s`` seconds (and on state changes)."""

    def __init__(self, path: Path, total_steps: int, enabled: bool, every_s: float) -> None:
        self.path, self.total_steps, self.enabled, self.every_s = Path(path), total_steps, enabled, every_s
        self._last_s = 0.0
        self.fields: dict[str, Any] = {}

    def update(self, state: str = "running", force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the document; write it if forced or ``every_s`` has passed."""
        self.fields.update(fields)
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_s < self.every_s):
            return
        self._last_s = now
        doc = {
            "state": state,
            "total_steps": self.total_steps,
            **{k: finite_or_none(v) for k, v in self.fields.items()},  # NaN is no JSON: null = not known
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_json(self.path, doc)
