"""What an ingest shows while it runs: one progress bar on a terminal, else one line per stage.

The stages are the ones an :class:`~helix_ray.ingest.run.IngestReport` times (its
``seconds`` keys). :func:`shown` picks how to show them: on a terminal a single bar on
stderr, redrawn in place, that moves through every stage of the run; elsewhere (a pipe, a
log file, a test) one plain line per stage as it ends, with what it did and how long it
took. Ray's own output is a separate matter (:func:`helix_ray.runtime.show_ray_output`);
when it is on, Ray writes lines of its own, and a bar drawn in place would be torn by
them, so the plain lines are used.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Protocol, TextIO

from helix_ray.runtime import ray_output_shown

#: Stage (a report's ``seconds`` key) → its name on screen. ``record`` is shown as part
#: of ``publish``: the generation is not current until the database has recorded it.
LABELS = {
    "ray_start": "start Ray",
    "read_validate": "read + validate",
    "dedup": "dedup",
    "expand_embed_annotate": "embed",
    "assemble": "assemble",
    "publish": "publish",
    "record": "publish",
}

#: Each stage's rough share of an ingest of new records, so the bar moves at an even pace:
#: embedding (with expansion and annotation) is most of the work.
WEIGHTS = {"ray_start": 10, "read_validate": 8, "dedup": 4, "expand_embed_annotate": 70, "assemble": 4,
           "publish": 4}


class Progress(Protocol):
    """Told by an ingest run where it is."""

    def stage(self, name: str) -> None:
        """Stage ``name`` begins (the one before it has ended)."""

    def advance(self, rows: int) -> None:
        """``rows`` more rows of the current stage are done (from any thread)."""


class NoProgress:
    """Shows nothing."""

    def stage(self, name: str) -> None:
        pass

    def advance(self, rows: int) -> None:
        pass


@contextmanager
def shown(report: Any, show: bool, stream: TextIO | None = None) -> Iterator[Progress]:
    """The progress of the run that fills ``report``, on ``stream`` (stderr): a bar when
    it is a terminal and Ray's own output is off, else :class:`StageLines`; nothing
    unless ``show``. Closed when the block ends, saying whether the run failed."""
    if not show:
        yield NoProgress()
        return
    stream = stream or sys.stderr
    progress: StageLines = (Bar if _is_terminal(stream) and not ray_output_shown() else StageLines)(report, stream)
    try:
        yield progress
    except BaseException:
        progress.close(failed=True)
        raise
    progress.close(failed=False)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class StageLines:
    """One line per stage once it ends, e.g. ``read + validate: 308 records, 8
    quarantined (1.2 s)``: what the stage did, from the report, and its time."""

    def __init__(self, report: Any, stream: TextIO):
        self.report, self.stream = report, stream
        self.lock = threading.Lock()
        self.current: str | None = None  # the stage running now (its report key)
        self.started = time.monotonic()
        self.rows = 0  # of the current stage

    def stage(self, name: str) -> None:
        with self.lock:
            if self.current is not None and LABELS.get(name) != LABELS.get(self.current):
                self._ended(self.current)
            self.current, self.rows = name, 0

    def advance(self, rows: int) -> None:
        with self.lock:
            self.rows += rows

    def close(self, *, failed: bool) -> None:
        with self.lock:
            if self.current is not None:
                self._ended(self.current, failed=failed)
            self.current = None

    def _ended(self, name: str, *, failed: bool = False) -> None:
        label = LABELS.get(name, name)
        if failed:
            self._write(f"{label}: failed\n")
            return
        seconds = sum(s for key, s in self.report.seconds.items() if LABELS.get(key, key) == label)
        self._write(f"{label}: {summary(self.report, name)} ({seconds:.1f} s)\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def summary(report: Any, name: str) -> str:
    """What stage ``name`` did, read from ``report`` once the stage has ended."""
    r = report
    if name == "ray_start":
        return "ready"
    if name == "read_validate":
        return f"{r.read} records, {r.quarantined} quarantined"
    if name == "dedup":
        return f"{r.new} new, {r.updated} updated, {r.unchanged} unchanged, {r.duplicates} dropped as near-duplicates"
    if name == "expand_embed_annotate":
        return f"{r.embedded} embedded" + (f", {r.reused} reused" if r.reused else "")
    if name == "assemble":
        return f"{r.total_memories} memories"
    if name in ("publish", "record"):
        return f"generation {r.generation}" if r.published else "nothing published"
    return "done"


class Bar(StageLines):
    """One line on a terminal, redrawn in place: the current stage, a bar over the whole
    run, the rows of a stage that counts them, and the time so far. A thread redraws it
    while a long stage gives no news, so the clock keeps moving."""

    TICK_S = 0.25

    def __init__(self, report: Any, stream: TextIO):
        super().__init__(report, stream)
        self.done: set[str] = set()
        self.fill, self.empty = ("█", "░") if _encodes(stream, "█░") else ("#", "-")
        self.drawn = ""
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="helix-progress", daemon=True)
        self.ticker.start()

    def stage(self, name: str) -> None:
        with self.lock:
            if self.current is not None:
                self.done.add(self.current)
            self.current, self.rows = name, 0
            self._draw()

    def advance(self, rows: int) -> None:
        with self.lock:
            self.rows += rows
            self._draw()

    def close(self, *, failed: bool) -> None:
        self.stop.set()
        self.ticker.join()
        with self.lock:
            if self.current is not None:
                self.done.add(self.current)
            self.current = None
            self._draw(final="failed" if failed else "done")
            self._write("\n")

    def _tick(self) -> None:
        while not self.stop.wait(self.TICK_S):
            with self.lock:
                if self.current is not None:
                    self._draw()

    def _fraction(self) -> float:
        weights = {k: v for k, v in WEIGHTS.items() if k != "ray_start" or k in self.done or k == self.current}
        total = sum(weights.values())
        done = sum(w for k, w in weights.items() if k in self.done)
        if self.current in weights and self.current == "expand_embed_annotate" and self.report.embedded:
            done += weights[self.current] * min(1.0, self.rows / self.report.embedded)
        return min(1.0, done / total)

    def _draw(self, final: str | None = None) -> None:
        fraction = 1.0 if final == "done" else self._fraction()
        label = final or LABELS.get(self.current or "", self.current or "")
        rows = f"  {self.rows}/{self.report.embedded} rows" if self.current == "expand_embed_annotate" else ""
        elapsed = int(time.monotonic() - self.started)
        tail = f" {fraction:4.0%}{rows}  {elapsed // 60}:{elapsed % 60:02d}"
        width = max(10, min(40, _columns(self.stream) - 52))  # room for the label and a tail of rows
        cells = int(round(fraction * width))
        line = f"{label:<16} {self.fill * cells}{self.empty * (width - cells)}{tail}"
        if line != self.drawn:  # the ticker redraws often; the terminal needs only changes
            self.drawn = line
            self._write(f"\r\x1b[K{line}")


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80  # 0: a terminal that does not say
    except (AttributeError, OSError, ValueError):
        return 80


def _encodes(stream: TextIO, text: str) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "ascii")
        return True
    except (LookupError, UnicodeEncodeError):
        return False
