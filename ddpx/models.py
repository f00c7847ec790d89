"""Models for the example scripts and the benchmark."""

import math

import torch
from torch import nn

__all__ = ["MLP", "ToyModel", "ToyMpModel"]


class ToyModel(nn.Module):
    """Linear(10, 10) -> ReLU -> Linear(10, 5): (batch, 10) -> (batch, 5)."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyMpModel(ToyModel):
    """ToyModel split over two devices: net1 on `dev0`, net2 and the output on `dev1`."""

    def __init__(self, dev0: torch.device | str, dev1: torch.device | str):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1.to(self.dev0)
        self.net2.to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


class MLP(nn.Sequential):
    """`depth` Linear(width, width) layers with ReLU between: (batch, width) -> (batch, width).

    It has depth * (width**2 + width) parameters: `MLP.with_params(25_000_000)` has width 2040
    and depth 6 (24.98M parameters).
    """

    def __init__(self, width: int, depth: int):
        layers = [nn.Linear(width, width)]
        for _ in range(depth - 1):
            layers += [nn.ReLU(), nn.Linear(width, width)]
        super().__init__(*layers)
        self.width = width

    @classmethod
    def with_params(cls, n_params: int, depth: int = 6) -> "MLP":
        """The MLP of `depth` layers with about `n_params` parameters (width a multiple of 8)."""
        width = max(8, round(math.sqrt(n_params / depth) / 8) * 8)
        return cls(width, depth)
