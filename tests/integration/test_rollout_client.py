"""RolloutClient against a real SGLang server on CPU: log-prob semantics checked against Hugging Face,
grouping, finish reasons, streaming in completion order with lazy prompt pulling, aborts, timeouts,
HTTP errors and teacher-forced scoring."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator

import pytest
import torch

from dapo_megatron.data import char_tokenizer
from dapo_megatron.records import Sample
from dapo_megatron.rollout import client as client_module
from dapo_megatron.rollout.client import RolloutClient, RolloutError
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.engine_record import liveness_check
from tests.integration.conftest import MAX_POSITIONS, engine_config, hf_greedy, hf_log_probs

pytestmark = pytest.mark.sglang

EOS = char_tokenizer.EOS_ID
PROMPTS = [
    ("hello", char_tokenizer.encode("Hello, world")),
    ("sum", char_tokenizer.encode("2 + 2 =")),
    ("x", char_tokenizer.encode("x")),
]
LONG = 3000  # new tokens: several seconds of decoding, so an abort lands mid-generation


@pytest.fixture(scope="module")
def client(engine: SGLangEngine) -> Iterator[RolloutClient]:
    with RolloutClient(engine.url, engine.cfg, on_error=liveness_check([engine])) as shared:
        yield shared


@pytest.fixture(scope="module")
def eos_prompts(hf_model: torch.nn.Module) -> tuple[list[int], list[int]]:
    """(short, long): greedy decoding of `short` ends with EOS within 8 tokens; `long` has no EOS in
    its first 200 greedy tokens. Found by scanning one-character prompts with Hugging Face."""
    starts = torch.arange(3, len(char_tokenizer.VOCAB)).view(-1, 1)
    with torch.no_grad():
        first_tokens = hf_model.generate(
            starts, do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None, pad_token_id=0
        )[:, 1:]
    ends_early = (first_tokens == EOS).any(dim=1).tolist()
    short = starts[ends_early.index(True)].tolist()
    long = next(
        prompt
        for prompt, early in zip(starts.tolist(), ends_early, strict=True)
        if not early and EOS not in hf_greedy(hf_model, prompt, 200)
    )
    return short, long


def max_error(samples: list[Sample], model: torch.nn.Module, temperature: float) -> float:
    errors = []
    for s in samples:
        expected = hf_log_probs(model, s.prompt_ids, s.output_ids, temperature)
        errors += [abs(a - b) for a, b in zip(s.logprobs, expected, strict=True)]
    return max(errors)


def recording(
    prompts: list[tuple[Hashable, list[int]]], pulled: list[Hashable]
) -> Iterator[tuple[Hashable, list[int]]]:
    for key, ids in prompts:
        pulled.append(key)
        yield key, ids


def abort_later(client: RolloutClient, key: Hashable, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, client.abort, args=(key,))
    timer.start()
    return timer


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.7)])
def test_sampled_log_probs_are_log_softmax_of_tempered_logits(
    client: RolloutClient, hf_model: torch.nn.Module, temperature: float, top_p: float
) -> None:
    groups = dict(client.stream_groups(PROMPTS, n=3, temperature=temperature, top_p=top_p, max_new_tokens=32))
    samples = [s for group in groups.values() for s in group]
    assert sum(len(s.output_ids) for s in samples) > 50
    assert max_error(samples, hf_model, temperature) < 1e-4  # top-p truncation is not in the log-probs
    if temperature != 1.0:  # the comparison is sharp enough to see a missing temperature
        assert max_error(samples, hf_model, 1.0) > 1e-2


def test_greedy_matches_hf_greedy(client: RolloutClient, hf_model: torch.nn.Module) -> None:
    groups = dict(client.stream_groups(PROMPTS, n=1, temperature=0.0, max_new_tokens=40, ignore_eos=True))
    for key, prompt in PROMPTS:
        [sample] = groups[key]
        assert sample.output_ids == hf_greedy(hf_model, prompt, 40), key
    assert max_error([s for g in groups.values() for s in g], hf_model, 1.0) < 1e-4


def test_groups_hold_n_distinct_samples_of_their_prompt(
    client: RolloutClient, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        client_module, "_PROGRESS_LOG_EVERY_S", 0.0
    )  # a progress line per group (no terminal here)
    groups = list(
        client.stream_groups(
            PROMPTS, n=4, max_new_tokens=16, ignore_eos=True, progress=True, progress_total=12
        )
    )
    assert sorted(key for key, _ in groups) == sorted(key for key, _ in PROMPTS)
    prompt_of = dict(PROMPTS)
    for key, samples in groups:
        assert [s.index for s in samples] == [0, 1, 2, 3]
        assert all(s.key == key and s.prompt_ids == prompt_of[key] for s in samples)
        assert all(s.finish_reason == "length" and len(s.output_ids) == 16 for s in samples)
        assert len({tuple(s.output_ids) for s in samples}) > 1
        assert all(s.weight_version for s in samples)
    assert "rollout: 12/12 samples" in capsys.readouterr().err  # the progress lines counted samples


def test_finish_reasons(
    client: RolloutClient, hf_model: torch.nn.Module, eos_prompts: tuple[list[int], list[int]]
) -> None:
    def one(prompt: list[int], **kwargs: object) -> Sample:
        [(_, [sample])] = list(client.stream_groups([("p", prompt)], n=1, temperature=0.0, **kwargs))
        return sample

    prompt = PROMPTS[0][1]
    greedy = hf_greedy(hf_model, prompt, 20)
    cut = next(i for i in range(1, 20) if greedy[i] not in greedy[:i])
    stopped = one(prompt, max_new_tokens=20, stop_token_ids=[greedy[cut]])
    assert (stopped.finish_reason, stopped.output_ids) == ("stop", greedy[: cut + 1])  # stop token included

    short, _ = eos_prompts
    ended = one(short, max_new_tokens=20)
    assert ended.finish_reason == "stop"
    assert ended.output_ids[-1] == EOS and EOS not in ended.output_ids[:-1]

    truncated = one(short, max_new_tokens=20, ignore_eos=True)
    assert (truncated.finish_reason, len(truncated.output_ids)) == ("length", 20)


def test_groups_come_back_in_completion_order(
    client: RolloutClient, eos_prompts: tuple[list[int], list[int]]
) -> None:
    short, long = eos_prompts
    order = [
        key
        for key, _ in client.stream_groups(
            [("long", long), ("short", short)], n=2, temperature=0.0, max_new_tokens=200
        )
    ]
    assert order == ["short", "long"]


def test_prompts_are_pulled_lazily_and_aborts_return_partial_samples(
    engine: SGLangEngine, hf_model: torch.nn.Module
) -> None:
    prompts = [(i, char_tokenizer.encode(f"prompt {i}")) for i in range(6)]
    pulled: list[Hashable] = []
    with RolloutClient(engine.url, engine_config(max_concurrent_requests=2)) as client:  # two groups of n=1
        stream = client.stream_groups(recording(prompts, pulled), n=1, max_new_tokens=LONG, ignore_eos=True)
        timer = abort_later(client, 0, delay_s=2.0)  # long after its first tokens, long before its last
        key, [first] = next(stream)
        timer.join()
        assert key == 0 and first.finish_reason == "abort"
        assert 0 < len(first.output_ids) < LONG
        assert pulled == [0, 1, 2]  # group 0's slot went to prompt 2 before group 0 was handed over

        client.abort_all()
        rest = {key: samples for key, samples in stream}
        assert sorted(rest) == [1, 2]
        assert pulled == [0, 1, 2]  # nothing pulled after abort_all
        partial = [s for samples in rest.values() for s in samples]
        assert all(s.finish_reason == "abort" and len(s.output_ids) < LONG for s in partial), [
            (s.key, s.finish_reason, len(s.output_ids)) for s in partial
        ]
        assert len(rest[1][0].output_ids) > 0  # prompt 2 may have been aborted before its first token
        assert max_error([first, *partial], hf_model, 1.0) < 1e-4  # partial samples are usable as they are


def test_closing_a_stream_early_stops_its_requests(engine: SGLangEngine) -> None:
    prompts = [(i, char_tokenizer.encode(f"prompt {i}")) for i in range(4)]
    with RolloutClient(engine.url, engine_config(max_concurrent_requests=3)) as client:
        stream = client.stream_groups(prompts, n=1, max_new_tokens=LONG, ignore_eos=True)
        timer = abort_later(client, 0, delay_s=1.0)
        assert next(stream)[0] == 0
        timer.join()
        start = time.monotonic()
        stream.close()
        assert time.monotonic() - start < 10
    engine.flush_cache()  # SGLang refuses to flush while any request is still running


def test_request_timeout_names_the_request_and_aborts_it(engine: SGLangEngine) -> None:
    errors: list[str] = []
    cfg = engine_config(request_timeout_s=1.0)
    client = RolloutClient(engine.url, cfg, on_error=errors.append)
    with pytest.raises(RolloutError, match=r"group key 'slow'.*timed out after 1 s"):
        list(client.stream_groups([("slow", PROMPTS[0][1])], n=2, max_new_tokens=LONG, ignore_eos=True))
    assert errors == [engine.url]  # the hook learns which engine failed
    engine.flush_cache(wait_s=10.0)  # the aborted request ends within a decode step, not after LONG tokens


def test_http_error_names_the_request(client: RolloutClient) -> None:
    too_long = [5] * (MAX_POSITIONS + 10)
    good = iter([("fine", PROMPTS[0][1]), ("too long", too_long)])
    with pytest.raises(RolloutError, match=r"group key 'too long'.*HTTP 400"):
        list(client.stream_groups(good, n=1, max_new_tokens=4))


def test_teacher_forced_log_probs_match_hf(client: RolloutClient, hf_model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [2, 9, 17, 33, 40]
    # The whole vocabulary, including 127: SGLang echoes ids >= vocab_size - 1 as 0.
    sequences = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in lengths]
    prompt_lengths = [1, 4, 17, 10, 39]  # a one-token prompt, an empty response, a one-token response
    scored = client.teacher_forced_log_probs(sequences, prompt_lengths)
    for seq, p, got in zip(sequences, prompt_lengths, scored, strict=True):
        expected = hf_log_probs(hf_model, seq[:p], seq[p:])
        assert len(got) == len(expected) == len(seq) - p
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, expected, strict=True))
    # Again, now with the sequences in SGLang's prefix cache.
    again = client.teacher_forced_log_probs(sequences, prompt_lengths)
    assert all(a == pytest.approx(b, abs=1e-6) for a, b in zip(again, scored, strict=True))
    with pytest.raises(ValueError, match="prompt length 0"):
        client.teacher_forced_log_probs([[5, 6]], [0])


def test_teacher_forced_log_probs_reproduce_sampled_ones(client: RolloutClient) -> None:
    """The check the trainer runs after a weight sync: engine scoring agrees with engine sampling."""
    groups = dict(client.stream_groups(PROMPTS, n=2, temperature=1.0, max_new_tokens=24))
    samples = [s for group in groups.values() for s in group]
    scored = client.teacher_forced_log_probs(
        [s.prompt_ids + s.output_ids for s in samples], [len(s.prompt_ids) for s in samples]
    )
    for sample, got in zip(samples, scored, strict=True):
        assert got == pytest.approx(sample.logprobs, abs=1e-4)


def test_bad_arguments_fail_at_the_call(client: RolloutClient) -> None:
    with pytest.raises(ValueError, match="top_p"):
        client.stream_groups(PROMPTS, top_p=0.0)
    with pytest.raises(ValueError, match="n must be"):
        client.stream_groups(PROMPTS, n=0)
    with pytest.raises(ValueError, match="is empty"):
        list(client.stream_groups([("empty", [])], n=1))
