"""The studies of quotientgeo: the paper's experiments, one module per ``quotientgeo reproduce
NAME``, and the developer benchmarks (:mod:`.bench`).

A distribution of its own beside the library, installed from a clone of the repository with
``pip install ./studies``; the library's wheel holds none of it. Each study module is a
pipeline (:mod:`.pipeline`: a config and three functions) and exposes ``add_arguments(parser)``
and ``run(args)``; :data:`COMMANDS` wires them into :mod:`quotientgeo.cli` through the entry
point ``reproduce`` of the group ``quotientgeo.commands`` (``studies/pyproject.toml``).
"""

from __future__ import annotations

from . import diagonal, invariance, lora, modular, rho_sweep, sam, toy, transformers

HELP = "reproduce the paper's experiments"

COMMANDS = {
    "diagonal": (diagonal.add_arguments, diagonal.run),
    "toy": (toy.add_arguments, toy.run),
    "invariance": (invariance.add_arguments, invariance.run),
    "transformers": (transformers.add_arguments, transformers.run),
    "rho-sweep": (rho_sweep.add_arguments, rho_sweep.run),
    "sam": (sam.add_arguments, sam.run),
    "modular": (modular.add_arguments, modular.run),
    "lora": (lora.add_arguments, lora.run),
}
