"""Copies from the host to a GPU that do not hold the host up.

A CPU tensor's memory is pageable: CUDA stages a copy from it through pinned memory and may
wait for the device's queue to drain first, so every small upload (a record's tensors, a
group's indices) would stop the host until the GPU caught up, and replay's host and device
would take turns instead of working at once. :func:`to_device` stages the tensor in pinned
memory itself (torch's caching host allocator: the pinned block is reused only once its copy
has finished) and queues the copy; the values are the same bits either way.

Imports torch lazily, as the rest of this layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["to_device"]


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``tensor`` on ``device`` (None: where it is); a CPU tensor bound for a GPU is copied without waiting."""
    import torch

    if device is None:
        return tensor
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
