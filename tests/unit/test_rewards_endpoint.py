"""A reward service over HTTP (reward.endpoint), against a real local http.server: verdicts under the built-in
scorer's type checks, transient failures retried with back-off, and a service that cannot score stopping the
scoring with an error naming it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from dapo_megatron.config import ConfigError, compose, to_job_config
from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.endpoint import RewardServiceError
from dapo_megatron.rewards.pool import RewardPool, status_counts
from tests.conftest import JsonHandler, free_port, local_http_server

SLOW_S = 1.0  # a reply this late is past every endpoint_timeout_s below


class RewardService(JsonHandler):
    """Grades like a custom reward function (correct when the solution ends with the ground truth) at /score;
    the solution text picks a misbehaviour. Every request body is recorded."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
            attempt = self.server.requests.count(body)
        solution, truth = body["solution_str"], body["ground_truth"]
        if self.path != "/score":
            self.send_error(404)
        elif solution == "down" or (solution == "flaky" and attempt == 1):
            self.send_error(503)
        elif solution == "slow" or (solution == "flaky" and attempt == 2):
            time.sleep(SLOW_S)  # the client has given up on this attempt by now
        elif solution == "no json":
            page = b"<html>busy</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
        elif solution == "string acc":
            self.reply_json({"acc": "yes"})
        elif solution == "float":
            self.reply_json(0.5)
        elif body["data_source"] == "bool":
            self.reply_json(solution == truth)
        else:
            self.reply_json({"acc": solution.endswith(truth), "pred": solution[-len(truth) :]})


@pytest.fixture
def service() -> Iterator[ThreadingHTTPServer]:
    with local_http_server(RewardService, requests=[], lock=threading.Lock()) as httpd:
        yield httpd


def url(httpd: ThreadingHTTPServer, path: str = "/score") -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}{path}"


def config(endpoint: str, *, workers: int = 0) -> RewardConfig:
    return RewardConfig(
        endpoint=endpoint,
        num_workers=workers,
        timeout_s=5.0,
        endpoint_timeout_s=0.3,
        endpoint_retries=2,
        endpoint_backoff_s=0.05,
        correct_score=2.0,
        wrong_score=-0.5,
    )


def test_verdicts_from_the_service_are_scored_in_the_workers_and_checked_as_the_scorers(
    service: ThreadingHTTPServer,
) -> None:
    items = [
        ("the answer is 42", "42", "math"),
        ("the answer is 41", "42", "math"),
        ("7", "7", "bool"),
        ("8", "7", "bool"),
        ("flaky", "y", "math"),  # a 503, then a reply too late, then the verdict
        ("no json", "1", "math"),
        ("string acc", "1", "math"),
        ("float", "1", "math"),
    ]
    with RewardPool(config(url(service), workers=1)) as pool:
        results = pool.score(items)
    assert [(r.score, r.acc, r.status) for r in results] == [
        (2.0, True, "ok"),
        (-0.5, False, "ok"),
        (2.0, True, "ok"),
        (-0.5, False, "ok"),
        (2.0, True, "ok"),
        (-0.5, False, "error"),
        (-0.5, False, "error"),
        (-0.5, False, "error"),
    ]
    assert results[0].pred == "42"
    assert service.requests[0] == {
        "data_source": "math",
        "solution_str": "the answer is 42",
        "ground_truth": "42",
    }
    assert [body["solution_str"] for body in service.requests].count("flaky") == 3
    assert f"reward endpoint {url(service)} replied with no JSON: '<html>busy</html>'" in results[5].error
    assert "acc='yes' of type str; it must be a bool" in results[6].error
    assert f"reward endpoint {url(service)} returned 0.5 of type float; return a bool" in results[7].error
    assert status_counts(results) == {"reward/timeouts": 0, "reward/errors": 3}


def test_an_unreachable_service_stops_the_scoring_from_the_workers_naming_it() -> None:
    nobody = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    pool = RewardPool(config(nobody, workers=1))
    with pytest.raises(RewardServiceError) as raised:
        pool.score([("Answer: 1", "1", "math")] * 3)
    message = str(raised.value)
    assert message.startswith(f"reward.endpoint={nobody} is unavailable: 3 attempts failed")
    assert "(reward.endpoint_retries=2), the last with no connection" in message
    with pytest.raises(RuntimeError, match="after close"):  # score() closed the pool and its workers
        pool.score([("Answer: 1", "1", "math")])


@pytest.mark.parametrize(
    ("solution", "path", "message", "attempts"),
    [
        (
            "slow",
            "/score",
            "3 attempts failed (reward.endpoint_retries=2), the last with no reply within "
            "reward.endpoint_timeout_s=0.3 s",
            3,
        ),
        ("down", "/score", "3 attempts failed (reward.endpoint_retries=2), the last with HTTP 503", 3),
        ("Answer: 1", "/wrong", "answered HTTP 404 Not Found", 1),  # not transient: no retry
    ],
    ids=["timeouts", "503s", "wrong-path"],
)
def test_a_service_that_cannot_score_is_an_error_naming_it(
    service: ThreadingHTTPServer, solution: str, path: str, message: str, attempts: int
) -> None:
    started = time.monotonic()
    with RewardPool(config(url(service, path))) as pool, pytest.raises(RewardServiceError) as raised:
        pool.score([(solution, "1", "math")])
    assert str(raised.value).startswith(f"reward.endpoint={url(service, path)} ")
    assert message in str(raised.value)
    assert len(service.requests) == attempts
    if attempts == 3:  # the back-off waited 0.05 s, then 0.1 s
        assert time.monotonic() - started >= 0.15


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.endpoint=localhost:8000"], r"must be an http:// or https:// URL with a host"),
        (
            ["reward.endpoint=http://127.0.0.1:9/score", "reward.function=dapo_megatron.rewards.example:x"],
            r"each choose how samples are graded; keep one",
        ),
        (
            ["reward.endpoint=http://127.0.0.1:9/score", "reward.endpoint_timeout_s=4"],
            r"3 attempts of reward\.endpoint_timeout_s=4\.0 s and their back-off take up to 13\.5 s, "
            r"not less than reward\.timeout_s=10\.0",
        ),
        (["reward.endpoint=http://127.0.0.1:9/score", "reward.endpoint_retries=-1"], r"must be >= 0"),
    ],
)
def test_endpoint_settings_are_checked_with_the_config(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        to_job_config(compose(overrides))


def test_the_default_endpoint_settings_fit_the_default_sample_limit() -> None:
    reward = to_job_config(compose(["reward.endpoint=https://rewards.example:8443/v1/score"])).reward
    endpoint = reward.reward_endpoint()
    assert endpoint is not None and endpoint.url == "https://rewards.example:8443/v1/score"
    assert endpoint.worst_case_s() < reward.timeout_s
