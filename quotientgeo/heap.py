"""Freed host memory handed back to the system before the maximiser's step.

glibc keeps freed blocks smaller than its mmap threshold (which rises to 32 MB as large blocks
are freed) in its heap, resident. The backward pass frees the activations this way, and the
step that follows allocates float32 transients of other sizes (a chunk of symmetry blocks,
pieces of the parameters) that the freed blocks do not all fit, so the process would hold both.
``malloc_trim(0)`` returns the heap's free pages first. The pages come back as page faults when
the heap grows again, which costs a small model more time than the memory is worth (measured:
11 % more time per iteration on ``quotientgeo bench sharpness``'s model), so only parameters
of at least :data:`MIN_BYTES` trim. Under another C library or system nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

__all__ = ["MIN_BYTES", "release_free_memory"]

#: The parameters' bytes (in their dtype, on this process) from which the heap is trimmed.
MIN_BYTES = 2**30


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the process's C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols, its C library's
    except (OSError, AttributeError):
        return None


def release_free_memory(device: torch.device, parameter_bytes: int) -> bool:
    """Return the C heap's free pages to the system after work on ``device`` (the CPU's tensors
    live there) for parameters of ``parameter_bytes`` (at least :data:`MIN_BYTES`). Returns
    whether anything was asked of the C library."""
    trim = _malloc_trim() if device.type == "cpu" and parameter_bytes >= MIN_BYTES else None
    if trim is None:
        return False
    trim(0)
    return True
