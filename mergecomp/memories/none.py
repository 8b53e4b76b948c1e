"""No error feedback: what compression loses is lost."""
from . import register
from .base import Memory


@register("none")
class NoneMemory(Memory):
    """Passes gradients through untouched; for unbiased or lossless compressors."""

    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, payload, ctx):
        return None
