#!/usr/bin/env python
"""Convert a megatron-core torch_dist checkpoint (any TP x PP layout it was saved from) into a
Hugging Face Qwen2 directory that `transformers` loads.

    python tools/convert_megatron_to_hf.py --checkpoint ckpt/run1 --output hf/run1 \
        --hf-config-dir Qwen2.5-7B [--dtype bfloat16] [--max-shard-size-gb 5] [--force]

--checkpoint is a torch_dist directory (`iter_0000100/`) or a checkpoint root with
`latest_checkpointed_iteration.txt`. --hf-config-dir supplies config.json and the tokenizer files,
which are copied. The checkpoint is read with torch.distributed.checkpoint in this one process,
without megatron or a cluster; only the model weights are read (optimizer state is skipped).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dapo_megatron.checkpoint import resolve
from dapo_megatron.models import hf_io, hf_mapping
from dapo_megatron.models.config import ModelConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="torch_dist directory or checkpoint root")
    parser.add_argument("--output", required=True, help="Hugging Face directory to create")
    parser.add_argument("--hf-config-dir", required=True, help="HF directory with config.json and tokenizer")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="dtype of the exported weights (default: as stored)")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="size of each safetensors shard")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --output")
    return parser.parse_args(argv)


def read_torch_dist_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint, read in one process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer") and "_extra_state" not in key
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    directory = resolve(args.checkpoint)
    hf_config = hf_io.read_hf_config(args.hf_config_dir)
    model_cfg = ModelConfig.from_hf_config(hf_config)
    out_dir = hf_io.prepare_output_dir(args.output, force=args.force)

    flat = read_torch_dist_weights(directory)
    megatron_state = hf_mapping.unstack_torch_dist(flat, model_cfg)
    del flat
    hf_state = hf_mapping.megatron_state_to_hf(megatron_state, model_cfg)
    if args.dtype is not None:
        hf_state = {name: tensor.to(_DTYPES[args.dtype]) for name, tensor in hf_state.items()}
    shards = hf_io.save_hf_state(hf_state, out_dir, max_shard_bytes=int(args.max_shard_size_gb * 2**30))
    copied = hf_io.copy_hf_assets(args.hf_config_dir, out_dir)
    if args.dtype is not None:
        config_file = out_dir / "config.json"
        config_file.write_text(config_file.read_text().replace(
            f'"torch_dtype": "{hf_config.get("torch_dtype")}"', f'"torch_dtype": "{args.dtype}"'))

    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in hf_state.values()})
    print(f"converted {directory} -> {out_dir}\n"
          f"  {len(hf_state)} HF tensors, {sum(t.numel() for t in hf_state.values()):,} parameters, "
          f"dtype {', '.join(dtypes)}, {len(shards)} safetensors shard(s)\n"
          f"  copied from {args.hf_config_dir}: {', '.join(copied)}\n"
          f"  took {time.time() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
