"""The online target's packed forward (train.online_forward): a row in one forward, documents kept apart."""

from __future__ import annotations

import logging

import pytest
import torch

from eagle3.config import TinyTargetConfig
from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.spec import FeatureSpec
from eagle3.target.tiny import build_tiny_model, build_tiny_tokenizer
from eagle3.train.data import TTTBatch
from eagle3.train.online import OnlineFeatures

AUX = [1, 2, 3]
T = 256
LENGTHS = [40, 70, 13, 90]  # real documents; the rest of the row is padding, a document of its own


def _model(architecture: str = "llama", attn: str | None = None):
    cfg = TinyTargetConfig(architecture=architecture, num_hidden_layers=4)
    model = build_tiny_model(build_tiny_tokenizer(), cfg, seed=0).eval()
    if attn is not None:
        model.set_attn_implementation(attn)
    return model


def _spec(model) -> FeatureSpec:
    c = model.config
    return FeatureSpec(
        target_name="tiny",
        target_fingerprint="fp",
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        vocab_size=c.vocab_size,
        aux_layer_ids=AUX,
        supervision="final_hidden",
        max_len=T,
        chat_template_hash="h",
        backend="hf",
        dtype="float32",
        aux_dtype="float32",
    )


def _row(lengths=LENGTHS, seed: int = 0) -> TTTBatch:
    """A collated row as the trainer builds it: [1, T] ids, documents, positions restarting per document."""
    gen = torch.Generator().manual_seed(seed)
    num_pad = T - sum(lengths)
    ids = torch.cat([torch.randint(3, 300, (sum(lengths),), generator=gen), torch.zeros(num_pad, dtype=torch.long)])
    docs = torch.cat([torch.full((n,), k) for k, n in enumerate([*lengths, num_pad])])
    pos = torch.cat([torch.arange(n) for n in [*lengths, num_pad]])
    return TTTBatch(
        aux=None,
        input_ids=ids[None],
        loss_mask=torch.ones(1, T, dtype=torch.uint8),
        document_ids=docs[None],
        position_ids=pos[None],
        final_hidden=None,
    )


def _features(model, forward: str, device: str = "cpu") -> OnlineFeatures:
    backend = HFCaptureBackend(None, AUX, model=model, device=device, tokens_per_forward=4096)
    return OnlineFeatures(backend, _spec(model), forward)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "deepseek_v3"])
def test_a_packed_row_equals_its_documents_run_as_padded_batches(architecture):
    """One packed forward fills a row bitwise as the padded per-document batches do (CPU: SDPA per document)."""
    model = _model(architecture)
    packed, padded = _features(model, "packed"), _features(model, "padded")
    assert packed.packed and not padded.packed
    assert packed.describe().startswith("packed: one forward per row") and padded.describe().startswith("padded")
    row = _row()
    got = packed.fill(row, LENGTHS, torch.float32)
    want = padded.fill(row, LENGTHS, torch.float32)
    assert got.aux.shape == (1, T, len(AUX) * model.config.hidden_size)
    if architecture == "deepseek_v3":  # MoE: an expert's GEMM runs over whichever tokens are routed to it
        torch.testing.assert_close(got.aux, want.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.final_hidden, want.final_hidden, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got.aux, want.aux) and torch.equal(got.final_hidden, want.final_hidden)
    assert not got.aux[0, sum(LENGTHS) :].any()  # the padding's states are zero, as in a collated shard row


@pytest.mark.parametrize("architecture", ["llama", "deepseek_v3"])
def test_the_flex_document_mask_gives_the_per_document_states(architecture):
    """The CUDA path's flex_attention over the document BlockMask (uncompiled here) matches SDPA per document
    (DeepSeek-V3: MLA's query/key heads wider than its value heads, and a score scale other than 1/sqrt(d))."""
    model = _model(architecture)
    backend = HFCaptureBackend(None, AUX, model=model, device="cpu", tokens_per_forward=4096)
    row = _row(seed=1)
    args = (row.input_ids, row.document_ids, row.position_ids, LENGTHS)
    with torch.no_grad():
        flex = backend.packed_states(*args, flex=True)
        sliced = backend.packed_states(*args, flex=False)
    assert flex["aux"].shape == sliced["aux"].shape == (sum(LENGTHS), len(AUX) * model.config.hidden_size)
    torch.testing.assert_close(flex["aux"], sliced["aux"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex["final"], sliced["final"], rtol=1e-5, atol=1e-5)
    # a document mask that leaked across documents would change every document after the first
    assert (flex["final"][LENGTHS[0] :] - sliced["final"][LENGTHS[0] :]).abs().max() < 1e-4


def test_packed_needs_sliced_attention_and_auto_falls_back_to_padded():
    """An eager-attention target: online_forward=packed is refused by name, auto runs padded batches."""
    model = _model(attn="eager")
    with pytest.raises(ValueError, match="online_forward=packed.*'eager'"):
        _features(model, "packed")
    assert not _features(model, "auto").packed


def test_packed_rows_keep_to_the_forward_budget_and_a_sharded_target_packs_only_when_asked():
    """A row longer than capture.tokens_per_forward is refused packed (auto: padded); a sharded target's auto
    is padded (no per-rank fallback), an explicit packed is honoured."""
    from eagle3.train.online import packed_for

    backend = HFCaptureBackend(None, AUX, model=_model(), device="cpu", tokens_per_forward=512)
    assert packed_for("auto", backend, 512) and packed_for("packed", backend, 512)
    assert not packed_for("auto", backend, 1024) and not packed_for("padded", backend, 512)
    with pytest.raises(ValueError, match="a row of 1024 tokens .* more than one forward may take \\(512"):
        packed_for("packed", backend, 1024)
    assert not packed_for("auto", backend, 512, sharded=True) and packed_for("packed", backend, 512, sharded=True)


def test_a_packed_context_refuses_a_forward_that_is_not_its_row():
    """Under a packed context a batch of two rows (or a cached step) raises instead of attending across documents."""
    from eagle3.features.attention import PackedDocs, attention_context, enable

    model = _model()
    assert enable(model)
    ids = torch.randint(3, 300, (2, 16))
    with attention_context(PackedDocs((8, 8))), torch.no_grad(), pytest.raises(ValueError, match="a packed row"):
        model.model(input_ids=ids, use_cache=False)


def test_a_failing_packed_forward_falls_back_under_auto_only(caplog, monkeypatch):
    """auto: a packed forward that raises is named in a warning and the row is filled by padded batches;
    an explicit packed setting raises instead."""
    model = _model()
    want = _features(model, "padded").fill(_row(), LENGTHS, torch.float32)

    def boom(*args, **kwargs):
        raise RuntimeError("flex compile failed: no kernel")

    auto = _features(model, "auto")
    monkeypatch.setattr(auto.backend, "packed_states", boom)
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        got = auto.fill(_row(), LENGTHS, torch.float32)
    assert "RuntimeError: flex compile failed: no kernel" in caplog.text and not auto.packed
    assert torch.equal(got.final_hidden, want.final_hidden)
    explicit = _features(model, "packed")
    monkeypatch.setattr(explicit.backend, "packed_states", boom)
    with pytest.raises(RuntimeError, match="no kernel"):
        explicit.fill(_row(), LENGTHS, torch.float32)


def test_rows_of_one_length_build_their_mask_with_one_compiled_graph():
    """The compiled block-mask build (the CUDA path's) equals the eager one and compiles once for rows of one
    length, whatever their documents and real-token counts (nothing row-specific is baked into the graph)."""
    from torch._dynamo.utils import counters

    from eagle3.features.attention import document_block_mask

    torch._dynamo.reset()
    counters.clear()
    for lengths in ([40, 70, 13, 90], [200], [5] * 40):
        docs = _row(lengths).document_ids[0]
        compiled = document_block_mask(docs, sum(lengths), compile=True)
        eager = document_block_mask(docs, sum(lengths), compile=False)
        assert torch.equal(compiled.to_dense(), eager.to_dense())
    assert counters["stats"]["unique_graphs"] == 1
