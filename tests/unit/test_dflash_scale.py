"""DFlash training at many anchors per row: the blocks' attention through a flex BlockMask and the loss in
checkpointed lm_head chunks give what the dense mask and the whole loss give, value and gradient."""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.dflash_blocks import block_mask_mod, block_visibility, flex_block_visibility
from eagle3.drafter.dflash_loss import block_target_argmax, block_teacher, dflash_loss, sample_anchors
from eagle3.drafter.functional import FLEX_AVAILABLE
from eagle3.drafter.ttt import TTTBatch
from tests.unit.test_dflash_loss import K, a_batch
from tests.unit.test_dflash_model import random_dflash


def _loss_and_grads(labels: str = "tokens", device: str = "cpu", **kw):
    """dflash_loss of the packed two-row batch (8 anchors a row), with the gradient of every trainable tensor."""
    d, feats, ids, mask, docs = (x.to(device) if isinstance(x, torch.Tensor) else x for x in a_batch(seed=3))
    drafter = random_dflash(d).to(device).train()
    anchors, valid = sample_anchors(mask, K, 8, torch.Generator().manual_seed(2), docs)
    final = torch.randn(2, 20, d.hidden_size, generator=torch.Generator().manual_seed(9)).to(device)
    batch = TTTBatch(aux=feats, input_ids=ids, loss_mask=mask, document_ids=docs, final_hidden=final)
    teacher = block_teacher(batch, anchors, K, drafter.lm_head.weight) if labels == "target" else None
    out = dflash_loss(drafter, feats, ids, mask, anchors, valid, docs, 2.0, teacher, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    return out, grads


def _assert_same(a, b, atol: float) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=0, atol=atol)
    torch.testing.assert_close(out_a.loss_sum, out_b.loss_sum, rtol=0, atol=atol * 10)
    assert torch.equal(out_a.num_correct, out_b.num_correct) and torch.equal(out_a.num_supervised, out_b.num_supervised)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="flex_attention is not in this torch build")
def test_flex_block_mask_is_the_dense_visibility_entry_for_entry():
    """flex_block_visibility's mask_mod, evaluated at every (query, key), is block_visibility's bool mask (packed
    documents, several blocks per row), so the two kernels attend over the same keys."""
    d, _, _, mask, docs = a_batch(seed=1)
    anchors, _ = sample_anchors(mask, K, 6, torch.Generator().manual_seed(4), docs)
    start = torch.tensor([[0, 0, 7, 7, 12, 12], [0, 0, 0, 0, 0, 0]])
    dense = block_visibility(anchors, 20, K, context_start=start)[:, 0]  # [B, Q, S]
    mod = block_mask_mod(start, anchors, 20, K)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(6 * K), torch.arange(20 + 6 * K), indexing="ij")
    assert torch.equal(mod(b, torch.zeros_like(b), q, kv), dense)
    assert flex_block_visibility(anchors, 20, K, context_start=start).shape[-2:] == (6 * K, 20 + 6 * K)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="flex_attention is not in this torch build")
def test_flex_attention_gives_the_dense_loss():
    """attn=flex (flex_attention, eager: CPU has no flex backward) against the dense mask: the same loss, per-slot
    sums and counts (float32, 1e-5). The gradients are compared on a GPU (tests/gpu/test_dflash_flex_gpu.py)."""
    d, feats, ids, mask, docs = a_batch(seed=3)
    drafter = random_dflash(d)
    anchors, valid = sample_anchors(mask, K, 8, torch.Generator().manual_seed(2), docs)
    with torch.no_grad():
        flex, dense = (
            dflash_loss(drafter, feats, ids, mask, anchors, valid, docs, 2.0, attn=attn) for attn in ("flex", "dense")
        )
    torch.testing.assert_close(flex.loss, dense.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(flex.loss_sum, dense.loss_sum, rtol=0, atol=1e-4)
    assert torch.equal(flex.num_correct, dense.num_correct) and torch.equal(
        flex.num_full_correct, dense.num_full_correct
    )


@pytest.mark.parametrize("labels", ["tokens", "target"])
def test_the_loss_in_checkpointed_chunks_equals_the_whole_loss(labels):
    """chunk=7 (slots that straddle blocks and rows, a short last chunk, checkpointed) against chunk=0: the same
    loss, per-slot sums, counts and gradients, for token labels and for the target's distribution."""
    _assert_same(_loss_and_grads(labels, chunk=7), _loss_and_grads(labels, chunk=0), atol=1e-6)


def test_the_chunked_reference_argmax_equals_the_whole_one():
    """block_target_argmax with chunk=5 equals it computed at once."""
    d, feats, ids, mask, docs = a_batch(seed=5)
    drafter = random_dflash(d)
    anchors, _ = sample_anchors(mask, K, 8, torch.Generator().manual_seed(6), docs)
    final = torch.randn(2, 20, d.hidden_size, generator=torch.Generator().manual_seed(7))
    batch = TTTBatch(aux=feats, input_ids=ids, loss_mask=mask, document_ids=docs, final_hidden=final)
    whole = block_target_argmax(batch, anchors, K, drafter.lm_head.weight)
    assert whole is not None and torch.equal(block_target_argmax(batch, anchors, K, drafter.lm_head.weight, 5), whole)
