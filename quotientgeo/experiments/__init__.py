"""Reproductions of the paper's experiments, one module per ``quotientgeo reproduce NAME``.

Each module exposes ``add_arguments(parser)`` and ``run(args)``; :data:`COMMANDS` wires them
into :mod:`quotientgeo.cli`.
"""

from __future__ import annotations

from . import diagonal, invariance, modular, rho_sweep, sam, toy, transformers

COMMANDS = {
    "diagonal": (diagonal.add_arguments, diagonal.run),
    "toy": (toy.add_arguments, toy.run),
    "invariance": (invariance.add_arguments, invariance.run),
    "transformers": (transformers.add_arguments, transformers.run),
    "rho-sweep": (rho_sweep.add_arguments, rho_sweep.run),
    "sam": (sam.add_arguments, sam.run),
    "modular": (modular.add_arguments, modular.run),
}
