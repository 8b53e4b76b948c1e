"""Residual error feedback.

Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""
from __future__ import annotations

import torch

from . import register
from .base import Memory, check_number
from ..staging import StagedDict


@register("residual")
class ResidualMemory(Memory):
    """e ← β·e + γ·g is compressed; what was not sent, (β·e + γ·g) − decode(payload), is kept.

    With β = γ = 1 (the default) the invariant is exact: over any number of steps,
    everything transmitted plus the current residual equals the sum of the gradients.
    β < 1 lets old errors fade (β = 0 keeps none); γ scales the gradient, e.g. by the
    learning rate as in EF-SGD.

    A step's residuals are staged: :meth:`commit` keeps them, :meth:`rollback` restores
    the previous step's.  A residual is replaced by a new tensor, never changed in place.
    """

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        self.beta = check_number(beta, "residual memory beta (the residual's decay)", 0.0, 1.0,
                                 advice="1 keeps every error (the usual choice), 0 none; a "
                                        "decay above 1 would grow the residual without bound.")
        self.gamma = check_number(gamma, "residual memory gamma (the gradient's scale)", 0.0,
                                  float("inf"), low_open=True, high_open=True,
                                  advice="1 is usual; 0 or less would send nothing or the "
                                         "opposite of the gradient.")
        self.residuals = StagedDict()

    def compensate(self, tensor, name):
        residual = self.residuals.get(name)
        scaled = tensor if self.gamma == 1.0 else tensor * self.gamma
        if residual is None:
            return scaled
        if residual.shape != tensor.shape:
            raise ValueError(
                f"residual of group {name!r} has shape {tuple(residual.shape)} but the gradient "
                f"has shape {tuple(tensor.shape)}: the plan changed without resetting memory")
        return scaled + (residual if self.beta == 1.0 else residual * self.beta)

    def update(self, tensor, name, compressor, payload, ctx):
        if compressor.lossless:  # everything was sent exactly: nothing to carry
            self.residuals.pop(name, None)
            return
        sent = compressor.decompress(payload, ctx)
        self.residuals[name] = tensor - sent.view_as(tensor)

    def commit(self):
        self.residuals.commit()

    def rollback(self):
        self.residuals.rollback()

    def state_dict(self):
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.committed().items()}}

    def load_state_dict(self, state):
        self.residuals.replace({k: v.clone() for k, v in state.get("residuals", {}).items()})

    def __repr__(self):
        return f"ResidualMemory(beta={self.beta}, gamma={self.gamma})"
