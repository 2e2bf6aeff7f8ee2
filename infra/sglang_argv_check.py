"""Parse the argv every ServerSpec mode builds with the installed SGLang's own argument parser.

No GPU, no model, no server: ``ServerArgs.add_cli_args`` builds SGLang's real parser, ``--config``
is merged the way SGLang's ``prepare_server_args`` merges it (its ``ConfigArgumentMerger``), and the
parsed values are compared with what the spec meant. ``ServerArgs.from_cli_args`` is not called:
in 0.5.16 it runs ``__post_init__``, which needs an accelerator and the model's files.

``check_modes()`` is what `eagle3 doctor` prints and what the tests run under each of
``SGLANG_VERSIONS``; a (version, mode) pair listed in ``MODE_GAPS`` must fail to parse, so a
release that gains the missing flag shows up as a changed fact rather than passing silently.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infra.sglang_modes import DFLASH_RESOLVED, MODE_GAPS, MODES, NGRAM_RESOLVED
from infra.sglang_pairs import dflash_serving_pair, ngram_serving_pair, serving_pair
from infra.sglang_spec import ServerSpec

# Settings SGLang derives in its resolution hooks, not straight from a flag: not on the parsed namespace.
RESOLVED_FIELDS = {"aux_hidden_state_capture", "return_hidden_states_mode"}
MODE_RESOLVED = {"dflash": set(DFLASH_RESOLVED), "ngram": set(NGRAM_RESOLVED)}
PLACEHOLDER_KEY = "placeholder-key"


class SGLangParseError(ValueError):
    """SGLang's parser refused an argv; the message is argparse's."""


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting."""

    def error(self, message: str) -> Any:
        raise SGLangParseError(message)


def installed_version() -> str | None:
    """The importable sglang's version, or None when it does not import."""
    try:
        import sglang
    except Exception:  # a broken install fails with anything
        return None
    return getattr(sglang, "__version__", "unknown")


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own launch_server parser (raising instead of exiting)."""
    from sglang.srt.server_args import ServerArgs

    parser = _RaisingParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser


def _config_merger(parser: argparse.ArgumentParser) -> Any:
    try:  # 0.5.23: sglang/srt/utils/server_args_config_parser.py
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
    except ImportError:  # 0.5.16: sglang/srt/server_args_config_parser.py
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger
    return ConfigArgumentMerger(parser)


def parse_launch_args(args: Sequence[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The namespace SGLang's parser makes of ``args`` (a ``--config`` YAML merged in first, as SGLang does)."""
    parser = parser or sglang_parser()
    args = list(args)
    if "--config" in args:
        args = _config_merger(parser).merge_config_with_args(args)
    return parser.parse_args(args)


def placeholder_specs() -> dict[str, ServerSpec]:
    """One spec per mode with placeholder paths; serve/speculative are a serving_pair with every field set
    and an API key (so the --config merge is exercised too), dflash and ngram the DFlash and n-gram twins of that
    baseline."""
    shared: dict[str, Any] = dict(
        api_key=PLACEHOLDER_KEY,
        tp_size=1,
        dtype="bfloat16",
        mem_fraction_static=0.8,
        max_running_requests=32,
        cuda_graph_max_bs_decode=32,
        attention_backend="triton",
    )
    baseline, speculative = serving_pair(
        "/placeholder/target", "/placeholder/draft", port=30000, num_steps=3, topk=1, num_draft_tokens=4, **shared
    )
    dflash = dflash_serving_pair("/placeholder/target", "/placeholder/draft", port=30000, block_size=16, **shared)[1]
    ngram = ngram_serving_pair("/placeholder/target", port=30000, **shared)[1]
    return {
        "capture_packed": ServerSpec("/placeholder/target", "capture_packed", port=30104, aux_layer_ids=(1, 15, 28)),
        "capture_aux": ServerSpec("/placeholder/target", "capture_aux", port=30100, aux_layer_ids=(1, 15, 28)),
        "capture_final": ServerSpec("/placeholder/target", "capture_final", port=30102),
        "serve": baseline,
        "speculative": speculative,
        "dflash": dflash,
        "ngram": ngram,
    }


def mismatches(spec: ServerSpec, parsed: argparse.Namespace) -> list[str]:
    """Fields whose parsed value differs from what ``spec`` meant (empty when SGLang read what we wrote)."""
    resolved = RESOLVED_FIELDS | MODE_RESOLVED.get(spec.mode, set())
    want = {k: v for k, v in spec.expected_server_info().items() if k not in resolved}
    if spec.mode == "capture_aux":  # SGLang's aux hook clears the EAGLE3 algorithm the flag set
        want["speculative_algorithm"] = "EAGLE3"
    want |= {"host": spec.host, "api_key": spec.api_key}
    return [
        f"{k}={getattr(parsed, k, '<no such field>')!r}, not {v!r}"
        for k, v in want.items()
        if getattr(parsed, k, "<no such field>") != v
    ]


@dataclass(frozen=True)
class ModeCheck:
    """One mode's verdict: ``ok`` it parses to what we meant; ``known_gap`` the version is known not to run it."""

    mode: str
    ok: bool
    detail: str
    known_gap: str | None = None

    @property
    def as_expected(self) -> bool:
        """Parses where it should, and fails where MODE_GAPS says the version cannot run it."""
        return self.ok != bool(self.known_gap)


def check_spec(spec: ServerSpec, parser: argparse.ArgumentParser, folder: Path) -> tuple[bool, str]:
    """(parses to the meant values, detail) for one spec; a key file is written in ``folder`` when needed."""
    key_file = None
    if spec.api_key:
        key_file = folder / f".{spec.mode}.api-key.yaml"
        key_file.write_text(spec.key_file_text())
    try:
        parsed = parse_launch_args(spec.launch_args(str(key_file) if key_file else None), parser)
    except Exception as exc:  # SGLangParseError, or the config merger's ValueError
        return False, f"{type(exc).__name__}: {exc}"
    wrong = mismatches(spec, parsed)
    return (False, "parsed, but " + "; ".join(wrong)) if wrong else (True, "parses")


def check_modes(version: str | None = None) -> list[ModeCheck]:
    """Every mode's placeholder argv through the installed SGLang's parser. Raises ImportError without sglang."""
    version = version or installed_version()
    if version is None:
        raise ImportError("sglang is not importable")
    parser = sglang_parser()
    gaps = MODE_GAPS.get(version, {})
    out = []
    specs = placeholder_specs()
    with tempfile.TemporaryDirectory(prefix="eagle3-argv-") as folder:
        for mode in MODES:
            ok, detail = (
                check_spec(specs[mode], parser, Path(folder))
                if mode in specs
                else (False, "no placeholder spec for this mode in infra/sglang_argv_check.py")
            )
            out.append(ModeCheck(mode, ok, detail, gaps.get(mode)))
    return out


def parse_many(named_args: dict[str, list[str]]) -> dict[str, Any]:
    """For tests under another release: {"version", "flags": every option string of the parser,
    "parsed": {name: {"error": str | None, "values": the namespace as JSON-able values}}}."""
    parser = sglang_parser()
    parsed: dict[str, Any] = {}
    for name, args in named_args.items():
        try:
            parsed[name] = {
                "error": None,
                "values": json.loads(json.dumps(vars(parse_launch_args(args, parser)), default=repr)),
            }
        except Exception as exc:  # SGLangParseError, or the config merger's ValueError
            parsed[name] = {"error": f"{type(exc).__name__}: {exc}", "values": {}}
    flags = sorted(s for action in parser._actions for s in action.option_strings)
    return {"version": installed_version(), "flags": flags, "parsed": parsed}


def main() -> int:
    """python -m infra.sglang_argv_check: the version and every mode's verdict as JSON; exit 1 on a surprise."""
    version = installed_version()
    checks = check_modes(version) if version else []
    print(json.dumps({"version": version, "modes": [asdict(c) | {"as_expected": c.as_expected} for c in checks]}))
    return 0 if version and all(c.as_expected for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
