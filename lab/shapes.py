"""Config fields of the random-weight targets the benchmarks build (no weights, no download), and the random
drafter they train over them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from eagle3.drafter.model import DrafterDims, Eagle3Drafter

LLAMA31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 32,
    "tie_word_embeddings": False,
}
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 30,
    "tie_word_embeddings": True,
}


def random_drafter(
    dims: DrafterDims, device: torch.device, gen: torch.Generator
) -> tuple[Eagle3Drafter, torch.Tensor, torch.Tensor]:
    """(drafter, t2d, d2t): a drafter of ``dims`` on ``device``, every Linear and Embedding weight N(0, 0.02) drawn
    from ``gen`` on the device (no CPU init of a billion numbers), and a random draft vocab map (t2d [V] bool, d2t
    [Vd]), for eagle3.train.build.ttt_objective."""
    import torch
    from torch import nn

    from eagle3.drafter.model import Eagle3Drafter

    with torch.device(device):
        drafter = Eagle3Drafter(dims)
        for module in drafter.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02, generator=gen)
        used = torch.randperm(dims.vocab_size, generator=gen)[: dims.draft_vocab_size].sort().values
        t2d = torch.zeros(dims.vocab_size, dtype=torch.bool)
        t2d[used] = True
        d2t = used - torch.arange(dims.draft_vocab_size)
    return drafter, t2d, d2t
