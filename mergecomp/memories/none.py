"""No error feedback: what compression loses is lost."""
from . import register
from .base import Memory


@register("none")
class NoneMemory(Memory):
    """Passes gradients through untouched; for unbiased or lossless compressors.

    What it measures on the drift's measured steps (:mod:`mergecomp.runtime.drift`): nothing
    is held back, so there is no lag; for a compressor whose error is noise
    (:attr:`~mergecomp.compressors.base.Compressor.reads_noise`: QSGD, TernGrad, unbiased
    rand-k, ATOMO) the exchange's *noise* instead, ``‖decode(compress(g)) − g‖`` against
    ``‖g‖``: one decode of this rank's own payload per group on a measured step.  A biased
    compressor without error feedback (signSGD's vote) and one with its own (PowerSGD) are
    not measured here."""

    #: What :meth:`drift_terms` measures: the compression's noise, not a held-back lag.
    drift_kind = "noise"

    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, payload, ctx):
        # ``tensor`` is what compensate() passed through: this step's gradient.  Only a
        # measured step of a compressor whose error is noise reads it (a decode and two norms).
        if self.measuring and compressor.reads_noise and not (compressor.lossless or compressor.error_feedback):
            sent = tensor.reshape(-1)
            decoded = compressor.decompress(payload, ctx).reshape(-1)
            self._note_incoming(name, sent)
            self._note_held(name, decoded - sent.to(decoded.dtype))
        return None
