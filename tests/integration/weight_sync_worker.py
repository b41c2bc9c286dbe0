"""Megatron trainer (any TP x PP, under torchrun) -> weight sync (either `rollout.sync_method`) -> a real
SGLang engine on CPU.

Rank 0 starts an engine on a Hugging Face directory holding *other* random weights, then the trainer
pushes its own. Writes a JSON report from rank 0: log-prob differences before and after each sync,
greedy continuations of both, weight versions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--bucket-kb", type=int, default=64, help="small: the tiny model needs several buckets")
    parser.add_argument("--method", choices=["tensor", "distributed"], default="tensor")
    args = parser.parse_args()
    root = Path(args.dir)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.data import arithmetic, char_tokenizer
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.config import ModelConfig
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.rollout.client import RolloutClient
    from dapo_megatron.rollout.config import RolloutConfig
    from dapo_megatron.rollout.engine import SGLangEngine
    from dapo_megatron.rollout.weight_sync import SYNC_METHODS
    from dapo_megatron.trainer.actor import Actor, PolicyRows
    from dapo_megatron.trainer.config import OptimConfig
    from dapo_megatron.trainer.forward import greedy_generate
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training
    from dapo_megatron.trainer.sync_probe import engine_log_probs, probe_rows

    cfg = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      vocab_size=128, max_position_embeddings=256, params_dtype="float32", transformer_impl="local")
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    layout = initialize(parallel, seed=3)
    rollout = RolloutConfig(max_total_tokens=4096, startup_timeout_s=240)

    engine = None
    if layout.rank == 0:
        hf_dir = root / "engine_start"
        torch.manual_seed(123)  # weights unrelated to the trainer's
        Qwen2ForCausalLM(Qwen2Config(**cfg.to_hf_config(), eos_token_id=char_tokenizer.EOS_ID,
                                     pad_token_id=char_tokenizer.PAD_ID)).save_pretrained(hf_dir)
        char_tokenizer.save(hf_dir)
        engine = SGLangEngine(str(hf_dir), rollout, log_file=root / "engine.log")
        engine.start()
    torch.distributed.barrier()

    model = wrap_for_training(build_gpt_model(cfg, parallel, layout), parallel)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=3e-2, weight_decay=0.0), parallel, cfg)
    actor = Actor(model, optimizer, scheduler, AlgoConfig(), layout, vocab_size=cfg.vocab_size)
    urls = [engine.url] if engine is not None else [None]
    torch.distributed.broadcast_object_list(urls, src=0)
    sync = SYNC_METHODS[args.method](urls, cfg, layout, bucket_bytes=args.bucket_kb * 1024, timeout_s=120)
    client = RolloutClient(urls[0], rollout) if layout.rank == 0 else None

    # Probe: prompts of the demo task followed by fixed continuations; every non-prompt token is scored.
    problems = arithmetic.problems("eval")[:6]
    prompts = [char_tokenizer.encode(p.prompt) for p in problems]
    continuations = [char_tokenizer.encode(f"Answer: {i}{i}") for i in range(len(prompts))]
    probe = probe_rows(prompts, continuations, pad_token_id=char_tokenizer.PAD_ID)
    mask = probe.response_mask

    def engine_log_probs_or_zeros() -> torch.Tensor:
        return engine_log_probs(client, prompts, continuations) if client is not None else torch.zeros_like(mask)

    def max_diff() -> float:
        trainer = actor.compute_log_probs(probe, micro_batch_size=3, temperature=1.0)
        return float(((engine_log_probs_or_zeros() - trainer).abs() * mask).max())

    def greedy_both() -> tuple[list[list[int]], list[list[int]]]:
        mine = greedy_generate(model, prompts, layout, max_new_tokens=8, eos_token_id=char_tokenizer.EOS_ID,
                               pad_token_id=char_tokenizer.PAD_ID, vocab_size=cfg.vocab_size)
        theirs = []
        if client is not None:
            groups = dict(client.stream_groups(enumerate(prompts), n=1, temperature=0.0, max_new_tokens=8,
                                               stop_token_ids=[char_tokenizer.EOS_ID]))
            theirs = [groups[i][0].output_ids for i in range(len(prompts))]
            report["weight_version"] = groups[0][0].weight_version
        return mine, theirs

    report: dict = {}
    report["before_sync"] = max_diff()
    stats = sync.sync(model, "step-0")
    report["after_sync"] = max_diff()
    report["greedy_trainer"], report["greedy_engine"] = greedy_both()

    rows = PolicyRows(tokens=probe.tokens, response_mask=mask, advantages=torch.linspace(-1, 1, len(prompts)))
    before = actor.compute_log_probs(probe, micro_batch_size=3)
    for _ in range(3):
        actor.train_step(rows, micro_batch_size=3)
    report["trainer_change"] = float(((actor.compute_log_probs(probe, micro_batch_size=3) - before).abs() * mask).max())
    report["stale_engine"] = max_diff()
    sync.sync(model, "step-1")
    report["after_second_sync"] = max_diff()
    report["greedy_trainer_2"], report["greedy_engine_2"] = greedy_both()
    sync.close()
    if client is not None:
        report["buckets"] = stats.buckets
        (root / "report.json").write_text(json.dumps(report))
        engine.shutdown()
    torch.distributed.barrier()
    shutdown()


if __name__ == "__main__":
    main()
