"""What the benchmark needs to know about a model: how to build it, feed it and score it.

A :class:`ModelSpec` bundles a builder, a synthetic-batch generator and a loss, so that
``compress_benchmark.py`` and the tests can time any model with the same few lines::

    spec = models.get("resnet20")
    model = spec.build()
    inputs, targets = spec.batch(32, device="cpu")
    spec.loss(model(inputs), targets).backward()

Synthetic data is enough for throughput measurements (the cost of a step does not depend on
the pixel values) and keeps the project free of dataset downloads.  Batches are drawn from a
``torch.Generator`` on the requested device, so two calls with equally seeded generators give
identical batches on every rank and every run.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

IMAGE_UNIT = "img"
SEQUENCE_UNIT = "seq"
VECTOR_UNIT = "sample"


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model.

    ``unit`` names what one sample is, for throughput reports: ``"img"`` for image models,
    ``"seq"`` for language models (one sample is one token sequence), ``"sample"`` for a
    model of plain feature vectors.
    ``build(**kwargs)`` returns a fresh ``nn.Module``; ``batch(batch_size, device, generator,
    **kwargs)`` returns ``(inputs, targets)``; ``loss(outputs, targets)`` returns a scalar.
    """

    name: str
    unit: str
    build: Callable[..., nn.Module]
    batch: Callable[..., Tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]
    default_batch_size: int
    description: str = ""

    def __post_init__(self):
        if self.unit not in (IMAGE_UNIT, SEQUENCE_UNIT, VECTOR_UNIT):
            raise ValueError(f"model {self.name!r}: unit must be {IMAGE_UNIT!r}, {SEQUENCE_UNIT!r} or "
                             f"{VECTOR_UNIT!r}, got {self.unit!r}")
        check_positive_int(f"model {self.name!r} default_batch_size", self.default_batch_size)


_SPECS: Dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to the table behind :func:`get`; a taken name raises ValueError."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register expects a ModelSpec, got {type(spec).__name__}")
    if spec.name in _SPECS and _SPECS[spec.name] is not spec:
        raise ValueError(f"model name {spec.name!r} is already registered; choose another name")
    _SPECS[spec.name] = spec
    return spec


def available() -> List[str]:
    """Names of every registered model, sorted."""
    return sorted(_SPECS)


def get(name: str) -> ModelSpec:
    """The spec registered under ``name``; ValueError naming the closest match if none."""
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        names = available()
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown model {name!r}: {hint}available models are "
                         f"{', '.join(names)}") from None


# ----------------------------------------------------------------------------- validation

def check_positive_int(what: str, value) -> int:
    """``value`` if it is an int >= 1, else ValueError saying what was wrong."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_probability(what: str, value) -> float:
    """``value`` if it is a number in [0, 1), else ValueError (used for dropout rates)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{what} must be a number in [0, 1), got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- synthetic data

def make_generator(device, generator: Optional[torch.Generator], seed: int = 0) -> torch.Generator:
    """``generator`` checked against ``device``, or a fresh one seeded with ``seed``.

    Sampling with a generator requires it to live on the device the tensor is created on.
    """
    device = torch.device(device)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return generator
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the batch is requested on "
                         f"{device}; create it with torch.Generator(device={str(device)!r})")
    return generator


def image_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
                image_size: int, num_classes: int, channels: int = 3) -> Tuple[Tensor, Tensor]:
    """Standard-normal images ``(B, C, H, W)`` and uniform labels ``(B,)``."""
    check_positive_int("batch_size", batch_size)
    check_positive_int("image_size", image_size)
    check_positive_int("num_classes", num_classes)
    generator = make_generator(device, generator)
    images = torch.randn(batch_size, channels, image_size, image_size, device=device,
                         generator=generator)
    labels = torch.randint(num_classes, (batch_size,), device=device, generator=generator)
    return images, labels


def token_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
                seq_len: int, vocab_size: int) -> Tuple[Tensor, Tensor]:
    """Uniform token ids ``(B, T)`` and the next-token targets ``(B, T)``.

    Targets are the inputs shifted by one position, as in language-model training.
    Batch-first, so data parallelism splits along dimension 0 like for images.
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    check_positive_int("vocab_size", vocab_size)
    generator = make_generator(device, generator)
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), device=device,
                           generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ----------------------------------------------------------------------------- losses

def classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross entropy of ``(B, classes)`` logits against ``(B,)`` labels."""
    return F.cross_entropy(logits, labels)


def language_model_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every token: ``(B, T, V)`` logits, ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
