"""Convert a Hugging Face Qwen2 checkpoint into a megatron-core torch_dist checkpoint.

    dapo-convert-hf-to-megatron --hf-dir Qwen2.5-7B --output ckpt/qwen2.5-7b \
        [--tensor-parallel 4] [--pipeline-parallel 2] [--dtype bfloat16] [--force]

torch_dist stores tensors by their global shape, so the result loads under any TP x PP layout; the
conversion therefore runs in one process. --tensor-parallel / --pipeline-parallel name the layout
you plan to train with: it is checked against the model (heads, query groups and layers must divide)
and sets the vocabulary padding, before anything is loaded. --dtype defaults to the checkpoint's own,
so a conversion is lossless unless asked otherwise.

The model is never held in memory: each parameter is read from the HF checkpoint, fused, cast and
written, then dropped (models/torch_dist_writer.py), so the peak memory is a few of the largest tensor
whatever the model's size; progress goes to stderr. Training jobs need no conversion: they read each
rank's slices of the HF checkpoint directly (model.hf_dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time

from dapo_megatron import checkpoint
from dapo_megatron.config import ConfigError, JobConfig, validate
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.distributed.layout import initialize, shutdown
from dapo_megatron.models import hf_io
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.safetensors_reader import SafetensorsReader
from dapo_megatron.models.torch_dist_writer import save_hf_as_torch_dist

_DTYPES = ("bfloat16", "float32", "float16")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class ReadProgress:
    """`load_hf_weights`'s progress callback: one line on stderr every `every_s` seconds and at the end."""

    def __init__(self, total_bytes: int, every_s: float = 10.0) -> None:
        self.total_bytes, self.every_s, self.tensors = total_bytes, every_s, 0
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int, bytes_read: int) -> None:
        self.tensors = done
        now = time.monotonic()
        if now - self.last < self.every_s and done < total:
            return
        self.last = now
        rate = bytes_read / max(now - self.started, 1e-9)
        eta = (self.total_bytes - bytes_read) / rate if rate else float("inf")
        print(
            f"read {done}/{total} tensors, {bytes_read / 2**30:.2f}/{self.total_bytes / 2**30:.2f} GiB, "
            f"{rate / 2**20:.0f} MiB/s, ETA {eta:.0f}s, peak memory {peak_rss_bytes() / 2**30:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)"
    )
    parser.add_argument("--output", required=True, help="checkpoint root to create (iter_0000000/ inside)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="TP size you will train with")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="PP size you will train with")
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="parameter dtype of the Megatron checkpoint (default: the HF checkpoint's)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --output")
    return parser.parse_args(argv)


def source_dtype(reader: SafetensorsReader, hf_config: dict) -> str:
    """The dtype the HF weights are stored in: the tensors' when they agree, else config.json's."""
    stored = {str(info.dtype).removeprefix("torch.") for info in reader.tensors.values()}
    if len(stored) == 1 and next(iter(stored)) in _DTYPES:
        return next(iter(stored))
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if declared in _DTYPES:
        return declared
    raise ValueError(
        f"cannot tell the checkpoint's dtype (tensors: {sorted(stored)}, config.json: "
        f"{declared!r}); pass --dtype"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    hf_config = hf_io.read_hf_config(args.hf_dir)
    with SafetensorsReader(args.hf_dir) as reader:
        total_bytes = sum(math.prod(info.shape) * info.dtype.itemsize for info in reader.tensors.values())
        try:
            dtype = args.dtype or source_dtype(reader, hf_config)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    model_cfg = ModelConfig.from_hf_config(
        hf_config, params_dtype=dtype, transformer_impl="local", hf_dir=str(args.hf_dir)
    )
    # This process builds the model unsplit; pad the vocab as the target TP will need it (a no-op for
    # power-of-two TP sizes, see ModelConfig.padded_vocab_size).
    model_cfg.make_vocab_size_divisible_by = math.lcm(
        model_cfg.make_vocab_size_divisible_by, args.tensor_parallel
    )
    target = ParallelConfig(
        tensor_model_parallel_size=args.tensor_parallel, pipeline_model_parallel_size=args.pipeline_parallel
    )
    try:
        validate(JobConfig(model=model_cfg, parallel=target), world_size=target.model_parallel_size)
    except ConfigError as error:
        print(f"error: the target layout does not fit this model: {error}", file=sys.stderr)
        return 2
    out_dir = hf_io.prepare_output_dir(args.output, force=args.force)

    layout = initialize(ParallelConfig(), seed=0)
    print(
        f"writing {model_cfg.num_parameters() / 1e9:.2f}B parameters in {dtype} to {out_dir}",
        file=sys.stderr,
        flush=True,
    )
    progress = ReadProgress(total_bytes)
    saved = checkpoint.step_dir(out_dir, 0)
    saved.mkdir()
    save_hf_as_torch_dist(args.hf_dir, model_cfg, layout, saved, progress=progress)
    shutdown()
    (saved / checkpoint.MODEL_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2))
    (out_dir / checkpoint.TRACKER_FILE).write_text("0\n")  # last: marks the checkpoint complete

    print(
        f"converted {args.hf_dir} -> {saved}\n"
        f"  model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
        f"{model_cfg.num_attention_heads} heads / {model_cfg.num_query_groups} KV groups, vocab "
        f"{model_cfg.vocab_size} (padded {model_cfg.padded_vocab_size(args.tensor_parallel)}), "
        f"tied embeddings: {model_cfg.tie_word_embeddings}\n"
        f"  {progress.tensors} Megatron tensors, {model_cfg.num_parameters():,} parameters, {dtype}\n"
        f"  checked for tp {args.tensor_parallel} x pp {args.pipeline_parallel}; loads under any layout\n"
        f"  took {time.time() - started:.1f}s, peak memory {peak_rss_bytes() / 2**30:.2f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
