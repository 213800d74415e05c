"""``quotientgeo bench NAME``: benchmarks that report seconds and ratios measured in one run.

Speed targets are checked here, never in unit tests: shared machines are noisy, so every
benchmark times its contenders in interleaved rounds of one process
(:func:`.timing.interleaved`) and reports medians and per-round ratios.

- ``projection``: horizontal projection against a scipy loop (:mod:`.projection`);
- ``generic``: closed forms against the generic autodiff base class (:mod:`.generic`);
- ``sharpness``: seconds per sharpness iteration against forward+backward (:mod:`.sharpness`);
- ``sam``: seconds per training step of AdamW, SAM, ASAM and geodesic SAM (:mod:`.sam`);
- ``memory``: peak memory of every measure against forward+backward (:mod:`.memory`).
"""

from __future__ import annotations

from . import generic, memory, projection, sam, sharpness

COMMANDS = {
    "projection": (projection.add_arguments, projection.run),
    "generic": (generic.add_arguments, generic.run),
    "sharpness": (sharpness.add_arguments, sharpness.run),
    "sam": (sam.add_arguments, sam.run),
    "memory": (memory.add_arguments, memory.run),
}
