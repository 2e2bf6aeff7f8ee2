"""The end-of-run summary, read back from the run directory's manifests.

A run triggered through a deployment executes in a worker's subprocess, so the client that
follows it prints what the stages recorded on disk (the same manifests that make re-runs skip
work), not a Python return value.
"""

from __future__ import annotations

from typing import Any

from eagle3.config import RunConfig
from eagle3.data.stages import merge, tokenize, vocab
from eagle3.evaluate import stage as evaluate
from eagle3.export import stage as export
from eagle3.features import stage as capture
from eagle3.run.layout import RunLayout, run_layout
from eagle3.run.registry import DATA_STAGES, ONLINE_SKIP, get_stage
from eagle3.train import stage as train


def results_from_disk(cfg: RunConfig) -> dict[str, Any]:
    """{stage: {"computed": None, "stats": ...}} for every stage whose manifest exists."""
    from eagle3.run.stage import read_manifest

    layout = run_layout(cfg)
    results: dict[str, Any] = {"run_dir": str(layout.root.resolve())}
    for stage in DATA_STAGES:
        doc = read_manifest(get_stage(stage).manifest(layout.root))
        if doc:
            results[stage] = {"computed": None, "stats": doc.get("stats", {}), "outputs": doc.get("outputs", {})}
    captured = read_manifest(capture.STAGE.manifest(layout.root))
    if cfg.train.features == "online":
        results[capture.STAGE.name] = {"skipped": ONLINE_SKIP}
    elif captured:
        results[capture.STAGE.name] = {"stats": captured.get("stats", {})}
    trained = read_manifest(train.STAGE.manifest(layout.root))
    if trained:
        stats = trained.get("stats", {})
        results[train.STAGE.name] = {
            "last_train": stats.get("train"),
            "last_eval": stats.get("eval"),
            "manifest": stats,
        }
    exported = read_manifest(export.STAGE.manifest(layout.root))
    if exported:
        results[export.STAGE.name] = {"stats": exported.get("stats", {}), "dir": str(layout.export.resolve())}
    evaluation = read_manifest(layout.eval_results)  # any JSON file, or None
    if evaluation:
        results[evaluate.STAGE.name] = evaluation
    return results


def print_summary(result: dict[str, Any], wall_s: float | None = None, outcome: str = "finished") -> None:
    """The stats a user wants after a run, one block per stage (of a failed run: the stages it completed)."""
    print(f"\n== pipeline {outcome}" + (f" in {wall_s:.1f} s ==" if wall_s is not None else " =="))
    for stage in DATA_STAGES:
        res = result.get(stage)
        if not res:
            continue
        state = {True: "computed", False: "up to date, skipped", None: "complete"}[res.get("computed")]
        print(f"\n[{stage}] {state}")
        for key, value in _headline(res["stats"]).items():
            print(f"  {key:<28} {value}")
    captured, trained = result.get(capture.STAGE.name), result.get(train.STAGE.name)
    exported, evaluation = result.get(export.STAGE.name), result.get(evaluate.STAGE.name)
    if captured and captured.get("skipped"):
        print(f"\n[{capture.STAGE.name}] skipped: {captured['skipped']}")
    elif captured:
        print(f"\n[{capture.STAGE.name}]")
        for key in ("num_shards", "num_samples", "num_tokens", "num_bytes", "bytes_per_token", "aux_layer_ids"):
            print(f"  {key:<28} {captured['stats'].get(key)}")
    if trained:
        _print_train(trained)
    if exported:
        print(f"\n[{export.STAGE.name}]\n  {'directory':<28} {exported['dir']}")
        if selection := exported["stats"].get("selection"):
            print(f"  {'checkpoint':<28} step {selection['step']} ({selection['reason']})")
    if evaluation:
        _print_eval(evaluation)


def print_stage_seconds(cfg: RunConfig, flow_run_id: str) -> None:
    """The seconds each stage of flow run ``flow_run_id`` took (the run summary's rows, which the pipeline saved in
    the run directory); nothing when that run saved none."""
    from eagle3.run.summary import duration_lines, read_stage_runs

    runs = read_stage_runs(run_layout(cfg).summary, flow_run_id)
    if runs:
        print("\n== seconds per stage ==")
        print("\n".join(duration_lines(runs)), flush=True)


def _print_train(summary: dict[str, Any]) -> None:
    """Train and validation accuracy per TTT step, and the acceptance-length estimate."""
    print(f"\n[{train.STAGE.name}]")
    for name, rec in (("last train step", summary.get("last_train")), ("last validation", summary.get("last_eval"))):
        if not rec:
            continue
        accs = " ".join(f"acc_{k}={rec[f'acc_{k}']:.3f}" for k in range(16) if f"acc_{k}" in rec)
        print(f"  {name:<20} step {rec.get('step')}  loss {rec.get('loss', float('nan')):.4f}  {accs}")
    last_eval = summary.get("last_eval") or {}
    if "accept_len_est" in last_eval:
        print(
            f"  {'accept_len_est (val)':<20} {last_eval['accept_len_est']:.3f}  "
            f"(unigram baseline acc_0 {last_eval.get('unigram_acc_0', float('nan')):.3f})"
        )
    best = summary.get("manifest", {}).get("best_step")
    if best is not None:
        print(f"  {'best validation':<20} step {best}  accept_len_est {summary['manifest']['best_accept_len_est']:.3f}")


def _print_eval(evaluation: dict[str, Any]) -> None:
    """Measured acceptance length per dataset and method (from eval/results.json)."""
    print(f"\n[{evaluate.STAGE.name}] measured by speculative decoding against the target (bonus token included)")
    for row in eval_rows(evaluation):
        print(
            f"  {row['dataset']:<10} {row['method']:<14} accept_len {row['accept_len']:<7} "
            f"per position {row['per_position']}  speedup {row['speedup']}x  lossless {row['identical']} identical, "
            f"{row['mismatch']} mismatch, {row['near_tie']} near-tie"
        )


ACCEPTANCE_COLUMNS = ("dataset", "method", "prompts", "accept_len", "per_position", "tokens_per_s", "speedup")
LOSSLESS_COLUMNS = ("dataset", "method", "identical", "mismatch", "near_tie")


def eval_rows(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (dataset, method) of eval/results.json, rounded for display (ACCEPTANCE_COLUMNS and
    LOSSLESS_COLUMNS: the report shows them as two tables)."""
    rows = []
    for res in evaluation.get("results", []):
        lossless = res.get("lossless", {})
        rows.append(
            {
                "dataset": res.get("dataset"),
                "method": res.get("method"),
                "prompts": res.get("num_prompts"),
                "accept_len": round(res.get("accept_len", float("nan")), 3),
                "per_position": " / ".join(f"{p:.3f}" for p in res.get("per_position", [])),
                "tokens_per_s": round(res.get("tokens_per_s", float("nan")), 2),
                "speedup": round(res.get("speedup", float("nan")), 2),
                "identical": f"{lossless.get('identical')}/{res.get('num_prompts')}",
                "mismatch": lossless.get("mismatch"),
                "near_tie": lossless.get("near_tie"),
            }
        )
    return rows


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...] | None = None) -> list[str]:
    """A markdown table of ``columns`` (default: the first row's keys), at most MAX_TABLE_COLUMNS wide."""
    # tasks.artifacts imports prefect: not at module level, since flows.cli imports this module before it points
    # PREFECT_API_URL at the local server, and Prefect reads its settings once, at import
    from tasks.artifacts import MAX_TABLE_COLUMNS

    if not rows:
        return []
    head = list(columns or rows[0])
    if len(head) > MAX_TABLE_COLUMNS:
        raise ValueError(f"table of {len(head)} columns would be cut off in the UI: {head}")
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(str(r.get(k, "")) for k in head) + " |" for r in rows
    ]


def data_section(res: dict[str, Any]) -> list[str]:
    """Markdown of the data stages' stats: per-source counts, rejects by reason, tokenization, draft vocab."""
    lines: list[str] = []
    merged = res.get(merge.STAGE.name, {}).get("stats", {})
    if merged:
        per_source = [
            {"source": name, **{k: s.get(k) for k in ("read", "kept", "rejected", "train", "val", "num_turns")}}
            for name, s in {**merged.get("sources", {}), "(total)": merged.get("total", {})}.items()
        ]
        reasons = {r: n for r, n in merged.get("total", {}).get("rejected_by_reason", {}).items() if n}
        lines += (
            ["## Data", ""]
            + _table(per_source)
            + [
                "",
                "rejected by reason: "
                + (", ".join(f"{r} {n:,}" for r, n in sorted(reasons.items())) if reasons else "none")
                + "",
                "",
            ]
        )
    tok = res.get(tokenize.STAGE.name, {}).get("stats", {})
    if tok:
        cut = {r: n for r, n in tok.get("rejected_by_reason", {}).items() if n}
        lines += [
            "## Tokenization",
            f"{tok.get('rows_written', 0):,} of {tok.get('rows_in', 0):,} rows written "
            f"({tok.get('rows_truncated', 0):,} truncated, {tok.get('rows_rejected', 0):,} rejected"
            + (": " + ", ".join(f"{r} {n:,}" for r, n in sorted(cut.items())) if cut else "")
            + "); "
            f"{tok.get('num_tokens', 0):,} tokens, {tok.get('num_loss_tokens', 0):,} of them trained on; "
            f"end of turn `{tok.get('end_of_turn_text')}`",
            "",
        ]
    drafted = res.get(vocab.STAGE.name, {}).get("stats", {})
    if drafted:
        lines += [
            "## Draft vocabulary",
            f"{drafted.get('draft_vocab_size', 0):,} of "
            f"{drafted.get('target_vocab_size', 0):,} target tokens; they cover "
            f"{drafted.get('coverage', float('nan')):.3f} of the "
            f"{drafted.get('num_train_loss_tokens', 0):,} trained-on tokens of the train split "
            f"({drafted.get('num_distinct_tokens', 0):,} distinct)",
            "",
        ]
    return lines


def selection_lines(train_stats: dict[str, Any], export_stats: dict[str, Any]) -> list[str]:
    """The best validation (and measurement) of the run and the checkpoint the export shipped, with the reason."""
    lines = []
    if train_stats.get("best_step") is not None:
        lines.append(
            f"best validation: step {train_stats['best_step']}, accept_len_est "
            f"{train_stats['best_accept_len_est']:.3f} (of {len(train_stats.get('eval_history') or [])} "
            "validations)"
        )
    if train_stats.get("best_measured_step") is not None:  # train.measured
        early = ", then stopped early by train.measured.patience" if train_stats["stopped_early"] else ""
        lines.append(
            f"best measured acceptance: step {train_stats['best_measured_step']}, accept_len "
            f"{train_stats['best_measured_accept_len']:.3f} (of {len(train_stats['measured_history'])} "
            f"measurements{early})"
        )
    if export_stats.get("selection"):
        sel = export_stats["selection"]
        lines.append(f"exported: `{sel['checkpoint']}` (step {sel['step']}): {sel['reason']}")
    return [f"- {line}" for line in lines] + ([""] if lines else [])


def render_run_report(cfg: RunConfig) -> str:
    """The run report: data stats, capture throughput, training curves, measured acceptance (from the run dir)."""
    from tasks.artifacts import markdown_image

    res, layout = results_from_disk(cfg), run_layout(cfg)
    lines = [f"# Run report `{cfg.run.name}`", "", f"run directory `{layout.root.resolve()}`", ""] + data_section(res)
    cap = res.get(capture.STAGE.name, {}).get("stats", {})
    if cap:
        lines += [
            "## Capture",
            f"{cap.get('num_samples')} samples, {cap.get('num_tokens')} tokens, "
            f"{cap.get('num_bytes', 0) / 1e6:.1f} MB, {cap.get('bytes_per_token')} bytes/token",
            "",
        ]
    trained = res.get(train.STAGE.name)
    if trained:
        last_train, last_eval = trained.get("last_train") or {}, trained.get("last_eval") or {}
        lines += [
            "## Training",
            f"last step {last_train.get('step')}: {last_train.get('tokens_per_s', 0):,.0f} "
            f"tokens/s; validation acc_0 {last_eval.get('acc_0', float('nan')):.3f}, accept_len_est "
            f"{last_eval.get('accept_len_est', float('nan')):.3f}",
            "",
        ]
        lines += selection_lines(trained.get("manifest", {}), res.get(export.STAGE.name, {}).get("stats", {}))
        lines += [markdown_image(p) for p in layout.train_plots if p.is_file()]
    if res.get(evaluate.STAGE.name):
        lines += ["", "## Measured acceptance (speculative decoding against the target)", ""]
        rows = eval_rows(res[evaluate.STAGE.name])
        lines += _table(rows, ACCEPTANCE_COLUMNS) + [
            "",
            "Lossless check against the target's own greedy output: identical, near_tie (first difference "
            "where the target's logits hardly differ), mismatch (any other difference)",
            "",
        ]
        lines += _table(rows, LOSSLESS_COLUMNS)
        plot = layout.eval_plot
        lines += ["", markdown_image(plot)] if plot.is_file() else []
    lines += appendix_lines(layout)
    if layout.deploy_report.is_file():
        lines += ["", layout.deploy_report.read_text()]
    return "\n".join(lines) + "\n"


def appendix_lines(layout: RunLayout) -> list[str]:
    """Each page in the run's appendix/ (name order) as a section: its headings one level deeper (its title a
    section of this report), its plot <name>.png below it."""
    from tasks.artifacts import markdown_image

    lines: list[str] = []
    for page in sorted(layout.appendix.glob("*.md")):
        lines += ["", *(f"#{line}" if line.startswith("#") else line for line in page.read_text().splitlines())]
        plot = page.with_suffix(".png")
        lines += ["", markdown_image(plot)] if plot.is_file() else []
    return lines


def _headline(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict) and len(value) <= 12:
            out.update(_headline(value, f"{prefix}{key}."))
        elif not isinstance(value, (dict, list)):
            out[f"{prefix}{key}"] = f"{value:,.3f}" if isinstance(value, float) else value
    return out
