"""The stage registry is the one list of stages: the layout, format versions, CLI and entry points follow it."""

from __future__ import annotations

import argparse
import json

import pytest

from eagle3.run.layout import FORMAT_VERSIONS, STAGE_DIRS, RunLayout
from eagle3.run.registry import DATA_STAGES, STAGES, UNTIL_CHOICES, get_stage


def test_every_stage_has_a_folder_a_version_and_a_manifest_path(tmp_path):
    """Layout folders, format versions and registry entries name the same stages, in pipeline order."""
    names = [s.name for s in STAGES]
    assert names == list(STAGE_DIRS) == list(FORMAT_VERSIONS)
    assert RunLayout(tmp_path).manifest("tokenize") == tmp_path / "data" / "tokenize.manifest.json"
    assert RunLayout(tmp_path).manifest("evaluate") == tmp_path / "eval" / "evaluate.manifest.json"
    with pytest.raises(KeyError, match="unknown stage 'deploy'"):
        get_stage("deploy")


def test_until_choices_are_the_data_block_then_every_later_stage_then_deploy():
    """`until` stops after the data stages, after any later stage, or after the deploy benchmark."""
    assert DATA_STAGES == ("synthesize", "merge", "regenerate", "tokenize", "vocab")
    assert UNTIL_CHOICES == ("vocab", "capture", "train", "export", "evaluate", "deploy")


def _choices(parser: argparse.ArgumentParser, command: str, dest: str) -> tuple:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return tuple(next(a for a in sub._actions if a.dest == dest).choices)


def test_console_script_reads_its_stage_lists_from_the_registry():
    """`eagle3 run --until`, `eagle3 stage` and the forwarded stage commands come from the registry."""
    from flows.cli import build_parser

    parser = build_parser()
    assert _choices(parser, "run", "until") == UNTIL_CHOICES
    assert _choices(parser, "stage", "stage") == (*DATA_STAGES, "all")
    forwarded = {s.command: s.cli for s in STAGES if s.command}
    assert forwarded == {"export": "eagle3.export", "eval": "eagle3.evaluate.stage"}


def test_stage_main_prints_typed_results_as_json_and_user_errors_as_one_line(tmp_path, capsys):
    """The generic main prints to_json() of each result, holds the lock while running, exits 2 on bad input."""
    from eagle3.run.cli_args import add_config_args, stage_main
    from eagle3.run.stage import StageOutcome
    from infra.locks import LOCK_FILE, read_holder

    seen = []

    def run(cfg, args):
        seen.append(read_holder(cfg.run_dir / LOCK_FILE).get("owner"))  # the main holds the lock around run
        return [StageOutcome("merge", "k", tmp_path / "m.json", True, {"rows": 3}, {}), None]

    parser = add_config_args(argparse.ArgumentParser())
    stage_main(parser, ["--set", f"run.workdir={tmp_path}"], run, lock_owner="test", write_config=True)
    printed = json.loads(capsys.readouterr().out)
    assert seen == ["test"] and printed["stats"] == {"rows": 3} and printed["computed"] is True
    assert (tmp_path / "tiny" / "config.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        stage_main(parser, ["--set", "train.lr=-1"], run)
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("error: ")
