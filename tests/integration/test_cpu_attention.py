"""The batched CPU attention (`backends/cpu_attention.py`) against SGLang's own per-sequence torch_native
code on the same KV cache: decode and prefill (with cached prefixes, grouped-query heads, causal and not),
and that the engine really runs it.

The comparison runs in a subprocess: importing SGLang on CPU needs the import-time stand-ins of
`backends/sglang_cpu.py`, which must not leak into the test process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.sglang

COMPARE = textwrap.dedent("""
    import json, torch
    import dapo_megatron.backends.sglang_cpu  # stand-ins, then the batched backend is registered
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from dapo_megatron.backends import cpu_attention
    from dapo_megatron.backends.cpu_attention import BatchedTorchNativeAttnBackend

    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 4, 2, 16, 1024
    k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    seq_lens = torch.tensor([7, 1, 13, 4, 9, 30])
    rows = torch.tensor([3, 0, 6, 1, 2, 7])
    req_to_token = torch.zeros(8, 64, dtype=torch.int32)
    free = (torch.randperm(slots - 1) + 1).int()  # scattered cache slots, as after many requests
    start = 0
    for row, n in zip(rows.tolist(), seq_lens.tolist()):
        req_to_token[row, :n] = free[start:start + n]
        start += n
    stock, batched = object.__new__(TorchNativeAttnBackend), object.__new__(BatchedTorchNativeAttnBackend)

    def run(method, backend, query, *args, **kwargs):
        out = torch.full_like(query, float("nan"))
        getattr(TorchNativeAttnBackend if backend is stock else BatchedTorchNativeAttnBackend, method)(
            backend, query, out, k_cache, v_cache, req_to_token, rows, seq_lens, *args, scaling=0.25, **kwargs)
        return out

    diffs = {}
    query = torch.randn(len(seq_lens), heads, dim)
    a = run("_run_sdpa_forward_decode", stock, query, enable_gqa=True)
    b = run("_run_sdpa_forward_decode", batched, query, enable_gqa=True)
    diffs["decode"] = (a - b).abs().max().item()
    prefix = torch.tensor([0, 0, 5, 2, 8, 29])
    extend = seq_lens - prefix
    query = torch.randn(int(extend.sum()), heads, dim)
    for causal in (True, False):
        a = run("_run_sdpa_forward_extend", stock, query, prefix, extend, enable_gqa=True, causal=causal)
        b = run("_run_sdpa_forward_extend", batched, query, prefix, extend, enable_gqa=True, causal=causal)
        diffs[f"extend_causal_{causal}"] = (a - b).abs().max().item()
    # Past the padding budget the batched class must hand over to the per-sequence loop (and agree).
    cpu_attention.MAX_PADDED_SCORES = 1
    a = run("_run_sdpa_forward_decode", stock, torch.ones(len(seq_lens), heads, dim), enable_gqa=True)
    b = run("_run_sdpa_forward_decode", batched, torch.ones(len(seq_lens), heads, dim), enable_gqa=True)
    diffs["decode_fallback"] = (a - b).abs().max().item()
    # Causality must matter for this data, or the causal comparison above proves little.
    c = run("_run_sdpa_forward_extend", stock, query, prefix, extend, enable_gqa=True, causal=True)
    d = run("_run_sdpa_forward_extend", stock, query, prefix, extend, enable_gqa=True, causal=False)
    diffs["causal_vs_not"] = (c - d).abs().max().item()
    diffs["registered"] = ATTENTION_BACKENDS["torch_native"].__name__
    print("RESULT " + json.dumps(diffs))
""")  # noqa: E501 (code run in a subprocess; the text is kept as is)


def test_batched_attention_equals_sglang_per_sequence_loop() -> None:
    done = subprocess.run(
        [sys.executable, "-c", COMPARE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    diffs = json.loads(line.removeprefix("RESULT "))
    assert diffs["registered"] == "create_batched_torch_native_backend"
    for case in ("decode", "extend_causal_True", "extend_causal_False", "decode_fallback"):
        assert diffs[case] < 1e-5, (case, diffs)
    assert diffs["causal_vs_not"] > 1e-2, diffs
