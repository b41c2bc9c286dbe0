"""Each TP rank's shard read as slices of the HF tensors equals the shard of the fully loaded, fused tensor,
and the reader reads no byte the shard does not hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dapo_megatron.models import hf_mapping
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.safetensors_reader import SafetensorsReader
from tests.model_configs import small_model_config

# 4 query groups of 2 heads, so TP 4 gives each rank one group; vocab 250 leaves padding rows on the last
# rank(s) under every TP size.
CFG = small_model_config(
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=250,
    make_vocab_size_divisible_by=64,
    params_dtype="float32",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16)
        for name, shape in hf_mapping.hf_param_shapes(CFG).items()
    }
    hf_dir = tmp_path_factory.mktemp("hf")
    save_file(state, str(hf_dir / "model.safetensors"))
    return hf_dir, state


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_slices_assemble_each_ranks_shard(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tp_size: int
) -> None:
    hf_dir, state = checkpoint
    full = hf_mapping.hf_to_megatron(state, CFG, tensor_parallel_size=tp_size)
    for tp_rank in range(tp_size):
        with SafetensorsReader(hf_dir) as reader:
            header_bytes = reader.bytes_read
            for name in hf_mapping.megatron_param_names(CFG):
                slices = hf_mapping.hf_slices_for_shard(name, CFG, tp_size, tp_rank)
                before = reader.bytes_read
                parts = [reader.read(s.name, s.dim, s.start, s.stop) for s in slices]
                shard = hf_mapping.shard_from_hf_slices(name, parts, CFG, tp_size)
                expected = hf_mapping.shard_for_tensor_parallel(name, full[name], CFG, tp_size, tp_rank)
                assert torch.equal(shard, expected), (name, tp_rank)
                # Only the rows that exist in HF are read: a vocab shard less its padding rows.
                rows = expected.shape[0]
                hf_rows = (
                    min(rows, max(0, CFG.vocab_size - tp_rank * rows))
                    if "word_embeddings" in name or name == "output_layer.weight"
                    else rows
                )
                assert (
                    reader.bytes_read - before == hf_rows * expected[0].numel() * expected.element_size()
                ), name
            assert header_bytes > 8


def test_reader_reads_columns_rows_and_whole_tensors(tmp_path: Path) -> None:
    table = torch.arange(5 * 7 * 3, dtype=torch.float32).reshape(5, 7, 3)
    scalar = torch.tensor(2.5, dtype=torch.float64)
    save_file({"table": table, "scalar": scalar}, str(tmp_path / "model.safetensors"))
    with SafetensorsReader(tmp_path) as reader:
        assert torch.equal(reader.read("table"), table)
        assert torch.equal(reader.read("table", 0, 1, 4), table[1:4])
        assert torch.equal(reader.read("table", 1, 2, 5), table[:, 2:5])
        assert torch.equal(reader.read("table", 2, 1, 2), table[:, :, 1:2])
        assert torch.equal(reader.read("scalar"), scalar)
        with pytest.raises(KeyError, match="'missing' is not in the checkpoint"):
            reader.read("missing")
        with pytest.raises(ValueError, match=r"cannot read \[3:9\] along dim 1"):
            reader.read("table", 1, 3, 9)


def test_wrong_checkpoint_is_named(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    hf_dir, _ = checkpoint
    other = ModelConfig(**{**CFG.__dict__, "ffn_hidden_size": 64})
    with (
        SafetensorsReader(hf_dir) as reader,
        pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight: expected"),
    ):
        hf_mapping.check_hf_shapes(reader.shapes(), other)
