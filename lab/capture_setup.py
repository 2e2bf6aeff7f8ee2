"""The capture benchmark's targets and samples (lab/capture.py): the preset's target with its tokenized samples
(or synthetic ones), or a random-weight model of Llama-3.1-8B or SmolLM2-135M shapes built on the device; and
the --save-tokens / --tokens-file sample files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.spec import FeatureSpec, SampleTokens
from lab.shapes import LLAMA31_8B, SMOLLM2_135M


def file_samples(path: Path, args: argparse.Namespace) -> list[SampleTokens]:
    """Samples of a --save-tokens file (ids concatenated, lengths), the first --num-samples that fit the cap."""
    import numpy as np

    data = np.load(path)
    ids, lengths = data["ids"].astype(np.int64), data["lengths"]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    keep = [i for i, n in enumerate(lengths) if n <= args.max_sample_tokens][: args.num_samples]
    return [
        SampleTokens(f"file:{i}", ids[starts[i] : starts[i] + lengths[i]].tolist(), [1] * int(lengths[i])) for i in keep
    ]


def save_tokens(path: Path, samples: list[SampleTokens]) -> None:
    import numpy as np

    ids = np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples])
    lengths = np.asarray([len(s.input_ids) for s in samples], dtype=np.int32)
    np.savez_compressed(path, ids=ids.astype(np.uint16) if ids.max() < 65536 else ids, lengths=lengths)
    print(f"saved {len(samples)} samples, {len(ids)} tokens to {path}")


def synthetic_samples(args: argparse.Namespace, vocab_size: int, seed: int) -> list[SampleTokens]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.min_sample_tokens, args.max_sample_tokens + 1, (args.num_samples,), generator=gen)
    return [
        SampleTokens(f"synthetic:{i}", torch.randint(0, vocab_size, (int(n),), generator=gen).tolist(), [1] * int(n))
        for i, n in enumerate(lengths)
    ]


def preset_setup(cfg: Any, args: argparse.Namespace, device: str) -> tuple[HFCaptureBackend, FeatureSpec, list]:
    """The configured target, its spec, and the first tokenized samples that fit the length cap (or synthetic)."""
    from eagle3.data.tokenize import read_tokenized
    from eagle3.features.run_spec import build_spec
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg)
    spec = build_spec(cfg, model_dir)
    if args.synthetic:
        samples = synthetic_samples(args, spec.vocab_size, cfg.run.seed)
    else:
        table = read_tokenized(
            cfg.run_dir / "data" / "tokenized.parquet", columns=["id", "input_ids", "loss_mask", "num_tokens"]
        )
        rows = [r for r in table.to_pylist() if r["num_tokens"] <= args.max_sample_tokens][: args.num_samples]
        if not rows:
            sys.exit(
                f"no tokenized samples of <= {args.max_sample_tokens} tokens under {cfg.run_dir}: tokenize "
                f"first, or pass --synthetic"
            )
        samples = [SampleTokens(r["id"], r["input_ids"], r["loss_mask"]) for r in rows]
    budget = args.tokens_per_forward or cfg.capture.tokens_per_forward
    backend = HFCaptureBackend.from_spec(
        model_dir,
        spec,
        device=device,
        dtype=cfg.target.dtype,
        tokens_per_forward=budget,
        device_map=cfg.capture.device_map,
        batch_invariant=per_sample_choice(cfg, args),
    )
    return backend, spec, samples


def per_sample_choice(cfg: Any, args: argparse.Namespace) -> bool | str:
    """The attention choice: --padded-attention / --per-sample-attention, else capture.per_sample_attention."""
    if args.padded_attention:
        return False
    return True if args.per_sample_attention else cfg.capture.per_sample_attention


def random_setup(cfg: Any, args: argparse.Namespace, device: str) -> tuple[HFCaptureBackend, FeatureSpec, list]:
    """A random-weight model of Llama-3.1-8B or SmolLM2-135M shapes built on the device, and synthetic samples."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle3.target.load import default_aux_layer_ids

    shape = dict(LLAMA31_8B if args.random_llama8b else SMOLLM2_135M)
    shape["num_hidden_layers"] = args.num_layers or shape["num_hidden_layers"]
    config = LlamaConfig(**shape)
    torch.manual_seed(cfg.run.seed)
    with torch.device(device):  # weights materialize on the device: nothing is loaded or carried
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    num_layers = config.num_hidden_layers
    aux = cfg.target.aux_layer_ids or default_aux_layer_ids(num_layers)
    name = "random-llama-3.1-8b" if args.random_llama8b else "random-smollm2-135m"
    spec = FeatureSpec(
        target_name=name,
        target_fingerprint="random",
        hidden_size=config.hidden_size,
        num_layers=num_layers,
        vocab_size=config.vocab_size,
        aux_layer_ids=aux,
        supervision=cfg.capture.supervision,
        topk=cfg.capture.topk if cfg.capture.supervision == "topk_logprobs" else None,
        dtype=cfg.capture.dtype,
        aux_dtype=cfg.capture.aux_dtype,
        max_len=args.max_sample_tokens,
        chat_template_hash="none",
        backend="hf",
    )
    budget = args.tokens_per_forward or cfg.capture.tokens_per_forward
    backend = HFCaptureBackend(
        None,
        aux,
        supervision=spec.supervision,
        topk=spec.topk,
        device=device,
        tokens_per_forward=budget,
        model=model,
        batch_invariant=per_sample_choice(cfg, args),
    )
    samples = (
        file_samples(args.tokens_file, args)
        if args.tokens_file
        else synthetic_samples(args, config.vocab_size, cfg.run.seed)
    )
    return backend, spec, samples
