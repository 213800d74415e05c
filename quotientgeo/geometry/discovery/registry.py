"""The readers :func:`find_symmetries` tries, in order, and how to register more."""

from __future__ import annotations

from . import families, readers
from .context import Reader

__all__ = ["Reader", "ReaderHandle", "register_reader", "registered_readers"]


class _Entry:
    """One registration (a reader registered twice is two entries)."""

    def __init__(self, reader: Reader):
        self.reader = reader


_READERS: list[_Entry] = [
    _Entry(r)
    for r in (
        readers.mha,
        families.deberta_v2,
        readers.separate(("query", "key", "value")),
        readers.separate(("q_proj", "k_proj", "v_proj")),
        readers.separate(("q_lin", "k_lin", "v_lin")),
        readers.separate(("q", "k", "v")),
        readers.fused_rows("qkv", "proj"),
        readers.fused_rows("qkv_proj", "o_proj"),
        readers.fused_rows("Wqkv", "Wo"),
        families.falcon,
        readers.neox,
        readers.gpt2,
    )
]


class ReaderHandle:
    """Returned by :func:`register_reader`: :meth:`remove` (or leaving a ``with`` block)
    unregisters the reader; removing twice does nothing."""

    def __init__(self, entry: _Entry):
        self._entry = entry

    @property
    def reader(self) -> Reader:
        return self._entry.reader

    def remove(self) -> None:
        if self._entry in _READERS:
            _READERS.remove(self._entry)

    def __enter__(self) -> ReaderHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        name = getattr(self.reader, "__qualname__", repr(self.reader))
        state = "registered" if self._entry in _READERS else "removed"
        return f"ReaderHandle({name}, {state})"


def register_reader(reader: Reader, *, first: bool = False) -> ReaderHandle:
    """Teach :func:`~quotientgeo.find_symmetries` an attention layout.

    ``reader(name, module, context)`` is called on every module of the model (``name`` as in
    ``model.named_modules()``, ``""`` for the model itself; ``context`` a
    :class:`DiscoveryContext`) and returns an :class:`AttentionFinding` for a module it
    recognises, ``None`` otherwise, or raises :class:`Unmapped` (with the reason) for one it
    recognises but cannot map. The first reader that recognises a module is used: registered
    readers are tried after the built-in ones, or before them with ``first=True``. Returns a
    :class:`ReaderHandle`; ``handle.remove()``, or ``with register_reader(...):``, undoes the
    registration.
    """
    if not callable(reader):
        raise TypeError(f"a reader must be callable, got {type(reader).__name__}")
    if not isinstance(first, bool):
        raise TypeError(f"first must be True or False, got {first!r}")
    entry = _Entry(reader)
    if first:
        _READERS.insert(0, entry)
    else:
        _READERS.append(entry)
    return ReaderHandle(entry)


def registered_readers() -> tuple[Reader, ...]:
    """The readers :func:`~quotientgeo.find_symmetries` tries, in order."""
    return tuple(e.reader for e in _READERS)
