"""GPU memory of one rank, per phase of a DAPO step, computed from the config alone (no torch, no GPU).

Four phases share each GPU (see `trainer/fleet.py` and the loop in `train.py`):

* **training**: the SGLang engine has released its weights and KV cache (`release_memory`); the trainer
  holds its persistent state plus the activations of the micro-batches in flight.
* **rollout**: the engine holds its weights and KV cache; the trainer keeps its persistent state
  (parameters, gradient buffers, optimizer) but no activations, or, with `trainer.offload_during_rollout`,
  nothing: that state waits in host memory (`trainer/offload.py`). The plan shows the phase both ways.
* **weight sync**: the engine's weights are back, its KV cache not yet; the trainer gathers full tensors
  into buckets of `rollout.sync_bucket_mb`.
* **checkpoint**: between the update and the weight sync, the engine's memory still released: the trainer's
  persistent state and nothing else. torch_dist stages what a rank writes in host memory, not on the GPU
  (`planning/checkpoint.py` has the checkpoint's bytes, host memory and time).

Besides its own trainer rank and engine worker, a GPU can hold other processes' CUDA contexts: with
`rollout.sync_method=tensor` every TP worker of an engine opens the weight buckets, which live on the GPU of
the engine's first TP rank, through CUDA IPC, and so creates a context on that GPU
(`foreign_cuda_contexts`); they stay for the processes' lifetime, in every phase after the first sync.

Sources of the byte counts:

* Parameters, gradient buffers and the distributed optimizer's shards follow megatron-core 0.16.1
  exactly: `distributed/param_and_grad_buffer.py` (`_ParamAndGradBuffer`: one buffer per parameter
  dtype; parameters laid out in reverse registration order; with the distributed optimizer each
  parameter starts at a multiple of 64 elements, each bucket is padded to a multiple of lcm(DP, 128),
  the parameters are moved into a padded buffer, and a tied embedding gets its own bucket; buckets of
  max(4e7, 1e6 x DP) elements only with `overlap_grad_reduce`, on the first pipeline stage) and
  `optimizer/distrib_optimizer.py` (each DP rank owns 1/DP of every bucket; the fp32 main parameters
  and the Adam moments exist only for the parameter elements inside that slice). Gradients are fp32
  (`trainer/optimizer.py` sets `grad_reduce_in_fp32`). `tests/distributed/test_plan_memory.py` checks
  these counts against what megatron-core allocates at TP2, PP2 and DP2.
* Optimizer states: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (2020), section 3: mixed-precision Adam keeps an fp32 copy of 16-bit parameters plus two fp32
  moments (12 bytes per parameter); ZeRO stage 1 (megatron's distributed optimizer) divides them by DP.
* Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), section 4: the tensors each layer saves for backward, per token, divided by TP inside the
  tensor-parallel regions and everywhere with sequence parallelism; full recompute keeps only each
  recompute unit's input; the 1F1B schedule keeps PP - stage micro-batches in flight on a stage. The
  paper's GPT layer (sbh(34 + 5as/h)) is re-derived for Qwen2 (`layer_activation_bytes`): SwiGLU,
  grouped-query attention, no dropout masks, and Transformer Engine's fused attention, which saves the
  output and a log-sum-exp per head instead of the s x s attention matrix. These are estimates; the
  other counts are exact.
* Rollout: SGLang (`mem_cache/kv_cache_configurator.py`) sizes its KV pool from the memory free when the
  engine starts: weights + KV cache = mem_fraction_static x free memory. The trainer has built its
  model and optimizer by then; Adam's moments are allocated at the first optimizer step (torch, TE and
  apex Adam all initialise them lazily), after the KV pool was sized. With the trainer's state offloaded
  the pool is sized against a GPU that holds none of it (only `cluster.reserved_gib`).
* Offload time: the trainer's whole state crosses the host link twice per step, at
  `HOST_DEVICE_GB_PER_S` (an assumption, below; nothing here has measured it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dapo_megatron import backends
from dapo_megatron.config import ConfigError, JobConfig, validate
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.sequence_padding import job_sequence_multiple, padded_length
from dapo_megatron.trainer.placement import engine_placement

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4
OPTIMIZER_MOMENTS = {"adam": 2, "sgd": 1}
"""fp32 state tensors per trained element: Adam's exp_avg and exp_avg_sq; SGD's momentum buffer."""
RESERVED = "reserved (CUDA contexts, NCCL, fragmentation)"
FOREIGN_CONTEXTS = "engine workers' CUDA contexts (IPC)"
HOST_DEVICE_GB_PER_S = 25.0
"""Pinned host <-> GPU copy bandwidth per GPU and direction in GB/s, all GPUs of a node copying at once: half
of the ~50 GB/s one H100's PCIe Gen5 x16 link reaches alone (64 GB/s raw), since the eight GPUs share PCIe
switch uplinks and host memory while they all move their state together. An assumption, never measured here:
replace it with the cluster's figure."""
SGLANG_VOCAB_PADDING = 64
"""SGLang pads its embedding and LM head rows to a multiple of 64 before splitting them over TP."""


# ---------------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of one rank, as megatron-core registers it."""

    name: str
    numel: int
    dtype: str
    shared_embedding: bool = False
    """A tied embedding split over pipeline stages (megatron gives it its own bucket)."""
    tp_replicated: bool = False
    """Every TP rank holds the whole tensor (the norms): a checkpoint stores it once."""


def planned_transformer_impl(model: ModelConfig) -> str:
    """The layer implementation a GPU job gets: `auto` means Transformer Engine there."""
    return "local" if model.transformer_impl == "local" else "transformer_engine"


def stage_parameters(model: ModelConfig, *, tp: int, pp: int, pp_rank: int) -> list[ParamSpec]:
    """This rank's parameters in `GPTModel.named_parameters()` order (any TP rank of stage `pp_rank`).

    Local layers register each RMSNorm separately, and in fp32: the project's `models/norm.RMSNorm` is a
    `torch.nn.RMSNorm` built without `params_dtype`. Transformer Engine fuses each norm into the following
    linear layer (`layer_norm_weight`) in the parameter dtype.
    """
    h, d, dtype = model.hidden_size, model.head_dim, model.params_dtype
    qkv_rows = (model.num_attention_heads + 2 * model.num_query_groups) * d // tp
    proj = h * model.num_attention_heads * d // tp
    fc1, fc2 = 2 * model.ffn_hidden_size // tp * h, h * model.ffn_hidden_size // tp
    local = planned_transformer_impl(model) == "local"
    norm_dtype = "float32" if local else dtype
    vocab_rows = model.padded_vocab_size(tp) // tp
    tied_across_stages = model.tie_word_embeddings and pp > 1
    first, last = pp_rank == 0, pp_rank == pp - 1
    layers_per_stage = model.num_layers // pp

    params = []
    if first:
        params.append(
            ParamSpec(
                "embedding.word_embeddings.weight", vocab_rows * h, dtype, shared_embedding=tied_across_stages
            )
        )
    for index in range(pp_rank * layers_per_stage, (pp_rank + 1) * layers_per_stage):
        prefix = f"decoder.layers.{index}."
        qkv = [ParamSpec(prefix + "self_attention.linear_qkv.weight", qkv_rows * h, dtype)]
        if model.add_qkv_bias:
            qkv.append(ParamSpec(prefix + "self_attention.linear_qkv.bias", qkv_rows, dtype))
        proj_spec = ParamSpec(prefix + "self_attention.linear_proj.weight", proj, dtype)
        fc = [
            ParamSpec(prefix + "mlp.linear_fc1.weight", fc1, dtype),
            ParamSpec(prefix + "mlp.linear_fc2.weight", fc2, dtype),
        ]
        if local:
            params += [
                ParamSpec(prefix + "input_layernorm.weight", h, norm_dtype, tp_replicated=True),
                proj_spec,
                *qkv,
                ParamSpec(prefix + "pre_mlp_layernorm.weight", h, norm_dtype, tp_replicated=True),
                *fc,
            ]
        else:
            params += [
                proj_spec,
                ParamSpec(
                    prefix + "self_attention.linear_qkv.layer_norm_weight", h, norm_dtype, tp_replicated=True
                ),
                *qkv,
                ParamSpec(prefix + "mlp.linear_fc1.layer_norm_weight", h, norm_dtype, tp_replicated=True),
                *fc,
            ]
    if last:
        params.append(ParamSpec("decoder.final_layernorm.weight", h, norm_dtype, tp_replicated=True))
        if not (model.tie_word_embeddings and pp == 1):  # one stage: the output layer reuses the embedding
            params.append(
                ParamSpec("output_layer.weight", vocab_rows * h, dtype, shared_embedding=tied_across_stages)
            )
    return params


# ------------------------------------------------------------------------- gradient buffers and optimizer


@dataclass(frozen=True)
class GradBuffer:
    """One megatron-core `_ParamAndGradBuffer` (all parameters of one dtype on this rank)."""

    param_dtype: str
    numel: int
    """Elements, padding included (the gradient buffer, and with the distributed optimizer the parameters)."""
    owned: tuple[tuple[int, ...], ...]
    """owned[r][i]: elements of parameter i (this buffer's order) in DP rank r's shard of the buffer."""
    param_numels: tuple[int, ...]


def buffer_orders(params: Sequence[ParamSpec]) -> list[list[ParamSpec]]:
    """The parameters of each buffer megatron DDP builds for `params`, in the buffer's order: one buffer per
    parameter dtype, in first-seen order, its parameters reversed (megatron lays them out roughly in the
    order backward produces them)."""
    by_dtype: dict[str, list[ParamSpec]] = {}
    for param in params:
        by_dtype.setdefault(param.dtype, []).append(param)
    return [group[::-1] for group in by_dtype.values()]


def grad_buffers(
    params: Sequence[ParamSpec], *, dp: int, distributed_optimizer: bool, bucket_size: int | None
) -> list[GradBuffer]:
    """The buffers megatron DDP builds for `params` (`buffer_orders`)."""
    buffers = []
    for ordered in buffer_orders(params):
        ranges, buckets = _buffer_layout(
            ordered, dp=dp, distributed_optimizer=distributed_optimizer, bucket_size=bucket_size
        )
        owned = []
        for rank in range(dp):
            mine = []
            for start, end, bucket in ranges:
                lo, hi = buckets[bucket]
                shard = (hi - lo) // dp
                mine.append(max(0, min(end, lo + (rank + 1) * shard) - max(start, lo + rank * shard)))
            owned.append(tuple(mine))
        dtype = ordered[0].dtype
        buffers.append(GradBuffer(dtype, buckets[-1][1], tuple(owned), tuple(p.numel for p in ordered)))
    return buffers


def _buffer_layout(
    ordered: Sequence[ParamSpec], *, dp: int, distributed_optimizer: bool, bucket_size: int | None
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """(start, end, bucket) of each parameter and (start, end) of each bucket, padding included, following
    `_ParamAndGradBuffer.__init__`."""
    ranges: list[tuple[int, int, int]] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = start = end = 0
    in_bucket = 0

    def close_bucket(bucket_end: int) -> int:
        nonlocal bucket_start, in_bucket
        if distributed_optimizer:
            # Every DP rank owns an equal slice of each bucket.
            bucket_end = padded_length(bucket_end, math.lcm(dp, 128))
        buckets.append((bucket_start, bucket_end))
        bucket_start, in_bucket = bucket_end, 0
        return bucket_end

    for param in ordered:
        if distributed_optimizer:
            start = padded_length(start, 64)  # 128-byte aligned parameters
        own_bucket = param.shared_embedding and distributed_optimizer
        if own_bucket and in_bucket:
            start = close_bucket(start)
        end = start + param.numel
        ranges.append((start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close_bucket(end)
        else:
            start = end
    if in_bucket:
        close_bucket(end)
    return ranges, buckets


@dataclass(frozen=True)
class StateBytes:
    """The trainer's persistent memory on one rank, in bytes."""

    parameters: int
    gradients: int
    main_parameters: int
    """fp32 copies of 16-bit parameters kept by the optimizer (the whole stage, or this rank's shard)."""
    moments: int
    """Optimizer state tensors (Adam: exp_avg and exp_avg_sq), allocated at the first step."""

    @property
    def optimizer(self) -> int:
        return self.main_parameters + self.moments

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def before_first_step(self) -> int:
        """What the trainer holds when the engine starts and sizes its KV cache."""
        return self.parameters + self.gradients + self.main_parameters


def ddp_bucket_size(parallel: ParallelConfig, dp: int, pp_rank: int) -> int | None:
    """Elements per gradient bucket megatron DDP uses on stage `pp_rank` (None: one bucket per buffer)."""
    return max(40_000_000, 1_000_000 * dp) if parallel.overlap_grad_reduce and pp_rank == 0 else None


def stage_state_bytes(
    model: ModelConfig, parallel: ParallelConfig, *, dp: int, pp_rank: int, optimizer: str = "adam"
) -> list[StateBytes]:
    """Parameters, fp32 gradient buffers and optimizer state of each DP rank (index) of pipeline stage
    `pp_rank` (any TP rank), as megatron DDP and megatron's (distributed) optimizer allocate them."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    params = stage_parameters(model, tp=tp, pp=pp, pp_rank=pp_rank)
    distributed = parallel.use_distributed_optimizer
    buffers = grad_buffers(
        params, dp=dp, distributed_optimizer=distributed, bucket_size=ddp_bucket_size(parallel, dp, pp_rank)
    )
    states = []
    for dp_rank in range(dp):
        parameters = gradients = main = trained = 0
        for buffer in buffers:
            width = DTYPE_BYTES[buffer.param_dtype]
            gradients += buffer.numel * FP32
            # With the distributed optimizer the parameters move into one padded buffer; otherwise they stay
            # separate tensors and the optimizer covers every element of this stage.
            parameters += (buffer.numel if distributed else sum(buffer.param_numels)) * width
            elements = sum(buffer.owned[dp_rank]) if distributed else sum(buffer.param_numels)
            trained += elements
            if width < FP32:
                main += elements * FP32
        states.append(StateBytes(parameters, gradients, main, trained * FP32 * OPTIMIZER_MOMENTS[optimizer]))
    return states


class StageStates:
    """`stage_state_bytes` for one model, memoized: the layout search asks for the same stages many times."""

    def __init__(self, model: ModelConfig, optimizer: str) -> None:
        self.model, self.optimizer = model, optimizer
        self._cache: dict[tuple[int | bool, ...], list[StateBytes]] = {}

    def __call__(self, parallel: ParallelConfig, *, dp: int, pp_rank: int) -> list[StateBytes]:
        key = (
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            parallel.use_distributed_optimizer,
            parallel.overlap_grad_reduce,
            dp,
            pp_rank,
        )
        if key not in self._cache:
            self._cache[key] = stage_state_bytes(
                self.model, parallel, dp=dp, pp_rank=pp_rank, optimizer=self.optimizer
            )
        return self._cache[key]


# -------------------------------------------------------------------------------------------- activations


def layer_activation_bytes(model: ModelConfig, *, tp: int, sequence_parallel: bool) -> float:
    """Bytes one transformer layer saves for backward, per token (Korthikanti et al. 2022, section 4.1,
    re-derived for Qwen2 with Transformer Engine layers; b = activation bytes, 2 for bf16):

        b x 4h / (TP if sequence parallel else 1)   inputs of the two RMSNorms and their outputs (the
                                                     inputs of the QKV and FC1 GEMMs)
      + b x ((a + 2g) d + a d + 3F) / TP             Q, K, V; the attention output (input of the output
                                                     projection); FC1's gate and up halves (SwiGLU's input);
                                                     SwiGLU's output (input of FC2)
      + 4 x a / TP                                   fused attention's fp32 log-sum-exp per head

    with h hidden, a attention heads, g query groups, d head dim, F the FFN width. Unlike the paper's GPT
    there are no dropout masks (Qwen2 trains without dropout) and no s x s attention matrix (fused
    attention recomputes it).
    """
    act = DTYPE_BYTES[model.params_dtype]
    a, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    outside_tp = act * 4 * model.hidden_size / (tp if sequence_parallel else 1)
    inside_tp = act * ((a + 2 * g) * d + a * d + 3 * model.ffn_hidden_size) / tp
    return outside_tp + inside_tp + FP32 * a / tp


def recompute_unit_input_bytes(model: ModelConfig, *, tp: int, sequence_parallel: bool) -> float:
    """Bytes per token a full-recompute unit keeps: its input hidden state."""
    return DTYPE_BYTES[model.params_dtype] * model.hidden_size / (tp if sequence_parallel else 1)


@dataclass(frozen=True)
class ActivationBytes:
    """Peak activation memory of one pipeline stage during a training step, in bytes."""

    layers: int
    """Saved layer activations of the micro-batches in flight, plus the recompute working set."""
    logits: int
    """Last stage: the vocab-parallel logits kept for the log-prob backward, their gradient, and the
    log-prob kernel's two fp32 chunk buffers."""
    in_flight: int
    """Micro-batches whose activations the 1F1B schedule holds at once on this stage."""

    @property
    def total(self) -> int:
        return self.layers + self.logits


def activation_bytes(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    pp_rank: int,
    tokens_per_micro_batch: int,
    micro_batches: int,
    logprob_chunk_size: int,
) -> ActivationBytes:
    """Activations of stage `pp_rank` for micro-batches of `tokens_per_micro_batch` tokens, `micro_batches`
    of them per optimizer step on this DP rank."""
    tp, pp, sp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.sequence_parallel,
    )
    layers = model.num_layers // pp
    full_layer = layer_activation_bytes(model, tp=tp, sequence_parallel=sp)
    unit_input = recompute_unit_input_bytes(model, tp=tp, sequence_parallel=sp)
    n = parallel.recompute_num_layers
    if parallel.recompute_granularity == "none":
        kept, working = layers * full_layer, 0.0
    elif parallel.recompute_method == "uniform":  # chunks of n layers; backward reruns one chunk at a time
        kept, working = layers // n * unit_input, n * full_layer
    else:  # block: the first n layers are checkpointed one by one, the others keep everything
        kept, working = n * unit_input + (layers - n) * full_layer, full_layer
    in_flight = min(pp - pp_rank, micro_batches)
    logits = 0
    if pp_rank == pp - 1:
        vocab_shard = model.padded_vocab_size(tp) // tp
        logits = (
            2 * tokens_per_micro_batch * vocab_shard * DTYPE_BYTES[model.params_dtype]
            + 2 * min(logprob_chunk_size, tokens_per_micro_batch) * vocab_shard * FP32
        )
    return ActivationBytes(int(tokens_per_micro_batch * (in_flight * kept + working)), logits, in_flight)


# ---------------------------------------------------------------------------------------------- rollout


def engine_weight_bytes(model: ModelConfig, *, engine_tp: int, dtype: str) -> int:
    """One GPU's share of an SGLang engine's Qwen2 weights: attention, MLP, embedding and LM head split
    over the engine's TP ranks, norms replicated, KV heads replicated when there are fewer than ranks."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    q = model.num_attention_heads * d // engine_tp
    kv = kv_heads_per_engine_rank(model, engine_tp) * d
    per_layer = (q + 2 * kv) * h + (q + 2 * kv) * model.add_qkv_bias + q * h + 3 * f // engine_tp * h + 2 * h
    vocab_rows = -(-padded_length(model.vocab_size, SGLANG_VOCAB_PADDING) // engine_tp)
    embeddings = vocab_rows * h * (1 if model.tie_word_embeddings else 2)
    return (model.num_layers * per_layer + embeddings + h) * DTYPE_BYTES[dtype]


def kv_heads_per_engine_rank(model: ModelConfig, engine_tp: int) -> int:
    return max(1, model.num_query_groups // engine_tp)


def kv_bytes_per_token(model: ModelConfig, *, engine_tp: int, dtype: str) -> int:
    """K and V of every layer for one token, on one GPU of the engine."""
    return (
        2
        * model.num_layers
        * kv_heads_per_engine_rank(model, engine_tp)
        * model.head_dim
        * DTYPE_BYTES[dtype]
    )


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Phase:
    name: str
    items: tuple[tuple[str, int], ...]
    """(what, bytes) per GPU."""

    @property
    def total(self) -> int:
        return sum(size for _, size in self.items)


@dataclass(frozen=True)
class MemoryPlan:
    """The memory of the busiest rank in each phase, against one GPU's capacity."""

    capacity: int
    phases: tuple[Phase, ...]
    state: StateBytes
    state_alternative: StateBytes
    """The same rank with parallel.use_distributed_optimizer flipped."""
    activations: ActivationBytes
    activations_alternative: ActivationBytes
    """The same stage with full recompute if it is off (one layer per unit), without it if it is on."""
    pp_rank: int
    """The pipeline stage these numbers are for (the one with the highest peak)."""
    dp_rank: int
    kv_tokens: int
    """KV-cache capacity of one engine in tokens."""
    sequence_tokens: int
    """max_prompt_length + max_response_length: one rollout must fit in the KV cache."""
    tokens_per_micro_batch: int
    micro_batches: int
    offload: bool
    """trainer.offload_during_rollout: the trainer's state is in host memory while the engine generates."""
    rollout_alternative: Phase
    """The rollout phase with trainer.offload_during_rollout flipped."""
    kv_tokens_alternative: int
    """The engine's KV-cache capacity in tokens with trainer.offload_during_rollout flipped."""
    concurrent_rollouts: int
    """rollout.max_concurrent_requests: the rollouts one engine is given at once."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def rollouts_held(self) -> int:
        """Full-length rollouts one engine's KV cache holds at once."""
        return max(self.kv_tokens, 0) // self.sequence_tokens

    @property
    def rollouts_held_alternative(self) -> int:
        return max(self.kv_tokens_alternative, 0) // self.sequence_tokens

    @property
    def held_vs_concurrency(self) -> float:
        """rollouts_held / concurrent_rollouts: below 1 a long-response batch runs fewer requests than
        configured (the engine queues the rest and retracts running ones when its cache fills)."""
        return self.rollouts_held / self.concurrent_rollouts

    @property
    def offload_bytes(self) -> int:
        """Bytes of trainer state that cross the host link each way per step with the offload."""
        return self.state.total

    @property
    def offload_seconds(self) -> float:
        """Estimated seconds of one move (offload or reload) at HOST_DEVICE_GB_PER_S."""
        return self.offload_bytes / (HOST_DEVICE_GB_PER_S * 1e9)

    @property
    def problems(self) -> list[str]:
        out = [
            f"{phase.name} needs {phase.total / GIB:.1f} GiB of {self.capacity / GIB:.0f} GiB"
            for phase in self.phases
            if phase.total > self.capacity
        ]
        if self.kv_tokens < self.sequence_tokens:
            out.append(
                f"the engine's KV cache holds {max(self.kv_tokens, 0)} tokens, less than one "
                f"{self.sequence_tokens}-token rollout"
            )
        return out

    @property
    def fits(self) -> bool:
        return not self.problems


def foreign_cuda_contexts(job: JobConfig) -> int:
    """CUDA contexts other processes open on the GPU of an engine's first TP rank: with
    `rollout.sync_method=tensor` the trainer rank there puts each weight bucket in its own GPU memory and
    sends every TP worker of the engine a CUDA IPC handle to it; SGLang's `update_weights_from_tensor`
    rebuilds the tensor where it lives, so each of the engine_tp_size - 1 workers on other GPUs opens a
    context on this one (and keeps it while it runs). `distributed` moves the buckets through a gloo group,
    host memory: none."""
    return job.rollout.engine_tp_size - 1 if job.rollout.sync_method == "tensor" else 0


def data_parallel_size(job: JobConfig) -> int:
    return job.cluster.world_size // job.parallel.model_parallel_size


def micro_batching(job: JobConfig) -> tuple[int, int]:
    """(tokens per micro-batch, micro-batches per optimizer step per DP rank), at worst: every rollout at
    full length. Tokens are those the model computes: a full-length row padded to the sequence multiple
    (`models/sequence_padding.py`). A token budget (trainer.max_tokens_per_micro_batch) is the most a
    micro-batch computes; without one, micro_batch_size padded full-length rows."""
    sequences = job.trainer.ppo_mini_batch_size * job.rollout.n_samples_per_prompt
    per_rank = -(-sequences // data_parallel_size(job))
    longest = padded_length(
        job.rollout.max_sequence_tokens, job_sequence_multiple(job.parallel, job.model.fp8)
    )
    budget = job.trainer.max_tokens_per_micro_batch
    rows = budget // longest if budget else job.trainer.micro_batch_size
    return budget or rows * longest, -(-per_rank // rows)


def plan_memory(job: JobConfig, states: StageStates | None = None) -> MemoryPlan:
    """The plan of the busiest rank of `job` on `job.cluster` (validate the config first). Pass `states`
    to reuse stage computations across calls for the same model."""
    states = states or StageStates(job.model, job.optim.optimizer)
    dp = data_parallel_size(job)
    plans = []
    for pp_rank in range(job.parallel.pipeline_model_parallel_size):
        per_rank = states(job.parallel, dp=dp, pp_rank=pp_rank)
        dp_rank = max(range(dp), key=lambda rank: per_rank[rank].total)  # the largest optimizer shard
        plans.append(_rank_plan(job, states, pp_rank, dp_rank))
    return max(plans, key=lambda plan: plan.peak.total)


def _rank_plan(job: JobConfig, states: StageStates, pp_rank: int, dp_rank: int) -> MemoryPlan:
    model, par, rollout = job.model, job.parallel, job.rollout
    dp = data_parallel_size(job)
    capacity = int(job.cluster.gpu_memory_gib * GIB)
    reserved = int(job.cluster.reserved_gib * GIB)
    state = states(par, dp=dp, pp_rank=pp_rank)[dp_rank]
    flipped = dataclasses.replace(
        par, use_distributed_optimizer=not par.use_distributed_optimizer, overlap_param_gather=False
    )
    state_alternative = max(states(flipped, dp=dp, pp_rank=pp_rank), key=lambda s: s.total)
    tokens, micro_batches = micro_batching(job)

    def activations(parallel: ParallelConfig) -> ActivationBytes:
        return activation_bytes(
            model,
            parallel,
            pp_rank=pp_rank,
            tokens_per_micro_batch=tokens,
            micro_batches=micro_batches,
            logprob_chunk_size=job.algo.logprob_chunk_size,
        )

    recompute_flipped = dataclasses.replace(
        par,
        recompute_granularity="none" if par.recompute_granularity == "full" else "full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    act = activations(par)
    engine_dtype = model.params_dtype if rollout.dtype == "auto" else rollout.dtype
    weights = engine_weight_bytes(model, engine_tp=rollout.engine_tp_size, dtype=engine_dtype)
    trainer_state = (
        ("parameters", state.parameters),
        ("gradients (fp32 buffers)", state.gradients),
        ("optimizer (fp32 main params + moments)", state.optimizer),
    )
    # Opened at the first weight sync, after the engine sized its KV cache: on top of it, not out of it.
    context_bytes = foreign_cuda_contexts(job) * int(job.cluster.cuda_context_gib * GIB)
    contexts = ((FOREIGN_CONTEXTS, context_bytes),) if context_bytes else ()

    def rollout_phase(offloaded: bool) -> tuple[Phase, int]:
        """The rollout phase and the engine's KV-cache tokens, with the trainer's state offloaded or not."""
        free_at_engine_start = capacity - reserved - (0 if offloaded else state.before_first_step)
        engine_static = int(rollout.mem_fraction_static * free_at_engine_start)
        kv_tokens = (engine_static - weights) // kv_bytes_per_token(
            model, engine_tp=rollout.engine_tp_size, dtype=engine_dtype
        )
        items = (
            *(() if offloaded else trainer_state),
            ("engine weights", weights),
            ("engine KV cache", max(engine_static - weights, 0)),
            *contexts,
            (RESERVED, reserved),
        )
        return Phase("rollout", items), kv_tokens

    offload = job.trainer.offload_during_rollout
    rollout_now, kv_tokens = rollout_phase(offload)
    rollout_alternative, kv_tokens_alternative = rollout_phase(not offload)
    phases = (
        Phase(
            "training",
            (
                *trainer_state,
                ("activations", act.layers),
                ("logits", act.logits),
                *contexts,
                (RESERVED, reserved),
            ),
        ),
        rollout_now,
        Phase(
            "weight sync",
            (
                *trainer_state,
                ("engine weights", weights),
                ("sync buckets (trainer + engine copy)", 2 * rollout.sync_bucket_mb * 2**20),
                *contexts,
                (RESERVED, reserved),
            ),
        ),
        Phase("checkpoint", (*trainer_state, *contexts, (RESERVED, reserved))),
    )
    return MemoryPlan(
        capacity=capacity,
        phases=phases,
        state=state,
        state_alternative=state_alternative,
        activations=act,
        activations_alternative=activations(recompute_flipped),
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        kv_tokens=kv_tokens,
        sequence_tokens=rollout.max_sequence_tokens,
        tokens_per_micro_batch=tokens,
        micro_batches=micro_batches,
        offload=offload,
        rollout_alternative=rollout_alternative,
        kv_tokens_alternative=kv_tokens_alternative,
        concurrent_rollouts=rollout.max_concurrent_requests,
    )


# ---------------------------------------------------------------------------------- validation and search


def validate_for_cluster(job: JobConfig) -> None:
    """`config.validate` for the planned world size, plus the rollout engines' fit on the nodes.

    Raises:
        ConfigError: naming the field and the fix.
    """
    validate(job, world_size=job.cluster.world_size)
    etp, gpus = job.rollout.engine_tp_size, job.cluster.gpus_per_node
    if gpus % etp:
        raise ConfigError(
            f"rollout.engine_tp_size={etp} does not divide cluster.gpus_per_node={gpus}: an engine's "
            f"GPUs must be on one node; choose a divisor of {gpus}."
        )
    try:
        engine_placement(job.cluster.world_size, job.rollout, backends.CUDA)
        backends.CUDA.check_overlap(job.trainer.overlap_rollout)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    heads, groups = job.model.num_attention_heads, job.model.num_query_groups

    def splits_heads(
        size: int,
    ) -> bool:  # SGLang: heads divisible by TP; KV groups divisible by it or dividing it
        return not heads % size and not (groups % size and size % groups)

    if not splits_heads(etp):
        fitting = [d for d in range(1, gpus + 1) if not gpus % d and splits_heads(d)]
        raise ConfigError(
            f"rollout.engine_tp_size={etp} cannot split model.num_attention_heads={heads} and "
            f"model.num_query_groups={groups} between its ranks; choose one of {fitting}."
        )


MAX_SUGGESTED_CHANGES = 3
"""The layout search looks at most this many fields away from the given config."""


def suggest_layout(job: JobConfig) -> tuple[dict[str, object], MemoryPlan] | None:
    """The nearest layout that fits on `job.cluster`: the fewest changed fields (at most
    MAX_SUGGESTED_CHANGES), then the cheapest to run (no recompute, less model parallelism, larger
    micro-batches). Returns ({field: value} of the changes, its plan), or None when none fits."""
    current = _knobs(job)
    states = StageStates(job.model, job.optim.optimizer)
    candidates = []
    for values in itertools.product(*_knob_options(job).values()):
        knobs = dict(zip(current, values, strict=True))
        changes = sum(knobs[k] != current[k] for k in current)
        if 0 < changes <= MAX_SUGGESTED_CHANGES:
            cost = (
                changes,
                knobs["parallel.recompute_granularity"] == "full",
                knobs["parallel.tensor_model_parallel_size"] * knobs["parallel.pipeline_model_parallel_size"],
                -knobs["trainer.micro_batch_size"],
                knobs["rollout.engine_tp_size"],
                abs(knobs["rollout.mem_fraction_static"] - current["rollout.mem_fraction_static"]),
            )
            candidates.append((cost, knobs))
    candidates.sort(key=lambda candidate: candidate[0])
    for _, knobs in candidates:
        try:
            changed = _with_knobs(job, knobs)
            validate_for_cluster(changed)
        except (ConfigError, ValueError):  # ValueError: a component's own check (e.g. SP needs TP > 1)
            continue
        plan = plan_memory(changed, states)
        if plan.fits:
            return {k: v for k, v in knobs.items() if v != current[k]}, plan
    return None


def _knobs(job: JobConfig) -> dict[str, object]:
    par = job.parallel
    return {
        "parallel.tensor_model_parallel_size": par.tensor_model_parallel_size,
        "parallel.pipeline_model_parallel_size": par.pipeline_model_parallel_size,
        "parallel.sequence_parallel": par.sequence_parallel,
        "parallel.use_distributed_optimizer": par.use_distributed_optimizer,
        "parallel.recompute_granularity": par.recompute_granularity,
        "trainer.micro_batch_size": job.trainer.micro_batch_size,
        "rollout.engine_tp_size": job.rollout.engine_tp_size,
        "rollout.mem_fraction_static": job.rollout.mem_fraction_static,
    }


def _knob_options(job: JobConfig) -> dict[str, list[object]]:
    gpus, world = job.cluster.gpus_per_node, job.cluster.world_size
    node_divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    micro = job.trainer.micro_batch_size
    return {
        "parallel.tensor_model_parallel_size": node_divisors,  # TP stays inside a node's NVLink domain
        "parallel.pipeline_model_parallel_size": [
            d for d in range(1, job.model.num_layers + 1) if job.model.num_layers % d == 0 and world % d == 0
        ],
        "parallel.sequence_parallel": [False, True],
        "parallel.use_distributed_optimizer": [False, True],
        "parallel.recompute_granularity": ["none", "full"],
        "trainer.micro_batch_size": sorted({micro >> shift for shift in range(micro.bit_length())}),
        "rollout.engine_tp_size": node_divisors,
        "rollout.mem_fraction_static": sorted(
            {job.rollout.mem_fraction_static, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}
        ),
    }


def _with_knobs(job: JobConfig, knobs: dict[str, object]) -> JobConfig:
    """`job` with the dotted fields of `knobs` replaced (components re-run their own checks)."""
    sections: dict[str, dict[str, object]] = {}
    for dotted, value in knobs.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    parallel = sections["parallel"]
    if not parallel["use_distributed_optimizer"]:
        parallel["overlap_param_gather"] = False  # it needs the distributed optimizer
    if parallel["recompute_granularity"] == "full" and job.parallel.recompute_granularity == "none":
        parallel.update(recompute_method="uniform", recompute_num_layers=1)
    return dataclasses.replace(
        job,
        **{
            section: dataclasses.replace(getattr(job, section), **fields)
            for section, fields in sections.items()
        },
    )
