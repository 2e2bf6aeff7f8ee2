"""lab/eval_speed.py: the decode speed benchmark runs on CPU and times only lossless decodes."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]


def test_eval_speed_benchmark_tiny_run_is_lossless(capsys):
    """lab/eval_speed.py --tiny runs end to end on CPU and every decode it times equals the static and the
    eager greedy."""
    bench = runpy.run_path(str(LAB / "eval_speed.py"))
    bench["main"](["--tiny", "--new-tokens", "16", "--repeats", "1"])
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert printed["lossless_identical"].startswith("5 of 5") and float(printed["greedy_static_tok_s"].split()[0]) > 0
    assert printed["eager_reference_identical"].startswith("7 of 7")
    assert float(printed["chain-3-oracle_round_ms"].split()[0]) > 0


def test_eval_speed_times_sampled_chain_rounds_both_ways(capsys):
    """--temperature 1 times the target's own sampling and chain 3 and 7 rounds drafted in one call and step by step;
    from the same seed both ways decode the same tokens, so their accept lengths are equal."""
    bench = runpy.run_path(str(LAB / "eval_speed.py"))
    bench["main"](["--tiny", "--new-tokens", "16", "--repeats", "1", "--temperature", "1", "--only-greedy"])
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert float(printed["sampled_target_tok_s"].split()[0]) > 0
    for steps in (3, 7):
        one_call, stepwise = (
            printed[f"sampled_chain-{steps}_round_ms"],
            printed[f"sampled_chain-{steps}_stepwise_round_ms"],
        )
        assert one_call.split("accept_len ")[1].split(",")[0] == stepwise.split("accept_len ")[1].split(",")[0]


def test_every_one_row_attention_variant_decodes_the_static_greedy(capsys):
    """--width-1-attention times the one-row decode once per attention (an sdpa kernel forced among them), and each
    decodes the static greedy's tokens; an unknown variant is refused by name."""
    bench = runpy.run_path(str(LAB / "eval_speed.py"))
    variants = ["sdpa", "sdpa-math", "packed", "packed-math", "matmul", "flex"]
    bench["main"](
        ["--tiny", "--new-tokens", "12", "--repeats", "1", "--only-greedy", "--width-1-attention", ",".join(variants)]
    )
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    for variant in variants:
        assert printed[f"greedy_width_1_tok_s[{variant}]"].endswith("vs the static greedy: identical)")
    with pytest.raises(SystemExit, match="sdpa-fast"):
        bench["main"](["--tiny", "--only-greedy", "--width-1-attention", "sdpa-fast"])
