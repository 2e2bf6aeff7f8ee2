"""Small feature specs and captured samples for the shard tests (random, or fixed patterns for golden bytes)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens

H, VOCAB, K = 8, 50, 4


def make_spec(aux_dtype: str = "bfloat16", supervision: str = "final_hidden", dtype: str = "bfloat16") -> FeatureSpec:
    """A small spec: H=8, three aux layers, vocab 50."""
    return FeatureSpec(
        target_name="t",
        target_fingerprint="fp",
        hidden_size=H,
        num_layers=6,
        vocab_size=VOCAB,
        aux_layer_ids=[1, 2, 3],
        supervision=supervision,
        topk=K if supervision == "topk_logprobs" else None,
        dtype=dtype,
        aux_dtype=aux_dtype,
        max_len=64,
        chat_template_hash="tmpl",
        backend="hf",
    )


def make_samples(spec: FeatureSpec, lengths: list[int], seed: int = 0, prefix: str = "s") -> list[CapturedSample]:
    """Random fp32 samples of the given lengths (ids and shapes consistent with ``spec``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        sample = CapturedSample(
            id=f"{prefix}{i}",
            input_ids=torch.randint(0, VOCAB, (n,), generator=gen),
            loss_mask=torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8),
            aux=torch.randn(n, 3 * H, generator=gen) * 3,
        )
        if spec.supervision == "final_hidden":
            sample.final = torch.randn(n, H, generator=gen)
        else:
            logits = torch.randn(n, VOCAB, generator=gen)
            sample.topk_logprobs, sample.topk_ids = torch.log_softmax(logits, -1).topk(K, -1)
        out.append(sample)
    return out


def make_features_dir(tmp_path: Path, spec: FeatureSpec) -> Path:
    """<tmp_path>/features holding spec.json."""
    fdir = tmp_path / "features"
    fdir.mkdir(parents=True, exist_ok=True)
    spec.save(fdir / "spec.json")
    return fdir


def patterned_samples(spec: FeatureSpec, lengths: list[int], prefix: str = "s") -> list[CapturedSample]:
    """Samples whose values follow fixed integer patterns (no random generator), for golden bytes."""
    out, base = [], 0
    for i, n in enumerate(lengths):
        rows = torch.arange(base, base + n)
        sample = CapturedSample(
            id=f"{prefix}{i}",
            input_ids=rows % VOCAB,
            loss_mask=(rows % 3 == 0).to(torch.uint8),
            aux=((torch.arange(n * 3 * H) + base * 3 * H) % 97 - 48).reshape(n, 3 * H) / 8,
        )
        if spec.supervision == "final_hidden":
            sample.final = ((torch.arange(n * H) + base * H) % 89 - 44).reshape(n, H) / 16
        else:
            sample.topk_ids = ((torch.arange(n * K) + base * K) % VOCAB).reshape(n, K)
            sample.topk_logprobs = -((torch.arange(n * K) + base * K) % 13).reshape(n, K).float() / 4
        out.append(sample)
        base += n
    return out


def request_of(samples: list[CapturedSample]) -> list[SampleTokens]:
    """The requests these samples answer (same ids, tokens and masks)."""
    return [SampleTokens(s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]
