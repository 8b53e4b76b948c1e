"""The convergence benchmark, small: a few compressors train the digits CNN on 2 gloo ranks and
must stay within a gap of dense; a compressor that sends zeros or noise must not.

One spawn for every row (``benchmarks/convergence.py``'s own training code, few epochs,
one seed).  The broken compressors are registered inside the rank processes only, so the
registry of the test session (which other tests iterate) never sees them.
"""
import pytest
import torch

pytest.importorskip("sklearn", reason="the digits dataset comes from scikit-learn (pip install -e .[test])")

from benchmarks import convergence  # noqa: E402
from mergecomp import compressors  # noqa: E402
from mergecomp.runtime.agreement import agreement_nbytes  # noqa: E402
from mergecomp.compressors import Compressor, Context  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

#: Rows that must train: one per family (a cast, a sparsifier with error feedback, DGC with
#: its warm-up and momentum correction, a scaled sign with error feedback and its recipe's
#: folded momentum, signSGD with its recipe's learning rate).
HEALTHY = ("fp16", "topk", "dgc", "efsignsgd", "signsgd")
BROKEN = ("sends_zeros", "sends_noise")
#: Ten epochs: DGC's four-epoch warm-up (dense early, momentum masked) needs the rest to catch up.
OPTIONS = convergence.Options(epochs=10, lr=0.05, momentum=0.9, batch_size=32, fusion_num=1, seeds=(0,))
#: Points of test accuracy a healthy compressor may lose to dense in this short run.
MAX_GAP_POINTS = 15.0


class SendsZeros(Compressor):
    """A broken compressor: the payload has the right size and every value zero."""

    summable = True
    recommended_communicator = "allreduce"

    def compress(self, tensor, name):
        return (torch.zeros_like(tensor.reshape(-1)),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return payload[0].view(ctx.shape)


class SendsNoise(SendsZeros):
    """A broken compressor: Gaussian noise of the gradient's own norm in place of it."""

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        noise = torch.randn_like(flat)
        noise.mul_(flat.norm() / noise.norm().clamp(min=1e-12))
        return (noise,), Context(tensor.shape, tensor.dtype)


def _train_rows(rank, world_size, labels):
    for name, cls in zip(BROKEN, (SendsZeros, SendsNoise)):
        if name not in compressors.registry:
            compressors.register(name)(cls)
    data = convergence.load_digits_split()
    return {label: convergence.train_one(convergence.parse_spec(label), 0, OPTIONS, data, rank, world_size)
            for label in labels}


@pytest.fixture(scope="module")
def rows():
    ranks = run_ranks(_train_rows, 2, (convergence.DENSE,) + HEALTHY + BROKEN, timeout=240)
    return ranks[0]


def _gap(rows, label):
    return 100.0 * (rows[convergence.DENSE]["test_accuracy"] - rows[label]["test_accuracy"])


def test_dense_learns_the_digits(rows):
    assert rows[convergence.DENSE]["test_accuracy"] > 0.85, rows[convergence.DENSE]["curve"]


@pytest.mark.parametrize("label", HEALTHY)
def test_compressor_stays_near_dense(rows, label):
    gap = _gap(rows, label)
    assert not rows[label]["diverged"], f"{label} diverged: losses {rows[label]['train_loss']}"
    assert gap < MAX_GAP_POINTS, (f"{label} reached {100 * rows[label]['test_accuracy']:.1f}% against "
                                  f"dense {100 * rows[convergence.DENSE]['test_accuracy']:.1f}%")


@pytest.mark.parametrize("label", BROKEN)
def test_broken_compressor_fails_the_gap(rows, label):
    assert _gap(rows, label) >= MAX_GAP_POINTS, (
        f"a compressor that {label.replace('_', ' ')} reached "
        f"{100 * rows[label]['test_accuracy']:.1f}%: the gap no longer tells broken from healthy")


def test_bytes_per_step_come_from_the_backend(rows):
    dense, topk = rows[convergence.DENSE], rows["topk"]
    parameters = sum(p.numel() for p in convergence.DigitsCNN().parameters())
    # One fp32 allreduce of every gradient, and the step's agreement (checks and outcome).
    assert dense["bytes_per_step"] == 4 * parameters + agreement_nbytes(2)
    assert 0 < topk["bytes_per_step"] < dense["bytes_per_step"] / 20


def _progress_lines(rank, world_size):
    import contextlib
    import dataclasses
    import io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        convergence.train_one(convergence.parse_spec("fp16"), 0, dataclasses.replace(OPTIONS, epochs=2),
                              convergence.load_digits_split(), rank, world_size)
    return printed.getvalue()


def test_rank_0_prints_a_line_at_each_epoch():
    printed, silent = run_ranks(_progress_lines, 2)
    lines = printed.splitlines()
    assert [line.split(",")[0] for line in lines] == ["fp16 seed 0: epoch 1 of 2", "fp16 seed 0: epoch 2 of 2"]
    assert all("test accuracy" in line and "train loss" in line for line in lines), lines
    assert silent == ""
