"""Our speculators export, loaded by the speculators package's own Eagle3 model, computes what our drafter does.

Needs ``pip install --no-deps speculators==0.9.0`` plus tests/speculators-requirements.txt; skipped (with the
missing module named) otherwise. The package is pure Python; it runs here on transformers 5.24 although it
declares <= 5.19.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from eagle3.drafter.model import export_state_dict
from eagle3.export.speculators import export_speculators
from tests.unit.test_export import AUX, random_drafter, tiny_dims, ttt_inputs, ttt_logits, vocab_maps, write_target

NEEDED = ("speculators", "datasets", "pandas", "multiprocess", "xxhash", "hs_connectors", "loguru")
MISSING = [m for m in NEEDED if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"speculators test needs modules {MISSING}: pip install "
    "--no-deps speculators==0.9.0 and -r tests/speculators-requirements.txt",
)
TTT_STEPS = 3
ATOL = 1e-5  # fp32 on both sides; the two implementations order their reductions differently


def load_with_speculators(export_dir, attn_implementation: str, **config_changes):
    """Eagle3DraftModel.from_pretrained on the export (it also reads the verifier's lm_head and norm)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = attn_implementation  # the kernel, not the maths
    for key, value in config_changes.items():
        setattr(config, key, value)
    return Eagle3DraftModel.from_pretrained(str(export_dir), config=config, dtype=torch.float32).eval()


@torch.no_grad()
def speculators_logits(model, aux: torch.Tensor, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(logits of each TTT step seen at lm_head, draft tokens it returns) of speculators' own forward."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, logits: seen.append(logits.detach()))
    try:
        # speculators feeds input_ids as step 0's tokens and shifts them by one more per step: pass x_{t+1}.
        tokens = model(
            hidden_states=aux,
            input_ids=torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1),
            document_ids=torch.zeros_like(ids),
            position_ids=torch.arange(ids.shape[1])[None],
            ttt_steps=TTT_STEPS,
        )
    finally:
        hook.remove()
    return seen, tokens


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(our drafter, the export dir, target dir, dims): a random tiny drafter exported in fp32."""
    tmp = tmp_path_factory.mktemp("spec")
    dims = tiny_dims()
    target = write_target(tmp / "target", dims)
    drafter = random_drafter(dims, target)
    out = export_speculators(
        drafter.state_dict(),
        dims,
        *vocab_maps(dims),
        AUX,
        tmp / "speculators",
        torch.float32,
        verifier_name_or_path=str(target),
    )
    return drafter, out, target, dims


def test_speculators_loads_every_tensor_we_exported(exported):
    """Its model holds our fc, layers.0.*, norm, lm_head, d2t/t2d, the target's embeddings, and our aux ids."""
    drafter, out, _, dims = exported
    model = load_with_speculators(out, "eager")
    theirs = model.state_dict()
    for name, value in export_state_dict(drafter).items():
        their_name = name.replace("midlayer.", "layers.0.", 1)
        assert torch.equal(theirs[their_name], value), name
    assert torch.equal(model.embed_tokens.weight, drafter.embed_tokens.weight)
    d2t, t2d = vocab_maps(dims)
    assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)
    assert model.target_layer_ids == [2, 4, 5]  # capture-before = our output-of-layer [1, 3, 4] + 1
    assert model.config.norm_before_residual is False and model.config.norm_output is False


# speculators' flex path extends its block mask per step assuming T is a multiple of 128 (its block size).
@pytest.mark.parametrize("attn, seq_len", [("eager", 12), ("simple_flex_attention", 128)])
def test_speculators_forward_matches_ours(exported, attn, seq_len):
    """Three TTT steps of speculators' own forward give our logits at every step (atol 1e-5) and our tokens."""
    drafter, out, _, dims = exported
    model = load_with_speculators(out, attn)
    aux, ids = ttt_inputs(dims, seq_len)
    seen, tokens = speculators_logits(model, aux, ids)
    ours = ttt_logits(drafter, aux, ids, TTT_STEPS)
    assert len(seen) == TTT_STEPS
    for k, (mine, theirs) in enumerate(zip(ours, seen)):
        assert torch.allclose(mine, theirs, atol=ATOL, rtol=0), (k, (mine - theirs).abs().max().item())
        assert torch.equal(tokens[k], mine.argmax(-1)), k


def test_speculators_trainer_default_flag_would_not_match(exported):
    """Control: with norm_before_residual=True (speculators' trainer default) step 0 differs, so the flag matters."""
    drafter, out, _, dims = exported
    aux, ids = ttt_inputs(dims)
    seen, _ = speculators_logits(load_with_speculators(out, "eager", norm_before_residual=True), aux, ids)
    assert not torch.allclose(seen[0], ttt_logits(drafter, aux, ids, 1)[0], atol=1e-2)
