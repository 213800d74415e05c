"""Progress bars: where the output is not a terminal, a phase prints a line when it starts and
one when it ends; a terminal gets tqdm's bar; a disabled bar prints nothing."""

from __future__ import annotations

import io
import re

import pytest

from quotientgeo.progress import PhaseLines, elapsed, progress_bar

END = re.compile(r"^(.+): (\d+)/(\d+) steps in (\d+\.\d) s$")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("total", [1, 3, 7])
def test_a_phase_to_update_by_hand_prints_its_start_and_its_end(total):
    log = io.StringIO()
    with progress_bar(total=total, desc="measuring", lines=True, file=log) as bar:
        assert isinstance(bar, PhaseLines)
        assert log.getvalue() == f"measuring: started ({total} steps)\n"  # before any step
        for _ in range(total):
            bar.update(1)
    _, end = log.getvalue().splitlines()
    match = END.match(end)
    assert match and match.groups()[:3] == ("measuring", str(total), str(total))


def test_a_phase_over_an_iterable_ends_when_the_iterable_does():
    log = io.StringIO()
    seen = list(progress_bar(range(5), desc="training", lines=True, file=log))
    assert seen == list(range(5))
    start, end = log.getvalue().splitlines()
    assert start == "training: started (5 steps)"
    assert END.match(end).groups()[:3] == ("training", "5", "5")


def test_a_phase_stopped_by_an_exception_says_so_once():
    log = io.StringIO()
    with pytest.raises(KeyError):
        with progress_bar(total=4, desc="grid", lines=True, file=log) as bar:
            bar.update(1)
            raise KeyError("x")
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("grid: stopped by KeyError after 1/4 steps in")


def test_the_bar_api_the_studies_use_is_silent():
    log = io.StringIO()
    bar = progress_bar(total=10, desc="training", lines=True, file=log)
    bar.n = 6  # the diagonal study sets the count of converged networks
    bar.set_postfix(active=4)
    bar.refresh()
    bar.close()
    bar.close()
    _, end = log.getvalue().splitlines()
    assert END.match(end).groups()[:3] == ("training", "6", "10")


@pytest.mark.parametrize(("enabled", "lines"), [(False, True), (False, False), (True, False)])
def test_nothing_is_printed_when_disabled_or_without_lines(enabled, lines):
    log = io.StringIO()  # not a terminal: tqdm hides its bar
    with progress_bar(total=3, desc="x", enabled=enabled, lines=lines, file=log) as bar:
        bar.update(3)
    assert log.getvalue() == ""


def test_a_terminal_gets_the_bar_not_lines():
    tty = Terminal()
    with progress_bar(total=2, desc="bar", lines=True, file=tty) as bar:
        assert not isinstance(bar, PhaseLines)
        bar.update(2)
    assert "started" not in tty.getvalue() and "bar" in tty.getvalue()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.04, "0.0 s"),
        (59.94, "59.9 s"),
        (60, "1 min 00 s"),
        (754.6, "12 min 35 s"),
        (3600, "1 h 00 min"),
        (7265, "2 h 01 min"),
    ],
)
def test_elapsed(seconds, text):
    assert elapsed(seconds) == text
