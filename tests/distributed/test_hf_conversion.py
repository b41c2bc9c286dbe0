"""HF Qwen2 -> torch_dist -> Megatron at TP2xPP2 gives HF's logits; Megatron -> HF is bit-identical.

Runs the two command-line tools exactly as users do, and real megatron-core under torchrun.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tiny_qwen2, torchrun

WORKER = Path(__file__).with_name("checkpoint_logits_worker.py")
pytestmark = pytest.mark.distributed


def tiny_hf_model(out_dir: Path, *, tied: bool, vocab_size: int) -> torch.nn.Module:
    return tiny_qwen2(
        out_dir, vocab_size=vocab_size, num_layers=4, tied=tied, rope_theta=10000.0, rms_norm_eps=1e-6
    )


def run_tool(name: str, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc


@pytest.mark.parametrize(("tied", "vocab_size"), [(False, 250), (True, 256)], ids=["untied-padded", "tied"])
def test_round_trip_through_tp2_pp2(tmp_path: Path, tied: bool, vocab_size: int) -> None:
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    hf_dir, ckpt, resaved, export = (tmp_path / d for d in ("hf", "ckpt", "resaved", "export"))
    hf_model = tiny_hf_model(hf_dir, tied=tied, vocab_size=vocab_size)
    run_tool(
        "convert_hf_to_megatron.py",
        "--hf-dir",
        str(hf_dir),
        "--output",
        str(ckpt),
        "--tensor-parallel",
        "2",
        "--pipeline-parallel",
        "2",
        "--dtype",
        "float32",
    )

    # HF -> Megatron at TP2 x PP2: the same logits as the HF model.
    result = tmp_path / "logits.pt"
    torchrun(
        WORKER,
        4,
        "--checkpoint",
        str(ckpt),
        "--tp",
        "2",
        "--pp",
        "2",
        "--out",
        str(result),
        "--save-to",
        str(resaved),
    )
    out = torch.load(result)
    with torch.no_grad():
        expected = hf_model(out["tokens"]).logits
    # Padded vocab columns are not part of the HF model.
    logits = out["logits"][..., :vocab_size]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=2e-5)

    # Megatron (saved from TP2 x PP2) -> HF: tensors bit-identical to the originals; transformers loads it.
    run_tool(
        "convert_megatron_to_hf.py",
        "--checkpoint",
        str(resaved),
        "--output",
        str(export),
        "--hf-config-dir",
        str(hf_dir),
    )
    original = load_file(hf_dir / "model.safetensors")
    exported = {}
    for shard in sorted(export.glob("model-*-of-*.safetensors")):
        exported.update(load_file(shard))
    assert (export / "model.safetensors.index.json").exists()
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = Qwen2ForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(out["tokens"]).logits, expected, rtol=0, atol=0)


def test_tools_refuse_bad_input(tmp_path: Path) -> None:
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    tiny_hf_model(hf_dir, tied=False, vocab_size=256)

    impossible = run_tool(
        "convert_hf_to_megatron.py",
        "--hf-dir",
        str(hf_dir),
        "--output",
        str(ckpt),
        "--tensor-parallel",
        "3",
        expect_ok=False,
    )
    assert impossible.returncode == 2
    assert (
        "model.num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size=3"
        in impossible.stderr
    )
    assert not ckpt.exists(), "a refused conversion must not leave an output directory behind"

    ckpt.mkdir()
    (ckpt / "keep.txt").write_text("precious")
    refused = run_tool(
        "convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--output", str(ckpt), expect_ok=False
    )
    assert refused.returncode != 0 and "--force" in refused.stderr
    assert (ckpt / "keep.txt").read_text() == "precious"

    export = tmp_path / "export"
    export.mkdir()
    (export / "keep.txt").write_text("precious")
    refused = run_tool(
        "convert_megatron_to_hf.py",
        "--checkpoint",
        str(hf_dir),
        "--output",
        str(export),
        "--hf-config-dir",
        str(hf_dir),
        expect_ok=False,
    )
    assert refused.returncode != 0
    assert (export / "keep.txt").read_text() == "precious"
