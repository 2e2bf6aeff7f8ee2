"""Command-line entry points: user errors give one clear message and exit 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_missing_source_file_is_one_clear_error(tmp_path):
    """A source path that does not exist names the source and the path; exit code 2; no traceback."""
    proc = _run(
        "eagle3.run.stages",
        "merge",
        "--preset",
        "tiny",
        "--set",
        f"run.workdir={tmp_path}",
        "--set",
        "data.sources.0.path=/nonexistent/chats.jsonl",
    )
    assert proc.returncode == 2, proc.stderr
    assert "tiny-chats" in proc.stderr and "/nonexistent/chats.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_preset_field_is_one_clear_error(tmp_path):
    """A preset with an unknown field fails before any work, naming the field."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  sourcez: []\n")
    proc = _run("eagle3.run.stages", "all", "--preset", str(bad))
    assert proc.returncode == 2
    assert "data.sourcez" in proc.stderr and "Traceback" not in proc.stderr


def test_directory_given_as_source_is_one_clear_error(tmp_path):
    """A directory where a file is expected is reported as such."""
    proc = _run(
        "eagle3.run.stages",
        "merge",
        "--preset",
        "tiny",
        "--set",
        f"run.workdir={tmp_path}",
        "--set",
        f"data.sources.0.path={tmp_path}",
    )
    assert proc.returncode == 2 and "director" in proc.stderr.lower() and "Traceback" not in proc.stderr


@pytest.mark.timeout(600)
def test_stage_all_runs_without_prefect_and_skips_on_rerun(tmp_path):
    """`python -m eagle3.run.stages all` on the tiny preset writes every output; a rerun computes nothing."""
    args = ("eagle3.run.stages", "all", "--preset", "tiny", "--set", f"run.workdir={tmp_path}")
    first = _run(*args)
    assert first.returncode == 0, first.stderr
    second = _run(*args)
    assert second.returncode == 0, second.stderr
    outcomes = [json.loads(block) for block in _json_blocks(second.stdout)]
    assert [o["stage"] for o in outcomes] == ["merge", "tokenize", "vocab"]
    assert not any(o["computed"] for o in outcomes)
    assert (tmp_path / "tiny" / "vocab" / "vocab_map.safetensors").is_file()


def _json_blocks(text: str) -> list[str]:
    """Split concatenated pretty-printed JSON objects (each starts with '{' at column 0)."""
    blocks, current = [], []
    for line in text.splitlines():
        if line == "{" and current:
            blocks.append("\n".join(current))
            current = []
        current.append(line)
    return blocks + (["\n".join(current)] if current else [])


def test_help_lists_every_subcommand_with_an_example():
    """`eagle3 --help` names each subcommand and shows at least one example line for it."""
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from flows.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # the registered subcommands
    examples = proc.stdout.split("examples:")[1]
    for name in commands:
        assert name in proc.stdout.split("examples:")[0], name
        assert f"eagle3 {name}" in examples, f"no example for {name}"


def _stage_main(capsys, *args: str) -> str:
    """Run `python -m eagle3.run.stages ARGS` in this process; its exit code must be 2; returns stderr."""
    from eagle3.run.stages import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_config_files_with_syntax_errors_name_file_and_line(tmp_path, capsys):
    """A preset YAML and a JSON --config with a syntax error: exit 2, one message naming the file and line."""
    preset = tmp_path / "broken.yaml"
    preset.write_text("run:\n  name: x\n data: [\n")
    err = _stage_main(capsys, "merge", "--preset", str(preset))
    assert f"{preset}, line 3" in err and "invalid YAML" in err and err.count("\n") == 1
    config = tmp_path / "config.json"
    config.write_text('{\n  "run": {"name": "x",}\n}\n')
    err = _stage_main(capsys, "merge", "--config", str(config))
    assert f"{config}, line 2" in err and "invalid JSON" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "override, needle",
    [
        ("run.name=" + "n" * 300, "run.name"),
        ("run.workdir={afile}", "is a file, not a folder"),
        ("target.tiny.hidden_size=-64", "target.tiny.hidden_size"),
        ("target.tiny.num_attention_heads=0", "target.tiny.num_attention_heads"),
        ("target.name=../../x", "target.name"),
    ],
)
def test_bad_config_values_are_one_message_and_exit_2(tmp_path, capsys, override, needle):
    """Over-long names, a file as workdir, non-positive sizes, '..' in a name: exit 2 naming the field; nothing made."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    workdir = tmp_path / "runs"
    args = ["tokenize", "--preset", "tiny", "--set", f"run.workdir={workdir}", "--set", override.format(afile=afile)]
    err = _stage_main(capsys, *args)
    assert err.startswith("error: invalid config") and needle in err and "Traceback" not in err
    assert not workdir.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_importing_the_cli_does_not_import_prefect():
    """flows.cli loads without prefect: Prefect reads PREFECT_API_URL at import, which the CLI sets afterwards
    (imported earlier, `eagle3 run` ran on a temporary server of its own instead of the local one)."""
    code = "import sys, flows.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _readme_console_commands() -> list[str]:
    """The `eagle3 ...` commands of the README's "What runs today" table (one per row that has one)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("## What runs today", 1)[1].split("\n\n", 2)[1]
    commands = [
        span
        for line in table.splitlines()
        if line.startswith("|")
        for span in line.split("`")[1::2]
        if span.startswith("eagle3 ")
    ]
    assert len(commands) >= 7, commands  # target, synthesize, merge, regenerate, tokenize, vocab, export, eval
    return commands


@pytest.mark.parametrize("command", _readme_console_commands())
def test_every_readme_console_command_reaches_the_help_of_what_it_runs(command, tmp_path, capsys):
    """Each `eagle3 ...` form of the README's table parses, and the entry point it hands over to resolves and
    answers --help (`eagle3 export` named a module without `main`: AttributeError on every call)."""
    import shlex

    from flows.cli import build_parser, entry_point, stage_entry

    argv = [
        tmp_path.as_posix() + "/config.json" if a == "runs/<run>/config.json" else "tiny" if a == "X" else a
        for a in shlex.split(command)[1:]
    ]
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit) as exit_info:
        (stage_entry(args.stage) if args.command == "stage" else entry_point(args.entry))(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["export", "eval"])
def test_forwarded_commands_run_their_stage_main(command, tmp_path, capsys):
    """`eagle3 export|eval --config MISSING` reaches the stage's main: one clear error, exit 2 (no AttributeError)."""
    from flows.cli import main

    missing = tmp_path / "config.json"
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(missing)])
    assert exit_info.value.code == 2
    assert f"config file {missing} not found" in capsys.readouterr().err


def test_console_scripts_resolve():
    """Every [project.scripts] entry of pyproject.toml names a callable that exists."""
    import importlib
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    for name, target in pyproject["project"]["scripts"].items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
