"""Megatron trainer (any TP x PP, under torchrun) -> weight sync (either `rollout.sync_method`) -> real
SGLang engines on CPU.

The first rank of each engine's block (`trainer/placement.py`) starts an engine on a Hugging Face directory
holding *other* random weights, then the trainer pushes its own. Writes a JSON report from rank 0: log-prob
differences before and after each sync (the worst engine), greedy continuations of the trainer and of every
engine, weight versions, which engines served a mixed stream, which ranks received relayed buckets.
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
    parser.add_argument(
        "--bucket-kb", type=int, default=64, help="small: the tiny model needs several buckets"
    )
    parser.add_argument("--method", choices=["tensor", "distributed"], default="tensor")
    parser.add_argument("--engines", type=int, default=1)
    args = parser.parse_args()
    root = Path(args.dir)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_megatron import backends
    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.data import arithmetic, char_tokenizer
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.records import PolicyRows
    from dapo_megatron.rollout import engine_auth
    from dapo_megatron.rollout.client import RolloutClient
    from dapo_megatron.rollout.config import RolloutConfig
    from dapo_megatron.rollout.engine import SGLangEngine
    from dapo_megatron.rollout.weight_sync import SYNC_METHODS
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.config import OptimConfig
    from dapo_megatron.trainer.forward import greedy_generate
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training
    from dapo_megatron.trainer.placement import engine_placement
    from dapo_megatron.trainer.sync_probe import engine_log_probs, probe_rows
    from tests.model_configs import small_model_config

    cfg = small_model_config(
        num_layers=4,
        vocab_size=128,
        max_position_embeddings=256,
        params_dtype="float32",
        transformer_impl="local",
    )
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    layout = initialize(parallel, seed=3)
    rollout = RolloutConfig(max_total_tokens=4096, startup_timeout_s=240, num_engines=args.engines)
    placement = engine_placement(layout.world_size, rollout, backends.CPU)

    hf_dir = root / "engine_start"
    if layout.rank == 0:
        torch.manual_seed(123)  # weights unrelated to the trainer's
        Qwen2ForCausalLM(
            Qwen2Config(
                **cfg.to_hf_config(), eos_token_id=char_tokenizer.EOS_ID, pad_token_id=char_tokenizer.PAD_ID
            )
        ).save_pretrained(hf_dir)
        char_tokenizer.save(hf_dir)
    torch.distributed.barrier()
    engine = None
    index = placement.owns(layout.rank)
    if index is not None:
        engine = SGLangEngine(str(hf_dir), rollout, log_file=root / f"engine{index}.log")
        engine.start()
    gathered: list = [None] * layout.world_size
    torch.distributed.all_gather_object(gathered, engine.record() if engine is not None else None)
    records = [record for record in gathered if record is not None]
    for record in records:  # every rank may talk to every engine
        engine_auth.register(record.url, record.api_key)
    urls = [record.url for record in records]

    model = wrap_for_training(build_gpt_model(cfg, parallel, layout), parallel)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=3e-2, weight_decay=0.0), parallel, cfg)
    actor = Actor(model, optimizer, scheduler, AlgoConfig(), layout, vocab_size=cfg.vocab_size)
    sync = SYNC_METHODS[args.method](
        urls,
        cfg,
        layout,
        bucket_bytes=args.bucket_kb * 1024,
        timeout_s=120,
        engine_owners=[placement.owner(e) for e in range(placement.num_engines)],
    )
    client = RolloutClient(urls, rollout) if layout.rank == 0 else None

    # Probe: prompts of the demo task followed by fixed continuations; every non-prompt token is scored.
    problems = arithmetic.problems("eval")[:6]
    prompts = [char_tokenizer.encode(p.prompt) for p in problems]
    continuations = [char_tokenizer.encode(f"Answer: {i}{i}") for i in range(len(prompts))]
    probe = probe_rows(prompts, continuations, pad_token_id=char_tokenizer.PAD_ID)
    mask = probe.response_mask

    def diffs() -> list[float]:
        """|engine - trainer| log-prob per engine."""
        trainer = actor.compute_log_probs(probe, micro_batch_size=3, temperature=1.0)
        if client is None:
            return []
        return [
            float(((engine_log_probs(client, prompts, continuations, engine=e) - trainer).abs() * mask).max())
            for e in range(len(urls))
        ]

    def greedy_all() -> tuple[list[list[int]], list[list[list[int]]]]:
        """The trainer's greedy continuations, and each engine's."""
        mine = greedy_generate(
            model,
            prompts,
            layout,
            max_new_tokens=8,
            eos_token_id=char_tokenizer.EOS_ID,
            pad_token_id=char_tokenizer.PAD_ID,
            vocab_size=cfg.vocab_size,
        )
        theirs = []
        for url in urls if client is not None else []:
            with RolloutClient(url, rollout) as one:
                groups = dict(
                    one.stream_groups(
                        enumerate(prompts),
                        n=1,
                        temperature=0.0,
                        max_new_tokens=8,
                        stop_token_ids=[char_tokenizer.EOS_ID],
                    )
                )
            theirs.append([groups[i][0].output_ids for i in range(len(prompts))])
            report["weight_version"] = groups[0][0].weight_version
        return mine, theirs

    report: dict = {}
    report["before_sync"] = diffs()
    stats = sync.sync(model, "step-0")
    report["after_sync"] = diffs()
    report["greedy_trainer"], report["greedy_engines"] = greedy_all()
    if client is not None:  # one stream over all engines: each group goes to the least busy one
        samples = [
            s
            for _, group in client.stream_groups(enumerate(prompts * 4), n=2, max_new_tokens=8)
            for s in group
        ]
        report["engines_used"] = sorted({s.engine for s in samples})
        report["urls"] = urls
    relayed = [rank for route in sync.routes for rank in route.relayed]

    rows = PolicyRows(tokens=probe.tokens, response_mask=mask, advantages=torch.linspace(-1, 1, len(prompts)))
    before = actor.compute_log_probs(probe, micro_batch_size=3)
    for _ in range(3):
        actor.train_step(rows, micro_batch_size=3)
    report["trainer_change"] = float(
        ((actor.compute_log_probs(probe, micro_batch_size=3) - before).abs() * mask).max()
    )
    report["stale_engine"] = diffs()
    sync.sync(model, "step-1")
    report["after_second_sync"] = diffs()
    report["greedy_trainer_2"], report["greedy_engines_2"] = greedy_all()
    sync.close()
    buckets: list = [None] * layout.world_size  # every rank that pushed into an engine
    torch.distributed.all_gather_object(buckets, stats.buckets)
    if client is not None:
        report["buckets"] = max(buckets)
        report["relayed_to"] = relayed
        (root / "report.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    if engine is not None:
        engine.shutdown()
    shutdown()


if __name__ == "__main__":
    main()
