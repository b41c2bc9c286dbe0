"""Generation requests to an SGLang server: grouped samples streamed as they finish, aborts, and
teacher-forced log-probs for weight-sync checks.

Each prompt's group of n samples is one batch request whose n copies of the prompt carry their own
request ids (`rid`): SGLang's own `n` parameter would rename the samples' ids, and then a group could
no longer be aborted. With several engines each group goes to the one with the fewest groups in flight, so
a group's samples share one engine's weights and a slow engine gets less work. Requests run on a thread
pool; the caller's thread pulls prompts from its iterable and yields groups in the order they complete, so
DAPO's dynamic sampling can score each group as soon as it is done and stop pulling prompts when it has
enough.

Log-prob semantics (SGLang defaults, verified against Hugging Face in tests/integration):
* sampled tokens: `log_softmax(logits / temperature)` at the sampled token, taken before top-p/top-k
  truncation; with temperature 0 (greedy) `log_softmax(logits)`;
* teacher-forced tokens: `log_softmax(logits)`, untempered; SGLang ignores the temperature for
  log-probs of tokens it is given rather than samples.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NoReturn, TextIO, cast

import requests
from requests.adapters import HTTPAdapter
from tqdm import tqdm

from dapo_megatron.records import FinishReason, Sample
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine_auth import ENGINE_AUTH

_FINISH_REASONS = ("stop", "length", "abort")
_CONNECT_TIMEOUT_S = 10.0
_ABORT_TIMEOUT_S = 30.0
_REABORT_EVERY_S = 0.5
_PROGRESS_LOG_EVERY_S = 30.0


class RolloutError(RuntimeError):
    """A generation or scoring request to the engine failed; the message names the request."""


@dataclass(slots=True)
class _Group:
    key: Hashable
    prompt_ids: list[int]
    rids: list[str]
    url: str
    """The engine generating it."""
    seeds: list[int] | None = None
    """Per-sample `sampling_seed`s (rollout.deterministic), else None."""
    aborted: bool = False
    """Set by abort/abort_all; the stream re-sends the abort until the group has come back."""


@dataclass(eq=False)
class _Stream:
    """In-flight groups of one `stream_groups` call; `stopped` ends prompt pulling (abort_all, errors)."""

    in_flight: dict[Future[list[Sample]], _Group] = field(default_factory=dict)
    stopped: threading.Event = field(default_factory=threading.Event)


class RolloutClient:
    """HTTP client of one or more SGLang engines serving the same weights.

    Args:
        urls: the engines' base URLs (or one URL), e.g. `SGLangEngine.url`.
        cfg: sampling defaults (n_samples_per_prompt, temperature, top_p, top_k, max_response_length),
            request_timeout_s and max_concurrent_requests (per engine).
        on_error: called with the engine's URL before a failed request to it is reported; raise from it to
            report something more useful instead, e.g. that the engine died, with its log.
    Every request carries the API key registered for its engine (`rollout/engine_auth.py`).
    """

    def __init__(
        self, urls: str | Sequence[str], cfg: RolloutConfig, *, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.urls = [url.rstrip("/") for url in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("RolloutClient needs at least one engine URL")
        self.cfg = cfg
        self.on_error = on_error
        self._session = requests.Session()
        self._session.auth = ENGINE_AUTH
        # Every worker thread holds a connection, plus a few for aborts sent while they wait.
        adapter = HTTPAdapter(pool_connections=len(self.urls), pool_maxsize=cfg.max_concurrent_requests + 4)
        self._session.mount("http://", adapter)
        self._groups_in_flight = dict.fromkeys(self.urls, 0)
        self._rid_prefix = uuid.uuid4().hex[:12]  # unique across clients sharing an engine
        self._rid_counter = itertools.count()
        self._lock = threading.Lock()
        self._streams: set[_Stream] = set()

    # ------------------------------------------------------------------ generation

    def stream_groups(
        self,
        prompts: Iterable[tuple[Hashable, Sequence[int]]],
        *,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        progress: bool = False,
        progress_total: int | None = None,
        group_seed: Callable[[Hashable], int] | None = None,
    ) -> Iterator[tuple[Hashable, list[Sample]]]:
        """Generate n samples per prompt; yield `(key, samples)` per prompt as each group completes.

        Prompts are pulled lazily, only when fewer than `max_concurrent_requests // n` groups (at least
        one) per engine are in flight. Sampling arguments default to the config; temperature 0 means greedy
        (for tests and evaluation; RL sampling needs temperature > 0). `progress` shows the samples generated
        (of `progress_total`, if known: a bar on a terminal, a line every 30 s in a log); pass it on the
        logging rank only. `group_seed(key)`, asked when a group is submitted, seeds its samples: sample i
        gets `sampling_seed = sample_seed(group_seed(key), i)`, which SGLang uses only with deterministic
        inference (rollout.deterministic); None leaves the sampler's own randomness.

        After `abort_all()` no further prompt is pulled and the groups in flight come back with their
        partial outputs, finish reason "abort". Closing the generator early aborts the groups in flight.
        Either way, when the stream ends none of its requests is running on the engine.
        """
        n = self.cfg.n_samples_per_prompt if n is None else n
        if n < 1:
            raise ValueError(f"n must be >= 1; got {n}")
        params = self._sampling_params(temperature, top_p, top_k, max_new_tokens, stop_token_ids, ignore_eos)
        if self.cfg.deterministic and group_seed is None and params["temperature"] > 0:
            raise ValueError(
                "rollout.deterministic=true needs a group_seed for sampling: SGLang's deterministic "
                "inference gives every request without a sampling_seed the same one (42), so all "
                "samples of a prompt would be identical"
            )
        # Arguments are checked here, at the call; the generator below starts work at the first next().
        return self._stream(iter(prompts), n, params, progress, progress_total, group_seed)

    def _stream(
        self,
        pending: Iterator[tuple[Hashable, Sequence[int]]],
        n: int,
        params: dict[str, Any],
        progress: bool,
        progress_total: int | None,
        group_seed: Callable[[Hashable], int] | None,
    ) -> Iterator[tuple[Hashable, list[Sample]]]:
        slots = max(1, self.cfg.max_concurrent_requests // n) * len(self.urls)
        stream = _Stream()
        bar = _Progress(progress_total) if progress else None
        pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="rollout-request")
        with self._lock:
            self._streams.add(stream)
        try:
            self._submit_more(stream, pool, pending, slots, n, params, group_seed)
            while stream.in_flight:
                done, _ = wait(list(stream.in_flight), timeout=_REABORT_EVERY_S, return_when=FIRST_COMPLETED)
                if not done:
                    self._repeat_aborts(stream)
                    continue
                with self._lock:
                    finished = [(stream.in_flight.pop(future), future) for future in done]
                results = [(group.key, future.result()) for group, future in finished]  # raises failures
                # Refill before yielding, so the engine keeps generating while the caller scores.
                self._submit_more(stream, pool, pending, slots, n, params, group_seed)
                for key, samples in results:
                    if bar is not None:
                        bar.update(len(samples))
                    yield key, samples
        finally:
            stream.stopped.set()
            self._abort_and_drain(stream)
            pool.shutdown()
            with self._lock:
                self._streams.discard(stream)
            if bar is not None:
                bar.close()

    def _sampling_params(
        self,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        max_new_tokens: int | None,
        stop_token_ids: Sequence[int],
        ignore_eos: bool,
    ) -> dict[str, Any]:
        params = {
            "temperature": self.cfg.temperature if temperature is None else temperature,
            "top_p": self.cfg.top_p if top_p is None else top_p,
            "top_k": self.cfg.top_k if top_k is None else top_k,
            "max_new_tokens": self.cfg.max_response_length if max_new_tokens is None else max_new_tokens,
            "stop_token_ids": [int(t) for t in stop_token_ids],
            "ignore_eos": ignore_eos,
        }
        if params["temperature"] < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy); got {params['temperature']}")
        if not 0 < params["top_p"] <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {params['top_p']}")
        if params["max_new_tokens"] < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {params['max_new_tokens']}")
        return params

    def _submit_more(
        self,
        stream: _Stream,
        pool: ThreadPoolExecutor,
        pending: Iterator[tuple[Hashable, Sequence[int]]],
        slots: int,
        n: int,
        params: dict[str, Any],
        group_seed: Callable[[Hashable], int] | None,
    ) -> None:
        while len(stream.in_flight) < slots and not stream.stopped.is_set():
            item = next(pending, None)
            if item is None:
                return
            key, prompt_ids = item
            with self._lock:
                url = min(self.urls, key=self._groups_in_flight.__getitem__)  # ties: the first engine
                self._groups_in_flight[url] += 1
            seeds = None if group_seed is None else [sample_seed(group_seed(key), i) for i in range(n)]
            group = _Group(key, _token_ids(prompt_ids, key), self._new_rids(n), url, seeds)
            future = pool.submit(self._generate_group, group, params)
            with self._lock:
                stream.in_flight[future] = group

    def _new_rids(self, count: int) -> list[str]:
        group = next(self._rid_counter)
        return [f"{self._rid_prefix}-{group}-{i}" for i in range(count)]

    def _generate_group(self, group: _Group, params: dict[str, Any]) -> list[Sample]:
        try:
            return self._request_group(group, params)
        finally:
            with self._lock:
                self._groups_in_flight[group.url] -= 1

    def _request_group(self, group: _Group, params: dict[str, Any]) -> list[Sample]:
        n = len(group.rids)
        per_sample = (
            params if group.seeds is None else [{**params, "sampling_seed": seed} for seed in group.seeds]
        )
        body = {
            "input_ids": [group.prompt_ids] * n,
            "rid": group.rids,
            "sampling_params": per_sample,
            "return_logprob": True,
        }
        what = f"generate request for group key {group.key!r} (rids {group.rids[0]}..{group.rids[-1]})"
        responses = self._post(
            group.url, "/generate", body, what, timeout=self.cfg.resolved_request_timeout_s, rids=group.rids
        )
        index_of = {rid: i for i, rid in enumerate(group.rids)}
        try:
            samples = [_parse_sample(item, group, index_of[item["meta_info"]["id"]]) for item in responses]
        except (KeyError, TypeError, ValueError) as err:
            raise RolloutError(f"{what} got an unexpected response from {group.url}: {err!r}") from err
        if sorted(s.index for s in samples) != list(range(n)):
            raise RolloutError(f"{what} got {len(samples)} samples back for {n} requests")
        return sorted(samples, key=lambda s: s.index)

    # ------------------------------------------------------------------ aborts

    # An abort reaches only requests the engine has registered; one still on its way over HTTP misses it
    # and would run to max_new_tokens. So aborted groups are marked, and their streams send the abort
    # again while they are still in flight.

    def abort_all(self) -> None:
        """Abort every request on the engines (including other clients') and stop all streams of this
        client from pulling more prompts; their groups in flight come back with finish reason abort."""
        with self._lock:
            for stream in self._streams:
                stream.stopped.set()
                for group in stream.in_flight.values():
                    group.aborted = True
        for url in self.urls:
            self._post(url, "/abort_request", {"abort_all": True}, "abort_all", timeout=_ABORT_TIMEOUT_S)

    def abort(self, key: Hashable) -> None:
        """Abort the in-flight groups with this key; they come back with finish reason abort."""
        with self._lock:
            groups = [
                group for stream in self._streams for group in stream.in_flight.values() if group.key == key
            ]
            for group in groups:
                group.aborted = True
        for group in groups:
            for rid in group.rids:
                self._post(
                    group.url, "/abort_request", {"rid": rid}, f"abort of {rid}", timeout=_ABORT_TIMEOUT_S
                )

    def _repeat_aborts(self, stream: _Stream) -> None:
        with self._lock:
            groups = [group for group in stream.in_flight.values() if group.aborted]
        for group in groups:
            self._abort_rids(group.url, group.rids)

    def _abort_and_drain(self, stream: _Stream) -> None:
        """Abort all groups still in flight and wait until their requests have returned (or failed)."""
        with self._lock:
            for group in stream.in_flight.values():
                group.aborted = True
        while stream.in_flight:
            self._repeat_aborts(stream)
            done, _ = wait(list(stream.in_flight), timeout=_REABORT_EVERY_S)
            with self._lock:
                for future in done:
                    del stream.in_flight[future]

    def _abort_rids(self, url: str, rids: Sequence[str]) -> None:
        """Best effort: used while already handling a failure or tearing a stream down."""
        for rid in rids:
            try:
                self._session.post(f"{url}/abort_request", json={"rid": rid}, timeout=_ABORT_TIMEOUT_S)
            except requests.RequestException:
                return  # the engine is unreachable, so nothing of ours is running there either

    # ------------------------------------------------------------------ scoring

    def teacher_forced_log_probs(
        self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], *, engine: int = 0
    ) -> list[list[float]]:
        """The engine's untempered log-prob of every token after the prompt: entry j of result i is
        `log_softmax(logits)[sequences[i][p + j]]` given `sequences[i][:p + j]`, `p = prompt_lengths[i]`.

        This is what weight-sync verification compares with the trainer's log-probs at temperature 1;
        SGLang has no tempered log-probs for given tokens. Computed by a prefill only
        (`max_new_tokens=0`) with `logprob_start_len = p - 1`: SGLang reports no value for the first
        position it is asked about, so starting one token early yields exactly the tokens after the
        prompt. Each token id SGLang echoes is checked against the input. `engine` indexes `urls`: a weight
        check asks every engine.
        """
        if len(sequences) != len(prompt_lengths):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
        tokens = [_token_ids(seq, i) for i, seq in enumerate(sequences)]
        for i, (seq, p) in enumerate(zip(tokens, prompt_lengths, strict=True)):
            if not 1 <= p <= len(seq):
                raise ValueError(f"prompt length {p} of sequence {i} must be in [1, {len(seq)}]")
        result: list[list[float]] = []
        chunk = self.cfg.max_concurrent_requests
        for start in range(0, len(tokens), chunk):
            end = start + chunk
            result += self._score_chunk(
                self.urls[engine], tokens[start:end], list(prompt_lengths[start:end]), first_index=start
            )
        return result

    def _score_chunk(
        self, url: str, sequences: list[list[int]], prompt_lengths: list[int], first_index: int
    ) -> list[list[float]]:
        rids = self._new_rids(len(sequences))
        body = {
            "input_ids": sequences,
            "rid": rids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": [p - 1 for p in prompt_lengths],
        }
        what = f"teacher-forced scoring of sequences {first_index}..{first_index + len(sequences) - 1}"
        responses = self._post(
            url, "/generate", body, what, timeout=self.cfg.resolved_request_timeout_s, rids=rids
        )
        try:
            by_rid = {
                response["meta_info"]["id"]: response["meta_info"]["input_token_logprobs"]
                for response in responses
            }
            # SGLang reports no value for the first position asked about (hence the [1:]).
            entries = [by_rid[rid][1:] for rid in rids]
        except (KeyError, TypeError) as err:
            raise RolloutError(f"{what} got an unexpected response from {url}: {err!r}") from err
        for i, (seq_entries, seq, p) in enumerate(zip(entries, sequences, prompt_lengths, strict=True)):
            if not _same_tokens([entry[1] for entry in seq_entries], seq[p:]):
                raise RolloutError(
                    f"{what}: the engine scored other tokens than sequence "
                    f"{first_index + i} holds after its prompt"
                )
        return [[float(entry[0]) for entry in seq_entries] for seq_entries in entries]

    # ------------------------------------------------------------------ plumbing

    def _post(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        what: str,
        *,
        timeout: float,
        rids: Sequence[str] = (),
    ) -> Any:
        """POST and return the decoded JSON; failures go through `on_error`, then raise RolloutError.
        `rids` are aborted if the request times out: the engine may still be working on them."""
        try:
            return self._post_once(url, path, body, what, timeout, rids)
        except RolloutError as err:
            self._report(url, err)

    def _post_once(
        self, url: str, path: str, body: dict[str, Any], what: str, timeout: float, rids: Sequence[str]
    ) -> Any:
        for attempt in range(2):
            try:
                response = self._session.post(
                    f"{url}{path}", json=body, timeout=(_CONNECT_TIMEOUT_S, timeout)
                )
                break
            except requests.Timeout as err:
                self._abort_rids(url, rids)
                raise RolloutError(f"{what} to {url} timed out after {timeout:g} s") from err
            except requests.RequestException as err:
                # The server (uvicorn) closes keep-alive connections idle for 5 s; a request sent on one just
                # as it closes is reset before the server read it. Once more, on a new connection; a dead
                # engine refuses that one too.
                if attempt or not isinstance(err, requests.ConnectionError):
                    raise RolloutError(f"{what} to {url} failed: {err}") from err
        if response.status_code != 200:
            raise RolloutError(
                f"{what} to {url} failed with HTTP {response.status_code}: {response.text[:2000]}"
            )
        return response.json() if response.content else None

    def _report(self, url: str, err: RolloutError) -> NoReturn:
        if self.on_error is not None:
            try:
                self.on_error(url)
            except BaseException as hook_error:
                raise hook_error from err
        raise err

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def sample_seed(*parts: object) -> int:
    """A seed in [0, 2**63) that is a pure function of the parts' text: the same on every machine, process and
    Python version (unlike `hash`), so a resumed run derives the seeds of the first."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _token_ids(ids: Sequence[int], name: object) -> list[int]:
    tokens = [int(t) for t in ids]
    if not tokens:
        raise ValueError(f"prompt {name!r} is empty")
    return tokens


def _same_tokens(echoed: list[int], expected: list[int]) -> bool:
    """Whether SGLang scored `expected`. It echoes ids >= vocab_size - 1 as 0 (it clips them for the
    detokenizer; the log-prob is still that of the real token), so an echoed 0 matches any id."""
    return len(echoed) == len(expected) and all(e in (x, 0) for e, x in zip(echoed, expected, strict=True))


def _parse_sample(item: dict[str, Any], group: _Group, index: int) -> Sample:
    meta = item["meta_info"]
    output_ids = [int(t) for t in item["output_ids"]]
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(output_ids):
        raise ValueError(f"{len(output_ids)} output tokens but {len(logprobs)} log-probs")
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in _FINISH_REASONS:
        raise ValueError(f"unknown finish reason {meta.get('finish_reason')!r}")
    return Sample(
        key=group.key,
        index=index,
        prompt_ids=group.prompt_ids,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=cast(FinishReason, reason),
        weight_version=str(meta.get("weight_version")),
        engine=group.url,
    )


class _Progress:
    """Samples generated so far, on the driving rank's console: a tqdm bar on a terminal, erased when the
    stream ends so that the step line stays the only one; in a log file (no terminal, e.g. under Slurm) a line
    every `_PROGRESS_LOG_EVERY_S` of a long rollout instead of a bar's carriage returns."""

    def __init__(self, total: int | None, stream: TextIO | None = None) -> None:
        self.total, self.samples = total, 0
        self.stream = sys.stderr if stream is None else stream
        self._start = self._last_line = time.monotonic()
        self._bar = None
        if self.stream.isatty():
            self._bar = tqdm(
                total=total, desc="rollout", unit="sample", dynamic_ncols=True, leave=False, file=self.stream
            )

    def update(self, samples: int) -> None:
        self.samples += samples
        if self._bar is not None:
            self._bar.update(samples)
        elif time.monotonic() - self._last_line >= _PROGRESS_LOG_EVERY_S:
            self._last_line = time.monotonic()
            done = f"{self.samples}/{self.total}" if self.total is not None else str(self.samples)
            print(
                f"rollout: {done} samples in {self._last_line - self._start:.0f} s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
