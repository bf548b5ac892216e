"""The ``helix`` commands over a store as a whole: ``quarantine`` and ``doctor`` look
into it, ``backup`` and ``restore`` copy it, ``forget-user`` erases a user from it,
``audit`` shows who did which admin action. They print; the work is
:class:`helix_ray.store.db.StoreDB`'s, :mod:`helix_ray.store.doctor`'s,
:mod:`helix_ray.store.backup`'s, :mod:`helix_ray.live.forget`'s and
:mod:`helix_ray.store.audit`'s. :func:`record` appends the admin commands to the audit
log. Imports stay inside the functions (``helix --help`` loads none of them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from helix_ray.cli_common import existing_store


def quarantine(args: argparse.Namespace) -> int:
    """``helix quarantine``: the rejected records, oldest first, with reason code,
    sentence, source file and position."""
    from helix_ray.errors import InvalidArgument
    from helix_ray.store.db import StoreDB

    store = existing_store(args.store)
    if args.limit < 1:
        raise InvalidArgument("--limit", args.limit, "it must be a whole number ≥ 1")
    with StoreDB(store, read_only=True) as db:
        reasons = db.quarantine_reasons()
        if args.reason and args.reason not in reasons:
            held = f"the reason codes this store holds are {', '.join(reasons)}" if reasons else \
                "this store's quarantine is empty"
            raise InvalidArgument("--reason", args.reason, held)
        rows = db.quarantine(args.limit, reason=args.reason)
    total = reasons.get(args.reason, 0) if args.reason else sum(reasons.values())
    records = [_record(row) for row in rows]
    if args.json:
        print(json.dumps({"total": total, "records": records}, indent=1, default=str, ensure_ascii=False))
        return 0
    for r in records:
        print(f"{r['reason']:<14} {r['source']} · {r['position']}")
        print(f"{'':<14} {r['sentence']}")
    shown = f"{len(records)} of {total}" if len(records) < total else str(total)
    counts = ", ".join(f"{code} ×{n}" for code, n in reasons.items())
    print(f"-- {shown} quarantined record{'s' if total != 1 else ''}" + (f" (in all: {counts})" if counts else "")
          + ("; --json shows each one's raw input" if records else ""))
    return 0


def _record(row: dict[str, Any]) -> dict[str, Any]:
    """A quarantine row with its reason split into code and sentence."""
    code, _, sentence = str(row["reason"]).partition(": ")
    return {"reason": code, "sentence": sentence, "source": row["source"], "position": row["position"],
            "raw": row["raw"], "ingest_run": row["ingest_run"], "quarantined_at": row["quarantined_at"]}


def doctor(args: argparse.Namespace) -> int:
    """``helix doctor``: one line per check; 0 when every check holds, 1 otherwise."""
    from helix_ray.store.doctor import check_store

    checks = check_store(args.store)
    for check in checks:
        print(f"{'ok' if check.ok else 'PROBLEM':<8} {check.name:<9} {check.found}")
        if check.fix:
            print(f"{'':<8} {'':<9} fix: {check.fix}")
    problems = sum(not c.ok for c in checks)
    if problems:
        print(f"helix doctor: {problems} problem{'s' if problems > 1 else ''} in {args.store}.", file=sys.stderr)
        return 1
    return 0


def backup(args: argparse.Namespace) -> int:
    """``helix backup``: the store copied into a new folder, with its manifest."""
    from helix_ray.store.backup import MANIFEST, backup as backup_store

    manifest = backup_store(args.store, args.out)
    size = sum(f["bytes"] for f in manifest["files"])
    print(f"backed up {args.store} (generation {manifest['generation']}) into {args.out}: "
          f"{len(manifest['files'])} files, {size:,} bytes; {MANIFEST} lists each with its SHA-256")
    return 0


def restore(args: argparse.Namespace) -> int:
    """``helix restore``: a checked backup into a new store folder."""
    from helix_ray.errors import InvalidArgument
    from helix_ray.store.backup import restore as restore_store

    store = _restore_folder(args)
    if store is None and args.store:
        raise InvalidArgument("--store", args.store_flag, f"name one folder to restore into; DIR names {args.store}",
                              "Give the new store's folder once: `helix restore BACKUP DIR` or `--store DIR`.")
    if store is None:
        raise InvalidArgument("DIR", "", "name the new store's folder (new, or empty) to restore into",
                              "Run `helix restore BACKUP DIR` (or `--store DIR`).")
    manifest = restore_store(args.backup, store)
    print(f"restored {args.backup} (generation {manifest['generation']}, backed up {manifest['created_at']} "
          f"by Helix {manifest['helix_version']}) into {store}: {len(manifest['files'])} files checked")
    return 0


def forget_user(args: argparse.Namespace) -> int:
    """``helix forget-user``: the user's rows out of the database and the delta, their
    keys and the adapter fitted on their queries out of the folder; with ``--compact``,
    out of the served generation and every file that held them too. The work is the
    single writer's (:mod:`helix_ray.live.forget`), as for ``DELETE /v1/users/{user}``."""
    from helix_ray.errors import NotFound
    from helix_ray.live.writer import WriterCore
    from helix_ray.store.db import DatabaseHeld

    store = existing_store(args.store)
    try:
        writer = WriterCore(store)  # its start replays the online writes' log into a new delta snapshot
    except DatabaseHeld:
        raise DatabaseHeld(
            f"Cannot forget user {args.user!r} in {store}: another process holds its database (a `helix serve` or "
            "an ingest), and DuckDB lets one process write it. With `helix serve` running, ask it: `DELETE "
            f"/v1/users/{args.user}` with an admin key (docs/http-api.md). Else wait for the ingest, or stop the "
            "server (its writes are durable in the database), and run this again.") from None
    try:
        outcome = writer.forget_user(args.user, compact=args.compact)
    except NotFound:  # exit 1: most likely a mistyped user id
        print(f"helix forget-user: store {args.store} holds nothing of user {args.user!r}; check the id "
              f"(`helix stats --store {args.store}` counts each user's memories).", file=sys.stderr)
        return 1
    finally:
        writer.close()
    if args.json:
        print(json.dumps(outcome, indent=1))
        return 0
    adapter_note = "; the query adapter (refit: helix adapt --from-feedback)" if outcome["adapter_removed"] else ""
    print(f"forgot user {args.user!r}: {outcome['memories']} memories ({outcome['chunks']} chunks), "
          f"{outcome['expansions']} expansions, {outcome['entities']} entities, {outcome['edges']} edges, "
          f"{outcome['access_rows']} accesses, {outcome['feedback']} feedback rows, {outcome['online_writes']} "
          f"online writes, {outcome['inbox_lines']} inbox lines, {outcome['keys']} keys{adapter_note}")
    if outcome["compacted"]:
        print(f"generation {outcome['generation']} holds none of them; older generations and delta snapshots "
              "deleted")
    else:
        print(f"the current generation still holds them, and recall still finds them, until the next one is "
              f"published (an ingest or a compaction); `helix forget-user --store {args.store} {args.user}` "
              "publishes it now")
    if outcome["mirror_stale"]:
        print("this store's mirror holds the user's data until the next push to it (`helix serve --mirror URI` or "
              "`helix ingest --mirror URI`); that push keeps no older generation there")
    return 0


def audit(args: argparse.Namespace) -> int:
    """``helix audit``: the newest records of the store's audit log, oldest first."""
    from helix_ray.errors import InvalidArgument
    from helix_ray.recall.scope import as_time
    from helix_ray.store import audit as audit_log

    if not audit_log.is_store(args.store):
        raise FileNotFoundError(f"Store {args.store} does not exist or holds no Helix store; check --store.")
    if args.limit < 1:
        raise InvalidArgument("--limit", args.limit, "it must be a whole number ≥ 1")
    records = audit_log.read(args.store, since=as_time("--since", args.since), limit=args.limit)
    if args.json:
        for r in records:
            print(json.dumps(r, ensure_ascii=False))
        return 0
    for r in records:
        who = r["actor"] + (f" ({r['actor_user']})" if r.get("actor_user") else "")
        what = r["action"] + (f" {r['target']}" if r.get("target") else "")
        ended = r["outcome"] + (f" {r['status']}" if r.get("status") is not None else "")
        extra = "".join(f"  {name}={json.dumps(r[name], ensure_ascii=False)}"
                        for name in ("params", "result") if r.get(name))
        print(f"{r['time']}  {who}  {what}  {ended}{extra}")
        if r.get("detail"):
            print(f"{'':<34}{r['detail']}")
    files = audit_log.files(args.store)
    print(f"-- {len(records)} record{'s' if len(records) != 1 else ''}"
          + (f" (log: {', '.join(str(f) for f in files)})" if files else " (no admin action recorded yet)"))
    return 0


def _restore_folder(args: argparse.Namespace) -> str | None:
    """The folder ``helix restore`` restores into, given as DIR or ``--store``; None when
    neither is given, or two different ones are."""
    if args.store and args.store_flag and Path(args.store) != Path(args.store_flag):
        return None
    return args.store or args.store_flag or None


def record(args: argparse.Namespace, code: int | None, detail: str | None = None) -> None:
    """Append a command that changes a store as a whole (``forget-user``, ``backup``,
    ``restore``, ``compact``, ``adapt``) to that store's audit log, as done by
    ``cli:<os user>``: ``ok`` for exit code 0, ``refused`` for another (``detail``: its
    sentence), ``failed`` for an unexpected error (``code`` None). The keys' commands are
    recorded by the key store itself."""
    entry = _admin_command(args)
    if entry is None:
        return
    from helix_ray.store import audit as audit_log

    store, target, params = entry
    outcome: audit_log.Outcome = "ok" if code == 0 else "failed" if code is None else "refused"
    try:
        audit_log.append(store, actor=audit_log.local_actor(), action=args.command, target=target, params=params,
                         outcome=outcome, status=code, detail=detail)
    except OSError as exc:  # the command's own outcome stands; say that it went unrecorded
        print(f"helix {args.command}: could not append to the audit log of {store}: {exc}", file=sys.stderr)


def _admin_command(args: argparse.Namespace) -> tuple[Path, str | None, dict[str, Any]] | None:
    """(store, target, params) of an admin command, None for any other."""
    command = args.command
    if command == "forget-user":
        return Path(args.store), args.user, {"compact": args.compact}
    if command == "backup":
        return Path(args.store), str(Path(args.out).resolve()), {}
    if command == "restore":  # recorded in the store it made (or, refused, the store it would not overwrite)
        folder = _restore_folder(args)
        if folder is None:
            return None  # no folder, or two: nothing was touched
        return Path(folder), str(Path(folder).resolve()), {"backup": str(Path(args.backup).resolve())}
    if command == "compact":
        return Path(args.store), None, {"runner": args.runner}
    if command == "adapt":
        return Path(args.store), None, {"pairs": args.pairs, "from_feedback": args.from_feedback,
                                        "users": args.users, "ridge": args.ridge, "force": args.force,
                                        "remove": args.remove}
    return None
