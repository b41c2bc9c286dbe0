"""The trainer's side of a flattened weight bucket, without an engine: its layout, and that building it does
not import SGLang into the trainer (seconds of every CPU start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from dapo_megatron.backends.cpu_weight_loader import named_views
from dapo_megatron.rollout.weight_sync import bucket_nbytes, flatten_bucket
from tests.conftest import REPO, one_gloo_rank, tiny_policy


def test_a_bucket_holds_every_tensor_once_and_gives_it_back_as_a_view() -> None:
    bucket = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.arange(4, dtype=torch.int64))]
    payload = flatten_bucket(bucket)
    assert payload["flattened_tensor"].numel() == bucket_nbytes(bucket) == 6 * 4 + 4 * 8
    [(name_a, a), (name_b, b)] = named_views(payload)
    assert (name_a, name_b) == ("a", "b")
    assert torch.equal(a, bucket[0][1]) and torch.equal(b, bucket[1][1])
    assert a.untyped_storage().data_ptr() == payload["flattened_tensor"].untyped_storage().data_ptr()
    assert [(m.start_idx, m.end_idx) for m in payload["metadata"]] == [(0, 24), (24, 56)]


def test_building_a_bucket_leaves_sglang_out_of_the_trainer() -> None:
    code = (
        "import sys, torch\n"
        "from dapo_megatron.backends.cpu_weight_loader import named_views\n"
        "from dapo_megatron.rollout.weight_sync import flatten_bucket\n"
        "named_views(flatten_bucket([('w', torch.ones(3))]))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=True
    )
    assert proc.stdout.strip() == "[]"


def test_tensors_read_in_place_ride_along_with_the_next_bucket_once() -> None:
    from dapo_megatron.rollout.weight_sync import with_in_place

    staged = flatten_bucket([("qkv", torch.ones(2))])
    in_place = [("mlp", torch.zeros(3))]
    merged = with_in_place(staged, in_place)
    assert [name for name, _ in merged] == ["qkv", "mlp"] and in_place == []
    assert with_in_place(staged, in_place) is staged  # nothing set aside since: the bucket as it was


def test_the_cpu_staging_buffer_holds_the_buckets_not_the_bucket_limit(tmp_path: Path) -> None:
    """Shared memory is committed when it is allocated: a staging buffer sized by the bucket limit would hold
    `rollout.sync_bucket_mb` of /dev/shm (512 MB by default) for a model of a few hundred KB. A sync without
    engines still flattens its buckets, so the buffer is measured without one."""
    from dapo_megatron.rollout.weight_sync import TensorWeightSync

    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        with one_gloo_rank(tmp_path / "store") as layout:
            model, cfg = tiny_policy(layout, vocab_size=128)
            sync = TensorWeightSync([], cfg, layout, bucket_bytes=512 * 2**20)
            sync.sync(model, "v1")
            staging = sync._staging
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            assert staging is not None and 0 < staging.numel() < model_bytes
            sync.sync(model, "v2")
            assert sync._staging is staging, "the next sync reuses the buffer"
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
