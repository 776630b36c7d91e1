"""What a person watches while a run goes: a rich progress bar on a terminal (step, loss,
tokens/s, memory, ETA), plain log lines otherwise (CI logs, `2>&1 | tee`), and messages.
Everything goes to stderr, as logs do; stdout is left for what a verb prints as its result."""
from __future__ import annotations

import sys
import time
from typing import NamedTuple

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column

console = Console(stderr=True, highlight=False)


def say(message: str) -> None:
    console.print(message, soft_wrap=True)


def counted(n: int, noun: str) -> str:
    """`1 token`, `2 tokens`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {message}", soft_wrap=True)  # the terminal wraps, not mid-value here


class StepProgress:
    """One bar for rank 0; other ranks get a silent instance."""

    def __init__(self, total: int, start: int, enabled: bool, bar: bool):
        self.enabled, self.total = enabled, total
        self.bar = enabled and bar and sys.stderr.isatty()
        self._progress = None
        self._last_line = 0.0
        self._start_step, self._start_time = start, time.monotonic()
        if self.bar:
            # one text after the bar, step count and ETA first: a narrow terminal cuts the info's end
            self._progress = Progress(
                TextColumn("[bold]train", table_column=Column(min_width=5)),
                BarColumn(bar_width=16, table_column=Column(min_width=16)),
                TextColumn("{task.fields[line]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
                console=console, transient=False)
            self._task = self._progress.add_task("train", total=total, completed=start, line=f"{start}/{total}")
            self._progress.start()

    def update(self, step: int, info: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self._progress.update(self._task, completed=step, line=f"{step}/{self.total} ETA {self._eta(step)} {info}")
        elif time.monotonic() - self._last_line > 5 or step == self.total:  # plain logs: every 5 s
            self._last_line = time.monotonic()
            say(f"step {step}/{self.total} {info} ETA {self._eta(step)}")

    def note(self, step: int, text: str) -> None:
        """A line of its own, whatever the bar or the 5 s cadence of plain lines show (an eval)."""
        if self.enabled:
            say(f"step {step}/{self.total} {text}")

    def _eta(self, step: int) -> str:
        done = step - self._start_step
        if done <= 0:
            return "?"
        return clock((time.monotonic() - self._start_time) / done * (self.total - step))

    def close(self) -> None:
        if self._progress:
            self._progress.stop()


class Shown(NamedTuple):
    """How work below the verb is shown: at all (rank 0), and as a bar where stderr is a terminal
    (log.progress)."""
    enabled: bool
    bar: bool


HIDDEN = Shown(False, False)


class CountProgress:
    """Items done of a known total (rows tokenized, eval batches run): on a terminal a bar with
    the rate and ETA that goes when done (a result line follows); otherwise a plain line every
    5 s, so work under 5 s says nothing; silent when not `enabled` (ranks other than 0). Used
    as a context manager."""

    def __init__(self, label: str, total: int, unit: str, enabled: bool = True, bar: bool = True):
        from rich.markup import escape
        from rich.progress import MofNCompleteColumn, TimeElapsedColumn

        self.label, self.total, self.unit, self.done = label, total, unit, 0
        self.enabled = enabled
        self._started = self._last_line = time.monotonic()
        self._progress = None
        if enabled and bar and sys.stderr.isatty():
            self._progress = Progress(TextColumn(f"[bold]{escape(label)}"), BarColumn(bar_width=16), MofNCompleteColumn(),
                                      TextColumn(unit), TimeElapsedColumn(), TextColumn("ETA"),
                                      TimeRemainingColumn(), console=console, transient=True)
            self._task = self._progress.add_task(label, total=total)

    def __enter__(self) -> "CountProgress":
        from rich.errors import LiveError

        if self._progress:
            try:
                self._progress.start()
            except LiveError:  # the training bar is up (rich shows one at a time): plain lines above it
                self._progress = None
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._progress:
            self._progress.update(self._task, completed=self.done)
        elif self.enabled and (now := time.monotonic()) - self._last_line > 5:
            self._last_line, rate = now, self.done / (now - self._started)
            shown_rate = f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"
            say(f"{self.label} {self.done}/{self.total} {self.unit} ({shown_rate}/s, ETA "
                f"{clock((self.total - self.done) / rate)})")

    def __exit__(self, *exc) -> None:
        if self._progress:
            self._progress.stop()


def clock(seconds: float) -> str:
    """`03:45:00`, `1d 03:45:00`: a duration past a day keeps its days (gmtime's %H wrapped)."""
    days, rest = divmod(int(seconds), 86400)
    return (f"{days}d " if days else "") + time.strftime("%H:%M:%S", time.gmtime(rest))


class ByteProgress:
    """A bar over bytes written (size, speed, ETA) on a terminal; a plain line every 5 s
    otherwise. Used as a context manager."""

    def __init__(self, label: str, total_bytes: int, enabled: bool = True):
        from rich.progress import DownloadColumn, TransferSpeedColumn

        self.label, self.total, self.done = label, total_bytes, 0
        self.enabled = enabled
        self._last_line = time.monotonic()
        self._progress = None
        if enabled and sys.stderr.isatty():
            self._progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=console, transient=False)
            self._task = self._progress.add_task(label, total=total_bytes)

    def __enter__(self) -> "ByteProgress":
        if self._progress:
            self._progress.start()
        return self

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._progress:
            self._progress.update(self._task, completed=self.done)
        elif self.enabled and time.monotonic() - self._last_line > 5:
            self._last_line = time.monotonic()
            say(f"{self.label} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB")

    def __exit__(self, *exc) -> None:
        if self._progress:
            self._progress.stop()
