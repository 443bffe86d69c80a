"""Device arguments: parsing, defaults and availability checks.

Every public entry point that takes devices goes through :func:`resolve_devices`, so the
spelling rules (ints are CUDA indices, strings, ``torch.device``) and the error messages live
in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CPU", "DeviceLike", "parse_device", "resolve_devices", "default_devices", "check_available"]

DeviceLike = int | str | torch.device

_SUPPORTED_TYPES = ("cpu", "cuda")

CPU = torch.device("cpu")
"""The CPU, as :func:`parse_device` spells it. Paths taken on every call test ``device == CPU``:
reading ``device.type`` builds a new string each time (~10 µs right after a step's kernels
have evicted torch's code from the caches, against ~3 µs for the comparison)."""


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


def _as_list_spelling(text: str) -> str | None:
    """The list of devices that a command-line spelling of several means (the examples'
    ``--devices cpu,cpu`` or ``'cpu*8'``), written in Python, or None for another string."""
    if "," not in text and "*" not in text:
        return None
    counted = []
    for item in text.split(","):
        name, star, count = (part.strip() for part in item.partition("*"))
        if not _is_device(name) or (star and not (count.isdigit() and int(count) > 0)):
            return None
        counted.append((name, int(count) if star else 1))
    if len(counted) == 1:
        return f"[{counted[0][0]!r}] * {counted[0][1]}"
    if sum(count for _, count in counted) > 8:
        # Written out, 'cpu*64,cuda:0' would be a list too long to read ('cpu*10**11,cpu' one
        # too long to build: the error would never come).
        return " + ".join(f"[{name!r}] * {count}" if count > 1 else f"[{name!r}]" for name, count in counted)
    return repr([name for name, count in counted for _ in range(count)])


def parse_device(device: object, *, what: str, replica: bool = False) -> torch.device:
    """Turns one device spelling into a ``torch.device`` without touching the hardware.

    ``what`` names the argument in error messages, e.g. ``"fdp.pmap devices[2]"``; ``replica``:
    ``device`` is an entry of a list of replicas' devices, for the advice.
    """
    if isinstance(device, bool):  # bool is an int subclass: True is no CUDA index
        raise TypeError(f"{what} must be an int, str or torch.device, got bool: {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{what} must be a non-negative CUDA index, got {device}")
        parsed = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError as err:
            spelled = _as_list_spelling(device) if replica else None
            # The examples' --devices 'cpu*8' in one entry of a list: the list is the replicas.
            advice = (
                "" if spelled is None else f"; a list names one device per replica: for {device!r}, {spelled}"
            )
            raise ValueError(f"{what} is not a device: {device!r} ({err}){advice}") from None
    elif isinstance(device, torch.device):
        parsed = device
    else:
        raise TypeError(
            f"{what} must be an int, str or torch.device, got {type(device).__name__}: {device!r}"
        )
    if parsed.type not in _SUPPORTED_TYPES:
        raise ValueError(f"{what}: fdp runs on cpu and cuda devices, got {str(parsed)!r}")
    if parsed.type == "cpu":
        # "cpu:0" and "cpu" are the same memory; one spelling keeps comparisons simple.
        parsed = CPU
    return parsed


def default_devices() -> tuple[torch.device, ...]:
    """All visible CUDA devices, else one CPU device; under fdp.distributed, this process's own."""
    from . import _distributed  # local: _distributed is optional machinery on top of this module

    return tuple(_distributed.local_devices())


def check_available(device: torch.device, *, what: str, replica: bool = False) -> torch.device:
    """Checks that ``device`` exists on this machine; pins a bare ``cuda`` to an index.

    ``replica``: ``device`` is one of a list of replicas' devices, for the advice.
    """
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        # Most often GPU code (nn.DataParallel's device_ids=[0, 1]) run on a laptop or a CPU
        # build of torch: say how to run the same replicas on the CPU.
        why = (
            f"this torch, {torch.__version__}, is built without CUDA"
            # (A ROCm build has no CUDA version, but runs its AMD GPUs as torch.cuda's devices.)
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None
            else "no GPU or driver found"
        )
        instead = (
            "to run the replicas on the CPU, name it once per replica: ['cpu', 'cpu'] runs two"
            if replica
            else "name the CPU, 'cpu', instead"
        )
        raise ValueError(
            f"{what} is {str(device)!r}, but CUDA is not available on this machine ({why}): {instead}"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"{what} is {str(device)!r}, but only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


def resolve_devices(
    devices: Sequence[DeviceLike] | None, *, what: str, check: bool = True
) -> tuple[torch.device, ...]:
    """Parses a ``devices`` argument (``None`` means :func:`default_devices`).

    Duplicates are kept: ``["cpu", "cpu"]`` is two replicas on the CPU.
    """
    if devices is None:
        return default_devices()
    if isinstance(devices, (str, int, torch.device)):
        advice = f"write [{devices!r}] for a single device"
        if isinstance(devices, str) and not _is_device(devices):
            # Not one device, so [devices] would be no advice: the examples' command-line
            # spelling of several (--devices cpu,cpu or 'cpu*8'), or a typo.
            spelled = _as_list_spelling(devices)
            advice = (
                "write a list of devices, one per replica, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']"
                if spelled is None
                else f"write {spelled} for the devices that {devices!r} names on the examples' command line"
            )
        if type(devices) is int and 1 < devices <= 8:
            # jax's count of devices reads like one here (pmap(f, devices=2)), but an int names
            # a GPU: say both spellings.
            advice = (
                f"write [{devices!r}] for the single device cuda:{devices}, or a list of one device "
                f"per replica for {devices} replicas, e.g. {['cpu'] * devices!r}"
            )
        raise TypeError(f"{what} must be a sequence of devices, got {devices!r}; {advice}")
    parsed = tuple(parse_device(d, what=f"{what}[{i}]", replica=True) for i, d in enumerate(devices))
    if not parsed:
        raise ValueError(f"{what} must name at least one device, got an empty sequence")
    if check:
        parsed = tuple(check_available(d, what=f"{what}[{i}]", replica=True) for i, d in enumerate(parsed))
    return parsed
