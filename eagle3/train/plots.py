"""PNG plots of train/metrics.jsonl: loss and accuracy per TTT step, train and val.

    python -m eagle3.train.plots runs/<run>/train/metrics.jsonl   # writes loss.png, acc.png beside it
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) from metrics.jsonl."""
    from eagle3.train.metrics import read_metrics as read_kind

    return read_kind(path, "train"), read_kind(path, "eval")


def num_steps_in(records: list[dict[str, Any]], prefix: str) -> int:
    """How many TTT steps the records carry (keys prefix_0, prefix_1, ...)."""
    return len({k for r in records for k in r if k.startswith(prefix + "_") and k[len(prefix) + 1:].isdigit()})


def _plot(train: list[dict], evals: list[dict], prefix: str, ylabel: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for k in range(num_steps_in(train + evals, prefix)):
        key = f"{prefix}_{k}"
        line, = ax.plot([r["step"] for r in train if key in r], [r[key] for r in train if key in r],
                        lw=1, alpha=0.6, label=f"train k={k}")
        if evals:
            ax.plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-",
                    color=line.get_color(), ms=3, label=f"val k={k}")
    for r in evals[-1:]:
        if prefix == "acc" and r.get("unigram_acc_0") is not None:
            ax.axhline(r["unigram_acc_0"], color="grey", ls="--", lw=1, label="unigram baseline (val, k=0)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_metrics(metrics_path: Path, out_dir: Path | None = None) -> list[Path]:
    """Write loss.png and acc.png (per TTT step k, train lines and val points); returns their paths."""
    train, evals = read_metrics(metrics_path)
    out_dir = Path(out_dir or Path(metrics_path).parent)
    return [_plot(train, evals, "loss", "soft cross-entropy", out_dir / "loss.png"),
            _plot(train, evals, "acc", "top-1 accuracy (supervised positions)", out_dir / "acc.png")]


if __name__ == "__main__":
    for written in plot_metrics(Path(sys.argv[1])):
        print(written)
