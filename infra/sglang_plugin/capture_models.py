"""Aux + final hidden states in one prefill, from an unpatched SGLang 0.5.16 (and later) server.

SGLang 0.5.16 has no ``--enable-return-aux-hidden-states`` (0.5.23 added it, and even there the final
hidden state is not returned beside the aux ones). What every version since 0.5.14 does have:

* ``SGLANG_EXTERNAL_MODEL_PACKAGE``: every module of the named package with an ``EntryClass`` is registered
  by class name and overrides SGLang's own class of that name (``sglang/srt/models/registry.py``).
* ``set_eagle3_layers_to_capture(ids)`` on the target model: the decoder then returns the residual stream
  entering layer ``id + 1`` (= the output of decoder layer ``id``, our convention) for each id.
* ``LogitsProcessor.forward(..., hidden_states_before_norm=...)``: when given, that tensor is what
  ``return_hidden_states`` sends back (``sglang/srt/layers/logits_processor.py``, ``_get_hidden_states_to_store``),
  while the logits still come from the normal post-norm state.

So the classes here are SGLang's own, plus one step: with ``EAGLE3_SGLANG_CAPTURE_LAYERS=a,b,c`` set, the
model captures those layers and hands ``cat(aux_a, aux_b, aux_c, final_post_norm)`` ([T, (K + 1) * H]) to the
logits processor as the state to return. Without the variable they behave exactly like SGLang's classes.
The client checks the row width, so a server that silently fell back to SGLang's class (an import error
here is only a warning there) fails the first capture instead of yielding wrong rows.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

LAYERS_ENV = "EAGLE3_SGLANG_CAPTURE_LAYERS"


def capture_layers() -> list[int] | None:
    """Layer ids (output-of-layer convention) from the environment, or None when capture is off."""
    text = os.environ.get(LAYERS_ENV, "").strip()
    return [int(part) for part in text.split(",")] if text else None


class PackAuxLogits(nn.Module):
    """Wraps a LogitsProcessor: aux states + the post-norm final state become the returned hidden states."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: Any,
        logits_metadata: Any,
        aux_hidden_states: list[torch.Tensor] | None = None,
        hidden_states_before_norm: torch.Tensor | None = None,
    ) -> Any:
        if aux_hidden_states is not None:
            # [T, H] each -> [T, (K + 1) * H]; hidden_states is the post-norm final state the logits use.
            hidden_states_before_norm = torch.cat([*aux_hidden_states, hidden_states], dim=-1)
        return self.inner(input_ids, hidden_states, lm_head, logits_metadata, None, hidden_states_before_norm)


def with_packed_capture(base: type[nn.Module]) -> type[nn.Module]:
    """A subclass of SGLang's ``base`` with the same name, capturing the env's layers when set."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (the class type() makes below)
        base.__init__(self, *args, **kwargs)
        layers = capture_layers()
        if layers is not None:
            self.set_eagle3_layers_to_capture(layers)
            self.logits_processor = PackAuxLogits(self.logits_processor)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


def _entry_classes() -> list[type[nn.Module]]:
    """The target families whose SGLang class supports EAGLE-3 layer capture and is importable here."""
    from sglang.srt.models.llama import LlamaForCausalLM

    classes = [LlamaForCausalLM]
    for module, name in (
        ("sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
        ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
    ):
        try:
            classes.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            continue
    return [with_packed_capture(cls) for cls in classes if hasattr(cls, "set_eagle3_layers_to_capture")]


def __getattr__(name: str) -> Any:
    """``EntryClass``, built when SGLang's registry asks for it, so importing this module needs no sglang."""
    if name == "EntryClass":
        return _entry_classes()
    raise AttributeError(name)
