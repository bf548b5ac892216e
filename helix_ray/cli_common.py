"""What the ``helix`` commands share: how a report and a recall answer print,
configuration files loaded with errors that name the flag the user typed, and a store
opened in this process with an error that says what to do when another holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_config_typed(model: Any, path: str | None, flag: str, overrides: dict[str, Any] | None = None,
                      typed: tuple[str, Any] | None = None) -> Any:
    """``load_config(model, path, overrides)``, its errors naming what the user typed
    rather than the model: ``flag`` and the file, or ``typed`` (the flag and value that
    ``overrides`` holds) when there is no file."""
    from helix_ray.config import load_config
    from helix_ray.errors import InvalidArgument

    try:
        return load_config(model, path, overrides)
    except InvalidArgument as exc:
        named, received = (flag, path) if path is not None else typed or (None, None)
        if named is None:
            raise
        raise InvalidArgument(named, received, exc.allowed, exc.fix) from None


def existing_store(folder: str | Path) -> Path:
    """``folder`` as a store with a database; FileNotFoundError saying how to make one
    (a command that opened a ``Memory`` there would make an empty store of any folder)."""
    from helix_ray.store.db import DB_FILE

    store = Path(folder)
    if not (store / DB_FILE).is_file():
        what = "does not exist" if not store.exists() else f"holds no {DB_FILE}: it is not a Helix store"
        raise FileNotFoundError(f"Store {folder} {what}; create one with `helix ingest SOURCE --store DIR`, or check "
                                "--store.")
    return store


def open_memory(store: str | Path, *, doing: str, instead: str, **options: Any) -> Any:
    """``Memory(store, **options)``; when another process holds the store's database,
    a :class:`~helix_ray.store.db.DatabaseHeld` that names ``doing`` (``"recall from"``,
    ``"add a memory in"``) and, with ``helix serve`` running, what to do ``instead``."""
    from helix_ray.memory import Memory
    from helix_ray.store.db import DatabaseHeld

    try:
        return Memory(Path(store), **options)
    except DatabaseHeld:
        raise DatabaseHeld(
            f"Cannot {doing} {store}: another process holds its database (a `helix serve`, `helix mcp --store` or "
            f"an ingest), and DuckDB lets one process open it. With `helix serve` running, {instead}. Else wait "
            "for the ingest to end and run this again.") from None


def format_report(report) -> str:
    """An ingest's report, for a terminal: what was read, what it did, what it published."""
    lines = [
        f"read {_count(report.read, 'record')}"
        + (f" ({report.chunks} of them chunks of {_count(report.chunked, 'long text')})" if report.chunks else "")
        + f": {report.accepted} accepted, {report.quarantined} quarantined",
        f"  new {report.new}, updated {report.updated}, unchanged {report.unchanged}, "
        f"dropped as near-duplicates {report.duplicates}, embedded {report.embedded}"
        + (f", removed {report.removed} (gone from their source)" if report.removed else "")
        + (f", renamed {report.renamed} (their ids now name their user)" if report.renamed else "")
        + (f", kept deleted {report.kept_deleted} (deleted by a user; the source gives them unchanged)"
           if report.kept_deleted else ""),
    ]
    if report.quarantine_reasons:
        lines.append("  quarantine: " + ", ".join(f"{k} ×{v}" for k, v in report.quarantine_reasons.items()))
    state = "published" if report.published else "unchanged (nothing new)"
    memories = f"{report.total_memories} memor{'y' if report.total_memories == 1 else 'ies'}"
    lines.append(f"generation {report.generation}: {state}, {memories}" if report.generation is not None else
                 f"no generation: nothing to publish, {memories}")
    lines.append("  seconds: " + ", ".join(f"{k} {v}" for k, v in report.seconds.items()))
    if len(report.work_units) > 1:  # a cluster's nodes shared the kNN searches
        lines.append("  units of work per node: " + ", ".join(f"{node[:8]} {n}" for node, n in report.work_units.items()))
    if report.mirrored:
        m = report.mirrored
        lines.append(f"mirror {m['uri']}: generation {m['generation']} ({m['uploaded']} files uploaded, "
                     f"{m['copied']} copied there), delta snapshot {m['delta_version']}")
    return "\n".join(lines)


def format_compaction(outcome: dict[str, Any]) -> str:
    """A compaction's outcome (``WriterCore.compact``), for a terminal."""
    if "reason" in outcome:
        return f"{outcome['reason']}: generation {outcome['generation']} stays"
    done = (f"folded {_count(outcome['folded'], 'write')} and {_count(outcome['deletions'], 'deletion')}, "
            f"{outcome['kept_in_delta']} left in the delta, in {outcome['seconds']} s")
    if outcome["published"]:
        return f"published generation {outcome['generation']}: {done}"
    return f"generation {outcome['generation']} stays (no row of it changed): {done}"


def format_result(result) -> str:
    """A :class:`~helix_ray.recall.result.RecallResult`, for a terminal."""
    return format_answer(result.as_dict())


def format_answer(answer: dict[str, Any], took_ms: list[float] | None = None) -> str:
    """A recall answer — ``RecallResult.as_dict()``, or a ``POST /v1/recall`` body, which
    has its shape — for a terminal; ``took_ms``: the HTTP round trips (first, last)."""
    flags = answer.get("flags", {})
    if flags.get("router_skip"):
        return f"(no recall: {flags['route']['reason']})"
    if not answer["items"]:
        return "(no memories matched)"
    lines = []
    # A reader reads top-down: best first. The agent's context (`--json`, result.context())
    # keeps the packed order, best at both ends.
    for item in sorted(answer["items"], key=lambda i: i["rank"]):
        cut = " [cut]" if item["truncated"] else ""
        lines.append(f"[{item['rank']}] {item['id']} · {item['type']} · {_minute(item['created_at'])} · "
                     f"score {item['score']:.3f} · {item['n_tokens']} tok{cut}")
        lines.append("    " + item["text"].replace("\n", "\n    "))
    timing = ", ".join(f"{k} {v:.1f}" for k, v in answer["timings_ms"].items())
    where = "ms" if took_ms is None else (f"HTTP round trip {took_ms[-1]:.1f} ms ({took_ms[0]:.0f} ms for the "
                                          "replica's first request); in the replica, ms")
    lines.append(f"-- {_count(len(answer['items']), 'item')}, "
                 f"{answer['total_tokens']}/{answer['budget_tokens']} tokens, "
                 f"generation {answer['generation']}; listed best first (an agent's context packs them best "
                 "at both ends); "
                 f"{where}: {timing}")
    read = _time_read(flags.get("time") or {})
    if read:
        lines.append(read)
    from helix_ray.recall.result import weak_match_note

    weak = weak_match_note(flags)
    if weak:
        lines.append(f"-- {weak}")
    over = flags.get("over_budget", 0)
    if over:
        shown = {item["rank"] for item in answer["items"]}
        missing = [r for r in range(1, len(shown) + over + 1) if r not in shown]
        lines.append(f"-- rank{'s' if over > 1 else ''} {', '.join(map(str, missing))} did not fit the "
                     f"{answer['budget_tokens']}-token budget; a larger budget (--budget) shows "
                     f"{'them' if over > 1 else 'it'}")
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    """``1 record``, ``3 records``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _minute(iso: str) -> str:
    """``2025-03-18T14:02:11+00:00`` as ``2025-03-18 14:02`` (UTC, as stored)."""
    return iso[:16].replace("T", " ")


def _time_read(time: dict[str, Any]) -> str | None:
    """A recall's reading of the time its query names (``flags.time``), and what it did:
    a window no candidate falls in changed nothing, which a reader should see."""
    import datetime as dt

    window = time.get("window")
    if not window:
        return None

    def day(iso: str, end: bool) -> str:
        moment = dt.datetime.fromisoformat(iso)
        if moment.year in (1, 9999):  # an open side: "since May", "before 2024"
            return "…"
        return (moment - dt.timedelta(microseconds=1) if end else moment).date().isoformat()

    line = (f"-- time: {window['expression']!r} read as {day(window['core_start'], False)} – "
            f"{day(window['core_end'], True)}")
    inside = time.get("inside")
    if inside == 0:
        return (line + "; no candidate was made in it or states a date in it, so it changed no rank (asked on "
                "another day? give that day as now: --now)")
    return line + (f"; it raised {_count(inside, 'candidate')}" if inside else "")
