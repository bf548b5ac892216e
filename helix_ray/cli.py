"""``helix``: one CLI with lazy imports, so ``helix --help`` is instant.

    helix ingest SOURCE... --store DIR [--format auto|jsonl|parquet|markdown|transcript|locomo|code|git] [--runner ray|local]
    helix ingest REPO --format code|git [--repo-name NAME] --store DIR --user USER      its code or its commits
    helix ingest FOLDER --format markdown [--doc-name NAME] --store DIR --user USER      its sections
    helix recall QUERY --store DIR --user USER [--budget TOKENS] [--k N] [--now TIME] [--context TURN]... [--explain] [--json]
    helix stats --store DIR [--json]
    helix quarantine --store DIR [--reason CODE] [--limit N] [--json]      the records an ingest rejected
    helix doctor --store DIR      check a store's folder, database, generation, files and keys
    helix backup --store DIR OUT      a checked copy of a store (not while `helix serve` holds it)
    helix restore BACKUP DIR      a backup back into a new folder
    helix forget-user --store DIR USER [--no-compact]   delete every memory, key and trace of a user
    helix eval {locomo,beir,longmemeval,repo} --data PATH [--systems LIST] [--adapt-on SPLIT] [--json OUT]
    helix adapt --store DIR (--pairs FILE.jsonl | --from-feedback) [--ridge R] | --remove      fit the query adapter
    helix demo [--store DIR] [--in-process]      ingest the shipped sample set and answer a query
    helix serve --store DIR [--host 127.0.0.1] [--port 8000] [--no-auth] [--graph auto|split|compact|inline] [--ha-proxy]
    helix keys create|list|revoke --store DIR [--user USER | KEY_ID]
    helix audit --store DIR [--since TIME] [--limit N] [--json]      who did which admin action, and how it ended
    helix mcp (--store DIR --user USER [--project P] [--session S] | --server URL --key KEY) [--http [--port N]]
    helix --version

Quiet by default: an ingest shows its progress on stderr (one bar on a terminal, else a
line per stage) and Ray's own output stays in its session folder; ``-v``/``--verbose`` on
the commands that may start Ray (ingest, compact, demo, serve) shows it too.

Exit codes: 0 done; 1 done, but with nothing to show for it (an ingest that accepted no
record, a doctor that found a problem); 2 refused (a bad argument, a missing store: the
sentence on stderr says which and how to fix it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from helix_ray import cli_adapt, cli_serve, cli_store, cli_write
from helix_ray.cli_common import existing_store, format_compaction, format_report, format_result, load_config_typed, open_memory
from helix_ray.cli_serve import serve_graph  # noqa: F401 - re-export for tests/test_cli_memory.py

FORMATS = ("auto", "jsonl", "parquet", "markdown", "transcript", "locomo", "code", "git")
TYPES = ("episodic", "semantic", "procedural", "decision", "code")


def _parser() -> argparse.ArgumentParser:
    from helix_ray import __version__

    p = argparse.ArgumentParser(prog="helix", description="Helix: memory recall for coding agents.")
    p.add_argument("--version", action="version", version=f"helix {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _ingest_arguments(sub)
    _recall_arguments(sub)
    _write_arguments(sub)
    _stats_arguments(sub)
    _quarantine_arguments(sub)
    _doctor_arguments(sub)
    _backup_arguments(sub)
    _eval_arguments(sub)
    _adapt_arguments(sub)
    _compact_arguments(sub)
    _demo_arguments(sub)
    _serve_arguments(sub)
    _keys_arguments(sub)
    _audit_arguments(sub)
    _mcp_arguments(sub)
    _describe(sub)
    return p


def _describe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Head each command's own ``--help`` with the line ``helix --help`` lists it by."""
    for action in sub._choices_actions:
        parser = sub.choices[action.dest]
        if parser.description is None and action.help:
            parser.description = action.help[:1].upper() + action.help[1:] + "."
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for inner in nested:
            _describe(inner)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on
    the write end then; where poll cannot tell, assume it is)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def _ingest_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix ingest``: read sources, publish a generation."""
    s = sub.add_parser("ingest", help="ingest sources into a store and publish a new generation")
    s.add_argument("sources", nargs="+", help="files or folders (JSONL, Parquet, Markdown, transcripts, LoCoMo; a "
                   "folder: all such files in it; a source tree with --format code, a git repository with --format "
                   "git)")
    s.add_argument("--store", required=True, help="store folder (created if missing)")
    s.add_argument("--format", default="auto", choices=FORMATS,
                   help="source format (default: detect; code and git are never guessed)")
    s.add_argument("--since", help="--format git: commits made on or after this date (YYYY-MM-DD)")
    s.add_argument("--max", type=int, dest="max_commits", metavar="N", help="--format git: the newest N commits")
    s.add_argument("--repo-name", metavar="NAME", help="--format code or git: the repository's name in the "
                   "memories' ids, code:<user>/<NAME>:... (letters, digits, '.', '_', '-'; default: the name of its git "
                   "repository's top folder, for a folder outside git its own); two repositories in folders of one "
                   "name need two")
    s.add_argument("--doc-name", metavar="NAME", help="--format markdown: the documents' name in the memories' "
                   "ids, md:<user>/<NAME>/<path>#<slug> (letters, digits, '.', '_', '-'; default: the folder's "
                   "name, for a file its folder's); two folders of one name need two")
    s.add_argument("--user", help="tenant for records that name none")
    s.add_argument("--runner", default="ray", choices=("ray", "local"),
                   help="ray: Ray Data on a local Ray or RAY_ADDRESS (default); local: one process")
    s.add_argument("--config", help="ingest YAML (see configs/ingest.yaml)")
    s.add_argument("--mirror", metavar="URI", help="also publish the store's current generation and delta there "
                   "(an absolute folder, file://, s3://, gs:// or hdfs:// URI), for servers on hosts that do not "
                   "see the store folder")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else a line per stage)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    _verbose_argument(s)


def _recall_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix recall``: one query against a store."""
    s = sub.add_parser("recall", help="recall memories for a query")
    s.add_argument("query", help="the question, in words (a time it names, such as 'last week', is read too)")
    s.add_argument("--store", required=True, help="store folder")
    s.add_argument("--user", required=True, help="tenant whose memories to search")
    s.add_argument("--budget", type=int, help="token budget of the packed result (default: default_budget_tokens "
                   "of the retrieval settings, as for POST /v1/recall; see docs/configuration.md)")
    s.add_argument("--k", type=int, default=10, help="items to select before packing (default 10)")
    s.add_argument("--project", help="only memories of this project")
    s.add_argument("--type", dest="types", action="append", choices=TYPES, help="repeat for several")
    s.add_argument("--since", help="ISO-8601 time: only memories created at or after it")
    s.add_argument("--until", help="ISO-8601 time: only memories created at or before it")
    s.add_argument("--now", help="ISO-8601 time the question is asked: what 'last week' or 'yesterday' in the "
                   "query are read against (default: the clock); it raises the memories of that time and hides "
                   "none (--until hides later ones)")
    s.add_argument("--context", action="append", metavar="TURN", help="an earlier turn of the conversation, the "
                   "query being its latest; repeat for several, oldest first")
    s.add_argument("--config", help="retrieval YAML (see configs/retrieval.yaml)")
    s.add_argument("--explain", action="store_true", help="show every candidate's ranks, signals and fate")
    s.add_argument("--json", action="store_true", help="print the answer as JSON: items, flags, timings (items in packed "
                   "order, the best at both ends; sort by each item's rank for best first)")


def _write_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix add`` and ``helix delete``: one memory, through the store's Writer."""
    s = sub.add_parser("add", help="write one memory (durable and recallable when it returns)")
    s.add_argument("text", metavar="TEXT", help="the memory's text; - reads it from stdin (a long text is stored as "
                   "chunks)")
    s.add_argument("--store", required=True, help="store folder (created if missing)")
    s.add_argument("--user", required=True, help="tenant the memory belongs to")
    s.add_argument("--id", help="its id (default: derived from user and text); an existing id is replaced")
    s.add_argument("--type", choices=TYPES, help="default: semantic")
    s.add_argument("--project")
    s.add_argument("--session", dest="session_id", help="the conversation or work session it belongs to")
    s.add_argument("--pinned", action="store_true", help="never dropped as a near-duplicate; ranks as pinned")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("delete", help="delete one memory (all its chunks): never recalled again")
    s.add_argument("id", metavar="ID", help="the memory's id, as recall or add gave it")
    s.add_argument("--store", required=True)
    s.add_argument("--user", required=True, help="whose memory it is: another user's id is refused")
    s.add_argument("--json", action="store_true")


def _stats_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix stats``: counts of a store."""
    s = sub.add_parser("stats", help="counts of a store")
    s.add_argument("--store", required=True)
    s.add_argument("--json", action="store_true")


def _quarantine_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix quarantine``: the records ingest rejected, with why and where."""
    s = sub.add_parser("quarantine", help="list the records ingest rejected: reason, sentence, file and position")
    s.add_argument("--store", required=True)
    s.add_argument("--reason", help="only records of this reason code (e.g. bad_time; an unknown one lists "
                                    "the codes this store holds)")
    s.add_argument("--limit", type=int, default=100, help="at most this many records, oldest first (default 100)")
    s.add_argument("--json", action="store_true", help="print the records, raw input included, as JSON")


def _doctor_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix doctor``: check a store."""
    s = sub.add_parser("doctor", help="check a store (folder, DuckDB, CURRENT, manifest, files, keys) and say how "
                                      "to fix what is wrong; exits 1 if anything is")
    s.add_argument("--store", required=True)


def _backup_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix backup``, ``helix restore``, ``helix forget-user``: a store as a whole."""
    s = sub.add_parser("backup", help="copy a store (current generation, database, delta, inbox, keys, adapter) "
                                      "into a new folder, with a manifest of sizes and checksums")
    s.add_argument("--store", required=True)
    s.add_argument("out", help="the backup folder (new, or empty)")
    s = sub.add_parser("restore", help="restore a backup into a new folder, after checking it against its manifest")
    s.add_argument("backup", help="a folder `helix backup` wrote")
    s.add_argument("store", nargs="?", help="the store folder to create (new, or empty)")
    s.add_argument("--store", dest="store_flag", metavar="DIR", help="the same folder, named as other commands name "
                   "a store (give it either way)")
    s = sub.add_parser("forget-user", help="delete every memory, chunk, expansion, entity, edge, access, feedback "
                                           "and key of a user from a store (not while `helix serve` holds it)")
    s.add_argument("--store", required=True)
    s.add_argument("user", help="the user id (as in --user of recall, or a record's user)")
    s.add_argument("--compact", action=argparse.BooleanOptionalAction, default=True,
                   help="also publish a generation without the user's rows now, and delete the older generations "
                        "and delta snapshots that hold them, as DELETE /v1/users does (default); with "
                        "--no-compact the current generation still serves them until the next compaction or ingest")
    s.add_argument("--json", action="store_true")


def _eval_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix eval``: systems side by side on a benchmark."""
    s = sub.add_parser("eval", help="score retrieval systems side by side on a benchmark")
    s.add_argument("dataset", choices=("locomo", "beir", "longmemeval", "repo"))
    s.add_argument("--data", required=True, help="locomo10.json, a BEIR folder, a LongMemEval JSON file, or (repo) "
                   "a JSONL of questions about a repository (tests/fixtures/repo_questions.jsonl)")
    s.add_argument("--systems", default=",".join(("bm25", "dense", "rrf", "helix")),
                   help="comma-separated: bm25, dense, rrf, helix, helix-rerank (cross-encoder on), helix-no-graph, "
                        "helix-mmr, helix-session, helix-no-recency, helix-no-strong-signal, helix-no-dedup, "
                        "helix-no-doc2query, helix-no-context (turn vectors without their session's context), "
                        "helix-no-lead-title (chunks do not repeat their text's title line: chunk.lead_title off), "
                        "helix-no-vector "
                        "(what Serve answers while its Embedder is down: BM25 through the later stages), "
                        "helix-written (the documents written through Memory.add, still in the delta), "
                        "or 'all'; a Helix system with '+ctx' appended (helix+ctx) gets --query-context's turns "
                        "as recall's context instead of joined before the question; "
                        "helix@<section>.<key>=<value> (several joined by '@', e.g. helix@rank.reweigh_silent=true) "
                        "runs the whole pipeline with those settings on helix's store, paired with it; "
                        "helix@ingest.<section>.<key>=<value> (helix@ingest.chunk.max_tokens=300) on a store built "
                        "with that ingest setting")
    s.add_argument("--split", default="test", help="BEIR qrels split (test, train, dev)")
    s.add_argument("--types", choices=("given", "derived"), default="given",
                   help="memory types of documents that have none: given (a conversation turn episodic, any other "
                        "document semantic; the default) or derived by ingest's rules, as for memories written "
                        "without a type")
    s.add_argument("--as-code", action="store_true",
                   help="beir: read each document as a Python file with the code reader (--format code), e.g. CoSQA")
    s.add_argument("--adapt-on", metavar="SPLIT",
                   help="fit a query adapter on labelled queries never scored and run every system through it: "
                        "BEIR, a qrels split (dev, train); LoCoMo, 'tune' or comma-separated conversations (one "
                        "adapter across them)")
    s.add_argument("--conversations", help="LoCoMo: 'tune', 'heldout' or comma-separated sample ids (default all)")
    s.add_argument("--granularity", choices=("turn", "session"),
                   help="what a document is: LoCoMo, a dialogue turn (default) or a whole session; LongMemEval, "
                        "a session (default) or a turn")
    s.add_argument("--haystack", type=int, default=0, metavar="N",
                   help="LoCoMo: the chosen conversations in one store, every N consecutive sessions of a "
                        "conversation joined into one document (N 3: ~2,000 tokens, as LongMemEval's chat "
                        "sessions); implies --granularity session")
    s.add_argument("--query-context", type=int, default=0, metavar="N",
                   help="LoCoMo: give each question with N turns of its conversation before it (consecutive turns "
                        "of a session holding none of its evidence, drawn per question id); 0: the question alone")
    s.add_argument("--repo", metavar="DIR", help="repo: the repository the questions are about (default: this "
                   "Helix checkout); read from a copy at --commit made under --workdir")
    s.add_argument("--commit", metavar="SHA", help="repo: the commit the questions were written against "
                   "(default 6bbb424, that of tests/fixtures/repo_questions.jsonl)")
    s.add_argument("--ks", default="5,10", help="cut-offs for Recall@k / nDCG@k / MRR@k, comma-separated; each system "
                   "retrieves max(ks) items (BEIR's Recall@100: --ks 5,10,100)")
    s.add_argument("--workdir", default=".helix/eval-stores", help="where the per-corpus stores are built and reused")
    s.add_argument("--json", dest="json_out", help="write the results as JSON to this path: the tables, the paired "
                   "differences and each system's row for every query (metrics, the max(ks) documents ranked)")


def _adapt_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix adapt``: fit or remove the store's query adapter."""
    s = sub.add_parser("adapt", help="fit the store's query adapter from labelled queries (or remove it)")
    s.add_argument("--store", required=True)
    s.add_argument("--pairs", help="JSONL, one labelled query a line: {\"query\": ..., \"user\": ..., "
                                   "\"memory_ids\": [ids it should find]}")
    s.add_argument("--from-feedback", action="store_true",
                   help="use the feedback the store recorded (Memory.feedback, POST /v1/feedback) as the pairs; "
                        "reads the store's database: while `helix serve` runs on it, use POST /v1/admin/adapt instead")
    s.add_argument("--user", dest="users", action="append",
                   help="with --from-feedback: only this user's feedback (repeat for several; default every user's)")
    s.add_argument("--ridge", type=float, help="shrinkage toward the identity (default: chosen by cross-validation)")
    s.add_argument("--force", action="store_true", help="save it even if cross-validation shows no gain")
    s.add_argument("--remove", action="store_true", help="delete the store's adapter (recall uses raw vectors)")
    s.add_argument("--json", action="store_true")


def _compact_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix compact``: fold online writes into the next generation."""
    s = sub.add_parser("compact", help="fold online writes (the inbox and the delta) into the next generation")
    s.add_argument("--store", required=True)
    s.add_argument("--runner", default="local", choices=("ray", "local"))
    s.add_argument("--rebuild", action="store_true",
                   help="rebuild every file with the ingest pipeline, taking in the generation's segments, even when "
                        "the writes would fold into a segment or nothing is pending")
    s.add_argument("--json", action="store_true")
    _verbose_argument(s)


def _demo_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix demo``: the shipped sample set, ingested, served and queried."""
    s = sub.add_parser("demo", help="ingest the shipped sample memory set, serve it and answer a query over HTTP")
    s.add_argument("--store", default=".helix/demo-store")
    s.add_argument("--query", default="why did we choose NATS for the event bus?")
    s.add_argument("--runner", default="ray", choices=("ray", "local"))
    s.add_argument("--in-process", action="store_true",
                   help="answer with helix_ray.Memory in this process instead of through the Serve application")
    _verbose_argument(s)


def _serve_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix serve``: the HTTP API on Ray Serve."""
    s = sub.add_parser("serve", help="serve a store over HTTP (Ray Serve) on 127.0.0.1")
    s.add_argument("--store", required=True,
                   help="store folder; a new one starts empty and takes memories through POST /v1/memories")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--no-auth", action="store_true", help="accept requests without an API key (each names its user)")
    s.add_argument("--graph", choices=("auto", "split", "compact", "inline"), default="auto",
                   help="split: a deployment per stage (Embedder, BM25, DenseANN, Ranker; scales each across a "
                        "cluster); compact: one Pipeline deployment runs them all (one hop); inline: the HTTP "
                        "ingress replicas run them all (no hop: the fastest on one host, see docs/operations.md); "
                        "auto (default): inline on a Ray this command starts, split on a cluster (RAY_ADDRESS)")
    s.add_argument("--ha-proxy", action="store_true",
                   help="Serve's experimental HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1; a faster proxy hop, "
                        "docs/operations.md); only for a Ray this command starts")
    s.add_argument("--ingest-config", help="ingest YAML for online writes and compaction (see configs/ingest.yaml)")
    s.add_argument("--retrieval-config", help="retrieval YAML: the base settings (see configs/retrieval.yaml)")
    s.add_argument("--mirror", metavar="URI", help="push the store there after every change and let recall replicas "
                   "on any node read their node's copy of it (an absolute folder, file://, s3://, gs:// or hdfs:// "
                   "URI; the Writer and the ingress stay on this node; not with --graph inline)")
    s.add_argument("--mirror-cache", metavar="DIR", help="with --mirror: each node's copy goes here (default: under "
                   "the node's temporary folder)")
    _verbose_argument(s)


def _verbose_argument(s: argparse.ArgumentParser) -> None:
    """``-v/--verbose`` of the commands that may start Ray."""
    s.add_argument("-v", "--verbose", action="store_true",
                   help="also show Ray's own output (its INFO lines, its workers' output, Ray Data's plans and "
                        "progress); without it Ray's logs stay in its session folder")


def _keys_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix keys create|list|revoke``: a store's API keys."""
    s = sub.add_parser("keys", help="API keys of a store (each maps to one user)")
    keys = s.add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("create", help="create a key for a user and print it (shown once)")
    k.add_argument("--store", required=True)
    k.add_argument("--user", required=True)
    k.add_argument("--admin", action="store_true",
                   help="may also change the live settings and compact (shared by every user)")
    k.add_argument("--expires", metavar="DURATION",
                   help="valid for this long, then refused: 90d, 12h or 30m (default: until revoked)")
    k = keys.add_parser("list", help="list the keys (ids, users, revoked), never the keys themselves")
    k.add_argument("--store", required=True)
    k = keys.add_parser("revoke", help="revoke a key by its id")
    k.add_argument("key_id")
    k.add_argument("--store", required=True)

def _audit_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix audit``: the store's audit log of admin actions."""
    s = sub.add_parser("audit", help="the store's audit log: each admin action (keys, compaction, settings, "
                                     "adapter, forget-user, backup, restore), who did it and how it ended")
    s.add_argument("--store", required=True)
    s.add_argument("--since", help="ISO-8601 time (UTC without an offset): only records at or after it")
    s.add_argument("--limit", type=int, default=100, help="the newest N records, oldest first (default 100)")
    s.add_argument("--json", action="store_true", help="one JSON record per line, as stored")


def _mcp_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``helix mcp``: the tools for coding agents (Model Context Protocol)."""
    s = sub.add_parser("mcp", help="serve recall/remember/forget to a coding agent over MCP (stdio; "
                          "streamable HTTP with --http)")
    s.add_argument("--store", help="store folder opened in this process (created empty if missing)")
    s.add_argument("--user", help="required with --store: the one user whose memories the tools read and write")
    s.add_argument("--project", help="project that `remember` files memories under when the agent names none")
    s.add_argument("--session", help="session that `remember` files memories under when the agent names none "
                                      "(e.g. the agent's conversation id): recall links a session's memories")
    s.add_argument("--server", metavar="URL", help="a running `helix serve` instead of --store (e.g. http://127.0.0.1:8000)")
    s.add_argument("--key", help="with --server: an API key; its user is the tenant")
    s.add_argument("--http", action="store_true", help="MCP's streamable HTTP transport on 127.0.0.1 instead of stdio")
    s.add_argument("--port", type=int, default=8765, help="with --http (default 8765); the path is /mcp")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("recall", "eval"):
        # The query path multiplies tiny matrices: a second BLAS thread only adds hand-off
        # cost, and much more of it on a busy host (docs/benchmarks.md). Serve replicas get
        # the same from Ray (OMP_NUM_THREADS=1 with fractional CPUs). Must be set before
        # numpy loads; an explicit setting wins.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if getattr(args, "verbose", False):
        from helix_ray.runtime import show_ray_output

        show_ray_output()
    command = {"ingest": _ingest, "recall": _recall, "add": cli_write.add, "delete": cli_write.delete,
               "stats": _stats, "eval": _eval, "demo": cli_serve.demo, "adapt": cli_adapt.adapt,
               "serve": cli_serve.serve, "keys": _keys, "compact": _compact,
               "quarantine": cli_store.quarantine, "doctor": cli_store.doctor, "mcp": _mcp,
               "backup": cli_store.backup, "restore": cli_store.restore,
               "forget-user": cli_store.forget_user, "audit": cli_store.audit}[args.command]
    try:
        code = command(args)
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's flush at exit
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # another pipe or socket: an error like any other
        # The reader went away (`helix stats | head -3`) once the command had done its
        # work: stop quietly, as a Unix tool killed by SIGPIPE does; stdout goes to
        # /dev/null so the exit's flush says nothing.
        cli_store.record(args, 0)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except Exception as exc:  # noqa: BLE001 - the CLI prints a sentence, not a traceback
        from helix_ray.errors import HelixError, InvalidArgument

        if isinstance(exc, InvalidArgument):
            exc = _as_typed(exc, parser, args.command)
        if isinstance(exc, (HelixError, ValueError, FileNotFoundError)):
            cli_store.record(args, 2, str(exc))
            print(f"helix {args.command}: {exc}", file=sys.stderr)
            return 2
        cli_store.record(args, None, f"{type(exc).__name__}: {exc}")
        raise
    cli_store.record(args, code)
    return code


#: Library argument names whose flag is spelled otherwise; the rest are ``--<name>``.
FLAGS = {"budget_tokens": "--budget", "types": "--type", "fmt": "--format", "max_commits": "--max"}


def _as_typed(exc: Any, parser: argparse.ArgumentParser, command: str) -> Any:
    """``exc`` (an InvalidArgument) naming the flag the user typed (``--budget``, not
    ``budget_tokens``), when ``command`` has that flag; else ``exc`` as it is."""
    from helix_ray.errors import InvalidArgument

    flag = FLAGS.get(exc.name, "--" + exc.name.replace("_", "-"))
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if flag not in commands[command]._option_string_actions:
        return exc
    return InvalidArgument(flag, exc.received, exc.allowed, exc.fix)


def _ingest_config(args: argparse.Namespace):
    from helix_ray.config import IngestConfig

    overrides: dict[str, Any] = {}
    if getattr(args, "user", None):
        overrides = {"validation": {"default_user": args.user}}
    return load_config_typed(IngestConfig, getattr(args, "config", None), "--config", overrides,
                             ("--user", getattr(args, "user", None)))


def _ingest(args: argparse.Namespace) -> int:
    from helix_ray.ingest.run import ingest

    report = ingest(args.sources, args.store, fmt=args.format, config=_ingest_config(args), runner=args.runner,
                    show_progress=not args.no_progress and not args.json, since=args.since,
                    max_commits=args.max_commits, repo_name=args.repo_name, doc_name=args.doc_name,
                    mirror=args.mirror)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=str))
    else:
        print(format_report(report))
    if report.accepted == 0:  # exit 1: a script that ingests and then recalls should stop here
        why = (f"all {report.quarantined} records were quarantined; `helix quarantine --store {args.store}` lists "
               "them with their reasons" if report.read else
               "the sources held no records; check the paths and --format")
        if report.read and set(report.quarantine_reasons) == {"missing_user"}:
            why = (f"none of the {report.read} records names its user: pass --user NAME (or give each record a "
                   "user; in a Markdown file, a front matter line `user: NAME`)")
        print(f"helix ingest: accepted nothing: {why}.", file=sys.stderr)
        return 1
    return 0


def _recall(args: argparse.Namespace) -> int:
    """A recall that finds nothing exits 0, with no items and, when the user has no
    memories at all (or the store no generation), a sentence on stderr: an empty answer
    is a true one (a new user's first session), and an agent's hook that recalls before
    every prompt must not fail on it; the sentence still catches a mistyped --user."""
    from helix_ray.config import RetrievalConfig

    existing_store(args.store)
    config = load_config_typed(RetrievalConfig, args.config, "--config") if args.config else None
    # One question: nothing to warm for, and no compaction to start.
    mem = open_memory(args.store, doing="recall from", instead="ask it: `POST /v1/recall` with the user's key "
                      "(docs/http-api.md), or `helix mcp --server URL --key KEY` for an agent",
                      retrieval=config, warm=False, compact_interval_s=None)
    with mem:
        result = mem.recall(args.query, user=args.user, budget_tokens=args.budget, k=args.k, project=args.project,
                            types=args.types, since=args.since, until=args.until, explain=args.explain,
                            now=args.now, context=args.context)
    empty = _nothing_to_recall(result, args.store, args)
    if empty:
        print(f"helix recall: {empty}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.as_dict(), indent=1, default=str))
        return 0
    print(format_result(result))
    if args.explain and result.explain is not None:
        import polars as pl

        table = result.explain
        # A column no candidate has a value in (window_rank without a time window) says nothing here.
        table = table.select([c for c in table.columns if table[c].null_count() < table.height])
        with pl.Config(tbl_rows=200, tbl_cols=20, fmt_str_lengths=24, tbl_width_chars=200):
            print(table)
    return 0


def _nothing_to_recall(result, store: str, args: argparse.Namespace) -> str | None:
    """Why ``result`` could hold nothing whatever the query, or None."""
    if result.items:
        return None
    if result.generation is None:
        return (f"store {store} has no published generation yet, so nothing to recall; "
                f"`helix ingest SOURCE --store {store}` adds memories.")
    if result.flags.get("empty_scope"):
        return (f"user {result.user!r} has no memories in generation {result.generation} of {store}; check --user "
                f"(`helix stats --store {store}` counts each user's memories).")
    narrowed = [f"--{name} {value}" for name, value in (("project", args.project), ("since", args.since),
                                                         ("until", args.until)) if value]
    narrowed += [f"--type {t}" for t in args.types or ()]
    if narrowed:
        return f"no memory of user {result.user!r} matched within {', '.join(narrowed)}; leave them out to search all."
    return None


def _stats(args: argparse.Namespace) -> int:
    existing_store(args.store)
    with open_memory(args.store, doing="read the stats of", instead="ask it: `GET /v1/stats` with a key "
                     "(docs/http-api.md)", record_access=False, warm=False, compact_interval_s=None) as mem:
        stats = mem.stats()
    if args.json:
        print(json.dumps(stats, indent=1, default=str))
    else:
        width = max(map(len, stats))
        for key, value in stats.items():
            print(f"{key:>{width}}: {json.dumps(value, default=str) if isinstance(value, (dict, list)) else value}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import logging

    from helix_ray.eval import LOCOMO_HELDOUT, LOCOMO_TUNE, load_beir, load_locomo, load_longmemeval, load_repo
    from helix_ray.eval.locomo import as_haystack
    from helix_ray.eval.repo import DEFAULT_COMMIT
    from helix_ray.eval.runner import evaluate, format_table

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.query_context and args.dataset != "locomo":
        raise ValueError(f"Got --query-context {args.query_context} with {args.dataset}; only LoCoMo gives the "
                         "turns of a question's conversation. Leave it out.")
    if args.granularity and args.dataset in ("beir", "repo"):
        raise ValueError(f"Got --granularity with {args.dataset}; its documents are what the dataset holds (a corpus "
                         "row, a function or a commit). Leave it out.")
    if args.as_code and args.dataset != "beir":
        raise ValueError(f"Got --as-code with {args.dataset}; it reads the snippets of a BEIR corpus (CoSQA) as code. "
                         "Leave it out.")
    if (args.repo or args.commit) and args.dataset != "repo":
        raise ValueError(f"Got --repo or --commit with {args.dataset}; only `helix eval repo` reads a repository. "
                         "Leave them out.")
    if args.haystack:
        if args.dataset != "locomo" or args.granularity == "turn" or args.haystack < 1:
            raise ValueError(f"Got --haystack {args.haystack} with {args.dataset}"
                             f"{' and --granularity turn' if args.granularity == 'turn' else ''}; it joins LoCoMo "
                             "sessions into long documents: give a count of at least 1, with `helix eval locomo` "
                             "and without --granularity turn.")
        args.granularity = "session"
    if args.dataset == "locomo":
        convs = {"tune": LOCOMO_TUNE, "heldout": LOCOMO_HELDOUT}.get(args.conversations or "", None)
        if convs is None and args.conversations:
            convs = tuple(c.strip() for c in args.conversations.split(","))
        evalset = load_locomo(args.data, conversations=convs, granularity=args.granularity or "turn",
                              query_context=args.query_context)
        if args.haystack:
            evalset = as_haystack(evalset, args.haystack)
    elif args.dataset == "beir":
        evalset = load_beir(args.data, split=args.split)
        if args.as_code:
            from helix_ray.eval.repo import snippets_as_code

            evalset = snippets_as_code(evalset, Path(args.workdir))
    elif args.dataset == "repo":
        evalset = load_repo(args.data, repo=args.repo, commit=args.commit or DEFAULT_COMMIT, workdir=Path(args.workdir))
    else:
        evalset = load_longmemeval(args.data, granularity=args.granularity or "session")
    from helix_ray.eval.runner import DEFAULT_SYSTEMS

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if systems == ["all"]:
        systems = list(DEFAULT_SYSTEMS)
    try:
        ks = tuple(sorted({int(k) for k in args.ks.split(",") if k.strip()}))
    except ValueError:
        ks = ()
    if not ks or ks[0] < 1:
        raise ValueError(f"Got --ks {args.ks!r}; give whole numbers ≥ 1 separated by commas, e.g. 5,10,100.")
    adapt_on = None
    if args.adapt_on and args.dataset == "locomo":
        tune = {"tune": LOCOMO_TUNE}.get(args.adapt_on) or tuple(c.strip() for c in args.adapt_on.split(","))
        overlap = sorted({q.corpus_id for q in evalset.queries} & set(tune))
        if overlap:
            raise ValueError(f"Got --adapt-on {args.adapt_on!r}, which shares conversations {overlap} with the ones "
                             "scored; fit on other conversations (e.g. --conversations heldout --adapt-on tune).")
        adapt_on = load_locomo(args.data, conversations=tune, granularity=args.granularity or "turn")
    elif args.adapt_on:
        if args.dataset != "beir" or args.adapt_on == args.split:
            raise ValueError(f"Got --adapt-on {args.adapt_on!r} with {args.dataset} --split {args.split!r}; it takes "
                             "a BEIR qrels split other than the one scored (e.g. --split test --adapt-on dev), or "
                             "LoCoMo conversations other than the ones scored (--adapt-on tune).")
        adapt_on = load_beir(args.data, split=args.adapt_on)
    report = evaluate(evalset, systems=systems, workdir=Path(args.workdir), ks=ks, depth=max(ks), adapt_on=adapt_on,
                      derive_types=args.types == "derived")
    for corpus, fitted in report.adapters.items():
        print(f"query adapter for {corpus}: {json.dumps(fitted)}")
    print(format_table(report, metrics=("recall@5", "recall@10", "recall_any@5", "ndcg@10", "mrr@10",
                                        *[f"recall@{k}" for k in ks if k > 10])))
    if args.json_out:
        options = {"granularity": args.granularity or {"locomo": "turn", "longmemeval": "session"}.get(args.dataset),
                   "query_context": args.query_context, "haystack": args.haystack or None,
                   "conversations": args.conversations, "split": args.split,
                   "types": args.types, "repo": args.repo, "commit": (args.commit or DEFAULT_COMMIT) if args.dataset == "repo" else None}
        Path(args.json_out).write_text(json.dumps({**report.as_dict(), "options": options}, indent=1))
    return 0


def _compact(args: argparse.Namespace) -> int:
    """Fold the writes a server took into the next generation. With a server running, its
    Writer holds the store (DuckDB has one writer): use POST /v1/admin/compact there."""
    from helix_ray.live.writer import WriterCore

    existing_store(args.store)
    writer = WriterCore(args.store, compact_runner=args.runner)
    try:
        outcome = writer.compact(rebuild=args.rebuild)
    finally:
        writer.db.close()
    print(json.dumps(outcome, indent=1, default=str) if args.json else format_compaction(outcome))
    return 0


def _keys(args: argparse.Namespace) -> int:
    from helix_ray.store.keys import KeyStore, parse_duration

    if not Path(args.store).is_dir():  # a mistyped --store lists no key and has none to revoke
        raise FileNotFoundError(f"Store {args.store} does not exist; create it with `helix ingest SOURCE --store DIR`.")
    keys = KeyStore(args.store)
    if args.keys_command == "create":
        key, record = keys.create(args.user, admin=args.admin,
                                  expires_in=parse_duration(args.expires) if args.expires else None)
        print(key)
        until = f", valid until {record.expires_at}" if record.expires_at else ""
        print(f"({'admin ' if record.admin else ''}key {record.key_id} for user {record.user!r}{until}; only its hash is stored in {keys.path}, "
              "so copy it now. Send it as 'Authorization: Bearer <key>'.)", file=sys.stderr)
    elif args.keys_command == "list":
        if not keys.records():
            print(f"helix keys: store {args.store} has no keys; `helix keys create --store {args.store} --user USER` "
                  "makes one", file=sys.stderr)
        for r in keys.records():
            print(f"{r.key_id}  user={r.user}  created={r.created_at}{'  admin' if r.admin else ''}"
                  f"{f'  expires={r.expires_at}' if r.expires_at else ''}{'  REVOKED' if r.revoked else ''}")
    else:
        record = keys.revoke(args.key_id)
        print(f"revoked key {record.key_id} of user {record.user!r}")
    return 0  # keys made and revoked are recorded in the audit log by the KeyStore


def _mcp(args: argparse.Namespace) -> int:
    import logging

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as for `helix recall`: before numpy loads
    from helix_ray import mcp_server

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="helix mcp: %(message)s")  # stdout: MCP
    backend = mcp_server.open_backend(store=args.store, user=args.user, server=args.server, key=args.key)
    if args.http:
        print(f"helix mcp: MCP (streamable HTTP) for user {backend.user!r} on http://127.0.0.1:{args.port}/mcp; "
              "Ctrl-C stops it", file=sys.stderr, flush=True)
        mcp_server.run_http(backend, project=args.project, session=args.session, port=args.port)
    else:
        mcp_server.run_stdio(backend, project=args.project, session=args.session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
