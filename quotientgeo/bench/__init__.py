"""``quotientgeo bench NAME``: benchmarks that report seconds, ratios and bytes measured in one run.

Speed targets are checked here, never in unit tests: shared machines are noisy, so every
benchmark times its contenders in interleaved rounds of one process
(:func:`.timing.interleaved`) and reports medians and per-round ratios.

The library keeps the three benchmarks that a user of the installed package needs to size and
time a run on their own machine, model size and GPU:

- ``memory``: peak memory of every measure against forward+backward (:mod:`.memory`);
- ``sharpness``: seconds per sharpness iteration against forward+backward (:mod:`.sharpness`);
- ``cost``: operators, host reads and bytes per iteration beyond forward+backward, counted at
  the dispatcher (:mod:`.cost`);

with their helpers, :mod:`.timing` (the interleaved harness) and :mod:`.options` (the model
options). The developer benchmarks, which time the library against baselines (``projection``:
the horizontal projection against a scipy loop; ``generic``: closed forms against the generic
autodiff base class; ``sam``: seconds per training step of AdamW, SAM, ASAM and geodesic SAM),
live in the studies distribution of the repository (``pip install ./studies`` from a clone,
module ``quotientgeo_studies.bench``). It adds them to this same ``bench`` group through the
``quotientgeo.commands`` entry points (:mod:`quotientgeo.cli`) and reuses :mod:`.timing` and
:mod:`.options` from here, so ``quotientgeo bench sam`` works as before from a clone.
"""

from __future__ import annotations

from . import cost, memory, sharpness

COMMANDS = {
    "sharpness": (sharpness.add_arguments, sharpness.run),
    "memory": (memory.add_arguments, memory.run),
    "cost": (cost.add_arguments, cost.run),
}
