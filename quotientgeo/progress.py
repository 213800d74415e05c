"""Progress bars: tqdm, shown only where the output is a terminal.

``enabled=True`` asks for a bar; tqdm then still hides it when the stream is not a terminal
(``disable=None``), so logs of batch jobs and CI are not flooded with carriage returns.
"""

from __future__ import annotations

from collections.abc import Iterable

from tqdm.auto import tqdm

__all__ = ["progress_bar"]


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    enabled: bool = True,
    leave: bool = False,
) -> tqdm:
    """A tqdm bar over ``iterable`` (or one to ``update`` by hand), off when ``enabled`` is
    false and when the output is not a terminal."""
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        disable=None if enabled else True,
        dynamic_ncols=True,
        leave=leave,
    )
