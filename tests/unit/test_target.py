"""eagle3.target.load: target directories, shape facts, fingerprint, single-tensor reads, tokenizer report."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.config import load_config
from eagle3.target.load import (
    TokenizerMismatchError,
    default_aux_layer_ids,
    fingerprint,
    lm_head_name,
    load_model,
    load_tokenizer,
    prepare_target,
    read_tensor,
    safetensors_header,
    stop_token_ids,
    target_info,
    tokenizer_report,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = load_config("tiny", [f"run.workdir={tmp_path_factory.mktemp('w')}"])
    return prepare_target(cfg)


def test_default_aux_ids_follow_output_of_layer_convention():
    """[1, N//2-1, N-4]: Llama-3.1-8B (32 layers) -> [1, 15, 28], SmolLM2 (30) -> [1, 14, 26]."""
    assert default_aux_layer_ids(32) == [1, 15, 28]
    assert default_aux_layer_ids(30) == [1, 14, 26]


def test_target_info_reads_shapes_from_config(tiny_dir):
    """Shape facts come from config.json and match the tiny preset."""
    info = target_info(tiny_dir)
    assert (info.num_layers, info.hidden_size, info.num_attention_heads) == (8, 64, 4)
    assert info.aux_layer_ids == [1, 3, 4]
    assert info.vocab_size == len(load_tokenizer(tiny_dir))


@pytest.mark.parametrize(
    "ids,reason",
    [
        ("[1,2,9]", "out of range"),
        ("[1,2,7]", "out of range"),
        ("[1,1,3]", "distinct and ascending"),
        ("[3,1,2]", "distinct and ascending"),
    ],
)
def test_bad_aux_ids_are_refused(tiny_dir, ids, reason):
    """Aux ids beyond the layers, on the last layer (the final state), repeated or unordered are errors."""
    cfg = load_config("tiny", [f"target.aux_layer_ids={ids}"])
    with pytest.raises(ValueError, match=reason):
        target_info(tiny_dir, cfg.target)


def test_fingerprint_is_stable_and_tracks_tokenizer_changes(tiny_dir, tmp_path):
    """Same files -> same fingerprint; an edited tokenizer file -> a different one."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert fingerprint(copy) == fingerprint(tiny_dir)
    cfg_path = copy / "tokenizer_config.json"
    doc = json.loads(cfg_path.read_text())
    doc["model_max_length"] = 12345
    cfg_path.write_text(json.dumps(doc))
    assert fingerprint(copy) != fingerprint(tiny_dir)


def test_fingerprint_ignores_the_writing_transformers_version_only(tiny_dir, tmp_path):
    """A config.json differing only in transformers_version keeps the fingerprint; any other key changes it."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    cfg_path = copy / "config.json"
    doc = json.loads(cfg_path.read_text())
    assert "transformers_version" in doc
    doc["transformers_version"] = "0.0.1"
    cfg_path.write_text(json.dumps(doc))
    assert fingerprint(copy) == fingerprint(tiny_dir)
    doc["rms_norm_eps"] = 0.5
    cfg_path.write_text(json.dumps(doc))
    assert fingerprint(copy) != fingerprint(tiny_dir)


def _same_shapes_other_weights(src, dst):
    """A copy of target ``src`` whose model.safetensors has the same header (names, dtypes, shapes, offsets) but one
    changed weight, its size and mtime kept (what ``cp -p`` of another model with the same shapes leaves)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    with safe_open(str(weights), framework="pt") as fh:
        tensors, metadata = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118 (safetensors' safe_open has keys() but is not iterable: `in fh` raises)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    stat = weights.stat()
    save_file(tensors, str(weights), metadata=metadata)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert safetensors_header(weights) == safetensors_header(src / "model.safetensors")
    assert weights.stat().st_size == stat.st_size
    return dst


def test_fingerprint_covers_the_weights_by_content(tiny_dir, tmp_path):
    """Another target with the same config, tokenizer and tensor shapes but other weights has another fingerprint,
    also when its weights were replaced in place keeping size and mtime (the spec, hence every key, follows it)."""
    from eagle3.features.run_spec import build_spec

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    before = fingerprint(copy)
    other = _same_shapes_other_weights(tiny_dir, tmp_path / "other")
    assert fingerprint(other) != fingerprint(tiny_dir)
    cfg = load_config("tiny", ["target.kind=hf", f"target.path={other}"])
    assert build_spec(cfg, prepare_target(cfg)).target_fingerprint == fingerprint(other)
    weights = copy / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes((other / "model.safetensors").read_bytes())  # in place: same inode, size and mtime
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(copy) != before


def test_fingerprint_hashes_each_weight_file_once_per_version(tiny_dir, tmp_path, monkeypatch):
    """Weights are hashed through infra.storage's file-stamp cache: a second fingerprint reads no weight file."""
    import infra.storage as storage

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    monkeypatch.setattr(storage, "RACY_NS", 0)  # the copy is fresh; a real target settled long ago
    hashed = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    first = fingerprint(copy)
    assert "model.safetensors" in hashed
    hashed.clear()
    assert fingerprint(copy) == first and hashed == []


def test_gguf_target_fingerprint_follows_the_gguf_file(tiny_dir, tmp_path, monkeypatch):
    """A folder converted from a GGUF is identified by the GGUF's sha256 (not by re-hashing its fp32 weights):
    two GGUF files that convert to the same bytes still give two fingerprints."""
    import eagle3.target.load as target

    monkeypatch.setattr(target, "_write_gguf_as_hf", lambda src, out: shutil.copytree(tiny_dir, out))
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"GGUF one")
    second.write_bytes(b"GGUF two")
    one, two = (target.convert_gguf(p, tmp_path / "cache", "m") for p in (first, second))
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
    assert fingerprint(one) != fingerprint(two)
    assert fingerprint(one) == fingerprint(target.convert_gguf(first, tmp_path / "cache", "m"))


def test_read_tensor_through_a_sharded_index_matches_the_model(tiny_dir, tmp_path):
    """Single tensors (and row slices) read through model.safetensors.index.json equal the loaded weights."""
    model = load_model(tiny_dir)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    info = target_info(tiny_dir)
    for name in ("model.embed_tokens.weight", "model.norm.weight", lm_head_name(info)):
        assert torch.equal(read_tensor(sharded, name), model.state_dict()[name])
    rows = read_tensor(sharded, "model.embed_tokens.weight", rows=slice(3, 7))
    assert torch.equal(rows, model.state_dict()["model.embed_tokens.weight"][3:7])
    with pytest.raises(KeyError, match="nope"):
        read_tensor(sharded, "nope")


def test_tokenizer_report_lists_specials_and_end_of_turn(tiny_dir):
    """ChatML's <|im_end|> is one token and the model stops on it."""
    report = tokenizer_report(load_tokenizer(tiny_dir), target_info(tiny_dir))
    assert report["end_of_turn_text"] == "<|im_end|>"
    assert report["end_of_turn_ids"] == [2] and 2 in report["stop_ids"]
    assert report["special_tokens"]["eos_token"] == {"token": "<|im_end|>", "id": 2}


def test_tokenizer_report_names_both_ids_on_a_mismatch(tiny_dir, tmp_path):
    """A model that stops on another id than the template's end-of-turn token is an error naming both."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    for name in ("generation_config.json", "config.json"):
        doc = json.loads((broken / name).read_text())
        doc["eos_token_id"] = 0
        (broken / name).write_text(json.dumps(doc))
    tok = load_tokenizer(broken)
    tok.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatchError, match=r"ids \[2\].*stops on ids \[0\]"):
        tokenizer_report(tok, target_info(broken))


def test_stop_ids_include_the_end_of_turn_token(tiny_dir):
    """Ids forced into the draft vocab include EOS and the template's end-of-turn token."""
    assert 2 in stop_token_ids(load_tokenizer(tiny_dir), target_info(tiny_dir))


@pytest.mark.slow
def test_gguf_conversion_makes_a_folder_both_transformers_generations_read(tmp_path):
    """SmolLM2 GGUF -> fp32 safetensors once; the folder carries the transformers-4 fixes and answers Paris."""
    cfg = load_config("smollm2-demo", [f"target.cache_dir={tmp_path}"])
    model_dir = prepare_target(cfg)
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((model_dir / "config.json").read_text())["rope_theta"] == 100000.0
    assert prepare_target(cfg) == model_dir  # cached: second call does not convert again
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])
    tokenizer_report(tok, target_info(model_dir))


def test_killed_gguf_conversion_temp_dir_is_removed_by_the_next_conversion(tmp_path, monkeypatch):
    """A conversion killed mid-write leaves <name>-<hash>.tmp<pid>/; the next one removes it (only its own)."""
    import subprocess
    import sys

    import eagle3.target.load as target

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake bytes")  # the conversion itself is replaced below: only the folders matter
    cache = tmp_path / "cache"
    code = (
        "import os, eagle3.target.load as t\n"
        "def killed(src, out):\n    out.mkdir(parents=True); (out / 'model.safetensors').write_bytes(b'x' * 4096)\n"
        "    os.kill(os.getpid(), 9)\n"
        f"t._write_gguf_as_hf = killed\nt.convert_gguf(t.Path({str(gguf)!r}), t.Path({str(cache)!r}), 'm')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    killed = [p.name for p in cache.iterdir() if ".tmp" in p.name]
    assert len(killed) == 1 and killed[0].startswith("m-")
    other = cache / "other-0123456789ab.tmp123"  # another target's conversion: not ours to remove
    other.mkdir()
    monkeypatch.setattr(target, "_write_gguf_as_hf", lambda src, out: out.mkdir(parents=True))
    out = target.convert_gguf(gguf, cache, "m")
    assert (out / ".complete").is_file()
    assert sorted(p.name for p in cache.iterdir()) == sorted([out.name, other.name, f".{out.name}.lock"])
