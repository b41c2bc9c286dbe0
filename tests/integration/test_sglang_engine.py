"""SGLangEngine against a real SGLang server on CPU: start, health, memory release/resume, API key, death
detection, failed and slow starts, and shutdown leaving no processes (when the trainer is killed:
test_engine_cleanup.py).

At most one server runs at a time: the module's shared engine is killed (by the death test) before
the tests that start their own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch

from dapo_megatron.data import char_tokenizer
from dapo_megatron.rollout.client import RolloutClient, RolloutError
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.engine_guard import slot_files_held
from dapo_megatron.rollout.engine_record import EngineError, liveness_check, raise_if_any_died, read_log_tail
from dapo_megatron.rollout.weight_sync import WeightSyncError, post_all
from tests.conftest import REPO
from tests.integration.conftest import alive, engine_config, hf_greedy, process_tree

pytestmark = pytest.mark.sglang

PROMPT = char_tokenizer.encode("The quick brown fox")


def greedy(engine: SGLangEngine, prompt: list[int], max_new_tokens: int) -> list[int]:
    with RolloutClient(engine.url, engine.cfg) as client:
        [(_, [sample])] = list(
            client.stream_groups(
                [("greedy", prompt)], n=1, temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
            )
        )
    return sample.output_ids


def processes_with_argument(text: str) -> list[psutil.Process]:
    """Running processes whose command line mentions `text` (e.g. a unique path or port)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if text in " ".join(process.info["cmdline"] or []) and alive(process):
            found.append(process)
    return found


def test_started_engine_is_healthy_and_generates_hf_greedy(
    engine: SGLangEngine, hf_model: torch.nn.Module
) -> None:
    assert engine.is_alive()
    engine.check_alive()
    assert len(process_tree(engine.pid)) >= 3  # launcher, scheduler, detokenizer
    assert Path(engine.server_info()["model_path"]) == engine.model_path
    assert greedy(engine, PROMPT, 24) == hf_greedy(hf_model, PROMPT, 24)


def test_idle_engine_leaves_the_cores_to_the_trainer(engine: SGLangEngine) -> None:
    """Between rollouts the trainer computes on the same cores: an idle engine must not spin (SGLang's
    scheduler busy-polls without --sleep-on-idle, ~100% of a core), yet must answer the next request."""
    greedy(engine, PROMPT, 4)  # served a request, now idle
    tree = process_tree(engine.pid)
    before, started = sum(p.cpu_times().user + p.cpu_times().system for p in tree), time.monotonic()
    time.sleep(3.0)
    used = sum(p.cpu_times().user + p.cpu_times().system for p in tree) - before
    assert used / (time.monotonic() - started) < 0.25, f"idle engine used {used:.2f} CPU seconds in 3 s"
    started = time.monotonic()
    assert len(greedy(engine, PROMPT, 4)) == 4
    assert time.monotonic() - started < 2.0  # a sleeping scheduler still answers promptly


FORK_PROBE = """
import sys
from dapo_megatron.backends import sglang_cpu
sglang_cpu.fork_workers()
from sglang.srt.entrypoints import engine
engine.mp.set_start_method("spawn", force=True)  # as SGLang's launcher does before starting its workers

def report(writer):
    writer.send(getattr(sys.modules["dapo_megatron.backends.sglang_cpu"], "set_after_import", None))

if __name__ == "__main__":  # a spawned child imports this file again, but not as __main__
    sglang_cpu.set_after_import = "the launcher's memory"
    reader, writer = engine.mp.Pipe(duplex=False)
    worker = engine.mp.Process(target=report, args=(writer,))
    worker.start()
    print(reader.recv())
    worker.join()
    import multiprocessing, threading
    stop = threading.Event()
    threading.Thread(target=stop.wait).start()  # a thread in the launcher: its workers must not fork
    print(engine.mp.Process is multiprocessing.get_context("spawn").Process)
    stop.set()
"""


def test_the_engines_workers_fork_from_the_launcher(tmp_path: Path) -> None:
    """SGLang spawns its scheduler and detokenizer as fresh interpreters that import torch and SGLang again
    (~7 s of an engine's start on two cores); on CPU they fork from the launcher instead
    (`backends/sglang_cpu.fork_workers`), seeing its memory as it was; unless a thread runs beside the
    launcher, which a fork would leave behind holding whatever it held."""
    script = tmp_path / "fork_probe.py"
    script.write_text(FORK_PROBE)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-2:] == ["the launcher's memory", "True"]


def test_release_and_staged_resume_keep_generation_correct(
    engine: SGLangEngine, hf_model: torch.nn.Module
) -> None:
    engine.release_memory()
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache"])
    engine.resume_memory(["cuda_graph"])
    assert greedy(engine, PROMPT, 24) == hf_greedy(hf_model, PROMPT, 24)
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory(["optimizer"])


def test_flush_cache_and_weight_version_label_later_samples(engine: SGLangEngine) -> None:
    engine.flush_cache()
    engine.update_weight_version("step-7")
    with RolloutClient(engine.url, engine.cfg) as client:
        [(_, samples)] = list(client.stream_groups([("p", PROMPT)], n=2, max_new_tokens=4))
    assert [s.weight_version for s in samples] == ["step-7", "step-7"]


def test_the_trainer_sets_the_engines_threads_for_its_next_forward_pass(
    engine: SGLangEngine, hf_model: torch.nn.Module
) -> None:
    """The count the trainer asks for reaches the engine's forward pass (logged from there) and generation
    stays the same; asking again for the same count changes nothing."""

    def changes() -> list[str]:
        return [line for line in engine.log_file.read_text().splitlines() if "intra-op threads" in line]

    assert engine.threads_file is not None and engine.threads_file.parent == engine.log_file.parent
    assert engine.start_threads == 1
    seen = len(changes())
    try:
        engine.set_cpu_threads(2)
        assert greedy(engine, PROMPT, 24) == hf_greedy(hf_model, PROMPT, 24)
        assert [line.split("] ")[-1] for line in changes()[seen:]] == [
            "engine computes on 2 intra-op threads"
        ]
        engine.set_cpu_threads(2)
        greedy(engine, PROMPT, 4)
        assert len(changes()) == seen + 1
    finally:
        engine.set_cpu_threads(1)
    greedy(engine, PROMPT, 4)
    assert changes()[-1].endswith("engine computes on 1 intra-op threads")


def test_only_holders_of_the_key_get_an_answer(engine: SGLangEngine) -> None:
    """Generation and every control endpoint refuse a request without the engine's key or with another one;
    health checks (which carry no secret) stay open; the key is in no log and no command line."""
    requests_ = {
        "/generate": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
        "/update_weights_from_tensor": {"serialized_named_tensors": [], "flush_cache": False},
        "/release_memory_occupation": {},
        "/init_weights_update_group": {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "x",
            "backend": "gloo",
        },
    }
    for path, body in requests_.items():
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": engine.api_key}):
            answer = requests.post(engine.url + path, json=body, headers=headers, timeout=30)
            assert answer.status_code in (401, 403), (path, headers, answer.status_code, answer.text[:200])
    assert requests.get(engine.url + "/health", timeout=30).status_code == 200
    keyed = {"Authorization": f"Bearer {engine.api_key}"}
    answer = requests.post(engine.url + "/generate", json=requests_["/generate"], headers=keyed, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 1
    engine.release_memory()  # an admin endpoint, through the engine's own session
    engine.resume_memory()
    assert engine.api_key not in engine.log_file.read_text()
    assert "api_key': '<redacted>'" in engine.log_file.read_text()  # SGLang printed it, the guard replaced it
    assert all(engine.api_key not in " ".join(p.cmdline()) for p in process_tree(engine.pid))


def test_dead_engine_is_reported_with_its_log_and_cleaned_up(engine: SGLangEngine) -> None:
    tree = process_tree(engine.pid)
    assert len(tree) >= 3
    slot_files = set().union(*(slot_files_held(p.pid) for p in tree))
    assert slot_files, "SGLang's scheduler holds a /dev/shm slot file; the check below needs one"
    record = engine.record()  # how another rank knows this engine
    os.kill(engine.pid, signal.SIGKILL)  # the guard; the server and its workers die with it
    deadline = time.monotonic() + 10
    while engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(EngineError, match="died") as info:
        engine.check_alive()
    assert read_log_tail(engine.log_file, 3) in str(info.value)
    # A client whose request fails asks the engine, and reports its death instead of a refused connection.
    client = RolloutClient(engine.url, engine.cfg, on_error=liveness_check([engine]))
    with pytest.raises(EngineError, match="died") as info:
        list(client.stream_groups([("p", PROMPT)], n=1, max_new_tokens=4))
    assert isinstance(info.value.__cause__, RolloutError)
    # So does a weight push that fails on it, from a rank that knows the engine by its record only.
    with pytest.raises(EngineError, match="died") as info:
        try:
            post_all([engine.url], "/begin_weight_update", {}, timeout_s=10)
        except WeightSyncError as failure:
            raise_if_any_died([record], failure)
    assert isinstance(info.value.__cause__, WeightSyncError) and str(engine.log_file) in str(info.value)
    engine.shutdown()
    assert [p.pid for p in tree if alive(p)] == []
    # The guard died before its clean-up: the engine's own shutdown removes what the server left in /dev/shm.
    assert [name for name in slot_files if (Path("/dev/shm") / name).exists()] == []
    engine.shutdown()  # idempotent; the fixture calls it once more


def test_bad_model_path_fails_fast_with_log_tail(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    engine = SGLangEngine(missing, engine_config(startup_timeout_s=120.0), log_file=tmp_path / "engine.log")
    with pytest.raises(EngineError, match="exited with code") as info:
        engine.start()
    assert "last lines" in str(info.value)
    assert str(missing) in str(info.value).split("last lines", 1)[1]  # SGLang's own complaint
    assert not engine.is_alive()
    assert processes_with_argument(str(missing)) == []


def test_startup_timeout_kills_the_half_started_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = engine_config(startup_timeout_s=3.0)
    engine = SGLangEngine(tiny_model_dir, cfg, log_file=tmp_path / "engine.log")
    with pytest.raises(EngineError, match="did not become healthy within 3 s"):
        engine.start()
    assert processes_with_argument(f"--port {engine.port}") == []


def test_port_in_use_is_refused_before_launch(tiny_model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        engine = SGLangEngine(
            tiny_model_dir, engine_config(), log_file=tmp_path / "engine.log", port=sock.getsockname()[1]
        )
        with pytest.raises(EngineError, match="already in use"):
            engine.start()
    assert engine.pid is None
