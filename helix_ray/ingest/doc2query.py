"""Stage 4: doc2query expansion — text a memory should also be found by.

Expansions go into the lexical (BM25) index beside the memory's text; they are not
embedded. Two backends behind one interface:

- :class:`OfflineExpander` (default, no model): keyphrases (the memory's rarest content
  words by a within-batch IDF, plus its entities: identifiers, paths, error strings),
  and question templates chosen by memory type, so the words a question uses ("why",
  "how", "fix", "error", "when") meet the memories that answer such questions.
- :class:`LLMExpander`: asks an OpenAI-compatible ``/v1/chat/completions`` endpoint for
  questions the memory answers. Used only when configured.
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.request
from collections import Counter
from typing import Protocol, Sequence

from helix_ray.config import Doc2QueryConfig
from helix_ray.ingest import entities

log = logging.getLogger(__name__)

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_'-]{2,}")
_STOP = frozenset(
    """the and for that this with from have has had was were are been being you your our
    not but can will would should could they them their there then than into onto over
    about after before when what which who whom why how its it's also just very more most
    some such only other any each all both few many much own same too out off again once
    here where while because does did doing done yes yeah okay really like get got going""".split()
)

TEMPLATES = {
    "decision": ["why did we choose {k}", "what did we decide about {k}", "reason for {k}"],
    "procedural": ["how to {k}", "steps for {k}", "how do I {k}"],
    "code": ["where is {k}", "what does {k} do", "fix error {k}"],
    "episodic": ["when did {k} happen", "what happened with {k}"],
    "semantic": ["what is {k}", "tell me about {k}"],
}


class Expander(Protocol):
    name: str

    def expand(self, texts: Sequence[str], types: Sequence[str]) -> list[list[str]]: ...


class OfflineExpander:
    name = "offline"

    def __init__(self, max_queries: int = 6):
        self.max_queries = max_queries

    def expand(self, texts: Sequence[str], types: Sequence[str]) -> list[list[str]]:
        words_per_doc = [[w.lower() for w in _WORD.findall(t)] for t in texts]
        df: Counter[str] = Counter()
        for words in words_per_doc:
            df.update(set(words))
        n = max(1, len(texts))
        out = []
        for text, mem_type, words in zip(texts, types, words_per_doc):
            content = [w for w in dict.fromkeys(words) if w not in _STOP]
            content.sort(key=lambda w: (-math.log((n + 1) / (df[w] + 0.5)), words.index(w)))
            keys = [e.split(":", 1)[1] for e in entities.extract(text) if not e.startswith(("date:", "url:"))][:3]
            keyphrase = " ".join(content[:3])
            topics = list(dict.fromkeys(keys + ([keyphrase] if keyphrase else [])))
            queries: list[str] = []
            for topic in topics:
                for template in TEMPLATES.get(mem_type, TEMPLATES["semantic"]):
                    queries.append(template.format(k=topic))
                    if len(queries) >= self.max_queries:
                        break
                if len(queries) >= self.max_queries:
                    break
            if self.max_queries and content:
                queries.append(" ".join(content[:8]))
            out.append(queries)
        return out


class LLMExpander:
    """Questions from an OpenAI-compatible endpoint; one request per memory."""

    name = "llm"

    def __init__(self, config: Doc2QueryConfig):
        if not config.llm_base_url:
            raise ValueError(
                "Got doc2query.backend='llm' without doc2query.llm_base_url; set it to an "
                "OpenAI-compatible endpoint such as http://127.0.0.1:8080/v1, or use backend 'offline'."
            )
        self.config = config

    def _ask(self, text: str) -> list[str]:
        body = {
            "model": self.config.llm_model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": "You write search queries. Answer with a JSON list of strings only."},
                {
                    "role": "user",
                    "content": f"Write {self.config.max_queries} short questions a developer might ask "
                    f"that this memory answers:\n\n{text}",
                },
            ],
        }
        assert self.config.llm_base_url  # __init__ refused a config without one
        request = urllib.request.Request(
            self.config.llm_base_url.rstrip("/") + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=self.config.llm_timeout_s) as response:
            payload = json.loads(response.read())
        content = payload["choices"][0]["message"]["content"]
        match = re.search(r"\[.*\]", content, re.S)
        items = json.loads(match.group(0)) if match else content.splitlines()
        return [str(q).strip() for q in items if str(q).strip()][: self.config.max_queries]

    def expand(self, texts: Sequence[str], types: Sequence[str]) -> list[list[str]]:
        return [self._ask(t) for t in texts]


class NoExpander:
    name = "none"

    def expand(self, texts: Sequence[str], types: Sequence[str]) -> list[list[str]]:
        return [[] for _ in texts]


def make_expander(config: Doc2QueryConfig) -> Expander:
    if config.backend == "llm":
        return LLMExpander(config)
    if config.backend == "none" or config.max_queries == 0:
        return NoExpander()
    return OfflineExpander(config.max_queries)
