"""lab/dflash_train_speed.py: the DFlash step benchmark runs on CPU and prints one row per (blocks, kernel)."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]


def test_dflash_step_benchmark_prints_a_row_per_case(capsys):
    """A 128-token row, 4 blocks: the dense case gives a positive step time and a finite first loss; the flex case
    gives the same first loss (same seed and anchors) or, where this torch has no flex backward (CPU), a row that
    says it failed and why."""
    bench = runpy.run_path(str(LAB / "dflash_train_speed.py"))
    args = ["--seq-len", "128", "--blocks", "4", "--kernels", "dense", "flex", "--warmup", "1", "--steps", "1"]
    bench["main"]([*args, "--chunk", "16"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    dense, flex = (dict(zip(("blocks", "kernel", "ms", "gib", "loss", "ratio"), map(str.strip, r))) for r in rows)
    assert dense["kernel"] == "dense" and float(dense["ms"]) > 0 and math.isfinite(float(dense["loss"]))
    if flex["ms"].startswith("failed"):
        assert "Error" in flex["ms"]
    else:
        assert math.isclose(float(flex["loss"]), float(dense["loss"]), rel_tol=1e-4) and float(flex["ratio"]) > 0
