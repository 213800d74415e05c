"""``quotientgeo bench NAME``: benchmarks that report seconds and ratios measured in one run.

Speed targets are checked here, never in unit tests: shared machines are noisy, so every
benchmark times its contenders in interleaved rounds of one process
(:func:`.timing.interleaved`) and reports medians and per-round ratios.

- ``projection``: horizontal projection against a scipy loop (:mod:`.projection`);
- ``generic``: closed forms against the generic autodiff base class (:mod:`.generic`);
- ``sharpness``: seconds per sharpness iteration against forward+backward (:mod:`.sharpness`).
"""

from __future__ import annotations

from . import generic, projection, sharpness

COMMANDS = {
    "projection": (projection.add_arguments, projection.run),
    "generic": (generic.add_arguments, generic.run),
    "sharpness": (sharpness.add_arguments, sharpness.run),
}
