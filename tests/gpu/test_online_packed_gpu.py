"""The online target's packed forward on CUDA (compiled flex_attention over a document BlockMask): the states of
a packed row equal its documents run as padded batches."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_online_packed import AUX, LENGTHS, T, _features, _model, _row

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("architecture", ["llama", "deepseek_v3"])
def test_compiled_flex_packed_rows_equal_padded_batches_on_cuda(architecture):
    """float32 on CUDA: packed (flex, compiled) and padded agree to 1e-4 on several rows of one length."""
    model = _model(architecture).to("cuda")
    packed, padded = _features(model, "packed", device="cuda"), _features(model, "padded", device="cuda")
    assert packed.packed
    for seed, lengths in enumerate([LENGTHS, [T - 10], [5] * 40]):
        row = _row(lengths, seed=seed)
        row = type(row)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(row).items()})
        got = packed.fill(row, lengths, torch.float32)
        want = padded.fill(row, lengths, torch.float32)
        assert packed.packed, "the packed forward fell back"
        n = sum(lengths)
        assert got.aux.shape == (1, T, len(AUX) * model.config.hidden_size)
        torch.testing.assert_close(got.aux[0, :n], want.aux[0, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.final_hidden[0, :n], want.final_hidden[0, :n], rtol=1e-4, atol=1e-4)
