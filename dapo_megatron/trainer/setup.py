"""Everything one training job holds, built once: policy, optimizer, rollout engine, rewards, prompts.

The driving rank (global rank 0) owns the rollout client (for every engine), the reward workers and the
prompt stream; the first rank of each engine's block launches that SGLang engine (`rollout/placement.py`);
every rank owns its shard of the policy. `Session` gives the driver loop the handful of
operations it needs and hides which rank does what.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dapo_megatron import checkpoint
from dapo_megatron.config import JobConfig
from dapo_megatron.data.tokenizer import load_tokenizer
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.models.qwen2 import build_gpt_model
from dapo_megatron.models.weights import export_hf, load_hf_weights
from dapo_megatron.rollout.engine import raise_if_any_died
from dapo_megatron.rollout.placement import check_overlap, engine_placement, launch_engine, rollout_config
from dapo_megatron.rollout.weight_sync import SYNC_METHODS, WeightSync, WeightSyncError, check_sync
from dapo_megatron.trainer.actor import Actor, PolicyRows
from dapo_megatron.trainer.batch import ScoredGroup, build_rows, policy_lag
from dapo_megatron.trainer.cpu_threads import TrainerThreads
from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training
from dapo_megatron.trainer.prompts import build_prompt_sources
from dapo_megatron.trainer.rollout import Prompt, RolloutManager
from dapo_megatron.trainer.sync_probe import engine_log_probs, probe_rows

if TYPE_CHECKING:
    from dapo_megatron.rollout.engine import EngineRecord, SGLangEngine

PROBE_PROMPTS = 4
PROBE_CONTINUATION = "Answer: 12"
"""Teacher-forced after a few eval prompts to compare engine and trainer log-probs after a sync."""


class Session:
    """Args:
        engine: this rank's engine if the caller launched it already (`launch_engine`); otherwise Session
            launches it, on CPU while the policy is built, on GPU after (see `__init__`).
    """

    def __init__(self, job: JobConfig, layout: ParallelLayout, engine: SGLangEngine | None = None) -> None:
        self.job, self.layout = job, layout
        self.out = Path(job.output_dir)
        if not job.model.hf_dir:
            raise ValueError("model.hf_dir is required: the Hugging Face directory with the tokenizer (and the "
                             "initial weights unless trainer.load is set); the demo builds one with "
                             "tools/make_demo_base.py")
        self.tokenizer = load_tokenizer(job.model.hf_dir)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stop_token_ids = [self.tokenizer.eos_token_id]
        self.client = self.rewards = self.rollouts = None
        self.engine = engine
        self.engines = engine_placement(layout.world_size, job.rollout, layout.device.type)
        check_overlap(job, layout.device.type)
        self._ahead: Future[tuple[Any, dict[str, float]]] | None = None
        """The next batch, generated during the current update (trainer.overlap_rollout; driving rank)."""
        self._ahead_worker: ThreadPoolExecutor | None = None
        self.timings: dict[str, float] = {}
        """Start-up phases in seconds, for the console and TensorBoard."""
        started = time.perf_counter()
        if engine is None and layout.device.type == "cpu":
            # SGLang's start-up overlaps with building the policy. Not on GPUs: the engine sizes its KV cache
            # from the memory left free, which must already exclude ours.
            self._launch_engine()
        try:
            self.model = wrap_for_training(build_gpt_model(job.model, job.parallel, layout), job.parallel)
            optimizer, scheduler = build_optimizer(self.model, job.optim, job.parallel, job.model)
            self.actor = Actor(self.model, optimizer, scheduler, job.algo, layout, vocab_size=job.model.vocab_size,
                               temperature=job.rollout.temperature)
            self.sync: WeightSync | None = None
            self.eval_prompts: list[Prompt] = []
            self.start_step = self._load_initial_state()
        except BaseException:
            if self.engine is not None:
                self.engine.shutdown()
            raise
        self._last_check = -1
        self._released = False
        self.timings["startup/policy_s"] = time.perf_counter() - started

    # ------------------------------------------------------------------ set-up

    def __enter__(self) -> Session:
        started = time.perf_counter()
        if self.engine is None and self.layout.device.type != "cpu":  # on CPU `__init__` launched it
            self._launch_engine()
        if self.engine is not None:
            self.engine.wait_until_ready()
        self.timings["startup/engine_wait_s"] = time.perf_counter() - started
        records: list[EngineRecord | None] = [None] * self.layout.world_size
        torch.distributed.all_gather_object(records, self.engine.record() if self.engine is not None else None)
        self.engine_records = [record for record in records if record is not None]  # in engine order
        # This rank's own engine is watched through its processes, the others through their records.
        self.watched: list[SGLangEngine | EngineRecord] = [
            self.engine if self.engine is not None and record.url == self.engine.url else record
            for record in self.engine_records]
        started = time.perf_counter()
        if self.layout.is_logging_rank:
            self._start_rollout_side()
        self.timings["startup/rollout_side_s"] = time.perf_counter() - started
        self.sync = SYNC_METHODS[self.job.rollout.sync_method](
            [record.url for record in self.engine_records], self.job.model, self.layout,
            bucket_bytes=self.job.rollout.sync_bucket_mb * 2**20, engine_tp_size=self.job.rollout.engine_tp_size,
            timeout_s=self.job.rollout.request_timeout_s,
            engine_owners=[self.engines.owner(e) for e in range(self.engines.num_engines)])
        self.probe = self._probe_rows()
        nodes: list[int | None] = [None] * self.layout.world_size
        torch.distributed.all_gather_object(nodes, self.layout.node)
        self.threads = TrainerThreads.for_job(self.layout.device.type, use_idle_cores=self.job.trainer.cpu_idle_cores,
                                              ranks_on_node=nodes.count(self.layout.node), engine=self.engine,
                                              engine_idle_cores=self.job.rollout.cpu_idle_cores)
        self.threads.engine_idle()  # until a batch is generated ahead
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ahead is not None and not self._ahead.done():  # left by an error: stop generating, then close
            with contextlib.suppress(Exception):  # best effort: the error that got us here is the one to report
                self.rollouts.cancel()
            self._ahead.exception()
        if self._ahead_worker is not None:
            self._ahead_worker.shutdown()
        # The sync first: a distributed sync's group is torn down on the engine's side too, while it still runs.
        for resource in (self.sync, self.client, self.rewards, self.engine):
            if resource is not None:
                (resource.shutdown if hasattr(resource, "shutdown") else resource.close)()

    def _launch_engine(self) -> None:
        layout = self.layout
        self.engine = launch_engine(self.job, rank=layout.rank, world_size=layout.world_size,
                                    local_rank=layout.local_rank, master_addr=layout.master_addr,
                                    device=layout.device.type)

    def _start_rollout_side(self) -> None:
        from dapo_megatron.rewards.pool import RewardPool
        from dapo_megatron.rollout.client import RolloutClient
        from dapo_megatron.rollout.engine import liveness_check

        job = self.job
        rollout = rollout_config(job)
        self.client = RolloutClient([record.url for record in self.engine_records], rollout,
                                    on_error=liveness_check(self.watched))
        self.rewards = RewardPool(job.reward)
        train, self.eval_prompts = build_prompt_sources(job, self.tokenizer)
        if self._prompt_state is not None:
            train.load_state_dict(self._prompt_state)
        self.rollouts = RolloutManager(self.client, self.rewards, train, rollout=rollout, trainer=job.trainer,
                                       decode=self._decode, stop_token_ids=self.stop_token_ids, progress=True)
        self.rollouts.backlog = self._backlog

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _load_initial_state(self) -> int:
        """Resume from the latest checkpoint, else start from trainer.load or the HF weights. Returns the step."""
        self._prompt_state, self._backlog = None, []
        resume, root = self.job.trainer.resume, self.out / "checkpoints"
        path = None
        if resume == "auto" and (root / checkpoint.TRACKER_FILE).exists():
            path = root
        elif resume not in ("auto", "never"):
            path = Path(resume)
        if path is not None:
            directory = checkpoint.load_model(self.model, path)
            rank_state, shared = checkpoint.load_training_state(directory, self.layout)
            self.actor.load_state_dict(rank_state)
            # Checkpoints older than the backlog carried finished groups without their prompts: start afresh.
            self._prompt_state, self._backlog = shared["prompts"], shared.get("backlog", [])
            if shared.get("ahead") is not None:  # generated ahead before the checkpoint: trained on next
                self._ahead = Future()
                self._ahead.set_result(shared["ahead"])
            return shared["step"]
        if self.job.trainer.load:
            checkpoint.load_model(self.model, self.job.trainer.load)
        else:
            load_hf_weights(self.model, self.job.model.hf_dir, self.job.model, self.layout)
        return 0

    def _probe_rows(self) -> PolicyRows:
        # The driving rank holds the evaluation prompts; every rank needs the probe.
        objects = [[p.ids for p in self.eval_prompts[:PROBE_PROMPTS]] if self.layout.is_logging_rank else None]
        torch.distributed.broadcast_object_list(objects, src=0)
        prompts = objects[0]
        self._probe_prompts = prompts
        self._probe_continuations = [self._encode(PROBE_CONTINUATION)] * len(prompts)
        return probe_rows(prompts, self._probe_continuations, pad_token_id=self.pad_token_id)

    # ------------------------------------------------------------------ what the loop calls

    def training_batch(self, groups: list[ScoredGroup] | None, step: int) -> tuple[PolicyRows, dict[str, float]]:
        """Rewards, advantages and token tensors built on the driving rank, handed to every rank, for rollout
        step `step` (which trains the weights pushed after step - 1)."""
        objects: list[Any] = [None]
        if self.layout.is_logging_rank:
            rows, metrics = build_rows(groups, self.job.algo, max_response_length=self.job.rollout.max_response_length,
                                       pad_token_id=self.pad_token_id)
            objects = [(rows, {**metrics, **policy_lag(groups, step - 1)})]
        torch.distributed.broadcast_object_list(objects, src=0)
        return objects[0]

    def collect_rollouts(self) -> tuple[Any, dict[str, float]]:
        """The next batch's groups and rollout metrics (driving rank; None elsewhere): the batch generated ahead
        during the last update if there is one, else generated now."""
        if not self.layout.is_logging_rank:
            return None, {}
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return ahead.result()
        return self.rollouts.collect()

    def generate_ahead(self) -> None:
        """Start collecting the next batch in the background, with the weights the engine holds now. Collective
        in effect: every rank leaves the engine its cores until `wait_for_ahead`."""
        if self.layout.is_logging_rank:
            if self._ahead_worker is None:
                self._ahead_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
            self._ahead = self._ahead_worker.submit(self.rollouts.collect)
        self.threads.engine_generating(self._ahead)

    def wait_for_ahead(self) -> float:
        """Block until the batch generated ahead is complete (the engine takes no weights while it generates);
        raises what its generation raised. Returns the seconds waited."""
        started = time.perf_counter()
        self.threads.trainer_waiting()
        if self._ahead is not None:
            self._ahead.result()
        self.threads.engine_idle()
        return time.perf_counter() - started

    @property
    def _offloads(self) -> bool:
        """On GPUs the engine gives its memory back while megatron trains (on CPU SGLang keeps it anyway)."""
        return self.layout.device.type == "cuda"

    def release_rollout_memory(self) -> None:
        if self._offloads and self.engine is not None:
            self.engine.release_memory()
            self._released = True
        torch.distributed.barrier()

    def sync_weights(self, step: int) -> float:
        """Push the weights as version `step-N`; check them against the trainer when due. Collective.

        On GPUs the engine's memory comes back in stages so the peak stays low: its weights first, then the
        push, then the KV cache once nothing of the trainer's transient buffers is needed any more."""
        started = time.perf_counter()
        version = f"step-{step}"
        released = self._released
        if released:
            # PyTorch's caching allocator still holds the training step's peak; hand it back to the
            # driver so SGLang can allocate its weights and KV cache in that memory.
            torch.cuda.empty_cache()
            self.engine.resume_memory(["weights"])
        torch.distributed.barrier()
        try:
            self.sync.sync(self.model, version)
        except WeightSyncError as failure:  # a push refused because an engine died: say which, with its log
            raise_if_any_died(self.watched, failure)
            raise
        if released:
            torch.cuda.empty_cache()  # the sync's transient buffers
            self.engine.resume_memory(["kv_cache", "cuda_graph"])
            self._released = False
        mode, every = self.job.rollout.sync_check, self.job.rollout.sync_check_every
        if mode == "always" or (mode == "first" and (self._last_check < 0 or step - self._last_check >= every)):
            self.check_sync(version)
            self._last_check = step
        return time.perf_counter() - started

    def check_sync(self, version: str) -> float:
        """Compare every engine's log-probs on the probe batch with the trainer's; raises WeightSyncError beyond
        rollout.sync_check_tolerance. Collective; returns the largest difference (0.0 off the driving rank)."""
        # SGLang scores given tokens untempered, so compare at temperature 1.
        trainer = self.actor.compute_log_probs(self.probe, self.job.trainer.micro_batch_size, temperature=1.0)
        if not self.layout.is_logging_rank:
            return 0.0
        gaps = [0.0]
        for index, url in enumerate(self.client.urls):  # each engine got its weights its own way
            engine = engine_log_probs(self.client, self._probe_prompts, self._probe_continuations, engine=index)
            gaps.append(check_sync(trainer, engine, self.probe.response_mask,
                                   tolerance=self.job.rollout.sync_check_tolerance, version=version, engine=url))
        return max(gaps)

    def evaluate(self) -> dict[str, float]:
        if not self.layout.is_logging_rank:
            return {}
        from dapo_megatron.trainer.evaluate import evaluate

        return evaluate(self.client, self.eval_prompts, self.rewards, self.job.eval, decode=self._decode,
                        max_new_tokens=self.job.eval.max_response_length or self.job.rollout.max_response_length,
                        stop_token_ids=self.stop_token_ids)

    def save(self, step: int) -> Path:
        rank_state = self.actor.state_dict()
        shared = None
        if self.layout.is_logging_rank:
            shared = {"step": step, "prompts": self.rollouts.prompts.state_dict(), "backlog": self.rollouts.backlog,
                      "ahead": self._ahead.result() if self._ahead is not None else None}
        return checkpoint.save_model(self.model, self.out / "checkpoints", step, self.job.model, self.layout,
                                     rank_state=rank_state, shared_state=shared)

    def export_hf(self, step: int) -> None:
        export_hf(self.model, self.job.model, self.layout, self.out / "hf" / f"step_{step:07d}",
                  tokenizer_dir=self.job.model.hf_dir)

