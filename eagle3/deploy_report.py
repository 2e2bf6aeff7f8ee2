"""The deploy stage's report: each speculative server's benchmark compared with the baseline's, checked, written.

    write_report    the comparison per EAGLE-3 (or DFlash) setting and concurrency level (infra.sglang_compare),
                    the per-dataset table, SGLang's accept length against eagle3 eval's (eagle3.deploy_checks);
                    SGLang's n-gram server (serve.ngram) as one more section, its accept length shown beside
                    eagle3 eval's n-gram method (another implementation), never checked against it;
                    <run>/deploy/results.json and report.md, MeasurementError when the figures fail their checks
    recorded_runs   the server runs a results.json holds, so the report can be built again without serving
                    (``python -m eagle3.deploy --report-only``, after an evaluation run on another machine)

The stage (eagle3.deploy) serves and benchmarks, then writes this report and, its figures checked, its manifest.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from eagle3.config import ConfigError, RunConfig
from eagle3.deploy_checks import (
    NGRAM,
    NGRAM_LABEL,
    AcceptCheck,
    NgramBeside,
    SameTextCheck,
    accept_checks,
    check_errors,
    drafter_label,
    ngram_beside_eval,
    render_checks,
    render_ngram_beside,
    same_text_checks,
)
from eagle3.deploy_records import DeployReport, ServerRun
from eagle3.run.layout import REPORT_FILE, RESULTS_FILE, run_layout


def report_context(cfg: RunConfig, baseline: ServerRun, speculative: Sequence[ServerRun]) -> dict[str, str]:
    """The report's header lines: run, every command line, and a NOTE when the servers were not SGLang."""
    from infra.sglang import LAUNCH_MODULE

    context = {"run": cfg.run.name, "baseline server": baseline.argv}
    context |= {
        f"{NGRAM_LABEL} server" if run.trio == NGRAM else f"{drafter_label(cfg)} server {run.trio}": run.argv
        for run in speculative
    }
    if cfg.server.launch_module != LAUNCH_MODULE:
        context["NOTE"] = (
            f"servers launched by {cfg.server.launch_module}, not {LAUNCH_MODULE}: "
            "these figures are not SGLang measurements"
        )
    return context


def _section(
    cfg: RunConfig, baseline: ServerRun, run: ServerRun
) -> tuple[list[dict[str, Any]], str, list[AcceptCheck | SameTextCheck | NgramBeside], list[str]]:
    """One speculative server: level rows, its markdown, its accept checks (the n-gram server: its accept lengths
    beside eagle3 eval's n-gram, unchecked) and what is wrong with its figures."""
    from infra.sglang_bench import MeasurementError
    from infra.sglang_compare import compare, compare_groups, render_group_table, render_report

    errors: list[str] = []
    ngram = run.trio == NGRAM
    label = NGRAM_LABEL if ngram else drafter_label(cfg)
    heading = f"## {label}" if ngram else f"## {label} {run.trio}"
    try:
        rows = compare(baseline.result, run.result)
    except MeasurementError as exc:
        return [], f"{heading}\n\nnot comparable: {exc}\n", [], [f"{run.trio}: {exc}"]
    setting = {f"{label} setting": _ngram_setting(run) if ngram else str(run.trio)}
    markdown = render_report(rows, baseline.result, run.result, setting, label)
    markdown = markdown.replace(f"# {label} deploy benchmark", heading, 1)
    if len(set(run.groups)) > 1 or cfg.serve.prompts == "evaluation":
        groups = compare_groups(baseline.result, run.result, list(run.groups))
        markdown += "\n" + render_group_table(groups, label, baseline.result.settings.sampled)
    level_rows = [{"trio": run.trio} | asdict(r) for r in rows]
    if ngram:  # another algorithm than eagle3 eval's n-gram: shown beside it, never checked
        beside, beside_skipped = ngram_beside_eval(cfg, run)
        return level_rows, markdown + render_ngram_beside(beside, beside_skipped), list(beside), errors
    checks, skipped = accept_checks(cfg, run)
    same, same_skipped = same_text_checks(cfg, run) if checks else ([], None)
    if checks:
        markdown += render_checks(checks, same, same_skipped)
    else:
        markdown += f"\nAccept length not compared with eagle3 eval: {skipped}\n"
    errors += check_errors(checks, same, cfg.serve.accept_tolerance)
    return level_rows, markdown, [*checks, *same], errors


def _ngram_setting(run: ServerRun) -> str:
    """The n-gram server's settings as its /server_info reported them (the command line has them too)."""
    info = run.result.server_settings
    if info.get("speculative_ngram_max_bfs_breadth") is None:  # recorded before these settings were
        return "SGLang NGRAM (settings: its command line above)"
    return (
        f"SGLang NGRAM, {info.get('speculative_num_draft_tokens')} draft tokens verified per step, breadth "
        f"{info.get('speculative_ngram_min_bfs_breadth')}-{info.get('speculative_ngram_max_bfs_breadth')}, trie "
        f"depth {info.get('speculative_ngram_max_trie_depth')}, match {info.get('speculative_ngram_match_type')}"
    )


def write_report(cfg: RunConfig, baseline: ServerRun, runs: Sequence[ServerRun]) -> DeployReport:
    """Compare each speculative run with the baseline and write results.json + report.md; MeasurementError (after
    results.json marked invalid) when figures cannot be right (speedup above the acceptance length, runs that
    differ in settings) or SGLang's accept length is further than serve.accept_tolerance from eagle3 eval's (for
    an EAGLE-3 or DFlash setting; the n-gram server's is only shown beside eagle3 eval's n-gram)."""
    from infra.sglang_bench import MeasurementError
    from infra.storage import atomic_write_json, atomic_write_text

    out = run_layout(cfg).deploy
    context = report_context(cfg, baseline, runs)
    sections = [_section(cfg, baseline, run) for run in runs]
    rows = [row for section in sections for row in section[0]]
    found = [check for section in sections for check in section[2]]
    checks = [c for c in found if not isinstance(c, NgramBeside)]
    errors = [error for section in sections for error in section[3]]
    head = [f"# {drafter_label(cfg)} deploy benchmark", ""] + [f"* {k}: `{v}`" for k, v in context.items()] + [""]
    markdown = "\n".join(head) + "\n" + "\n".join(section[1] for section in sections)
    doc: dict[str, Any] = {
        "context": context,
        "baseline": baseline.to_json(),
        "speculative": [run.to_json() for run in runs],
        "comparison": rows,
        "accept_checks": [asdict(c) for c in checks if isinstance(c, AcceptCheck)],
        "same_text_checks": [asdict(c) for c in checks if isinstance(c, SameTextCheck)],
        "ngram_beside_eval": [asdict(c) for c in found if isinstance(c, NgramBeside)],
        "valid": not errors,
        "errors": errors,
    }
    results = atomic_write_json(out / RESULTS_FILE, doc)
    report = DeployReport(results, atomic_write_text(out / REPORT_FILE, markdown), rows, markdown, checks)
    if errors:
        raise MeasurementError(
            f"deploy figures failed their checks (report written to {report.report}):\n  " + "\n  ".join(errors)
        )
    return report


def recorded_runs(cfg: RunConfig) -> tuple[ServerRun, list[ServerRun]]:
    """(baseline, speculative runs) as <run>/deploy/results.json recorded them; ConfigError when there is none."""
    path = run_layout(cfg).deploy / RESULTS_FILE
    if not path.is_file():
        raise ConfigError(f"no {path}: run the deploy benchmark first (python -m eagle3.deploy without --report-only)")
    doc = json.loads(path.read_text())
    try:
        return ServerRun.from_json(doc["baseline"]), [ServerRun.from_json(run) for run in doc["speculative"]]
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a deploy results file ({type(exc).__name__}: {exc})") from exc
