"""A run directory is relocatable: a finished run moved to another path (run.workdir updated, the old path gone)
exports and evaluates as before, every stage a no-op, and no file of the run names the old location."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3.config import load_config
from infra.storage import forget_hashes

OVERRIDES = [
    "train.max_steps=2",
    "train.eval_every_steps=2",
    "train.checkpoint_every_steps=2",
    "evaluate.num_prompts=1",
    "evaluate.max_new_tokens=8",
    "evaluate.datasets=[mtbench]",
]


def _cfg(workdir: Path, cache: Path):
    return load_config("tiny", [f"run.workdir={workdir}", f"target.cache_dir={cache}", *OVERRIDES])


def _stage_cli(main, capsys, cfg) -> str:
    """Run a stage's ``main`` on the run's config file as a user would; its stdout (exit 0 required)."""
    capsys.readouterr()
    try:
        main(["--config", str(cfg.run_dir / "config.json")])
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr()
    return capsys.readouterr().out


def test_a_finished_run_moved_elsewhere_exports_and_evaluates_as_a_no_op(tmp_path, capsys):
    from eagle3.evaluate.stage import main as evaluate_main
    from eagle3.evaluate.stage import run_evaluate
    from eagle3.export.stage import main as export_main
    from eagle3.export.stage import run_export
    from eagle3.features.capture import run_capture
    from eagle3.run.layout import write_run_config
    from eagle3.run.registry import STAGES
    from eagle3.run.stages import run_all
    from eagle3.train.loop import train

    cache = tmp_path / "_targets"
    old = _cfg(tmp_path / "a", cache)
    run_all(old)
    run_capture(old)
    assert train(old).status == "done"
    run_export(old)
    run_evaluate(old)
    old_root = old.run_dir

    shutil.move(tmp_path / "a", tmp_path / "b")  # moved, old path gone
    forget_hashes()
    new = _cfg(tmp_path / "b", cache)
    write_run_config(new)  # what every entry point writes; the stages below read it through --config
    assert not old_root.exists() and new.run_dir.is_dir()

    out = _stage_cli(export_main, capsys, new)
    assert "export up to date" in out and str(old_root) not in out
    assert str(new.run_dir / "export" / "sglang") in out
    out = _stage_cli(evaluate_main, capsys, new)
    assert '"computed": false' in out and str(old_root) not in out
    incomplete = [s.name for s in STAGES if s.skip_reason(new) is None and not s.is_complete(new)]
    assert incomplete == []
    assert train(new).status == "up_to_date"

    # No manifest, export folder, progress file or report of the run names where it used to be.
    stale = [
        str(p.relative_to(new.run_dir))
        for p in new.run_dir.rglob("*")
        if p.is_file() and p.suffix in (".json", ".jsonl", ".md") and str(old_root) in p.read_text()
    ]
    assert stale == []

    # A manifest written before paths were stored relative (absolute, inside the old run dir of the same name) is
    # read against the run's current location.
    manifest = new.run_dir / "export" / "export.manifest.json"
    doc = json.loads(manifest.read_text())
    for fmt, entry in doc["stats"]["formats"].items():
        entry["dir"] = str(old_root / "export" / fmt)
    manifest.write_text(json.dumps(doc))
    out = _stage_cli(export_main, capsys, new)
    assert "export up to date" in out and str(new.run_dir / "export" / "sglang") in out


@pytest.mark.parametrize(
    "stored, expected",
    [
        ("export/sglang", "export/sglang"),
        ("/old/place/tiny/export/sglang", "export/sglang"),  # absolute, inside an old run dir of the same name
        ("/old/tiny/runs/tiny/train/checkpoints/step-4", "train/checkpoints/step-4"),  # the name twice: the run's own
    ],
)
def test_stored_paths_resolve_against_the_current_run_dir(tmp_path, stored, expected):
    from eagle3.run.layout import resolve_in_run

    root = tmp_path / "runs" / "tiny"
    (root / expected).mkdir(parents=True)
    assert resolve_in_run(root, stored) == root / expected


def test_paths_outside_the_run_stay_absolute_and_inside_become_relative(tmp_path):
    from eagle3.run.layout import resolve_in_run, run_relative

    root = tmp_path / "runs" / "tiny"
    assert run_relative(root, root / "export" / "sglang") == "export/sglang"
    assert run_relative(root, tmp_path / "_targets" / "t") == str(tmp_path / "_targets" / "t")
    assert resolve_in_run(root, str(tmp_path / "_targets" / "t")) == tmp_path / "_targets" / "t"
