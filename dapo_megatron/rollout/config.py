"""Rollout settings: the SGLang engine, sampling, and how weights reach it."""

from __future__ import annotations

import math
from dataclasses import dataclass

DECODE_S_PER_TOKEN = 0.04
"""An upper bound of a healthy engine's decode step: a 32B engine at TP 4 on H100s with its KV cache full of
20k-token rollouts takes an estimated 25-35 ms a step (each GPU reads its 16 GB of weights and up to ~49 GB
of cache per step at ~3.3 TB/s, plus 128 all-reduces); an estimate, not a measurement, hence the margin."""
QUEUE_FACTOR = 2
"""A request may wait for the full-length ones ahead of it before its KV cache fits (SGLang queues it, or
retracts it and recomputes it later): up to one more full-length generation."""
PREFILL_ALLOWANCE_S = 120.0
"""Prefill of the prompts, the first request's kernel compilation, a flush after a weight sync."""
MIN_REQUEST_TIMEOUT_S = 600.0
"""The floor of a derived timeout: short responses on a slow engine (CPU) take longer than the GPU bound."""


@dataclass
class RolloutConfig:
    # --- sampling (DAPO trains at temperature 1.0, top_p 1.0) ---
    n_samples_per_prompt: int = 8
    """Group size G: samples per prompt, normalised together by GRPO."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 16
    """max_new_tokens; responses cut here finish with reason `length`."""
    max_prompt_length: int = 64

    # --- engine ---
    engine_tp_size: int = 1
    """Tensor-parallel size of each SGLang engine (one engine per group of this many GPUs)."""
    num_engines: int = 0
    """SGLang engines in the job; 0 = one per `engine_tp_size` GPUs on CUDA, one on CPU. Each is launched
    by the first rank of an equal block of ranks, on that block's devices (`trainer/placement.py`)."""
    mem_fraction_static: float = 0.5
    """Share of GPU memory SGLang takes for weights + KV cache (ignored on CPU)."""
    max_total_tokens: int = 65536
    """KV-cache capacity in tokens on CPU, where there is no memory fraction to size it from. Below
    `max_concurrent_requests x (max_prompt_length + max_response_length)` the engine queues requests and
    retracts running ones (recomputing them) when it fills, which costs generation time; a CPU engine warns
    at start (`kv_shortfall`). The default holds 256 requests of the ~30M benchmark's length (see
    bench/RESULTS.md, 'Engine KV cache')."""
    dtype: str = "auto"
    """Engine dtype; auto = the policy's params_dtype."""
    quantization: str | None = None
    """`fp8`: SGLang quantizes the synced weights to FP8 (`--quantization fp8`, GPU only) for faster
    generation. The rollout policy then differs from the trained one, so it requires truncated importance
    sampling (algo.tis_cap) and a looser rollout.sync_check_tolerance. None: the engine dtype."""
    seed: int | None = None
    """Seed of the rollout: engine i's sampler gets `seed + i` (`--random-seed`, always passed, so no two
    engines draw the same random stream; `engine_seed`), and the per-sample seeds of `deterministic` derive
    from `seed` itself, whichever engine serves the sample; None = the job seed
    (`rollout/fleet.rollout_config`)."""
    deterministic: bool = False
    """Reproducible sampling (GPU only): SGLang's deterministic inference (`--enable-deterministic-inference`,
    batch-invariant kernels: a sequence's logits do not depend on what it is batched with) plus a seed per
    sample derived from the seed, the data position at the start of the step, the prompt's draw number and
    uid, and the sample's index (`rollout/client.sample_seed`). A resumed dynamic_sampling_mode=batch_sync job
    then regenerates the first run's samples at each step, given the same weights; in streaming mode which
    in-flight groups a full batch cuts off still depends on timing. SGLang then picks a deterministic
    attention backend (fa3 on Hopper, flashinfer on Blackwell) and its pytorch sampler, which are slower.
    Refused on CPU: SGLang refuses deterministic inference with the CPU engine's torch_native attention, and
    without it ignores per-request seeds."""
    startup_timeout_s: float = 300.0
    request_timeout_s: float | None = None
    """How long one group's request may take (a group returns with its slowest sample) before the client
    aborts it and the job fails; it also bounds each weight push. None = derived from the response budget
    (`resolved_request_timeout_s`, written in by `rollout/fleet.rollout_config`): 2 x 20480 x 40 ms + 120 s =
    1759 s for the 7B and 32B recipes, the 600 s floor for shorter responses. The collective timeout is built
    from it (`trainer/timeout.py`)."""
    max_concurrent_requests: int = 256
    log_dir: str | None = None
    """Engine logs; None = <output_dir>/logs."""
    cpu_idle_cores: bool = True
    """CPU engines: while the trainer only waits for its engine (the rest of a batch generated ahead, a
    synchronous rollout, an evaluation, the first sync's check) the engine computes on the rank's whole share
    of the cores; beside an update it keeps to the threads it was started with (OMP_NUM_THREADS, else one),
    so the two never oversubscribe the cores. The trainer's side is trainer.cpu_idle_cores; both are applied
    by trainer/cpu_threads.py. It pays where generation dominates the wait (a ~30M model); at the demo's 165k
    parameters the driving rank's streaming and reward scoring, which run during the same wait, need the
    second core as much as the engine does, so the demo turns it off (see bench/RESULTS.md, 'CPU idle
    cores'). Ignored on GPUs."""

    # --- weight sync ---
    sync_bucket_mb: int = 512
    """Size of each bucket of HF tensors pushed to the engine; bounds the extra memory during a sync."""
    sync_method: str = "tensor"
    """`tensor` (update_weights_from_tensor: CUDA IPC on GPU, shared memory on CPU) or `distributed`
    (update_weights_from_distributed: broadcast over a process group shared with the engine)."""
    sync_check: str = "first"
    """Compare engine and trainer log-probs on a probe batch after a sync: `always`, `first` (the first
    sync, then every `sync_check_every` steps) or `off`."""
    sync_check_every: int = 50
    sync_check_tolerance: float = 1e-3
    """Largest allowed |engine - trainer| log-prob on the probe batch (fp32; use ~0.05 for bf16)."""

    def engine_seed(self, index: int) -> int | None:
        """The sampler seed of engine `index` (`--random-seed`): `seed + index`; None when seed is None
        (SGLang then draws one at random)."""
        return None if self.seed is None else self.seed + index

    @property
    def resolved_request_timeout_s(self) -> float:
        """request_timeout_s, or the one derived from max_response_length when it is None."""
        if self.request_timeout_s is not None:
            return self.request_timeout_s
        return derived_request_timeout_s(self.max_response_length)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest rollout: max_prompt_length + max_response_length tokens."""
        return self.max_prompt_length + self.max_response_length

    @property
    def max_in_flight_tokens(self) -> int:
        """The KV cache one engine needs for all its max_concurrent_requests at full length. An upper bound:
        the samples of a group share their prompt's cache entries."""
        return self.max_concurrent_requests * self.max_sequence_tokens

    def kv_shortfall(self) -> str | None:
        """Why the CPU engine's KV cache (max_total_tokens) cannot hold every concurrent request at full
        length, or None when it can."""
        per_request, needed = self.max_sequence_tokens, self.max_in_flight_tokens
        if needed <= self.max_total_tokens:
            return None
        return (
            f"rollout.max_total_tokens={self.max_total_tokens} holds {self.max_total_tokens // per_request} "
            f"of rollout.max_concurrent_requests={self.max_concurrent_requests} requests of up to "
            f"{per_request} tokens: the engine queues the rest and retracts running requests when its KV "
            f"cache fills, recomputing them. Set rollout.max_total_tokens={needed} (or lower "
            "max_concurrent_requests)."
        )

    def __post_init__(self) -> None:
        positive = (
            "n_samples_per_prompt",
            "max_response_length",
            "max_prompt_length",
            "engine_tp_size",
            "max_total_tokens",
            "max_concurrent_requests",
            "sync_bucket_mb",
            "sync_check_every",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1; got {getattr(self, name)}.")
        if self.num_engines < 0:
            raise ValueError(f"rollout.num_engines must be >= 0 (0 = automatic); got {self.num_engines}.")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for RL sampling; got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1]; got {self.top_p}.")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"rollout.mem_fraction_static must be in (0, 1); got {self.mem_fraction_static}."
            )
        for name in ("startup_timeout_s", "request_timeout_s", "sync_check_tolerance"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be > 0; got {getattr(self, name)}.")
        if self.sync_method not in ("tensor", "distributed"):
            raise ValueError(f"rollout.sync_method must be tensor or distributed; got {self.sync_method!r}.")
        if self.sync_check not in ("always", "first", "off"):
            raise ValueError(f"rollout.sync_check must be always, first or off; got {self.sync_check!r}.")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"rollout.quantization must be null or fp8; got {self.quantization!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"rollout.dtype must be auto, float32, bfloat16 or float16; got {self.dtype!r}.")


def derived_request_timeout_s(max_response_length: int) -> float:
    """The default `request_timeout_s`: a full-length group decoded at the slowest healthy step, after
    waiting for as long again (QUEUE_FACTOR), plus the prefill allowance; at least MIN_REQUEST_TIMEOUT_S.
    Whole seconds."""
    bound = QUEUE_FACTOR * max_response_length * DECODE_S_PER_TOKEN + PREFILL_ALLOWANCE_S
    return float(max(MIN_REQUEST_TIMEOUT_S, math.ceil(bound)))
