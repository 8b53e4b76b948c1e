"""Top-k sparsification: send the k = ratio·n coordinates of largest magnitude.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.

    I = indices of the k largest |g_i|;   send (g_I, I);   decode: ĝ_i = g_i for i ∈ I, else 0.

On the wire (the default ``"auto"``: whichever of the two 8-bit block wires of
:mod:`.blockwire` is smaller for k, ``"tight8"`` at the default density): k values in 8
bits (fp8 e4m3 after one power-of-two scale), k 8-bit offsets within blocks of 255
coordinates, a one-byte count per block and the scale: 2·k + ⌈n / 255⌉ + 4 bytes.
``"compact8"``: the 8-bit values with 16-bit offsets within blocks of 65,536 and an int32
count per block, 3·k + 4·⌈n / 65,536⌉ + 4 (smaller below about one coordinate in 255).
``"compact"``: 16-bit values, 4·k + 4·⌈n / 65,536⌉.  ``"indexed"``:
k values in the gradient's dtype and k int32 indices (int64 beyond 2^31 elements),
k × (value bytes + 4) bytes.
"""
from __future__ import annotations

from types import MappingProxyType

from . import register
from .base import Context, check_ratio
from ..kernels import Scratch, exact_top_k, gather
from .recipes import Recipe
from .blockwire import check_wire_format
from .sparsifier import RESIDUAL_CLIPPING_REASON, SparseCompressor, num_selected
from .warmup import DensityWarmup


@register("topk")
class TopKCompressor(DensityWarmup, SparseCompressor):
    """Keep the k = ratio·n entries of largest magnitude; biased, so pair it with residual memory.

    Its memory (``"auto"``) is the residual with the optimizer's momentum before the
    exchange (``memories.create("residual", momentum="optimizer", adam=True)``): an
    ``SGD(momentum=m)`` has m taken over, so each rank accumulates u ← m·u + g, compresses u
    plus its residual, and SGD steps on the exchanged sum without momentum; an Adam's or
    AdamW's β1 is taken over the same way, with momentum factor masking (Adam steps at
    β1 = 0 on what the exchange delivered); with any other optimizer, or none, it is plain
    error feedback.  Why: heavy-ball momentum applied after an error-feedback exchange
    replays a backlog released in one step for 1/(1 − m) steps.

    Under an Adam or AdamW it warms its density up as DGC does (:class:`~.warmup.DensityWarmup`,
    ``warmup="auto"``: 25% down to ``compress_ratio`` over the first four epochs, which
    follow ``set_epoch``; ``warmup_steps=S`` counts S steps instead).  Why: a coordinate a
    sparse exchange first sends late meets a second moment that never saw it and takes an
    oversized step; SGD has no second moment, and under it ``"auto"`` is no warm-up.  An
    explicit ``warmup`` (epochs or densities) applies under any optimizer.  What it reaches
    on the benchmark's tasks: docs/results.md#lm-momentum-placement, #lm-topk-lag and
    #adamw-topk-default.

    Exact (the same selection as ``torch.topk``, up to ties), found through block peaks
    (``kernels.exact_top_k``) instead of a top-k over all n elements.

    A NaN counts as larger than any number, as in ``torch.topk`` (the selection falls back
    to ``torch.topk`` when a NaN hides the candidates); the reducer drops non-finite steps.

    Wire for n elements (``wire_format``): ``"tight8"``, 2·k + ⌈n / 255⌉ + 4 bytes — fp8
    values after one power-of-two scale, the rounding kept by error feedback, and 8-bit
    offsets within blocks of 255 (:mod:`.blockwire`); ``"compact8"``, 3·k + 4·⌈n / 65,536⌉
    + 4 — the same values, 16-bit offsets within blocks of 65,536; ``"auto"``, the default,
    the smaller of those two for k; ``"compact"``, 4·k + 4·⌈n /
    65,536⌉ — bf16 values (a 16-bit gradient's own dtype); ``"indexed"``, k × (value bytes
    + 4) — the values in the input dtype and int32 indices (int64 beyond 2^31 elements).
    The default density, 3.5%, sends on the tight wire fewer bytes than 1% takes on the
    indexed one from an fp32 gradient: 3.5 times the coordinates for 92% of the traffic,
    and as many bytes as 2.5% took on ``"compact8"`` (what that buys:
    docs/results.md#tight-wire).  Payloads of different ranks index different
    coordinates, so they are not summable: use the allgather or PS communicator.
    """

    summable = False
    unbiased = False
    recommended_memory = "residual"
    recommended_memory_options = MappingProxyType({"momentum": "optimizer", "adam": True})
    recommended_communicator = "allgather"
    fixed_size = True
    recipe = Recipe(
        reason=RESIDUAL_CLIPPING_REASON + "; "
               "its default memory applies SGD's momentum before the exchange; under SGD, on a "
               "transformer it lags dense early in training, where the 'dgc' compressor at the "
               "same compress_ratio, with its momentum factor masking and a density warm-up "
               "(warmup_steps = a fifth of the run's steps), reached dense's loss in the "
               "language-model benchmark; under Adam or AdamW top-k does both by default",
        local_clipping=True)

    def __init__(self, compress_ratio: float = 0.035, warmup="auto", warmup_steps: int = 0,
                 wire_format: str = "auto"):
        self.compress_ratio = check_ratio(compress_ratio)
        self.wire_format = check_wire_format(wire_format)
        self._start_warmup(warmup, warmup_steps)
        self._scratch = Scratch()

    knob = "density"

    def compress(self, tensor, name, layout=None):
        self._warn_if_warmup_off()
        self._compressed = True
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.scaled_ratio(name, self.density()))
        # the block wires need the indices ascending
        indices = exact_top_k(flat, k, self._scratch, ascending=self.wire_format != "indexed")
        return self.wire_payload(gather(flat, indices), indices, flat.numel()), Context(tensor.shape, tensor.dtype)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """k coordinates at 3 bytes each (compact8) or 4 (compact), plus 4 per block of
        65,536 (and a 4-byte scale on compact8), at 2 bytes plus 1 per block of 255 and the
        scale (tight8), or k values in the input dtype and k indices (indexed): the
        payload's k, else the configured one."""
        k = payload[0].numel() if payload is not None else num_selected(numel, self.compress_ratio)
        return self.entries_nbytes(k, numel, element_size, payload)
