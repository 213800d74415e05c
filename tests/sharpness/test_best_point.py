"""The best point of Auto-PGD shares the iterates' tensors while it is one of them.

The objective keeps the best iterate in buffers of its own only while it is older than both the
current iterate ``ξ_k`` and the previous one ``ξ_{k-1}``; otherwise it *is* one of them. These
tests follow every run with an independent bookkeeping of Auto-PGD's iterates (copies taken
after each evaluation) and check, at every step, that the previous iterate, the current one and
the best one hold exactly what Auto-PGD says, that the result is the best evaluated point,
that the best point has a buffer of its own exactly while it is older than both iterates (never
during a restart's backward pass), and that every state and transition of the objective's table
occurs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from quotientgeo import adaptive_sharpness, geodesic_sharpness
from quotientgeo.sharpness import objective as objective_module

sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))  # the families' tiny models
from tiny_families import regression

Objective = objective_module.Objective


class _Book:
    """Auto-PGD's iterates as copies: ``(id, tensors)`` of ξ_k, ξ_{k-1} and the best one."""

    def __init__(self):
        self.cur = self.prev = self.best = None
        self.best_loss = None
        self.restarting = False
        self.count = 0
        self.states: set[str] = set()
        self.restarts_from_earlier = 0

    def snapshot(self, obj):
        out = obj.space.empty()
        obj._copy_current_(out)
        self.count += 1
        return (self.count, out)


def _equal(a, b, what):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


def _follow(monkeypatch) -> _Book:
    book = _Book()
    names = ("begin", "value", "keep_best", "restart", "gradient", "gram", "advance")
    real = {n: getattr(Objective, n) for n in names}
    real["best_iterate"] = Objective.best_iterate

    def begin(self, *args, **kwargs):
        real["begin"](self, *args, **kwargs)
        book.cur = book.snapshot(self)  # x + ξ_0 read back is rounded; ξ_{-1} = ξ_0 is not
        book.prev = (book.cur[0], {n: t.clone() for n, t in self.previous.items()})
        book.best = book.best_loss = None

    def value(self, k, grad):
        loss = real["value"](self, k, grad)
        book.cur = book.snapshot(self)
        if book.best_loss is None or float(loss) > book.best_loss:
            book.best, book.best_loss = book.cur, float(loss)
        return loss

    def keep_best(self, keep):
        assert isinstance(keep, bool)  # read on the host, after the forward pass
        real["keep_best"](self, keep)

    def restart(self, best_is_current, k):
        if not best_is_current:
            book.restarts_from_earlier += 1
        book.restarting = not best_is_current
        real["restart"](self, best_is_current, k)
        book.restarting = False
        # the same point; as the weights hold it, ``x + ξ`` read back is rounded
        book.prev, book.cur = book.best, (book.best[0], book.snapshot(self)[1])

    def gradient(self):
        if book.restarting:  # ξ_{k-1} holds the best point: no buffer of its own
            assert self.best is None and self._best == "previous", self._best
        real["gradient"](self)

    def gram(self):
        _equal(self.previous, book.prev[1], "ξ_{k-1}")
        now = book.snapshot(self)[1]
        _equal(now, book.cur[1], "ξ_k")
        book.states.add(self._best)
        # a buffer of its own exactly while the best point is older than both iterates
        best = book.best
        own = best is not None and best[0] not in (book.cur[0], book.prev[0])
        assert (self.best is not None) == own, (self._best, own)
        return real["gram"](self)

    def advance(self, c):
        real["advance"](self, c)
        book.prev = book.cur

    def best_iterate(self):
        out = real["best_iterate"](self)
        _equal(out, book.best[1], "best")
        return out

    wrappers = [begin, value, keep_best, restart, gradient, gram, advance, best_iterate]
    for fn in wrappers:
        monkeypatch.setattr(Objective, fn.__name__, fn)
    return book


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_iterates_and_the_best_point_are_what_auto_pgd_says(name, monkeypatch):
    model, loss_fn = regression(name)
    book = _follow(monkeypatch)
    adaptive_kw = dict(n_iter=30, restarts=2, seed=0, progress=False)
    kw = dict(adaptive_kw, return_perturbation=True)
    results = []
    for rho in (0.3,):  # 30 steps overshoot, fail to improve twice in a row, restart
        results += [
            geodesic_sharpness(model, loss_fn, [None], rho=rho, metric="mix", **kw),
            geodesic_sharpness(
                model, loss_fn, [None], rho=rho, metric="inv", perturbation="exact", **kw
            ),
            adaptive_sharpness(model, loss_fn, [None], rho=rho, **adaptive_kw),
        ]
    assert book.restarts_from_earlier > 0, "no restart from an earlier best point: vacuous"
    assert set(objective_module.Best) <= book.states, book.states
    for result in results:  # the result is the best evaluated value, whatever held the point
        assert result.worst_losses[0] == max(max(t) for t in result.trace[0])
