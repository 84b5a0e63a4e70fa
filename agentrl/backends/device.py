"""The device as a parameter: parsing `--actor.device`, and what follows from the device.

`auto` is cuda when a CUDA device is visible, else cpu. Inside a Ray actor that was given one
GPU, Ray sets CUDA_VISIBLE_DEVICES and that GPU is `cuda:0`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_name(name: str, flag: str = "--actor.device") -> None:
    """Raise ValueError unless `name` is auto, cpu, cuda or cuda:N (no torch import)."""
    if not _PATTERN.match(name):
        raise ValueError(f"{flag} {name!r} is not a device: use auto, cpu, cuda or cuda:N")


def resolve_device(name: str, flag: str = "--actor.device") -> torch.device:
    """The torch device `name` stands for; ValueError where it is not there."""
    import torch

    check_device_name(name, flag)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{flag} {name}: no CUDA device is visible (torch.cuda.is_available() is "
                f"False); use {flag} cpu, or auto to take a GPU where there is one"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{flag} {name}: only {count} CUDA device(s) are visible (cuda:0..cuda:"
                f"{count - 1}); pick one of those"
            )
    return device


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def autocast(device: torch.device, mixed_precision: str) -> Any:
    """bf16 autocast on `device` for mixed_precision "bf16" (a disabled context otherwise)."""
    import torch

    return torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16"
    )
