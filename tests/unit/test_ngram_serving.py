"""SGLang's n-gram speculation served, checked on CPU: ServerSpec mode ngram, SGLang's own parser and NGRAM hook, and
the FAKE server's imitation of that hook.

Both releases' parsers read the ngram argv in tests/unit/test_sglang_argv.py (VERSIONED_SPECS, under 0.5.16 and
0.5.23) and in `eagle3 doctor`. Here: SGLang 0.5.23's ``_handle_ngram`` resolving our argv, which needs a device it
supports and a page size (resolved later in SGLang's own pipeline: 1 by default on CUDA), so ``--device cuda
--page-size 1`` are appended for the hook only (nothing runs on a device). 0.5.16's hook has the same rules (it
assigns the fields instead of declaring resolutions); it is read, not run. No real server is started.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from infra.sglang_modes import NGRAM_RESOLVED
from infra.sglang_pairs import ngram_serving_pair
from infra.sglang_spec import NgramSettings, ServerSpec, ServerSpecError
from tests.fakes.sglang_model import FakeModel, LaunchArgs, build_parser
from tests.unit.argv_pairs import SERVING, sglang_parser, without_speculative_flags

SETTINGS = NgramSettings(num_draft_tokens=8, min_bfs_breadth=2, max_bfs_breadth=4, max_trie_depth=12, match_type="PROB")
PAIR = ngram_serving_pair(
    "/models/target",
    port=30000,
    ngram=SETTINGS,
    **SERVING,
)


def test_ngram_argv_has_the_algorithm_and_every_setting_and_no_draft():
    """Mode ngram adds --speculative-algorithm NGRAM, the draft-token count and the four n-gram flags, no draft
    model; a spec without settings writes SGLang's defaults out (12 tokens, breadth 1..10, depth 18, BFS)."""
    args = PAIR[1].launch_args()
    at = args.index("--speculative-algorithm")
    assert args[at : at + 12] == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "8",
        "--speculative-ngram-min-bfs-breadth",
        "2",
        "--speculative-ngram-max-bfs-breadth",
        "4",
        "--speculative-ngram-max-trie-depth",
        "12",
        "--speculative-ngram-match-type",
        "PROB",
    ]
    assert sum(a.startswith("--speculative-") for a in args) == 6
    bare = " ".join(ServerSpec("M", "ngram").launch_args())
    assert bare.endswith(
        "--speculative-algorithm NGRAM --speculative-num-draft-tokens 12 --speculative-ngram-min-bfs-breadth 1 "
        "--speculative-ngram-max-bfs-breadth 10 --speculative-ngram-max-trie-depth 18 "
        "--speculative-ngram-match-type BFS"
    )


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"draft_model_path": "/d"}, "draft_model_path do not apply to mode ngram"),
        ({"num_steps": 3, "topk": 1, "num_draft_tokens": 4}, "num_steps, topk, num_draft_tokens do not apply"),
        ({"ngram": NgramSettings(min_bfs_breadth=3, max_bfs_breadth=2)}, "min_bfs_breadth \\(3\\) <= max_bfs_breadth"),
        ({"ngram": NgramSettings(max_trie_depth=1)}, "max_trie_depth 1 must be >= 2"),
        ({"ngram": NgramSettings(num_draft_tokens=1)}, "num_draft_tokens 1 must be >= 2"),
    ],
)
def test_a_wrong_ngram_spec_is_refused_naming_the_field(fields, needle):
    """A draft model, an EAGLE-3 trio, or settings SGLang's n-gram corpus refuses at start-up fail up front."""
    with pytest.raises(ServerSpecError, match=needle):
        ServerSpec("M", "ngram", **fields)


def test_ngram_settings_belong_to_mode_ngram_only():
    """A plain or EAGLE-3 server does not take n-gram settings (SGLang would ignore them)."""
    for mode, extra in (("serve", {}), ("speculative", {"draft_model_path": "/d"})):
        with pytest.raises(ServerSpecError, match="ngram settings only apply to mode ngram"):
            ServerSpec("M", mode, ngram=NgramSettings(), **extra)


def test_ngram_pair_differs_only_in_speculative_flags_and_port():
    """Baseline and n-gram argv are equal once the --speculative-* pairs and the port are removed."""
    baseline, ngram = PAIR
    assert (baseline.mode, ngram.mode, ngram.port) == ("serve", "ngram", baseline.port + 1)
    assert without_speculative_flags(ngram.launch_args()) == without_speculative_flags(baseline.launch_args())
    assert ngram.speculative and not baseline.speculative


# ---------------------------------------------------------------- SGLang 0.5.23's own parser and NGRAM hook


@pytest.fixture(scope="module")
def sglang() -> tuple[Any, argparse.ArgumentParser]:
    return sglang_parser()


def _resolved(sglang: tuple[Any, argparse.ArgumentParser], args: list[str], keys: list[str]) -> dict[str, Any]:
    """SGLang's _handle_ngram applied to the ServerArgs of ``args`` (on CUDA with page size 1: see the module doc)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.arg_groups.speculative_hook import _handle_ngram

    cls, parser = sglang
    server_args = cls.from_cli_args(parser.parse_args([*args, "--device", "cuda", "--page-size", "1"]))
    _handle_ngram(server_args)
    return {k: resolution_result(server_args, k) for k in keys}


@pytest.mark.parametrize("settings", [NgramSettings(), SETTINGS], ids=["defaults", "set"])
def test_sglangs_ngram_hook_resolves_our_argv_to_expected_server_info(sglang, settings):
    """SGLang 0.5.23's _handle_ngram turns the n-gram server's argv into exactly what the readiness probe expects
    (top-k = max breadth, steps = tokens // top-k, no draft model)."""
    spec = ServerSpec("/models/target", "ngram", ngram=settings, max_running_requests=32)
    want = spec.expected_server_info()
    assert _resolved(sglang, spec.launch_args(), list(want)) == want


def test_ngram_settings_defaults_are_sglangs(sglang):
    """NgramSettings() holds SGLang's own defaults: the n-gram fields' and _handle_ngram's 12 draft tokens."""
    import msgspec

    defaults = {f.name: f.default for f in msgspec.structs.fields(sglang[0])}
    ours = NgramSettings()
    assert {
        k: defaults[f"speculative_ngram_{k}"] for k in ("min_bfs_breadth", "max_bfs_breadth", "max_trie_depth")
    } == {"min_bfs_breadth": ours.min_bfs_breadth, "max_bfs_breadth": ours.max_bfs_breadth, "max_trie_depth": 18}
    assert defaults["speculative_ngram_match_type"] == ours.match_type
    assert (
        _resolved(sglang, ["--model-path", "M", "--speculative-algorithm", "NGRAM"], ["speculative_num_draft_tokens"])[
            "speculative_num_draft_tokens"
        ]
        == ours.num_draft_tokens
    )


def test_sglang_refuses_a_wide_ngram_tree_on_pages_outside_flashinfer(sglang):
    """SGLang's own hook refuses a breadth above 1 with a page size above 1 on triton (a constraint the spec's doc
    states; the servers here keep SGLang's page size 1)."""
    from sglang.srt.arg_groups.speculative_hook import _handle_ngram

    cls, parser = sglang
    args = [*PAIR[1].launch_args(), "--device", "cuda", "--page-size", "16"]
    with pytest.raises(ValueError, match="only supported for the 'flashinfer' backend"):
        _handle_ngram(cls.from_cli_args(parser.parse_args(args)))


@pytest.mark.parametrize("settings", [NgramSettings(), SETTINGS], ids=["defaults", "set"])
def test_the_fake_resolves_ngram_as_sglang_does(sglang, settings):
    """The fake server's /server_info for an n-gram argv equals SGLang's hook on the same argv (max_running_requests
    left to SGLang's speculative reset)."""
    args = ServerSpec("/models/target", "ngram", ngram=settings).launch_args()
    keys = ["speculative_algorithm", "speculative_num_draft_tokens", *NGRAM_RESOLVED, "max_running_requests"]
    ns = vars(build_parser().parse_args(args))
    fake = LaunchArgs(**{k: v for k, v in ns.items() if not k.startswith("fake_")}).resolved(FakeModel())
    assert {k: fake[k] for k in keys} == _resolved(sglang, args, keys)
