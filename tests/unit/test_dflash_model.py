"""The DFlash drafter module: shapes, what a block can see, train/decode layouts agree, determinism, goldens.

The helpers at the top (tiny dims, a seeded drafter with non-trivial norms and the target's tables) are shared
with tests/unit/test_export_dflash.py and tests/unit/test_export_dflash_load.py (which compares this module's
forward with SGLang's own DFlashDraftModel).
"""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.drafter.dflash import DFlashDims, DFlashDrafter, export_state_dict, init_dflash_weights
from eagle3.drafter.dflash_blocks import block_input_ids, block_positions, block_visibility
from eagle3.drafter.functional import Llama3RopeScaling
from eagle3.drafter.model import trainable_parameters

# ------------------------------------------------------------------------------------------------- helpers


def tiny_dflash_dims(
    layers: int = 2, block_size: int = 4, rope_scaling: Llama3RopeScaling | None = None, vocab: int = 64
) -> DFlashDims:
    """H=32, 4 query / 2 key-value heads of 8, I=48, 3 context features, mask token = the last id."""
    return DFlashDims(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        num_hidden_layers=layers,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        vocab_size=vocab,
        num_context_features=3,
        block_size=block_size,
        mask_token_id=vocab - 1,
        max_position_embeddings=256,
    )


def random_dflash(dims: DFlashDims, seed: int = 0, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Seeded weights large enough to matter, norms away from 1 (so a swapped norm shows), random target tables."""
    drafter = DFlashDrafter(dims)
    init_dflash_weights(drafter, std=0.2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        drafter.embed_tokens.weight.copy_(torch.randn(drafter.embed_tokens.weight.shape, generator=gen))
        drafter.lm_head.weight.copy_(torch.randn(drafter.lm_head.weight.shape, generator=gen))
    return drafter.to(dtype).eval()


def features(dims: DFlashDims, batch: int, length: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, dims.num_context_features * dims.hidden_size, generator=gen).to(dtype)


def decode_call(drafter: DFlashDrafter, feats: torch.Tensor, context_end: torch.Tensor, anchors: torch.Tensor):
    """One block per row at the anchor position context_end (SGLang's decode step): hidden [B, K, H]."""
    d = drafter.dims
    batch, length, _ = feats.shape
    ids = block_input_ids(anchors[:, None], d.block_size, d.mask_token_id)
    positions = block_positions(context_end[:, None], d.block_size)
    visible = block_visibility(context_end[:, None], length, d.block_size)
    with torch.no_grad():
        return drafter(feats, torch.arange(length).expand(batch, -1), ids, positions, visible)


def naive_block(drafter: DFlashDrafter, feats: torch.Tensor, anchor: int, anchor_pos: int) -> torch.Tensor:
    """An independent float64 reading of SGLang's DFlashDraftModel for ONE row and ONE block, token by token and
    head by head: context = feats[:anchor_pos] at positions 0.., block = [anchor, mask...] at anchor_pos.."""
    d = drafter.dims
    eps, hd, groups = d.rms_norm_eps, d.head_dim, d.num_attention_heads // d.num_key_value_heads
    sd = {k: v.double() for k, v in drafter.state_dict().items()}

    def norm(x, w):
        return x / torch.sqrt((x * x).mean() + eps) * w

    def rope(x, pos):  # neox half-split, theta^(-2i/hd)
        half = hd // 2
        out = torch.empty_like(x)
        for i in range(half):
            angle = pos * d.rope_theta ** (-2 * i / hd)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = x[i] * c - x[i + half] * s
            out[i + half] = x[i + half] * c + x[i] * s
        return out

    ctx = [norm(sd["fc.weight"] @ f, sd["hidden_norm.weight"]) for f in feats[:anchor_pos].double()]
    ids = [anchor] + [d.mask_token_id] * (d.block_size - 1)
    xs = [sd["embed_tokens.weight"][t] for t in ids]
    for li in range(d.num_hidden_layers):
        p = f"layers.{li}."
        hs = [norm(x, sd[p + "input_layernorm.weight"]) for x in xs]

        def kv(h, pos, p=p):
            k = (sd[p + "self_attn.k_proj.weight"] @ h).view(d.num_key_value_heads, hd)
            k = torch.stack([rope(norm(k[j], sd[p + "self_attn.k_norm.weight"]), pos) for j in range(len(k))])
            return k, (sd[p + "self_attn.v_proj.weight"] @ h).view(d.num_key_value_heads, hd)

        keys = [kv(c, j) for j, c in enumerate(ctx)] + [kv(h, anchor_pos + i) for i, h in enumerate(hs)]
        new = []
        for i, (x, h) in enumerate(zip(xs, hs, strict=True)):
            q = (sd[p + "self_attn.q_proj.weight"] @ h).view(d.num_attention_heads, hd)
            heads = []
            for head in range(d.num_attention_heads):
                qh = rope(norm(q[head], sd[p + "self_attn.q_norm.weight"]), anchor_pos + i)
                scores = torch.stack([qh @ k[head // groups] for k, _ in keys]) / math.sqrt(hd)
                probs = torch.softmax(scores, dim=0)
                heads.append(sum(pr * v[head // groups] for pr, (_, v) in zip(probs, keys, strict=True)))
            x = x + sd[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
            m = norm(x, sd[p + "post_attention_layernorm.weight"])
            gate, up = sd[p + "mlp.gate_proj.weight"] @ m, sd[p + "mlp.up_proj.weight"] @ m
            new.append(x + sd[p + "mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up))
        xs = new
    return torch.stack([norm(x, sd["norm.weight"]) for x in xs])


# --------------------------------------------------------------------------------------------- the layout


def test_block_layout_golden():
    """Anchors then mask tokens, positions from each anchor, and who sees what (2 blocks of 3, 4 context keys)."""
    assert block_input_ids(torch.tensor([[7, 9]]), 3, 0).tolist() == [[7, 0, 0, 9, 0, 0]]
    assert block_positions(torch.tensor([[2, 5]]), 3).tolist() == [[2, 3, 4, 5, 6, 7]]
    visible = block_visibility(
        torch.tensor([[2, 4]]), num_context=4, block_size=3, context_start=torch.tensor([[0, 1]])
    )
    assert visible.shape == (1, 1, 6, 10)
    rows = ["".join("x" if v else "." for v in row) for row in visible[0, 0].tolist()]
    assert rows == [
        "xx..xxx...",
        "xx..xxx...",
        "xx..xxx...",  # block 0: context [0, 2), itself
        ".xxx...xxx",
        ".xxx...xxx",
        ".xxx...xxx",
    ]  # block 1: context [1, 4), itself


def test_shapes_and_what_is_frozen():
    d = tiny_dflash_dims()
    drafter = random_dflash(d)
    feats = features(d, batch=2, length=6)
    hidden = decode_call(drafter, feats, torch.tensor([6, 3]), torch.tensor([1, 2]))
    assert hidden.shape == (2, d.block_size, d.hidden_size)
    assert drafter.logits(hidden).shape == (2, d.block_size, d.vocab_size)
    assert drafter.draft_block(feats, torch.tensor([6, 3]), torch.tensor([1, 2])).shape == (2, d.block_size - 1)
    trainable = {id(p) for p in trainable_parameters(drafter)}
    assert id(drafter.embed_tokens.weight) not in trainable and id(drafter.lm_head.weight) not in trainable
    assert len(trainable) == len(export_state_dict(drafter)) == 3 + 11 * d.num_hidden_layers


def test_dims_refuse_what_sglang_cannot_serve():
    with pytest.raises(ValueError, match="mask_token_id 64 is outside"):
        DFlashDims(32, 4, 2, 8, 48, 1, 1e-6, 1e4, None, 64, 3, 4, 64)
    with pytest.raises(ValueError, match="drafts nothing"):
        DFlashDims(32, 4, 2, 8, 48, 1, 1e-6, 1e4, None, 64, 3, 1, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        DFlashDims(32, 4, 3, 8, 48, 1, 1e-6, 1e4, None, 64, 3, 4, 0)


# ---------------------------------------------------------------------------------- what a block depends on


def test_context_past_the_anchor_and_padding_are_invisible():
    """Row 1 commits 3 tokens: changing its features at positions >= 3 changes nothing; at position 2 it does."""
    d = tiny_dflash_dims()
    drafter = random_dflash(d)
    feats, ends, anchors = features(d, 2, 6), torch.tensor([6, 3]), torch.tensor([5, 8])
    base = decode_call(drafter, feats, ends, anchors)
    hidden_tail = feats.clone()
    hidden_tail[1, 3:] = 1e3 * torch.randn(3, feats.shape[-1])
    assert torch.equal(decode_call(drafter, hidden_tail, ends, anchors), base)
    visible_change = feats.clone()
    visible_change[1, 2] += 1.0
    changed = decode_call(drafter, visible_change, ends, anchors)
    assert torch.equal(changed[0], base[0]) and not torch.allclose(changed[1], base[1])


def test_attention_inside_the_block_is_not_causal():
    """SGLang's DFlash layers are ENCODER_ONLY: the LAST block token changes the output of slot 1."""
    d = tiny_dflash_dims()
    drafter = random_dflash(d)
    feats = features(d, 1, 5)
    ids = block_input_ids(torch.tensor([[3]]), d.block_size, d.mask_token_id)
    positions, visible = block_positions(torch.tensor([[5]]), d.block_size), None
    ctx_pos = torch.arange(5)[None]
    with torch.no_grad():
        base = drafter(feats, ctx_pos, ids, positions, visible)
        other = ids.clone()
        other[0, -1] = 11
        changed = drafter(feats, ctx_pos, other, positions, visible)
    assert not torch.allclose(changed[0, 1], base[0, 1])


def test_training_layout_equals_one_decode_call_per_block():
    """Three blocks in one row, each seeing the context before its own anchor, give what three separate decode
    calls give (context truncated at the anchor); the other blocks' tokens never matter."""
    d = tiny_dflash_dims()
    drafter = random_dflash(d, dtype=torch.float64)
    length = 12
    feats = features(d, 1, length, dtype=torch.float64)
    tokens = torch.randint(0, d.vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(3))
    anchor_pos = torch.tensor([[2, 5, 9]])
    anchors = tokens.gather(1, anchor_pos)
    ids = block_input_ids(anchors, d.block_size, d.mask_token_id)
    positions = block_positions(anchor_pos, d.block_size)
    visible = block_visibility(anchor_pos, length, d.block_size)
    with torch.no_grad():
        together = drafter(feats, torch.arange(length)[None], ids, positions, visible).view(3, d.block_size, -1)
        other = ids.clone()
        other[0, d.block_size :] = 0  # blocks 1 and 2 replaced: block 0 must not notice
        alone0 = drafter(feats, torch.arange(length)[None], other, positions, visible)[0, : d.block_size]
    assert torch.equal(alone0, together[0])
    for n in range(3):
        a = int(anchor_pos[0, n])
        single = decode_call(drafter, feats[:, :a], torch.tensor([a]), anchors[:, n])[0]
        torch.testing.assert_close(single, together[n], rtol=0, atol=1e-12)


def test_rows_of_a_batch_are_independent():
    """A row padded into a batch gives what it gives alone."""
    d = tiny_dflash_dims()
    drafter = random_dflash(d)
    feats = features(d, 2, 6)
    both = decode_call(drafter, feats, torch.tensor([6, 3]), torch.tensor([5, 8]))
    alone = decode_call(drafter, feats[1:, :3], torch.tensor([3]), torch.tensor([8]))
    torch.testing.assert_close(both[1:], alone, rtol=1e-5, atol=1e-6)


def test_only_relative_positions_matter():
    """RoPE on queries and keys alike: shifting every position by 17 leaves the block's outputs unchanged."""
    d = tiny_dflash_dims()
    drafter = random_dflash(d, dtype=torch.float64)
    feats = features(d, 1, 5, dtype=torch.float64)
    ids = block_input_ids(torch.tensor([[3]]), d.block_size, d.mask_token_id)
    with torch.no_grad():
        base = drafter(feats, torch.arange(5)[None], ids, block_positions(torch.tensor([[5]]), d.block_size))
        shifted = drafter(feats, torch.arange(5)[None] + 17, ids, block_positions(torch.tensor([[22]]), d.block_size))
    torch.testing.assert_close(shifted, base, rtol=0, atol=1e-10)


def test_determinism():
    d = tiny_dflash_dims()
    drafter = random_dflash(d)
    feats = features(d, 2, 6)
    runs = [decode_call(drafter, feats, torch.tensor([6, 3]), torch.tensor([5, 8])) for _ in range(2)]
    assert torch.equal(*runs)
    assert torch.equal(
        export_state_dict(random_dflash(d, seed=4))["fc.weight"],
        export_state_dict(random_dflash(d, seed=4))["fc.weight"],
    )


# -------------------------------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("layers", [1, 2])
def test_golden_equals_a_naive_token_by_token_reading(layers):
    """float64: the module equals an independent per-token, per-head implementation of SGLang's computation."""
    d = tiny_dflash_dims(layers=layers)
    drafter = random_dflash(d, seed=layers, dtype=torch.float64)
    feats = features(d, 1, 6, dtype=torch.float64)
    ours = decode_call(drafter, feats, torch.tensor([4]), torch.tensor([9]))[0]  # context = positions 0..3
    torch.testing.assert_close(ours, naive_block(drafter, feats[0], anchor=9, anchor_pos=4), rtol=0, atol=1e-10)


def test_golden_hand_case_zero_sublayers_leave_the_embedding():
    """With o_proj and down_proj zero, every layer adds nothing: the output is norm(embedding), by hand."""
    d = tiny_dflash_dims(layers=2)
    drafter = random_dflash(d, dtype=torch.float64)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    ids = block_input_ids(torch.tensor([[3]]), d.block_size, d.mask_token_id)[0]
    hidden = decode_call(drafter, features(d, 1, 5, dtype=torch.float64), torch.tensor([5]), torch.tensor([3]))[0]
    e = drafter.embed_tokens.weight[ids]
    by_hand = e / (e.pow(2).mean(-1, keepdim=True) + d.rms_norm_eps).sqrt() * drafter.norm.weight
    torch.testing.assert_close(hidden, by_hand, rtol=0, atol=1e-12)
