"""ServerSpec.extra_args: forbidden and managed flags are caught in every spelling SGLang's parser accepts.

SGLang builds its parser with argparse's default allow_abbrev, so a unique prefix of a long flag (`--api-k`,
`--por`) and the `--flag=value` form are read as the full flag: the checks must see them the same way.
"""

from __future__ import annotations

import argparse

import pytest

from infra.sglang_spec import FORBIDDEN_EXTRA, ServerSpec, ServerSpecError


def _spec(*extra: str) -> ServerSpec:
    return ServerSpec("/models/target", "serve", extra_args=tuple(extra))


@pytest.mark.parametrize(
    "extra", [["--api-key", "K"], ["--api-key=K"], ["--api-ke", "K"], ["--api-k=K"], ["--api", "K"], ["--api=K"]]
)
def test_the_api_key_is_refused_in_extra_args_however_abbreviated(extra):
    """Every spelling argparse reads as --api-key is refused (the key would be on argv, readable by every user)."""
    with pytest.raises(ServerSpecError, match="--api-key") as err:
        _spec(*extra)
    assert "process list" in str(err.value)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--por", "31000"], "--port"),
        (["--por=31000"], "--port"),
        (["--port=31000"], "--port"),
        (["--model-p", "/other"], "--model-path"),
        (["--tp-s", "2"], "--tp-size"),
        (["--skip-server-warm"], "--skip-server-warmup"),
        (["--conf=x.yaml"], "--config"),
    ],
)
def test_abbreviated_managed_or_forbidden_flags_are_refused(extra, flag):
    """An abbreviated flag the spec sets itself (or forbids) is refused, naming the full flag it stands for."""
    with pytest.raises(ServerSpecError, match=flag):
        _spec(*extra)


@pytest.mark.parametrize(
    "extra",
    [
        ["--context-length", "8192"],
        ["--log-level", "debug"],
        ["--enable-metrics"],
        ["--served-model-name=x"],
        ["--trust-remote-code"],
    ],
)
def test_other_flags_pass(extra):
    """Flags that are no prefix of a managed or forbidden one stay allowed, in both spellings."""
    assert _spec(*extra).launch_args()[-len(extra) :] == extra


def test_the_refusals_agree_with_argparse_allow_abbrev():
    """A parser with the spec's managed and forbidden flags (allow_abbrev on, as SGLang's) reads each refused
    spelling as the full flag: what the check names is what SGLang would set."""
    spec = _spec()
    managed = [a for a in [*spec.launch_args()] if a.startswith("--")]
    parser = argparse.ArgumentParser(allow_abbrev=True)
    for flag in {*managed, *FORBIDDEN_EXTRA}:
        parser.add_argument(flag, nargs="?")
    for extra, dest in (
        (["--api-ke", "K"], "api_key"),
        (["--api-k=K"], "api_key"),
        (["--api", "K"], "api_key"),
        (["--por", "31000"], "port"),
    ):
        args, _ = parser.parse_known_args(extra)
        assert getattr(args, dest) in ("K", "31000"), extra
