"""The lab times the trainer's own wiring: it builds EAGLE-3's objective only through the core's
eagle3.train.build.ttt_objective (the function build_objective uses), never with a copy of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

LAB = Path(__file__).resolve().parents[1]


def test_no_lab_file_builds_the_objective_itself():
    """No lab file constructs TTTObjective or defines a build_objective of its own."""
    found = []
    for path in sorted(LAB.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            called = getattr(node.func, "id", getattr(node.func, "attr", "")) if isinstance(node, ast.Call) else ""
            if called == "TTTObjective":
                found.append(f"{path.name}:{node.lineno} TTTObjective(...)")
            elif isinstance(node, ast.FunctionDef) and node.name == "build_objective":
                found.append(f"{path.name}:{node.lineno} def build_objective")
    assert found == []


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_the_lab_objective_follows_the_run_settings(loss):
    """lab/online_train.py's objective over a random target has the config's TTT steps, decay and token loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.config import load_config
    from lab.online_train import random_objective
    from lab.shapes import SMOLLM2_135M

    cfg = load_config("tiny", ["drafter.ttt_steps=2", "drafter.step_decay=0.5", f"train.loss={loss}"])
    shape = {
        **SMOLLM2_135M,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "num_hidden_layers": 1,
    }
    model = LlamaForCausalLM(LlamaConfig(**shape))
    objective = random_objective(cfg, model, shape, 64, torch.device("cpu"))
    assert (objective.ttt_steps, objective.step_decay, objective.loss.kind) == (2, 0.5, loss)
    assert int(objective.t2d.sum()) == 64 and objective.d2t.shape == (64,)
