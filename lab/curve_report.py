"""The data-scaling curve's report: acceptance length against training tokens, one line per method.

Reads each size's ``eval/results.json`` (eagle3.evaluate.stage) and, where a size has no decoded figure for a
method, its ``eval/replayed.json`` (chain and n-gram acceptance replayed from an evaluation's greedy texts by
``lab/drafter_shift.py --replay-only``: no decode, so no lossless check; marked † in the tables and
drawn hollow), and writes into one folder:
curve.json (the rows), curve.md (a table per dataset) and curve.png (acceptance vs training tokens on a log
axis, one line per drafting method, the n-gram baseline as a flat dashed line: it uses no drafter, so
every size measures the same thing and the first size that measured it stands for all). Recipe variants
measured at the largest size (quality_curve.py's sweep) get a table of their own beside that size's baseline.
Both tables carry each run's validation accept_len_est (its best step, read from the run's train/metrics.jsonl
beside the results), so a variant whose training a stretch stopped before its last step is still reported, marked
as stopped, with no acceptance of its own.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any directory

from eagle3.run.layout import RunLayout  # noqa: E402

CURVE_REPORT, CURVE_PLOT, CURVE_DATA = "curve.md", "curve.png", "curve.json"
"""The curve's files. quality_curve.py writes them into the data run's appendix/ (RunLayout.appendix), so that
run's report (flows/report.py) shows curve.md as a section and curve.png below it."""
NGRAM = "ngram"


@dataclass(frozen=True)
class CurveRow:
    """One method's acceptance at one size on one dataset ('all' = the prompts of every dataset)."""

    tokens: int  # the size's train.max_train_tokens
    dataset: str
    method: str
    accept_len: float
    num_prompts: int
    lossless_identical: int  # -1 for a replayed figure (no decode ran)
    replayed: bool = False


@dataclass(frozen=True)
class Validation:
    """A run's validation accept_len_est at its best step, and how far its training got."""

    best_step: int
    best: float
    last_step: int  # the last step the training logged
    finished: bool  # the train stage wrote its manifest (False: stopped before its last step, e.g. by a deadline)


def read_validation(run_dir: Path) -> Validation | None:
    """The best validation of the run's train/metrics.jsonl (None when it has no validation record)."""
    from eagle3.run.registry import get_stage
    from eagle3.train.metrics import read_metrics

    layout = RunLayout(Path(run_dir))
    evals = [r for r in read_metrics(layout.metrics, "eval") if "accept_len_est" in r]
    if not evals:
        return None
    best = max(evals, key=lambda r: (r["accept_len_est"], -r["step"]))  # the first step to reach the best value
    last = max(int(r["step"]) for r in [*evals, *read_metrics(layout.metrics, "train")])
    finished = get_stage("train").manifest(layout.root).is_file()
    return Validation(int(best["step"]), float(best["accept_len_est"]), last, finished)


def validation_cell(v: Validation | None) -> str:
    """'2.649 (step 7,200)', or for a training stopped early '2.706 (step 5,800; stopped at 5,929)'."""
    if v is None:
        return "-"
    return f"{v.best:.3f} (step {v.best_step:,}" + ("" if v.finished else f"; stopped at {v.last_step:,}") + ")"


def run_of(results: Path) -> Path:
    """The run folder of an evaluation's results file (<run>/eval/results.json)."""
    return Path(results).parent.parent


def token_label(tokens: int) -> str:
    """3_000_000 -> '3M', 500_000 -> '500K', 1_500_000 -> '1.5M' (also the size runs' name suffix)."""
    for unit, scale in (("M", 1_000_000), ("K", 1_000)):
        if tokens >= scale:
            return f"{tokens / scale:g}{unit}"
    return str(tokens)


def read_rows(
    results: Mapping[int, Path], replayed: Mapping[int, Path] | None = None
) -> tuple[list[CurveRow], list[int]]:
    """Rows of every size with a results file or a replay file (decoded figures win), and the sizes with
    neither (not measured yet)."""
    rows, missing = [], []
    for tokens, path in sorted(results.items()):
        decoded = []
        if path.is_file():
            decoded = [
                CurveRow(
                    tokens,
                    r["dataset"],
                    r["method"],
                    float(r["accept_len"]),
                    int(r["num_prompts"]),
                    int(r["lossless"]["identical"]),
                )
                for r in json.loads(path.read_text())["results"]
            ]
            decoded += _all_of_one(decoded)
        replay = (replayed or {}).get(tokens)
        have = {(r.dataset, r.method) for r in decoded}
        extra = (
            [r for r in _replayed_rows(tokens, replay) if (r.dataset, r.method) not in have]
            if replay is not None and replay.is_file()
            else []
        )
        if not decoded and not extra:
            missing.append(tokens)
        rows += decoded + extra
    return rows, missing


def _all_of_one(decoded: list[CurveRow]) -> list[CurveRow]:
    """An evaluation of one dataset has no 'all' rows (its rows are all of it); a replay always has them, so
    without these a one-dataset size would leave the 'all' table and the sweep to its replayed figures."""
    datasets = {r.dataset for r in decoded}
    if len(datasets) != 1 or "all" in datasets:
        return []
    return [replace(r, dataset="all") for r in decoded]


def _replayed_rows(tokens: int, path: Path) -> list[CurveRow]:
    """The rows of a replay file (drafter_shift.py --replay-only --out)."""
    doc = json.loads(path.read_text())
    rows = []
    for key, value in doc["accept_len"].items():
        dataset, method = key.split("/", 1)
        rows.append(CurveRow(tokens, dataset, method, float(value), int(doc["num_prompts"][dataset]), -1, True))
    return rows


def _cell(row: CurveRow) -> str:
    return f"{row.accept_len:.3f}" + ("†" if row.replayed else "")


def ngram_baseline(rows: list[CurveRow]) -> dict[str, CurveRow]:
    """Per dataset, the n-gram row of the smallest size that measured it."""
    out: dict[str, CurveRow] = {}
    for r in sorted(rows, key=lambda r: r.tokens):
        if r.method == NGRAM:
            out.setdefault(r.dataset, r)
    return out


def curve_markdown(rows: list[CurveRow], missing: list[int], validation: Mapping[int, Validation] | None = None) -> str:
    """One table per dataset: a row per size, a column per drafting method, the n-gram baseline, and in the table
    of all prompts each size's validation accept_len_est."""
    baseline, validation = ngram_baseline(rows), validation or {}
    methods = list(dict.fromkeys(r.method for r in rows if r.method != NGRAM))
    lines = ["# Data-scaling curve: acceptance length vs training tokens", ""]
    for dataset in dict.fromkeys(r.dataset for r in rows):
        by = {(r.tokens, r.method): r for r in rows if r.dataset == dataset}
        sizes = sorted({t for t, _ in by})
        with_val = dataset == "all"
        lines += [
            f"## {dataset}",
            "",
            "| training tokens | "
            + " | ".join(methods)
            + " | n-gram (no drafter) |"
            + (" validation accept_len_est |" if with_val else ""),
            "|---:|" + "---:|" * (len(methods) + 1 + with_val),
        ]
        base = _cell(baseline[dataset]) if dataset in baseline else "-"
        for tokens in sizes:
            cells = [_cell(by[tokens, m]) if (tokens, m) in by else "-" for m in methods]
            val = f" {validation_cell(validation.get(tokens))} |" if with_val else ""
            lines.append(f"| {token_label(tokens)} | " + " | ".join(cells) + f" | {base} |" + val)
        lines.append("")
    unlossless = [r for r in rows if not r.replayed and r.lossless_identical != r.num_prompts]
    if any(r.replayed for r in rows):
        lines.append("† replayed from an evaluation's greedy texts (teacher-forced drafter, no decode of its own).")
    lines.append(
        "Every decode token-identical to greedy."
        if not unlossless
        else "Not identical to greedy: "
        + ", ".join(
            f"{token_label(r.tokens)} {r.dataset} {r.method} ({r.lossless_identical}/{r.num_prompts})"
            for r in unlossless
        )
    )
    if missing:
        lines.append("Not measured yet: " + ", ".join(token_label(t) for t in missing) + ".")
    return "\n".join(lines) + "\n"


def plot_curve(rows: list[CurveRow], out: Path, dataset: str = "all") -> Path:
    """curve.png: acceptance length vs training tokens (log x) on one dataset, n-gram as a flat dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from infra.storage import atomic_path

    chosen = [r for r in rows if r.dataset == dataset] or rows
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for method in dict.fromkeys(r.method for r in chosen if r.method != NGRAM):
        points = sorted((r.tokens, r.accept_len, r.replayed) for r in chosen if r.method == method)
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "-", label=method)
        for filled in (True, False):  # decoded points filled, replayed ones hollow
            xs = [(t, a) for t, a, replay in points if replay != filled]
            ax.plot(
                [x[0] for x in xs],
                [x[1] for x in xs],
                "o",
                color=line.get_color(),
                fillstyle="full" if filled else "none",
            )
    base = ngram_baseline(chosen).get(chosen[0].dataset if chosen else dataset)
    if base is not None:
        ax.axhline(base.accept_len, color="gray", ls="--", label=f"n-gram ({base.accept_len:.2f})")
    ax.set(
        xscale="log",
        xlabel="training tokens",
        ylabel="acceptance length",
        title=f"acceptance vs training tokens ({chosen[0].dataset if chosen else dataset})",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out


def read_sweep(
    sweep: Mapping[str, Path], tokens: int, replayed: Mapping[str, Path] | None = None
) -> dict[str, list[CurveRow]]:
    """Rows of every recipe variant measured so far ('all' prompts; each trained on ``tokens``), by label;
    ``replayed``: each variant's replay file, for the methods its decode lacks (or without a decode)."""
    out = {}
    for label, path in sweep.items():
        replay = (replayed or {}).get(label)
        rows, missing = read_rows({tokens: path}, {tokens: replay} if replay is not None else None)
        if not missing:
            out[label] = [r for r in rows if r.dataset == "all"]
    return out


def sweep_markdown(
    rows: list[CurveRow],
    variants: Mapping[str, list[CurveRow]],
    largest: int,
    pending: list[str] = (),
    validation: Mapping[str, Validation] | None = None,
) -> str:
    """The recipe sweep at the largest size: a row per recipe (the baseline first; a variant with a validation but
    no acceptance too), a column per method and the validation, and a line naming the ``pending`` variants (not
    measured yet)."""
    validation = validation or {}
    recipes = {"baseline": [r for r in rows if r.tokens == largest and r.dataset == "all"], **variants}
    recipes |= {label: [] for label in validation if label not in recipes}
    methods = list(dict.fromkeys(r.method for rs in recipes.values() for r in rs if r.method != NGRAM))
    lines = [
        f"## Recipe sweep at {token_label(largest)} (all prompts)",
        "",
        "| recipe | " + " | ".join(methods) + " | lossless | validation accept_len_est |",
        "|---|" + "---:|" * len(methods) + "---|---:|",
    ]
    for label, rs in recipes.items():
        by = {r.method: r for r in rs}
        cells = [_cell(by[m]) if m in by else "-" for m in methods]
        ok = sum(r.lossless_identical for r in rs if r.method != NGRAM and not r.replayed)
        total = sum(r.num_prompts for r in rs if r.method != NGRAM and not r.replayed)
        lossless = f"{ok}/{total} identical" if total else "replayed, no decode" if rs else "not decoded"
        val = validation_cell(validation.get(label))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {lossless} | {val} |")
    if pending:
        lines += ["", f"Not measured yet: {', '.join(pending)}."]
    return "\n".join(lines) + "\n"


def write_curve_report(
    results: Mapping[int, Path],
    out_dir: Path,
    sweep: Mapping[str, Path] | None = None,
    replayed: Mapping[int, Path] | None = None,
    sweep_replayed: Mapping[str, Path] | None = None,
) -> dict[str, Path]:
    """curve.json, curve.md and (with any measured size) curve.png in ``out_dir``; ``sweep``: each recipe
    variant's results file (measured at the largest size), tabled when present; ``replayed`` (by tokens) and
    ``sweep_replayed`` (by label): the replay file of each size and variant, for the methods its results lack."""
    from infra.storage import atomic_write_json, atomic_write_text

    rows, missing = read_rows(results, replayed)
    largest = max(results, default=0)
    variants = read_sweep(sweep or {}, largest, sweep_replayed)
    size_val = {t: v for t, path in results.items() if (v := read_validation(run_of(path))) is not None}
    sweep_val = {
        label: v
        for label, path in {"baseline": results.get(largest), **(sweep or {})}.items()
        if path is not None and (v := read_validation(run_of(path))) is not None
    }
    pending = [label for label in sweep or {} if label not in variants and label not in sweep_val]
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "rows": [asdict(r) for r in rows],
        "not_measured": missing,
        "validation": {str(t): asdict(v) for t, v in size_val.items()},
        "sweep": {label: [asdict(r) for r in rs] for label, rs in variants.items()},
        "sweep_validation": {label: asdict(v) for label, v in sweep_val.items()},
        "sweep_not_measured": pending,
    }
    has_sweep = variants or set(sweep_val) - {"baseline"}
    markdown = curve_markdown(rows, missing, size_val) + (
        "\n" + sweep_markdown(rows, variants, largest, pending, sweep_val) if has_sweep else ""
    )
    outputs = {
        "json": atomic_write_json(out_dir / CURVE_DATA, payload),
        "markdown": atomic_write_text(out_dir / CURVE_REPORT, markdown),
    }
    if rows:
        outputs["plot"] = plot_curve(rows, out_dir / CURVE_PLOT)
    return outputs


def rows_of(curve_json: Path) -> list[CurveRow]:
    """The rows of a curve.json (write_curve_report's, or one kept with the docs), each checked."""
    try:
        doc = json.loads(Path(curve_json).read_text())
        return [CurveRow(**row) for row in doc["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(
            f"error: {curve_json}: not a curve.json with rows of {', '.join(CurveRow.__annotations__)} ({err!r})"
        ) from None


def main(argv: list[str] | None = None) -> None:
    """python3 lab/curve_report.py CURVE_JSON OUT_PNG [--dataset all]: draw curve.png again from a curve.json
    (one carried back from a GPU host, or docs/curve.json), without the runs it was read from."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("curve_json", type=Path)
    parser.add_argument("out_png", type=Path)
    parser.add_argument("--dataset", default="all", help="which dataset's rows to draw")
    args = parser.parse_args(argv)
    print(plot_curve(rows_of(args.curve_json), args.out_png, args.dataset))


if __name__ == "__main__":
    main()
