"""The convergence benchmark applies each compressor's recipe, as a user told by it would."""
import pytest

from tests.distributed import run_ranks


def _benchmark_settings(rank, world_size, label):
    from benchmarks import convergence
    options = convergence.Options(epochs=1, lr=0.05, momentum=0.9, batch_size=32, fusion_num=None, seeds=(0,))
    optimizer, settings = convergence.build(convergence.parse_spec(label), options, convergence.DigitsCNN())
    group = optimizer.optimizer.param_groups[0]
    optimizer.remove_hooks()
    return settings, group["lr"], group["momentum"], optimizer.compressor.compress_ratio \
        if hasattr(optimizer.compressor, "compress_ratio") else None


def test_the_convergence_benchmark_applies_each_recipe():
    pytest.importorskip("sklearn", reason="the convergence benchmark imports scikit-learn's digits")
    settings, lr, momentum, ratio = run_ranks(_benchmark_settings, 1, "randk")[0]
    assert (lr, momentum, ratio) == (pytest.approx(0.5), 0.0, 0.1)
    assert settings["momentum_in"] == "folded into lr" and settings["recipe_arguments"] == {}  # its default is 0.1
    assert settings["advice"] is None
    settings, lr, momentum, _ = run_ranks(_benchmark_settings, 1, "signsgd")[0]
    assert (lr, momentum) == (pytest.approx(0.0005), 0.9)
    settings, lr, momentum, ratio = run_ranks(_benchmark_settings, 1, "randk:compress_ratio=0.05:lr_scale=2")[0]
    assert (lr, momentum, ratio) == (pytest.approx(0.1), 0.0, 0.05)  # the spec's own choices win
    assert "compress_ratio=0.05 is below the 0.1" in settings["advice"]
