"""SGLangCaptureBackend and ManagedServer against the FAKE SGLang server (tests/fakes/sglang_server.py).

Only the fake is exercised here: field names and shapes follow SGLang 0.5.23 as read from its source,
not as observed from a running server. Each fault the fake can inject must be caught, and no sample
that failed a check may reach the caller.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.config import RunConfig, SGLangServerConfig
from eagle3.features.sglang_backend import SGLangCaptureBackend
from eagle3.features.sglang_requests import CaptureError
from eagle3.features.spec import FeatureSpec, SampleTokens
from infra.process import RestartPolicy, free_port, group_alive
from infra.sglang import ManagedServer, ServerSpec, ServerStartError
from infra.sglang_probe import ProbeExpectations, ServerCheckError, probe_ready
from tests.fakes.sglang_model import Faults, LaunchArgs, fake_hidden_rows, fake_topk
from tests.fakes.sglang_server import FakeSGLangServer, two_free_ports

REPO = Path(__file__).resolve().parents[2]
H, LAYERS, VOCAB = 16, 8, 256
AUX_IDS = [1, 3, 4]  # the fake's default for 8 layers: [1, L//2 - 1, L - 4]
CAPTURE_FLAGS = dict(chunked_prefill_size=-1, disable_radix_cache=True, skip_tokenizer_init=True)


def feature_spec(supervision: str = "final_hidden", topk: int | None = None) -> FeatureSpec:
    return FeatureSpec(
        target_name="fake",
        target_fingerprint="fp",
        hidden_size=H,
        num_layers=LAYERS,
        vocab_size=VOCAB,
        aux_layer_ids=AUX_IDS,
        supervision=supervision,
        topk=topk,
        max_len=64,
        chat_template_hash="h",
        backend="sglang",
    )


def aux_server(faults: Faults | None = None, **launch) -> FakeSGLangServer:
    args = LaunchArgs(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3", **CAPTURE_FLAGS, **launch)
    return FakeSGLangServer(args, faults or Faults())


def final_server(**launch) -> FakeSGLangServer:
    return FakeSGLangServer(LaunchArgs(enable_return_hidden_states=True, **CAPTURE_FLAGS, **launch))


def samples(num: int, start: int = 0) -> list[SampleTokens]:
    out = []
    for i in range(start, start + num):
        ids = [(7 * i + 3 * j) % VOCAB for j in range(5 + i % 7)]
        out.append(SampleTokens(f"src:{i}", ids, [j % 2 for j in range(len(ids))]))
    return out


def backend(spec: FeatureSpec, aux: list, final: list = (), **kw) -> SGLangCaptureBackend:
    kw.setdefault("max_retries", 1)
    kw.setdefault("retry_backoff_s", 0.01)
    kw.setdefault("request_timeout_s", 5.0)
    return SGLangCaptureBackend(spec, aux, final, **kw)


def assert_matches_fake(captured, sample: SampleTokens) -> None:
    assert captured.id == sample.id
    assert captured.input_ids.tolist() == sample.input_ids and captured.loss_mask.tolist() == sample.loss_mask
    np.testing.assert_array_equal(captured.aux.numpy(), fake_hidden_rows(sample.input_ids, AUX_IDS, H))


# ---------------------------------------------------------------- the backend


def test_two_pass_capture_returns_the_fakes_states_in_input_order():
    """Aux from two servers and final from a third come back in order, joined by id, with the fake's values."""
    batch = samples(12)
    with aux_server(api_key="k") as a1, aux_server(api_key="k") as a2, final_server(api_key="k") as f:
        out = list(backend(feature_spec(), [a1.base_url, a2.base_url], [f.base_url], api_key="k").capture(batch))
        bodies = a1.generate_bodies + a2.generate_bodies
        headers = a1.generate_headers + a2.generate_headers + f.generate_headers
        assert a1.generate_bodies and a2.generate_bodies  # both aux servers shared the work
    assert [c.id for c in out] == [s.id for s in batch]
    for captured, sample in zip(out, batch):
        assert_matches_fake(captured, sample)
        np.testing.assert_array_equal(captured.final.numpy(), fake_hidden_rows(sample.input_ids, [LAYERS], H))
        assert captured.aux.dtype == captured.final.dtype == torch.float32
    assert sorted(b["rid"] for b in bodies) == sorted(s.id for s in batch)
    assert len({b["extra_key"] for b in bodies}) == len(bodies)  # a fresh radix-cache key per request
    assert all(
        b["sampling_params"] == {"max_new_tokens": 1, "temperature": 0} and b["return_hidden_states"] is True
        for b in bodies
    )
    assert {h.get("Authorization") for h in headers} == {"Bearer k"}


def test_topk_supervision_returns_each_positions_next_token_topk():
    """With topk supervision row t holds the target's top-K after token t (the last row from the output)."""
    batch = samples(3)
    with aux_server() as a:
        out = list(backend(feature_spec("topk_logprobs", topk=4), [a.base_url]).capture(batch))
        body = a.generate_bodies[0]
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (True, 0, 4)
    for captured, sample in zip(out, batch):
        assert_matches_fake(captured, sample)
        assert captured.final is None
        for t, token in enumerate(sample.input_ids):
            ids, logprobs = fake_topk(token, t, 4, VOCAB)
            assert captured.topk_ids[t].tolist() == ids
            np.testing.assert_allclose(captured.topk_logprobs[t].numpy(), logprobs, rtol=1e-6)


@pytest.mark.parametrize(
    "faults, check",
    [
        (Faults(short_rows=1), "rows"),
        (Faults(id_fault="alter"), "id"),
        (Faults(id_fault="drop"), "id"),
        (Faults(cached_tokens=2), "cached_tokens"),
        (Faults(nan=True), "finite"),
    ],
)
def test_each_fault_is_detected_retried_and_never_yielded(faults, check):
    """A persistent fault is retried max_retries times, then CaptureError names the sample and the check."""
    yielded = []
    with aux_server(faults) as a:
        with pytest.raises(CaptureError) as exc:
            for captured in backend(feature_spec("topk_logprobs", topk=2), [a.base_url], max_retries=2).capture(
                samples(1)
            ):
                yielded.append(captured)
        num_requests = len(a.generate_bodies)
    assert yielded == []
    assert exc.value.sample_id == "src:0" and exc.value.check == check
    assert "'src:0'" in str(exc.value) and f"'{check}'" in str(exc.value)
    assert num_requests == 3  # first try + max_retries


def test_rows_of_the_wrong_width_are_detected():
    """A server capturing four layers for a three-layer spec fails the width check (server check skipped)."""
    with aux_server(return_aux_hidden_state_layer_ids=[1, 2, 3, 4]) as a:
        b = backend(feature_spec("topk_logprobs", topk=2), [a.base_url], check_servers=False)
        with pytest.raises(CaptureError, match=f"row 0 has {4 * H} values, expected {3 * H}") as exc:
            list(b.capture(samples(1)))
    assert exc.value.check == "width"


def test_a_transient_fault_is_retried_and_the_good_answer_kept():
    """One short-rows answer followed by a good one yields the correct sample after one retry."""
    batch = samples(1)
    with aux_server(Faults(short_rows=3, times=1)) as a:
        b = backend(feature_spec("topk_logprobs", topk=2), [a.base_url])
        (captured,) = list(b.capture(batch))
        assert len(a.generate_bodies) == 2
    assert b.num_retries == 1
    assert_matches_fake(captured, batch[0])


def test_good_samples_before_a_bad_one_are_yielded_and_the_bad_one_stops_the_capture():
    """Samples are yielded in order until one fails for good; nothing bad and nothing after it is yielded."""
    batch, yielded = samples(6), []
    with aux_server() as a:
        iterator = backend(
            feature_spec("topk_logprobs", topk=2), [a.base_url], max_concurrency=1, max_retries=0
        ).capture(batch)
        yielded.append(next(iterator))
        a.faults = Faults(short_rows=1)  # every answer from now on is bad
        with pytest.raises(CaptureError, match="'rows'"):
            for captured in iterator:
                yielded.append(captured)
    assert 1 <= len(yielded) < len(batch)
    for captured, sample in zip(yielded, batch):
        assert_matches_fake(captured, sample)


def test_a_stalled_server_times_out_and_names_the_sample():
    """A server that answers only after 3 s fails the sample with check 'timeout' (0.3 s) after 1 retry, 2 sends."""
    with aux_server(Faults(stall_s=3.0)) as a:
        with pytest.raises(CaptureError) as exc:
            list(
                backend(
                    feature_spec("topk_logprobs", topk=2), [a.base_url], request_timeout_s=0.3, max_retries=1
                ).capture(samples(1))
            )
        sent = a.counts.get("/generate")
    assert exc.value.check == "timeout" and exc.value.sample_id == "src:0"
    assert "after 2 attempt(s)" in str(exc.value) and sent == 2


def test_a_server_that_died_fails_the_sample_as_transport_after_retries():
    """A plain endpoint that stops answering (fake told to die) fails with check 'transport', not a hang."""
    with aux_server(Faults(die_after=1)) as a:
        b = backend(feature_spec("topk_logprobs", topk=2), [a.base_url], max_concurrency=1, max_retries=2)
        with pytest.raises(CaptureError) as exc:
            list(b.capture(samples(3)))
    assert exc.value.check == "transport" and exc.value.sample_id == "src:1"


def test_server_capturing_other_layers_is_refused_before_any_request():
    """An aux server whose /server_info lists other layers than the spec fails up front: widths cannot tell."""
    with aux_server(return_aux_hidden_state_layer_ids=[1, 3, 5]) as a:
        with pytest.raises(CaptureError, match=r"captures layers \[1, 3, 5\]"):
            list(backend(feature_spec("topk_logprobs", topk=2), [a.base_url]).capture(samples(2)))
        assert a.generate_bodies == []


def test_a_permanent_http_error_is_not_retried():
    """A 400 (server not configured for hidden states) fails at once with check 'http_status'."""
    with FakeSGLangServer(LaunchArgs(**CAPTURE_FLAGS)) as plain:
        b = backend(feature_spec("topk_logprobs", topk=2), [plain.base_url], max_retries=3, check_servers=False)
        with pytest.raises(CaptureError) as exc:
            list(b.capture(samples(1)))
        assert len(plain.generate_bodies) == 1
    assert exc.value.check == "http_status" and "not configured to return hidden states" in str(exc.value)


def test_concurrency_per_endpoint_is_bounded():
    """No endpoint ever sees more than max_concurrency requests at once, yet both are used."""
    with aux_server(Faults(stall_s=0.05)) as a1, aux_server(Faults(stall_s=0.05)) as a2:
        out = list(
            backend(feature_spec("topk_logprobs", topk=2), [a1.base_url, a2.base_url], max_concurrency=2).capture(
                samples(16)
            )
        )
        assert 1 <= a1.max_in_flight <= 2 and 1 <= a2.max_in_flight <= 2
    assert len(out) == 16


def test_final_hidden_without_final_endpoints_is_refused():
    """final_hidden supervision needs a capture_final server: aux servers do not return the final state."""
    with pytest.raises(ValueError, match="final_endpoints"):
        SGLangCaptureBackend(feature_spec(), ["http://127.0.0.1:1"])


# ---------------------------------------------------------------- readiness and supervision


def test_probe_reports_ready_only_after_a_checked_smoke_forward():
    """probe_ready waits out the warmup (503), then returns after exactly one smoke /generate it checked."""
    fake = aux_server(api_key="k")
    fake.warmup_s = 0.4
    with fake:
        spec = ServerSpec("fake-model", "capture_aux", port=fake.args.port, api_key="k")
        report = probe_ready(
            spec, ProbeExpectations(hidden_size=H, architectures=("LlamaForCausalLM",)), timeout_s=10, poll_s=0.05
        )
        assert fake.counts["/health_generate"] > 1 and len(fake.generate_bodies) == 1
    assert report.smoke == f"capture forward: 8 rows x {3 * H} finite values" and report.version == "0.5.23"


@pytest.mark.parametrize("mode", ["serve", "speculative"])
def test_probe_checks_a_serving_server_with_a_greedy_generation(mode):
    """Serve and speculative servers pass only after 16 varied greedy tokens (and, speculative, verify steps)."""
    draft = (
        {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": "/d",
            "speculative_num_steps": 3,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4,
        }
        if mode == "speculative"
        else {}
    )
    trio = {"draft_model_path": "/d", "num_steps": 3, "topk": 1, "num_draft_tokens": 4} if draft else {}
    with FakeSGLangServer(LaunchArgs(**draft)) as fake:
        spec = ServerSpec("fake-model", mode, port=fake.args.port, **trio)
        report = probe_ready(spec, ProbeExpectations(vocab_size=VOCAB), timeout_s=10, poll_s=0.05)
        assert fake.generate_bodies[0]["sampling_params"]["max_new_tokens"] == 16
    assert report.smoke == "greedy generation of 16 tokens"


def test_probe_fails_when_server_info_differs_from_the_spec():
    """A server capturing other layers than the spec asks for is not ready; the message names the field."""
    with aux_server(return_aux_hidden_state_layer_ids=[1, 3, 5]) as fake:
        spec = ServerSpec("fake-model", "capture_aux", port=fake.args.port, aux_layer_ids=(1, 3, 4))
        with pytest.raises(ServerCheckError, match="return_aux_hidden_state_layer_ids"):
            probe_ready(spec, ProbeExpectations(hidden_size=H), timeout_s=5, poll_s=0.05)
        assert fake.generate_bodies == []


def test_probe_fails_fast_on_a_wrong_api_key():
    """A 401 from /model_info is a configuration error, not a reason to keep polling."""
    with aux_server(api_key="right") as fake:
        spec = ServerSpec("fake-model", "capture_aux", port=fake.args.port, api_key="wrong")
        with pytest.raises(ServerCheckError, match="401"):
            probe_ready(spec, ProbeExpectations(hidden_size=H), timeout_s=30, poll_s=0.05)


def managed(tmp_path: Path, *extra: str, port: int | None = None, **kw) -> ManagedServer:
    spec = ServerSpec(
        "fake-model",
        "capture_aux",
        port=port or free_port(),
        api_key="k",
        aux_layer_ids=tuple(AUX_IDS),
        python=sys.executable,
        module="tests.fakes.sglang_server",
        extra_args=("--fake-lifetime-s", "60", *extra),
    )
    return ManagedServer(
        spec,
        tmp_path / "sglang.log",
        expect=ProbeExpectations(hidden_size=H),
        startup_timeout_s=20,
        poll_s=0.05,
        watch_s=0.05,
        cwd=REPO,
        policy=kw.pop("policy", RestartPolicy(max_restarts=2, backoff_s=0.05)),
        **kw,
    )


def test_managed_server_killed_mid_capture_is_restarted_and_the_capture_completes(tmp_path):
    """SIGKILL of the server's group mid-run: the supervisor restarts it and every sample arrives intact."""
    batch = samples(16)
    out = []
    with managed(tmp_path, "--fake-stall-s", "0.05") as server:
        first_pid = server.pid
        b = backend(feature_spec("topk_logprobs", topk=2), [server], api_key="k", max_retries=3, ready_timeout_s=20)
        for captured in b.capture(batch):
            out.append(captured)
            if len(out) == 3:
                os.killpg(first_pid, signal.SIGKILL)
        assert server.num_restarts == 1 and server.pid != first_pid and server.ready
    assert not group_alive(server.pid)
    assert b.num_retries >= 1
    for captured, sample in zip(out, batch, strict=True):
        assert_matches_fake(captured, sample)
    assert "restart 1/2" in (tmp_path / "sglang.log").read_text()


def test_a_server_that_exits_by_itself_is_restarted_and_the_capture_completes(tmp_path):
    """The fake exiting after a few answers (code 3) is restarted, and every sample still arrives intact."""
    batch = samples(6)
    with managed(tmp_path, "--fake-die-after", "4", policy=RestartPolicy(max_restarts=4, backoff_s=0.05)) as server:
        b = backend(
            feature_spec("topk_logprobs", topk=2),
            [server],
            api_key="k",
            max_retries=3,
            ready_timeout_s=20,
            max_concurrency=1,
        )
        out = list(b.capture(batch))
        assert server.num_restarts >= 1
    for captured, sample in zip(out, batch, strict=True):
        assert_matches_fake(captured, sample)
    assert "exited with code 3" in (tmp_path / "sglang.log").read_text()


def test_managed_server_is_not_ready_when_the_smoke_check_fails(tmp_path):
    """A server whose smoke answer has short rows never reports ready; the error names the check and the log."""
    server = managed(tmp_path, "--fake-short-rows", "1")
    with pytest.raises(ServerStartError) as exc:
        server.start()
    message = str(exc.value)
    assert "'rows'" in message and str(tmp_path / "sglang.log") in message and "fake sglang" in message
    assert not server.ready and not group_alive(server.pid)


def test_managed_server_refuses_a_port_that_already_answers(tmp_path):
    """If another server owns the port, start() fails before launching (the probe would check the wrong one)."""
    with aux_server() as other:
        server = managed(tmp_path, port=other.args.port)
        with pytest.raises(ServerStartError, match="already answers"):
            server.start()
        assert server.pid is None


def test_managed_server_gives_up_after_max_restarts_and_shows_the_log(tmp_path):
    """A server that dies at every start is restarted max_restarts times, then fails with its log's tail."""
    server = managed(tmp_path, "--no-such-flag", policy=RestartPolicy(max_restarts=2, backoff_s=0.01))
    with pytest.raises(ServerStartError) as exc:
        server.start()
    assert server.num_restarts == 2 and "no restarts left" in str(exc.value)
    assert "unrecognized arguments: --no-such-flag" in str(exc.value)
    assert "--api-key k " not in str(exc.value) and "--config " in str(exc.value)  # usage text lists --api-key


def test_managed_server_key_stays_out_of_cmdline_and_environment(tmp_path, monkeypatch):
    """The key is in no /proc cmdline or environ of the server, only in a 0600 file removed on stop; log 0600."""
    key = "s3cret-key-0123456789"
    monkeypatch.setenv("EAGLE3_SGLANG_API_KEY", key)  # as a user exports it: the server must not inherit it
    monkeypatch.setenv("UNRELATED", "kept")
    spec = ServerSpec(
        "fake-model",
        "capture_aux",
        port=free_port(),
        api_key=key,
        aux_layer_ids=tuple(AUX_IDS),
        python=sys.executable,
        module="tests.fakes.sglang_server",
        extra_args=("--fake-lifetime-s", "60"),
    )
    server = ManagedServer(
        spec,
        tmp_path / "sglang.log",
        expect=ProbeExpectations(hidden_size=H),
        startup_timeout_s=20,
        poll_s=0.05,
        cwd=REPO,
    )
    with server:
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{server.pid}/environ").read_bytes()
        assert key.encode() not in cmdline and key.encode() not in environ and b"UNRELATED=kept" in environ
        assert oct(server.key_file.stat().st_mode & 0o777) == "0o600" and key in server.key_file.read_text()
        assert oct(server.log_path.stat().st_mode & 0o777) == "0o600"
    assert not server.key_file.exists()


# ---------------------------------------------------------------- from_config


def run_config(tmp_path: Path, supervision: str, **sglang) -> RunConfig:
    """A capture config on the fake server; settings of the server section (python, startup_timeout_s, ...) go there."""
    server = {name: sglang.pop(name) for name in list(sglang) if name in SGLangServerConfig.model_fields}
    return RunConfig.model_validate(
        {
            "run": {"workdir": str(tmp_path), "name": "r"},
            "capture": {"backend": "sglang", "supervision": supervision, "topk": 2, "sglang": sglang},
            "server": {"api_key_env": None, "launch_module": "tests.fakes.sglang_server", **server},
        }
    )


def test_from_config_uses_existing_endpoints(tmp_path):
    """capture.sglang.endpoints are used as they are: no launch, and the capture returns the server's states."""
    with aux_server() as a:
        b = SGLangCaptureBackend.from_config(
            run_config(tmp_path, "topk_logprobs", endpoints=[a.base_url], server_mode="capture_aux"),
            tmp_path,
            feature_spec("topk_logprobs", topk=2),
        )
        (captured,) = list(b.capture(samples(1)))
        b.close()
    assert b.owned_servers == [] and not (tmp_path / "r" / "logs").exists()
    assert_matches_fake(captured, samples(1)[0])


def _fake_gpu_host(tmp_path, monkeypatch):
    """A fake nvidia-smi (one idle GPU) first on PATH, the repository as CWD (so `python -m
    tests.fakes.sglang_server` resolves), and a model folder with a config only; returns the folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in --query-gpu=*) echo "0, GPU-a, Fake, 81920, 3";; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(REPO)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 16, "num_hidden_layers": 8, "vocab_size": 256}')
    return model


def test_from_config_launches_owns_and_stops_both_servers(tmp_path, monkeypatch):
    """Without endpoints it checks the GPU, launches aux + final servers (fake), captures, and close() kills both."""
    model = _fake_gpu_host(tmp_path, monkeypatch)
    cfg = run_config(
        tmp_path,
        "final_hidden",
        python=sys.executable,
        port=two_free_ports(),
        startup_timeout_s=30,
        server_mode="capture_aux",
    )
    b = SGLangCaptureBackend.from_config(cfg, model, feature_spec())
    try:
        (captured,) = list(b.capture(samples(1)))
        aux, final = b.owned_servers
        assert (aux.spec.mode, final.spec.mode, final.spec.port) == ("capture_aux", "capture_final", aux.spec.port + 1)
        assert aux.spec.mem_fraction_static == final.spec.mem_fraction_static == 0.4
    finally:
        b.close()
    assert not group_alive(aux.pid) and not group_alive(final.pid)
    assert (tmp_path / "r" / "logs" / "sglang-capture_final.log").exists()
    assert_matches_fake(captured, samples(1)[0])
    np.testing.assert_array_equal(captured.final.numpy(), fake_hidden_rows(samples(1)[0].input_ids, [LAYERS], H))


def test_a_held_final_port_is_refused_by_name_before_any_server_launches(tmp_path, monkeypatch):
    """A socket bound (not listening) on port + 1 stops the launch up front, naming that port; nothing starts."""
    import socket

    model = _fake_gpu_host(tmp_path, monkeypatch)
    port = two_free_ports()
    launched: list[str] = []
    monkeypatch.setattr(ManagedServer, "start", lambda self: launched.append(self.spec.mode))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 1))  # like the local end of an outgoing connection: bound, not listening
        cfg = run_config(
            tmp_path, "final_hidden", python=sys.executable, port=port, startup_timeout_s=30, server_mode="capture_aux"
        )
        with pytest.raises(ServerStartError, match=f"127.0.0.1:{port + 1} is held by another socket"):
            SGLangCaptureBackend.from_config(cfg, model, feature_spec())
    assert launched == []


def test_managed_endpoints_hand_the_key_to_shard_backends_in_memory_not_the_environment(tmp_path, monkeypatch):
    """Backends built inside managed_endpoints get the servers' generated key; os.environ never holds it."""
    from eagle3.features.sglang_backend import _MANAGED, managed_endpoints

    model = _fake_gpu_host(tmp_path, monkeypatch)
    cfg = run_config(
        tmp_path,
        "topk_logprobs",
        python=sys.executable,
        port=free_port(),
        startup_timeout_s=30,
        api_key_env="EAGLE3_TEST_SGLANG_KEY",
    )
    monkeypatch.delenv("EAGLE3_TEST_SGLANG_KEY", raising=False)
    spec = feature_spec("topk_logprobs", topk=2)
    with managed_endpoints(cfg, model, spec) as served:
        key = _MANAGED[served.capture.sglang.endpoints[0]].api_key
        assert key not in os.environ.values()
        b = SGLangCaptureBackend.from_config(served, model, spec)
        assert b.api_key == key and b.owned_servers == []
        (captured,) = list(b.capture(samples(1)))
        b.close()
    assert _MANAGED == {} and key not in os.environ.values()
    assert_matches_fake(captured, samples(1)[0])


def test_a_shard_backend_waits_for_a_managed_server_killed_between_shards(tmp_path, monkeypatch):
    """A managed server SIGKILLed before the next shard's backend opens: the backend waits for the restart."""
    from eagle3.features.sglang_backend import _MANAGED, managed_endpoints

    model = _fake_gpu_host(tmp_path, monkeypatch)
    cfg = run_config(tmp_path, "final_hidden", python=sys.executable, port=free_port(), startup_timeout_s=30)
    spec = feature_spec()
    with managed_endpoints(cfg, model, spec) as served:
        server = _MANAGED[served.capture.sglang.endpoints[0]]
        os.killpg(server.pid, signal.SIGKILL)
        b = SGLangCaptureBackend.from_config(served, model, spec)
        (captured,) = list(b.capture(samples(1)))
        assert server.num_restarts == 1
    assert_matches_fake(captured, samples(1)[0])


# ---------------------------------------------------------------- capture_packed (one pass, our model package)


def test_a_managed_capture_packed_server_returns_aux_and_final_in_one_pass(tmp_path, monkeypatch):
    """server_mode capture_packed launches ONE server with the model package's env, in the target's compute dtype
    (SGLang's own default would serve a float32 checkpoint in float16); aux and final equal the fake's."""
    model = _fake_gpu_host(tmp_path, monkeypatch)
    cfg = run_config(tmp_path, "final_hidden", python=sys.executable, port=two_free_ports(), startup_timeout_s=30)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"dtype": "bfloat16"})})
    assert cfg.capture.sglang.server_mode == "capture_packed"  # the default: it runs on SGLang 0.5.16 too
    b = SGLangCaptureBackend.from_config(cfg, model, feature_spec())
    try:
        captured = list(b.capture(samples(3)))
        (server,) = b.owned_servers
        assert server.spec.mode == "capture_packed" and server.spec.aux_layer_ids == tuple(AUX_IDS)
        argv = server.spec.argv("key.yaml")
        assert "--disable-cuda-graph" in argv and "--enable-return-hidden-states" in argv
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
    finally:
        b.close()
    for got, sample in zip(captured, samples(3)):
        assert_matches_fake(got, sample)
        np.testing.assert_array_equal(got.final.numpy(), fake_hidden_rows(sample.input_ids, [LAYERS], H))


def test_a_packed_server_without_the_model_package_fails_the_width_check(tmp_path):
    """A server that fell back to SGLang's own class returns H-wide rows: the capture fails, naming the check."""
    with final_server() as plain:  # --enable-return-hidden-states, no model package: rows are H wide
        b = SGLangCaptureBackend(feature_spec(), [plain.base_url], packed=True, max_retries=0)
        with pytest.raises(CaptureError, match="src:0"):
            list(b.capture(samples(1)))


def test_the_model_package_packs_aux_states_then_the_final_state():
    """PackAuxLogits hands cat(aux..., final) to SGLang's processor as the state to return; the logits' input
    is unchanged."""
    import torch

    from infra.sglang_plugin.capture_models import PackAuxLogits, with_packed_capture

    seen = {}

    class Inner(torch.nn.Module):
        def forward(self, input_ids, hidden, lm_head, meta, aux=None, before_norm=None):
            seen.update(hidden=hidden, aux=aux, before_norm=before_norm)
            return "out"

    hidden, aux = torch.randn(5, 4), [torch.randn(5, 4) for _ in range(3)]
    assert PackAuxLogits(Inner())(None, hidden, None, None, aux) == "out"
    assert seen["aux"] is None and seen["hidden"] is hidden
    assert torch.equal(seen["before_norm"], torch.cat([*aux, hidden], dim=-1))

    class Base(torch.nn.Module):  # stands in for SGLang's LlamaForCausalLM
        def __init__(self):
            super().__init__()
            self.logits_processor, self.layers = Inner(), None

        def set_eagle3_layers_to_capture(self, ids):
            self.layers = ids

    cls = with_packed_capture(Base)
    assert cls.__name__ == "Base" and issubclass(cls, Base)  # SGLang registers classes by name
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("EAGLE3_SGLANG_CAPTURE_LAYERS", raising=False)
        plain = cls()
        mp.setenv("EAGLE3_SGLANG_CAPTURE_LAYERS", "1,14,26")
        packed = cls()
    assert plain.layers is None and isinstance(plain.logits_processor, Inner)
    assert packed.layers == [1, 14, 26] and isinstance(packed.logits_processor, PackAuxLogits)


def test_wait_ready_returns_only_once_a_server_called_ready_answers_health(tmp_path):
    """A server its supervisor calls ready while nothing listens (its process not yet seen dead): wait_ready waits
    until /health answers, so a capture retry does not hit a refused connection."""
    import threading
    import time

    port = free_port()
    server = managed(tmp_path, port=port)  # never started: only its readiness bookkeeping is used
    server._ready.set()
    server.process.alive = lambda: True
    started: list[FakeSGLangServer] = []
    timer = threading.Timer(1.5, lambda: started.append(aux_server(port=port).start()))
    t0 = time.monotonic()
    timer.start()
    try:
        server.wait_ready(20)
        elapsed = time.monotonic() - t0
    finally:
        timer.join()
        for fake in started:
            fake.stop()
    assert started and elapsed >= 1.4
