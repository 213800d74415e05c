"""Invariant curvature: the Riemannian Hessian of a model's loss on the quotient of its
parameter symmetries, its trace, its extreme eigenvalues and its spectral density.

- :mod:`.operator`: :class:`RiemannianHessian`, the operator (matrix-free, whitened, symmetric);
- :mod:`.loss`: the batch-averaged loss and its Hessian-vector products by double backward;
- :mod:`.parts`: the geometry of each part of the coordinates (projection, connection, metric);
- :mod:`.groups`: the coordinates grouped by layer and kind of block (``per_block=True``);
- :mod:`.trace`, :mod:`.eigenvalues`, :mod:`.density`: the three functions;
- :mod:`.lanczos`: the extreme eigenvalue by the Lanczos recurrence with two vectors;
- :mod:`.result`: what they return.
"""

from .density import hessian_density, lanczos_quadrature
from .eigenvalues import hessian_eigenvalues
from .groups import KINDS, Group
from .lanczos import LanczosEigenvalue, lanczos_extreme
from .operator import BlockOperator, RiemannianHessian
from .result import (
    BlockEigenvalues,
    BlockSpectrum,
    BlockTrace,
    EigenvalueResult,
    Spectrum,
    SpectrumResult,
    TraceResult,
)
from .trace import hessian_trace

__all__ = [
    "KINDS",
    "BlockEigenvalues",
    "BlockOperator",
    "BlockSpectrum",
    "BlockTrace",
    "EigenvalueResult",
    "Group",
    "LanczosEigenvalue",
    "RiemannianHessian",
    "Spectrum",
    "SpectrumResult",
    "TraceResult",
    "hessian_density",
    "hessian_eigenvalues",
    "hessian_trace",
    "lanczos_extreme",
    "lanczos_quadrature",
]
