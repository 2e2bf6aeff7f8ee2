"""drafter.dflash.init=target: a DFlash drafter started from the target's own layers, on the tiny preset's target."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import load_config
from eagle3.drafter.dflash import context_kv, dflash_weights, project_context
from eagle3.drafter.functional import rms_norm
from eagle3.target.load import prepare_target, read_tensor
from eagle3.train.dflash import build_dflash_objective, dflash_setup
from eagle3.train.dflash_init import first_copied_layer
from tests.unit.test_speculate import AUX_IDS


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The tiny target (8 layers, aux [1, 3, 4]) and a 2-layer DFlash drafter started from it."""
    workdir = tmp_path_factory.mktemp("dflash-init")
    overrides = [f"run.workdir={workdir}", "drafter.family=dflash", "drafter.dflash.block_size=4"]
    cfg = load_config("tiny", [*overrides, "drafter.dflash.num_layers=2", "drafter.dflash.init=target"])
    model_dir = prepare_target(cfg)
    setup = dflash_setup(cfg, model_dir, AUX_IDS)
    return model_dir, setup, build_dflash_objective(cfg, setup, model_dir, torch.device("cpu")).drafter


def test_draft_layers_are_the_target_layers_after_the_deepest_read_one(started):
    """Draft layers 0 and 1 hold target layers 5 and 6 (the deepest read layer is 4), every tensor of them; the
    final norm is the target's; the per-head q/k norms stay ones (a Llama target has none)."""
    model_dir, _, drafter = started
    for j, i in enumerate((5, 6)):
        params = dict(drafter.layers[j].named_parameters())
        for name in (
            "self_attn.q_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.down_proj.weight",
            "post_attention_layernorm.weight",
        ):
            assert torch.equal(params[name], read_tensor(model_dir, f"model.layers.{i}.{name}").float()), (j, name)
        assert torch.equal(params["self_attn.q_norm.weight"], torch.ones_like(params["self_attn.q_norm.weight"]))
    assert torch.equal(drafter.norm.weight, read_tensor(model_dir, "model.norm.weight").float())


def test_context_values_are_what_the_copied_target_layer_computes(started):
    """Functional: the first draft layer's context values for states h (deepest slice h_deep) are
    v_proj(input_layernorm(h_deep)) of target layer 5, i.e. what that layer reads as its values (the other read
    layers contribute nothing at the start)."""
    model_dir, setup, drafter = started
    d, h = drafter.dims, drafter.dims.hidden_size
    feats = torch.randn(1, 6, d.num_context_features * h, generator=torch.Generator().manual_seed(0))
    w = dflash_weights(drafter)
    _, values = context_kv(w, project_context(w, feats, d.rms_norm_eps), torch.arange(6)[None], d)[0]
    ln = read_tensor(model_dir, "model.layers.5.input_layernorm.weight").float()
    v_proj = read_tensor(model_dir, "model.layers.5.self_attn.v_proj.weight").float()
    want = rms_norm(feats[..., -h:], ln, d.rms_norm_eps) @ v_proj.T  # [1, 6, nKV*hd]
    want = want.view(1, 6, d.num_key_value_heads, d.head_dim).transpose(1, 2)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)


def test_the_copied_layers_stay_inside_the_target():
    """The first copied layer moves down when the layers after the deepest read one are too few; more draft
    layers than the target has is refused."""
    assert first_copied_layer([1, 14, 26], 30, 1) == 27
    assert first_copied_layer([1, 14, 26], 30, 5) == 25
    with pytest.raises(ValueError, match="one target layer per draft layer"):
        first_copied_layer([1, 3, 4], 8, 9)
