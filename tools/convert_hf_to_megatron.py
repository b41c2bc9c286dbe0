#!/usr/bin/env python
"""Convert a Hugging Face Qwen2 checkpoint into a megatron-core torch_dist checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --output ckpt/qwen2.5-7b \
        [--tensor-parallel 4] [--pipeline-parallel 2] [--dtype bfloat16] [--force]

torch_dist stores tensors by their global shape, so the result loads under any TP x PP layout; the
conversion therefore runs in one process. --tensor-parallel / --pipeline-parallel name the layout
you plan to train with: it is checked against the model (heads, query groups and layers must divide)
and sets the vocabulary padding, before anything is loaded.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from dapo_megatron.config import ConfigError, JobConfig, validate
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models import hf_io, hf_mapping
from dapo_megatron.models.config import ModelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--output", required=True, help="checkpoint root to create (iter_0000000/ inside)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="TP size you will train with")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="PP size you will train with")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                        help="parameter dtype of the Megatron checkpoint")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --output")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    model_cfg = ModelConfig.from_hf_config(hf_io.read_hf_config(args.hf_dir), params_dtype=args.dtype,
                                           transformer_impl="local", hf_dir=str(args.hf_dir))
    # This process builds the model unsplit; pad the vocab as the target TP will need it (a no-op for
    # power-of-two TP sizes, see ModelConfig.padded_vocab_size).
    model_cfg.make_vocab_size_divisible_by = math.lcm(model_cfg.make_vocab_size_divisible_by, args.tensor_parallel)
    target = ParallelConfig(tensor_model_parallel_size=args.tensor_parallel,
                            pipeline_model_parallel_size=args.pipeline_parallel)
    try:
        validate(JobConfig(model=model_cfg, parallel=target), world_size=target.model_parallel_size)
    except ConfigError as error:
        print(f"error: the target layout does not fit this model: {error}", file=sys.stderr)
        return 2
    out_dir = hf_io.prepare_output_dir(args.output, force=args.force)

    hf_state = hf_io.load_hf_state(args.hf_dir)
    full_state = hf_mapping.hf_to_megatron(hf_state, model_cfg, tensor_parallel_size=args.tensor_parallel)
    del hf_state

    # megatron-core is imported only now: argument and shape errors above come back in a second.
    from dapo_megatron import checkpoint
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import load_full_state

    single = ParallelConfig()
    layout = initialize(single, seed=0)
    model = build_gpt_model(model_cfg, single, layout)
    load_full_state(model, full_state, model_cfg, layout)
    saved = checkpoint.save_model(model, out_dir, step=0, model_cfg=model_cfg, layout=layout)
    shutdown()

    print(f"converted {args.hf_dir} -> {saved}\n"
          f"  model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
          f"{model_cfg.num_attention_heads} heads / {model_cfg.num_query_groups} KV groups, vocab "
          f"{model_cfg.vocab_size} (padded {model_cfg.padded_vocab_size(args.tensor_parallel)}), "
          f"tied embeddings: {model_cfg.tie_word_embeddings}\n"
          f"  {len(full_state)} Megatron tensors, {model_cfg.num_parameters():,} parameters, {args.dtype}\n"
          f"  checked for tp {args.tensor_parallel} x pp {args.pipeline_parallel}; loads under any layout\n"
          f"  took {time.time() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
