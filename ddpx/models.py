"""Models for the example scripts."""

import torch
from torch import nn

__all__ = ["ToyModel", "ToyMpModel"]


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
