"""The memory planner's formulas on hand-computed numbers, its fits / does-not-fit verdict and suggestion,
its refusal of impossible layouts, and the per-rank placement of the dry run."""

from __future__ import annotations

import dataclasses

import pytest

from dapo_megatron import config as C
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.planning import memory as M
from tests.conftest import assert_import_is_light

# h 64, 4 heads of 16, 2 query groups, FFN 128, vocab 128 (no padding), bf16, Transformer Engine layers.
SMALL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
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
