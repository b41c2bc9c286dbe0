"""Starting from Hugging Face weights at TP2 x PP2, each rank reads its own slices of the checkpoint, not all of
it, and its memory grows by about one parameter while it loads (a ~420 MB fp32 model; 32B runs read ~65 GB
of bf16 otherwise on every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("hf_sliced_load_worker.py")
pytestmark = pytest.mark.distributed
MiB = 2**20


def write_random_hf_checkpoint(out_dir: Path, **overrides: object) -> dict[str, int]:
    """A random Qwen2 as a sharded HF safetensors directory (hidden 1024, 8 layers, vocab 16000 by default);
    returns each tensor's size in bytes."""
    from dapo_megatron.models import hf_io, hf_mapping
    from dapo_megatron.models.config import ModelConfig

    fields: dict[str, object] = dict(num_layers=8, hidden_size=1024, ffn_hidden_size=2048, num_attention_heads=16,
                                     num_query_groups=4, vocab_size=16000, max_position_embeddings=256,
                                     params_dtype="float32")
    cfg = ModelConfig(**{**fields, **overrides})
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg.params_dtype)
    state = {name: torch.randn(shape, generator=generator).to(dtype) * 0.02
             for name, shape in hf_mapping.hf_param_shapes(cfg).items()}
    out_dir.mkdir(parents=True)
    hf_io.save_hf_state(state, out_dir, max_shard_bytes=160 * MiB)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    return {name: tensor.numel() * tensor.element_size() for name, tensor in state.items()}


def test_each_rank_reads_only_its_slices(tmp_path: Path) -> None:
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    sizes = write_random_hf_checkpoint(hf_dir)
    out.mkdir()
    torchrun(WORKER, 4, "--hf-dir", str(hf_dir), "--tp", "2", "--pp", "2", "--out", str(out))

    checkpoint_bytes, largest_tensor = sum(sizes.values()), max(sizes.values())
    for rank in range(4):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["checked"] > 0 and report["mismatched"] == [], report
        # Every byte the process read while loading (rchar counts all read syscalls), against the bytes of
        # its parameters; one tensor of slack covers the file headers. Pages read through a memory map are
        # not in rchar; they count towards RSS, which the last check bounds.
        assert report["rchar"] <= report["shard_bytes"] + largest_tensor, report
        assert report["bytes_read"] <= report["rchar"]
        assert report["rchar"] < checkpoint_bytes / 2, report
        # While loading, a rank holds one parameter's HF slices and its assembled shard at a time.
        assert report["peak_rss_growth"] <= 2 * report["largest_param_bytes"] + 64 * MiB, report
