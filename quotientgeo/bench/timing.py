"""The one timing harness of the benchmarks: interleaved rounds, rotated order, medians.

Every round runs every contender once; the order rotates by one position per round, so no
contender always runs first or after the same neighbour, and the slow spells of a shared
machine spread over all contenders instead of landing on one. An untimed warm-up round comes
first (caches, allocator, lazy initialisation). Each call is bracketed by a device
synchronisation (CUDA), so asynchronous work is counted where it is launched. Ratios are
taken per round (contenders timed seconds apart) and their median reported, which cancels a
machine that is slower in one round than in another.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

from ..progress import progress_bar

K = TypeVar("K", bound=Hashable)  # a contender's name: a string, or a tuple of strings

__all__ = ["interleaved", "median_ratio", "medians"]


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    contenders: Mapping[K, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    device: torch.device | None = None,
    settle: Mapping[K, float] | None = None,
    progress: bool = False,
) -> dict[K, list[float]]:
    """Wall seconds of every contender in each of ``rounds`` timed rounds (after ``warmup``).

    ``settle[name]`` seconds of untimed sleep follow each call of ``name`` (for libraries whose
    worker threads keep spinning after a call and would slow the next contender).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    settle = settle or {}
    names = list(contenders)
    samples: dict[K, list[float]] = {name: [] for name in names}
    for r in progress_bar(range(warmup + rounds), desc="rounds", enabled=progress):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            _sync(device)
            start = time.perf_counter()
            contenders[name]()
            _sync(device)
            if r >= warmup:
                samples[name].append(time.perf_counter() - start)
            time.sleep(settle.get(name, 0.0))
    return samples


def medians(samples: Mapping[K, list[float]]) -> dict[K, float]:
    """Median seconds of every contender."""
    return {name: statistics.median(times) for name, times in samples.items()}


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of the per-round ratio ``numerator / denominator``."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))
