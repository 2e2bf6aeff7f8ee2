"""How a stage command ends on an exception: a user error (the project's own types) is one line and exit 2; anything
else (a bug) keeps its traceback and exits non-zero, so it can be reported and found."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.config import ConfigError
from eagle3.data.rejects import SourceError
from eagle3.run.cli_args import RunDirError, is_user_error
from eagle3.run.stage import MissingInputError
from infra.storage import DiskSpaceError, LockHeldError

ROOT = Path(__file__).resolve().parents[2]

# `python -m eagle3.data.stages.merge` whose merge has a bug: the source hashing (part of the stage key) raises
# EXC("messages") instead of hashing.
BUGGY_MERGE = """
import sys
import eagle3.data.stages.merge as merge

def bug(cfg):
    raise {exc}("messages")

merge.source_hashes = bug
merge.main(sys.argv[1:])
"""


def _merge(tmp_path: Path, code: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    args = ["--preset", "tiny", "--set", f"run.workdir={tmp_path}", *(f"--set={o}" for o in overrides)]
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("exc", ["KeyError", "ValueError", "TypeError"])
def test_a_bug_in_a_stage_keeps_its_traceback(tmp_path, exc):
    """A KeyError, a plain ValueError or a TypeError raised inside a stage: the traceback (down to the raising line)
    and the exception reach stderr, and the exit status is 1, not the user-error status 2."""
    proc = _merge(tmp_path, BUGGY_MERGE.format(exc=exc))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert ", in key" in proc.stderr and ", in bug" in proc.stderr  # the frames down to the raising function
    assert proc.stderr.splitlines()[-1].startswith(f"{exc}: ")
    assert not proc.stderr.startswith("error: ")


def test_a_config_error_is_still_one_line_and_exit_2(tmp_path):
    """A misspelled config key: one message on stderr ("error: invalid config ..." and a line per problem, here the
    key with the field it was meant to be), exit 2, no traceback."""
    proc = _merge(tmp_path, "import sys, eagle3.data.stages.merge as m; m.main(sys.argv[1:])", "train.lrr=0.1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and "train.lrr: unknown key; did you mean train.lr?" in proc.stderr
    assert proc.stderr.count("\n") == 2 and "Traceback" not in proc.stderr


def _os_error(code: int, filename: str | None = "/runs/x") -> OSError:
    return OSError(code, "os says no", filename)


@pytest.mark.parametrize(
    "exc, user",
    [
        (ConfigError("train.lr: must be > 0"), True),
        (SourceError("source 'a': file /x does not exist"), True),
        (MissingInputError("tokenize first"), True),
        (RunDirError("No space left on device: /runs/x"), True),
        (DiskSpaceError("needs 3 GB, 1 GB free"), True),
        (LockHeldError("held by pid 12"), True),
        (FileNotFoundError("no SGLang export at /runs/x/export (run the export stage first)"), True),
        (_os_error(errno.ENOSPC), True),
        (RuntimeError("shard 3 failed"), False),  # (a wrapper) ...
        (ValueError("bad"), False),
        (KeyError("messages"), False),
        (TypeError("unsupported operand"), False),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/opt/missing.json"), False),
        (_os_error(errno.EIO), False),
    ],
)
def test_user_errors_are_the_projects_own_types(exc, user):
    """is_user_error: the project's ValueError subclasses, its run-directory, disk and lock errors, a missing path it
    reports itself (no errno) and user-fixable OS errors are user errors; builtin errors and other OS errors not."""
    assert is_user_error(exc) is user


def test_a_wrapped_user_fixable_os_error_is_a_user_error():
    """A RuntimeError caused by ENOSPC (a shard writer wraps its OSError) is the user's to fix: one line."""
    try:
        try:
            raise _os_error(errno.ENOSPC)
        except OSError as err:
            raise RuntimeError("shard 3 failed") from err
    except RuntimeError as exc:
        assert is_user_error(exc)


def test_train_before_capture_or_vocab_names_the_stage_to_run_first(tmp_path):
    """Offline training in a run with no captured features (or no vocab map) says which stage to run first, as a
    user error, instead of a FileNotFoundError traceback."""
    from eagle3.config import load_config
    from eagle3.train.build import read_inputs

    cfg = load_config("tiny", [f"run.workdir={tmp_path}", "train.features=offline"])
    with pytest.raises(MissingInputError, match="run the capture stage first") as caught:
        read_inputs(cfg, tmp_path / "unused")
    assert is_user_error(caught.value)
    online = load_config("tiny", [f"run.workdir={tmp_path}", "train.features=online"])
    with pytest.raises(MissingInputError, match="run the vocab stage first"):
        read_inputs(online, _tiny_target(online))


def _tiny_target(cfg):
    from eagle3.target.load import prepare_target

    return prepare_target(cfg)


def test_a_failed_measurement_check_exits_1_with_its_message_and_no_traceback(capsys):
    """MeasurementError (e.g. SGLang's accept length 3.7% from eagle3 eval's) is a result: its lines, exit 1."""
    from eagle3.run.cli_args import exit_on_user_error
    from infra.sglang_bench_records import MeasurementError

    @exit_on_user_error
    def main() -> None:
        raise MeasurementError("deploy figures failed their checks:\n  5-4-8 mtbench: 3.7% > 3%")

    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert err == "error: deploy figures failed their checks:\n  5-4-8 mtbench: 3.7% > 3%\n"
