"""DFlash's blocks through compiled flex_attention on a GPU (drafter.attn_impl auto there) against the dense mask:
the same loss and gradients, so training at thousands of anchors per row trains what the dense path trains."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_dflash_scale import _assert_same, _loss_and_grads

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_flex_gives_the_dense_loss_and_gradients_on_cuda():
    """float32 on CUDA, chunked loss in both: flex (compiled kernel) and dense agree within 1e-4."""
    flex = _loss_and_grads(device="cuda", attn="flex", chunk=7)
    dense = _loss_and_grads(device="cuda", attn="dense", chunk=7)
    _assert_same(flex, dense, atol=1e-4)
