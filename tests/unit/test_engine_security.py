"""How an engine is launched so that only the job can talk to it: a fresh key per engine, handed over outside
the command line, sent by the clients to its engine only; loopback unless another node must reach it."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest
import requests

from dapo_megatron import backends
from dapo_megatron.rollout import engine_auth, engine_guard
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.engine_record import EngineRecord
from dapo_megatron.trainer.fleet import engine_host, job_on_one_node


def test_every_engine_has_its_own_unguessable_key(tmp_path: Path) -> None:
    keys = {SGLangEngine("m", RolloutConfig(), log_file=tmp_path / "e.log").api_key for _ in range(3)}
    assert len(keys) == 3
    assert all(len(key) >= 43 for key in keys)  # 32 random bytes, base64


def test_the_key_is_on_no_command_line(tmp_path: Path) -> None:
    for device in ("cpu", "cuda"):
        engine = SGLangEngine(
            "m", RolloutConfig(), log_file=tmp_path / "e.log", backend=backends.named(device), port=4321
        )
        engine.tmpdir = tmp_path
        guarded = engine.guarded_command()
        assert engine.api_key not in " ".join(guarded + engine.command())
        assert "--api-key" not in guarded
        assert guarded[:3] == [sys.executable, "-m", "dapo_megatron.rollout.engine_guard"]
        assert guarded[guarded.index("--parent") + 1] == str(os.getpid())
        assert guarded[guarded.index("--tmpdir") + 1] == str(tmp_path)
        assert guarded[guarded.index("--") + 1 :] == engine.command()[2:]


def test_the_server_process_gets_the_key_as_api_and_admin_key(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []
    monkeypatch.setenv(engine_guard.API_KEY_ENV, "k3y")
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.setattr(runpy, "run_module", lambda module, **kw: ran.append((module, list(sys.argv), kw)))
    monkeypatch.setattr(engine_guard, "_die_with", ran.append)  # not this test process
    engine_guard.main(["--serve", "4321", "sglang.launch_server", "--port", "1"])
    assert ran == [
        4321,
        (
            "sglang.launch_server",
            ["sglang.launch_server", "--port", "1", "--api-key=k3y", "--admin-api-key=k3y"],
            {"run_name": "__main__", "alter_sys": True},
        ),
    ]
    assert engine_guard.API_KEY_ENV not in os.environ  # SGLang's workers do not inherit it


def test_records_carry_the_key_but_do_not_print_it() -> None:
    record = EngineRecord(url="http://h:1", log_file="l", host="h", processes=(), api_key="s3cret")
    assert record.api_key == "s3cret"
    assert "s3cret" not in repr(record)


def test_requests_carry_the_key_of_the_engine_they_go_to() -> None:
    engine_auth.register("http://10.0.0.1:30000", "key-a")
    engine_auth.register("http://10.0.0.2:30000/", "key-b")
    try:

        def header(url: str) -> str | None:
            prepared = requests.Request("POST", url, json={}, auth=engine_auth.ENGINE_AUTH).prepare()
            return prepared.headers.get("Authorization")

        assert header("http://10.0.0.1:30000/generate") == "Bearer key-a"
        assert header("http://10.0.0.2:30000/update_weights_from_tensor") == "Bearer key-b"
        assert header("http://10.0.0.1:30001/generate") is None  # another server on that host
        engine_auth.forget("http://10.0.0.1:30000")
        assert header("http://10.0.0.1:30000/generate") is None
    finally:
        engine_auth.forget("http://10.0.0.1:30000")
        engine_auth.forget("http://10.0.0.2:30000")


@pytest.mark.parametrize(
    ("environ", "world_size", "one_node"),
    [
        ({}, 1, True),  # no launcher
        ({"LOCAL_WORLD_SIZE": "4"}, 4, True),  # torchrun, one node
        ({"LOCAL_WORLD_SIZE": "4"}, 8, False),  # torchrun, two nodes
        ({"SLURM_JOB_NUM_NODES": "1"}, 8, True),
        ({"SLURM_JOB_NUM_NODES": "2"}, 8, False),
    ],
)
def test_engines_listen_on_loopback_unless_the_job_spans_nodes(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], world_size: int, one_node: bool
) -> None:
    towards = "dapo_megatron.trainer.fleet.address_towards"
    monkeypatch.setattr(towards, lambda host: f"10.9.9.9 towards {host}")
    assert job_on_one_node(world_size, environ) is one_node
    host = engine_host(world_size, "node-0", environ)
    assert host == ("127.0.0.1" if one_node else "10.9.9.9 towards node-0")


def test_a_key_that_starts_with_a_dash_reaches_sglang_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # token_urlsafe draws "-" as the first character once in 64 keys.
    import argparse

    from sglang.srt.server_args import ServerArgs

    ran = []
    monkeypatch.setenv(engine_guard.API_KEY_ENV, "-Kq3")
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.setattr(runpy, "run_module", lambda module, **kw: ran.append(list(sys.argv)))
    monkeypatch.setattr(engine_guard, "_die_with", lambda parent: None)
    engine_guard.main(["--serve", "4321", "sglang.launch_server", "--model-path", "m"])
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(ran[0][1:])
    assert parsed.api_key == parsed.admin_api_key == "-Kq3"
