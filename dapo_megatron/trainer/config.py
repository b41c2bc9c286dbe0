"""Optimizer and training-loop settings owned by the actor."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimConfig:
    optimizer: str = "adam"
    """megatron-core optimizer name; `adam` with weight decay is AdamW (decoupled)."""
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_rollout_steps: int = 0
    """Linear warm-up length in rollout steps (the paper: 20). The schedule advances once per optimizer step,
    over this many times trainer.train_batch_size / trainer.ppo_mini_batch_size optimizer steps."""
    lr_warmup_steps: int | None = None
    """Replaced by lr_warmup_rollout_steps (this one counted optimizer steps); setting it is an error saying
    so."""
    weight_decay: float = 0.1
    decay_all_parameters: bool = False
    """Apply weight_decay to every parameter, as torch's AdamW over all parameters does (the paper's verl/FSDP
    run). False: megatron-core's rule, no decay for biases and 1-D parameters (the norms' weights)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer must be adam or sgd; got {self.optimizer!r}.")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0; got {self.lr}.")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr={self.lr}]; got {self.min_lr}.")
        if self.lr_warmup_steps is not None:
            raise ValueError(
                "optim.lr_warmup_steps is gone: set optim.lr_warmup_rollout_steps, which counts rollout "
                "steps (the paper: 20; each is trainer.train_batch_size / trainer.ppo_mini_batch_size "
                f"optimizer steps); got optim.lr_warmup_steps={self.lr_warmup_steps}."
            )
        if self.lr_warmup_rollout_steps < 0:
            raise ValueError(
                f"optim.lr_warmup_rollout_steps must be >= 0; got {self.lr_warmup_rollout_steps}."
            )
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0; got {self.weight_decay}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1); got {getattr(self, name)}.")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0 (0 disables clipping); got {self.clip_grad}.")


WARMUP_EVAL_MODES = ("greedy", "teacher_forced")


@dataclass
class WarmupConfig:
    """Supervised warm-up that teaches a from-scratch demo model the answer format before RL
    (the DAPO paper starts from a pretrained base model instead; real recipes disable this)."""

    enabled: bool = True
    max_steps: int = 1500
    batch_size: int = 64
    micro_batch_size: int = 32
    lr: float = 3e-3
    target_accuracy: float = 0.22
    """Stop once greedy held-out accuracy reaches this. Accuracy rises steeply once it starts, so a
    measured stopping point gives RL the same starting difficulty on every machine and seed; stopping
    inside that rise (rather than just before it, at ~15%) is what lets DAPO take over quickly."""
    eval_every: int = 5
    eval_size: int = 200
    eval_mode: str = "greedy"
    """How held-out accuracy is measured. `greedy`: greedy decoding with the trainer's model, scored by DAPO's
    scorer; one forward pass over the whole prefix per generated token (no KV cache), cheap for the demo's
    ~10-token answers and prohibitive on CPU for `data.task=column_addition`'s ~100. `teacher_forced`: the
    share of problems whose whole target and EOS are the model's argmax at every position given the target so
    far, which is exactly when greedy decoding writes the target: one forward pass, and a lower bound of the
    greedy accuracy (which also counts right answers reached with other working)."""
    max_new_tokens: int | None = None
    """Generation cap of the `greedy` evaluation; None: the longest held-out target plus EOS."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "micro_batch_size", "eval_every", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmup.{name} must be >= 1; got {getattr(self, name)}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"warmup.max_new_tokens must be >= 1 or null; got {self.max_new_tokens}.")
        if self.eval_mode not in WARMUP_EVAL_MODES:
            raise ValueError(f"warmup.eval_mode must be one of {WARMUP_EVAL_MODES}; got {self.eval_mode!r}.")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"warmup.batch_size ({self.batch_size}) must be a multiple of "
                f"warmup.micro_batch_size ({self.micro_batch_size})."
            )
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"warmup.target_accuracy must be in (0, 1]; got {self.target_accuracy}.")
        if self.lr <= 0:
            raise ValueError(f"warmup.lr must be > 0; got {self.lr}.")


@dataclass
class TrainerConfig:
    """The DAPO loop: batch sizes, dynamic sampling, checkpoints. Sizes count prompt groups (each of
    rollout.n_samples_per_prompt samples) unless they say sequences."""

    total_steps: int = 100
    """Rollout steps (each: generate a batch, then one or more optimizer steps on it)."""
    train_batch_size: int = 16
    """Prompt groups per rollout step (the paper: 512)."""
    ppo_mini_batch_size: int = 16
    """Prompt groups per optimizer step; train_batch_size / ppo_mini_batch_size optimizer steps run on
    each rollout batch (the paper: 512 / 32 = 16)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward micro-batch on one data-parallel rank (without a token budget)."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a micro-batch: rows x its longest row, in label positions, after the padding the model
    computes (sequence parallelism, FP8 alignment: `models/sequence_padding.py`). Set: each optimizer step's
    rows are sorted by length and packed into micro-batches within the budget, the same number on every
    data-parallel rank and tokens balanced across ranks (trainer/packing.py); micro_batch_size then only
    sizes the weight-sync check's forward pass. None or 0: micro_batch_size rows per micro-batch in batch
    order. Must hold the longest row, rollout.max_prompt_length + rollout.max_response_length, padded."""

    dynamic_sampling: bool = True
    """Drop groups whose samples are all right or all wrong and keep generating until the batch is full."""
    dynamic_sampling_mode: str = "streaming"
    """`streaming`: judge each group as it completes, admit informative groups in draw order, abort
    in-flight requests once the batch is full and resolve the prompts drawn past it first next step.
    `batch_sync`: verl's recipe (generate gen_batch_size prompts, wait for all, filter, truncate,
    repeat), for comparison."""
    gen_batch_size: int = 48
    """Prompts submitted per generation round (verl's recipe uses 3 x train_batch_size)."""
    max_gen_rounds: int = 10
    """Rounds allowed to fill one batch. When they run out: `on_unfilled_batch`."""
    on_unfilled_batch: str = "error"
    """`error` (stop, as verl does: the data is too easy or too hard for dynamic sampling) or `train`
    (train on the groups collected so far and log it)."""
    carry_over: bool = True
    """Streaming: prompts drawn past a full batch go first next step, finished informative groups as they
    are and aborted prompts generated again. False: they are skipped, as verl drops what does not fit."""
    max_carry_groups: int = 64
    """Streaming: at most this many prompts drawn past a full batch carry over (in draw order, finished or
    aborted); the rest are skipped. Bounds how stale a carried group can be."""

    overlap_rollout: bool = False
    """Generate the next batch while the policy trains on this one: the engine samples batch k+1 with the
    weights before update k, so every batch after the first is one step off-policy (verl's one-step
    off-policy mode). π_old is then either the policy that sampled it (algo.old_log_prob_source=rollout) or
    the current weights' recomputation with decoupled PPO's correction (old_log_prob_source=trainer and
    algo.lag_is_cap: the trust region stays around the weights being updated, at the cost of a forward pass;
    bench/RESULTS.md, 'Generating ahead and learning'). The engine needs devices of its own: on CPU it runs
    on other cores; colocated GPU engines hand their memory to the trainer during the update, so it is
    refused there. A checkpoint keeps the batch generated ahead, so a resumed run trains on it next."""
    offload_during_rollout: bool = False
    """Keep this rank's training state in host memory while the engine generates: its parameters, gradient
    buffers and optimizer state (fp32 main parameters, Adam's moments; with the distributed optimizer only
    this rank's shard) move out after the weight sync and back before the update (`trainer/offload.py`; host
    memory pinned on GPUs). A colocated engine then generates on a GPU without them (`tools/plan_memory.py`
    shows its KV cache with and without; each move of the 32B recipe's 25.75 GiB per GPU is planned at
    ~1.1 s). The engine's KV cache is sized when it starts and resumed by the weight sync, both with the
    state still on the GPU: a larger cache also needs those two done without it (bench/RESULTS.md, 'Rollout
    memory of the 32B recipe'). Exact: the bytes come back as they left. On CPU the same moves run, and gain
    nothing: the parameters the engine maps stay in shared memory. Needs the trainer idle while the engine
    generates, so not with overlap_rollout."""
    cpu_idle_cores: bool = True
    """CPU jobs: the trainer computes on this rank's whole share of the cores (its CPU affinity over the ranks
    of the node) whenever the engine is not generating (a synchronous update; generating ahead, the optimizer
    steps that start once the batch ahead is complete, checked between optimizer steps), and on the threads it
    was started with (OMP_NUM_THREADS; tools/demo.sh sets 1; unset, the share less the engine's one thread)
    while the engine generates beside the update: more threads there would oversubscribe the cores (see
    bench/RESULTS.md, 'CPU idle cores'). False: always the threads it was started with. The engine's side is
    rollout.cpu_idle_cores; both are applied by trainer/cpu_threads.py. Ignored on GPUs. Whole-tensor sums
    (the gradient norm) can differ in the last bit between thread counts, and generating ahead the switch
    depends on timing: set false where two runs of the trainer must agree bit for bit."""

    save_every: int = 0
    """Checkpoint every N rollout steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    hf_export_every: int = 0
    resume: str = "auto"
    """`auto` (latest complete checkpoint in output_dir, if any), `never`, or a checkpoint path."""
    load: str | None = None
    """A torch_dist checkpoint to start from (tools/convert_hf_to_megatron.py output). Without it the
    policy starts from model.hf_dir's weights."""
    overwrite: bool = False
    """Allow a run that does not resume (`resume=never`, or `auto` without a tracker) to write checkpoints
    into an output_dir that already holds some. Without it such a start is refused: it would replace another
    run's checkpoints and move the tracker backwards."""
    keep_last_checkpoints: int = 0
    """Keep the N newest complete checkpoints and delete older ones, each only after a newer one is complete
    (0: keep all). A 32B checkpoint with optimizer state is ~450 GB."""
    keep_checkpoint_every: int = 0
    """With keep_last_checkpoints, also keep every checkpoint whose step is a multiple of N (milestones; 0:
    none)."""
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    """Where the metrics go (logging rank): `tensorboard` and `jsonl` (output_dir/tensorboard/metrics.jsonl),
    and `wandb` (a Weights & Biases run in project wandb_project named experiment_name, the resolved config
    attached; online or offline as WANDB_MODE says)."""
    wandb_project: str = "dapo_megatron"
    log_level: str = "INFO"
    """The `dapo_megatron` console logger's level on the logging rank (WARNING quiets the step lines)."""

    def __post_init__(self) -> None:
        for name in (
            "total_steps",
            "train_batch_size",
            "ppo_mini_batch_size",
            "micro_batch_size",
            "gen_batch_size",
            "max_gen_rounds",
            "max_carry_groups",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1; got {getattr(self, name)}.")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 0:
            raise ValueError(
                "trainer.max_tokens_per_micro_batch must be >= 0 (0 or null: fixed micro_batch_size); "
                f"got {self.max_tokens_per_micro_batch}."
            )
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(
                f"trainer.train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"trainer.ppo_mini_batch_size ({self.ppo_mini_batch_size})."
            )
        if self.dynamic_sampling_mode not in ("streaming", "batch_sync"):
            raise ValueError(
                "trainer.dynamic_sampling_mode must be streaming or batch_sync; "
                f"got {self.dynamic_sampling_mode!r}."
            )
        if self.on_unfilled_batch not in ("error", "train"):
            raise ValueError(
                f"trainer.on_unfilled_batch must be error or train; got {self.on_unfilled_batch!r}."
            )
        if self.offload_during_rollout and self.overlap_rollout:
            raise ValueError(
                "trainer.offload_during_rollout moves the trainer's state out while the engine generates, "
                "and trainer.overlap_rollout generates during the update, which needs that state: set one "
                "of them false."
            )
        unknown = sorted(set(self.loggers) - {"tensorboard", "jsonl", "wandb"})
        if unknown:
            raise ValueError(f"trainer.loggers: unknown {unknown}; choose from tensorboard, jsonl, wandb.")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(
                f"trainer.log_level must be DEBUG, INFO, WARNING or ERROR; got {self.log_level!r}."
            )
        for name in ("save_every", "hf_export_every", "keep_last_checkpoints", "keep_checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0; got {getattr(self, name)}.")

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per rollout step."""
        return self.train_batch_size // self.ppo_mini_batch_size


@dataclass
class EvalConfig:
    """Held-out evaluation: k samples per problem, avg@k and pass@k (DAPO: AIME, k=32, T=1.0, top_p=0.7)."""

    every: int = 10
    """Evaluate every N rollout steps (and before the first); 0 disables."""
    num_problems: int = 200
    samples_per_problem: int = 1
    temperature: float = 1.0
    top_p: float = 0.7
    max_response_length: int | None = None
    """None = rollout.max_response_length."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.num_problems < 1 or self.samples_per_problem < 1:
            raise ValueError(
                "eval.every must be >= 0, eval.num_problems and eval.samples_per_problem >= 1; got "
                f"{self.every}, {self.num_problems}, {self.samples_per_problem}."
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"eval.temperature must be >= 0 and eval.top_p in (0, 1]; got {self.temperature}, "
                f"{self.top_p}."
            )
