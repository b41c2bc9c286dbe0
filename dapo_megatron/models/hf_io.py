"""Read Hugging Face model directories (config, safetensors files, assets) without transformers; writing is
`hf_export`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

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
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}; only safetensors checkpoints "
        "are supported (convert .bin files with transformers' save_pretrained first)"
    )


def load_hf_state(hf_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint, in memory at once (for small models and tests;
    `safetensors_reader` reads one rank's slices)."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(hf_dir):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                state[key] = f.get_tensor(key)
    return state


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
