"""Training backends behind one protocol (`base.TrainBackend`), and the one place where the
CPU speed-ups are chosen.

    backend = create_backend("fsdp2", DistSpec(rank=0, world_size=2, addr=...))
    backend.setup(model, OptimizerSpec(lr=1e-6), resolve_device("auto"))

| name      | what                                                               |
|-----------|--------------------------------------------------------------------|
| local     | one process, any device                                            |
| cpu       | local plus the CPU speed-ups of `agentrl.backends.cpu` (measured)  |
| fsdp2     | parameters, gradients and optimizer state sharded over Ray ranks   |
| deepspeed | DeepSpeed ZeRO 1-3 over Ray ranks                                  |

`auto` is cpu on a CPU device and local elsewhere. A new backend is one file implementing the
protocol plus its line in BACKENDS. Importing this package loads neither torch nor a backend.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from agentrl.backends.base import DistSpec, NonFiniteLossError, OptimizerSpec, TrainBackend
from agentrl.backends.device import check_device_name, resolve_device

if TYPE_CHECKING:
    import torch

BACKENDS = {
    "local": "agentrl.backends.local:LocalBackend",
    "cpu": "agentrl.backends.cpu.backend:CPUBackend",
    "fsdp2": "agentrl.backends.fsdp2:FSDP2Backend",
    "deepspeed": "agentrl.backends.deepspeed:DeepSpeedBackend",
}
DISTRIBUTED = ("fsdp2", "deepspeed")
"""Backends whose ranks are separate Ray actors joined by a process group."""

_NEEDS = {"deepspeed": ("deepspeed", "pip install deepspeed (agentrl's dev extra pins 0.19.8)")}


def check_backend_name(name: str, flag: str = "--backend") -> None:
    """ValueError (with a did-you-mean) unless `name` is auto or a known backend whose package
    is installed; imports nothing heavy."""
    choices = ("auto", *BACKENDS)
    if name not in choices:
        hint = difflib.get_close_matches(name, choices, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"{flag} {name!r} is unknown.{did_you_mean} Choose one of: "
                         f"{', '.join(choices)}")
    if name in _NEEDS:
        package, how = _NEEDS[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} {name} needs the {package} package: {how}")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` -> cpu on a CPU device, local elsewhere; other names unchanged."""
    if name != "auto":
        return name
    return "cpu" if device.type == "cpu" else "local"


def create_backend(name: str, dist: DistSpec | None = None) -> TrainBackend:
    """A new (not yet set up) backend by name (not `auto`: resolve it first)."""
    check_backend_name(name)
    from agentrl.plugins import load_attr

    return load_attr(BACKENDS[name], "Backend")(dist)


def engine_options(device: torch.device | str) -> dict[str, Any]:
    """Keyword arguments for `TransformersEngine` on `device`: on a CPU the lean decode step of
    `agentrl.backends.cpu` (compiled kernels where measured faster); elsewhere none."""
    import torch

    if torch.device(device).type != "cpu":
        return {}
    from agentrl.backends import cpu

    return cpu.engine_options()


__all__ = [
    "BACKENDS",
    "DISTRIBUTED",
    "DistSpec",
    "NonFiniteLossError",
    "OptimizerSpec",
    "TrainBackend",
    "check_backend_name",
    "check_device_name",
    "create_backend",
    "engine_options",
    "resolve_backend_name",
    "resolve_device",
]
