"""Progress bars: tqdm, shown only where the output is a terminal.

``enabled=True`` asks for a bar; tqdm then still hides it when the stream is not a terminal
(``disable=None``), so logs of batch jobs and CI are not flooded with carriage returns.
``lines=True`` (the studies' phases) prints instead, where the stream is not a terminal, one
line when the phase starts and one when it ends, with its elapsed time, so that a long run
whose output goes to a log still says where it is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import IO

from tqdm.auto import tqdm
from tqdm.std import tqdm as plain_tqdm

__all__ = ["PhaseLines", "elapsed", "progress_bar"]


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    enabled: bool = True,
    leave: bool = False,
    lines: bool = False,
    file: IO[str] | None = None,
) -> plain_tqdm:
    """A tqdm bar over ``iterable`` (or one to ``update`` by hand), off when ``enabled`` is
    false and when the output is not a terminal. With ``lines``, an enabled bar whose output
    (``file``, default ``sys.stderr``) is not a terminal is a :class:`PhaseLines` instead: a
    line at its start and one at its end."""
    stream = sys.stderr if file is None else file
    if enabled and lines and not _is_terminal(stream):
        return PhaseLines(iterable, total=total, desc=desc, file=stream)
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        disable=None if enabled else True,
        dynamic_ncols=True,
        leave=leave,
        file=file,
    )


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def elapsed(seconds: float) -> str:
    """``"4.2 s"`` under a minute, ``"3 min 12 s"`` under an hour, ``"1 h 05 min"`` above."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class PhaseLines(plain_tqdm):
    """A disabled tqdm bar that prints ``"<desc>: started (<total> steps)"`` when it is made and
    ``"<desc>: <n>/<total> steps in <elapsed>"`` when it closes (at the end of its iterable, on
    ``close()`` or at the end of its ``with`` block), each line flushed. It counts ``update``
    and iteration like a bar, and takes ``n``, ``set_postfix`` and ``refresh`` silently."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str | None = None,
        file: IO[str],
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        super().__init__(iterable, total=total, disable=True)
        self.phase, self.stream, self.ended = desc or "progress", file, False
        self.started = time.perf_counter()
        steps = "" if total is None else f" ({total} steps)"
        self._print(f"{self.phase}: started{steps}")

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def update(self, n: float | None = 1) -> bool | None:
        self.n += 1 if n is None else n
        return None

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.n += 1
        self.close()

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            of = "" if self.total is None else f"/{self.total}"
            took = elapsed(time.perf_counter() - self.started)
            self._print(f"{self.phase}: {self.n:g}{of} steps in {took}")
        super().close()

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if exc_type is not None and not self.ended:
            self.ended = True
            of = "" if self.total is None else f"/{self.total}"
            took = elapsed(time.perf_counter() - self.started)
            self._print(
                f"{self.phase}: stopped by {exc_type.__name__} after {self.n:g}{of} steps in {took}"
            )
        self.close()

    def __del__(self) -> None:  # a bar left open by an exception says nothing more
        pass
