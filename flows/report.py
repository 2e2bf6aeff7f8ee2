"""The end-of-run summary, read back from the run directory's manifests.

A run triggered through a deployment executes in a worker's subprocess, so the client that
follows it prints what the stages recorded on disk (the same manifests that make re-runs skip
work), not a Python return value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig

DATA_STAGES = ("merge", "regenerate", "tokenize", "vocab")


def _manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _json(path: Path) -> dict[str, Any] | None:
    return _manifest(path)


def results_from_disk(cfg: RunConfig) -> dict[str, Any]:
    """{stage: {"computed": None, "stats": ...}} for every stage whose manifest exists."""
    from eagle3.stages import manifest_path

    run = cfg.run_dir
    results: dict[str, Any] = {"run_dir": str(run.resolve())}
    for stage in DATA_STAGES:
        doc = _manifest(manifest_path(cfg, stage))
        if doc:
            results[stage] = {"computed": None, "stats": doc.get("stats", {}), "outputs": doc.get("outputs", {})}
    capture = _manifest(run / "features" / "capture.manifest.json")
    if capture:
        results["capture"] = {"stats": capture.get("stats", {})}
    train = _manifest(run / "train" / "train.manifest.json")
    if train:
        stats = train.get("stats", {})
        results["train"] = {"last_train": stats.get("train"), "last_eval": stats.get("eval"), "manifest": stats}
    export = _manifest(run / "export" / "export.manifest.json")
    if export:
        results["export"] = {"stats": export.get("stats", {}), "dir": str((run / "export").resolve())}
    evaluation = _json(run / "eval" / "results.json")
    if evaluation:
        results["evaluate"] = evaluation
    return results


def print_summary(result: dict[str, Any], wall_s: float | None = None) -> None:
    """The stats a user wants after a run, one block per stage."""
    print("\n== pipeline finished" + (f" in {wall_s:.1f} s ==" if wall_s is not None else " =="))
    for stage in DATA_STAGES:
        res = result.get(stage)
        if not res:
            continue
        state = {True: "computed", False: "up to date, skipped", None: "complete"}[res.get("computed")]
        print(f"\n[{stage}] {state}")
        for key, value in _headline(res["stats"]).items():
            print(f"  {key:<28} {value}")
    if result.get("capture"):
        print("\n[capture]")
        for key in ("num_shards", "num_samples", "num_tokens", "num_bytes", "bytes_per_token", "aux_layer_ids"):
            print(f"  {key:<28} {result['capture']['stats'].get(key)}")
    if result.get("train"):
        _print_train(result["train"])
    if result.get("export"):
        print(f"\n[export]\n  {'directory':<28} {result['export']['dir']}")
    if result.get("evaluate"):
        _print_eval(result["evaluate"])


def _print_train(train: dict[str, Any]) -> None:
    """Train and validation accuracy per TTT step, and the acceptance-length estimate."""
    print("\n[train]")
    for name, rec in (("last train step", train.get("last_train")), ("last validation", train.get("last_eval"))):
        if not rec:
            continue
        accs = " ".join(f"acc_{k}={rec[f'acc_{k}']:.3f}" for k in range(16) if f"acc_{k}" in rec)
        print(f"  {name:<20} step {rec.get('step')}  loss {rec.get('loss', float('nan')):.4f}  {accs}")
    last_eval = train.get("last_eval") or {}
    if "accept_len_est" in last_eval:
        print(f"  {'accept_len_est (val)':<20} {last_eval['accept_len_est']:.3f}  "
              f"(unigram baseline acc_0 {last_eval.get('unigram_acc_0', float('nan')):.3f})")


def _print_eval(evaluation: dict[str, Any]) -> None:
    """Measured acceptance length per dataset and method (from eval/results.json)."""
    print("\n[evaluate] measured by speculative decoding against the target (lossless check included)")
    for row in eval_rows(evaluation):
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))


def eval_rows(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per (dataset, method) of eval/results.json."""
    rows = []
    for res in evaluation.get("results", []):
        rows.append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()
                     if isinstance(v, (int, float, str, bool))})
    return rows


def _headline(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict) and len(value) <= 12:
            out.update(_headline(value, f"{prefix}{key}."))
        elif not isinstance(value, (dict, list)):
            out[f"{prefix}{key}"] = f"{value:,.3f}" if isinstance(value, float) else value
    return out
