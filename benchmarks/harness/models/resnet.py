"""Residual networks: ResNet-20 for CIFAR-10 and ResNet-50 for ImageNet.

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016.

* ResNet-20 (section 4.2): 3 stages of 3 basic blocks with 16/32/64 channels on 32x32
  images; shortcuts that change shape are "option A" (stride-2 subsampling and zero-padded
  channels, no parameters), which gives the paper's 0.27M parameters.
* ResNet-50 (table 1): bottleneck blocks [3, 4, 6, 3], projection shortcuts ("option B"),
  25.6M parameters with 1000 classes.  Global average pooling makes it accept any image side
  of at least 32 pixels; ``image_size`` in the batch lets cheap runs use smaller images.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .spec import IMAGE_UNIT, ModelSpec, check_positive_int, classification_loss, image_batch, register


class PaddingShortcut(nn.Module):
    """Option-A shortcut: subsample by ``stride`` and zero-pad the new channels."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, ::self.stride, ::self.stride]
        half = self.extra_channels // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (CIFAR ResNets)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = PaddingShortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images: stem, 3 stages of n basic blocks, pooling, linear."""

    def __init__(self, depth: int = 20, num_classes: int = 10):
        super().__init__()
        check_positive_int("num_classes", num_classes)
        if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, "
                             f"110), got {depth!r}")
        blocks = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(inplace=True))
        layers, channels = [], 16
        for stage, width in enumerate((16, 32, 64)):
            for index in range(blocks):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(BasicBlock(channels, width, stride))
                channels = width
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ImageNetResNet(nn.Module):
    """Bottleneck ResNet for ImageNet-shaped inputs (7x7 stem, max pool, 4 stages)."""

    def __init__(self, stage_blocks=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        check_positive_int("num_classes", num_classes)
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, channels = [], 64
        for stage, (blocks, width) in enumerate(zip(stage_blocks, (64, 128, 256, 512))):
            for index in range(blocks):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(Bottleneck(channels, width, stride))
                channels = width * Bottleneck.expansion
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, num_classes)
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _init_weights(model: nn.Module) -> None:
    """He initialisation for convolutions, unit BatchNorm (as in the paper)."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def resnet20(num_classes: int = 10) -> CifarResNet:
    """ResNet-20 for CIFAR-10 (0.27M parameters)."""
    return CifarResNet(20, num_classes)


def resnet50(num_classes: int = 1000) -> ImageNetResNet:
    """ResNet-50 for ImageNet (25.6M parameters)."""
    return ImageNetResNet((3, 4, 6, 3), num_classes)


def cifar_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
                image_size: int = 32, num_classes: int = 10):
    """Synthetic CIFAR-10 batch: 3x32x32 images, 10 classes."""
    return image_batch(batch_size, device, generator, image_size=image_size,
                       num_classes=num_classes)


def imagenet_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None,
                   *, image_size: int = 224, num_classes: int = 1000):
    """Synthetic ImageNet batch: 3x224x224 images (or ``image_size`` >= 32), 1000 classes."""
    if isinstance(image_size, int) and 0 < image_size < 32:
        raise ValueError(f"image_size must be at least 32 for resnet50 (five stride-2 "
                         f"reductions), got {image_size}")
    return image_batch(batch_size, device, generator, image_size=image_size,
                       num_classes=num_classes)


RESNET20 = register(ModelSpec("resnet20", IMAGE_UNIT, resnet20, cifar_batch,
                              classification_loss, default_batch_size=32,
                              description="ResNet-20, CIFAR-10 32x32, 0.27M parameters"))
RESNET50 = register(ModelSpec("resnet50", IMAGE_UNIT, resnet50, imagenet_batch,
                              classification_loss, default_batch_size=32,
                              description="ResNet-50, ImageNet 224x224, 25.6M parameters"))
