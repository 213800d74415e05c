"""Batched linear algebra used by the manifolds.

Every function works on the trailing two dimensions and broadcasts over leading (batch)
dimensions, like :mod:`torch.linalg`. Nothing here leaves the input's device or dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from torch.autograd import forward_ad

Tensor = torch.Tensor
# public (documented as torch.linalg.LinAlgError) but missing from the module's __all__
LinAlgError = torch.linalg.LinAlgError  # pyright: ignore[reportPrivateImportUsage]


def tensor_sum(terms: Iterable[Tensor]) -> Tensor:
    """``t₁ + t₂ + …`` of at least one tensor, added left to right like the built-in ``sum``
    (whose start value ``0`` makes its result ``int | Tensor`` to a type checker)."""
    return functools.reduce(operator.add, terms)


def mT(a: Tensor) -> Tensor:
    """Matrix transpose of the trailing two dimensions."""
    return a.transpose(-1, -2)


def sym(a: Tensor) -> Tensor:
    """Symmetric part ``(A + Aᵀ) / 2``."""
    return 0.5 * (a + mT(a))


def gram(a: Tensor, eps: float | Tensor = 0.0) -> Tensor:
    """Relaxed Gram matrix ``AᵀA + eps·I`` of an ``(..., n, h)`` factor (``eps`` a number, or a
    tensor broadcastable to ``(..., 1, 1)``)."""
    g = mT(a) @ a
    if isinstance(eps, Tensor) or eps:
        g = g + eps * torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
    return g


class DeferredChecks:
    """Checks of :func:`cholesky` and :func:`expm` recorded on the device, read on the host later.

    While the object is entered (``with checks:``; it may be entered again, and the innermost
    entered one records), each of those calls appends a failure flag (a tensor, nonzero where
    it failed) and its error, and makes no host read. :meth:`failed` is their disjunction, on
    the device; :meth:`raise_failed` reads it once and raises the first failure's error.

    ``factorisations=False`` defers only :func:`expm`'s checks: a matrix that fails them comes
    out ``NaN``, so a failure also shows as a non-finite value downstream, and a caller that
    reads the finiteness of what it computes anyway can read the flag with it (the sharpness
    maximiser); :func:`cholesky` then checks at once, as outside any block.
    """

    def __init__(self, *, factorisations: bool = True):
        self.factorisations = factorisations
        self.pending: list[tuple[Tensor, Callable[[], Exception], bool]] = []
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> DeferredChecks:
        self._tokens.append(_DEFERRED.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _DEFERRED.reset(self._tokens.pop())

    def record(self, flag: Tensor, error: Callable[[], Exception], *, held: bool = False) -> None:
        """A check that failed where ``flag`` is nonzero (with ``held``: where it is zero, a
        flag that is true where the check held), with the error it raises."""
        self.pending.append((flag, error, held))

    def failed(self) -> Tensor | None:
        """Whether a recorded check failed (0-dim boolean on the device; ``None``: none
        recorded). No host read."""
        return _any_failed(self.pending)

    def raise_failed(self) -> None:
        """Read the recorded checks (one host read; more only to name a failure), forget them,
        and raise the error of the first that failed, if any."""
        pending, self.pending = self.pending, []
        failed = _any_failed(pending)
        if failed is None or not bool(failed):
            return
        for flag, error, held in pending:
            if not bool(flag.all()) if held else bool(flag.any()):
                raise error()


def _any_failed(pending: list[tuple[Tensor, Callable[[], Exception], bool]]) -> Tensor | None:
    failed = [flag.reshape(-1) for flag, _, held in pending if not held]
    held = [flag.reshape(-1) for flag, _, held in pending if held]
    if not held:
        return torch.cat(failed).any() if failed else None
    any_failed = ~torch.cat(held).all()
    return any_failed | torch.cat(failed).any() if failed else any_failed


# the checks of the innermost entered :class:`DeferredChecks`
_DEFERRED: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar(
    "deferred_checks", default=None
)


def _not_positive_definite(what: str) -> ValueError:
    return ValueError(
        f"{what} is not positive definite: a factor is rank deficient (or nearly so). "
        "Use full-column-rank factors, or relax the geometry with eps > 0 "
        "(Gram matrices become GᵀG + eps·I)."
    )


def cholesky(spd: Tensor, what: str = "matrix") -> Tensor:
    """Lower Cholesky factor, re-raising a failure as a ``ValueError`` that names ``what``.

    Checked on the host at once (a device synchronisation), except inside
    :func:`deferred_checks` (a :class:`DeferredChecks` that defers factorisations), which
    checks every factorisation of its block in one read."""
    checks = _DEFERRED.get()
    if checks is not None and checks.factorisations:
        L, info = torch.linalg.cholesky_ex(spd)
        checks.record(info, functools.partial(_not_positive_definite, what))
        return L
    try:
        return torch.linalg.cholesky(spd)
    except LinAlgError as err:
        raise _not_positive_definite(what) from err


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """A block whose :func:`cholesky` and :func:`expm` calls do not synchronise: each returns
    at once (:func:`cholesky` ``torch.linalg.cholesky_ex``'s factor), and on leaving the block
    (without an exception) all of them are checked in one host read; the first that failed
    raises its ``ValueError``. What the block computed from a failed call is meaningless: the
    caller must not let it out before the block is left."""
    checks = DeferredChecks()
    with checks:
        yield
    checks.raise_failed()


def cholesky_inverse(L: Tensor) -> Tensor:
    """``(L Lᵀ)⁻¹`` from a lower Cholesky factor: ``torch.cholesky_inverse``, except under a
    ``torch.func`` transform or forward-mode AD (the generic path differentiates through this
    with ``torch.func.jvp``), where its tangent is wrong: there ``cholesky_solve`` of the
    identity, materialised because forward-mode AD of a broadcast one is wrong too."""
    if _differentiated_forward(L):
        eye = identity(L.shape[-1], L).expand_as(L).contiguous()  # a copy of the cached identity
        return torch.cholesky_solve(eye, L)
    return torch.cholesky_inverse(L)


class SylvesterBasis(NamedTuple):
    """Eigen-decomposition of the operator ``X ↦ A X + X A`` with ``A = P Q``.

    ``A = V diag(d) V⁻¹`` with ``P = L Lᵀ``, ``Lᵀ Q L = U diag(d) Uᵀ`` and ``V = L U``, so ``A``
    is diagonalisable with positive eigenvalues even though it is not symmetric.
    """

    V: Tensor
    V_inv: Tensor
    denom: Tensor  # d_i + d_j, shape (..., h, h)


def sylvester_basis(P: Tensor, Q: Tensor, L: Tensor | None = None) -> SylvesterBasis:
    """Precompute :class:`SylvesterBasis` for SPD ``P``, ``Q`` (one Cholesky, one ``eigh``)."""
    if L is None:
        L = cholesky(P, "GᵀG")
    try:
        d, U = torch.linalg.eigh(mT(L) @ Q @ L)
    except LinAlgError as err:
        raise ValueError(
            "the eigendecomposition of Lᵀ Q L failed: the factors are not finite or far too "
            "ill-conditioned (a diverging optimiser?)"
        ) from err
    V = L @ U
    # V⁻¹ = Uᵀ L⁻¹ = (L⁻ᵀ U)ᵀ
    V_inv = mT(torch.linalg.solve_triangular(mT(L), U, upper=True))
    return SylvesterBasis(V, V_inv, d.unsqueeze(-1) + d.unsqueeze(-2))


def solve_sylvester(basis: SylvesterBasis, B: Tensor) -> Tensor:
    """Solve ``A X + X A = B`` for ``X`` with ``A = V diag(d) V⁻¹``.

    In the eigenbasis the operator is diagonal: ``Y = (V⁻¹ B V) / (d_i + d_j)``, ``X = V Y V⁻¹``.
    """
    V, V_inv, denom = basis
    return V @ ((V_inv @ B @ V) / denom) @ V_inv


def conjugate_gradient(
    apply_A: Callable[[Tensor], Tensor],
    b: Tensor,
    *,
    event_dims: int,
    precondition: Callable[[Tensor], Tensor] | None = None,
    rtol: float | None = None,
    max_iter: int = 1000,
) -> Tensor:
    """Batched (preconditioned) conjugate gradients for SPD ``A``: solve ``A x = b``.

    The trailing ``event_dims`` dimensions of ``b`` form one vector; leading dimensions are
    independent systems, each with its own step sizes. ``precondition(r)`` applies an SPD
    approximation of ``A⁻¹``. Iterates until every system has ``||r|| ≤ rtol·||b||`` (``rtol``
    defaults to ``1e-13`` in float64 and ``1e-6`` otherwise), checking on the host once per
    iteration; warns if ``max_iter`` iterations do not get there.
    """
    if rtol is None:
        rtol = 1e-13 if b.dtype == torch.float64 else 1e-6
    if precondition is None:
        precondition = lambda r: r  # noqa: E731
    dims = tuple(range(-event_dims, 0))

    def dot(u: Tensor, v: Tensor) -> Tensor:
        return (u * v).sum(dim=dims, keepdim=True)

    tiny = torch.finfo(b.dtype).tiny
    x = torch.zeros_like(b)
    r = b.clone()
    threshold = (rtol**2) * dot(b, b)
    z = precondition(r)
    p = z
    rz = dot(r, z)
    for _ in range(max_iter):
        if bool((dot(r, r) <= threshold).all()):
            return x
        Ap = apply_A(p)
        alpha = rz / dot(p, Ap).clamp_min(tiny)
        x = x + alpha * p
        r = r - alpha * Ap
        z = precondition(r)
        rz_new = dot(r, z)
        p = z + (rz_new / rz.clamp_min(tiny)) * p
        rz = rz_new
    if not bool((dot(r, r) <= threshold).all()):
        worst = (dot(r, r) / dot(b, b).clamp_min(tiny)).max().sqrt().item()
        warnings.warn(
            f"conjugate gradients stopped after {max_iter} iterations at relative residual "
            f"{worst:.1e} > {rtol:.0e}: the system is ill-conditioned (nearly rank-deficient "
            "factors?); results are approximate",
            RuntimeWarning,
            stacklevel=3,
        )
    return x


_TAYLOR_THETA = 0.5  # ‖A‖₁ after scaling: degree-12 truncation error ≤ θ¹³/13! ≈ 2e-14
#: The squarings :func:`expm` allows itself where it reads nothing on the host (inside
#: :class:`DeferredChecks`): 1-norms up to ``θ·2⁶ = 32``.
DEFERRED_SQUARINGS = 6


def expm_squarings(norm: float) -> int:
    """The squarings :func:`expm` takes for a matrix of 1-norm at most ``norm``:
    ``⌈log₂(norm / θ)⌉₊`` (``θ = 0.5``). A caller that bounds the norms of its matrices passes
    this as ``squarings``: its masked squarings then number no more than its matrices need."""
    if not math.isfinite(norm):
        raise ValueError(f"expm_squarings needs a finite norm, got {norm}")
    return max(0, math.ceil(math.log2(norm / _TAYLOR_THETA))) if norm > 0 else 0


def _expm_too_long(bound: int) -> ValueError:
    return ValueError(
        f"expm: a matrix has a 1-norm above {_TAYLOR_THETA * 2.0**bound:g} (or non-finite "
        f"entries), more than the {bound} squarings allowed inside deferred checks: a "
        "geodesic step this long (many radians) is no small perturbation; shorten it, or call "
        "outside deferred_checks(), where the squarings are counted on the host"
    )


def expm(A: Tensor, squarings: int | None = None) -> Tensor:
    """Batched matrix exponential: degree-12 Taylor polynomial, scaling and squaring, each
    matrix with its own number of squarings.

    ``expm(Aᵢ) = p(Aᵢ / 2^sᵢ)^(2^sᵢ)`` with ``p`` the Taylor polynomial of degree 12, evaluated
    by Paterson–Stockmeyer in six matrix products, and ``sᵢ = ⌈log₂(‖Aᵢ‖₁ / θ)⌉₊``
    (``θ = 0.5``) for every matrix of the batch, computed on the device, so the relative
    truncation error of ``p(Aᵢ / 2^sᵢ)`` is at most ``θ¹³/13! ≈ 2e-14`` (a relative backward
    error of ``Aᵢ`` of that order: the forward error grows with ``‖Aᵢ‖₁``). ``S`` masked
    squarings (``torch.where``) square each matrix ``sᵢ`` times, with the bound ``S``:

    - ``squarings``, if given: then no host read chooses ``sᵢ``; a matrix with ``sᵢ > S``
      (or non-finite entries) comes out ``NaN``, and its check is recorded inside
      :class:`DeferredChecks` (:func:`deferred_checks`) or made at once outside (one host
      read; the batch is computed again with ``S = max sᵢ``);
    - else, inside :class:`DeferredChecks`, :data:`DEFERRED_SQUARINGS` (as if given);
    - else ``max sᵢ`` over the batch, read once on the host (non-finite entries raise).

    Differentiable through matrix products: for many small matrices of modest norm this is
    several times cheaper than :func:`torch.linalg.matrix_exp`, most of all in the backward
    pass (which that function takes as the exponential of a matrix of twice the size). In
    reverse mode the polynomial has a backward pass of its own, its sums of products
    accumulated in place (once: no second derivative); ``torch.func`` transforms and
    forward-mode AD differentiate through its products.
    """
    if A.shape[-1] == 0:
        return A.clone()
    checks = _DEFERRED.get()
    if squarings is None and checks is None:
        norm = float(one_norms(A).max()) if A.numel() else 0.0
        if not math.isfinite(norm):
            raise ValueError("expm: the matrix has non-finite entries")
        return _expm(A, expm_squarings(norm))[0]
    bound = DEFERRED_SQUARINGS if squarings is None else squarings
    E, held = _expm(A, bound)
    if checks is not None:
        checks.record(held, functools.partial(_expm_too_long, bound), held=True)
        return E
    if not bool(held.all()):  # outside any block: checked at once, and computed again
        return expm(A)
    return E


def identity(n: int, like: Tensor) -> Tensor:
    """The ``n × n`` identity in ``like``'s dtype and device, made once per size, dtype and
    device (no operator on later calls; its first ``k`` rows are ``[I, 0]``, a view): read it,
    never write into it."""
    return _identity(n, like.dtype, like.device)


@functools.cache
def _identity(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    with _plain():
        return torch.eye(n, dtype=dtype, device=device)


def constant(values: float | tuple, like: Tensor) -> Tensor:
    """``torch.tensor(values)`` in ``like``'s dtype and device, made once per values, dtype and
    device (a copy to a GPU would make the host wait), outside inference mode so that autograd
    may save it: read it, never write into it. ``values``: numbers or nested tuples of them."""
    return _constant(values, like.dtype, like.device)


@functools.cache
def _constant(values: float | tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    with _plain():
        return torch.tensor(values, dtype=dtype, device=device)


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    """Tensors made here are plain, whatever the caller runs under: outside inference mode (so
    that autograd may save them) and not wrapped by a ``torch.func`` transform (``jvp`` and
    ``grad`` wrap new tensors: a cached one would outlive its transform)."""
    with torch.inference_mode(False), torch._C._DisableFuncTorch():  # pyright: ignore[reportAttributeAccessIssue]
        yield


#: ``c[j, i] = 1 / (4j + i)!`` (``3 × 5``, ``i ≤ 3``, and ``c[2, 4] = 1 / 12!``): the Taylor
#: coefficients of :func:`_expm`'s Paterson–Stockmeyer groups, the last one with the term of
#: degree 12.
_TAYLOR_COEFFICIENTS = tuple(
    tuple(1.0 / math.factorial(4 * j + i) if i < 4 or j == 2 else 0.0 for i in range(5))
    for j in range(3)
)


def one_norms(A: Tensor) -> Tensor:
    """``‖Aᵢ‖₁``, the largest column sum of magnitudes of each matrix (detached; one rounding
    for :func:`expm`'s count of squarings on the host and its checks on the device, which
    must agree at the boundary)."""
    return torch.linalg.vector_norm(A.detach(), 1, -2).amax(-1)


def transformed(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` is traced by a ``torch.func`` transform (``vmap``, ``jvp``,
    ``jacrev``, ...), whose batching has no rule for writing into a tensor made inside it or
    for a custom autograd function without one."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # pyright: ignore[reportAttributeAccessIssue]
    return any(wrapped(t) for t in tensors)


def _differentiated_forward(t: Tensor) -> bool:
    """Whether ``t`` is traced by a ``torch.func`` transform (:func:`transformed`) or carries a
    forward-mode AD tangent: where an operator without a correct forward rule may not run."""
    return transformed(t) or forward_ad.unpack_dual(t).tangent is not None


def _taylor(B: Tensor) -> Tensor:
    """``p(B)``, the Taylor polynomial of degree 12 of the exponential, by Paterson–Stockmeyer:
    ``q_j = c₄ⱼ I + c₄ⱼ₊₁ B + c₄ⱼ₊₂ B² + c₄ⱼ₊₃ B³`` (``j = 0, 1, 2``; ``q₂`` also
    ``+ B⁴/12!``) in one contraction of the stacked powers, ``p = q₀ + B⁴ (q₁ + B⁴ q₂)``.
    Differentiable by any transform (autograd through its products)."""
    eye = identity(B.shape[-1], B).expand_as(B)
    B2 = B @ B
    B3 = B2 @ B
    B4 = B2 @ B2
    powers = torch.stack([eye, B, B2, B3, B4])
    q = torch.tensordot(constant(_TAYLOR_COEFFICIENTS, B), powers, 1)
    q0, q1, E = q.unbind(0)  # its backward is one stack, where indexing's is one op each
    return matmul_add(q0, B4, matmul_add(q1, B4, E))


class _TaylorPolynomial(torch.autograd.Function):
    """:func:`_taylor` with the powers written into one tensor as they are formed (no stack of
    copies), and a backward pass whose sums of products are accumulated by ``baddbmm_`` into
    the gradients of the powers (autograd's adds each product to a separate tensor). With
    ``p = q₀ + B⁴ r``, ``r = q₁ + B⁴ q₂`` and ``Ḡ`` the gradient of ``p``:
    ``r̄ = B⁴ᵀ Ḡ``, ``q̄₂ = B⁴ᵀ r̄``, the powers' gradients ``P̄ᵢ = Σⱼ cⱼᵢ q̄ⱼ``
    (``q̄ = (Ḡ, r̄, q̄₂)``) plus ``B̄⁴ += Ḡ rᵀ + r̄ q₂ᵀ``, then ``B̄² += B̄⁴ B²ᵀ + B²ᵀ B̄⁴ + B̄³ Bᵀ``
    and ``B̄ += B²ᵀ B̄³ + B̄² Bᵀ + Bᵀ B̄²``. Not differentiable twice."""

    @staticmethod
    def forward(ctx, B: Tensor) -> Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        n = B.shape[-1]
        powers = B.new_empty((4, *B.shape))  # B, B², B³, B⁴
        powers[0].copy_(B)
        flat = powers.view(4, -1, n, n)
        torch.bmm(flat[0], flat[0], out=flat[1])
        torch.bmm(flat[1], flat[0], out=flat[2])
        torch.bmm(flat[1], flat[1], out=flat[3])
        c = constant(_TAYLOR_COEFFICIENTS, B)
        q = torch.tensordot(c[:, 1:], powers, 1)
        q.diagonal(dim1=-2, dim2=-1).add_(c[:, :1].view(3, *[1] * (B.dim() - 1)))  # + c₄ⱼ I
        q0, q1, q2 = q.unbind(0)
        r = matmul_add(q1, powers[3], q2)
        ctx.save_for_backward(powers, q2, r)
        return matmul_add(q0, powers[3], r)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        powers, q2, r = ctx.saved_tensors
        n = grad.shape[-1]
        B, B2, B4 = (powers[i].view(-1, n, n) for i in (0, 1, 3))
        q2, r = q2.reshape(-1, n, n), r.reshape(-1, n, n)
        q_bars = grad.new_empty((3, *B.shape))  # Ḡ, r̄, q̄₂
        G, r_bar, q2_bar = q_bars.unbind(0)
        G.copy_(grad.reshape(-1, n, n))
        torch.bmm(B4.mT, G, out=r_bar)
        torch.bmm(B4.mT, r_bar, out=q2_bar)
        coefficients = constant(_TAYLOR_COEFFICIENTS, grad)[:, 1:].mT  # (4, 3): i = 1..4
        B_bar, B2_bar, B3_bar, B4_bar = torch.tensordot(coefficients, q_bars, 1).unbind(0)
        B4_bar.baddbmm_(G, r.mT).baddbmm_(r_bar, q2.mT)
        B2_bar.baddbmm_(B4_bar, B2.mT).baddbmm_(B2.mT, B4_bar).baddbmm_(B3_bar, B.mT)
        B_bar.baddbmm_(B2.mT, B3_bar).baddbmm_(B2_bar, B.mT).baddbmm_(B.mT, B2_bar)
        return B_bar.view(powers.shape[1:])


def _expm(A: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """:func:`expm` with ``S = bound`` squarings, and where a matrix needs at most ``S`` (and
    is finite; the others come out ``NaN``)."""
    norm = one_norms(A)[..., None, None]
    held = norm <= _TAYLOR_THETA * 2.0**bound  # NaN fails
    nan = constant(math.nan, A)
    if bound == 0:  # no scaling: A itself, or NaN where it fails
        B = torch.where(held, A, nan)
    else:
        # sᵢ, and NaN where it fails: the matrix's scaling, so its result, is then NaN
        s = torch.where(held, (norm / _TAYLOR_THETA).log2().ceil().clamp(0, bound), nan)
        B = A * torch.exp2(-s)
    # the custom backward pass has no forward-mode or torch.func rule: those trace the products
    if _differentiated_forward(B):
        E = _taylor(B)
    else:
        E = _TaylorPolynomial.apply(B)
    if bound:
        eye = identity(A.shape[-1], A).expand_as(A)
        square = s > torch.arange(bound, dtype=s.dtype, device=s.device)  # (..., 1, S)
        # E ← E · (E or I): the same values as where(square, E E, E) (a product with I is
        # exact), and a backward pass with one where and no zeros for the identity's branch
        for j in range(bound):
            E = E @ torch.where(square[..., j : j + 1], E, eye)
    return E, held.reshape(held.shape[:-2])


def matmul_add(C: Tensor, A: Tensor, B: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``β C + α A B`` for matrices of the same leading dimensions (``(..., n, k)`` by
    ``(..., k, m)``): one ``torch.baddbmm``, of views where the leading dimensions flatten
    without a copy (a contiguous batch, or slices and transposes of one). Its backward pass
    scales by ``β`` and ``α`` only where they are not 1."""
    b = math.prod(C.shape[:-2])
    out = torch.baddbmm(
        C.reshape(b, *C.shape[-2:]),
        A.reshape(b, *A.shape[-2:]),
        B.reshape(b, *B.shape[-2:]),
        beta=beta,
        alpha=alpha,
    )
    return out.view(C.shape)


def haar_orthogonal(
    *shape: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Haar-random orthogonal matrices of shape ``(..., k, k)``: ``Q`` of the QR factorization
    ``N = QR`` of a standard Gaussian ``N``, its columns' signs fixed so that ``diag(R) > 0``
    (without the fix ``Q`` is not Haar distributed)."""
    N = torch.randn(shape, generator=generator, dtype=dtype, device=device)
    Q, R = torch.linalg.qr(N)
    return Q * torch.sgn(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)


def log_uniform(
    *shape: int,
    condition: float,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Positive numbers ``exp(t)``, ``t`` uniform in ``[-½ log c, ½ log c]`` (``c = condition``):
    log-uniform in ``[c^{-1/2}, c^{1/2}]``, so any two differ by a factor of at most ``c``."""
    half = 0.5 * math.log(condition)
    t = torch.rand(shape, generator=generator, dtype=dtype, device=device)
    return torch.exp(half * (2 * t - 1))


def conditioned_matrix(
    *shape: int,
    condition: float,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Random square matrices ``A = U diag(σ) Vᵀ`` of shape ``(..., k, k)`` with condition number
    at most ``condition``: ``U``, ``V`` Haar-random orthogonal (:func:`haar_orthogonal`), ``σ``
    log-uniform in ``[c^{-1/2}, c^{1/2}]`` (:func:`log_uniform`). Both components of ``GL(k)``
    (``det A`` of either sign) occur."""
    k = shape[-1]
    kw = {"generator": generator, "dtype": dtype, "device": device}
    U = haar_orthogonal(*shape, **kw)
    V = haar_orthogonal(*shape, **kw)
    sigma = log_uniform(*shape[:-2], 1, k, condition=condition, **kw)
    return (U * sigma) @ mT(V)
