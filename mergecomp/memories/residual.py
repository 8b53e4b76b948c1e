"""Residual error feedback.

Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import register
from .base import Memory, check_number, clip_local, norm_of, subtract_sent
from ..checkpoint import check_group_tensors
from ..staging import Spares, StagedDict, shares_memory


@register("residual")
class ResidualMemory(Memory):
    """e ← β·e + γ·g is compressed; what was not sent, (β·e + γ·g) − decode(payload), is kept.

    With β = γ = 1 (the default) the invariant is exact: over any number of steps,
    everything transmitted plus the current residual equals the sum of the gradients.
    β < 1 lets old errors fade (β = 0 keeps none); γ scales the gradient, e.g. by the
    learning rate as in EF-SGD.

    A step's residuals are staged: :meth:`commit` keeps them, :meth:`rollback` restores
    the previous step's.  A committed residual is never changed in place; the tensors a
    step writes come from the ones earlier commits replaced (page faults of a fresh
    group-sized tensor per step cost more than the arithmetic on a CPU).
    """

    def __init__(self, beta: float = 1.0, gamma: float = 1.0, clip_norm: Optional[float] = None):
        self.beta = check_number(beta, "residual memory beta (the residual's decay)", 0.0, 1.0,
                                 advice="1 keeps every error (the usual choice), 0 none; a "
                                        "decay above 1 would grow the residual without bound.")
        self.gamma = check_number(gamma, "residual memory gamma (the gradient's scale)", 0.0,
                                  float("inf"), low_open=True, high_open=True,
                                  advice="1 is usual; 0 or less would send nothing or the "
                                         "opposite of the gradient.")
        if clip_norm is not None:
            clip_norm = check_number(clip_norm, "residual memory clip_norm", 0.0, float("inf"),
                                     low_open=True, high_open=True,
                                     advice="Pass None for no clipping; clip_norm = your clip / √N "
                                            "for N ranks clips as the averaged gradient would.")
        self.clip_norm = clip_norm  # local clipping: the gradient, before the residual is added
        self.residuals = StagedDict()
        self._made = {}  # group → the tensor compensate() made this step (ours to reuse)
        self._spares = Spares()  # residuals no state holds, reused by compensate() and update()

    def compensate(self, tensor, name):
        if self.clip_norm is not None:
            tensor = clip_local(tensor, self.clip_norm)
        residual = self.residuals.get(name)
        if residual is None:
            self._made.pop(name, None)
            return tensor if self.gamma == 1.0 else tensor * self.gamma
        if residual.shape != tensor.shape:
            raise ValueError(
                f"residual of group {name!r} has shape {tuple(residual.shape)} but the gradient "
                f"has shape {tuple(tensor.shape)}: the plan changed without resetting memory")
        out = self._spares.take(name, tensor)
        if self.gamma == 1.0 and self.beta == 1.0:
            compensated = torch.add(tensor, residual, out=out)
        else:
            scaled = tensor if self.gamma == 1.0 else tensor * self.gamma
            compensated = torch.add(scaled, residual if self.beta == 1.0 else residual * self.beta, out=out)
        self._made[name] = compensated
        return compensated

    def update(self, tensor, name, compressor, payload, ctx):
        made = self._made.pop(name, None)
        if compressor.lossless:  # everything was sent exactly: nothing to carry
            self.residuals.pop(name, None)
            return
        if made is tensor and not shares_memory(payload, (tensor,)):
            residual = tensor  # made by compensate() this step, sent already: it becomes the residual
        else:
            spare = self._spares.take(name, tensor)
            residual = tensor.clone() if spare is None else spare.copy_(tensor)
        subtract_sent(residual, compressor, payload, ctx)
        self.residuals[name] = residual

    def commit(self):
        self._made.clear()
        self._spares.recycle_commit(self.residuals)

    def rollback(self):
        self._made.clear()
        self._spares.recycle_rollback(self.residuals)

    def error_norm(self):
        """The norm of the residuals: what was computed but not yet sent."""
        return norm_of(self.residuals.committed().values())

    def state_dict(self):
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.committed().items()}}

    def check_state(self, state, groups):
        """Residuals are flat tensors of their group's size and dtype."""
        unknown = sorted(set(state) - {"residuals"})
        if unknown:
            raise ValueError(f"residual memory state has unknown keys {unknown}; expected 'residuals'")
        check_group_tensors("residual", state.get("residuals", {}), groups)

    def load_state_dict(self, state):
        self._made.clear()
        self._spares.clear()
        self.residuals.replace({k: v.clone() for k, v in state.get("residuals", {}).items()})

    def __repr__(self):
        clip = "" if self.clip_norm is None else f", clip_norm={self.clip_norm}"
        return f"ResidualMemory(beta={self.beta}, gamma={self.gamma}{clip})"
