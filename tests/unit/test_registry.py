"""The stage registry is the one list of stages: the layout, format versions, CLI and entry points follow it."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from eagle3.run import registry
from eagle3.run.layout import RunLayout
from eagle3.run.registry import DATA_STAGES, STAGES, UNTIL_CHOICES, StageSpec, get_stage
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_module_has_the_same_shape(tmp_path):
    """Each registered module defines STAGE, SECTION, DESCRIPTION, skip_reason, key, run and main; its manifest
    sits in its folder; the names are unique and in pipeline order."""
    names = [s.name for s in STAGES]
    assert names == [
        "synthesize",
        "merge",
        "regenerate",
        "tokenize",
        "vocab",
        "capture",
        "train",
        "export",
        "evaluate",
        "deploy",
    ]
    for spec in STAGES:
        for attr in ("STAGE", "SECTION", "DESCRIPTION", "skip_reason", "key", "run", "main"):
            assert hasattr(spec.module, attr), f"{spec.module.__name__} lacks {attr}"
        assert spec.manifest(tmp_path) == RunLayout(tmp_path).manifest(spec.module.STAGE)
    assert get_stage("tokenize").manifest(tmp_path) == tmp_path / "data" / "tokenize.manifest.json"
    assert get_stage("evaluate").manifest(tmp_path) == tmp_path / "eval" / "evaluate.manifest.json"
    assert get_stage("deploy").manifest(tmp_path) == tmp_path / "deploy" / "deploy.manifest.json"
    assert {s.name: s.version for s in STAGES if s.version != 1} == {"regenerate": 2, "tokenize": 2}
    with pytest.raises(KeyError, match="unknown stage 'toy'"):
        get_stage("toy")


def test_registry_and_the_stage_modules_load_without_torch():
    """The console script and the flows import the registry: it imports every stage module, and none of them
    imports torch at module level (their work does, when it runs)."""
    code = "import sys, eagle3.run.registry, flows.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_until_choices_are_the_data_block_then_every_later_stage():
    """`until` stops after the data stages (all or none), or after any later stage (deploy: the last)."""
    assert DATA_STAGES == ("synthesize", "merge", "regenerate", "tokenize", "vocab")
    assert UNTIL_CHOICES == ("vocab", "capture", "train", "export", "evaluate", "deploy")
    assert [s.name for s in registry.stages_until("capture")] == [*DATA_STAGES, "capture"]


def _choices(parser: argparse.ArgumentParser, command: str, dest: str) -> tuple:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return tuple(next(a for a in sub._actions if a.dest == dest).choices)


def test_console_script_reads_its_stage_lists_from_the_registry():
    """`eagle3 run --until`, `eagle3 stage` (every stage, and `all`) and the forwarded stage commands come from
    the registry."""
    from flows.cli import build_parser

    parser = build_parser()
    assert _choices(parser, "run", "until") == UNTIL_CHOICES
    assert _choices(parser, "stage", "stage") == (*(s.name for s in STAGES), "all")
    forwarded = {s.command: s.cli for s in STAGES if s.command}
    assert forwarded == {"export": "eagle3.export.stage", "eval": "eagle3.evaluate.stage"}


def test_the_pipeline_runs_every_registry_stage_once_in_registry_order():
    """Each stage is run by exactly one part of the pipeline (a data task, capture or training, a step of the deploy
    subflow); the deploy subflow's steps follow the registry, and `until` reaches the steps of its stages."""
    from flows.deploy import ALL_STEPS, STEP_STAGES
    from flows.pipeline import MODEL_RUNS, deploy_steps
    from tasks.data import DATA_TASKS

    runs = [*(m.STAGE.name for m in DATA_TASKS), *(m.STAGE.name for m in MODEL_RUNS), *STEP_STAGES.values()]
    assert sorted(runs) == sorted(s.name for s in STAGES)
    assert list(STEP_STAGES.values()) == [s.name for s in STAGES if s.name in STEP_STAGES.values()]
    assert {u: deploy_steps(u) for u in UNTIL_CHOICES} == {
        "vocab": [],
        "capture": [],
        "train": [],
        "export": ["export"],
        "evaluate": ["export", "evaluate"],
        "deploy": list(ALL_STEPS),
    }
    assert ALL_STEPS == ("export", "evaluate", "benchmark")  # the names `steps` takes (users' scripts pass them)


def test_stage_facts_the_harnesses_read(tmp_path):
    """The registry says which stages resume after a kill and which write the same bytes in every run (the kill
    harness's checks), and where each writes (the run summary)."""
    assert [s.name for s in STAGES if s.resumable] == ["regenerate", "capture", "train", "evaluate"]
    assert [s.name for s in STAGES if s.reproducible] == ["merge", "regenerate", "tokenize", "vocab", "capture"]
    assert get_stage("tokenize").output(tmp_path) == tmp_path / "data" / "tokenized.parquet"
    assert get_stage("capture").output(tmp_path) == tmp_path / "features"  # no output(): the stage's folder


# ------------------------------------------------------------------------------------ adding a stage


def _toy_module() -> types.ModuleType:
    """A stage as a new module would write it: it counts the merged conversations into toy/count.json."""
    toy = types.ModuleType("toy_stage")
    toy.STAGE = StageId("toy", "toy")
    toy.SECTION = None
    toy.DESCRIPTION = "count the merged conversations"
    toy.calls = []

    def key(cfg):
        return stage_key(toy.STAGE, {}, [get_stage("merge").manifest(cfg.run_dir)])

    def run(cfg, progress=None, force=False, known_key=None):
        def compute():
            toy.calls.append(cfg.run.name)
            out = cfg.run_dir / "toy" / "count.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"rows": 3}))
            return {"count": out}, {"rows": 3}

        return run_stage(toy.STAGE, toy.STAGE.manifest(cfg.run_dir), known_key or key(cfg), compute, force=force)

    def main(argv=None):
        from eagle3.run.cli_args import add_config_args, stage_main

        parser = add_config_args(argparse.ArgumentParser())
        parser.add_argument("--force", action="store_true")
        stage_main(parser, argv, lambda cfg, args: run(cfg, force=args.force), lock_owner="toy")

    toy.skip_reason, toy.key, toy.run, toy.main = (lambda cfg: None), key, run, main
    return toy


def test_a_toy_stage_added_to_the_registry_runs_through_the_same_runner_cli_and_cache(tmp_path, monkeypatch, capsys):
    """A new stage is its module plus one registry line: `eagle3 stage toy` runs it, its key reads its input's
    manifest, a second run is skipped (also for Prefect's cache key), and the pipeline's `until` offers it."""
    from eagle3.config import load_config
    from flows.cli import build_parser
    from flows.cli import main as cli_main
    from tasks.stage_cache import up_to_date_key

    toy = _toy_module()
    stages = (*STAGES, StageSpec(toy))
    monkeypatch.setattr(registry, "STAGES", stages)
    monkeypatch.setattr(registry, "BY_NAME", {s.name: s for s in stages})
    assert "toy" in _choices(build_parser(), "stage", "stage")
    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])
    args = ["--preset", "tiny", "--set", f"run.workdir={tmp_path}"]
    with pytest.raises(SystemExit) as done:
        cli_main(["stage", "merge", *args])
    assert done.value.code == 0
    assert up_to_date_key("toy", cfg) is None  # never ran: the task would run
    with pytest.raises(SystemExit):
        cli_main(["stage", "toy", *args])
    capsys.readouterr()
    assert toy.calls == ["tiny"] and json.loads((cfg.run_dir / "toy" / "count.json").read_text()) == {"rows": 3}
    assert get_stage("toy").is_complete(cfg) and up_to_date_key("toy", cfg) == get_stage("toy").key(cfg)
    outcome = get_stage("toy").run(cfg)
    assert isinstance(outcome, StageOutcome) and not outcome.computed and toy.calls == ["tiny"]


# --------------------------------------------------------------------------- one list of stages

CODE_DIRS = ("eagle3", "infra", "flows", "tasks", "deployments", "scripts")
STAGE_CALLS = {
    "get_stage",
    "manifest",
    "manifest_name",
    "stage_dir",
    "stage_key",
    "run_stage",
    "write_manifest",
    "skipped_outcome",
    "stage_cache_key",
    "up_to_date_key",
    "StageId",
    "is_complete",
    "key_for",
    "manifest_path",
    "from_manifest",
    "StageOutcome",
}
"""Calls whose string arguments name a stage."""
LOOKUPS = {"get", "pop", "setdefault"}
"""Methods whose first argument is a key: ``results.get("merge")`` picks a stage's result by its name."""


def stage_name_uses(path: Path, names: set[str]) -> list[str]:
    """'file:line name' for every place ``path``'s code names a stage by a string: a string argument of a call
    that takes a stage (STAGE_CALLS), a comparison with a stage's name (``stage == "merge"``), a lookup by it
    (``res["evaluate"]``, ``res.get("capture")``), or a list, tuple, set or dict of two or more stage names (a stage
    order)."""
    found = []

    def named(*nodes: ast.expr) -> list[str]:
        return [f"{path}:{n.lineno} {n.value}" for n in nodes if isinstance(n, ast.Constant) and n.value in names]

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in STAGE_CALLS:
                found += named(*node.args)
            elif func in LOOKUPS and isinstance(node.func, ast.Attribute):
                found += named(*node.args[:1])
        elif isinstance(node, ast.Compare):
            found += named(node.left, *node.comparators)
        elif isinstance(node, ast.Subscript):
            found += named(node.slice)
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            listed = named(*(e for e in items if e is not None))
            if len(listed) >= 2:
                found += listed
    return found


NOT_STAGES = {
    "eagle3/run/layout.py": (
        4,
        "the run directory's folder names (data, vocab, train, export, deploy, ...): the "
        "layout names every folder once and a stage's StageId points at its own; four of "
        "them equal a stage's name, and runs on disk keep them",
    ),
    "eagle3/data/merge.py": (1, "the 'train' split of a row (row['split'] == 'train'), not the stage"),
    "eagle3/export/model_card.py": (
        2,
        "the 'train' split's count of a source and the train manifest's last training step (stats['train']), "
        "not the stage",
    ),
    "flows/report.py": (1, "the train manifest's last training step (stats.get('train')), not the stage"),
    "eagle3/refresh/candidate.py": (
        2,
        "config section names of a candidate run's overrides ({'regenerate': "
        "{'enabled': False}, 'train': {...}}), not stages",
    ),
    "eagle3/deploy_checks.py": (
        1,
        "the config section an evaluation ran with, as eval/results.json records it (settings['evaluate']), "
        "not the stage",
    ),
}
"""Strings equal to a stage's name that name something else, each file with how many and why: no other file may
name a stage by hand."""


def _own_files(spec: StageSpec) -> set[Path]:
    """The stage's module and the package file beside it that holds its identity (eagle3/<area>/__init__.py)."""
    module = Path(spec.module.__file__).resolve()
    return {module, module.parent / "__init__.py"}


def test_stage_names_appear_in_code_only_in_their_own_module_and_the_registry():
    """No code outside a stage's own module (and the registry) names the stage by a string where a stage is
    meant (eagle3/, flows/, tasks/, scripts/): everything else reaches stages through the registry or the
    stage's module."""
    names = {s.name for s in STAGES}
    allowed = {Path(registry.__file__).resolve()}
    for spec in STAGES:
        allowed |= _own_files(spec)
    by_file: dict[str, list[str]] = {}
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if path.resolve() not in allowed:
                uses = stage_name_uses(path, names)
                if uses:
                    by_file[path.relative_to(ROOT).as_posix()] = uses
    over = {f: u for f, u in by_file.items() if len(u) > NOT_STAGES.get(f, (0, ""))[0]}
    assert over == {}


def test_stage_name_checker_finds_a_hand_written_stage_list(tmp_path):
    """The check above finds a stage list, a stage named in a call, a comparison with a stage's name and a lookup
    by it, and passes a split named 'train'."""
    code = tmp_path / "x.py"
    code.write_text(
        'ORDER = ["merge", "tokenize"]\npath = layout.manifest("vocab")\nsplit = read_split(p, "train")\n'
        'if stage == "capture":\n    x = res.get("export")\ny = res["evaluate"]\n'
    )
    stages = {"merge", "tokenize", "vocab", "train", "capture", "export", "evaluate"}
    assert sorted(u.split(" ")[1] for u in stage_name_uses(code, stages)) == [
        "capture",
        "evaluate",
        "export",
        "merge",
        "tokenize",
        "vocab",
    ]


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
