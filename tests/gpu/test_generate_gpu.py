"""Fast generation on CUDA, where transformers compiles the static decode step (Inductor, CUDA graphs): each decode
attention, with and without straggler batches, gives plain generate's greedy tokens in float32."""

from __future__ import annotations

import pytest

from eagle3.data.generate import TokenGenerator
from tests.unit.test_generate import _plain, _prompts, _settings, _tiny_llama

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("attention,stragglers", [("kv_heads", 0), ("flex", 0), ("kv_heads", 2), ("flex", 2)])
def test_compiled_static_generation_equals_plain_generate_on_cuda(attention, stragglers):
    """Compiled static decode on CUDA (batches of 4, straggler batches of 2 when asked) equals plain generate."""
    model = _tiny_llama().to("cuda")
    prompts = _prompts(16, seed=3)
    free = _plain(model, prompts, (2,))
    eos = (2, free[0][4], free[3][1], free[5][2])  # tokens the model emits: rows stop at different steps
    ref = _plain(model, prompts, eos)
    gen = TokenGenerator(model, _settings(eos, backend="static", decode_attention=attention, straggler_rows=stragglers))
    got = gen.generate(prompts)
    model.set_attn_implementation("sdpa")
    assert got == ref
    if stragglers:
        assert any(shape.startswith("static 2 x ") for shape in gen.stats.shapes), gen.stats.shapes
