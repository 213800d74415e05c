"""Freed host memory handed back to the system before the maximiser's step.

glibc keeps freed blocks smaller than its mmap threshold (which rises to 32 MB as large blocks
are freed) in its heap, resident. The backward pass frees the activations this way, and the
step that follows allocates float32 transients of other sizes (a chunk of symmetry blocks,
pieces of the parameters) that the freed blocks do not all fit, so the process would hold both.
``malloc_trim(0)`` returns the heap's free pages first. Under another C library or system it
is not there, and nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

__all__ = ["release_free_memory"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the process's C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols, its C library's
    except (OSError, AttributeError):
        return None


def release_free_memory(device: torch.device) -> bool:
    """Return the C heap's free pages to the system after work on ``device``; only the CPU's
    tensors live there. Returns whether anything was asked of the C library."""
    trim = _malloc_trim() if device.type == "cpu" else None
    if trim is None:
        return False
    trim(0)
    return True
