"""lab/drafter_shift.py on the evaluate stage's tiny run: its teacher-forced figures match what the decode
measured."""

from __future__ import annotations

import json
import re
import runpy
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.data.vocab import maps_from_used
from eagle3.drafter.model import Eagle3Drafter, export_state_dict, init_weights
from eagle3.evaluate.stage import run_evaluate
from eagle3.export.sglang import export_sglang
from eagle3.run.journal import Journal
from eagle3.run.stages import write_run_config
from eagle3.target.load import target_info
from eagle3.target.tensors import drafter_dims

LAB = Path(__file__).resolve().parents[1]


def test_drafter_shift_benchmark_reproduces_the_decodes_position1_acceptance(tiny_run, tmp_path, capsys):
    """lab/drafter_shift.py: teacher-forced agreement at the chain's round starts equals the position-1
    acceptance the evaluation measured, per dataset, with a drafter that hits on some rounds and misses on
    others (it always proposes the tiny target's most frequent greedy token)."""
    cfg, model_dir, export_dir = tiny_run
    run_evaluate(cfg, export_dir=export_dir)
    records = [json.loads(line) for line in (cfg.run_dir / "eval" / "prompts.jsonl").read_text().splitlines()]
    frequent = Counter(t for r in records for t in r["greedy"]["tokens"]).most_common(1)[0][0]
    info = target_info(model_dir, cfg.target)
    drafter = Eagle3Drafter(drafter_dims(info, model_dir, draft_vocab_size=info.vocab_size - frequent))
    init_weights(drafter, std=0.2)
    with torch.no_grad():
        drafter.norm.weight.zero_()  # all draft logits 0: argmax is draft id 0, i.e. target id `frequent`
    d2t, t2d = maps_from_used(np.arange(frequent, info.vocab_size), info.vocab_size)
    constant = export_sglang(
        export_state_dict(drafter),
        drafter.dims,
        d2t,
        t2d,
        info.aux_layer_ids,
        tmp_path / "constant-export",
        dtype=torch.float32,
    )
    run = cfg.model_copy(update={"run": cfg.run.model_copy(update={"workdir": str(tmp_path / "runs")})})
    run_evaluate(run, export_dir=constant)
    journal = Journal(tmp_path / "regenerate.journal.jsonl")
    with journal.appender() as append:
        for i in range(4):
            append(
                {
                    "id": f"sharegpt:c{i}",
                    "status": "ok",
                    "messages": [
                        {"role": "user", "content": f"Question {i}: what is the capital of France?"},
                        {"role": "assistant", "content": "The capital of France is Paris. " * (i + 1)},
                    ],
                }
            )
    shift = runpy.run_path(str(LAB / "drafter_shift.py"))
    shift["main"](
        [
            "--config",
            str(write_run_config(run)),
            "--export-dir",
            str(constant),
            "--journal",
            str(journal.path),
            "--eval-prompts",
            str(run.run_dir / "eval" / "prompts.jsonl"),
            "--num-conversations",
            "4",
        ]
    )
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert int(printed["val_conversations"]) + int(printed["train_conversations"]) == 4
    rates = []
    for dataset in ("mtbench", "gsm8k"):
        at_starts = printed[f"eval_{dataset}_teacher_forced_at_chain_round_starts"]
        assert at_starts == printed[f"eval_{dataset}_chain_position1_acceptance"]
        rates.append(float(at_starts.split()[0]))
    assert any(0.0 < rate < 1.0 for rate in rates), rates
    replays = {k: v for k, v in printed.items() if k.endswith("_replayed_accept_len")}
    assert {k.split("_")[1] for k in replays} == {"mtbench", "gsm8k"}, replays
    for line in replays.values():  # e.g. "1.2500 (decoded 1.2500; identical rounds on 2/2 prompts)"
        replayed, decoded, same, prompts = re.fullmatch(
            r"([\d.]+) \(decoded ([\d.]+); identical rounds on (\d+)/(\d+) prompts\)", line
        ).groups()
        assert replayed == decoded and same == prompts and int(prompts) > 0, line
    assert any(float(line.split()[0]) > 1.0 for line in replays.values()), replays  # some drafts accepted
    # --replay-only on another drafter's evaluation (same target and prompts, so the same greedy texts) gives
    # this drafter's decoded chain acceptance without decoding it
    shift["main"](
        [
            "--config",
            str(write_run_config(run)),
            "--export-dir",
            str(constant),
            "--replay-only",
            "--eval-prompts",
            str(cfg.run_dir / "eval" / "prompts.jsonl"),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    replayed = json.loads((tmp_path / "r.json").read_text())["accept_len"]
    for key, line in replays.items():
        dataset, method = key.split("_")[1:3]
        assert f"{replayed[f'{dataset}/{method}']:.4f}" == re.search(r"decoded ([\d.]+)", line).group(1), key
    assert {k.split("/")[0] for k in replayed} == {"mtbench", "gsm8k", "all"}
    decoded = {
        f"{r['dataset']}/{r['method']}": r["accept_len"]
        for r in json.loads((cfg.run_dir / "eval" / "results.json").read_text())["results"]
    }
    assert all(replayed[k] == pytest.approx(decoded[k]) for k in decoded if k.endswith("/ngram")), (replayed, decoded)
