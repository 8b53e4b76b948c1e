"""Residual error feedback stored in 16 bits: half the memory of ``residual`` for FP32 gradients.

Error feedback (Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019) keeps, per
group, what compression did not send.  Where that costs too much memory (under FSDP2 the
sender keeps a residual for the whole unsharded gradient of every unit) the residual can be
stored in bfloat16 (or float16): it is compensated and computed in the gradient's dtype and
rounded when stored.  The rounding error of each step's stored residual (a relative 2⁻⁹ of it
in bfloat16) is dropped, so the invariant of ``residual`` (sent + residual = sum of the
gradients) holds up to that error; the residual itself keeps every coordinate.
"""
from __future__ import annotations

import torch

from . import register
from .base import Memory, norm_of, subtract_sent
from ..staging import StagedDict

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@register("residual16")
class Residual16Memory(Memory):
    """e + g is compressed; what was not sent, (e + g) − decode(payload), is kept in ``dtype``
    (``"bfloat16"``, the default, or ``"float16"``, whose range is narrower)."""

    def __init__(self, dtype: str = "bfloat16"):
        if dtype not in _DTYPES:
            raise ValueError(f"residual16 memory dtype must be one of {sorted(_DTYPES)}, got {dtype!r}; "
                             "use the 'residual' memory to keep residuals in the gradient's dtype")
        self.dtype = dtype
        self._storage = _DTYPES[dtype]
        self.residuals = StagedDict()

    def compensate(self, tensor, name):
        self._note_incoming(name, tensor)
        residual = self.residuals.get(name)
        if residual is None:
            return tensor
        if residual.numel() != tensor.numel():
            raise ValueError(f"residual of group {name!r} has {residual.numel()} elements but the gradient "
                             f"has {tensor.numel()}: the plan changed without resetting memory")
        return tensor + residual.view(tensor.shape).to(tensor.dtype)

    def update(self, tensor, name, compressor, payload, ctx):
        if compressor.lossless:  # everything was sent exactly: nothing to carry
            self.residuals.pop(name, None)
            self._note_held(name)
            return
        residual = tensor.clone()
        subtract_sent(residual, compressor, payload, ctx)
        self.residuals[name] = residual.reshape(-1).to(self._storage)
        self._note_held(name, self.residuals[name])

    def commit(self):
        self.residuals.commit()

    def rollback(self):
        self.residuals.rollback()

    def error_norm(self):
        """The norm of the residuals: what was computed but not yet sent."""
        return norm_of([r.float() for r in self.residuals.committed().values()])

    def state_dict(self):
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.committed().items()}}

    def check_state(self, state, groups):
        """Residuals are flat tensors of their group's size, in this memory's dtype."""
        unknown = sorted(set(state) - {"residuals"})
        if unknown:
            raise ValueError(f"residual16 memory state has unknown keys {unknown}; expected 'residuals'")
        for name, tensor in state.get("residuals", {}).items():
            if name not in groups:
                raise ValueError(f"residual16 state has a group {name!r} this run does not exchange")
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != groups[name].numel:
                raise ValueError(f"residual of group {name!r} must be a flat tensor of {groups[name].numel} "
                                 f"elements, got {getattr(tensor, 'shape', type(tensor).__name__)}")
            if tensor.dtype != self._storage:
                raise ValueError(f"residual of group {name!r} is {tensor.dtype}, this memory keeps {self.dtype}")

    def load_state_dict(self, state):
        self.residuals.replace({k: v.clone() for k, v in state.get("residuals", {}).items()})

    def __repr__(self):
        return f"Residual16Memory(dtype={self.dtype!r})"
