"""Invariant curvature: the Riemannian Hessian of a model's loss on the quotient of its
parameter symmetries, its trace, its extreme eigenvalues and its spectral density.

- :mod:`.operator`: :class:`RiemannianHessian`, the operator (matrix-free, whitened, symmetric);
- :mod:`.loss`: the batch-averaged loss and its Hessian-vector products by double backward;
- :mod:`.parts`: the geometry of each part of the coordinates (projection, connection, metric);
- :mod:`.groups`: the coordinates grouped by layer and kind of block (``per_block=True``).
"""

from .groups import KINDS, Group
from .operator import BlockOperator, RiemannianHessian

__all__ = ["KINDS", "BlockOperator", "Group", "RiemannianHessian"]
