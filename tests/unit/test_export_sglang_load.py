"""Our SGLang export, loaded by SGLang 0.5.23's own LlamaForCausalLMEagle3 on CPU, sets every parameter to our tensors.

SGLang's loader silently skips names it does not know, so the only proof that an export serves the weights we
trained is to load it into SGLang's real class and look: every parameter except the embeddings (shared from the
target at serving time) must be written and equal ours, with SGLang's q/k/v and gate/up fusion and its padded
lm_head. The SGLang side runs in a child process (this file run as a script),
because it initialises a process-wide runtime context and a gloo process group that must not leak into other
tests. It reads the config through SGLang's get_config and the weights through SGLang's safetensors iterator.

Two import-only stand-ins, both for modules SGLang imports but never runs on this path, each raising if touched:
  vllm._custom_ops   the rotary-embedding layer imports it at construction on a non-CPU-engine machine (documented);
  torchvision        sglang.srt.configs imports an InternVL image helper that imports torchvision.transforms; no
                     torchvision wheel for the CPU build of torch 2.13 exists (the PyPI one needs libtorch_cuda).
Requirements: pip install --no-deps sglang==0.5.23, tests/sglang-parser-requirements.txt and
tests/sglang-draft-requirements.txt (see that file); skipped with the missing module named otherwise.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import socket
import subprocess
import sys
import types
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


# --------------------------------------------------------------------------------------- the SGLang child


class _StandIn:
    """Any use (call or attribute) of a stand-in raises: it exists only so that an import succeeds."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is an import-only test stand-in and was called")

    def __getattr__(self, attr: str):
        raise RuntimeError(f"{self._name}.{attr} is an import-only test stand-in and was used")


def _stand_in_module(name: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{name}.{attr}")

    module.__getattr__ = missing
    sys.modules[name] = module
    return module


def install_stand_ins() -> list[str]:
    """Fake vllm._custom_ops and (when absent) torchvision.transforms; returns what was faked."""
    from transformers.utils.import_utils import is_torchvision_available

    faked = []
    if importlib.util.find_spec("torchvision") is None:
        assert not is_torchvision_available()  # cached now, so transformers never mistakes the stand-in for torchvision
        vision, transforms = _stand_in_module("torchvision", True), _stand_in_module("torchvision.transforms", True)
        vision.transforms, transforms.functional = transforms, _stand_in_module("torchvision.transforms.functional")
        faked.append("torchvision")
    if importlib.util.find_spec("vllm") is None:
        _stand_in_module("vllm", True).__dict__["_custom_ops"] = _stand_in_module("vllm._custom_ops")
        faked.append("vllm._custom_ops")
    return faked


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_sglang_cpu_runtime(target_dir: Path) -> None:
    """SGLang's runtime context and a one-rank gloo group, as a scheduler process has them (once per process)."""
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    if not torch.distributed.is_initialized():
        args = ServerArgs(model_path=str(target_dir), device="cpu", skip_tokenizer_init=True)
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        initialize_model_parallel(backend="gloo")


def nan_filled(model):
    """``model`` with every parameter NaN: a parameter the loader never writes stays NaN."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    return model


def build_sglang_draft(export_dir: Path, target_dir: Path):
    """SGLang's LlamaForCausalLMEagle3 for the export's config.json, every parameter filled with NaN."""
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.utils.hf_transformers_utils import get_config

    init_sglang_cpu_runtime(target_dir)
    return nan_filled(LlamaForCausalLMEagle3(get_config(str(export_dir), trust_remote_code=False)))


def child_main(target_dir: str, *jobs: str) -> None:
    """For each (export dir, out file): load the export into a fresh SGLang draft model with SGLang's own readers
    and save every parameter plus hot_token_id."""
    from safetensors.torch import save_file

    faked = install_stand_ins()
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    for export_dir, out_file in zip(jobs[::2], jobs[1::2], strict=True):
        model = build_sglang_draft(Path(export_dir), Path(target_dir))
        model.load_weights(safetensors_weights_iterator([str(Path(export_dir) / "model.safetensors")]))
        tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        if model.hot_token_id is not None:
            tensors["__hot_token_id__"] = model.hot_token_id.contiguous()
        view = {
            "draft_vocab_size": model.config.draft_vocab_size,
            "fc_in": model.model.fc.in_features,
            "num_aux": model.model.num_aux_hidden_states,
            "hidden_size_in": model.model.hidden_size_in,
            "aux_ids": model.config.eagle_config["eagle_aux_hidden_state_layer_ids"],
            "load_lm_head_from_target": model.load_lm_head_from_target,
            "stand_ins": faked,
        }
        save_file(tensors, out_file, metadata={"sglang_view": json.dumps(view)})


# ----------------------------------------------------------------------------------------------- the tests


def _missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


pytestmark = pytest.mark.skipif(
    bool(_missing_modules()),
    reason=(
        f"SGLang draft-class test needs modules {_missing_modules()}: pip install --no-deps sglang==0.5.23, "
        "-r tests/sglang-parser-requirements.txt, -r tests/sglang-draft-requirements.txt"
    ),
)


def load_in_sglang(target_dir: Path, export_dirs: list[Path]) -> list[dict[str, torch.Tensor]]:
    """Run the child once; for each export, SGLang's parameters after loading it (and __hot_token_id__), with
    what SGLang's model read from config.json under the key __view__."""
    from safetensors import safe_open

    outs = [d.with_name(d.name + ".sglang.safetensors") for d in export_dirs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(Path(__file__).resolve()), str(target_dir)]
    cmd += [str(p) for pair in zip(export_dirs, outs, strict=True) for p in pair]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = []
    for out in outs:
        with safe_open(str(out), framework="pt") as fh:
            results.append(
                {
                    **{k: fh.get_tensor(k) for k in fh.keys()},  # noqa: SIM118 (safetensors' safe_open has keys() but is not iterable: `in fh` raises)
                    "__view__": json.loads(fh.metadata()["sglang_view"]),
                }
            )
    return results


def misname(export_dir: Path, broken: Path, name: str, wrong: str) -> Path:
    """A copy of the export with tensor ``name`` stored as ``wrong`` (the kind of key SGLang's loader skips)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(export_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors[wrong] = tensors.pop(name)
    save_file(tensors, str(broken / "model.safetensors"))
    return broken


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """SGLang's parameters after loading a clean fp32 export and a misnamed copy; our drafter, dims, the dirs."""
    from eagle3.drafter.model import export_state_dict
    from eagle3.export.sglang import export_sglang
    from tests.unit.test_export import AUX, random_drafter, tiny_dims, vocab_maps, write_target

    tmp = tmp_path_factory.mktemp("sglang")
    dims = tiny_dims(vocab=200, draft=100)  # lm_head rows get padded by SGLang (100 -> 128): checked below
    target = write_target(tmp / "target", dims)
    drafter = random_drafter(dims, target)
    out = export_sglang(export_state_dict(drafter), dims, *vocab_maps(dims), AUX, tmp / "export", torch.float32)
    broken = misname(out, tmp / "broken", "midlayer.hidden_norm.weight", "midlayer.hiden_norm.weight")
    clean_params, broken_params = load_in_sglang(target, [out, broken])
    return {
        "params": clean_params,
        "broken_params": broken_params,
        "drafter": drafter,
        "dims": dims,
        "out": out,
        "broken": broken,
    }


def test_every_sglang_parameter_but_the_embeddings_is_ours(loaded):
    """fc, fused qkv (q;k;v rows), o, fused gate_up (gate;up rows), down, 3 layer norms, norm, lm_head[:Vd] == ours."""
    params, drafter, dims = loaded["params"], loaded["drafter"], loaded["dims"]
    mid = drafter.midlayer
    expected = {
        "model.fc.weight": drafter.fc.weight,
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [mid.self_attn.q_proj.weight, mid.self_attn.k_proj.weight, mid.self_attn.v_proj.weight]
        ),
        "model.layers.0.self_attn.o_proj.weight": mid.self_attn.o_proj.weight,
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([mid.mlp.gate_proj.weight, mid.mlp.up_proj.weight]),
        "model.layers.0.mlp.down_proj.weight": mid.mlp.down_proj.weight,
        "model.layers.0.input_layernorm.weight": mid.input_layernorm.weight,
        "model.layers.0.hidden_norm.weight": mid.hidden_norm.weight,
        "model.layers.0.post_attention_layernorm.weight": mid.post_attention_layernorm.weight,
        "model.norm.weight": drafter.norm.weight,
    }
    names = set(params) - {"__hot_token_id__", "__view__"}
    assert names == set(expected) | {"lm_head.weight", "model.embed_tokens.weight"}
    for name, want in expected.items():
        assert torch.equal(params[name], want.detach()), name
    lm_head = params["lm_head.weight"]
    assert lm_head.shape[0] >= dims.draft_vocab_size
    assert torch.equal(lm_head[: dims.draft_vocab_size], drafter.lm_head.weight.detach())
    assert torch.isnan(params["model.embed_tokens.weight"]).all()  # shared from the target when serving


def test_hot_token_ids_are_the_draft_vocab(loaded):
    """SGLang's hot_token_id = d2t + arange: the target ids of our draft vocab, in draft order."""
    from tests.unit.test_export import vocab_maps

    params, dims = loaded["params"], loaded["dims"]
    d2t, t2d = vocab_maps(dims)
    assert torch.equal(params["__hot_token_id__"], d2t + torch.arange(dims.draft_vocab_size))
    assert torch.equal(params["__hot_token_id__"], t2d.nonzero().squeeze(1))


def test_sglang_ignores_a_misnamed_key_that_our_check_catches(loaded):
    """hidden_norm misspelt: SGLang loads without a word and leaves the norm unset (NaN); our check names the key."""
    from eagle3.export.checks import ExportError
    from eagle3.export.sglang import check_sglang_export

    params = loaded["broken_params"]
    assert torch.isnan(params["model.layers.0.hidden_norm.weight"]).all()
    assert not torch.isnan(params["model.fc.weight"]).any()
    with pytest.raises(ExportError, match=r"missing keys \['midlayer.hidden_norm.weight'\].*midlayer.hiden_norm"):
        check_sglang_export(loaded["broken"])


def test_sglang_reads_our_config_fields(loaded):
    """SGLang's model took our draft vocab (its own lm_head, not the target's), fc width 3 x Ht and our aux ids."""
    dims, view = loaded["dims"], loaded["params"]["__view__"]
    assert view["draft_vocab_size"] == dims.draft_vocab_size and view["load_lm_head_from_target"] is False
    assert (view["num_aux"], view["hidden_size_in"], view["fc_in"]) == (3, dims.hidden_size, 3 * dims.hidden_size)
    assert view["aux_ids"] == [1, 3, 4]  # output-of-layer; SGLang's Llama target captures before layers [2, 4, 5]
    assert set(view["stand_ins"]) <= {"torchvision", "vllm._custom_ops"}


if __name__ == "__main__":
    child_main(*sys.argv[1:])
