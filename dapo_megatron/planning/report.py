"""What the dry run and `tools/plan_memory.py` print: where every rank sits, the memory plan, the checkpoint
and the time-limit lead.

The dry run (`python -m dapo_megatron.train experiment=... dry_run=true`) validates the config for the
world size of `cluster.*` and prints both, with no GPU, no process group and no weights: the rank
coordinates come from megatron-core's own `RankGenerator` (the order `initialize_model_parallel` uses),
the memory from `planning.memory`'s arithmetic, the checkpoint from `planning.checkpoint`'s and the lead from
`planning.stop`'s.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from dapo_megatron import backends
from dapo_megatron.config import ConfigError, JobConfig
from dapo_megatron.planning.checkpoint import GB, CheckpointPlan, plan_checkpoint
from dapo_megatron.planning.memory import (
    GIB,
    HOST_DEVICE_GB_PER_S,
    MemoryPlan,
    data_parallel_size,
    plan_memory,
    suggest_layout,
    validate_for_cluster,
)
from dapo_megatron.planning.stop import WEIGHT_SYNC_GB_PER_S, StopLead, plan_stop_lead
from dapo_megatron.trainer.placement import engine_placement

MEGATRON_RANK_ORDER = "tp-cp-ep-dp-pp"
"""`parallel_state.initialize_model_parallel`'s default: TP ranks adjacent (inside a node), PP outermost."""


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int
    local_rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    first_layer: int
    last_layer: int
    """Inclusive range of the transformer layers this rank holds (its TP shard of them)."""
    engine: int
    engine_tp_rank: int


def rank_placements(job: JobConfig) -> list[RankPlacement]:
    """Every rank of the planned world: its node, its megatron coordinates, its layers and its engine."""
    from megatron.core.parallel_state import RankGenerator

    par, gpus = job.parallel, job.cluster.gpus_per_node
    tp, pp, dp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, data_parallel_size(job)
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=MEGATRON_RANK_ORDER)
    coordinate: dict[str, dict[int, int]] = {}
    for axis in ("tp", "pp", "dp"):
        coordinate[axis] = {
            rank: index for group in generator.get_ranks(axis) for index, rank in enumerate(group)
        }
    layers = job.model.num_layers // pp
    engines = engine_placement(job.cluster.world_size, job.rollout, backends.CUDA)
    return [
        RankPlacement(
            rank=rank,
            node=rank // gpus,
            local_rank=rank % gpus,
            tp_rank=coordinate["tp"][rank],
            pp_rank=coordinate["pp"][rank],
            dp_rank=coordinate["dp"][rank],
            first_layer=coordinate["pp"][rank] * layers,
            last_layer=(coordinate["pp"][rank] + 1) * layers - 1,
            engine=engines.engine_of(rank),
            engine_tp_rank=rank % engines.ranks_per_engine,
        )
        for rank in range(job.cluster.world_size)
    ]


def format_placements(job: JobConfig, placements: list[RankPlacement]) -> str:
    pp, etp = job.parallel.pipeline_model_parallel_size, job.rollout.engine_tp_size
    lines = []
    for p in placements:
        extras = (" + embedding" if p.pp_rank == 0 else "") + (
            " + final norm, output layer" if p.pp_rank == pp - 1 else ""
        )
        lines.append(
            f"rank {p.rank:>4} | node {p.node:>3} gpu {p.local_rank} | tp {p.tp_rank} pp {p.pp_rank} "
            f"dp {p.dp_rank:>3} | layers {p.first_layer}-{p.last_layer}{extras} | "
            f"engine {p.engine} "
            + (
                f"(engine tp rank {p.engine_tp_rank})"
                if p.engine_tp_rank < etp
                else "(no engine rank on this GPU)"
            )
        )
    return "\n".join(lines)


def describe_layout(job: JobConfig) -> str:
    par, rollout, cluster = job.parallel, job.rollout, job.cluster
    recompute = (
        f"full ({par.recompute_method}, {par.recompute_num_layers} layer(s) per unit)"
        if par.recompute_granularity == "full"
        else "none"
    )
    return (
        f"{job.model.name} on {cluster.nodes} node(s) x {cluster.gpus_per_node} GPU(s) of "
        f"{cluster.gpu_memory_gib:g} GiB = {cluster.world_size} ranks\n"
        f"training: TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x DP "
        f"{data_parallel_size(job)}, sequence parallel {'on' if par.sequence_parallel else 'off'}, "
        f"distributed optimizer {'on' if par.use_distributed_optimizer else 'off'}, recompute {recompute}\n"
        f"rollout: {engine_placement(cluster.world_size, rollout, backends.CUDA).num_engines} SGLang "
        f"engine(s) x TP {rollout.engine_tp_size}, mem_fraction_static {rollout.mem_fraction_static:g}"
    )


def format_plan(job: JobConfig, plan: MemoryPlan) -> str:
    """A table: what one GPU of the busiest rank holds in each phase, against the GPU's memory."""
    par = job.parallel
    names = list(dict.fromkeys(name for phase in plan.phases for name, _ in phase.items))
    width = max(map(len, names)) + 2
    header = f"{'GiB per GPU':<{width}}" + "".join(f"{phase.name:>13}" for phase in plan.phases)
    rows = [header]
    for name in names:
        cells = [dict(phase.items).get(name) for phase in plan.phases]
        rows.append(
            f"{name:<{width}}" + "".join(f"{'-' if c is None else f'{c / GIB:.2f}':>13}" for c in cells)
        )
    rows.append(
        f"{'total of ' + format(plan.capacity / GIB, 'g'):<{width}}"
        + "".join(f"{phase.total / GIB:>13.2f}" for phase in plan.phases)
    )
    rows.append(
        f"{'':<{width}}"
        + "".join(f"{'fits' if phase.total <= plan.capacity else 'TOO BIG':>13}" for phase in plan.phases)
    )
    other = "without" if par.use_distributed_optimizer else "with"
    recompute_other = "without" if par.recompute_granularity == "full" else "with full"
    alternative = plan.state_alternative
    micro = job.trainer.micro_batch_size
    shape = (
        f"up to {plan.tokens_per_micro_batch} tokens (trainer.max_tokens_per_micro_batch)"
        if job.trainer.max_tokens_per_micro_batch
        else f"{micro} sequence(s) x {plan.tokens_per_micro_batch // micro} tokens"
    )
    kv_tokens, held = max(plan.kv_tokens, 0), plan.rollouts_held
    # Not a problem (SGLang admits what fits and most rollouts stop short of the maximum), but past this
    # point a long-response batch generates with fewer requests in flight than configured and retractions
    # recompute.
    queueing = (
        ""
        if kv_tokens >= job.rollout.max_in_flight_tokens
        else f"; rollout.max_concurrent_requests={job.rollout.max_concurrent_requests} at full length would "
        f"need {job.rollout.max_in_flight_tokens} tokens: the engine queues the rest and retracts running "
        "requests when the cache fills"
    )
    return "\n".join(
        [
            f"micro-batch: {shape}, up to {plan.micro_batches} per "
            f"optimizer step and DP rank, {plan.activations.in_flight} in flight",
            f"busiest rank: pipeline stage {plan.pp_rank}, DP rank {plan.dp_rank}",
            *rows,
            f"{other} the distributed optimizer: optimizer {alternative.optimizer / GIB:.2f} GiB, parameters "
            f"{alternative.parameters / GIB:.2f}, gradients {alternative.gradients / GIB:.2f}",
            f"activations {recompute_other} recompute: {plan.activations_alternative.layers / GIB:.2f} GiB",
            f"engine KV cache: {kv_tokens} tokens per engine = {held} full-length "
            f"rollouts ({plan.sequence_tokens} tokens) at once ({held}/{plan.concurrent_rollouts} = "
            f"{plan.held_vs_concurrency:.2f} of the concurrent requests){queueing}; left for SGLang's "
            f"activations and CUDA graphs: {(plan.capacity - plan.phases[1].total) / GIB:.2f} GiB",
            format_offload(plan),
        ]
    )


def format_offload(plan: MemoryPlan) -> str:
    """Where the trainer's state is during rollout, what the other choice would give the engine, and what the
    moves cost."""
    moves = (
        f"{plan.offload_bytes / GIB:.2f} GiB per GPU each way per step, ~{plan.offload_seconds:.1f} s each "
        f"way at {HOST_DEVICE_GB_PER_S:g} GB/s (planning.memory.HOST_DEVICE_GB_PER_S, assumed)"
    )
    other = (
        f"engine KV cache {max(plan.kv_tokens_alternative, 0)} tokens = {plan.rollouts_held_alternative} "
        f"full-length rollouts, rollout phase {plan.rollout_alternative.total / GIB:.2f} GiB"
    )
    if plan.offload:
        return (
            f"trainer state during rollout: in host memory (trainer.offload_during_rollout), {moves}; kept "
            f"on the GPU: {other}"
        )
    return (
        f"trainer state during rollout: on the GPU; in host memory (trainer.offload_during_rollout=true): "
        f"{other}, for {moves}"
    )


def format_checkpoint(checkpoint: CheckpointPlan) -> str:
    """The checkpoint's bytes, who writes them, the host memory a save and a load hold, and their times."""
    total, weights, optimizer = checkpoint.total / GB, checkpoint.weights / GB, checkpoint.optimizer / GB
    per_rank, per_node = checkpoint.written_per_rank / GB, checkpoint.written_per_node / GB
    bandwidths = "cluster.storage_write_gb_per_s and storage_read_gb_per_s, assumed"
    return (
        f"checkpoint: {total:.1f} GB (weights {weights:.1f} + optimizer {optimizer:.1f}), each tensor "
        f"written once, by every rank: {per_rank:.2f} GB per rank, {per_node:.1f} GB per node; host memory "
        f"per rank {checkpoint.save_host_bytes / GIB:.2f} GiB while saving (torch_dist stages what a rank "
        f"writes), {checkpoint.load_host_bytes / GIB:.2f} GiB while loading (one stored chunk at a time); "
        f"save ~{checkpoint.save_seconds:.0f} s at {checkpoint.write_gb_per_s:g} GB/s per node, load "
        f"~{checkpoint.load_seconds:.0f} s at {checkpoint.read_gb_per_s:g} GB/s ({bandwidths}); a resume "
        f"reads {checkpoint.resume_read_bytes / GB:.1f} GB"
    )


def format_stop_lead(job: JobConfig, lead: StopLead) -> str:
    """The time-limit lead the stop signal needs, and its parts."""
    cluster = job.cluster
    rollouts = job.trainer.train_batch_size * job.rollout.n_samples_per_prompt
    old_log_probs = f" + {lead.old_log_prob_flops:.3g} old log-prob" if lead.old_log_prob_flops else ""
    rate = f"{cluster.train_mfu:.0%} MFU of {cluster.gpu_peak_tflops:g} TFLOP/s x {cluster.world_size} GPUs"
    return (
        f"time-limit stop: the signal needs {math.ceil(lead.lead_s)} s before the limit (#SBATCH "
        f"--signal=B:USR1@N with N >= that): update {lead.update_s:.0f} s ({rollouts} full-length rollouts, "
        f"{lead.train_flops:.3g}{old_log_probs} FLOPs at {rate}, cluster.train_mfu assumed), checkpoint save "
        f"{lead.save_s:.0f} s, weight sync {lead.sync_s:.0f} s (at {WEIGHT_SYNC_GB_PER_S:g} GB/s, assumed), "
        f"state moves {lead.state_moves_s:.0f} s, margin {lead.margin_s:.0f} s"
    )


def format_verdict(job: JobConfig, plan: MemoryPlan) -> str:
    if plan.fits:
        return f"fits: peak {plan.peak.total / GIB:.1f} GiB of {plan.capacity / GIB:g} GiB ({plan.peak.name})"
    lines = ["does not fit: " + "; ".join(plan.problems)]
    suggestion = suggest_layout(job)
    if suggestion is None:
        lines.append(
            f"no layout within a few fields of this one fits on {job.cluster.world_size} GPUs; "
            "add nodes (cluster.nodes) or shorten rollout.max_response_length."
        )
    else:
        changes, fitting = suggestion
        overrides = " ".join(f"{name}={_override(value)}" for name, value in changes.items())
        lines.append(
            f"nearest layout that fits (peak {fitting.peak.total / GIB:.1f} GiB, {fitting.peak.name}): "
            f"{overrides}"
        )
    return "\n".join(lines)


def _override(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def report(job: JobConfig, *, show_ranks: bool) -> int:
    """Validate `job` for `cluster.*`; print its layout (with every rank's placement when `show_ranks`), the
    memory plan and the verdict. Returns the exit status: 0 fits, 1 does not fit (the nearest layout that
    does is printed), 2 invalid config (the error names the field)."""
    try:
        validate_for_cluster(job)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plan, checkpoint = plan_memory(job), plan_checkpoint(job)
    print(describe_layout(job))
    if show_ranks:
        print(format_placements(job, rank_placements(job)))
    print(format_plan(job, plan))
    print(format_checkpoint(checkpoint))
    print(format_stop_lead(job, plan_stop_lead(job, plan, checkpoint)))
    print(format_verdict(job, plan))
    return 0 if plan.fits else 1


def dry_run(job: JobConfig) -> int:
    """`dry_run=true`: the report with every rank's placement."""
    print("dry run: nothing is started or allocated")
    return report(job, show_ranks=True)
