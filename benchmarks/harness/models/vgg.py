"""VGG-16 for CIFAR-10, with BatchNorm.

Simonyan, Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition",
ICLR 2015 (configuration D), in the CIFAR form used by gradient-compression papers: BatchNorm
after every convolution (Ioffe, Szegedy 2015), 32x32 inputs, and a single linear classifier on
the 512-channel 1x1 feature map instead of the ImageNet 4096-wide layers.  14.7M parameters,
almost all in the last convolutions: a model dominated by large tensors, the opposite of
ResNet-20.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .spec import IMAGE_UNIT, ModelSpec, check_positive_int, classification_loss, register
from .resnet import cifar_batch

POOL = "M"
VGG16_LAYERS = (64, 64, POOL, 128, 128, POOL, 256, 256, 256, POOL,
                512, 512, 512, POOL, 512, 512, 512, POOL)


class CifarVGG(nn.Module):
    """3x3 convolution + BatchNorm + ReLU stacks separated by 2x2 max pools, then a linear."""

    def __init__(self, layers=VGG16_LAYERS, num_classes: int = 10):
        super().__init__()
        check_positive_int("num_classes", num_classes)
        modules, channels = [], 3
        for layer in layers:
            if layer == POOL:
                modules.append(nn.MaxPool2d(2, 2))
                continue
            modules += [nn.Conv2d(channels, layer, 3, padding=1), nn.BatchNorm2d(layer),
                        nn.ReLU(inplace=True)]
            channels = layer
        self.features = nn.Sequential(*modules)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def vgg16(num_classes: int = 10) -> CifarVGG:
    """VGG-16 with BatchNorm for CIFAR-10 (14.7M parameters)."""
    return CifarVGG(VGG16_LAYERS, num_classes)


def vgg_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
              image_size: int = 32, num_classes: int = 10):
    """Synthetic CIFAR-10 batch; ``image_size`` must be a multiple of 32 (five 2x2 pools)."""
    if isinstance(image_size, int) and image_size % 32:
        raise ValueError(f"image_size must be a multiple of 32 for vgg16 (five 2x2 max "
                         f"pools), got {image_size}")
    return cifar_batch(batch_size, device, generator, image_size=image_size,
                       num_classes=num_classes)


VGG16 = register(ModelSpec("vgg16", IMAGE_UNIT, vgg16, vgg_batch, classification_loss,
                           default_batch_size=32,
                           description="VGG-16 with BatchNorm, CIFAR-10 32x32, 14.7M parameters"))
