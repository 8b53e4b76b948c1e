"""Components that own the momentum refuse an optimizer that has one too (the dgc memory
takes SGD's and Adam's over instead: tests/test_momentum_takeover.py)."""
import pytest
import torch

from mergecomp import compressors


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("component", [lambda: compressors.create("signum")])
def test_second_momentum_is_refused(component):
    with pytest.raises(ValueError, match=r"group 0 of SGD has momentum=0.9"):
        component().check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"group 0 of Adam has betas\[0\]=0.9"):
        component().check_optimizer(torch.optim.Adam(params(), lr=0.1))
    component().check_optimizer(torch.optim.SGD(params(), lr=0.1, weight_decay=1e-4))  # fine


def test_signum_under_an_adam_is_told_what_to_use():
    with pytest.raises(ValueError, match=r"Under an Adam, use the efsignsgd compressor") as refused:
        compressors.create("signum").check_optimizer(torch.optim.AdamW(params(), lr=1e-3))
    assert "betas=(0, beta2)" in str(refused.value) and "plain SGD" not in str(refused.value)
    assert "signsgd compressor's majority vote" in str(refused.value)  # the vote is named, as the second choice
    with pytest.raises(ValueError, match=r"Use plain SGD \(momentum=0\)"):
        compressors.create("signum").check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    compressors.create("signum").check_optimizer(torch.optim.AdamW(params(), lr=1e-3, betas=(0.0, 0.999)))
