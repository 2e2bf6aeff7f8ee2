"""ServerSpec -> argv, checked by our own rules and by SGLang 0.5.23's own parser and validation hooks.

The SGLang tests need ``pip install --no-deps sglang==0.5.23`` plus tests/sglang-parser-requirements.txt
(no GPU). What they prove: every argv we build parses with SGLang's real ``ServerArgs.add_cli_args``
parser and ``ServerArgs.from_cli_args``; SGLang's own aux-capture and hidden-state-mode resolution
hooks give the /server_info values the readiness probe expects; our /generate bodies pass SGLang's own
request schema. What they cannot run on a CPU box: the speculative resolution (it loads the model
config through modules that need torchvision's CUDA build), and anything that starts a server.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from infra.sglang import SGLANG_VERSION, ServerSpec, ServerSpecError, serving_pair
from infra.sglang_argv_check import mismatches, parse_many
from infra.sglang_bench import BenchSettings, bench_request_body
from infra.sglang_bench_records import SHARED_SETTINGS, SPEC_SETTINGS
from infra.sglang_checks import capture_request_body, generation_smoke_body
from infra.sglang_modes import MODE_GAPS, SGLANG_VERSIONS
from tests import sglang_side
from tests.fakes.sglang_model import LaunchArgs, build_parser
from tests.fakes.sglang_server import fake_authorized
from tests.unit.argv_pairs import without_speculative_flags

SKIP_REASON = (
    "sglang 0.5.23 is not importable: install it with `pip install --no-deps sglang==0.5.23` and "
    "`pip install -r tests/sglang-parser-requirements.txt` to check argv with SGLang's own parser"
)

SPECS: dict[str, ServerSpec] = {
    "capture_aux": ServerSpec("/models/target", "capture_aux", port=30100),
    "capture_aux_ids": ServerSpec(
        "/models/target",
        "capture_aux",
        port=30101,
        aux_layer_ids=(1, 15, 28),
        api_key="k3y",
        tp_size=2,
        dp_size=2,
        mem_fraction_static=0.8,
        dtype="bfloat16",
    ),
    "capture_final": ServerSpec("/models/target", "capture_final", port=30102),
    "capture_final_opts": ServerSpec(
        "/models/target",
        "capture_final",
        port=30103,
        api_key="k3y",
        tp_size=4,
        mem_fraction_static=0.75,
        extra_args=("--context-length", "8192"),
    ),
    "serve": ServerSpec("/models/target", "serve", port=30000),
    "speculative": ServerSpec("/models/target", "speculative", draft_model_path="/runs/x/export/sglang"),
    "speculative_trio": ServerSpec(
        "/models/target",
        "speculative",
        draft_model_path="/d",
        num_steps=3,
        topk=1,
        num_draft_tokens=4,
        api_key="k3y",
        mem_fraction_static=0.7,
        extra_args=("--max-running-requests", "32", "--cuda-graph-max-bs-decode", "32"),
    ),
    "speculative_topk4": ServerSpec(
        "/models/target", "speculative", draft_model_path="/d", num_steps=5, topk=4, num_draft_tokens=8
    ),
    "speculative_rejection": ServerSpec(
        "/models/target",
        "speculative",
        draft_model_path="/d",
        num_steps=3,
        topk=1,
        num_draft_tokens=4,
        rejection_sampling=True,
    ),
}
# The deploy benchmark's pair: every serving flag set, EAGLE-3 trio explicit.
BENCH_PAIR = serving_pair(
    "/models/target",
    "/runs/x/export/sglang",
    port=30000,
    num_steps=3,
    topk=1,
    num_draft_tokens=4,
    api_key="k3y",
    tp_size=2,
    dtype="bfloat16",
    mem_fraction_static=0.8,
    max_running_requests=32,
    cuda_graph_max_bs_decode=32,
    attention_backend="triton",
    extra_args=("--context-length", "8192"),
)
SPECS |= {"bench_baseline": BENCH_PAIR[0], "bench_speculative": BENCH_PAIR[1]}
# Fields SGLang resolves on the CPU box with its own hooks (speculative ones need the model config).
RESOLVED_BY_HOOKS = {"speculative_algorithm", "aux_hidden_state_capture", "return_hidden_states_mode"}


# ---------------------------------------------------------------- our own rules (no sglang needed)


def test_capture_aux_argv_has_exactly_the_capture_flags():
    """capture_aux adds the aux flags, explicit ids, full prefill, no radix cache, no tokenizer, loopback host."""
    argv = ServerSpec("M", "capture_aux", port=30100, aux_layer_ids=[1, 3, 5], api_key="s").argv("/r/.k.api-key.yaml")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    joined = " ".join(argv)
    assert (
        "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
        "--return-aux-hidden-state-layer-ids 1 3 5 --chunked-prefill-size -1 --disable-radix-cache "
        "--skip-tokenizer-init"
    ) in joined
    assert "--host 127.0.0.1 --port 30100" in joined and "--config /r/.k.api-key.yaml" in joined
    assert "--api-key" not in argv and "s" not in argv
    assert "--enable-return-hidden-states" not in argv


def test_capture_final_argv_returns_final_hidden_without_aux():
    """capture_final asks for full hidden states with the same truncation guards and no aux flags."""
    argv = ServerSpec("M", "capture_final").launch_args()
    assert " ".join(argv).endswith(
        "--enable-return-hidden-states --chunked-prefill-size -1 --disable-radix-cache --skip-tokenizer-init"
    )
    assert not any("aux" in a or "speculative" in a for a in argv)


@pytest.mark.parametrize(
    "ids, fragment",
    [
        ((3, 1), "ascending"),
        ((1, 1, 2), "repeat"),
        ((-1, 2), ">= 0"),
        ((), "empty"),
    ],
)
def test_bad_aux_layer_ids_are_refused_with_a_reason(ids, fragment):
    """aux_layer_ids must be non-empty, unique, ascending and >= 0; the message says which rule broke."""
    with pytest.raises(ServerSpecError, match=fragment):
        ServerSpec("M", "capture_aux", aux_layer_ids=ids)


def test_aux_layer_ids_only_belong_to_capture_aux():
    """A serve or speculative server does not take aux ids (the draft's config chooses them)."""
    with pytest.raises(ServerSpecError, match="only apply to modes capture_aux"):
        ServerSpec("M", "serve", aux_layer_ids=(1, 2))


def test_speculative_trio_goes_together():
    """num_steps/topk/num_draft_tokens are all set or all left to SGLang; a partial set names what is missing."""
    with pytest.raises(ServerSpecError, match="missing num_draft_tokens, topk"):
        ServerSpec("M", "speculative", draft_model_path="D", num_steps=3)
    with pytest.raises(ServerSpecError, match="needs draft_model_path"):
        ServerSpec("M", "speculative")
    with pytest.raises(ServerSpecError, match="only apply to mode speculative"):
        ServerSpec("M", "serve", num_steps=3, topk=1, num_draft_tokens=4)


def test_rejection_sampling_belongs_to_eagle3_chains_only():
    """--speculative-use-rejection-sampling is built for a speculative chain (SGLang asserts topk 1) and refused on a
    tree or another mode, naming the rule."""
    with pytest.raises(ServerSpecError, match="rejection_sampling needs topk 1"):
        ServerSpec(
            "M", "speculative", draft_model_path="D", num_steps=5, topk=4, num_draft_tokens=8, rejection_sampling=True
        )
    with pytest.raises(ServerSpecError, match="rejection_sampling only applies to mode speculative"):
        ServerSpec("M", "ngram", rejection_sampling=True)
    assert SPECS["speculative_rejection"].launch_args()[-1] == "--speculative-use-rejection-sampling"
    assert "--speculative-use-rejection-sampling" not in SPECS["speculative_trio"].launch_args(key_file="k")


def test_topk_one_requires_steps_plus_one_draft_tokens():
    """With topk 1 SGLang overrides num_draft_tokens to num_steps + 1, so another value is refused up front."""
    with pytest.raises(ServerSpecError, match="num_steps \\+ 1 = 4"):
        ServerSpec("M", "speculative", draft_model_path="D", num_steps=3, topk=1, num_draft_tokens=6)


def test_extra_args_cannot_shadow_managed_flags():
    """An extra --port (argparse keeps the last) or --skip-server-warmup (defeats readiness) is refused."""
    with pytest.raises(ServerSpecError, match="repeats --port"):
        ServerSpec("M", "serve", extra_args=("--port=1234",))
    with pytest.raises(ServerSpecError, match="skip-server-warmup"):
        ServerSpec("M", "serve", extra_args=("--skip-server-warmup",))


def test_api_key_never_reaches_the_command_line():
    """The key travels only in the --config file's text; a spec with a key and no file builds no argv at all."""
    spec = ServerSpec("M", "serve", api_key='p"w\\:d#')
    assert 'p"w\\:d#' not in " ".join(spec.argv("/r/k.yaml"))
    assert spec.key_file_text() == 'api-key: "p\\"w\\\\:d#"\n'
    with pytest.raises(ServerSpecError, match="never on the command line"):
        spec.argv()
    for flag in ("--api-key", "--config"):
        with pytest.raises(ServerSpecError, match=flag):
            ServerSpec("M", "serve", extra_args=(flag, "x"))


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "gpu-host.example"])
def test_non_loopback_host_is_refused_unless_allowed_and_then_needs_a_key(host):
    """A host other machines can reach needs allow_remote, and then an API key; loopback hosts need neither."""
    with pytest.raises(ServerSpecError, match="not a loopback address"):
        ServerSpec("M", "serve", host=host, api_key="k")
    with pytest.raises(ServerSpecError, match="needs an API key"):
        ServerSpec("M", "serve", host=host, allow_remote=True)
    assert ServerSpec("M", "serve", host=host, allow_remote=True, api_key="k").host == host
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServerSpec("M", "serve", host=loopback).host == loopback


def test_deploy_config_refuses_a_public_host_unless_allowed():
    """server.host 0.0.0.0 fails at spec building; server.allow_remote_host lets it through (with the run's key)."""
    from eagle3.config import RunConfig
    from eagle3.deploy import server_specs

    cfg = RunConfig()
    public = cfg.model_copy(update={"server": cfg.server.model_copy(update={"host": "0.0.0.0"})})
    with pytest.raises(ServerSpecError, match="allow_remote_host"):
        server_specs(public, "/m", "/d", api_key="k")
    allowed = public.model_copy(update={"server": public.server.model_copy(update={"allow_remote_host": True})})
    assert {s.host for s in server_specs(allowed, "/m", "/d", api_key="k")} == {"0.0.0.0"}


def _args_of(spec: ServerSpec, folder: Path) -> list[str]:
    """launch_args with the key file written as ManagedServer writes it."""
    if not spec.api_key:
        return spec.launch_args()
    key_file = folder / ".sglang.api-key.yaml"
    key_file.write_text(spec.key_file_text())
    return spec.launch_args(str(key_file))


def test_serving_pair_differs_only_in_speculative_flags_and_port():
    """Baseline and speculative argv are equal once the --speculative-* pairs and the port are removed."""
    baseline, speculative = BENCH_PAIR
    assert (baseline.mode, speculative.mode, speculative.port) == ("serve", "speculative", baseline.port + 1)
    base_args, spec_args = baseline.launch_args("k.yaml"), speculative.launch_args("k.yaml")
    assert without_speculative_flags(spec_args) == without_speculative_flags(base_args)
    assert " ".join(spec_args).count("--speculative-") == 5
    assert "--max-running-requests 32 --cuda-graph-max-bs-decode 32 --attention-backend triton" in " ".join(base_args)


def test_serving_pair_refuses_a_wrong_eagle3_trio():
    """With topk 1, num_draft_tokens must be num_steps + 1; the pair is not built otherwise."""
    with pytest.raises(ServerSpecError, match="num_steps \\+ 1 = 4"):
        serving_pair("M", "D", port=1, num_steps=3, topk=1, num_draft_tokens=8)


def test_api_key_stays_out_of_repr():
    """The spec's repr (logged by callers) does not show the API key."""
    assert "hunter2" not in repr(ServerSpec("M", "serve", api_key="hunter2"))


# ---------------------------------------------------------------- SGLang's own parser


@pytest.fixture(scope="module")
def sglang_parser() -> tuple[Any, argparse.ArgumentParser]:
    server_args = pytest.importorskip("sglang.srt.server_args", reason=SKIP_REASON)
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    server_args.ServerArgs.add_cli_args(parser)
    return server_args.ServerArgs, parser


def _sglang_args(sglang_parser: tuple[Any, argparse.ArgumentParser], argv: list[str]) -> Any:
    """ServerArgs from argv the way prepare_server_args builds them, --config file merged in."""
    cls, parser = sglang_parser
    if "--config" in argv:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    return cls.from_cli_args(parser.parse_args(argv))


def test_installed_sglang_is_the_version_we_speak(sglang_parser):
    """The parser under test is SGLang 0.5.23, the version whose JSON and flags this code follows."""
    import sglang

    assert sglang.__version__ == SGLANG_VERSION


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_argv_parses_with_sglangs_own_parser(sglang_parser, name, tmp_path):
    """SGLang's parser and from_cli_args accept each argv and read back the values we meant (the key from the file)."""
    spec = SPECS[name]
    args = _sglang_args(sglang_parser, _args_of(spec, tmp_path))
    assert (args.model_path, args.host, args.port) == (spec.model_path, spec.host, spec.port)
    assert (args.tp_size, args.dp_size, args.api_key) == (spec.tp_size, spec.dp_size, spec.api_key)
    assert args.mem_fraction_static == spec.mem_fraction_static
    raw = {k: v for k, v in spec.expected_server_info().items() if k not in RESOLVED_BY_HOOKS}
    assert {k: getattr(args, k) for k in raw} == raw


@pytest.mark.parametrize("name", sorted(SPECS))
def test_expected_server_info_keys_are_sglang_fields(sglang_parser, name):
    """Every key the readiness probe reads from /server_info is a ServerArgs field of 0.5.23."""
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(sglang_parser[0])}
    assert set(SPECS[name].expected_server_info()) - fields == set()


@pytest.mark.parametrize("name", ["capture_aux", "capture_aux_ids", "capture_final", "capture_final_opts", "serve"])
def test_sglang_resolution_hooks_give_the_settings_the_probe_expects(sglang_parser, name, tmp_path):
    """SGLang's own aux-capture and hidden-state-mode hooks resolve our argv to expected_server_info()."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.arg_groups.serving_hook import handle_return_hidden_states_mode
    from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture

    spec = SPECS[name]
    args = _sglang_args(sglang_parser, _args_of(spec, tmp_path))
    handle_aux_hidden_state_capture(args)
    handle_return_hidden_states_mode(args)
    assert {k: resolution_result(args, k) for k in spec.expected_server_info()} == spec.expected_server_info()


def test_sglang_refuses_what_serverspec_refuses(sglang_parser):
    """Repeated aux ids and aux capture with a draft fail in SGLang's hook too, so our checks are not invented."""
    from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture

    base = SPECS["capture_aux"].launch_args()
    for extra in (["--return-aux-hidden-state-layer-ids", "2", "2"], ["--speculative-draft-model-path", "D"]):
        with pytest.raises(ValueError):
            handle_aux_hidden_state_capture(_sglang_args(sglang_parser, base + extra))


@pytest.mark.parametrize(
    "bad", [["--num-speculative-tokens", "4"], ["--enable-return-aux-hiden-states"], ["--cuda-graph-max-bs", "32"]]
)
def test_misspelled_or_old_flags_fail_sglangs_parser(sglang_parser, bad, capsys):
    """A vLLM spelling, a typo and the 0.5.14 --cuda-graph-max-bs (now ambiguous) all exit with a parser error."""
    spec = ServerSpec("/models/target", "serve", extra_args=tuple(bad))
    with pytest.raises(SystemExit) as exc:
        sglang_parser[1].parse_args(spec.launch_args())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err or "ambiguous option" in err


def test_sglang_parser_accepts_unambiguous_prefixes(sglang_parser):
    """Known gap: SGLang keeps argparse's allow_abbrev, so a truncated flag parses as the full one."""
    args = sglang_parser[1].parse_args(["--model-path", "M", "--enable-return-aux-hidden-state"])
    assert args.enable_return_aux_hidden_states is True


def _bodies() -> list[dict[str, Any]]:
    return [
        capture_request_body([1, 2, 3], "src:1"),
        capture_request_body([5], "src:2", top_logprobs_num=20),
        generation_smoke_body("readiness-smoke-1"),
        bench_request_body("Explain sourdough.", "bench-c1-0", 256),
        bench_request_body([1, 2, 3], "bench-c4-1", 64),
    ]


def test_sglang_parses_the_pair_to_settings_that_differ_only_in_speculative_fields(sglang_parser, tmp_path):
    """Through SGLang's parser, the benchmark pair's ServerArgs differ in speculative_* fields and port only."""
    import msgspec

    base, spec = (_sglang_args(sglang_parser, _args_of(s, tmp_path)) for s in BENCH_PAIR)
    names = [f.name for f in msgspec.structs.fields(sglang_parser[0])]
    differ = {n for n in names if getattr(base, n) != getattr(spec, n)}
    assert differ == {
        "port",
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
    }
    assert (spec.max_running_requests, spec.cuda_graph_max_bs_decode, spec.attention_backend) == (32, 32, "triton")


def test_deploy_config_builds_a_pair_sglang_accepts(sglang_parser, tmp_path):
    """The deploy flow's specs from the default serve config parse in SGLang with the documented flags."""
    from eagle3.config import RunConfig
    from eagle3.deploy import server_specs

    baseline, speculative = server_specs(RunConfig(), "/models/target", "/runs/r/export/sglang", api_key="k")
    args = _sglang_args(sglang_parser, _args_of(speculative, tmp_path))
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert (args.dtype, args.mem_fraction_static, args.max_running_requests, args.cuda_graph_max_bs_decode) == (
        "bfloat16",
        0.8,
        32,
        32,
    )
    assert args.api_key == "k"
    assert _sglang_args(sglang_parser, _args_of(baseline, tmp_path)).speculative_algorithm is None


def test_deploy_config_builds_an_ngram_server_sglang_accepts(sglang_parser, tmp_path):
    """With serve.ngram the deploy flow's n-gram spec parses in SGLang to serve.ngram_* and the baseline's serving
    flags; through SGLang's parser it differs from the baseline in speculative fields and the port only."""
    import msgspec

    from eagle3.config import RunConfig
    from eagle3.deploy import server_specs, speculative_settings

    cfg = RunConfig.model_validate({"serve": {"ngram": True, "ngram_num_draft_tokens": 8, "ngram_match_type": "PROB"}})
    assert speculative_settings(cfg) == ["3-1-4", "ngram"]
    baseline, ngram = server_specs(cfg, "/models/target", "/runs/r/export/sglang", api_key="k", trio="ngram")
    base, args = (_sglang_args(sglang_parser, _args_of(s, tmp_path)) for s in (baseline, ngram))
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens, args.speculative_ngram_match_type) == (
        "NGRAM",
        8,
        "PROB",
    )
    assert (args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth) == (1, 10)
    assert (args.max_running_requests, args.cuda_graph_max_bs_decode, args.api_key) == (32, 32, "k")
    names = [f.name for f in msgspec.structs.fields(sglang_parser[0])]
    assert {n for n in names if getattr(base, n) != getattr(args, n)} == {
        "port",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
        "speculative_ngram_match_type",
    }  # breadth 1..10 and depth 18 are SGLang's defaults, so equal on the baseline's namespace


def test_benchmark_settings_names_are_sglang_fields(sglang_parser):
    """Every /server_info key the benchmark compares between the two servers is a ServerArgs field of 0.5.23."""
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(sglang_parser[0])}
    assert set(SHARED_SETTINGS + SPEC_SETTINGS) - fields == set()


def test_our_generate_bodies_pass_sglangs_request_schema(sglang_parser):
    """Capture, top-K, smoke and benchmark bodies pass SGLang's /generate contract gate and use its field names."""
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    for body in _bodies():
        assert generate_contract_error(body) is None
        assert set(body) - set(GenerateRequest.__struct_fields__) == set()
    assert generate_contract_error({"input_ids": [1], "sampling_params": {"max_new_token": 1}})  # gate is live


@pytest.mark.parametrize(
    "sampling", [BenchSettings(temperature=1.0), BenchSettings(temperature=0.7, top_p=0.9, top_k=50)]
)
def test_sampled_bench_bodies_pass_sglangs_sampling_checks(sglang_parser, sampling):
    """A sampled benchmark body passes the contract gate and SGLang's own SamplingParams checks, which refuse the
    top_k 0 our settings use for "all" (so it is left out)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    body = bench_request_body([1, 2, 3], "bench-c1-0", 64, False, sampling.sampling_params())
    assert generate_contract_error(body) is None
    params = SamplingParams(**body["sampling_params"])
    params.normalize(None)
    params.verify(vocab_size=1000)
    assert (params.temperature, params.top_p) == (sampling.temperature, sampling.top_p)
    bad = SamplingParams(**(body["sampling_params"] | {"top_k": 0}))
    bad.normalize(None)
    with pytest.raises(ValueError, match="top_k"):
        bad.verify(vocab_size=1000)


def test_fake_server_auth_matches_sglangs_rule(sglang_parser):
    """The fake's API-key decision equals SGLang's decide_request_auth on the paths we use."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    for path in ("/generate", "/model_info", "/server_info", "/health_generate", "/health", "/ready"):
        for header in (None, "Bearer k", "Bearer wrong", "k"):
            for key in (None, "k"):
                real = decide_request_auth(
                    method="GET",
                    path=path,
                    authorization_header=header,
                    api_key=key,
                    admin_api_key=None,
                    auth_level=AuthLevel.NORMAL,
                ).allowed
                assert fake_authorized(path, header, key) == real, (path, header, key)


def test_fake_server_flags_are_sglang_flags(sglang_parser):
    """Every launch flag the fake server understands is a flag of SGLang 0.5.23 (the fake invents none)."""
    _, parser = sglang_parser
    fake_flags = {
        a.option_strings[0]
        for a in build_parser()._actions
        if a.option_strings and not a.option_strings[0].startswith(("--fake-", "-h"))
    }
    real_flags = {s for a in parser._actions for s in a.option_strings}
    assert fake_flags - real_flags == set()
    assert len(fake_flags) == len(LaunchArgs.__dataclass_fields__)


# ---------------------------------------------------------------- every SGLang release we run: 0.5.16 and 0.5.23

# Argv checked under every release in SGLANG_VERSIONS: SPECS plus the mode any release can run.
VERSIONED_SPECS = SPECS | {
    "capture_packed": ServerSpec(
        "/models/target", "capture_packed", port=30104, aux_layer_ids=(1, 15, 28), api_key="k3y"
    ),
    "dflash": ServerSpec("/models/target", "dflash", draft_model_path="/runs/x/export/sglang"),
    "ngram": ServerSpec("/models/target", "ngram", port=30001, max_running_requests=32, attention_backend="triton"),
    "dflash_block": ServerSpec(
        "/models/target",
        "dflash",
        draft_model_path="/d",
        block_size=16,
        api_key="k3y",
        max_running_requests=32,
        attention_backend="triton",
    ),
}
# Flags whose existence differs between the releases (found by diffing both parsers' option strings), limited to
# those this project builds or has built: {flag: releases that have it}. The test below keeps this table true.
FLAG_RELEASES = {
    "--enable-return-aux-hidden-states": ("0.5.23",),
    "--return-aux-hidden-state-layer-ids": ("0.5.23",),
    "--return-hidden-states-mode": ("0.5.23",),
    "--cuda-graph-max-bs": ("0.5.16",),  # 0.5.23: an ambiguous prefix of --cuda-graph-max-bs-decode/-prefill...
    "--cuda-graph-max-bs-decode": ("0.5.16", "0.5.23"),
    "--enable-return-hidden-states": ("0.5.16", "0.5.23"),
    "--disable-cuda-graph": ("0.5.16", "0.5.23"),
    "--config": ("0.5.16", "0.5.23"),
    "--speculative-dflash-block-size": ("0.5.16", "0.5.23"),
    "--speculative-use-rejection-sampling": ("0.5.16", "0.5.23"),
    # The NGRAM flags are the same in both releases (0.5.16 server_args.py, 0.5.23 arg_groups/fields/spec.py).
    "--speculative-ngram-min-bfs-breadth": ("0.5.16", "0.5.23"),
    "--speculative-ngram-max-bfs-breadth": ("0.5.16", "0.5.23"),
    "--speculative-ngram-max-trie-depth": ("0.5.16", "0.5.23"),
    "--speculative-ngram-match-type": ("0.5.16", "0.5.23"),
}


@pytest.fixture(scope="module")
def parsed_by_version(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """{version: parse_many(...) of every VERSIONED_SPECS argv}: the venv's own release in-process, the other one
    in a subprocess whose ``import sglang`` is that release (tests/sglang_side.py)."""
    folder = tmp_path_factory.mktemp("keys")
    named = {name: _args_of(spec, folder) for name, spec in VERSIONED_SPECS.items()}
    out = {}
    for version in SGLANG_VERSIONS:
        if sglang_side.side_folder(version) is None:
            pytest.importorskip("sglang.srt.server_args", reason=SKIP_REASON)
            out[version] = parse_many(named)
        elif sglang_side.available(version):
            proc = sglang_side.run_under(
                version,
                "import json, sys; from infra.sglang_argv_check import parse_many; "
                f"print(json.dumps(parse_many({named!r})))",
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            out[version] = json.loads(proc.stdout.splitlines()[-1])
    return out


def _under(parsed_by_version: dict[str, dict[str, Any]], version: str) -> dict[str, Any]:
    if version not in parsed_by_version:
        pytest.skip(
            f"SGLang {version} is not installed beside the venv's: ./scripts/bootstrap.sh puts it in "
            f"{sglang_side.side_folder(version)}"
        )
    return parsed_by_version[version]


@pytest.mark.parametrize("version", SGLANG_VERSIONS)
def test_each_release_is_the_version_it_claims(parsed_by_version, version):
    """The parser checked as 0.5.16 really is 0.5.16 (the side folder shadows the venv's sglang), and so on."""
    assert _under(parsed_by_version, version)["version"] == version


@pytest.mark.parametrize("name", sorted(VERSIONED_SPECS))
@pytest.mark.parametrize("version", SGLANG_VERSIONS)
def test_every_argv_parses_under_each_release_or_is_a_known_gap(parsed_by_version, version, name):
    """Each release's own parser reads each argv to the values we meant; a mode MODE_GAPS lists for a release
    (0.5.16 cannot run capture_aux) must be REJECTED by that parser, so this fails when that stops being true."""
    spec = VERSIONED_SPECS[name]
    result = _under(parsed_by_version, version)["parsed"][name]
    gap = MODE_GAPS.get(version, {}).get(spec.mode)
    if gap:
        assert result["error"] and "unrecognized arguments: --enable-return-aux-hidden-states" in result["error"], (
            f"SGLang {version} now parses {name}: MODE_GAPS says {gap!r}; drop the entry if it runs"
        )
        return
    assert result["error"] is None, result["error"]
    assert mismatches(spec, argparse.Namespace(**result["values"])) == []


@pytest.mark.parametrize("flag", sorted(FLAG_RELEASES))
def test_flag_differences_between_releases_are_the_known_ones(parsed_by_version, flag):
    """FLAG_RELEASES says which releases' parsers know each flag whose existence differs, or that we rely on."""
    for version in SGLANG_VERSIONS:
        flags = set(_under(parsed_by_version, version)["flags"])
        assert (flag in flags) == (version in FLAG_RELEASES[flag]), (flag, version)


def test_only_capture_aux_needs_the_newer_release():
    """The version-to-modes table: 0.5.16 lacks exactly capture_aux; 0.5.23 runs every mode; only known releases."""
    assert set(MODE_GAPS) <= set(SGLANG_VERSIONS)
    assert {v: set(g) for v, g in MODE_GAPS.items()} == {"0.5.16": {"capture_aux"}}
