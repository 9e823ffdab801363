"""Small PyTorch models for the examples and benchmarks (torchvision is not required).

``resnet18(small_input=True)`` is the CIFAR/Fashion-MNIST variant: a 3x3 stride-1 first
convolution and no max-pool, so 28x28 inputs are not shrunk away in the stem.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def cnn(classes: int = 10, in_channels: int = 1) -> nn.Module:
    """The small MNIST CNN (conv32-conv64-pool-fc128), for 28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 12 * 12, 128), nn.ReLU(),
        nn.Linear(128, classes),
    )  # fmt: skip


def mlp(in_features: int = 784, hidden: int = 512, classes: int = 10) -> nn.Module:
    """784-512-10 MLP (the classic MNIST data-parallel example)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes)
    )


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(True),
            nn.Conv2d(width, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def _resnet(
    block: type[_Basic] | type[_Bottleneck],
    layers: list[int],
    classes: int,
    in_channels: int,
    small_input: bool,
) -> nn.Module:
    if small_input:
        stem = [nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True)]
    else:
        stem = [
            nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(True),
            nn.MaxPool2d(3, 2, 1),
        ]
    stages, cin = [], 64
    for i, blocks in enumerate(layers):
        width = 64 * 2**i
        for j in range(blocks):
            stages.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
            cin = width * block.expansion
    return nn.Sequential(
        *stem, *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)
    )


def resnet18(classes: int = 10, in_channels: int = 3, small_input: bool = True) -> nn.Module:
    """ResNet-18; ``small_input`` uses the 3x3 stride-1 stem without max-pool."""
    return _resnet(_Basic, [2, 2, 2, 2], classes, in_channels, small_input)


def resnet50(classes: int = 1000, in_channels: int = 3, small_input: bool = False) -> nn.Module:
    """ResNet-50 (ImageNet stem by default)."""
    return _resnet(_Bottleneck, [3, 4, 6, 3], classes, in_channels, small_input)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": cnn,
    "mlp": mlp,
    "resnet18": resnet18,
    "resnet50": resnet50,
}
