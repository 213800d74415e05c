"""Developer benchmarks of quotientgeo against baselines, added to ``quotientgeo bench``.

- ``projection``: horizontal projection against a scipy loop (:mod:`.projection`);
- ``generic``: closed forms against the generic autodiff base class (:mod:`.generic`);
- ``sam``: seconds per training step of AdamW, SAM, ASAM and geodesic SAM (:mod:`.sam`).

They time the library's implementation choices, which only its developers change, so they live
here rather than in the installed library; ``bench memory`` and ``bench sharpness``, which a
user runs to size their own model and GPU, stay in :mod:`quotientgeo.bench` (whose harness,
:mod:`quotientgeo.bench.timing`, these reuse). The entry point ``bench`` of the group
``quotientgeo.commands`` (``studies/pyproject.toml``) adds :data:`COMMANDS` to the library's
``bench`` group.
"""

from __future__ import annotations

from . import generic, projection, sam

COMMANDS = {
    "projection": (projection.add_arguments, projection.run),
    "generic": (generic.add_arguments, generic.run),
    "sam": (sam.add_arguments, sam.run),
}
