"""PNG plots of train/metrics.jsonl: loss and accuracy per TTT step, train and val; with train.measured, the measured
and the estimated acceptance length against tokens seen.

    python -m eagle3.train.plots runs/<run>/train/metrics.jsonl   # writes loss.png, acc.png (acceptance.png) beside it
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from eagle3.run.layout import ACC_PLOT, ACCEPTANCE_PLOT, LOSS_PLOT


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) from metrics.jsonl."""
    from eagle3.train.metrics import read_metrics as read_kind

    return read_kind(path, "train"), read_kind(path, "eval")


def num_steps_in(records: list[dict[str, Any]], prefix: str) -> int:
    """How many TTT steps the records carry (keys prefix_0, prefix_1, ...)."""
    return len({k for r in records for k in r if k.startswith(prefix + "_") and k[len(prefix) + 1 :].isdigit()})


def _plot(train: list[dict], evals: list[dict], prefix: str, ylabel: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for k in range(num_steps_in(train + evals, prefix)):
        key = f"{prefix}_{k}"
        (line,) = ax.plot(
            [r["step"] for r in train if key in r],
            [r[key] for r in train if key in r],
            lw=1,
            alpha=0.6,
            label=f"train k={k}",
        )
        if evals:
            ax.plot(
                [r["step"] for r in evals if key in r],
                [r[key] for r in evals if key in r],
                "o-",
                color=line.get_color(),
                ms=3,
                label=f"val k={k}",
            )
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


def plot_acceptance(train: list[dict], evals: list[dict], measured: list[dict], out: Path) -> Path:
    """Measured acceptance length (real chain decodes) and the validations' teacher-forced accept_len_est against
    tokens seen (a validation's from the train record of its step); the best measurement marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = {r["step"]: r["tokens_seen"] for r in train if "tokens_seen" in r}
    estimated = [(seen[r["step"]], r["accept_len_est"]) for r in evals if r["step"] in seen and "accept_len_est" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if estimated:
        ax.plot(*zip(*estimated), "s--", ms=3, lw=1, label="estimated (val, teacher-forced accept_len_est)")
    chain = measured[-1].get("chain_steps")
    ax.plot(
        [r["tokens_seen"] for r in measured],
        [r["accept_len"] for r in measured],
        "o-",
        ms=4,
        label=f"measured (chain {chain}, greedy decode)",
    )
    best = max(measured, key=lambda r: (r["accept_len"], -r["step"]))  # ties: the earlier step, as training keeps
    ax.plot(
        [best["tokens_seen"]],
        [best["accept_len"]],
        "*",
        ms=12,
        color="black",
        label=f"best measured: step {best['step']}",
    )
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("acceptance length (bonus included)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_metrics(metrics_path: Path, out_dir: Path | None = None) -> list[Path]:
    """Write loss.png and acc.png (per TTT step k, train lines and val points), and acceptance.png when the run
    measured acceptance (train.measured); returns their paths."""
    from eagle3.train.measured import RECORD_TYPE
    from eagle3.train.metrics import read_metrics as read_kind

    train, evals = read_metrics(metrics_path)
    measured = read_kind(metrics_path, RECORD_TYPE)
    out_dir = Path(out_dir or Path(metrics_path).parent)
    written = [
        _plot(train, evals, "loss", "soft cross-entropy", out_dir / LOSS_PLOT),
        _plot(train, evals, "acc", "top-1 accuracy (supervised positions)", out_dir / ACC_PLOT),
    ]
    if measured:
        written.append(plot_acceptance(train, evals, measured, out_dir / ACCEPTANCE_PLOT))
    return written


if __name__ == "__main__":
    for written in plot_metrics(Path(sys.argv[1])):
        print(written)
