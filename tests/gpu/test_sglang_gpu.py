"""Real SGLang on a GPU host (sglang importable by the interpreter in EAGLE3_SGLANG_PYTHON, default this one):
capture_packed returns the aux and final states the in-process HF capture computes, to bf16 rounding."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from eagle3.config import load_config
from eagle3.features.capture import make_backend
from eagle3.features.run_spec import build_spec
from eagle3.features.sglang_backend import SGLangCaptureBackend
from eagle3.features.spec import SampleTokens
from eagle3.target.load import prepare_target
from infra.process import free_port

pytestmark = pytest.mark.gpu
PYTHON = os.environ.get("EAGLE3_SGLANG_PYTHON", sys.executable)


def _has_sglang() -> bool:
    return subprocess.run([PYTHON, "-c", "import sglang"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_sglang(), reason=f"{PYTHON} cannot import sglang")
def test_capture_packed_on_real_sglang_equals_hf_capture(tmp_path):
    """A managed capture_packed server (bf16) gives every aux layer and the final state within 2e-2 rel RMS of HF."""
    cfg = load_config(
        "tiny",
        [
            f"run.workdir={tmp_path}",
            "capture.backend=sglang",
            "target.dtype=bfloat16",
            "capture.device=cuda",
            f"server.python={PYTHON}",
            f"capture.sglang.port={free_port()}",
            "capture.sglang.mem_fraction_static=0.2",
            "server.startup_timeout_s=600",
            "capture.allow_shared_gpus=true",
            "server.attention_backend=triton",
        ],
    )
    model_dir = prepare_target(cfg)
    spec = build_spec(cfg, model_dir)
    rng = np.random.default_rng(0)
    samples = [
        SampleTokens(f"s:{i}", rng.integers(3, spec.vocab_size, 40 + 7 * i).tolist(), [1] * (40 + 7 * i))
        for i in range(6)
    ]
    sglang = SGLangCaptureBackend.from_config(cfg, model_dir, spec)
    try:
        served = list(sglang.capture(samples))
    finally:
        sglang.close()
    hf = make_backend(
        cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"backend": "hf"})}), model_dir, spec
    )
    try:
        local = list(hf.capture(samples))
    finally:
        hf.close()
    h = spec.hidden_size
    for got, want in zip(served, local):
        assert got.input_ids.tolist() == want.input_ids.tolist()
        blocks = [(got.aux[:, k * h : (k + 1) * h], want.aux[:, k * h : (k + 1) * h]) for k in range(spec.num_aux)]
        for a, b in [*blocks, (got.final, want.final)]:
            a, b = a.float(), b.float()
            assert (a - b).norm() / b.norm() < 2e-2
