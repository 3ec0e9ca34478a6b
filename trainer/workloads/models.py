"""Models the CLI can train: a small MLP, a small CNN, and ResNet-18 for small images.

No dropout anywhere and no BatchNorm outside ResNet-18, so that sync mode with
N trainers x batch b computes exactly what one process computes with batch N*b
(BatchNorm's statistics depend on the batch; ResNet-18 keeps its running
statistics local to each trainer, see docs/how-it-works.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

MODELS = ("mlp", "cnn", "resnet18", "widemlp")


class MLP(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], num_classes: int = 10, hidden: int = 256):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(in_shape), hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class WideMLP(nn.Module):
    """About 23M parameters and little compute: the communication-bound workload of ps-bench."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(in_shape), 8192)
        self.fc2 = nn.Linear(8192, 2048)
        self.fc3 = nn.Linear(2048, num_classes)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class CNN(nn.Module):
    """Two conv blocks and two linear layers (about 100k parameters): seconds per epoch on mnist5k."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int = 10):
        super().__init__()
        c = in_shape[0]
        self.conv1 = nn.Conv2d(c, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        x = self.pool(x).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


class Residual(nn.Module):
    """d2l's residual block: two 3x3 convs with BatchNorm, optional 1x1 projection."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.proj = nn.Conv2d(cin, cout, 1, stride=stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.proj(x) if self.proj is not None else x))


class ResNet18(nn.Module):
    """ResNet-18 for small images as in d2l (ch. 13.6): 3x3 stem, stride 1, no max-pool."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_shape[0], 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Residual(cin, cout, stride), Residual(cout, cout)]
            cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int = 10, seed: int = 0) -> nn.Module:
    """Every trainer builds the same initial weights from ``seed``."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(in_shape, num_classes)
    if name == "cnn":
        return CNN(in_shape, num_classes)
    if name == "resnet18":
        return ResNet18(in_shape, num_classes)
    if name == "widemlp":
        return WideMLP(in_shape, num_classes)
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
