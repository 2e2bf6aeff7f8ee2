"""Our DFlash export, loaded by SGLang 0.5.23's own DFlashDraftModel on CPU, sets every parameter to our tensors,
and SGLang's own forward of a block then gives the hidden states our module gives.

SGLang's DFlashDraftModel.load_weights silently ignores names it does not know, so the proof that an export serves
the weights we trained is to load it into SGLang's real class and look: every parameter must be written (none left
NaN) and equal ours, with SGLang's q/k/v and gate/up fusion. The forward check runs SGLang's own
DFlashDraftModel.forward (its layers, qk-norm, RoPE, fused residual norms, final norm) over a block whose context
was written into a real SGLang KV pool (MHATokenToKVPool) the way DFlashWorkerV2._append_target_hidden_sequential
writes it (project_target_hidden, kv_proj_only, apply_k_norm, apply_k_rope, set_kv_buffer), with SGLang's
TorchNativeAttnBackend honouring the layers' ENCODER_ONLY attention type. Two things are not the GPU path: the
batch is an EXTEND batch with the committed context as its prefix (the worker's TARGET_VERIFY batch over the same
keys needs a GPU backend), and SGLANG_FORCE_FUSED_OP_BACKEND=torch runs the norms, RoPE and SiLU as SGLang's
forward_native (no CUDA kernels here).

The SGLang side runs in a child process (this file run as a script): it initialises a process-wide runtime context
and a gloo process group that must not leak into other tests. It reads the config through SGLang's get_config and
the weights through SGLang's safetensors iterator.

Import-only stand-ins, each raising if touched: those of tests/unit/test_export_sglang_load.py (vllm._custom_ops,
torchvision), plus one for DFlash:
  einops   sglang.srt.models.dflash imports sglang.srt.models.utils, whose import chain (model_executor.runner ->
           batch_overlap -> layers.moe.topk -> eplb.expert_distribution) imports einops at module level for the MoE
           expert-distribution recorder, which a DFlash draft never runs; einops is not in the project's
           environment nor in tests/sglang-draft-requirements.txt.
Requirements: as tests/unit/test_export_sglang_load.py; skipped with the missing module named otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NEEDED = (
    "sglang",
    "triton",
    "dill",
    "tvm_ffi",
    "sentencepiece",
    "compressed_tensors",
    "loguru",
    "openai",
    "partial_json_parser",
    "msgspec",
    "zmq",
    "pybase64",
)
DFLASH_STAND_INS = ("einops",)
NUM_TARGET_LAYERS = 8
TARGET_LAYER_IDS = [1, 3, 5]
CONTEXT_LENS = [7, 4]  # committed tokens of the two rows of the forward check


# --------------------------------------------------------------------------------------- the SGLang child


def install_dflash_stand_ins() -> list[str]:
    """The EAGLE-3 test's stand-ins plus einops (when absent); returns what was faked."""
    from tests.unit.test_export_sglang_load import _stand_in_module, install_stand_ins

    faked = install_stand_ins()
    for name in DFLASH_STAND_INS:
        if importlib.util.find_spec(name) is None:
            _stand_in_module(name, True)
            faked.append(name)
    return faked


def build_sglang_dflash(export_dir: Path, target_dir: Path):
    """SGLang's DFlashDraftModel for the export's config.json, every parameter filled with NaN."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers_utils import get_config

    from tests.unit.test_export_sglang_load import init_sglang_cpu_runtime, nan_filled

    init_sglang_cpu_runtime(target_dir)
    return nan_filled(DFlashDraftModel(get_config(str(export_dir), trust_remote_code=False)))


def sglang_block_forward(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """SGLang's DFlashDraftModel.forward over one block per row, after writing each row's context into an SGLang KV
    pool as DFlashWorkerV2._append_target_hidden_sequential does: hidden states [R*K, H]."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    block_ids, context_lens = inputs["block_ids"], inputs["context_lens"]  # [R, K], [R]
    rows, block = block_ids.shape
    attn0 = model.layers[0].self_attn
    seq_lens = context_lens + block
    pool = MHATokenToKVPool(
        size=int(seq_lens.sum()) + 8,
        page_size=1,
        dtype=torch.float32,
        head_num=attn0.num_kv_heads,
        head_dim=attn0.head_dim,
        layer_num=len(model.layers),
        device="cpu",
        enable_memory_saver=False,
    )
    req_to_token = torch.zeros((rows, int(seq_lens.max())), dtype=torch.int64)
    start = 1  # slot 0 is the pool's padding slot
    for r, n in enumerate(seq_lens.tolist()):
        req_to_token[r, :n] = torch.arange(start, start + n)
        start += n
    runner = SimpleNamespace(
        device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool
    )
    backend = TorchNativeAttnBackend(runner)
    ctx_loc = torch.cat([req_to_token[r, :n] for r, n in enumerate(context_lens.tolist())])
    ctx_pos = torch.cat([torch.arange(n) for n in context_lens.tolist()])
    target_hidden = torch.cat([inputs[f"features_{r}"] for r in range(rows)])  # [sum C, F*H]
    with torch.no_grad():
        ctx_hidden = model.project_target_hidden(target_hidden)
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx_hidden))
            k = attn.apply_k_rope(ctx_pos, attn.apply_k_norm(k))
            pool.set_kv_buffer(
                attn.attn,
                ctx_loc,
                k.view(-1, attn.num_kv_heads, attn.head_dim),
                v.view(-1, attn.num_kv_heads, attn.head_dim),
                attn.attn.k_scale,
                attn.attn.v_scale,
            )
    positions = (context_lens[:, None] + torch.arange(block)).flatten()  # the worker's prefix_lens + offsets
    out_loc = torch.cat([req_to_token[r, n : n + block] for r, n in enumerate(context_lens.tolist())])
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=rows,
        input_ids=block_ids.flatten(),
        req_pool_indices=torch.arange(rows),
        seq_lens=seq_lens,
        out_cache_loc=out_loc,
        seq_lens_sum=int(seq_lens.sum()),
        positions=positions,
        extend_prefix_lens=context_lens,
        extend_seq_lens=torch.full((rows,), block),
    )
    backend.init_forward_metadata(batch)
    embeds = inputs["embed"][block_ids.flatten()]  # the worker's embed_module(block_ids)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        return model(block_ids.flatten(), positions, batch, input_embeds=embeds).hidden_states


def child_main(target_dir: str, *jobs: str) -> None:
    """For each (export dir, inputs file or '-', out file): load the export into a fresh SGLang DFlashDraftModel with
    SGLang's own readers, save every parameter, what SGLang read from the config, and (given inputs) its forward."""
    from safetensors.torch import load_file, save_file

    faked = install_dflash_stand_ins()
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    for export_dir, inputs_file, out_file in zip(jobs[::3], jobs[1::3], jobs[2::3], strict=True):
        model = build_sglang_dflash(Path(export_dir), Path(target_dir))
        model.load_weights(safetensors_weights_iterator([str(Path(export_dir) / "model.safetensors")]))
        tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        parsed = parse_dflash_draft_config(draft_hf_config=model.config)
        layers = [layer.self_attn for layer in model.layers]
        view = {
            "block_size": model.block_size,
            "num_context_features": model.num_context_features,
            "fc_in": model.fc.in_features,
            "mask_token_id": parsed.mask_token_id,
            "target_layer_ids": parsed.resolve_target_layer_ids(
                target_num_layers=NUM_TARGET_LAYERS, draft_num_layers=len(layers)
            ),
            "attn_types": [a.attn.attn_type.name for a in layers],
            "sliding_window": [a.attn.sliding_window_size for a in layers],
            "scaling": [a.attn.scaling for a in layers],
            "rope": [type(a.rotary_emb).__name__ for a in layers],
            "neox": [bool(a.rotary_emb.is_neox_style) for a in layers],
            "stand_ins": faked,
            "fused_op_backend": os.environ.get("SGLANG_FORCE_FUSED_OP_BACKEND"),
        }
        if inputs_file != "-":
            tensors["__hidden__"] = sglang_block_forward(model, load_file(inputs_file)).contiguous()
        save_file(tensors, out_file, metadata={"sglang_view": json.dumps(view)})


# ----------------------------------------------------------------------------------------------- the tests


def _missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


pytestmark = pytest.mark.skipif(
    bool(_missing_modules()),
    reason=(
        f"SGLang DFlash draft-class test needs modules {_missing_modules()}: pip install --no-deps sglang==0.5.23, "
        "-r tests/sglang-parser-requirements.txt, -r tests/sglang-draft-requirements.txt"
    ),
)


def load_in_sglang(target_dir: Path, jobs: list[tuple[Path, Path | None]]) -> list[dict]:
    """Run the child once; for each (export, inputs or None), SGLang's parameters after loading it, its forward
    (__hidden__, given inputs) and what it read from config.json (__view__)."""
    from safetensors import safe_open

    outs = [export.with_name(export.name + ".sglang.safetensors") for export, _ in jobs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SGLANG_FORCE_FUSED_OP_BACKEND": "torch"}
    cmd = [sys.executable, str(Path(__file__).resolve()), str(target_dir)]
    for (export, inputs), out in zip(jobs, outs, strict=True):
        cmd += [str(export), str(inputs) if inputs is not None else "-", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = []
    for out in outs:
        with safe_open(str(out), framework="pt") as fh:
            results.append(
                {
                    **{k: fh.get_tensor(k) for k in fh.keys()},  # noqa: SIM118 (safe_open is not iterable)
                    "__view__": json.loads(fh.metadata()["sglang_view"]),
                }
            )
    return results


def write_target_config(folder: Path, hidden: int, vocab: int) -> Path:
    """A tiny Llama target folder (config.json only): what ServerArgs reads in the child."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "num_hidden_layers": NUM_TARGET_LAYERS,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def forward_inputs(drafter, path: Path, seed: int = 5) -> dict[str, torch.Tensor]:
    """Two rows (CONTEXT_LENS committed tokens each), random target features and anchors, the embedding table."""
    from safetensors.torch import save_file

    from eagle3.drafter.dflash_blocks import block_input_ids

    d = drafter.dims
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, d.vocab_size, (len(CONTEXT_LENS),), generator=gen)
    inputs = {
        f"features_{r}": torch.randn(n, d.num_context_features * d.hidden_size, generator=gen)
        for r, n in enumerate(CONTEXT_LENS)
    }
    inputs.update(
        {
            "block_ids": block_input_ids(anchors[:, None], d.block_size, d.mask_token_id),
            "context_lens": torch.tensor(CONTEXT_LENS),
            "embed": drafter.embed_tokens.weight.detach().clone(),
        }
    )
    save_file(inputs, str(path))
    return inputs


def our_block_forward(drafter, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our module on the same rows, contexts padded to the longest: hidden states [R*K, H]."""
    from eagle3.drafter.dflash_blocks import block_positions, block_visibility

    d, lens = drafter.dims, inputs["context_lens"]
    longest, width = int(lens.max()), d.num_context_features * d.hidden_size
    features = torch.zeros(len(lens), longest, width)
    for r, n in enumerate(lens.tolist()):
        features[r, :n] = inputs[f"features_{r}"]
    context_positions = torch.arange(longest).expand(len(lens), -1)
    positions = block_positions(lens[:, None], d.block_size)
    visible = block_visibility(lens[:, None], longest, d.block_size)
    with torch.no_grad():
        hidden = drafter(features, context_positions, inputs["block_ids"], positions, visible)
    return hidden.reshape(-1, d.hidden_size)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """SGLang's view of three exports: 2 layers plain RoPE (with a forward), 1 layer llama3 RoPE (with a forward),
    and a copy of the first with a misnamed key."""
    from eagle3.drafter.dflash import export_state_dict
    from eagle3.drafter.functional import Llama3RopeScaling
    from eagle3.export.dflash import export_dflash
    from tests.unit.test_dflash_model import random_dflash, tiny_dflash_dims
    from tests.unit.test_export_sglang_load import misname

    tmp = tmp_path_factory.mktemp("dflash_sglang")
    plain = random_dflash(tiny_dflash_dims(layers=2), seed=1)
    scaled = random_dflash(
        tiny_dflash_dims(
            layers=1,
            block_size=5,
            rope_scaling=Llama3RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8
            ),
        ),
        seed=2,
    )
    target = write_target_config(tmp / "target", plain.dims.hidden_size, plain.dims.vocab_size)
    outs, inputs = [], []
    for name, drafter in (("plain", plain), ("scaled", scaled)):
        outs.append(
            export_dflash(
                export_state_dict(drafter), drafter.dims, TARGET_LAYER_IDS, NUM_TARGET_LAYERS, tmp / name, torch.float32
            )
        )
        inputs.append(forward_inputs(drafter, tmp / f"{name}.inputs.safetensors"))
    broken = misname(outs[0], tmp / "broken", "layers.1.self_attn.k_norm.weight", "layers.1.self_attn.k_nrom.weight")
    results = load_in_sglang(
        target,
        [(outs[0], tmp / "plain.inputs.safetensors"), (outs[1], tmp / "scaled.inputs.safetensors"), (broken, None)],
    )
    return {
        "drafters": [plain, scaled],
        "results": results[:2],
        "inputs": inputs,
        "broken": broken,
        "broken_params": results[2],
    }


def expected_sglang_params(drafter) -> dict[str, torch.Tensor]:
    """Every SGLang parameter as our tensors: q;k;v rows fused into qkv_proj, gate;up into gate_up_proj."""
    expected = {
        "fc.weight": drafter.fc.weight,
        "hidden_norm.weight": drafter.hidden_norm.weight,
        "norm.weight": drafter.norm.weight,
    }
    for i, layer in enumerate(drafter.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"layers.{i}"
        expected.update(
            {
                f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
                f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                f"{p}.self_attn.qkv_proj.weight": torch.cat(
                    [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
                ),
                f"{p}.self_attn.o_proj.weight": attn.o_proj.weight,
                f"{p}.self_attn.q_norm.weight": attn.q_norm.weight,
                f"{p}.self_attn.k_norm.weight": attn.k_norm.weight,
                f"{p}.mlp.gate_up_proj.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                f"{p}.mlp.down_proj.weight": mlp.down_proj.weight,
            }
        )
    return {k: v.detach() for k, v in expected.items()}


def test_every_sglang_parameter_is_ours(loaded):
    """SGLang's parameter set is exactly ours (no embeddings, no lm_head: the target's), every one written."""
    for drafter, params in zip(loaded["drafters"], loaded["results"], strict=True):
        expected = expected_sglang_params(drafter)
        names = set(params) - {"__view__", "__hidden__"}
        assert names == set(expected)
        for name, want in expected.items():
            assert not torch.isnan(params[name]).any(), f"SGLang left {name} unset"
            assert torch.equal(params[name], want), name


def test_sglang_reads_our_config_fields(loaded):
    """Block size, features, mask id, target layers; non-causal (ENCODER_ONLY) full attention with 1/sqrt(hd);
    neox-style RoPE, llama3-scaled when asked."""
    for drafter, params, rope in zip(
        loaded["drafters"], loaded["results"], ("RotaryEmbedding", "Llama3RotaryEmbedding"), strict=True
    ):
        d, view = drafter.dims, params["__view__"]
        layers = d.num_hidden_layers
        assert (view["block_size"], view["num_context_features"], view["fc_in"]) == (d.block_size, 3, 3 * d.hidden_size)
        assert view["mask_token_id"] == d.mask_token_id and view["target_layer_ids"] == TARGET_LAYER_IDS
        assert view["attn_types"] == ["ENCODER_ONLY"] * layers and view["sliding_window"] == [-1] * layers
        assert view["scaling"] == [d.head_dim**-0.5] * layers
        assert view["rope"] == [rope] * layers and view["neox"] == [True] * layers
        assert set(view["stand_ins"]) <= {"torchvision", "vllm._custom_ops", *DFLASH_STAND_INS}
        assert view["fused_op_backend"] == "torch"


def test_sglang_forward_of_a_block_equals_ours(loaded):
    """Two rows with 7 and 4 committed tokens: SGLang's hidden states of every block slot equal our module's."""
    for drafter, params, inputs in zip(loaded["drafters"], loaded["results"], loaded["inputs"], strict=True):
        ours, theirs = our_block_forward(drafter, inputs), params["__hidden__"]
        assert theirs.shape == ours.shape == (len(CONTEXT_LENS) * drafter.dims.block_size, drafter.dims.hidden_size)
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
        assert ours.std() > 0.1  # not a degenerate comparison


def test_sglang_ignores_a_misnamed_key_that_our_check_catches(loaded):
    """k_norm misspelt: SGLang loads without a word and leaves the norm unset (NaN); our check names the key."""
    from eagle3.export.checks import ExportError
    from eagle3.export.dflash import check_dflash_export

    params = loaded["broken_params"]
    assert torch.isnan(params["layers.1.self_attn.k_norm.weight"]).all()
    assert not torch.isnan(params["layers.0.self_attn.k_norm.weight"]).any()
    with pytest.raises(ExportError, match=r"missing keys \['layers.1.self_attn.k_norm.weight'\].*k_nrom"):
        check_dflash_export(loaded["broken"])


if __name__ == "__main__":
    child_main(*sys.argv[1:])
