"""Peak memory and time of the chunked log-prob/entropy kernel vs the naive full-vocab computation.

Both paths compute the sampled-token log-prob and the entropy of ``softmax(logits / T)`` and run the
backward pass into the logits. The naive path is what a plain PyTorch trainer does:
``log_softmax(logits.float() / T)``, gather, ``entropy = −Σ p·log p``, autograd.

Each measurement runs in a fresh subprocess so that its peak resident set size
(``ru_maxrss``) belongs to that path alone; the peak is reported relative to the RSS just before the
call (inputs already allocated), so it counts the activations, temporaries and the logits gradient.
Time is the best of ``--repeats`` warm forward+backward runs in the same subprocess.

Usage: ``python bench/bench_logprobs.py [--tokens 1024] [--vocab 152064] [--chunk-size 256]``.
The last two lines printed are ``logprob_peak_mem_vs_naive`` and ``logprob_time_vs_naive``.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dapo_megatron.algo.logprobs import reference_logprobs, vocab_parallel_logprobs  # noqa: E402

TEMPERATURE = 0.9


def run_path(
    path: str, tokens: int, vocab: int, chunk_size: int, repeats: int, dtype: str
) -> dict[str, float]:
    """Inside the child process: measure one path; returns peak bytes above the inputs and seconds."""
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=getattr(torch, dtype)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    grad_log_prob, grad_entropy = torch.randn(tokens), torch.randn(tokens)

    def step() -> None:
        if path == "naive":
            log_prob, entropy = reference_logprobs(logits, labels, temperature=TEMPERATURE)
        else:
            log_prob, entropy = vocab_parallel_logprobs(
                logits, labels, temperature=TEMPERATURE, chunk_size=chunk_size
            )
        torch.autograd.backward([log_prob, entropy], [grad_log_prob, grad_entropy])
        logits.grad = None

    rss_before = psutil.Process().memory_info().rss
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "peak_bytes": peak - rss_before,
        "prior_peak_bytes": maxrss_before - rss_before,
        "seconds": min(times),
        "input_bytes": logits.numel() * logits.element_size(),
    }


def measure_in_subprocess(path: str, args: argparse.Namespace) -> dict[str, float]:
    command = [
        sys.executable,
        __file__,
        "--child",
        path,
        f"--tokens={args.tokens}",
        f"--vocab={args.vocab}",
        f"--chunk-size={args.chunk_size}",
        f"--repeats={args.repeats}",
        f"--dtype={args.dtype}",
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--child", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = run_path(args.child, args.tokens, args.vocab, args.chunk_size, args.repeats, args.dtype)
        print(json.dumps(result))
        return

    print(
        f"logits [{args.tokens}, {args.vocab}] {args.dtype}, T={TEMPERATURE}, chunk_size={args.chunk_size}, "
        f"torch threads={torch.get_num_threads()}"
    )
    results = {path: measure_in_subprocess(path, args) for path in ("naive", "chunked")}
    gib = 2.0**30
    for path, result in results.items():
        print(
            f"{path:8s} peak above inputs {result['peak_bytes'] / gib:6.2f} GiB "
            f"(logits {result['input_bytes'] / gib:.2f} GiB, earlier peak "
            f"{result['prior_peak_bytes'] / gib:.2f} GiB), fwd+bwd {result['seconds']:.3f} s"
        )
    naive, chunked = results["naive"], results["chunked"]
    print(f"logprob_peak_mem_vs_naive {chunked['peak_bytes'] / naive['peak_bytes']:.3f}")
    print(f"logprob_time_vs_naive {chunked['seconds'] / naive['seconds']:.3f}")


if __name__ == "__main__":
    main()
