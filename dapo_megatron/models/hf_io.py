"""Read and write Hugging Face model directories (safetensors, sharded or not) without transformers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


def read_hf_config(hf_dir: Path | str) -> dict:
    config_file = Path(hf_dir) / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found: pass a Hugging Face model directory")
    return json.loads(config_file.read_text())


def checkpoint_files(hf_dir: Path | str) -> list[Path]:
    """The safetensors files of a Hugging Face directory (one file or an index of shards)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.exists():
        return [hf_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (hf_dir / SINGLE_FILE).exists():
        return [hf_dir / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}; only safetensors checkpoints "
                            "are supported (convert .bin files with transformers' save_pretrained first)")


def load_hf_state(hf_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint, in memory at once (for small models and tests;
    `safetensors_reader` reads one rank's slices)."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(hf_dir):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                state[key] = f.get_tensor(key)
    return state


def save_hf_state(state: Mapping[str, torch.Tensor], out_dir: Path | str, *,
                  max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `model-0000i-of-0000N.safetensors` shards and `model.safetensors.index.json`."""
    out_dir = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.contiguous()
        shard_bytes += size
    total = len(shards)
    weight_map: dict[str, str] = {}
    paths = []
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        paths.append(out_dir / file_name)
    total_size = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_size},
                                                  "weight_map": weight_map}, indent=2))
    return paths


def copy_hf_assets(src_dir: Path | str, out_dir: Path | str) -> list[str]:
    """Copy everything except weights (config, generation config, tokenizer, chat template)."""
    copied = []
    for path in sorted(Path(src_dir).iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name != INDEX_FILE:
            shutil.copy2(path, Path(out_dir) / path.name)
            copied.append(path.name)
    return copied


def prepare_output_dir(out_dir: Path | str, *, force: bool) -> Path:
    """Create `out_dir`; refuse to touch a non-empty one unless `force` (then empty it first)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise FileExistsError(f"{out_dir} already exists and is not empty; pass --force to overwrite it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir
