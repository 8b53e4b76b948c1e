"""Residual error feedback.

Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""
from __future__ import annotations

from typing import Dict

import torch

from . import register
from .base import Memory


@register("residual")
class ResidualMemory(Memory):
    """e ← β·e + γ·g is compressed; what was not sent, (β·e + γ·g) − decode(payload), is kept.

    With β = γ = 1 (the default) the invariant is exact: over any number of steps,
    everything transmitted plus the current residual equals the sum of the gradients.
    """

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: Dict[str, torch.Tensor] = {}

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

    def state_dict(self):
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state):
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}

    def __repr__(self):
        return f"ResidualMemory(beta={self.beta}, gamma={self.gamma})"
