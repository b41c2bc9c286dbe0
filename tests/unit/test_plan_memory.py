"""The memory planner's formulas on hand-computed numbers, its fits / does-not-fit verdict and suggestion,
its refusal of impossible layouts, and the per-rank placement of the dry run."""

from __future__ import annotations

import dataclasses

import pytest

from dapo_megatron import config as C
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.planning import memory as M
from tests.conftest import assert_import_is_light
from tests.model_configs import small_model_config

# h 64, 4 heads of 16, 2 query groups, FFN 128, vocab 128 (no padding), bf16, Transformer Engine layers.
SMALL = small_model_config(
    num_layers=4,
    vocab_size=128,
    params_dtype="bfloat16",
    transformer_impl="auto",
)


def test_layer_activations_per_token_by_hand() -> None:
    # b = 2 bytes. Norm inputs/outputs 4h = 256 -> 512 B (replicated without SP, / TP with it). Inside TP:
    # Q,K,V (4 + 2*2) * 16 = 128, attention output 64, SwiGLU in + out 3 * 128 = 384:
    # 576 * 2 B / TP 2 = 576 B. Log-sum-exp: 4 B * 4 heads / TP 2 = 8 B.
    assert M.layer_activation_bytes(SMALL, tp=2, sequence_parallel=False) == 512 + 576 + 8
    assert M.layer_activation_bytes(SMALL, tp=2, sequence_parallel=True) == 256 + 576 + 8
    assert M.recompute_unit_input_bytes(SMALL, tp=2, sequence_parallel=False) == 128
    assert M.recompute_unit_input_bytes(SMALL, tp=2, sequence_parallel=True) == 64


def test_stage_activations_with_pipeline_and_recompute_by_hand() -> None:
    full_layer, unit_input, tokens = 1096, 128, 10
    base = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    kwargs = dict(tokens_per_micro_batch=tokens, micro_batches=4, logprob_chunk_size=1024)
    # Stage 0 of 2 holds 2 layers and 2 micro-batches in flight (1F1B); it has no logits.
    first = M.activation_bytes(SMALL, base, pp_rank=0, **kwargs)
    assert (first.in_flight, first.layers, first.logits) == (2, tokens * 2 * 2 * full_layer, 0)
    # Full recompute, one layer per unit: each micro-batch keeps 2 unit inputs; backward reruns one layer.
    recompute = dataclasses.replace(base, recompute_granularity="full")
    assert M.activation_bytes(SMALL, recompute, pp_rank=0, **kwargs).layers == tokens * (
        2 * 2 * unit_input + full_layer
    )
    # Block method with 1 layer: the first layer is checkpointed, the second keeps everything.
    block = dataclasses.replace(recompute, recompute_method="block")
    assert M.activation_bytes(SMALL, block, pp_rank=0, **kwargs).layers == tokens * (
        2 * (unit_input + full_layer) + full_layer
    )
    # The last stage: one micro-batch in flight, plus bf16 logits and their gradient over its 64-column vocab
    # shard (2 * 10 * 64 * 2 B) and the log-prob kernel's two fp32 chunks (2 * 10 * 64 * 4 B).
    last = M.activation_bytes(SMALL, base, pp_rank=1, **kwargs)
    assert (last.in_flight, last.layers, last.logits) == (1, tokens * 2 * full_layer, 2560 + 5120)


def test_state_bytes_of_one_replica_by_hand() -> None:
    one_layer = dataclasses.replace(SMALL, num_layers=1)
    # Embedding 128x64 = 8192; QKV 128x64 + bias 128; projection 64x64; FC1 256x64; FC2 64x128; two norms of
    # 64 (fused into TE's linears, bf16); final norm 64; output layer 8192: 53568 parameters.
    numel = 8192 + 8192 + 128 + 4096 + 16384 + 8192 + 2 * 64 + 64 + 8192
    assert numel == one_layer.num_parameters()
    [state] = M.stage_state_bytes(one_layer, ParallelConfig(), dp=1, pp_rank=0)
    assert state == M.StateBytes(
        parameters=2 * numel, gradients=4 * numel, main_parameters=4 * numel, moments=8 * numel
    )  # ZeRO's mixed-precision Adam: 2 + 4 + 12 bytes per parameter


@pytest.mark.parametrize("tied", [False, True])
def test_stages_and_tensor_shards_add_up_to_the_model(tied: bool) -> None:
    model = dataclasses.replace(SMALL, tie_word_embeddings=tied)
    # Both TP ranks hold half of every matrix and a full copy of every norm; PP 2 with tied embeddings keeps
    # a second copy of the embedding on the last stage.
    norms = (2 * model.num_layers + 1) * model.hidden_size
    shards = [sum(p.numel for p in M.stage_parameters(model, tp=2, pp=2, pp_rank=stage)) for stage in (0, 1)]
    extra_copy = model.vocab_size * model.hidden_size if tied else 0
    assert 2 * sum(shards) == model.num_parameters() + extra_copy + norms


def test_distributed_optimizer_partitions_the_padded_buffers_over_data_parallel() -> None:
    parallel = ParallelConfig(use_distributed_optimizer=True)
    plain = M.stage_state_bytes(SMALL, ParallelConfig(), dp=3, pp_rank=0)[0]
    sharded = M.stage_state_bytes(SMALL, parallel, dp=3, pp_rank=0)
    # Every trained element is owned by exactly one DP rank (ZeRO-1), so the shards add up to the whole.
    assert sum(s.moments for s in sharded) == plain.moments
    assert sum(s.main_parameters for s in sharded) == plain.main_parameters
    [buffer] = M.grad_buffers(
        M.stage_parameters(SMALL, tp=1, pp=1, pp_rank=0), dp=3, distributed_optimizer=True, bucket_size=None
    )
    assert buffer.numel % (3 * 128) == 0 and buffer.numel >= sum(buffer.param_numels)
    assert sharded[0].gradients == 4 * buffer.numel > plain.gradients


def test_engine_weights_and_kv_cache_by_hand() -> None:
    model = C.load(["model=qwen2.5-32b"]).model
    # Engine TP 1 holds the whole bf16 model (Qwen's vocab needs no padding to 64).
    assert M.engine_weight_bytes(model, engine_tp=1, dtype="bfloat16") == 2 * model.num_parameters()
    # K and V, 64 layers, 8 KV heads of 128 over engine TP 8: 2 * 64 * 1 * 128 * 2 B.
    assert M.kv_bytes_per_token(model, engine_tp=8, dtype="bfloat16") == 32768
    seven = C.load(["model=qwen2.5-7b"]).model  # 4 KV heads over 8 ranks: each rank keeps one (replicated)
    assert M.kv_bytes_per_token(seven, engine_tp=8, dtype="bfloat16") == 2 * 28 * 1 * 128 * 2


def job(*overrides: str) -> C.JobConfig:
    return C.to_job_config(C.compose(["experiment=dapo_qwen2.5_32b", *overrides]))


def test_the_32b_recipe_fits_and_an_unsharded_layout_does_not() -> None:
    assert M.plan_memory(job()).fits
    crowded = job(
        "parallel.use_distributed_optimizer=false",
        "parallel.overlap_param_gather=false",
        "parallel.recompute_granularity=none",
    )
    plan = M.plan_memory(crowded)
    assert not plan.fits
    assert any(problem.startswith("training needs") for problem in plan.problems)


def test_suggested_layout_fits_when_applied_as_overrides() -> None:
    overrides = [
        "parallel.tensor_model_parallel_size=4",
        "parallel.use_distributed_optimizer=false",
        "parallel.overlap_param_gather=false",
    ]
    assert not M.plan_memory(job(*overrides)).fits
    changes, plan = M.suggest_layout(job(*overrides))
    assert plan.fits and 0 < len(changes) <= M.MAX_SUGGESTED_CHANGES
    # The suggestion, typed back in as Hydra overrides, is a valid layout that fits.
    applied = job(
        *overrides, *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())
    )
    M.validate_for_cluster(applied)
    assert M.plan_memory(applied).fits


def test_micro_batches_are_sized_by_the_padded_longest_row() -> None:
    # FP8 at TP 8 with sequence parallelism pads micro-batches to a multiple of 128, so a 300-token rollout
    # trains as 384 tokens. DP 16 ranks share 32 prompts x 16 samples: 32 sequences each per optimizer step.
    short = ("model.fp8.enabled=true", "rollout.max_prompt_length=100", "rollout.max_response_length=200")
    # Two full-length rows per micro-batch: 768 tokens computed, 16 micro-batches.
    fixed = job(*short, "trainer.max_tokens_per_micro_batch=null", "trainer.micro_batch_size=2")
    assert M.micro_batching(fixed) == (768, 16)
    plan = M.plan_memory(fixed)
    assert (plan.tokens_per_micro_batch, plan.micro_batches) == (768, 16)
    # A 1000-token budget holds two 384-token rows (not three 300-token ones): 16 micro-batches of at most
    # 1000 tokens.
    assert M.micro_batching(job(*short, "trainer.max_tokens_per_micro_batch=1000")) == (1000, 16)
    # In bf16 the multiple is 8: 304 tokens a row, three rows fit 1000, 11 micro-batches.
    assert M.micro_batching(job(*short[1:], "trainer.max_tokens_per_micro_batch=1000")) == (1000, 11)


def test_a_full_kv_cache_is_a_problem() -> None:
    plan = M.plan_memory(job("rollout.mem_fraction_static=0.2"))
    assert plan.kv_tokens < plan.sequence_tokens and not plan.fits
    assert "KV cache" in plan.problems[-1]


def test_report_says_when_the_kv_cache_cannot_hold_every_concurrent_request() -> None:
    from dapo_megatron.planning.report import format_plan

    plan = M.plan_memory(job())
    held = plan.kv_tokens // plan.sequence_tokens
    assert (
        1 <= held < job().rollout.max_concurrent_requests
    )  # the 32B recipe: 33 full-length rollouts per engine
    assert "rollout.max_concurrent_requests=64 at full length would need" in format_plan(job(), plan)
    # No note where every concurrent request fits at full length.
    enough = job(f"rollout.max_concurrent_requests={held}")
    assert "max_concurrent_requests" not in format_plan(enough, M.plan_memory(enough))


def test_offloading_the_trainer_gives_the_engine_the_whole_gpu() -> None:
    """With trainer.offload_during_rollout the engine sizes its KV cache against a GPU holding only the
    reserve, and the rollout phase holds nothing of the trainer's; without it, the state stays and the cache
    is sized against what the state leaves (the state before Adam's first step). By hand, 32B recipe."""
    from dapo_megatron.planning.report import format_offload

    offloaded, kept = job(), job("trainer.offload_during_rollout=false")
    assert offloaded.trainer.offload_during_rollout
    plan, plan_kept = M.plan_memory(offloaded), M.plan_memory(kept)
    model, weights = offloaded.model, dict(plan.rollout_alternative.items)["engine weights"]
    per_token = M.kv_bytes_per_token(model, engine_tp=4, dtype="bfloat16")
    free = int(80 * M.GIB) - int(4 * M.GIB)
    assert plan.kv_tokens == (int(0.8 * free) - weights) // per_token
    assert plan_kept.kv_tokens == (int(0.8 * (free - plan.state.before_first_step)) - weights) // per_token
    assert (plan.kv_tokens_alternative, plan_kept.kv_tokens_alternative) == (
        plan_kept.kv_tokens,
        plan.kv_tokens,
    )
    rollout = dict(plan.phases[1].items)
    assert "parameters" not in rollout and "gradients (fp32 buffers)" in dict(plan_kept.phases[1].items)
    assert plan_kept.phases[1].total - plan.phases[1].total == plan.state.total - (
        rollout["engine KV cache"] - dict(plan_kept.phases[1].items)["engine KV cache"]
    )
    # The moves: the whole state each way, at the assumed host link speed.
    assert (
        plan.offload_bytes
        == plan.state.total
        == plan.state.parameters + plan.state.gradients + (plan.state.optimizer)
    )
    assert plan.offload_seconds == pytest.approx(plan.state.total / 25e9)
    assert "~1.1 s each way at 25 GB/s" in format_offload(plan)
    assert "19 full-length rollouts" in format_offload(plan)
    assert "33 full-length rollouts" in format_offload(plan_kept)


def test_the_32b_recipe_holds_at_least_half_its_concurrent_rollouts_at_full_length() -> None:
    """`kv_rollouts_held_vs_concurrency_32b` (bench/RESULTS.md): 33/64 with the trainer offloaded; the same
    engines without the offload hold 19, and the recipe before it (0.7 of the memory the state left, 256
    requests per engine) held 15/256."""
    plan = M.plan_memory(job())
    assert plan.held_vs_concurrency >= 0.5
    assert (plan.rollouts_held, plan.concurrent_rollouts) == (33, 64)
    assert M.plan_memory(job("trainer.offload_during_rollout=false")).rollouts_held == 19
    before = M.plan_memory(
        job(
            "trainer.offload_during_rollout=false",
            "rollout.mem_fraction_static=0.7",
            "rollout.max_concurrent_requests=256",
        )
    )
    assert (before.rollouts_held, before.concurrent_rollouts) == (15, 256)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.tensor_model_parallel_size=3", "parallel.tensor_model_parallel_size=3"),
        ("parallel.pipeline_model_parallel_size=3", "parallel.pipeline_model_parallel_size=3"),
        ("rollout.engine_tp_size=3", "rollout.engine_tp_size=3"),
        ("parallel.recompute_num_layers=3", "parallel.recompute_num_layers=3"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(C.ConfigError, match=field.replace(".", r"\.")):
        M.validate_for_cluster(job(override))


def test_plan_memory_tool_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.plan_memory import main

    assert main(["experiment=dapo_qwen2.5_32b"]) == 0
    assert "fits: peak" in capsys.readouterr().out
    assert main(["experiment=dapo_qwen2.5_32b", "parallel.tensor_model_parallel_size=3"]) == 2
    assert "parallel.tensor_model_parallel_size=3" in capsys.readouterr().err


def test_rank_placement_follows_megatron_order() -> None:
    from dapo_megatron.planning.report import rank_placements

    placed = rank_placements(
        job(
            "cluster.nodes=2",
            "cluster.gpus_per_node=4",
            "parallel.tensor_model_parallel_size=2",
            "parallel.pipeline_model_parallel_size=2",
            "rollout.engine_tp_size=2",
        )
    )
    # tp-cp-ep-dp-pp: rank = tp + TP * (dp + DP * pp), with TP = PP = DP = 2.
    for p in placed:
        assert p.rank == p.tp_rank + 2 * (p.dp_rank + 2 * p.pp_rank)
        assert (p.node, p.local_rank, p.engine) == (p.rank // 4, p.rank % 4, p.rank // 2)
        assert (p.first_layer, p.last_layer) == (32 * p.pp_rank, 32 * p.pp_rank + 31)
    assert len({(p.tp_rank, p.pp_rank, p.dp_rank) for p in placed}) == 8


def test_memory_module_imports_no_torch() -> None:
    assert_import_is_light("dapo_megatron.planning.memory", ("torch", "megatron", "sglang"))


# ------------------------------------------------------------------------------ checkpoint, contexts, stop


def test_optimizer_checkpoint_bytes_per_element() -> None:
    from dapo_megatron.planning.checkpoint import optimizer_bytes_per_element

    # Adam's two fp32 moments, plus the fp32 main parameter of a 16-bit parameter; the distributed optimizer
    # stores a main parameter for fp32 parameters too (a view of the parameter, under its own key).
    assert optimizer_bytes_per_element("bfloat16", distributed=False) == 12
    assert optimizer_bytes_per_element("float32", distributed=False) == 8
    assert optimizer_bytes_per_element("float32", distributed=True) == 12
    assert optimizer_bytes_per_element("bfloat16", distributed=True, optimizer="sgd") == 8


def test_stage_checkpoint_by_hand() -> None:
    from dapo_megatron.planning.checkpoint import StageCheckpoint, stage_checkpoint

    one_layer = dataclasses.replace(SMALL, num_layers=1)
    numel, norms = 53568, 3 * 64  # the parameters counted above; TE's two fused norms and the final norm
    # One rank: 2 bytes of bf16 weight and 12 of optimizer state per parameter, all written by it; the largest
    # stored chunk is one of FC1's (256 x 64) fp32 optimizer tensors.
    assert stage_checkpoint(one_layer, ParallelConfig(), dp=1, pp_rank=0) == StageCheckpoint(
        weights=2 * numel, optimizer=12 * numel, written=(14 * numel,), largest_chunk=4 * 16384
    )
    # TP 2: the norms are stored once, by TP rank 0, which also writes its half of every matrix.
    tp2 = stage_checkpoint(one_layer, ParallelConfig(tensor_model_parallel_size=2), dp=1, pp_rank=0)
    assert (tp2.weights, tp2.optimizer) == (2 * numel, 12 * numel)
    assert tp2.written == (14 * ((numel - norms) // 2 + norms),)
    # ZeRO-1 at DP 2: the buffer (reverse order, no alignment padding here) is padded to 53632 = 419 x 128
    # and split at 26816: DP rank 0 owns 26816 parameter elements, DP rank 1 the other 26752. Each writes half
    # of the weights and its own optimizer shard: every byte once. FC1 (elements 16448-32832) is cut at
    # 26816: DP rank 0's part, 10368 fp32 elements per tensor, is the largest chunk.
    zero1 = stage_checkpoint(one_layer, ParallelConfig(use_distributed_optimizer=True), dp=2, pp_rank=0)
    assert zero1.written == (numel + 12 * 26816, numel + 12 * 26752)
    assert sum(zero1.written) == 14 * numel
    assert zero1.largest_chunk == 4 * 10368


def test_the_32b_checkpoint_is_written_by_every_rank() -> None:
    from dapo_megatron.planning.checkpoint import plan_checkpoint

    plan, n = plan_checkpoint(job()), job().model.num_parameters()
    # Qwen's vocab needs no padding at TP 8 and TE's norms are bf16: 2 + 12 bytes per parameter, 458.7 GB.
    assert (plan.weights, plan.optimizer) == (2 * n, 12 * n)
    assert plan.total == plan.resume_read_bytes == pytest.approx(458.694e9, rel=1e-5)
    # 128 ranks share it evenly (to the distributed optimizer's padding): 3.58 GB each, held in host memory
    # while they save; a node's 8 write 28.7 GB, 14.3 s at 2 GB/s, and read it back in 7.2 s at 4 GB/s.
    assert plan.total / 128 <= plan.written_per_rank == plan.save_host_bytes <= 1.001 * plan.total / 128
    assert plan.written_per_node == 8 * plan.written_per_rank
    assert plan.save_seconds == pytest.approx(plan.written_per_node / 2e9) == pytest.approx(14.34, abs=0.01)
    assert plan.load_seconds == pytest.approx(plan.written_per_node / 4e9) == pytest.approx(7.17, abs=0.01)
    assert plan_checkpoint(job("cluster.storage_write_gb_per_s=4")).save_seconds == plan.save_seconds / 2
    # A load holds one stored chunk: the largest is a TP shard of the embedding, 152064 / 8 x 5120 bf16.
    assert plan.load_host_bytes == 152064 // 8 * 5120 * 2


def test_engine_tp_workers_contexts_are_counted_on_the_gpu_they_open() -> None:
    """rollout.sync_method=tensor: each of an engine's other TP workers opens a CUDA context on the GPU of its
    first rank (cluster.cuda_context_gib each), from the first sync on, in every phase; none for gloo."""
    plan = M.plan_memory(job())
    assert M.foreign_cuda_contexts(job()) == 3  # engine TP 4
    for phase in plan.phases:
        assert dict(phase.items)[M.FOREIGN_CONTEXTS] == 3 * M.GIB // 2, phase.name
    for other in ("rollout.sync_method=distributed", "rollout.engine_tp_size=1"):
        assert all(M.FOREIGN_CONTEXTS not in dict(p.items) for p in M.plan_memory(job(other)).phases)
    # Opened after the engine sized its KV cache: they do not shrink it.
    assert M.plan_memory(job("rollout.sync_method=distributed")).kv_tokens == plan.kv_tokens
    bigger = M.plan_memory(job("cluster.cuda_context_gib=1"))
    assert bigger.phases[1].total - plan.phases[1].total == 3 * M.GIB // 2


def test_the_checkpoint_phase_holds_the_trainer_state_alone() -> None:
    """Between the update and the weight sync the engine's memory is released and there are no
    activations: the trainer's state, the other processes' contexts and the reserve."""
    plan = M.plan_memory(job())
    checkpoint = {phase.name: phase for phase in plan.phases}["checkpoint"]
    assert dict(checkpoint.items) == {
        "parameters": plan.state.parameters,
        "gradients (fp32 buffers)": plan.state.gradients,
        "optimizer (fp32 main params + moments)": plan.state.optimizer,
        M.FOREIGN_CONTEXTS: 3 * M.GIB // 2,
        M.RESERVED: 4 * M.GIB,
    }
    assert checkpoint.total < plan.phases[0].total


def test_stop_lead_by_hand() -> None:
    """The 0.5B recipe on one H100: 32 prompts x 16 rollouts of 1024 + 4096 tokens, 4 optimizer steps (so an
    old log-prob forward pass), no offload."""
    from dapo_megatron.planning.checkpoint import plan_checkpoint
    from dapo_megatron.planning.stop import plan_stop_lead

    small = C.to_job_config(C.compose(["experiment=dapo_qwen2.5_0.5b"]))
    # N = 24 x (896 x 1152 + 896 x 896 + 896 x 9728 + 4864 x 896) + 896 x 151936 = 493,961,216; per rollout
    # of s = 5120: 6 N s + 12 x 24 x 896 x s^2 = 1.51745e13 + 6.7646e12 = 2.19391e13 FLOPs; x 512.
    lead = plan_stop_lead(small, M.plan_memory(small), plan_checkpoint(small))
    assert lead.train_flops == pytest.approx(512 * 2.19391e13, rel=1e-5)
    assert lead.old_log_prob_flops == pytest.approx(lead.train_flops / 3)
    # At 25% of 989 TFLOP/s: 1.49771e16 / 2.4725e14 = 60.57 s.
    assert lead.update_s == pytest.approx(60.57, abs=0.01)
    # Save: 0.494e9 parameters x 14 B = 6.916 GB at 2 GB/s; sync: 0.988 GB at 5 GB/s; margin 120 s.
    assert lead.save_s == pytest.approx(3.458, abs=0.001)
    assert lead.sync_s == pytest.approx(0.1976, abs=0.0001)
    assert lead.state_moves_s == 0
    assert lead.lead_s == pytest.approx(60.57 + 3.458 + 0.1976 + 120, abs=0.01)
    # One optimizer step per rollout step: no old log-prob pass.
    single = C.to_job_config(C.compose(["experiment=dapo_qwen2.5_0.5b", "trainer.ppo_mini_batch_size=32"]))
    assert plan_stop_lead(single, M.plan_memory(single), plan_checkpoint(single)).old_log_prob_flops == 0


def test_the_32b_stop_lead_counts_the_state_moves() -> None:
    from dapo_megatron.planning.checkpoint import plan_checkpoint
    from dapo_megatron.planning.stop import plan_stop_lead

    plan = M.plan_memory(job())
    lead = plan_stop_lead(job(), plan, plan_checkpoint(job()))
    assert lead.state_moves_s == pytest.approx(
        2 * plan.offload_seconds
    )  # back before the update, out in the sync
    assert lead.save_s == plan_checkpoint(job()).save_seconds
    assert lead.update_s > 1800  # 8192 full-length rollouts of 22528 tokens


def test_checkpoint_and_stop_modules_import_no_torch() -> None:
    assert_import_is_light("dapo_megatron.planning.checkpoint", ("torch", "megatron", "sglang"))
    assert_import_is_light("dapo_megatron.planning.stop", ("torch", "megatron", "sglang"))
