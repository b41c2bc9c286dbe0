"""A disk that fills up while a checkpoint is written: the save stops with an error that names the cause
(torch's serializer alone says `unexpected pos`), the committed checkpoint stays the newest and intact. The
full disk is bench/faults.py's: every Python `open` under the new checkpoint's directory fails with ENOSPC
after a byte budget, in the writer's processes too (a site module, imported at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dapo_megatron import checkpoint
from tests.conftest import REPO

SAVE_TWICE = """
import sys
from pathlib import Path

from dapo_megatron import checkpoint
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.qwen2 import build_gpt_model
from tests.conftest import one_gloo_rank
from tests.model_configs import small_model_config

root = Path(sys.argv[1])
cfg = small_model_config(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1,
                         max_position_embeddings=32)
with one_gloo_rank(root.parent / "store") as layout:
    model = build_gpt_model(cfg, ParallelConfig(), layout)
    checkpoint.save_model(model, root, 1, cfg, layout)
    try:
        checkpoint.save_model(model, root, 2, cfg, layout)
    except checkpoint.CheckpointWriteError as error:
        print("ERROR", error)
"""


def test_a_full_disk_names_itself_and_keeps_the_committed_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "bench" / "faults_site"), str(REPO)]),
        "DAPO_FAULT_ENOSPC_DIR": f"{checkpoint.step_dir(root, 2)}.partial",
        "DAPO_FAULT_ENOSPC_BYTES": "1000",
        "DAPO_FAULT_ENOSPC_REPORT": str(tmp_path / "enospc.txt"),
    }
    run = subprocess.run(
        [sys.executable, "-c", SAVE_TWICE, str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "enospc.txt").exists(), "the full disk was never hit"
    error = next(line for line in run.stdout.splitlines() if line.startswith("ERROR"))
    assert "checkpoint step 2 could not be written" in error
    assert "No space left on device" in error, error
    assert "checkpoint step 1 stays the newest committed one" in error, error
    assert "trainer.resume=auto" in error

    assert (root / checkpoint.TRACKER_FILE).read_text() == "1\n"
    assert checkpoint.verify(checkpoint.step_dir(root, 1)) is None
    assert checkpoint.resolve(root) == checkpoint.step_dir(root, 1)
