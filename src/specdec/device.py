"""Torch devices checked against what this torch build and machine offer, before any model is loaded.

    check_device("cuda", key="--device")   # ConfigError on a CPU-only torch: names the devices there are

A device is a torch device string (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ``xpu``): its type must be one this
machine has (``cpu`` always; ``cuda`` where ``torch.cuda.is_available()``, its index below the device count; others
where ``torch.<type>.is_available()``). ``meta`` is refused: it holds no weights to generate with.
"""

from __future__ import annotations

from specdec.config import ConfigError

ALWAYS = ("cpu",)
ACCELERATORS = ("cuda", "mps", "xpu", "hpu", "mtia")  # device types probed through torch.<type>.is_available()


def available_devices() -> list[str]:
    """The device types this torch can run on here (``cpu`` first)."""
    import torch

    out = list(ALWAYS)
    for kind in ACCELERATORS:
        if kind == "mps":
            ok = bool(getattr(getattr(torch, "backends", None), "mps", None) and torch.backends.mps.is_available())
        else:
            mod = getattr(torch, kind, None)
            ok = bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())
        if ok:
            out.append(kind)
    return out


def _count(kind: str) -> int:
    import torch

    mod = getattr(torch, kind, None)
    return int(mod.device_count()) if mod is not None and hasattr(mod, "device_count") else 1


def check_device(value: object, *, key: str = "device") -> str:
    """``value`` as a device string this machine runs, else ``ConfigError`` naming ``key`` (a flag such as ``--device``
    or a keyword), the value and the devices there are."""
    import torch

    have = available_devices()
    offer = f"this torch ({torch.__version__}) offers: {', '.join(have)}"
    given = f"{key} {value}" if key.startswith("-") else f"{key}={value!r}"  # a flag or a keyword, as written
    if not isinstance(value, str):
        raise ConfigError(f"{given} must be a device name such as 'cpu' or 'cuda'; {offer}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{given} is not a torch device; {offer}") from None
    if dev.type not in have:
        raise ConfigError(f"{given}: no {dev.type} device on this machine; {offer}")
    if dev.index is not None and dev.type != "cpu" and dev.index >= _count(dev.type):
        raise ConfigError(f"{given}: {dev.type} has {_count(dev.type)} device(s) here (indices from 0)")
    return value
