"""The promoted line: atomic promotion (old or new drafter whole, after a SIGKILL at any step), rollback, the card;
the gate's rule; the warm start's copy of an export into a drafter."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.config_refresh import GateConfig
from eagle3.refresh.gate import GateRow, decide
from eagle3.refresh.line import PROMOTION_FILE, Line, PromotionError, utc_now
from eagle3.refresh.records import Promotion

ROOT = Path(__file__).resolve().parents[2]


def _export(folder: Path, seed: int) -> Path:
    """A stand-in export folder: a config and 64 KiB of seeded weights bytes (the line never reads them)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(f'{{"seed": {seed}}}\n')
    (folder / "model.safetensors").write_bytes(hashlib.sha256(str(seed).encode()).digest() * 2048)
    (folder / "README.md").write_text(f"# export {seed}\n")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors")}


def _promote(line: Line, export: Path, drafter: str) -> Path:
    return line.promote(
        export,
        Promotion(drafter, "manual", line.current_id(), "test", utc_now(), str(export)),
        card_head=(export / "README.md").read_text(),
    )


def test_promote_points_current_at_a_whole_copy_and_rollback_returns(tmp_path):
    """current serves the promoted copy (export files, promotion.json, card); rollback goes back to the drafter it
    replaced, and past the first one it refuses."""
    line = Line(tmp_path / "run")
    old, new = _export(tmp_path / "old", 1), _export(tmp_path / "new", 2)
    _promote(line, old, "a")
    _promote(line, new, "b")
    assert os.readlink(line.pointer) == "drafters/b" and _files(line.pointer) == _files(new)
    assert line.promotion("b").replaces == "a" and (line.pointer / PROMOTION_FILE).is_file()
    assert (line.pointer / "README.md").read_text().startswith("# export 2")
    assert line.rollback().id == "a" and _files(line.pointer) == _files(old)
    with pytest.raises(PromotionError, match="nothing to roll back to"):
        line.rollback()
    events = [(e["event"], e["to"]) for e in sorted(line.events.load().values(), key=lambda e: e["id"])]
    assert sorted(events) == sorted([("promote", "a"), ("promote", "b"), ("rollback", "a")])
    card = (line.root / "README.md").read_text()
    assert "Current: `a`" in card and "rollback `b` -> `a`" in card


def _kill_promotion(run: Path, export: Path, n: int) -> int:
    cmd = [sys.executable, "-m", "tests.unit.refresh_kill", "promote", str(run), str(export), "b", str(n)]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120).returncode


def test_a_sigkill_at_any_step_of_a_promotion_leaves_the_old_or_the_new_drafter_whole(tmp_path):
    """Killed before each of its file-system steps in turn, a promotion leaves `current` on the old drafter or on the
    new one, every file of it intact; the next promotion then completes and the events hold it once."""
    old, new = _export(tmp_path / "old", 1), _export(tmp_path / "new", 2)
    outcomes, n = [], 1
    while True:
        run = tmp_path / f"run-{n}"
        _promote(Line(run), old, "a")
        code = _kill_promotion(run, new, n)
        line = Line(run)
        served = _files(line.pointer)
        assert served in (_files(old), _files(new)), f"killed at step {n}: current is a mix"
        assert line.current_id() == ("b" if served == _files(new) else "a")
        outcomes.append((code, line.current_id()))
        _promote(line, new, "b")  # what the next refresh does: finish the promotion
        assert line.current_id() == "b" and _files(line.pointer) == _files(new)
        assert [e["to"] for e in line.events.load().values()].count("b") == 1
        if code == 0:
            break
        assert code == -9, f"step {n}: exit {code}"
        n += 1
    assert n > 10 and ("b" in {c for _, c in outcomes[:-1]})  # kills landed before and after the pointer swap
    assert (-9, "a") in outcomes


@pytest.mark.parametrize(
    ("deltas", "mismatches", "promote", "why"),
    [
        ({"all": 0.2, "mtbench": 0.3, "mtbench/math": -0.05}, 0, True, "promoted"),
        ({"all": 0.04, "mtbench": 0.04}, 0, False, "min_gain"),
        ({"all": 0.2, "mtbench": 0.5, "gsm8k": -0.11}, 0, False, "gsm8k"),
        ({"all": 0.5, "mtbench": 0.5}, 1, False, "lossless"),
    ],
)
def test_gate_rule(deltas, mismatches, promote, why):
    """Promote iff lossless, overall gain >= min_gain and no group falls by more than max_drop (0.05 and 0.1)."""
    rows = [GateRow(group, 10, 2.0, 2.0 + delta) for group, delta in deltas.items()]
    verdict, reason = decide(rows, GateConfig(min_gain=0.05, max_drop=0.1), mismatches)
    assert verdict is promote and why in reason


def test_warm_start_copies_every_tensor_and_matches_lm_head_rows_by_target_id(tmp_path):
    """load_init copies fc, midlayer and norm exactly; lm_head rows follow their target id into the new draft vocab,
    and a token the export lacks keeps its init."""
    from safetensors.torch import save_file

    from eagle3.drafter.model import DrafterDims, Eagle3Drafter
    from eagle3.refresh.warm_start import load_init

    dims = DrafterDims(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=10,
        draft_vocab_size=4,
        num_aux=3,
        target_hidden_size=8,
    )
    torch.manual_seed(0)
    source = Eagle3Drafter(dims)
    their_t2d = torch.zeros(10, dtype=torch.bool)
    their_t2d[[1, 3, 5, 7]] = True
    tensors = {k: v.clone() for k, v in source.state_dict().items() if not k.startswith("embed_tokens")}
    vocab = {"t2d": their_t2d, "d2t": torch.zeros(4, dtype=torch.long)}
    save_file({**tensors, **vocab}, str(tmp_path / "model.safetensors"))
    target = Eagle3Drafter(dims)
    init_row = target.lm_head.weight[1].clone()  # draft id 1 = target id 2, which the export's vocab lacks
    our_t2d = torch.zeros(10, dtype=torch.bool)
    our_t2d[[1, 2, 5, 7]] = True  # draft ids 0..3 = target ids 1, 2, 5, 7
    load_init(target, tmp_path, our_t2d)
    for name in tensors:
        if name != "lm_head.weight":
            assert torch.equal(target.state_dict()[name], tensors[name]), name
    theirs = tensors["lm_head.weight"]  # rows = target ids 1, 3, 5, 7
    for ours, there in ((0, 0), (2, 2), (3, 3)):  # target ids 1, 5, 7
        assert torch.equal(target.lm_head.weight[ours], theirs[there])
    assert torch.equal(target.lm_head.weight[1], init_row)


def test_the_deploy_stage_serves_the_current_drafter_once_one_is_promoted(tmp_path):
    """deploy.draft_dir is the run's export until a drafter is promoted, then the folder `current` points at (and
    the accept check against eagle3 eval, which measured the export, is skipped for other weights)."""
    from eagle3.config import load_config
    from eagle3.deploy_checks import draft_dir, serves_own_export

    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])
    own = _export(cfg.run_dir / "export" / "sglang", 1)
    assert draft_dir(cfg) == own
    _promote(Line(cfg.run_dir), own, "a")
    assert draft_dir(cfg) == Line(cfg.run_dir).drafter_dir("a") and serves_own_export(cfg)
    _promote(Line(cfg.run_dir), _export(tmp_path / "new", 2), "b")
    assert draft_dir(cfg) == Line(cfg.run_dir).drafter_dir("b") and not serves_own_export(cfg)
