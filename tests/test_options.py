"""The string enums of :mod:`quotientgeo.options` behave as Python 3.11's ``enum.StrEnum`` on
every supported Python: ``Option`` is ``(str, Enum)`` with ``str``'s ``__str__`` and
``__format__``, since Python 3.10 has no ``StrEnum``."""

from __future__ import annotations

import enum
import json
import pickle
import sys

import pytest

from quotientgeo.options import Distributed, Norm, Option, Perturbation, option

MEMBERS = [m for kind in (Perturbation, Norm, Distributed) for m in kind]


@pytest.mark.parametrize("member", MEMBERS, ids=str)
def test_a_member_is_its_value(member):
    kind, value = type(member), member.value
    assert isinstance(member, str) and isinstance(member, Option)
    assert member == value and hash(member) == hash(value)
    assert str(member) == value and f"{member}" == value and "%s" % member == value  # noqa: UP031
    assert f"{member:>20}" == f"{value:>20}" and format(member, "") == value
    assert repr(member) == f"<{kind.__name__}.{member.name}: {value!r}>"
    assert json.dumps({"k": member}) == json.dumps({"k": value})
    assert kind(value) is member and option(kind, "x", value) is member
    assert pickle.loads(pickle.dumps(member)) is member


@pytest.mark.skipif(sys.version_info < (3, 11), reason="enum.StrEnum is Python 3.11+")
@pytest.mark.parametrize("kind", [Perturbation, Norm, Distributed])
def test_the_enums_agree_with_strenum(kind):
    """An ``enum.StrEnum`` with the same members, the independent reference."""
    reference = enum.StrEnum(kind.__name__, {m.name: m.value for m in kind})  # type: ignore[misc]
    for ours, theirs in zip(kind, reference, strict=True):
        for show in (str, repr, lambda m: f"{m}", lambda m: f"{m:^16}", json.dumps):
            assert show(ours) == show(theirs)
        assert ours == theirs and hash(ours) == hash(theirs)


def test_an_unknown_value_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"norm must be one of \('riemannian', 'adaptive'\)"):
        option(Norm, "norm", "euclidean")
