"""Training-time test: alignment by hand, equality with a loop-by-loop reference, packing, loss, metrics."""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.acceptance import SOFT_CE, TokenLoss
from eagle3.drafter.alignment import (
    PAD_TOKEN,
    Supervision,
    align_step,
    align_steps,
    supervision_from_final,
    supervision_from_topk,
)
from eagle3.drafter.functional import FLEX_AVAILABLE
from eagle3.drafter.masks import positions_from_documents
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, init_weights, trainable_parameters
from eagle3.drafter.soft_ce import ChunkedSoftCE, pad_probs, soft_ce_chunk, soft_ce_chunk_grad, step_soft_ce
from eagle3.drafter.ttt import StepOptions, TTTBatch, metrics_from_counts, ttt_loss
from tests.unit.ttt_reference import combined_loss, reference_ttt

V, VD, HT, A, STEPS = 97, 40, 32, 3, 3
PATHS = {
    "plain": StepOptions(),
    "fused_loss": StepOptions(loss_chunk_tokens=5),
    "functional_step": StepOptions(reuse_block_mask=True),  # the functional step (dense attention on CPU)
    "functional_fused": StepOptions(loss_chunk_tokens=7, reuse_block_mask=True),
}
"""Every way the unroll can run on CPU; each must equal the reference."""


def tiny_dims() -> DrafterDims:
    return DrafterDims(
        hidden_size=HT,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=V,
        draft_vocab_size=VD,
        num_aux=A,
        target_hidden_size=HT,
    )


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> Eagle3Drafter:
    model = Eagle3Drafter(tiny_dims())
    init_weights(model, std=0.2, seed=seed)  # larger than 0.02 so that logits, and their errors, are not tiny
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(V, HT, generator=torch.Generator().manual_seed(seed + 1)))
    return model.to(dtype)


def vocab_maps(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    used = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return t2d, used - torch.arange(VD)


def random_inputs(rows: int, length: int, seed: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "aux": torch.randn(rows, length, A * HT, generator=g, dtype=dtype),
        "input_ids": torch.randint(0, V, (rows, length), generator=g),
        "loss_mask": (torch.rand(rows, length, generator=g) < 0.7).to(torch.uint8),
        "final": torch.randn(rows, length, HT, generator=g, dtype=dtype),
    }


def target_weight(seed: int = 7, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(V, HT, generator=torch.Generator().manual_seed(seed), dtype=dtype)  # [V, Ht]


def run_optimized(
    model,
    x: dict,
    docs: torch.Tensor | None = None,
    attn_impl: str = "dense",
    steps: int = STEPS,
    options: StepOptions | None = None,
    loss: TokenLoss = SOFT_CE,
):
    t2d, d2t = vocab_maps()
    batch = TTTBatch(aux=x["aux"], input_ids=x["input_ids"], loss_mask=x["loss_mask"], document_ids=docs)
    sup = supervision_from_final(x["final"], target_weight(dtype=x["final"].dtype), t2d, chunk_tokens=5)
    return ttt_loss(model, batch, sup, t2d, d2t, steps, attn_impl=attn_impl, options=options, loss=loss)


def run_reference(model, x: dict, row: int, start: int, stop: int, steps: int = STEPS):
    """The reference over tokens [start, stop) of one row, as an unpacked sequence of its own."""
    t2d, _ = vocab_maps()
    target_logits = x["final"][row, start:stop] @ target_weight().T  # [T, V]
    return reference_ttt(
        model,
        x["aux"][row, start:stop],
        x["input_ids"][row, start:stop].tolist(),
        x["loss_mask"][row, start:stop].tolist(),
        target_logits,
        t2d,
        steps,
    )


def assert_same_grads(model, loss_a: torch.Tensor, loss_b: torch.Tensor) -> None:
    params = trainable_parameters(model)
    for _p, ga, gb in zip(
        params, torch.autograd.grad(loss_a, params, retain_graph=True), torch.autograd.grad(loss_b, params)
    ):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-13)


def assert_counts_match(out, refs) -> None:
    for k in range(STEPS):
        torch.testing.assert_close(out.loss_sum[k], sum(r[k].loss_sum for r in refs), rtol=1e-10, atol=1e-12)
        got = [
            int(out.num_supervised[k]),
            int(out.num_predicted[k]),
            int(out.num_correct[k]),
            int(out.num_full_correct[k]),
        ]
        assert got == [
            sum(getattr(r[k], n) for r in refs)
            for n in ("num_supervised", "num_predicted", "num_correct", "num_full_correct")
        ]


def test_alignment_by_hand_on_a_six_token_sequence():
    """Step k at index t reads x[t+1+k], is scored against target position t+1+k, supervised iff loss_mask[t+2+k].

    x = 10 11 12 13 14 15, loss_mask = 0 0 1 1 1 0 (x2..x4 are the answer), target argmax at j = 20 + j,
    and 23 is outside the draft vocab. Feature: fc(aux[t]) at k = 0, the step-(k-1) output at t after.
        k=0  t=0: token x1=11, target j=1 (21), predicts x2 (mask 1) -> in the loss
             t=1: token x2=12, target j=2 (22), predicts x3 (mask 1) -> in the loss
             t=2: token x3=13, target j=3 (23), predicts x4 (mask 1) -> accuracy only (23 is not drafted)
             t=3: token x4=14, target j=4 (24), predicts x5 (mask 0) -> out
             t=4: token x5=15, target j=5 (25), predicts x6 (none) -> out;  t=5: no token (pad), no target -> out
        k=1  t=0: x2=12, j=2 (22), predicts x3 (1) -> loss;  t=1: x3=13, j=3 (23), predicts x4 (1) -> accuracy only
             t=2: x4=14, j=4, predicts x5 (0) -> out;  t=3: x5, j=5, predicts x6 (none) -> out;  t=4,5: pad
        k=2  t=0: x3=13, j=3 (23), predicts x4 (1) -> accuracy only;  t=1: x4, j=4, predicts x5 (0) -> out;  rest out
    """
    ids, mask = torch.tensor([[10, 11, 12, 13, 14, 15]]), torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.uint8)
    argmax, docs = 20 + torch.arange(6)[None], torch.zeros(1, 6, dtype=torch.long)
    t2d = torch.ones(30, dtype=torch.bool)
    t2d[23] = False
    p = PAD_TOKEN
    expected = {  # k: (input token, target argmax, predicts a marked token, in the loss)
        0: ([11, 12, 13, 14, 15, p], [21, 22, 23, 24, 25, -1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]),
        1: ([12, 13, 14, 15, p, p], [22, 23, 24, 25, -1, -1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]),
        2: ([13, 14, 15, p, p, p], [23, 24, 25, -1, -1, -1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
    }
    for k, (tokens, target, marked, in_loss) in expected.items():
        a = align_step(ids, mask, docs, argmax, t2d, k)
        assert a.input_ids[0].tolist() == tokens, k
        assert a.target_argmax[0].tolist() == target, k
        assert a.predicts_marked[0].int().tolist() == marked, k
        assert a.position_mask[0].int().tolist() == in_loss, k


def test_alignment_never_shifts_across_a_document_end():
    """Two packed documents of 3: tokens and predictions that would come from the other document are cut."""
    ids, mask = torch.tensor([[10, 11, 12, 13, 14, 15]]), torch.ones(1, 6, dtype=torch.uint8)
    docs, argmax, t2d = torch.tensor([[0, 0, 0, 1, 1, 1]]), 20 + torch.arange(6)[None], torch.ones(30, dtype=torch.bool)
    a0 = align_step(ids, mask, docs, argmax, t2d, 0)
    assert a0.input_ids[0].tolist() == [11, 12, PAD_TOKEN, 14, 15, PAD_TOKEN]
    assert a0.target_argmax[0].tolist() == [21, 22, -1, 24, 25, -1]
    assert a0.predicts_marked[0].int().tolist() == [1, 0, 0, 1, 0, 0]  # x3 is document 2's first token
    assert align_step(ids, mask, docs, argmax, t2d, 1).predicts_marked.sum() == 0
    assert positions_from_documents(docs)[0].tolist() == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("path", PATHS)
def test_unpacked_batch_matches_the_reference(path):
    """Two unpacked rows: loss, per-step sums and counts and every trainable gradient equal the reference."""
    model, x = tiny_model(), random_inputs(2, 12, seed=1)
    out = run_optimized(model, x, options=PATHS[path])
    refs = [run_reference(model, x, row, 0, 12) for row in range(2)]
    assert_counts_match(out, refs)
    ref_loss = combined_loss(refs)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=0)
    assert_same_grads(model, out.loss, ref_loss)


@pytest.mark.parametrize("path", PATHS)
def test_packed_row_equals_its_documents_run_separately(path):
    """A row packing documents of 7, 9 and 4 tokens gives the sums, loss and gradients of the three run alone."""
    model, x = tiny_model(), random_inputs(1, 20, seed=2)
    docs = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4])
    out = run_optimized(model, x, docs, options=PATHS[path])
    refs = [run_reference(model, x, 0, a, b) for a, b in ((0, 7), (7, 16), (16, 20))]
    assert_counts_match(out, refs)
    ref_loss = combined_loss(refs)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=0)
    assert_same_grads(model, out.loss, ref_loss)


@pytest.mark.parametrize("perturbed, kept", [((7, 16), (0, 7)), ((0, 7), (7, 16))])
def test_no_leak_between_packed_documents(perturbed, kept):
    """Changing one document's aux, tokens and target leaves the other's loss and gradients unchanged."""
    model, x = tiny_model(), random_inputs(1, 16, seed=3)
    docs = torch.tensor([[0] * 7 + [1] * 9])
    x["loss_mask"][0, perturbed[0] : perturbed[1]] = 0  # only the kept document is scored
    y = {name: value.clone() for name, value in x.items()}
    g = torch.Generator().manual_seed(9)
    span = slice(*perturbed)
    y["aux"][0, span] = 3 * torch.randn(y["aux"][0, span].shape, generator=g, dtype=y["aux"].dtype)
    y["final"][0, span] = torch.randn(y["final"][0, span].shape, generator=g, dtype=y["final"].dtype)
    y["input_ids"][0, span] = torch.randint(0, V, (perturbed[1] - perturbed[0],), generator=g)
    a, b = run_optimized(model, x, docs), run_optimized(model, y, docs)
    assert int(a.num_supervised.sum()) > 0
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-12, atol=0)
    assert_same_grads(model, a.loss, b.loss)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="flex_attention is not importable")
def test_flex_and_dense_give_the_same_packed_loss():
    """The flex_attention path (forward, eager on CPU) equals the dense path on a packed batch."""
    model, x = tiny_model(dtype=torch.float32), random_inputs(2, 16, seed=4, dtype=torch.float32)
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    with torch.no_grad():
        dense, flex = (run_optimized(model, x, docs, impl) for impl in ("dense", "flex"))
    torch.testing.assert_close(flex.loss_sum, dense.loss_sum, rtol=1e-5, atol=1e-6)


def test_golden_loss_values():
    """Seeded tiny drafter and inputs give these exact per-step losses and counts (guards unintended changes)."""
    model, x = tiny_model(seed=11), random_inputs(2, 16, seed=12)
    out = run_optimized(model, x, torch.tensor([[0] * 10 + [1] * 6, [0] * 16]))
    m = out.metrics()
    got = [m["loss_0"], m["loss_1"], m["loss_2"], m["loss"]]
    assert got == pytest.approx(GOLDEN_LOSSES, rel=1e-9)
    assert [m[f"num_supervised_{k}"] for k in range(STEPS)] == GOLDEN_COUNTS


GOLDEN_LOSSES = [4.11030597439977, 3.9090559864211456, 4.259834957135006, 9.96384513610309]
GOLDEN_COUNTS = [8.0, 5.0, 5.0]


def test_loss_is_a_masked_mean_unmoved_by_unsupervised_tokens():
    """Appending an unsupervised document or row leaves the loss unchanged (a B*T mean would shrink it)."""
    model, x = tiny_model(), random_inputs(1, 10, seed=5)
    base = run_optimized(model, x).loss
    pad = random_inputs(1, 6, seed=6)
    pad["loss_mask"].zero_()
    longer = {n: torch.cat([x[n], pad[n]], dim=1) for n in x}
    packed = run_optimized(model, longer, torch.tensor([[0] * 10 + [1] * 6])).loss
    extra_row = {n: torch.cat([longer[n], longer[n]], dim=0) for n in x}
    extra_row["loss_mask"][1] = 0
    rows = run_optimized(model, extra_row, torch.tensor([[0] * 10 + [1] * 6] * 2)).loss
    torch.testing.assert_close(packed, base, rtol=1e-12, atol=0)
    torch.testing.assert_close(rows, base, rtol=1e-12, atol=0)


def test_chunked_target_logits_do_not_change_the_supervision():
    """Target logits computed 1, 7 or all tokens at a time give the same distribution and argmax."""
    t2d, _ = vocab_maps()
    final = random_inputs(2, 9, seed=8)["final"]
    whole = supervision_from_final(final, target_weight(), t2d, chunk_tokens=1000)
    for chunk in (1, 7):
        part = supervision_from_final(final, target_weight(), t2d, chunk_tokens=chunk)
        torch.testing.assert_close(part.probs, whole.probs, rtol=1e-12, atol=0)
        assert torch.equal(part.argmax, whole.argmax)
    logits = final @ target_weight().T  # [B, T, V]
    assert torch.equal(whole.argmax, logits.argmax(-1))
    torch.testing.assert_close(whole.probs, torch.softmax(logits[..., t2d], -1), rtol=1e-12, atol=0)


def test_topk_supervision_by_hand():
    """Top-3 ids {5, 2, 8} with t2d = {2, 5, 7}: the draft distribution is p(5), p(2) renormalised, argmax 5."""
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[2, 5, 7]] = True  # draft ids: 2 -> 0, 5 -> 1, 7 -> 2
    ids, logprobs = torch.tensor([[[5, 2, 8]]]), torch.log(torch.tensor([[[0.5, 0.3, 0.1]]]))
    sup = supervision_from_topk(ids, logprobs, t2d)
    torch.testing.assert_close(sup.probs[0, 0], torch.tensor([0.3 / 0.8, 0.5 / 0.8, 0.0]))
    assert sup.argmax.tolist() == [[5]]


def test_topk_with_the_full_vocab_equals_final_hidden_supervision():
    """With K = V the top-K rebuild is exact: same draft distribution and argmax as the final-hidden path."""
    t2d, _ = vocab_maps()
    final = random_inputs(1, 6, seed=10)["final"]
    logprobs = torch.log_softmax(final @ target_weight().T, dim=-1)  # [1, 6, V]
    top = logprobs.topk(V, dim=-1)
    from_topk = supervision_from_topk(top.indices, top.values, t2d)
    from_final = supervision_from_final(final, target_weight(), t2d)
    torch.testing.assert_close(from_topk.probs, from_final.probs, rtol=1e-5, atol=1e-7, check_dtype=False)
    assert torch.equal(from_topk.argmax, from_final.argmax)


def test_metrics_from_counts_by_hand():
    """acc 1/2 then 1/2, full 1/2 then 1/4: accept_len_est = 1 + 0.5 + 0.25; loss = l0 + 0.8 * l1."""
    m = metrics_from_counts(
        loss_sum=torch.tensor([4.0, 3.0]),
        num_supervised=torch.tensor([2, 3]),
        num_predicted=torch.tensor([4, 4]),
        num_correct=torch.tensor([2, 2]),
        num_full_correct=torch.tensor([2, 1]),
    )
    assert m["acc_0"] == m["acc_1"] == 0.5 and m["full_acc_1"] == 0.25
    assert m["loss_0"] == 2.0 and m["loss_1"] == 1.0 and m["loss"] == pytest.approx(2.0 + 0.8 * 1.0)
    assert m["accept_len_est"] == pytest.approx(1.75)


def test_a_drafter_copying_the_target_is_always_right():
    """With fc/attention/MLP silenced and lm_head = target rows on the same features, acc_0 is 1 where drafted."""
    model, x = tiny_model(), random_inputs(1, 12, seed=13)
    t2d, d2t = vocab_maps()
    w = target_weight()
    with torch.no_grad():
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(w[t2d])
        model.norm.weight.fill_(1.0)
    # step 0's feature fc(aux) passes through unchanged; make it the target's (normed) final state one ahead
    final = x["final"] / x["final"].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    aux = torch.zeros_like(x["aux"])
    aux[0, :-1, :HT] = final[0, 1:]
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, :HT] = torch.eye(HT, dtype=model.fc.weight.dtype)
    batch = TTTBatch(aux=aux, input_ids=x["input_ids"], loss_mask=torch.ones_like(x["loss_mask"]))
    out = ttt_loss(model, batch, supervision_from_final(final, w, t2d), t2d, d2t, 1)
    assert int(out.num_correct[0]) == int(out.num_supervised[0]) > 0


def test_accuracy_full_accuracy_and_accept_length_through_the_unroll():
    """A drafter that always proposes draft id 0 (target id 3) against a hand-made target argmax gives hand counts.

    Target argmax at j = 0..7 is [9, 3, 3, 3, 9, 3, 3, 9]; step k at t is right iff argmax[t+1+k] == 3 and is
    counted iff t+2+k <= 7. k=0: t=0..5 -> 1 1 1 0 1 1 (5/6); k=1: t=0..4 -> 1 1 0 1 1 (4/5), all-so-far
    1 1 0 0 1 (3/5); k=2: t=0..3 -> 1 0 1 1 (3/4), all-so-far 1 0 0 0 (1/4).
    accept_len_est = 1 + 5/6 + 5/6*4/5 + 5/6*4/5*3/4 = 3.
    """
    model = tiny_model()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[3, 5, 9, 11]] = True
    d2t = torch.tensor([3, 5, 9, 11]) - torch.arange(4)
    model.lm_head = torch.nn.Linear(HT, 4, bias=False, dtype=torch.float64)
    torch.nn.init.zeros_(model.lm_head.weight)  # all logits tie at 0: the argmax is draft id 0
    x = random_inputs(1, 8, seed=14)
    argmax = torch.tensor([[9, 3, 3, 3, 9, 3, 3, 9]])
    sup = Supervision(torch.full((1, 8, 4), 0.25, dtype=torch.float64), argmax)
    batch = TTTBatch(aux=x["aux"], input_ids=x["input_ids"], loss_mask=torch.ones(1, 8, dtype=torch.uint8))
    m = ttt_loss(model, batch, sup, t2d, d2t, STEPS).metrics()
    assert [m[f"acc_{k}"] for k in range(3)] == pytest.approx([5 / 6, 4 / 5, 3 / 4])
    assert [m[f"full_acc_{k}"] for k in range(3)] == pytest.approx([5 / 6, 3 / 5, 1 / 4])
    assert m["accept_len_est"] == pytest.approx(3.0)


# ------------------------------------------------------------------------------------ the fast paths


def test_align_steps_equals_align_step_at_every_step():
    """The all-steps alignment equals align_step for each k, packed rows, running past the row end included."""
    g = torch.Generator().manual_seed(15)
    ids, argmax = torch.randint(0, V, (2, 9), generator=g), torch.randint(0, V, (2, 9), generator=g)
    mask = (torch.rand(2, 9, generator=g) < 0.6).to(torch.uint8)
    docs, (t2d, _) = torch.tensor([[0] * 4 + [1] * 5, [3] * 2 + [7] * 7]), vocab_maps()
    together = align_steps(ids, mask, docs, argmax, t2d, 6)  # 6 steps: shifts up to 7 of 9 tokens
    for k in range(6):
        alone = align_step(ids, mask, docs, argmax, t2d, k)
        for field in ("input_ids", "target_argmax", "predicts_marked", "position_mask"):
            assert torch.equal(getattr(together[k], field), getattr(alone, field)), (k, field)
    assert together[0].position_mask.any() and not together[5].predicts_marked.any()


@pytest.mark.parametrize("chunk", [1, 5, 7, 24, 1000])
def test_chunked_soft_ce_equals_log_softmax_loss_and_gradient(chunk):
    """Sum, argmax and the logits gradient of the chunked CE equal log_softmax's for chunks that do or don't divide."""
    g = torch.Generator().manual_seed(16)
    logits = torch.randn(2, 12, VD, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(2, 12, VD, generator=g, dtype=torch.float64), -1)
    mask = torch.rand(2, 12, generator=g) < 0.7
    mask[:, -2:] = False  # the last tokens read past their row (shift 2): never supervised
    plain = torch.where(mask, step_soft_ce(logits, probs, 2), 0).sum()
    fused, top = ChunkedSoftCE.apply(logits, pad_probs(probs, 3), mask, 2, chunk, (soft_ce_chunk, soft_ce_chunk_grad))
    torch.testing.assert_close(fused, plain, rtol=1e-13, atol=0)
    assert torch.equal(top, logits.argmax(-1))
    (want,) = torch.autograd.grad(3.5 * plain, logits)
    (got,) = torch.autograd.grad(3.5 * fused, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert got[~mask].abs().max() == 0 and got[mask].abs().max() > 0


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_fused_loss_path_equals_the_plain_path(chunk):
    """Through the whole packed unroll: same loss, sums, counts and every gradient as the log_softmax path."""
    model, x = tiny_model(), random_inputs(2, 16, seed=17)
    docs = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])
    plain = run_optimized(model, x, docs)
    fused = run_optimized(model, x, docs, options=StepOptions(loss_chunk_tokens=chunk))
    torch.testing.assert_close(fused.loss_sum, plain.loss_sum, rtol=1e-12, atol=0)
    for name in ("num_supervised", "num_predicted", "num_correct", "num_full_correct"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    assert_same_grads(model, fused.loss, plain.loss)


def test_compiled_step_traces_without_graph_breaks_and_matches_eager():
    """torch.compile (aot_eager on CPU: same tracing as inductor) of the step and loss: no graph break, same grads."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, x = tiny_model(), random_inputs(2, 12, seed=18)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    eager = run_optimized(model, x, docs, options=StepOptions(loss_chunk_tokens=5))
    compiled = run_optimized(model, x, docs, options=StepOptions("aot_eager", loss_chunk_tokens=5))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 4  # attention inputs, step outputs, CE forward, CE gradient
    torch.testing.assert_close(compiled.loss_sum, eager.loss_sum, rtol=1e-12, atol=0)
    assert torch.equal(compiled.num_correct, eager.num_correct)
    assert_same_grads(model, compiled.loss, eager.loss)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="flex_attention is not importable")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_one_block_mask_layout_equals_the_dense_path():
    """flex over one S*T key layout (later steps zero until computed, hidden by the mask) equals dense attention."""
    model, x = tiny_model(dtype=torch.float32), random_inputs(2, 128, seed=19, dtype=torch.float32)
    docs = torch.tensor([[0] * 50 + [1] * 78, [0] * 128])
    with torch.no_grad():  # flex has no CPU backward
        dense = run_optimized(model, x, docs, "dense")
        flex = run_optimized(model, x, docs, "flex", options=StepOptions(reuse_block_mask=True))
    torch.testing.assert_close(flex.loss_sum, dense.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(flex.num_correct, dense.num_correct)


def test_supervision_without_host_syncs_is_unchanged():
    """Passing the draft ids / draft vocab size (no t2d scan) gives the same supervision."""
    t2d, d2t = vocab_maps()
    final = random_inputs(1, 6, seed=20)["final"]
    draft_ids = d2t + torch.arange(VD)
    a, b = (
        supervision_from_final(final, target_weight(), t2d),
        supervision_from_final(final, target_weight(), t2d, draft_ids=draft_ids),
    )
    assert torch.equal(a.probs, b.probs) and torch.equal(a.argmax, b.argmax)
    top = torch.log_softmax(final @ target_weight().T, -1).topk(5, dim=-1)
    c, d = supervision_from_topk(top.indices, top.values, t2d), supervision_from_topk(top.indices, top.values, t2d, VD)
    assert torch.equal(c.probs, d.probs) and torch.equal(c.argmax, d.argmax)
