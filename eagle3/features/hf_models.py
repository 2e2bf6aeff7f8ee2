"""The process-wide cache of transformers targets and one lock per device: shard tasks in one process share a
loaded target and take turns running forwards on its device."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from eagle3.features.attention import enable

_MODELS: dict[tuple, Any] = {}
_MODELS_LOCK = threading.Lock()
_DEVICE_LOCKS: dict[str, threading.Lock] = {}


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; anything else unchanged."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_lock(device: str | torch.device) -> threading.Lock:
    """One lock per device: shard tasks in one process take turns running forwards on it."""
    key = str(torch.device(device))
    with _MODELS_LOCK:
        return _DEVICE_LOCKS.setdefault(key, threading.Lock())


def load_model(model_dir: Path, dtype: str, device: str, device_map: str | None = None) -> Any:
    """A fresh (uncached) target in eval mode with the per-sample attention where it is exact."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if not device_map:
        model = model.to(device)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in functools.wraps: mypy sees no bound self
    model.eval()
    enable(model)
    return model


def get_model(model_dir: Path, dtype: str = "float32", device: str = "cpu", device_map: str | None = None) -> Any:
    """The target model, loaded once per process for (fingerprint, dtype, device, device_map)."""
    from eagle3.target.load import fingerprint

    device = resolve_device(device)
    key = (fingerprint(Path(model_dir)), dtype, device, device_map)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(Path(model_dir), dtype, device, device_map)
        return _MODELS[key]


def clear_model_cache() -> None:
    """Forget every cached model (tests, or to free GPU memory between stages)."""
    with _MODELS_LOCK:
        _MODELS.clear()
