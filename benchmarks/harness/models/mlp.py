"""A three-layer perceptron on random feature vectors: gradients that are nothing but a few
large matrices.

``width`` → ``2·width`` → ``width`` → 10 classes, ReLU between (4.2M parameters at the default
width of 1024).  No convolution or recurrence: a step's compute is three matrix products, so
the exchange, and the compressor's passes over the gradient, are a large share of it.  The
communicator comparisons of ``benchmarks/headline.py exchanges`` run on it (``--width``
resizes it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .spec import VECTOR_UNIT, ModelSpec, check_positive_int, classification_loss, make_generator, register

NUM_CLASSES = 10


def mlp(width: int = 1024) -> nn.Sequential:
    """Linear(width, 2·width), ReLU, Linear(2·width, width), ReLU, Linear(width, 10)."""
    check_positive_int("width", width)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width), nn.ReLU(),
                         nn.Linear(width, NUM_CLASSES))


def vector_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
                 width: int = 1024):
    """Standard-normal vectors ``(B, width)`` and uniform labels ``(B,)`` of 10 classes."""
    check_positive_int("batch_size", batch_size)
    check_positive_int("width", width)
    generator = make_generator(device, generator)
    inputs = torch.randn(batch_size, width, device=device, generator=generator)
    labels = torch.randint(NUM_CLASSES, (batch_size,), device=device, generator=generator)
    return inputs, labels


MLP = register(ModelSpec("mlp", VECTOR_UNIT, mlp, vector_batch, classification_loss, default_batch_size=8,
                         description="three-layer perceptron on random vectors, width 1024: 4.2M parameters"))
