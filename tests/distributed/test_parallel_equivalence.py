"""Every layout computes the gradient of the same formula (real megatron-core, gloo, torchrun).

For the warm-up's cross-entropy and for the DAPO policy loss, the loss and every gradient under TP2,
PP2, TP2xPP2, DP2 and 1/2/4 micro-batches (and for DAPO under TP2 and TP2xPP2 with sequence
parallelism) equal plain autograd of the loss written out on the whole batch in one process: the exact
global token mean. The naive mean of micro-batch means differs, so
these tests can tell the two apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("equivalence_worker.py")
pytestmark = pytest.mark.distributed


def run_worker(workdir: Path, out: Path, *flags: str, layout: tuple[int, int, int] = (1, 1, 1)) -> dict:
    """The equivalence worker at `layout` (tp, pp, processes), writing its result to `out`."""
    tp, pp, nproc = layout
    torchrun(
        WORKER, nproc, *flags, "--tp", str(tp), "--pp", str(pp), "--dir", str(workdir), "--out", str(out)
    )
    return torch.load(out)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("equivalence")


@pytest.fixture(scope="module")
def reference(workdir: Path) -> dict[str, dict]:
    """Weights, batches and whole-batch autograd gradients for both objectives, from one process each."""
    out = {}
    for objective in ("ce", "dapo"):
        run_worker(
            workdir,
            workdir / f"{objective}_tp1.pt",
            "--objective",
            objective,
            "--micro-batches",
            "1",
            "--reference",
        )
        out[objective] = torch.load(workdir / f"{objective}_formula.pt")
    return out


def assert_same_gradients(result: dict, expected: dict) -> None:
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert result["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=2e-5, atol=1e-7, msg=name)


LAYOUTS = {  # name: (tp, pp, processes, micro-batches per DP rank)
    "mb1": (1, 1, 1, 1),
    "mb2": (1, 1, 1, 2),
    "mb4": (1, 1, 1, 4),
    "dp2": (1, 1, 2, 2),
    "tp2": (2, 1, 2, 2),
    "pp2": (1, 2, 2, 4),
    "tp2xpp2": (2, 2, 4, 2),
}
CASES = [("ce", name) for name in ("mb4", "dp2", "tp2", "pp2", "tp2xpp2")] + [
    ("dapo", name) for name in ("mb1", "mb2", "mb4", "dp2", "tp2", "pp2", "tp2xpp2")
]


@pytest.mark.parametrize(("objective", "layout"), CASES, ids=[f"{o}-{n}" for o, n in CASES])
def test_layout_gives_the_whole_batch_gradient(
    reference: dict, workdir: Path, objective: str, layout: str
) -> None:
    tp, pp, nproc, micro = LAYOUTS[layout]
    result = run_worker(
        workdir,
        workdir / f"{objective}_{layout}.pt",
        *("--objective", objective, "--micro-batches", str(micro)),
        layout=(tp, pp, nproc),
    )
    assert_same_gradients(result, reference[objective]["formula"])


@pytest.mark.parametrize("layout", ["tp2", "tp2xpp2"])
def test_sequence_parallel_gives_the_whole_batch_gradient(
    reference: dict, workdir: Path, layout: str
) -> None:
    # Sequence parallelism splits the sequence over TP outside the matmuls, so each micro-batch must go in
    # padded to an even length. With PP, sequence-split activations of both widths pass between the stages.
    # The norms' weight gradients are partial sums per TP rank that finalize_model_grads must add up.
    tp, pp, nproc, micro = LAYOUTS[layout]
    result = run_worker(
        workdir,
        workdir / f"sequence_parallel_{layout}.pt",
        *("--objective", "dapo", "--sequence-parallel", "--micro-batches", str(micro)),
        layout=(tp, pp, nproc),
    )
    assert micro_batch_widths(workdir, micro) == [13, 11]
    assert result["model_widths"] == [14, 12]
    assert_same_gradients(result, reference["dapo"]["formula"])


def micro_batch_widths(workdir: Path, micro_batches: int) -> list[int]:
    """Label positions of the DAPO batch's consecutive micro-batches, each cut to its longest row."""
    from dapo_megatron.records import PolicyRows

    batch = torch.load(workdir / "dapo_batch.pt")
    rows = PolicyRows(tokens=batch["tokens"], response_mask=batch["mask"], advantages=batch["advantages"])
    return [mb.tokens.shape[1] for mb in rows.micro_batches([len(rows) // micro_batches] * micro_batches)]


# A budget for this batch's row widths (5-13 label positions): 30 tokens pack 4 micro-batches; halving
# two of them balances the DP ranks better, so each runs 3 (of 2, 1 and 1 rows), and rows of different
# counts and widths pass between the pipeline stages. One DP2 x PP2 run covers both, at the cost of one
# torchrun.
TOKEN_BUDGET, BUDGET_LAYOUT = 30, (1, 2, 4)  # tp, pp, processes


def test_token_budget_micro_batches_give_the_whole_batch_gradient(reference: dict, workdir: Path) -> None:
    result = run_worker(
        workdir,
        workdir / "budget_dp2xpp2.pt",
        *("--objective", "dapo", "--micro-batches", "1", "--max-tokens", str(TOKEN_BUDGET)),
        layout=BUDGET_LAYOUT,
    )
    assert_same_gradients(result, reference["dapo"]["formula"])
    assert result["log_prob_gap"] < 1e-5


def test_token_budget_plan_is_uneven(reference: dict, workdir: Path) -> None:
    # What makes the test above meaningful: micro-batches of different row counts, and DP ranks holding
    # other rows than the contiguous halves of the batch.
    from dapo_megatron.records import PolicyRows
    from dapo_megatron.trainer.batch import split_rows
    from dapo_megatron.trainer.config import TrainerConfig

    batch = torch.load(workdir / "dapo_batch.pt")
    rows = PolicyRows(
        tokens=batch["tokens"], response_mask=batch["mask"], advantages=torch.arange(len(batch["mask"]))
    )
    config = TrainerConfig(train_batch_size=1, ppo_mini_batch_size=1, max_tokens_per_micro_batch=TOKEN_BUDGET)
    shares = [split_rows(rows, 2, rank, config) for rank in range(2)]
    assert [share.micro_batch_sizes for share in shares] == [[[2, 1, 1]], [[2, 1, 1]]]
    assert shares[0].rows.advantages.tolist() != list(range(len(rows) // 2))


@pytest.mark.parametrize("layout", ["mb4", "dp2"])
def test_sequence_mean_ablation_is_exact_too(reference: dict, workdir: Path, layout: str) -> None:
    tp, pp, nproc, micro = LAYOUTS[layout]
    result = run_worker(
        workdir,
        workdir / f"seq_mean_{layout}.pt",
        *("--objective", "dapo", "--loss-agg-mode", "seq-mean-token-mean", "--micro-batches", str(micro)),
        layout=(tp, pp, nproc),
    )
    assert_same_gradients(result, reference["dapo"]["seq-mean-token-mean"])


def test_full_activation_recompute_gives_the_same_gradient(reference: dict, workdir: Path) -> None:
    # megatron-core reruns each layer's forward in backward (its own checkpoint function and RNG tracker,
    # across TP ranks and pipeline stages): the loss and gradients must not change.
    layout = "tp2xpp2"
    tp, pp, nproc, micro = LAYOUTS[layout]
    result = run_worker(
        workdir,
        workdir / f"recompute_{layout}.pt",
        *("--objective", "dapo", "--recompute", "--micro-batches", str(micro)),
        layout=(tp, pp, nproc),
    )
    assert result["layer_forward_calls"] == 2 * micro, "the layers were not recomputed in backward"
    assert_same_gradients(result, reference["dapo"]["formula"])


@pytest.mark.parametrize("objective", ["ce", "dapo"])
def test_naive_mean_of_micro_batch_means_differs(reference: dict, objective: str) -> None:
    formula, naive = reference[objective]["formula"], reference[objective]["naive"]
    assert all(g.abs().max() > 0 for g in formula["grads"].values()), "a zero gradient would prove nothing"
    worst = max(
        ((naive["grads"][n] - g).abs().max() / g.abs().max()).item() for n, g in formula["grads"].items()
    )
    assert worst > 1e-3, "the batch is too even: the test could not tell a global token mean from a naive one"
