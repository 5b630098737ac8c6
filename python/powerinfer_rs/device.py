"""Choosing the device: the names `Engine.load(device=...)` and `--device` accept, whether CUDA
is usable on this machine (and why not), and the one-line notice the runtime prints when it
falls back to the CPU or leaves part of a model there.

It decides nothing about what goes to the GPU (`gpu` does) and imports no placement code.
"""

from __future__ import annotations

import sys

from . import _core

# what `Engine.load(device=...)` and `--device` accept
DEVICES = ("auto", "cpu", "cuda", "emulated")


def notice(msg: str) -> None:
    print(f"powerinfer-rs: {msg}", file=sys.stderr)


def cuda_available() -> tuple[bool, str]:
    """(usable, why not)."""
    try:
        devices = _core.cuda_devices()
    except _core.CudaUnavailableError as e:
        return False, str(e)
    return bool(devices), "no CUDA device"
