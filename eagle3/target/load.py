"""The target model handle: where its files are, what shape it has, and its fingerprint (identity by content).

Three kinds of target all end up as one HF-style directory (config.json, safetensors, tokenizer):
  hf    a transformers directory, used as is;
  gguf  a GGUF file, converted once into a cached fp32 safetensors directory;
  tiny  a random tiny Llama, Qwen3 or DeepSeek-V3 with a locally built tokenizer (tests, CI).
Most stages need only the config and tokenizer; the trainer needs single tensors (embeddings,
lm_head), which ``read_tensor`` takes from sharded safetensors through the index without
loading the model (eagle3.target.tensors hands them to the drafter). Run
``python -m eagle3.target.load --preset smollm2-demo`` for the tokenizer report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig, TargetConfig
from eagle3.run.paths import resolve_path
from infra.locks import file_lock
from infra.storage import atomic_write_json, sha256_file_cached, sha256_json

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
CONVERTED_MARKER = ".complete"
"""Written last into a folder converted from a GGUF: JSON naming the GGUF and its sha256 (the folder's identity)."""
EMBED_TENSOR = "model.embed_tokens.weight"
"""The target's input embeddings (the drafter's frozen table; also the lm_head of a target that ties them)."""


class TokenizerMismatchError(ValueError):
    """The end-of-turn text of the chat template does not tokenize to an id the model stops on."""


@dataclass(frozen=True)
class TargetInfo:
    """Shape facts read from config.json (no weights loaded).

    The attention fields are those a Llama-style layer of the same width uses, since the drafter is one:
    for an MLA target (DeepSeek-V3, Kimi-K2) head_dim is v_head_dim, the per-head width of its attention
    output, because its config's head_dim is only the RoPE part of the query/key heads.
    """

    model_dir: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    aux_layer_ids: list[int]
    tie_word_embeddings: bool
    eos_token_ids: list[int]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """[1, N//2-1, N-4] in the output-of-layer convention (0-based layer whose output is taken)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def check_aux_layer_ids(aux: list[int], num_layers: int) -> None:
    """Aux ids must be distinct, ascending and below the last layer.

    The last layer's output is the final hidden state (HF applies the final norm to it, SGLang
    cannot capture it as aux), so id N-1 would silently mean different tensors in different places.
    """
    if any(not 0 <= i < num_layers - 1 for i in aux):
        raise ValueError(
            f"target.aux_layer_ids {aux} out of range: ids must be in [0, {num_layers - 2}] "
            f"for {num_layers} layers (output-of-layer convention; the last layer is the final state)"
        )
    if list(aux) != sorted(set(aux)):
        raise ValueError(
            f"target.aux_layer_ids {aux} must be distinct and ascending"
            f" (a {num_layers}-layer target needs explicit ids if the default repeats)"
        )


def prepare_target(cfg: RunConfig) -> Path:
    """Return the HF directory of the target, converting or building it into the cache once."""
    tcfg = cfg.target
    if tcfg.kind == "hf":
        assert tcfg.path is not None, "TargetConfig requires a path for kinds hf and gguf"
        path = resolve_path(tcfg.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target.path {tcfg.path}: no config.json in {path}")
        return path
    if tcfg.kind == "gguf":
        assert tcfg.path is not None, "TargetConfig requires a path for kinds hf and gguf"
        return convert_gguf(resolve_path(tcfg.path), cfg.target_cache_dir, tcfg.name)
    from eagle3.target.tiny import save_tiny_target

    key = sha256_json({"tiny": tcfg.tiny.model_dump(), "seed": cfg.run.seed})[:12]
    return save_tiny_target(cfg.target_cache_dir / f"{tcfg.name}-{key}", tcfg.tiny, cfg.run.seed)


def convert_gguf(gguf_file: Path, cache_dir: Path, name: str) -> Path:
    """Dequantize a GGUF model once into ``<cache>/<name>-<hash>/`` (fp32 safetensors + tokenizer).

    The cache is shared by runs, so the conversion holds a flock on ``.<name>-<hash>.lock``: a second
    process waits for the first one's result instead of converting too, and whoever holds the lock
    may delete the ``<name>-<hash>.tmp<pid>`` folders that killed conversions left (gigabytes each).
    """
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} not found")
    digest = sha256_file_cached(gguf_file)  # once per process and version of the file (infra.storage)
    out = cache_dir / f"{name}-{digest[:12]}"
    marker = {"gguf": gguf_file.name, "sha256": digest}
    if converted_from(out) == digest:
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{out.name}.lock"):
        if converted_from(out) == digest:  # converted by the process we waited for
            return out
        if (out / CONVERTED_MARKER).is_file():  # converted before the marker named the GGUF's sha256
            atomic_write_json(out / CONVERTED_MARKER, marker)
            return out
        remove_conversion_temps(out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        _write_gguf_as_hf(gguf_file, tmp)
        atomic_write_json(tmp / CONVERTED_MARKER, marker)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


def remove_conversion_temps(out: Path) -> list[Path]:
    """Delete the ``<out>.tmp<pid>`` folders of earlier conversions into ``out`` (call only under its lock)."""
    pattern = re.compile(re.escape(out.name) + r"\.tmp\d+")
    stale = sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def converted_from(folder: Path) -> str | None:
    """The sha256 of the GGUF file ``folder`` was converted from (its marker), or None for any other folder."""
    try:
        doc = json.loads((Path(folder) / CONVERTED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    digest = doc.get("sha256") if isinstance(doc, dict) else None
    return digest if isinstance(digest, str) else None


def _write_gguf_as_hf(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are plain fp32 after dequantization; the GGUF quantizer marker only blocks saving.
    model.hf_quantizer = None  # type: ignore[assignment]  # undeclared on the model class: typed as a submodule
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _make_loadable_by_transformers4(out)


def _make_loadable_by_transformers4(out: Path) -> None:
    """transformers 4.x misreads folders written by 5.x (tokenizer class, rope_theta); fix both."""
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.pop("backend", None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    cfg_path = out / "config.json"
    model_cfg = json.loads(cfg_path.read_text())
    theta = (model_cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in model_cfg:
        model_cfg["rope_theta"] = theta
        cfg_path.write_text(json.dumps(model_cfg, indent=2) + "\n")


def _eos_ids(model_dir: Path, model_cfg: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    for source in (json.loads(gen_path.read_text()) if gen_path.is_file() else {}, model_cfg):
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else ([value] if value is not None else [])
    return sorted(set(ids))


def _head_dim(c: dict[str, Any]) -> int:
    """Per-head attention output width: MLA's v_head_dim (kv_lora_rank marks MLA), else head_dim or H / heads."""
    if c.get("kv_lora_rank") and c.get("v_head_dim"):
        return c["v_head_dim"]
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def read_model_config(model_dir: Path | str) -> dict[str, Any]:
    """The target's config.json (the language-model part of a multimodal wrapper, which nests it)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def target_info(model_dir: Path, tcfg: TargetConfig | None = None) -> TargetInfo:
    """Shape facts from config.json; aux ids from the config section or the default."""
    model_dir = Path(model_dir)
    c = read_model_config(model_dir)
    num_layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    aux = (tcfg.aux_layer_ids if tcfg and tcfg.aux_layer_ids else None) or default_aux_layer_ids(num_layers)
    check_aux_layer_ids(aux, num_layers)
    return TargetInfo(
        model_dir=str(model_dir),
        architecture=(c.get("architectures") or ["?"])[0],
        num_layers=num_layers,
        hidden_size=c["hidden_size"],
        vocab_size=c["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=_head_dim(c),
        intermediate_size=c.get("intermediate_size", 0),
        aux_layer_ids=list(aux),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(model_dir, c),
    )


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.gguf")) + sorted(model_dir.glob("*.bin"))


WRITER_VERSION_KEY = "transformers_version"
"""The config.json key naming the transformers version that wrote the folder; not part of a target's identity."""


def fingerprint(model_dir: Path) -> str:
    """Identity of a target by content: config, tokenizer files, chat template and the weights' sha256.

    Two targets with the same config, tokenizer and tensor shapes but other weights differ, and so do the keys
    of every stage that uses the target. The weights are hashed through infra.storage's cache (once per process
    and version of a file, keyed by device, inode, size, mtime and ctime), so a file replaced in place keeping
    its size and mtime is hashed again, and an unchanged one is not. A folder converted from a GGUF
    (``convert_gguf``) stands for the GGUF file, whose sha256 its marker records: the GGUF is what a user
    changes, and its fp32 conversion is many times larger. A tiny target is hashed like any folder (its
    weights are a few megabytes). config.json's ``transformers_version`` (the library that wrote the folder,
    not a property of the model) is left out, so a target converted under another transformers version keeps
    its identity and data generated on one host rebuilds on another.
    """
    base = Path(model_dir).resolve()
    config = json.loads((base / "config.json").read_text())
    config.pop(WRITER_VERSION_KEY, None)
    doc: dict[str, Any] = {"config": config}
    doc["tokenizer"] = {n: sha256_file_cached(base / n) for n in TOKENIZER_FILES if (base / n).is_file()}
    gguf = converted_from(base)
    doc["weights"] = (
        {"gguf_sha256": gguf}
        if gguf is not None
        else [{"name": p.name, "sha256": sha256_file_cached(p)} for p in _weight_files(base)]
    )
    return sha256_json(doc)[:16]


def _tensor_file(model_dir: Path, name: str) -> Path:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        if name not in weight_map:
            raise KeyError(f"tensor {name!r} not in {index}")
        return model_dir / weight_map[name]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    return single


def read_tensor(model_dir: Path, name: str, rows: Any = None):
    """One tensor (optionally a row slice/index) from the target's safetensors, without loading the model."""
    from safetensors import safe_open

    path = _tensor_file(Path(model_dir), name)
    with safe_open(str(path), framework="pt") as fh:
        if name not in fh.keys():  # noqa: SIM118 (safetensors' safe_open has keys() but is not iterable: `in fh` raises)
            raise KeyError(f"tensor {name!r} not in {path}")
        if rows is None:
            return fh.get_tensor(name)
        if isinstance(rows, slice):
            return fh.get_slice(name)[rows]
        return fh.get_tensor(name)[rows]


def lm_head_name(info: TargetInfo) -> str:
    """Name of the output projection (tied models reuse the input embeddings)."""
    return EMBED_TENSOR if info.tie_word_embeddings else "lm_head.weight"


def load_tokenizer(model_dir: Path):
    """The target's tokenizer (fast)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(model_dir: Path, dtype: str = "float32", device: str = "cpu"):
    """The target model in eval mode (only stages that run forwards need this)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in functools.wraps: mypy sees no bound self


def tokenizer_report(tokenizer, info: TargetInfo) -> dict[str, Any]:
    """Special tokens with ids, and the end-of-turn check (raises TokenizerMismatchError on a mismatch)."""
    from eagle3.data.tokenize import end_of_turn_text

    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    special_ids = {name: (tok, tokenizer.convert_tokens_to_ids(tok)) for name, tok in specials.items() if tok}
    eot_text = end_of_turn_text(tokenizer)
    eot_ids = tokenizer.encode(eot_text, add_special_tokens=False)
    stop_ids = sorted(
        set(info.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    )
    report = {
        "special_tokens": {k: {"token": t, "id": i} for k, (t, i) in special_ids.items()},
        "end_of_turn_text": eot_text,
        "end_of_turn_ids": eot_ids,
        "stop_ids": stop_ids,
        "vocab_size_tokenizer": len(tokenizer),
        "vocab_size_model": info.vocab_size,
    }
    if len(eot_ids) != 1 or eot_ids[0] not in stop_ids:
        raise TokenizerMismatchError(
            f"the chat template closes assistant turns with {eot_text!r}, which tokenizes to ids {eot_ids}, "
            f"but the model stops on ids {stop_ids}; generation would not stop where training says it does"
        )
    return report


def stop_token_ids(tokenizer, info: TargetInfo) -> list[int]:
    """Ids the model emits to end a turn: EOS ids plus the template's end-of-turn id."""
    from eagle3.data.tokenize import end_of_turn_text

    ids = set(info.eos_token_ids) | set(tokenizer.encode(end_of_turn_text(tokenizer), add_special_tokens=False))
    return sorted(ids)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.target.load --preset smollm2-demo: prepare the target and print its report."""
    from eagle3.run.cli_args import add_config_args, stage_main

    def run(cfg: RunConfig, args: argparse.Namespace) -> dict[str, Any]:
        model_dir = prepare_target(cfg)
        info = target_info(model_dir, cfg.target)
        return {
            "info": asdict(info),
            "fingerprint": fingerprint(model_dir),
            "tokenizer": tokenizer_report(load_tokenizer(model_dir), info),
        }

    stage_main(add_config_args(argparse.ArgumentParser(description=main.__doc__)), argv, run)


if __name__ == "__main__":
    main()
