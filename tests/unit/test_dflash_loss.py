"""The DFlash training objective: where anchors may fall, the batched loss against a block-by-block reference,
the slot weights, what the gradient reaches, padding anchors."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.drafter.dflash import DFlashDrafter
from eagle3.drafter.dflash_blocks import block_input_ids, block_positions, block_visibility
from eagle3.drafter.dflash_loss import anchor_candidates, dflash_loss, sample_anchors, slot_weights
from eagle3.drafter.model import trainable_parameters
from tests.unit.test_dflash_model import features, random_dflash, tiny_dflash_dims

K = 4


def packed_row(length: int, doc_lengths: list[int], prompt_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(document_ids, loss_mask) [1, length]: documents back to back (the rest is padding, a document of its
    own, unsupervised); each document's first prompt_lengths[i] tokens are its prompt (unsupervised)."""
    docs = torch.full((1, length), len(doc_lengths), dtype=torch.long)
    mask = torch.zeros(1, length, dtype=torch.long)
    start = 0
    for i, (n, prompt) in enumerate(zip(doc_lengths, prompt_lengths, strict=True)):
        docs[0, start : start + n] = i
        mask[0, start + prompt : start + n] = 1
        start += n
    return docs, mask


def a_batch(seed: int = 0):
    """Two rows of 20 tokens: row 0 packs 3 documents (+ padding), row 1 is one document with a prompt."""
    d = tiny_dflash_dims(block_size=K)
    docs0, mask0 = packed_row(20, [7, 5, 6], [2, 1, 3])
    docs1, mask1 = packed_row(20, [20], [6])
    docs, mask = torch.cat([docs0, docs1]), torch.cat([mask0, mask1])
    ids = torch.randint(0, d.vocab_size - 1, (2, 20), generator=torch.Generator().manual_seed(seed))
    return d, features(d, 2, 20, seed=seed + 1), ids, mask, docs


def reference_loss(drafter: DFlashDrafter, feats, ids, mask, docs, anchors, valid, gamma, final=None):
    """Block by block through the DECODE path: one DFlashDrafter.forward per valid anchor p, its context the
    features of p's document before p at positions 0 .., the block at p's in-document position, every key
    visible (visible=None; an anchor at a document start gets one masked padding token, as the module cannot
    run an empty context); CE by hand (-log_softmax at the target) over the supervised slots, weighted mean.
    ``final`` [B, T, H]: the CE of slot k is against softmax(lm_head(final[p+k-1])) instead (the teacher)."""
    num, den = 0.0, 0.0
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            p = int(anchors[b, n])
            s = p
            while s > 0 and docs[b, s - 1] == docs[b, p]:
                s -= 1
            block = block_input_ids(ids[b : b + 1, p : p + 1], K, drafter.dims.mask_token_id)
            positions = block_positions(torch.tensor([[p - s]]), K)
            if p > s:  # the context cut at the anchor, every key visible
                hidden = drafter(feats[b : b + 1, s:p], torch.arange(p - s)[None], block, positions)
            else:  # nothing committed yet: one padding context token, hidden as a decode step hides padding
                visible = block_visibility(torch.tensor([[0]]), 1, K)
                hidden = drafter(
                    feats[b : b + 1, s : s + 1], torch.zeros(1, 1, dtype=torch.long), block, positions, visible
                )
            logp = torch.log_softmax(drafter.logits(hidden[0]), dim=-1)  # [K, V]
            for k in range(1, K):
                t = p + k
                if t < ids.shape[1] and docs[b, t] == docs[b, p] and mask[b, t]:
                    w = 1.0 if gamma is None else math.exp(-(k - 1) / gamma)
                    if final is None:
                        num = num - w * logp[k, ids[b, t]]
                    else:
                        teacher = torch.softmax(drafter.logits(final[b, t - 1]), dim=-1)  # [V]
                        num = num - w * (teacher * logp[k]).sum()
                    den += w
    return num / den


# ------------------------------------------------------------------------------------------------ anchors


def test_anchors_stay_in_one_document_and_the_row_and_have_a_supervised_target():
    """Property over random packings and masks: every valid anchor p has p .. p+K-1 inside the row and inside
    p's document, and some loss_mask[p+1 .. p+K-1] = 1; anchors are distinct and ascending, padding comes last;
    a row gets min(N, #candidates) anchors, and with N large every candidate (brute force) is drawn."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        length = int(torch.randint(1, 24, (1,), generator=gen))
        cuts = sorted(torch.randint(0, length + 1, (3,), generator=gen).tolist())
        docs = torch.bucketize(torch.arange(length), torch.tensor(cuts), right=True)[None]  # up to 4 runs
        mask = (torch.rand(1, length, generator=gen) < 0.3).long()
        brute = {
            p
            for p in range(length - K + 1)
            if all(docs[0, p + i] == docs[0, p] for i in range(K)) and mask[0, p + 1 : p + K].any()
        }
        num_blocks = 3 if trial % 2 else 30
        anchors, valid = sample_anchors(mask, K, num_blocks, torch.Generator().manual_seed(trial), docs)
        assert anchors.shape == valid.shape == (1, num_blocks)
        chosen = anchors[0][valid[0]].tolist()
        assert set(chosen) <= brute and chosen == sorted(set(chosen))
        assert len(chosen) == min(num_blocks, len(brute))
        assert valid[0].tolist() == [True] * len(chosen) + [False] * (num_blocks - len(chosen))
        assert not anchors[0][~valid[0]].any()  # padding anchors sit at 0
        if num_blocks >= len(brute):
            assert set(chosen) == brute
        assert set(anchor_candidates(mask, K, docs)[0].nonzero().flatten().tolist()) == brute


def test_anchor_golden():
    """By hand, K=4, one row of 10, documents [0..4] and [5..9], mask on 3, 4 and 8: the first document's
    anchors 0 and 1 (targets 3, 4 inside it; 2 would cross the boundary at 5); the second's 5 and 6 (target 8;
    7 would run past the row)."""
    docs = torch.tensor([[0] * 5 + [1] * 5])
    mask = torch.zeros(1, 10, dtype=torch.long)
    mask[0, [3, 4, 8]] = 1
    assert anchor_candidates(mask, K, docs)[0].nonzero().flatten().tolist() == [0, 1, 5, 6]
    anchors, valid = sample_anchors(mask, K, 5, torch.Generator().manual_seed(0), docs)
    assert anchors.tolist() == [[0, 1, 5, 6, 0]] and valid.tolist() == [[True] * 4 + [False]]


def test_anchor_sampling_is_deterministic_given_the_seed():
    """The same generator seed gives the same anchors; other seeds give other subsets (of the same candidates)."""
    mask = torch.ones(2, 64, dtype=torch.long)

    def draw(seed):
        return sample_anchors(mask, K, 8, torch.Generator().manual_seed(seed))

    a, b = draw(7), draw(7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert any(not torch.equal(draw(seed)[0], a[0]) for seed in range(8, 12))


# --------------------------------------------------------------------------------------------------- loss


@pytest.mark.parametrize("gamma", [None, 2.0])
def test_batched_loss_equals_block_by_block_decode_calls(gamma):
    """Golden parity (float32, 1e-5): all blocks of a packed batch in one forward give the loss of a loop that
    runs each block alone through the decode path and computes the cross-entropy by hand."""
    d, feats, ids, mask, docs = a_batch()
    drafter = random_dflash(d)
    anchors, valid = sample_anchors(mask, K, 6, torch.Generator().manual_seed(1), docs)
    assert valid.sum() >= 8  # both rows, several documents
    with torch.no_grad():
        out = dflash_loss(drafter, feats, ids, mask, anchors, valid, docs, gamma=gamma)
        ref = reference_loss(drafter, feats, ids, mask, docs, anchors, valid, gamma)
    torch.testing.assert_close(out.loss, ref, rtol=0, atol=1e-5)
    assert out.num_supervised.shape == out.num_correct.shape == (K - 1,)
    assert torch.all(out.num_correct <= out.num_supervised) and out.slot_accuracy().shape == (K - 1,)


def test_slot_weights_change_the_loss_as_the_formula_says():
    """loss = sum_k w_k S_k / sum_k w_k n_k with w_k = exp(-(k-1)/gamma), S_k and n_k the per-slot CE sums and
    counts (which do not depend on gamma); gamma None is the plain mean sum S_k / sum n_k."""
    d, feats, ids, mask, docs = a_batch()
    drafter = random_dflash(d)
    anchors, valid = sample_anchors(mask, K, 6, torch.Generator().manual_seed(1), docs)
    assert slot_weights(K, 2.0).tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])
    with torch.no_grad():
        plain = dflash_loss(drafter, feats, ids, mask, anchors, valid, docs)
        decayed = dflash_loss(drafter, feats, ids, mask, anchors, valid, docs, gamma=2.0)
    assert torch.equal(plain.loss_sum, decayed.loss_sum) and torch.equal(plain.num_supervised, decayed.num_supervised)
    s, n = plain.loss_sum.double(), plain.num_supervised.double()
    w = torch.tensor([math.exp(-(k - 1) / 2.0) for k in range(1, K)], dtype=torch.float64)
    torch.testing.assert_close(plain.loss.double(), s.sum() / n.sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(decayed.loss.double(), (w * s).sum() / (w * n).sum(), rtol=1e-6, atol=0)
    assert not torch.isclose(plain.loss, decayed.loss)
    with pytest.raises(ValueError, match="gamma"):
        slot_weights(K, 0.0)


def test_gradients_reach_the_drafter_and_not_the_targets_tables():
    """Backward gives every trainable parameter a finite, nonzero gradient; the frozen embeddings and lm_head
    get none."""
    d, feats, ids, mask, docs = a_batch()
    drafter = random_dflash(d).train()
    anchors, valid = sample_anchors(mask, K, 6, torch.Generator().manual_seed(1), docs)
    dflash_loss(drafter, feats, ids, mask, anchors, valid, docs, gamma=3.0).loss.backward()
    trainable = trainable_parameters(drafter)
    assert len(trainable) == 3 + 11 * d.num_hidden_layers
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None


def test_an_invalid_anchor_contributes_nothing():
    """An anchor marked invalid adds nothing, wherever it points: the per-slot sums and counts of the batch with
    it invalid plus those of that block alone (the only valid one) are those of the full batch, and moving the
    invalid anchor changes nothing; with every anchor invalid the loss is 0 (not NaN) and still differentiable."""
    d, feats, ids, mask, docs = a_batch()
    drafter = random_dflash(d)
    anchors, valid = sample_anchors(mask, K, 6, torch.Generator().manual_seed(1), docs)
    assert valid[1, 2]
    dropped, alone = valid.clone(), torch.zeros_like(valid)
    dropped[1, 2], alone[1, 2] = False, True
    moved = anchors.clone()
    moved[1, 2] = 17  # the invalid anchor elsewhere, its block running past the row end
    with torch.no_grad():
        full = dflash_loss(drafter, feats, ids, mask, anchors, valid, docs)
        rest = dflash_loss(drafter, feats, ids, mask, anchors, dropped, docs)
        rest_moved = dflash_loss(drafter, feats, ids, mask, moved, dropped, docs)
        one = dflash_loss(drafter, feats, ids, mask, anchors, alone, docs)
    assert one.num_supervised.sum() > 0
    assert torch.equal(rest.num_supervised + one.num_supervised, full.num_supervised)
    assert torch.equal(rest.num_correct + one.num_correct, full.num_correct)
    torch.testing.assert_close(rest.loss_sum + one.loss_sum, full.loss_sum, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(rest_moved.loss, rest.loss, rtol=0, atol=1e-6)
    assert torch.equal(rest_moved.num_supervised, rest.num_supervised)
    none = dflash_loss(drafter, feats, ids, mask, anchors, torch.zeros_like(valid), docs)
    assert none.loss.item() == 0.0 and none.loss.requires_grad and not none.num_supervised.any()


def test_targets_are_the_same_positions_not_shifted():
    """Slot k is scored against the token AT p+k: a drafter whose lm_head reads the block embedding would be
    right only for that alignment. Here: with the layers zeroed, slot outputs are norm(mask embedding); making
    lm_head favour token t at the mask embedding makes the loss tiny exactly when every target is t."""
    d = tiny_dflash_dims(block_size=K)
    drafter = random_dflash(d)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = drafter.embed_tokens.weight[d.mask_token_id]
        h = e / (e.pow(2).mean() + d.rms_norm_eps).sqrt() * drafter.norm.weight
        drafter.lm_head.weight.zero_()
        drafter.lm_head.weight[5] = 50 * h / h.norm()
    ids = torch.tensor([[1, 2, 5, 5, 5, 9]])  # anchor 1: targets at 2, 3, 4 are all 5; at 3, 4, 5 they are not
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    feats = features(d, 1, 6)
    valid = torch.tensor([[True]])
    with torch.no_grad():
        right = dflash_loss(drafter, feats, ids, mask, torch.tensor([[1]]), valid)
        shifted = dflash_loss(drafter, feats, ids, mask, torch.tensor([[2]]), valid)
    assert right.loss < 1e-3 and right.slot_accuracy().tolist() == [1.0] * (K - 1)
    assert shifted.loss > 1.0 and shifted.slot_accuracy().tolist() == [1.0, 1.0, 0.0]
