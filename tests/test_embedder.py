"""The encoders' model calls: how many texts each takes."""

from __future__ import annotations

import numpy as np

from helix_ray.config import EmbedderConfig
from helix_ray.embedder import FastEmbedder, length_batches
from helix_ray.token_encoder import BATCH_TOKENS, get_token_encoder


def test_length_batches_cap_texts_and_padded_characters():
    lengths = [10, 10, 20, 30, 40, 400, 900, 5_000]
    parts = length_batches(lengths, max_texts=3, max_chars=100)
    assert parts == [slice(0, 3), slice(3, 5), slice(5, 6), slice(6, 7), slice(7, 8)]
    for part in parts:  # each within both limits, or a single text longer than the budget
        size = part.stop - part.start
        assert size <= 3 and (size * lengths[part.stop - 1] <= 100 or size == 1)
    assert length_batches([], 3, 100) == []
    assert length_batches([5] * 7, 3, 1_000) == [slice(0, 3), slice(3, 6), slice(6, 7)]


TOPICS = ["the cat sat on the warm mat", "stock prices fell sharply on monday",
          "a recipe for lemon cake with butter", "the rocket launched towards the moon",
          "tax forms are due in april", "the violin concerto opened the concert", "rain flooded the old bridge"]


def test_long_texts_go_fewer_to_a_call_and_keep_their_order():
    embedder = FastEmbedder(EmbedderConfig(batch_size=8, batch_chars=2_400))
    calls: list[list[int]] = []
    model = embedder._model

    class Spy:
        def passage_embed(self, texts, batch_size):
            calls.append([len(t) for t in texts])
            assert batch_size == len(texts)  # one model call each
            return model.passage_embed(texts, batch_size=batch_size)

    embedder._model = Spy()
    texts = [" ".join([topic] * n) for topic, n in zip(TOPICS, [1, 40, 2, 70, 9, 1, 30])]
    vectors = embedder.embed_passages(texts)
    assert sorted(min(len(t), 2_000) for t in texts) == [n for call in calls for n in call]  # cut at max_chars
    assert all(len(call) * max(call) <= 2_400 or len(call) == 1 for call in calls)
    assert len(calls) > 1 and max(len(call) for call in calls) > 1
    embedder._model = model
    one_by_one = np.stack([embedder.embed_passages([t])[0] for t in texts])
    similar = vectors @ one_by_one.T
    assert np.all(np.diag(similar) > 0.99)  # each text's own vector, in input order
    assert np.all(similar[~np.eye(len(texts), dtype=bool)] < 0.9)


def test_long_passages_go_fewer_to_a_token_encoder_call():
    encoder = get_token_encoder()
    texts = [" ".join([topic] * n) for topic, n in zip(TOPICS * 6, [1, 40, 2, 70, 9, 1, 30] * 6)]
    alone = [encoder.encode_passages([t])[0] for t in texts]
    shapes: list[tuple[int, int]] = []
    run = encoder._run

    def spy(ids, attention):
        shapes.append(ids.shape)
        return run(ids, attention)

    encoder._run = spy  # type: ignore[method-assign]
    try:
        together = encoder.encode_passages(texts)
    finally:
        del encoder._run
    assert sum(rows for rows, _ in shapes) == len(texts)
    assert all(rows * width <= BATCH_TOKENS or rows == 1 for rows, width in shapes)
    assert max(rows for rows, _ in shapes) == encoder.batch_size  # short passages still fill a call
    assert min(rows for rows, _ in shapes) < encoder.batch_size
    for a, b in zip(together, alone):  # each passage's own tokens, in input order
        assert a.shape == b.shape and float(np.mean(np.sum(a * b, axis=1))) > 0.99
