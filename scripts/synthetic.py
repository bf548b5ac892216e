#!/usr/bin/env python
"""Seeded generator of realistic coding-agent memories, as JSONL rows in Helix's format.

    python scripts/synthetic.py --n 100000 --out /tmp/helix-synth-100k.jsonl --seed 0

Each row is ``{"id", "text", "user", "project", "session_id", "created_at", "type"?,
"source"}`` (``type`` is left out of ~25% of rows so ingest derives it, as it would for
an agent that does not label its memories).

What makes it realistic enough for benchmarks:

- **Vocabulary.** A few thousand identifiers built from the seed: ``snake_case``
  functions, ``CamelCase`` classes, file paths (py/go/ts/rs/yaml/sql/sh...), ``ENV_VARS``,
  dotted config keys, service names, error classes with exact messages, real tool and
  library names, teammates. Each project draws a working set from it (a Zipf-weighted
  subset), so identifiers repeat within a tenant the way they do in a real codebase and
  BM25 sees realistic document frequencies.
- **Templates.** Decisions, error messages with exact strings, file-path facts, how-tos
  with steps and commands, dated events, preferences, plain facts and a few code snippets.
- **Lengths.** 10–120 words, log-normal (median ~28 words): a template plus elaboration
  sentences that reuse the session's topic.
- **Sessions.** 5–40 memories each, on one project and one topic (a few files/functions),
  minutes apart, so temporal and entity edges mean something.
- **Time.** Sessions spread over two years (2024-01-01 .. 2025-12-31).
- **Tenants.** Zipf-sized users: by default ``round(40 * sqrt(n / 100k))`` users with
  exponent 1.05, so 100k rows give 40 users, the largest ~25k memories, the smallest ~500.

``derive_text`` perturbs a text (numbers, one or two identifiers, a sentence), which
``scripts/bench_recall.py`` uses to build large stores from a smaller embedded base.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from synthetic_words import (
    NOUNS,
    VERBS,
    CLASS_SUFFIX,
    TOOLS,
    LANGS,
    FIRST_NAMES,
    PROJECT_NAMES,
    ERROR_BASES,
    STDLIB_ERRORS,
    GENERIC_REASONS,
    FILLER,
    STYLE_PREFS,
    VAGUE,
)

_NUM_RE = re.compile(r"\b\d+\b")
MAX_WORDS = 120


def _weighted_index(rng: random.Random, n: int, s: float = 1.1) -> int:
    """Zipf-ish index in [0, n): low indexes far more likely (a working set's hot items)."""
    u = rng.random()
    # inverse CDF of a continuous power law on [1, n+1)
    if abs(s - 1.0) < 1e-9:
        x = math.exp(u * math.log(n + 1))
    else:
        a = 1.0 - s
        x = (1.0 + u * ((n + 1) ** a - 1.0)) ** (1.0 / a)
    return min(n - 1, max(0, int(x) - 1))


# ----------------------------------------------------------------------------- vocabulary


@dataclass
class Vocab:
    functions: list[str]
    classes: list[str]
    services: list[str]
    paths: list[str]
    test_paths: list[str]
    envs: list[str]
    config_keys: list[str]
    errors: list[tuple[str, str]]  # (class, message template)
    modules: list[str]
    tools: list[str]
    people: list[str]
    routes: list[str]
    make_targets: list[str]

    def size(self) -> int:
        return sum(len(v) for v in (self.functions, self.classes, self.services, self.paths, self.test_paths,
                                    self.envs, self.config_keys, self.errors, self.modules, self.tools,
                                    self.people, self.routes, self.make_targets))


def build_vocab(seed: int) -> Vocab:
    rng = random.Random(f"vocab-{seed}")

    def uniq(make, count: int) -> list:
        out: dict = {}
        tries = 0
        while len(out) < count and tries < count * 50:
            out.setdefault(make(), None)
            tries += 1
        return list(out)

    functions = uniq(lambda: "_".join([rng.choice(VERBS)] + rng.sample(NOUNS, rng.choice((1, 1, 2)))), 1500)
    classes = uniq(lambda: "".join(w.capitalize().replace("_", "") for w in rng.sample(NOUNS, rng.choice((1, 2))))
                   + rng.choice(CLASS_SUFFIX), 600)
    services = uniq(lambda: f"{rng.choice(NOUNS).replace('_', '-')}-{rng.choice(['api', 'worker', 'service', 'gateway', 'indexer', 'scheduler', 'sync', 'web', 'cli', 'proxy'])}", 120)
    modules = uniq(lambda: ".".join([rng.choice(PROJECT_NAMES)] + [rng.choice(NOUNS) for _ in range(rng.choice((1, 2)))]), 300)
    ext = ["py"] * 6 + ["go", "go", "ts", "ts", "tsx", "rs", "yaml", "yml", "toml", "sql", "sh", "json", "proto", "md"]

    def a_path() -> str:
        root = rng.choice(["services", "src", "lib", "pkg", "apps", "internal", "deploy", "infra", "scripts", "migrations"])
        depth = rng.choice((1, 2, 2, 3))
        parts = [root] + [rng.choice(NOUNS) for _ in range(depth - 1)]
        return "/".join(parts) + "/" + "_".join(rng.sample(NOUNS, rng.choice((1, 2)))) + "." + rng.choice(ext)

    paths = uniq(a_path, 1800)
    test_paths = uniq(lambda: f"tests/{rng.choice(['unit', 'integration', 'e2e'])}/test_{'_'.join(rng.sample(NOUNS, rng.choice((1, 2))))}.py", 400)
    envs = uniq(lambda: "_".join(w.upper() for w in [rng.choice(NOUNS + PROJECT_NAMES)] + rng.sample(NOUNS, rng.choice((1, 2))))
                + rng.choice(["", "_URL", "_TIMEOUT", "_MAX", "_ENABLED", "_PATH", "_TOKEN", "_SIZE"]), 350)
    config_keys = uniq(lambda: ".".join([rng.choice(NOUNS)] + [rng.choice(NOUNS) for _ in range(rng.choice((0, 1)))]
                                        + [rng.choice(["max_" + rng.choice(NOUNS) + "s", rng.choice(NOUNS) + "_timeout_ms",
                                                       "batch_size", "enabled", rng.choice(NOUNS) + "_ttl", "retries", "workers",
                                                       "pool_size", "threshold"])]), 450)
    custom_errors = uniq(lambda: (rng.choice(ERROR_BASES) + rng.choice(["Error", "Error", "Exception", "Timeout", "Warning"]),
                                  rng.choice(["{noun} {noun2} failed: {reason_short}", "cannot {verb} {noun}: {reason_short}",
                                              "{noun} not found for id {n}", "expected {n} rows, got {n2}",
                                              "{noun} is stale (version {n} < {n2})", "lock on {noun} held by {svc}"])), 140)
    errors = STDLIB_ERRORS + custom_errors
    people = list(FIRST_NAMES)
    routes = uniq(lambda: "/" + "/".join(rng.sample(NOUNS, rng.choice((1, 2, 3)))) + rng.choice(["", "", "/{id}", "/batch"]), 250)
    make_targets = uniq(lambda: rng.choice(VERBS) + rng.choice(["", "-" + rng.choice(NOUNS)]), 60)
    return Vocab(functions, classes, services, paths, test_paths, envs, config_keys, errors, modules,
                 list(TOOLS), people, routes, make_targets)


@dataclass
class Project:
    name: str
    lang: str
    functions: list[str]
    classes: list[str]
    services: list[str]
    paths: list[str]
    test_paths: list[str]
    envs: list[str]
    config_keys: list[str]
    errors: list[tuple[str, str]]
    modules: list[str]
    tools: list[str]
    people: list[str]
    routes: list[str]
    make_targets: list[str]


def make_project(rng: random.Random, vocab: Vocab, name: str) -> Project:
    def pick(items: list, k: int) -> list:
        return rng.sample(items, min(k, len(items)))

    return Project(
        name=name, lang=rng.choice(LANGS),
        functions=pick(vocab.functions, 160), classes=pick(vocab.classes, 60), services=pick(vocab.services, 8),
        paths=pick(vocab.paths, 140), test_paths=pick(vocab.test_paths, 40), envs=pick(vocab.envs, 30),
        config_keys=pick(vocab.config_keys, 40), errors=pick(vocab.errors, 30), modules=pick(vocab.modules, 20),
        tools=pick(vocab.tools, 14), people=pick(vocab.people, 8), routes=pick(vocab.routes, 25),
        make_targets=pick(vocab.make_targets, 8),
    )


# ----------------------------------------------------------------------------- text


@dataclass
class Topic:
    """What one session is about: a hot subset of the project's working set."""

    project: Project
    functions: list[str]
    paths: list[str]
    classes: list[str]
    service: str
    error: tuple[str, str]
    env: str
    config_key: str
    tool: str
    when: dt.datetime = field(default_factory=lambda: dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc))


class Writer:
    """Fills templates for one project/topic. All randomness comes from ``rng``."""

    def __init__(self, rng: random.Random, topic: Topic):
        self.rng = rng
        self.t = topic
        self.p = topic.project

    # -- slot fillers: mostly the session topic, sometimes anything in the project
    def _hot(self, hot: list[str], pool: list[str]) -> str:
        return self.rng.choice(hot) if hot and self.rng.random() < 0.6 else pool[_weighted_index(self.rng, len(pool))]

    def func(self) -> str:
        return self._hot(self.t.functions, self.p.functions)

    def path(self) -> str:
        return self._hot(self.t.paths, self.p.paths)

    def cls(self) -> str:
        return self._hot(self.t.classes, self.p.classes)

    def svc(self) -> str:
        return self.t.service if self.rng.random() < 0.6 else self.rng.choice(self.p.services)

    def env(self) -> str:
        return self.t.env if self.rng.random() < 0.5 else self.rng.choice(self.p.envs)

    def key(self) -> str:
        return self.t.config_key if self.rng.random() < 0.5 else self.rng.choice(self.p.config_keys)

    def tool(self) -> str:
        return self.t.tool if self.rng.random() < 0.4 else self.rng.choice(self.p.tools)

    def person(self) -> str:
        return self.rng.choice(self.p.people)

    def noun(self) -> str:
        return self.rng.choice(NOUNS).replace("_", " ")

    def ver(self) -> str:
        r = self.rng
        return f"{r.randint(0, 4)}.{r.randint(0, 30)}.{r.randint(0, 12)}"

    def date_text(self) -> str:
        d = self.t.when + dt.timedelta(days=-self.rng.randint(0, 20))
        return d.strftime("%Y-%m-%d") if self.rng.random() < 0.6 else d.strftime("%B %-d")

    def error(self) -> tuple[str, str]:
        cls, msg = self.t.error if self.rng.random() < 0.6 else self.rng.choice(self.p.errors)
        return cls, self.fill(msg)

    def fill(self, template: str) -> str:
        r = self.rng
        values = {
            "noun": self.noun(), "noun2": self.noun(), "verb": r.choice(VERBS), "n": r.randint(2, 90),
            "n2": r.randint(100, 9000), "port": r.choice([5432, 6379, 8080, 8000, 9092, 3000, 9200, 4317, 8443, 5672]),
            "path": self.path(), "path2": self.path(), "module": r.choice(self.p.modules), "svc": self.svc(),
            "hexb": f"{r.randint(128, 255):x}", "reason_short": r.choice(["timeout", "permission denied", "bad state", "missing field", "checksum mismatch"]),
            "person": self.person(), "pr": r.randint(100, 4999), "test_path": r.choice(self.p.test_paths),
            "env": self.env(), "ticket": f"{self.p.name.upper()[:4]}-{r.randint(10, 2999)}", "config_key": self.key(),
            "project": self.p.name, "tool": self.tool(), "ver": self.ver(), "func": self.func(), "class_": self.cls(),
            "lang": self.p.lang, "test_func": "test_" + r.choice(self.p.functions),
        }
        return template.format(**values)

    # -- templates: each returns (text, type)
    def decision(self) -> tuple[str, str]:
        r = self.rng
        reason = self.fill(r.choice(GENERIC_REASONS))
        a, b = r.sample(self.p.tools + TOOLS[:10], 2)
        options = [
            f"We decided to use {a} instead of {b} for the {self.noun()} {self.noun()} in {self.svc()} because {reason}.",
            f"Decision: {self.key()} stays at {r.choice([8, 16, 32, 64, 128, 256, 500, 1000])} for {self.svc()}; {reason}.",
            f"The team agreed to move {self.func()}() out of {self.path()} into {self.path()} since {reason}.",
            f"We went with {a} for {self.noun()} storage after trying {b}; {reason}.",
            f"Decided to keep {self.cls()} synchronous for now: {reason}.",
            f"{self.person()} and I settled on retrying {self.func()} at most {r.randint(2, 6)} times with jitter because {reason}.",
            f"We chose to pin {a} to {self.ver()} in {self.p.name} until {b} supports it; {reason}.",
        ]
        return r.choice(options), "decision"

    def error_msg(self) -> tuple[str, str]:
        r = self.rng
        cls, msg = self.error()
        err = f"{cls}: {msg}" if msg else cls
        fix = r.choice([f"adding a timeout to {self.func()}()", f"setting {self.env()}={r.choice(['1', 'true', '30', '0'])}",
                        f"pinning {self.tool()} to {self.ver()}", f"reordering the imports in {self.path()}",
                        f"raising {self.key()}", "clearing the stale lock file", f"retrying inside {self.cls()}",
                        f"running `make {r.choice(self.p.make_targets)}` first"])
        options = [
            (f"{self.path()}:{r.randint(12, 880)} raised {err} when calling {self.func()}(); fixed by {fix}.", "code"),
            (f"`{r.choice(['make ' + r.choice(self.p.make_targets), 'pytest ' + r.choice(self.p.test_paths), 'docker compose up ' + self.svc(), 'python -m ' + r.choice(self.p.modules)])}` "
             f"failed with exit code {r.choice([1, 2, 127, 137, 139])}: {err}", "code"),
            (f"Got HTTP {r.choice([500, 502, 503, 504, 429, 401, 409])} from {self.svc()} {r.choice(self.p.routes)} after "
             f"{r.randint(2, 60)}s; the logs showed {err}. The fix was {fix}.", "episodic"),
            (f"If you see \"{err}\" in {self.svc()}, it means {self.fill(r.choice(['the {noun} cache is cold', 'the {noun} table is locked', '{env} is unset', 'the {noun} worker died']))}; {fix} resolves it.", "semantic"),
            (f"Traceback ends in {self.func()}: {err}. Happens only with {self.tool()} {self.ver()}.", "code"),
        ]
        return r.choice(options)

    def path_fact(self) -> tuple[str, str]:
        r = self.rng
        options = [
            f"{self.cls()} lives in {self.path()}; {self.func()}() is the entry point and reads {self.env()}.",
            f"The config for {self.svc()} is in {self.path()} under the key {self.key()}.",
            f"{self.func()}() is defined in {self.path()} and wraps {self.cls()}.",
            f"Migrations for the {self.noun()} table are in {self.path()}; run them before starting {self.svc()}.",
            f"The {self.noun()} fixtures used by {r.choice(self.p.test_paths)} come from {self.path()}.",
        ]
        return r.choice(options), "code"

    def howto(self) -> tuple[str, str]:
        r = self.rng
        noun = self.noun()
        cmd1 = r.choice([f"make {r.choice(self.p.make_targets)}", f"python -m {r.choice(self.p.modules)} --{r.choice(VERBS)}",
                         f"kubectl rollout restart deploy/{self.svc()}", f"docker compose up -d {self.svc()}",
                         f"pytest {r.choice(self.p.test_paths)} -x"])
        options = [
            f"How to {r.choice(VERBS)} the {noun} {self.noun()}: 1) run `{cmd1}` 2) set {self.env()}={r.choice(['1', 'true', '300'])} 3) restart {self.svc()}.",
            f"To rebuild the {noun} index, run `{cmd1}` and then call {self.func()}() from a shell.",
            f"Steps to rotate {self.env()}: update it in vault, redeploy {self.svc()}, then check {r.choice(self.p.routes)} returns 200.",
            f"To debug {self.cls()} locally, export {self.env()}=debug and run `{cmd1}`.",
            f"- stop {self.svc()}\n- run `{cmd1}`\n- verify with {self.func()}()",
        ]
        return r.choice(options), "procedural"

    def event(self) -> tuple[str, str]:
        r = self.rng
        d = self.date_text()
        options = [
            f"On {d} we deployed {self.svc()} {self.ver()} and {r.choice(['error rates doubled for an hour', 'latency improved', 'the cache hit rate fell', 'nothing broke', 'had to roll back'])}.",
            f"{d}: {self.person()} rotated {self.env()} after the {self.noun()} incident.",
            f"Outage on {d}: {self.svc()} ran out of {r.choice(['connections', 'memory', 'disk', 'file descriptors'])} and {self.func()} kept retrying.",
            f"Released {self.p.name} {self.ver()} on {d} with the new {self.cls()}.",
            f"{self.person()} started on {self.p.name} on {d} and owns {self.svc()} now.",
        ]
        return r.choice(options), "episodic"

    def preference(self) -> tuple[str, str]:
        r = self.rng
        a, b = r.sample(self.p.tools + TOOLS, 2)
        options = [
            f"{self.person()} prefers {r.choice(STYLE_PREFS)} in {self.p.lang} code.",
            f"User prefers {a} over {b} for {self.noun()} work; always {r.choice(STYLE_PREFS)}.",
            f"Never commit directly to main in {self.p.name}; the user wants {r.choice(STYLE_PREFS)}.",
            f"The user likes answers with {r.choice(['short code first', 'the command to run', 'a diff', 'links to the file'])} and {r.choice(STYLE_PREFS)}.",
        ]
        return r.choice(options), "semantic"

    def fact(self) -> tuple[str, str]:
        r = self.rng
        options = [
            f"{self.svc()} listens on port {r.choice([8080, 8000, 9000, 3000, 50051, 8443, 7000])} and talks to {self.tool()} at {self.noun().replace(' ', '-')}.internal.",
            f"{self.cls()} caches {self.noun()} results for {r.randint(1, 90)} minutes in {self.tool()}.",
            f"{self.svc()} is owned by {self.person()}; escalations go to the {self.p.name} channel.",
            f"The {self.noun()} table has about {r.randint(2, 900)} million rows and is partitioned by {self.noun()}.",
            f"{self.func()} is not thread-safe because it mutates the shared {self.cls()}.",
            f"Default {self.key()} is {r.choice([10, 30, 100, 250, 1000])}; production overrides it with {self.env()}.",
        ]
        return r.choice(options), "semantic"

    def code(self) -> tuple[str, str]:
        r = self.rng
        f = self.func()
        snippet = r.choice([
            f"```python\nresult = {f}({self.noun().replace(' ', '_')}_id, timeout={r.randint(1, 60)})\n```",
            f"```bash\n{self.env()}=1 make {r.choice(self.p.make_targets)}\n```",
            f"```sql\nCREATE INDEX ON {self.noun().replace(' ', '_')} ({self.noun().replace(' ', '_')}_id);\n```",
        ])
        return f"Snippet that fixed {self.cls()}:\n{snippet}", "code"

    KINDS = ("decision", "error_msg", "path_fact", "howto", "event", "preference", "fact", "code")
    KIND_WEIGHTS = (0.14, 0.20, 0.14, 0.13, 0.14, 0.07, 0.14, 0.04)

    def memory(self, target_words: int) -> tuple[str, str]:
        kind = self.rng.choices(self.KINDS, self.KIND_WEIGHTS)[0]
        text, mem_type = getattr(self, kind)()
        words = len(text.split())
        extra = []
        fillers = self.rng.sample(FILLER, len(FILLER))  # no sentence twice in one memory
        while words < target_words and fillers:
            sentence = self.fill(fillers.pop())
            if words + len(sentence.split()) > MAX_WORDS:
                break
            extra.append(sentence)
            words += len(sentence.split())
        if extra:
            text = text + " " + " ".join(extra)
        return text, mem_type


def derive_text(rng: random.Random, text: str, topic_words: list[str]) -> str:
    """A variant of ``text``: new numbers, one or two words swapped for ``topic_words``,
    and sometimes a sentence dropped or added. Close in meaning, different in detail."""
    out = _NUM_RE.sub(lambda m: str(rng.randint(1, 999)) if rng.random() < 0.7 else m.group(0), text)
    words = out.split(" ")
    for _ in range(rng.choice((1, 1, 2, 3))):
        if len(words) > 4 and topic_words:
            i = rng.randrange(len(words))
            if "\n" not in words[i] and "`" not in words[i]:
                words[i] = rng.choice(topic_words)
    out = " ".join(words)
    sentences = out.split(". ")
    if len(sentences) > 2 and rng.random() < 0.4:
        del sentences[rng.randrange(1, len(sentences))]
        out = ". ".join(sentences)
    if rng.random() < 0.3:
        out += " " + rng.choice(["Still true as of the last check.", "Worth double-checking before relying on it.",
                                 "Confirmed again today.", "This came up twice this month."])
    return out


# ----------------------------------------------------------------------------- corpus layout


def tenant_sizes(n: int, users: int, zipf: float) -> list[int]:
    """Zipf-like tenant sizes summing to n, each at least 5 (one session)."""
    users = max(1, min(users, n // 5 or 1))
    weights = [1.0 / (i + 1) ** zipf for i in range(users)]
    total = sum(weights)
    sizes = [max(5, int(round(n * w / total))) for w in weights]
    diff = n - sum(sizes)
    i = 0
    while diff != 0:  # settle rounding on the largest tenants
        step = 1 if diff > 0 else -1
        if sizes[i % users] + step >= 5:
            sizes[i % users] += step
            diff -= step
        i += 1
    return sizes


def default_users(n: int) -> int:
    return max(1, round(40 * math.sqrt(n / 100_000)))


def session_sizes(rng: random.Random, total: int) -> list[int]:
    sizes = []
    left = total
    while left > 0:
        s = int(min(40, max(5, round(rng.lognormvariate(math.log(14), 0.55)))))
        if left - s < 5:
            s = left if left <= 40 else left - 5
        sizes.append(s)
        left -= s
    return sizes


START = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
SPAN_DAYS = 730


class Corpus:
    """The whole synthetic corpus: tenants, their projects, sessions and memories."""

    def __init__(self, n: int, *, seed: int = 0, users: int | None = None, zipf: float = 1.05,
                 median_words: float = 28.0, words_sigma: float = 0.65):
        self.n, self.seed = n, seed
        self.vocab = build_vocab(seed)
        self.sizes = tenant_sizes(n, users or default_users(n), zipf)
        self.median_words, self.words_sigma = median_words, words_sigma

    def target_words(self, rng: random.Random) -> int:
        return int(min(MAX_WORDS, max(10, round(rng.lognormvariate(math.log(self.median_words), self.words_sigma)))))

    def skeleton(self) -> Iterator[tuple[dict[str, Any], Writer]]:
        """(row without text/type, the session's writer), tenant by tenant, in time order."""
        rng = random.Random(f"corpus-{self.seed}")
        counter = 0
        for u, size in enumerate(self.sizes):
            user = f"user-{u:03d}"
            projects = [make_project(rng, self.vocab, f"{rng.choice(PROJECT_NAMES)}-{rng.randint(1, 99)}")
                        for _ in range(rng.randint(1, 6))]
            sizes = session_sizes(rng, size)
            starts = sorted(START + dt.timedelta(seconds=rng.uniform(0, SPAN_DAYS * 86400)) for _ in sizes)
            for s_no, (s_size, when) in enumerate(zip(sizes, starts)):
                project = projects[_weighted_index(rng, len(projects), 1.3)]
                topic = Topic(
                    project=project, functions=rng.sample(project.functions, 3), paths=rng.sample(project.paths, 3),
                    classes=rng.sample(project.classes, 2), service=rng.choice(project.services),
                    error=rng.choice(project.errors), env=rng.choice(project.envs),
                    config_key=rng.choice(project.config_keys), tool=rng.choice(project.tools), when=when,
                )
                writer = Writer(rng, topic)
                session_id = f"{user}:s{s_no:05d}"
                t = when
                for _ in range(s_size):
                    t = t + dt.timedelta(seconds=rng.randint(20, 1200))
                    row = {
                        "id": f"syn{self.seed}-{counter:08d}",
                        "user": user,
                        "project": project.name,
                        "session_id": session_id,
                        "created_at": t.strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "source": "agent",
                    }
                    counter += 1
                    yield row, writer

    def rows(self) -> Iterator[dict[str, Any]]:
        for row, writer in self.skeleton():
            text, mem_type = writer.memory(self.target_words(writer.rng))
            row["text"] = text
            if writer.rng.random() < 0.75:
                row["type"] = mem_type
            yield row


def write_jsonl(n: int, out: str, *, seed: int = 0, users: int | None = None, zipf: float = 1.05) -> dict[str, Any]:
    corpus = Corpus(n, seed=seed, users=users, zipf=zipf)
    words = []
    with open(out, "w", encoding="utf-8") as fh:
        for row in corpus.rows():
            words.append(len(row["text"].split()))
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    words.sort()
    return {
        "rows": n, "users": len(corpus.sizes), "largest_tenant": max(corpus.sizes), "smallest_tenant": min(corpus.sizes),
        "vocab_items": corpus.vocab.size(),
        "words_p10_p50_p90_max": [words[len(words) // 10], words[len(words) // 2], words[len(words) * 9 // 10], words[-1]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="memories to write")
    ap.add_argument("--out", required=True, help="output JSONL path (keep it out of the repo)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=None, help="tenants (default round(40*sqrt(n/100k)))")
    ap.add_argument("--zipf", type=float, default=1.05, help="tenant-size Zipf exponent")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    stats = write_jsonl(args.n, args.out, seed=args.seed, users=args.users, zipf=args.zipf)
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
