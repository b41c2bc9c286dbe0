"""The job's configuration: typed dataclasses composed by Hydra from `configs/`, validated before
anything is built.

Each component owns its dataclass (`models/config.py`, `distributed/config.py`, ...); this module
composes them into `JobConfig`, registers the schema with Hydra's ConfigStore (so unknown keys and
wrong types are errors), and checks the rules that span components (`validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, OmegaConf

from dapo_megatron import backends
from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.data.config import DataConfig
from dapo_megatron.distributed.config import ClusterConfig, ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.fp8 import alignment_error as fp8_alignment_error
from dapo_megatron.models.sequence_padding import job_padding_reason, job_sequence_multiple, padded_length
from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.config import EvalConfig, OptimConfig, TrainerConfig, WarmupConfig
from dapo_megatron.trainer.placement import engine_placement

CONFIG_DIR = (Path(__file__).parent / "configs").resolve()
"""The Hydra config tree: the checkout's `configs/` (through the link `dapo_megatron/configs`), or the copy an
installed wheel carries in the package (pyproject.toml's package data)."""


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = 1234
    output_dir: str = "outputs/${experiment_name}"
    """Checkpoints, TensorBoard logs (with metrics.jsonl) and engine logs go here."""
    experiment_name: str = "default"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The GPUs a recipe is planned for (read by the dry run and tools/plan_memory.py)."""
    dry_run: bool = False
    """Validate the whole config for cluster.nodes x cluster.gpus_per_node ranks, print the layout per rank
    and the memory plan, and exit: no GPU, no process group, no weights."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and the fix."""


def register_configs() -> None:
    """Register `JobConfig` as the schema `configs/config.yaml` extends (idempotent)."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def compose(overrides: Sequence[str] = (), config_dir: Path | str = CONFIG_DIR) -> DictConfig:
    """Compose `config.yaml` with Hydra overrides (`model=qwen2.5-7b parallel.tensor_model_parallel_size=4`)
    outside of `@hydra.main`, as tools and tests do."""
    register_configs()
    _check_override_keys(overrides, Path(config_dir))
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def to_job_config(cfg: DictConfig) -> JobConfig:
    """Turn a composed DictConfig into typed dataclasses; each component's `__post_init__` checks its
    own fields here. Field errors come back as `ConfigError` with OmegaConf's wrapping removed."""
    _reject_unknown_keys(cfg, JobConfig, prefix="")
    try:
        job = OmegaConf.to_object(cfg)
    except Exception as error:  # OmegaConf wraps __post_init__ errors in its own exception types
        cause = error.__cause__ or error
        raise ConfigError(str(cause).split("\n")[0]) from error
    assert isinstance(job, JobConfig)
    return job


def validate(job: JobConfig, world_size: int) -> None:
    """Rules that span components, checked before any process group or model exists.

    Raises:
        ConfigError: naming the offending field and how to fix it.
    """
    model, par = job.model, job.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    divisible_by_tp = {
        "model.num_attention_heads": model.num_attention_heads,
        "model.num_query_groups": model.num_query_groups,
        "model.ffn_hidden_size": model.ffn_hidden_size,
    }
    for name, value in divisible_by_tp.items():
        if value % tp:
            fitting = [d for d in range(1, tp + 1) if all(v % d == 0 for v in divisible_by_tp.values())]
            raise ConfigError(
                f"{name}={value} is not divisible by parallel.tensor_model_parallel_size={tp}; "
                f"the largest tensor-parallel size up to {tp} that fits this model is {fitting[-1]}."
            )
    if model.num_layers % pp:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by "
            f"parallel.pipeline_model_parallel_size={pp}; choose a pipeline size that divides "
            f"{model.num_layers} (for example {_largest_divisor_at_most(model.num_layers, pp)})."
        )
    if world_size % (tp * pp):
        raise ConfigError(
            f"the world size {world_size} is not a multiple of tensor x pipeline parallel = {tp} x {pp} = "
            f"{tp * pp}; launch a multiple of {tp * pp} processes or change "
            "parallel.tensor_model_parallel_size / parallel.pipeline_model_parallel_size."
        )
    rollout, trainer = job.rollout, job.trainer
    longest_row = rollout.max_sequence_tokens
    if longest_row > model.max_position_embeddings:
        raise ConfigError(
            f"rollout.max_prompt_length + rollout.max_response_length = {longest_row} exceeds "
            f"model.max_position_embeddings={model.max_position_embeddings}; shorten them or use a model "
            "with a longer context."
        )
    _validate_token_budget(job)
    if rollout.num_engines:
        try:  # the device decides the automatic count only
            engine_placement(world_size, rollout, backends.CPU)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    dp = world_size // (tp * pp)
    optimizer_steps = trainer.optimizer_steps
    if trainer.ppo_mini_batch_size * rollout.n_samples_per_prompt < dp:
        raise ConfigError(
            f"trainer.ppo_mini_batch_size={trainer.ppo_mini_batch_size} prompts x "
            f"rollout.n_samples_per_prompt={rollout.n_samples_per_prompt} leaves some of the {dp} "
            f"data-parallel ranks without a sequence in each of the {optimizer_steps} optimizer steps; raise "
            "trainer.ppo_mini_batch_size or use fewer ranks."
        )
    layers_per_stage = model.num_layers // pp
    if par.recompute_granularity == "full" and (
        layers_per_stage % par.recompute_num_layers
        if par.recompute_method == "uniform"
        else par.recompute_num_layers > layers_per_stage
    ):
        rule = "divide" if par.recompute_method == "uniform" else "be at most"
        raise ConfigError(
            f"parallel.recompute_num_layers={par.recompute_num_layers} must {rule} the {layers_per_stage} "
            f"layers of a pipeline stage with parallel.recompute_method={par.recompute_method}; use 1 "
            "(recompute every layer)."
        )
    _validate_old_log_prob_source(job)  # first: its fix for quantized rollouts is not the TIS one below
    _validate_low_precision(job)


def _validate_token_budget(job: JobConfig) -> None:
    """A micro-batch budget must hold the longest possible row as the model computes it, padded to the
    sequence multiple (`models/sequence_padding.py`), or the planner would refuse it mid-run."""
    budget, longest_row = job.trainer.max_tokens_per_micro_batch, job.rollout.max_sequence_tokens
    multiple = job_sequence_multiple(job.parallel, job.model.fp8)
    computed = padded_length(longest_row, multiple)
    if budget and budget < computed:
        padding = (
            f", which the model computes as {computed} (every micro-batch is right-padded to a multiple of "
            f"{multiple}: {job_padding_reason(job.parallel, job.model.fp8)})"
            if computed > longest_row
            else ""
        )
        raise ConfigError(
            f"trainer.max_tokens_per_micro_batch={budget} cannot hold the longest possible row, "
            f"rollout.max_prompt_length + rollout.max_response_length = {longest_row} tokens{padding}; raise "
            f"it to at least {computed} or set it to null (fixed trainer.micro_batch_size)."
        )


def _validate_low_precision(job: JobConfig) -> None:
    """FP8 training shapes and layout, and FP8 rollouts' need for importance-sampling correction. Whether
    this machine can run FP8 is checked when the model is built (`models/fp8.check_environment`)."""
    model, par = job.model, job.parallel
    error = fp8_alignment_error(
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        head_dim=model.head_dim,
        tensor_parallel_size=par.tensor_model_parallel_size,
        fp8=model.fp8,
    )
    if error:
        raise ConfigError(error)
    if model.fp8.enabled and model.fp8.param_gather and not par.use_distributed_optimizer:
        raise ConfigError(
            "model.fp8.param_gather=true keeps only FP8 weights in the model and needs the "
            "distributed optimizer for the fp32 master weights; set parallel.use_distributed_optimizer=true "
            "or model.fp8.param_gather=false."
        )
    if model.fp8.enabled and model.fp8.param_gather:
        # The weight sync would read FP8 tensors (data plus scales) where it expects the engine's dtype, and
        # no GPU run has checked a dequantising path yet.
        raise ConfigError(
            "model.fp8.param_gather=true keeps the layer weights as FP8 tensors, and the weight sync "
            "would send them to the engine undequantised (its weights are in rollout.dtype); set "
            "model.fp8.param_gather=false (FP8 compute with model.fp8.enabled=true still works)."
        )
    layers_per_stage = model.num_layers // par.pipeline_model_parallel_size
    if model.fp8.enabled and model.fp8.first_last_layers_bf16:
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(model.fp8, name) > layers_per_stage:
                raise ConfigError(
                    f"model.fp8.{name}={getattr(model.fp8, name)} exceeds the {layers_per_stage} layers "
                    "of a pipeline stage; lower it or use fewer pipeline stages."
                )
    if job.rollout.quantization and job.algo.tis_cap is None:
        raise ConfigError(
            f"rollout.quantization={job.rollout.quantization} samples from a quantized copy of the policy, "
            "so the rollout log-probs differ from the trainer's; set algo.tis_cap (truncated importance "
            "sampling, e.g. algo.tis_cap=2.0) or rollout.quantization=null."
        )


def _validate_old_log_prob_source(job: JobConfig) -> None:
    """π_old taken from the engine is only as good as the engine's agreement with the trainer. Batches
    generated ahead (trainer.overlap_rollout) were sampled one update back: either π_old is that sampling
    policy (the engine's log-probs), or it is recomputed by the current weights and decoupled PPO
    (algo.lag_is_cap) weights each lagged token by how far the sampling policy was from them."""
    if (
        job.trainer.overlap_rollout
        and job.algo.old_log_prob_source != "rollout"
        and job.algo.lag_is_cap is None
    ):
        raise ConfigError(
            "trainer.overlap_rollout=true trains each batch one step after the weights that sampled "
            "it; a pi_old recomputed by the current weights is then not the sampling policy, and "
            "algo.lag_is_cap=null turns off the decoupled correction that accounts for it; set "
            "algo.lag_is_cap (e.g. 2.0), algo.old_log_prob_source=rollout or trainer.overlap_rollout=false"
        )
    if job.algo.old_log_prob_source != "rollout":
        return
    refused = "algo.old_log_prob_source=rollout takes pi_old from the engine, but"
    if job.rollout.quantization:
        raise ConfigError(
            f"{refused} rollout.quantization={job.rollout.quantization} samples from a quantized copy "
            "of the policy, whose log-probs are not the policy's; set algo.old_log_prob_source=trainer"
        )
    if job.rollout.sync_check == "off":
        raise ConfigError(
            f"{refused} rollout.sync_check=off leaves the gap between engine and trainer log-probs "
            "unmeasured; set algo.old_log_prob_source=trainer or rollout.sync_check=first"
        )


def load(overrides: Sequence[str] = (), world_size: int = 1) -> JobConfig:
    """Compose, type-check and validate in one call."""
    job = to_job_config(compose(overrides))
    validate(job, world_size)
    return job


def _reject_unknown_keys(node: DictConfig, schema: type, prefix: str) -> None:
    # Hydra's `+key=value` adds keys even to a structured config, and OmegaConf.to_object then drops
    # them silently: a typo would be ignored instead of reported.
    known = {f.name: f.type for f in dataclasses.fields(schema)}
    for key in node:
        if key not in known:
            raise _unknown_key(f"{prefix}{key}", known)
        child = node[key]
        child_schema = OmegaConf.get_type(node, str(key)) if isinstance(child, DictConfig) else None
        if child_schema is not None and dataclasses.is_dataclass(child_schema):
            _reject_unknown_keys(child, child_schema, prefix=f"{prefix}{key}.")


def _unknown_key(path: str, valid: typing.Iterable[str]) -> ConfigError:
    """One line naming the key and the valid ones nearest to it (all of them if none is near)."""
    prefix, _, name = path.rpartition(".")
    valid = sorted(valid)
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    if near:
        return ConfigError(f"unknown config key {path}; did you mean {', '.join(_dotted(prefix, near))}?")
    where = f"under {prefix}" if prefix else "at the top"
    return ConfigError(f"unknown config key {path}; valid keys {where}: {', '.join(valid)}.")


def _dotted(prefix: str, keys: list[str]) -> list[str]:
    return [f"{prefix}.{key}" if prefix else key for key in keys]


def _check_override_keys(overrides: Sequence[str], config_dir: Path) -> None:
    # Hydra refuses an unknown key too, but with a multi-line message and no suggestion; a typo such as
    # trainer.totl_steps deserves one line naming trainer.total_steps. Keys added with +/++ are checked
    # after composing (`_reject_unknown_keys`); config group choices (model=...) are Hydra's to check.
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.type in (OverrideType.ADD, OverrideType.FORCE_ADD) or key.split(".")[0] == "hydra":
            continue
        if (config_dir / key).is_dir():
            continue
        schema: type | None = JobConfig
        for depth, part in enumerate(key.split(".")):
            if schema is None:  # below a field that is not a dataclass (a list, a dict): Hydra checks
                break
            hints = typing.get_type_hints(schema)
            if part not in hints:
                raise _unknown_key(".".join(key.split(".")[: depth + 1]), hints)
            schema = _dataclass_of(hints[part])


def _dataclass_of(hint: object) -> type | None:
    """The dataclass a field holds (through `X | None`), or None."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _largest_divisor_at_most(value: int, limit: int) -> int:
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)
