"""PyTorch's data-parallel tutorial, written with fdp.

The tutorial (https://pytorch.org/tutorials/beginner/blitz/data_parallel_tutorial.html) wraps a
``Linear(5, 2)`` in ``nn.DataParallel`` and prints the sizes each replica sees: a batch of 30
becomes 15 + 15 on 2 GPUs and 4,4,4,4,4,4,4,2 on 8. Here the model is a function of its
parameters, ``fdp.pmap`` maps it over the devices, and CPU devices work too:

    python examples/data_parallel_tutorial.py --devices cpu,cpu
    python examples/data_parallel_tutorial.py --devices 'cpu*8'
    python examples/data_parallel_tutorial.py            # every GPU, or the CPU

The replicas run in parallel threads, so their lines come in any order.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import fdp

# Parameters and DataLoaders
input_size = 5
output_size = 2

batch_size = 30
data_size = 100


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class Model(nn.Module):
    # Our model

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = self.fc(input)
        # One write per line: the replicas print from parallel threads.
        print(f"\tIn Model: input size {input.size()} output size {output.size()}\n", end="", flush=True)
        return output


def parse_devices(text: str | None) -> list[str] | None:
    """``"cpu,cpu"`` -> ``["cpu", "cpu"]``; ``"cpu*8"`` -> eight CPU devices; None: fdp's default."""
    if text is None:
        return None
    devices: list[str] = []
    for item in text.split(","):
        name, _, count = item.strip().partition("*")
        devices += [name] * (int(count) if count else 1)
    return devices


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", help="comma-separated devices, e.g. cpu,cpu or cuda:0,cuda:1 or 'cpu*8'")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    rand_loader = DataLoader(
        dataset=RandomDataset(input_size, data_size), batch_size=batch_size, shuffle=True
    )
    model = Model(input_size, output_size)

    parallel_model = fdp.pmap(model, devices=parse_devices(args.devices))  # Key line.
    devices = parallel_model.devices
    print("Let's use", len(devices), "devices!", [str(d) for d in devices])

    device = devices[0]
    model.to(device)
    params = dict(model.named_parameters())

    for data in rand_loader:
        input = data.to(device)
        output = parallel_model(params, input)
        print("Outside: input size", input.size(), "output_size", output.size())


if __name__ == "__main__":
    main()
