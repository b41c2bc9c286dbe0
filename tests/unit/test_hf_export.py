"""The pieces of a Hugging Face export: shards that safetensors reads back, config.json completed from the
base model's, and atomic publication."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dapo_megatron.models import hf_export
from dapo_megatron.models.config import ModelConfig
from tests.model_configs import small_model_config

CFG = small_model_config(
    hidden_size=32,
    ffn_hidden_size=48,
    vocab_size=100,
    params_dtype="float32",
)


def read_all(out_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(out_dir / file, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    assert {name: index["weight_map"][name] for name in tensors} == index["weight_map"]
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shards_read_back_by_safetensors(tmp_path: Path, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(12, 8, generator=generator)
    tensors = {
        "a": torch.randn(40, 8, generator=generator),
        "scalar": torch.tensor(3.5),
        "q": fused[:6],
        "k": fused[6:].t(),
        "bias": torch.randn(5, generator=generator),
    }
    progress = hf_export.Progress(len(tensors), 0, stream=io.StringIO(), every_s=0)
    # 40x8 floats is 1280 bytes in fp32: with a 1024-byte limit "a" gets a shard of its own.
    writer = hf_export.ShardWriter(
        tmp_path, dtype, max_shard_bytes=1024 // (4 // dtype.itemsize), progress=progress
    )
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    parts = writer.finish()
    assert [part.names for part in parts] == [["a"], ["scalar", "q", "k", "bias"]]
    hf_export.write_index(tmp_path, parts)
    back = read_all(tmp_path)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor.to(dtype)), name
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() for t in tensors.values()) * dtype.itemsize
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert progress.tensors == len(tensors)


def test_writer_copies_views_instead_of_holding_their_base(tmp_path: Path) -> None:
    big = torch.zeros(1000, 10)
    writer = hf_export.ShardWriter(tmp_path, torch.float32)
    writer.add("rows", big[:3])
    held = writer._pending["rows"]
    assert held.untyped_storage().nbytes() == 3 * 10 * 4, "a view keeps its whole base tensor alive"
    with pytest.raises(ValueError, match="written twice"):
        writer.add("rows", big[:3])


def test_config_keeps_the_base_fields_and_takes_the_tensors_dtype() -> None:
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "rope_scaling": {"type": "yarn", "factor": 4.0},
        "dtype": "float32",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "tie_word_embeddings": False,
        "sliding_window": None,
    }
    config = hf_export.export_config(base, CFG, torch.bfloat16)
    assert config == {**base, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert base["dtype"] == "float32", "the caller's dict is not modified"

    older = {key: value for key, value in base.items() if key != "dtype"} | {"torch_dtype": "bfloat16"}
    assert hf_export.export_config(older, CFG, torch.float32) == {**older, "torch_dtype": "float32"}

    # Shapes come from the weights being written, whatever the base says.
    assert hf_export.export_config({**base, "vocab_size": 7}, CFG, torch.float32)["vocab_size"] == 100


def test_config_without_a_base_describes_the_model() -> None:
    config = hf_export.export_config(None, CFG, torch.float16)
    assert config == {**CFG.to_hf_config(), "torch_dtype": "float16"}
    assert ModelConfig.from_hf_config(config).hidden_size == CFG.hidden_size


def test_a_failed_export_leaves_the_previous_one_and_no_staging(tmp_path: Path) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_text("previous")
    with pytest.raises(RuntimeError, match="disk full"), hf_export.staging_dir(out) as staging:
        (staging / "model-00001-of-00002.safetensors").write_text("half")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (out / "model.safetensors").read_text() == "previous"

    with hf_export.staging_dir(out) as staging:
        (staging / "model.safetensors").write_text("new")
        assert (out / "model.safetensors").read_text() == "previous"
        hf_export.publish(staging, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "new"


def test_staging_left_by_a_killed_export_is_removed(tmp_path: Path) -> None:
    out = tmp_path / "export"
    dead = tmp_path / "export.tmp-999999999"  # above any pid_max, so no such process
    dead.mkdir()
    alive = tmp_path / f"export.tmp-{os.getppid()}"  # another export still running
    alive.mkdir()
    with hf_export.staging_dir(out) as staging:
        assert staging.name == f"export.tmp-{os.getpid()}"
        hf_export.publish(staging, out)
    assert not dead.exists() and alive.exists()


def test_an_export_renamed_aside_by_a_killed_publish_is_restored(tmp_path: Path) -> None:
    out = tmp_path / "export"
    aside = tmp_path / "export.old-999999999"  # killed between publish's two renames
    aside.mkdir()
    (aside / "model.safetensors").write_text("previous")
    with pytest.raises(RuntimeError), hf_export.staging_dir(out):
        raise RuntimeError("this export fails too")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (out / "model.safetensors").read_text() == "previous"

    aside.mkdir()  # with an export in place, a leftover is only removed
    with hf_export.staging_dir(out) as staging:
        hf_export.publish(staging, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_output_is_refused_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert hf_export.check_output(out, force=False) == out
    out.mkdir()
    hf_export.check_output(out, force=False)  # empty: fine
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="--force"):
        hf_export.check_output(out, force=False)
    hf_export.check_output(out, force=True)
    assert (out / "keep.txt").read_text() == "precious", "nothing is removed before the export is complete"


def test_progress_reports_counts_and_eta() -> None:
    stream = io.StringIO()
    progress = hf_export.Progress(4, 4 * 2**30, label="convert", every_s=3600, stream=stream)
    progress.advance(2**30)
    assert stream.getvalue() == "", "lines come every `every_s` seconds"
    for _ in range(3):
        progress.advance(2**30)
    line = stream.getvalue().strip()
    assert line.startswith("convert: 4/4 tensors, 4.00/4.00 GiB") and "ETA 0s" in line


def test_stage_totals_split_the_model() -> None:
    # Per layer: 12 HF tensors, 1024 q + 2 x 512 k/v + 64 biases + 1024 o + 3 x 1536 mlp + 2 x 32 norms = 7808
    # parameters; embedding and lm_head 100 x 32 each, final norm 32.
    assert hf_export.stage_totals(CFG, torch.bfloat16) == (27, 2 * (2 * 7808 + 2 * 3200 + 32))
    assert hf_export.stage_totals(CFG, torch.bfloat16, 2, 0) == (13, 2 * (3200 + 7808))
    assert hf_export.stage_totals(CFG, torch.float32, 2, 1) == (14, 4 * (7808 + 32 + 3200))
