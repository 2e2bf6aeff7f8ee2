"""Presets that need a GPU host say so in the run form, and a run of one on a host without CUDA is refused at once
(issue 39, first list, item 5): before any download, model build or process start."""

from __future__ import annotations

import pytest
from prefect.utilities.callables import parameter_schema

from eagle3.config import load_config
from flows.capture import eagle3_capture
from flows.common import gpu_needs, gpu_presets
from flows.deploy import eagle3_deploy
from flows.pipeline import eagle3_pipeline
from flows.train import eagle3_train

GPU_ONLY = ["kimi-k25", "llama31-8b", "smollm2-40m", "smollm2-curve", "smollm2-quality", "smollm2-sglang"]


def test_gpu_presets_are_computed_from_their_configs():
    """SGLang capture or a cuda device makes a preset GPU-only; the CPU presets are not listed."""
    assert gpu_presets() == GPU_ONLY


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["regenerate.enabled=true", "regenerate.backend=sglang"], ["regenerate.backend=sglang"]),
        (["regenerate.enabled=true", "regenerate.backend=hf", "regenerate.device=cuda"], ["regenerate.device=cuda"]),
        (["regenerate.enabled=false", "regenerate.backend=sglang", "regenerate.device=cuda"], []),
        (["regenerate.enabled=true", "regenerate.backend=openai", "regenerate.device=cuda"], []),
    ],
)
def test_regeneration_on_the_gpu_makes_a_run_gpu_only(overrides, named):
    """Regeneration through a server the stage starts, or in-process on cuda, needs a GPU host; an endpoint
    elsewhere (openai, its device unused) or regeneration switched off does not."""
    assert gpu_needs(load_config("tiny", overrides)) == named


@pytest.mark.parametrize("flow", [eagle3_pipeline, eagle3_capture, eagle3_train, eagle3_deploy], ids=lambda f: f.name)
def test_the_form_names_the_presets_that_need_a_gpu(flow):
    """The `preset` description of the registered schema (what `prefect deploy` computes) lists them."""
    text = parameter_schema(flow).model_dump()["properties"]["preset"]["description"]
    assert "Needs a CUDA GPU host" in text
    listed = text.split("Needs a CUDA GPU host")[1]
    assert all(p in listed for p in GPU_ONLY) and "tiny" not in listed and "smollm2-demo," not in listed


@pytest.mark.parametrize("flow", ["eagle3_train", "eagle3_pipeline"])
def test_a_gpu_preset_on_a_host_without_cuda_fails_at_once(flow, tmp_path, monkeypatch):
    """llama31-8b on a CPU-only host: the flow fails in its first step with a message naming the GPU settings, and
    nothing is written under the work directory."""
    import time

    import torch

    from flows.pipeline import eagle3_pipeline

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = {"eagle3_train": eagle3_train, "eagle3_pipeline": eagle3_pipeline}[flow]
    t0 = time.monotonic()
    state = run(preset="llama31-8b", overrides=[f"run.workdir={tmp_path}"], return_state=True)
    assert state.is_failed()
    assert time.monotonic() - t0 < 60
    with pytest.raises(RuntimeError, match="needs a CUDA GPU host.*capture.backend=sglang.*no CUDA device"):
        state.result()
    assert list(tmp_path.iterdir()) == []
    if flow == "eagle3_pipeline":  # the run page says why too: a run-summary artifact, as for a config error
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        from eagle3.config import intended_run_name
        from tasks.artifacts import run_artifact_key

        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
                )
            )
        name = intended_run_name("llama31-8b", [f"run.workdir={tmp_path}"])
        (summary,) = [a for a in artifacts if a.key == run_artifact_key(name, "run-summary")]
        assert summary.description == "pipeline summary (failed: needs a GPU host)"
        assert f"# Run `{name}` failed: needs a GPU host" in summary.data
        assert "capture.backend=sglang" in summary.data and "Run it on a GPU worker" in summary.data
