"""A DFlash drafter served by SGLang, checked on CPU: ServerSpec mode dflash, SGLang's own parser and DFLASH hook,
the FAKE server's imitation of that hook, the model card's command and doctor's mode list.

Both releases' parsers read the dflash argv in tests/unit/test_sglang_argv.py (VERSIONED_SPECS, under 0.5.16 and
0.5.23) and in `eagle3 doctor` (tests/unit/test_doctor.py). Here: SGLang 0.5.23's ``_handle_dflash`` resolving our
argv, which it refuses on any device but CUDA, so ``--device cuda`` is appended for the hook only (nothing runs on
a device). 0.5.16's hook has the same rules (it assigns the fields instead of declaring resolutions) but its
``ServerArgs.from_cli_args`` needs modules this CPU venv lacks, so it is read, not run. No real server is started.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from infra.sglang_modes import DFLASH_RESOLVED
from infra.sglang_pairs import dflash_serving_pair
from infra.sglang_spec import ServerSpec, ServerSpecError
from tests.fakes.sglang_model import LaunchArgs, build_parser
from tests.unit.argv_pairs import SERVING, sglang_parser, without_speculative_flags

PAIR = dflash_serving_pair(
    "/models/target",
    "/runs/r/export/sglang",
    port=30000,
    block_size=8,
    **SERVING,
)


def test_dflash_argv_has_the_algorithm_the_draft_and_the_block_size():
    """Mode dflash adds exactly --speculative-algorithm DFLASH, the draft folder and the block size, after the
    shared flags; without a block size SGLang reads the draft's config, so no block flag is written."""
    args = ServerSpec("M", "dflash", draft_model_path="/d", block_size=16).launch_args()
    assert args[-6:] == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-dflash-block-size",
        "16",
    ]
    assert sum(a.startswith("--speculative-") for a in args) == 3
    bare = ServerSpec("M", "dflash", draft_model_path="/d").launch_args()
    assert "--speculative-dflash-block-size" not in bare and bare[-4:-2] == ["--speculative-algorithm", "DFLASH"]


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({}, "mode dflash needs draft_model_path"),
        (
            {"draft_model_path": "/d", "num_steps": 3, "topk": 1, "num_draft_tokens": 4},
            "num_steps, topk, num_draft_tokens do not apply to mode dflash",
        ),
        ({"draft_model_path": "/d", "block_size": 1}, "block_size 1 must be >= 2"),
    ],
)
def test_a_wrong_dflash_spec_is_refused_naming_the_field(fields, needle):
    """No draft, an EAGLE-3 trio (SGLang forces one step, top-1) or a block below 2 is refused up front."""
    with pytest.raises(ServerSpecError, match=needle):
        ServerSpec("M", "dflash", **fields)


def test_block_size_belongs_to_mode_dflash_only():
    """An EAGLE-3 or plain server does not take a block size (argparse would pass it to SGLang unused)."""
    for mode, extra in (("serve", {}), ("speculative", {"draft_model_path": "/d"})):
        with pytest.raises(ServerSpecError, match="block_size only applies to mode dflash"):
            ServerSpec("M", mode, block_size=4, **extra)


def test_dflash_pair_differs_only_in_speculative_flags_and_port():
    """Baseline and DFlash argv are equal once the --speculative-* pairs and the port are removed."""
    baseline, dflash = PAIR
    assert (baseline.mode, dflash.mode, dflash.port) == ("serve", "dflash", baseline.port + 1)
    assert without_speculative_flags(dflash.launch_args()) == without_speculative_flags(baseline.launch_args())
    assert dflash.speculative and not baseline.speculative


def test_dflash_server_info_is_what_sglangs_hook_resolves():
    """The readiness probe wants DFLASH, the draft, one step, top-1 and K draft tokens (the block size)."""
    want = PAIR[1].expected_server_info()
    assert {k: want[k] for k in ("speculative_algorithm", "speculative_dflash_block_size", *DFLASH_RESOLVED)} == {
        "speculative_algorithm": "DFLASH",
        "speculative_dflash_block_size": 8,
        "speculative_num_steps": 1,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 8,
    }


# ---------------------------------------------------------------- SGLang 0.5.23's own parser and DFLASH hook


@pytest.fixture(scope="module")
def sglang() -> tuple[Any, argparse.ArgumentParser]:
    return sglang_parser()


def _resolved(sglang: tuple[Any, argparse.ArgumentParser], args: list[str], keys: list[str]) -> dict[str, Any]:
    """SGLang's _handle_dflash applied to the ServerArgs of ``args`` (on a CUDA device, which it requires)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    cls, parser = sglang
    server_args = cls.from_cli_args(parser.parse_args([*args, "--device", "cuda"]))
    _handle_dflash(server_args)
    return {k: resolution_result(server_args, k) for k in keys}


def test_sglangs_dflash_hook_resolves_our_argv_to_expected_server_info(sglang):
    """SGLang 0.5.23's _handle_dflash turns the DFlash server's argv into exactly what the readiness probe expects."""
    spec = PAIR[1]
    want = spec.expected_server_info()
    assert _resolved(sglang, spec.launch_args(), list(want)) == want


def test_sglang_refuses_a_block_size_that_disagrees_with_draft_tokens(sglang):
    """SGLang's own hook refuses --speculative-num-draft-tokens unequal to the block size, as ServerSpec refuses
    the trio for mode dflash (so our rule is not invented)."""
    with pytest.raises(ValueError, match="they differ"):
        _resolved(sglang, [*PAIR[1].launch_args(), "--speculative-num-draft-tokens", "4"], [])


def test_sglang_parses_the_dflash_pair_to_settings_that_differ_only_in_speculative_fields(sglang):
    """Through SGLang's parser and from_cli_args, baseline and DFlash ServerArgs differ in these fields only."""
    import msgspec

    cls, parser = sglang
    base, dflash = (cls.from_cli_args(parser.parse_args(spec.launch_args())) for spec in PAIR)
    differ = {f.name for f in msgspec.structs.fields(cls) if getattr(base, f.name) != getattr(dflash, f.name)}
    assert differ == {"port", "speculative_algorithm", "speculative_draft_model_path", "speculative_dflash_block_size"}


@pytest.mark.parametrize("extra", [[], ["--speculative-num-draft-tokens", "8"]])
def test_the_fake_resolves_dflash_as_sglang_does(sglang, extra):
    """The fake server's /server_info for a DFlash argv equals SGLang's hook on the same argv (block size given,
    with or without the equal draft-token count; max_running_requests left to SGLang's speculative reset)."""
    spec = ServerSpec("/models/target", "dflash", draft_model_path="/d", block_size=8)
    args = [*spec.launch_args(), *extra]
    keys = ["speculative_algorithm", "speculative_draft_model_path", *DFLASH_RESOLVED, "max_running_requests"]
    ns = vars(build_parser().parse_args(args))
    fake = LaunchArgs(**{k: v for k, v in ns.items() if not k.startswith("fake_")}).resolved(_fake_model())
    assert {k: fake[k] for k in keys} == _resolved(sglang, args, keys)


def _fake_model() -> Any:
    from tests.fakes.sglang_model import FakeModel

    return FakeModel()


def test_the_fake_reads_the_block_size_from_the_draft_without_the_flag(tmp_path):
    """Without --speculative-dflash-block-size the fake (like SGLang) takes dflash_config.block_size of the draft's
    config.json, and refuses a draft-token count that disagrees with the flag."""
    (tmp_path / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 6}, "block_size": 6}))
    args = LaunchArgs(speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path))
    got = args.resolved(_fake_model())
    assert [got[k] for k in DFLASH_RESOLVED] == [1, 1, 6]  # steps, top-k, draft tokens
    with pytest.raises(ValueError, match="they must match"):
        LaunchArgs(
            speculative_algorithm="DFLASH",
            speculative_draft_model_path="/d",
            speculative_dflash_block_size=4,
            speculative_num_draft_tokens=5,
        ).resolved(_fake_model())


# ---------------------------------------------------------------- the model card and doctor


def _card(tmp_path: Path, results: dict[str, Any] | None) -> str:
    from eagle3.config import RunConfig
    from eagle3.export.checks import INFO_FILE, read_json
    from eagle3.export.model_card import CardInputs, render_card
    from tests.unit.test_export import tiny_dims, write_target
    from tests.unit.test_export_dflash import export

    folder, _ = export(tmp_path)  # block size 4, target layers [1, 3, 5]
    target = write_target(tmp_path / "target", tiny_dims())
    cfg = RunConfig.model_validate(
        {
            "run": {"workdir": str(tmp_path), "name": "card"},
            "drafter": {"family": "dflash", "dflash": {"block_size": 4}},
        }
    )
    return render_card(CardInputs(cfg, folder, "sglang", folder, target, read_json(folder / INFO_FILE), {}, results))


def test_dflash_card_serves_with_dflash_flags_and_shows_the_measured_table(tmp_path, sglang):
    """The card of a DFlash export names the family and its target layers, gives a DFLASH command with the export's
    block size that SGLang's parser reads back, has no vLLM or EAGLE-3 line, and shows eval's table once given."""
    results = {
        "settings": {"max_new_tokens": 16, "device": "cpu", "dtype": "float32"},
        "results": [
            {
                "dataset": "all",
                "method": "dflash-3-1-4",
                "num_prompts": 2,
                "accept_len": 1.75,
                "speedup": 1.1,
                "lossless": {"identical": 2},
            }
        ],
    }
    card = _card(tmp_path, results)
    assert card.startswith("# DFlash drafter for ") and "outputs of layers [1, 3, 5]" in card
    assert "vllm serve" not in card and "EAGLE" not in card and "TTT" not in card
    command = card.split("```bash\n", 1)[1].split("\n```", 1)[0]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    parsed = sglang[1].parse_args(argv[3:])
    assert (parsed.speculative_algorithm, parsed.speculative_dflash_block_size) == ("DFLASH", 4)
    assert parsed.speculative_draft_model_path == str((tmp_path / "dflash").resolve())
    assert "| all | dflash-3-1-4 | 2 | 1.750 | 1.10x | 2/2 identical |" in card
    assert "Not measured yet" in _card(tmp_path / "again", None)


def test_doctor_checks_the_dflash_argv_for_a_dflash_run_that_serves():
    """A run with drafter.family=dflash and serve.enabled launches the baseline and a DFlash server, so doctor
    needs those two modes' argv (not the EAGLE-3 one)."""
    from eagle3.config import RunConfig
    from flows.doctor import sglang_modes_used

    cfg = RunConfig.model_validate({"drafter": {"family": "dflash"}, "serve": {"enabled": True}})
    assert sglang_modes_used(cfg) == {"serve", "dflash"}
    assert sglang_modes_used(RunConfig.model_validate({"serve": {"enabled": True}})) == {"serve", "speculative"}
