"""Convert a megatron-core torch_dist checkpoint (any TP x PP layout it was saved from) into a
Hugging Face Qwen2 directory that `transformers` loads.

    dapo-convert-megatron-to-hf --checkpoint ckpt/run1 --output hf/run1 \
        --hf-config-dir Qwen2.5-7B [--dtype bfloat16] [--max-shard-size-gb 5] [--force]

--checkpoint is a torch_dist directory (`iter_0000100/`) or a checkpoint root with
`latest_checkpointed_iteration.txt`. --hf-config-dir is the base model's directory: its config.json is
kept whole (bos/eos_token_id, rope scaling, ...) with the dtype set to the exported tensors', and its
tokenizer files are copied. Without it the config comes from the checkpoint's dapo_model.json and no
tokenizer is copied.

The checkpoint is read in this one process with torch.distributed.checkpoint (no megatron, no cluster;
optimizer state is skipped), one layer of one parameter at a time, and written shard by shard: memory
peaks at about one shard plus one layer's largest parameter, whatever the model size. Progress goes to
stderr. The directory is written beside --output and renamed into place when complete, so an
interrupted conversion leaves nothing (or the previous export, with --force) under --output.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dapo_megatron.checkpoint import read_model_config, resolve
from dapo_megatron.cli import reports_config_errors
from dapo_megatron.config import ConfigError
from dapo_megatron.models import hf_export, hf_io, hf_mapping
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.torch_dist_reader import TorchDistReader

_DTYPES = {name: dtype for dtype, name in hf_export.DTYPE_NAMES.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="torch_dist directory or checkpoint root")
    parser.add_argument("--output", required=True, help="Hugging Face directory to create")
    parser.add_argument(
        "--hf-config-dir",
        default=None,
        help="base model's HF directory (config.json and tokenizer); recommended",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="dtype of the exported weights (default: as stored)",
    )
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="size of each safetensors shard")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output")
    parser.add_argument("--progress-every-s", type=float, default=5.0, help="seconds between progress lines")
    return parser.parse_args(argv)


def _model_config(directory: Path, base: dict | None) -> ModelConfig:
    if base is not None:
        return ModelConfig.from_hf_config(base)
    saved = read_model_config(directory)
    if saved is None:
        raise ConfigError(
            f"{directory} has no dapo_model.json (not written by this project); pass "
            "--hf-config-dir with the base model's config.json"
        )
    return saved


def _export_dtype(reader: TorchDistReader, requested: str | None) -> torch.dtype:
    if requested is not None:
        return _DTYPES[requested]
    stored = reader.dtypes()
    if len(stored) != 1:
        raise ConfigError(f"the checkpoint mixes dtypes {sorted(map(str, stored))}; pass --dtype")
    return next(iter(stored))


@reports_config_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    try:
        directory = resolve(args.checkpoint)
        out_dir = hf_export.check_output(args.output, force=args.force)
    except (ValueError, FileNotFoundError, FileExistsError) as error:  # wrong paths: the user's to fix
        raise ConfigError(str(error)) from error
    base = hf_io.read_hf_config(args.hf_config_dir) if args.hf_config_dir else None
    model_cfg = _model_config(directory, base)
    reader = TorchDistReader(directory)
    # Every shape is checked against the config before a byte of weights is read.
    hf_mapping.unstack_torch_dist(reader.meta_tensors(), model_cfg)
    dtype = _export_dtype(reader, args.dtype)
    total_tensors, total_bytes = hf_export.stage_totals(model_cfg, dtype)
    print(
        f"converting {directory} -> {out_dir}: {total_tensors} HF tensors, {total_bytes / 2**30:.2f} GiB "
        f"in {hf_export.dtype_name(dtype)}",
        file=sys.stderr,
        flush=True,
    )

    progress = hf_export.Progress(total_tensors, total_bytes, label="convert", every_s=args.progress_every_s)
    with hf_export.staging_dir(out_dir) as staging:
        writer = hf_export.ShardWriter(staging, dtype, int(args.max_shard_size_gb * 2**30), progress=progress)
        for block in reader.blocks():
            for name, tensor in reader.named_tensors(block):
                writer.add_megatron(name, tensor, model_cfg)
        config = hf_export.export_config(base, model_cfg, dtype)
        shards = hf_export.finish_directory(staging, writer.finish(), config, args.hf_config_dir)
        hf_export.publish(staging, out_dir)

    copied = (
        f"config and tokenizer files from {args.hf_config_dir}"
        if args.hf_config_dir
        else "no tokenizer (pass --hf-config-dir to copy one)"
    )
    print(
        f"converted {directory} -> {out_dir}\n"
        f"  {progress.tensors} HF tensors, {model_cfg.num_parameters():,} parameters, "
        f"dtype {hf_export.dtype_name(dtype)}, {len(shards)} safetensors shard(s); {copied}\n"
        f"  took {time.time() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
