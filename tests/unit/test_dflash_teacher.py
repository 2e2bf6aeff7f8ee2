"""The DFlash teacher: the target's own distribution as the labels of every block slot (drafter.dflash.labels),
against a block-by-block reference, and what a draft is counted right against."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3.drafter.alignment import Supervision
from eagle3.drafter.dflash_loss import (
    DFlashObjective,
    block_target_argmax,
    block_teacher,
    dflash_loss,
    sample_anchors,
)
from eagle3.drafter.ttt import TTTBatch
from tests.unit.test_dflash_loss import K, a_batch, reference_loss
from tests.unit.test_dflash_model import random_dflash


def setup(seed: int = 0):
    """The packed two-row batch of test_dflash_loss, a random drafter, anchors, and final states [2, 20, H]."""
    d, feats, ids, mask, docs = a_batch(seed)
    drafter = random_dflash(d)
    anchors, valid = sample_anchors(mask, K, 6, torch.Generator().manual_seed(1), docs)
    final = torch.randn(2, 20, d.hidden_size, generator=torch.Generator().manual_seed(seed + 7))
    batch = TTTBatch(aux=feats, input_ids=ids, loss_mask=mask, document_ids=docs, final_hidden=final)
    return drafter, batch, anchors, valid


@pytest.mark.parametrize("gamma", [None, 2.0])
def test_distilled_loss_equals_block_by_block_reference(gamma):
    """Golden parity (float32, 1e-5): with the teacher, each slot k of the block at p is scored against
    softmax(lm_head(final[p+k-1])), the target's prediction of the token at p+k, block by block by hand."""
    drafter, b, anchors, valid = setup()
    with torch.no_grad():
        teacher = block_teacher(b, anchors, K, drafter.lm_head.weight)
        out = dflash_loss(drafter, b.aux, b.input_ids, b.loss_mask, anchors, valid, b.document_ids, gamma, teacher)
        ref = reference_loss(
            drafter, b.aux, b.input_ids, b.loss_mask, b.document_ids, anchors, valid, gamma, final=b.final_hidden
        )
    torch.testing.assert_close(out.loss, ref, rtol=0, atol=1e-5)


def test_teacher_slots_read_the_target_one_position_before_the_drafted_token():
    """Slot k of the block anchored at p: probs = softmax(lm_head(final[p+k-1])), argmax its argmax."""
    drafter, b, anchors, _ = setup()
    teacher = block_teacher(b, anchors, K, drafter.lm_head.weight)
    assert teacher is not None and teacher.probs.shape == (2, 6, K - 1, drafter.dims.vocab_size)
    for row, n, k in [(0, 0, 1), (1, 2, 3), (1, 5, 2)]:
        p = int(anchors[row, n])
        logits = drafter.lm_head.weight @ b.final_hidden[row, p + k - 1]
        torch.testing.assert_close(teacher.probs[row, n, k - 1], torch.softmax(logits, dim=-1))
        assert teacher.argmax[row, n, k - 1] == logits.argmax()


def test_a_one_hot_teacher_gives_the_token_loss():
    """Distilling from a teacher that puts all its mass on the row's token equals the token cross-entropy."""
    drafter, b, anchors, valid = setup()
    index = (anchors[..., None] + torch.arange(1, K)).clamp(max=19)  # [B, N, K-1] the drafted tokens' indices
    tokens = b.input_ids.gather(1, index.flatten(1)).view_as(index)
    one_hot = Supervision(F.one_hot(tokens, drafter.dims.vocab_size).float(), tokens)
    with torch.no_grad():
        plain = dflash_loss(drafter, b.aux, b.input_ids, b.loss_mask, anchors, valid, b.document_ids, 2.0)
        taught = dflash_loss(drafter, b.aux, b.input_ids, b.loss_mask, anchors, valid, b.document_ids, 2.0, one_hot)
    torch.testing.assert_close(taught.loss, plain.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(taught.loss_sum, plain.loss_sum, rtol=0, atol=1e-4)
    assert torch.equal(taught.num_correct, plain.num_correct)


def test_drafts_are_counted_right_against_the_reference():
    """A hit is a draft equal to the reference (default: the teacher's argmax): the row's tokens as reference count
    what the token labels count, a reference no draft can equal (-1) counts nothing, whatever the loss."""
    drafter, b, anchors, valid = setup()
    teacher = block_teacher(b, anchors, K, drafter.lm_head.weight)
    assert teacher is not None
    index = (anchors[..., None] + torch.arange(1, K)).clamp(max=19)
    tokens = b.input_ids.gather(1, index.flatten(1)).view_as(index)

    def run(**kwargs):
        with torch.no_grad():
            return dflash_loss(drafter, b.aux, b.input_ids, b.loss_mask, anchors, valid, b.document_ids, **kwargs)

    plain = run()
    assert plain.num_correct.sum() > 0  # the comparisons below are not vacuous
    assert torch.equal(run(teacher=teacher, reference=tokens).num_correct, plain.num_correct)
    assert run(reference=torch.full_like(tokens, -1)).num_correct.sum() == 0
    assert torch.equal(run(teacher=teacher).reference, teacher.argmax)
    assert torch.equal(run(reference=tokens).loss, plain.loss)  # the reference never changes the loss


def test_objective_distills_when_asked_and_refuses_target_labels_without_supervision():
    """DFlashObjective(labels=target) equals dflash_loss with block_teacher; labels=tokens keeps the token CE but
    still counts hits against the target's argmax (against the tokens when the batch has no supervision); with no
    supervision in the batch, target labels are refused."""
    drafter, b, anchors, valid = setup()
    d = drafter.dims
    index = list(range(d.num_context_features))
    with torch.no_grad():
        teacher = block_teacher(b, anchors, K, drafter.lm_head.weight)
        want = dflash_loss(drafter, b.aux, b.input_ids, b.loss_mask, anchors, valid, b.document_ids, None, teacher)
        tokens = dflash_loss(drafter, b.aux, b.input_ids, b.loss_mask, anchors, valid, b.document_ids)
        got = DFlashObjective(drafter, index, len(index), 6, labels="target")(b, (anchors, valid))
        kept = DFlashObjective(drafter, index, len(index), 6, labels="tokens")(b, (anchors, valid))
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    torch.testing.assert_close(kept.loss, tokens.loss, rtol=0, atol=0)
    assert torch.equal(kept.reference, teacher.argmax)
    bare = TTTBatch(aux=b.aux, input_ids=b.input_ids, loss_mask=b.loss_mask, document_ids=b.document_ids)
    with torch.no_grad():
        bare_tokens = DFlashObjective(drafter, index, len(index), 6, labels="tokens")(bare, (anchors, valid))
    assert torch.equal(bare_tokens.num_correct, tokens.num_correct)
    with pytest.raises(ValueError, match="labels=target needs the target's supervision"):
        DFlashObjective(drafter, index, len(index), 6, labels="target")(bare, (anchors, valid))


def test_topk_teacher_with_every_id_equals_the_final_hidden_teacher():
    """Top-K log-probs that hold the whole vocab rebuild the same teacher as final_hidden through lm_head."""
    drafter, b, anchors, _ = setup()
    vocab = drafter.dims.vocab_size
    logprobs = torch.log_softmax(b.final_hidden @ drafter.lm_head.weight.T, dim=-1)  # [B, T, V]
    top = logprobs.topk(vocab, dim=-1)
    topk = TTTBatch(b.aux, b.input_ids, b.loss_mask, b.document_ids, topk_ids=top.indices, topk_logprobs=top.values)
    want = block_teacher(b, anchors, K, drafter.lm_head.weight)
    got = block_teacher(topk, anchors, K, drafter.lm_head.weight)
    assert want is not None and got is not None
    torch.testing.assert_close(got.probs, want.probs, rtol=0, atol=1e-6)
    assert torch.equal(got.argmax, want.argmax)


def test_target_argmax_alone_equals_the_teacher_argmax():
    """block_target_argmax (no softmax) gives block_teacher's argmax, from final states and from top-K log-probs."""
    drafter, b, anchors, _ = setup()
    logprobs = torch.log_softmax(b.final_hidden @ drafter.lm_head.weight.T, dim=-1)
    top = logprobs.topk(5, dim=-1)
    topk = TTTBatch(b.aux, b.input_ids, b.loss_mask, b.document_ids, topk_ids=top.indices, topk_logprobs=top.values)
    for batch in (b, topk):
        teacher = block_teacher(batch, anchors, K, drafter.lm_head.weight)
        assert teacher is not None
        assert torch.equal(block_target_argmax(batch, anchors, K, drafter.lm_head.weight), teacher.argmax)
    bare = TTTBatch(b.aux, b.input_ids, b.loss_mask, b.document_ids)
    assert block_target_argmax(bare, anchors, K, drafter.lm_head.weight) is None
