"""Stage 6, the multi-signal ranking, on hand-made pools: what ``rank.reweigh_silent``
changes between memory types, and what it leaves alone within one type; how a code
memory shares its container's score."""

from __future__ import annotations

import numpy as np

from helix_ray.config import RankConfig
from helix_ray.recall.rank import rank, support_from_containers

NOW_US = 1_750_000_000 * 1_000_000


def _rank(types: list[str], cosine: list[float], *, reweigh: bool, last_access_us: list[int] | None = None,
          salience: list[float] | None = None, confidence: float = 0.8, boost: list[float] | None = None):
    n = len(types)
    return rank(
        types=np.array(types), cosine=np.array(cosine), fused=np.array(cosine),
        last_access_us=np.array(last_access_us or [0] * n, dtype=np.int64),
        salience=np.array(salience or [0.5] * n), confidence=np.full(n, confidence), graph=np.zeros(n),
        projects=np.array([""] * n), pinned=np.zeros(n, dtype=bool), now_us=NOW_US,
        config=RankConfig(reweigh_silent=reweigh), boost=None if boost is None else np.array(boost),
    )


def test_a_signal_no_candidate_has_no_longer_favours_a_type():
    # A commit a hair closer to the query than a function; nothing was ever recalled,
    # linked, or given salience or confidence: only similarity speaks.
    types, cosine, none = ["decision", "code", "episodic"], [0.81, 0.80, 0.10], [0.0] * 3
    kept = _rank(types, cosine, reweigh=False, salience=none, confidence=0.0)
    assert kept.order[0] == 1  # code's row gives similarity .50 against the commit's .35
    reweighed = _rank(types, cosine, reweigh=True, salience=none, confidence=0.0)
    assert reweighed.order[0] == 0  # both rows now give similarity their whole weight
    assert np.isclose(reweighed.scores[0], sum(RankConfig().type_weights["decision"].model_dump().values()))


def test_each_row_is_rescaled_over_the_signals_that_speak():
    # One commit was recalled an hour ago, so recency speaks; graph does not.
    types, cosine = ["decision", "code", "episodic"], [0.80, 0.80, 0.10]
    hour = 3_600 * 1_000_000
    reweighed = _rank(types, cosine, reweigh=True, last_access_us=[NOW_US - hour, 0, 0], salience=[0.5] * 3,
                      confidence=0.5)
    for i, kind in enumerate(types):
        w = RankConfig().type_weights[kind]
        s = reweighed.signals
        expected = (w.similarity * s["similarity"][i] + w.recency * s["recency"][i] + 0.5 * (w.salience + w.confidence)
                    ) / (1.0 - w.graph)
        assert np.isclose(reweighed.scores[i], expected), kind
    assert reweighed.order[0] == 0


def test_an_access_after_now_is_no_access():
    """Protects: a recall asked as of a past moment (``now=``) ranking the memories an
    earlier recall had just returned above all others, their accesses (stamped by the
    clock, after that moment) read as the freshest there are."""
    types, cosine, hour = ["episodic"] * 3, [0.80, 0.79, 0.10], 3_600 * 1_000_000
    later = _rank(types, cosine, reweigh=True, last_access_us=[0, NOW_US + hour, 0])
    assert later.signals["recency"].tolist() == [0.0, 0.0, 0.0] and later.order[0] == 0
    before = _rank(types, cosine, reweigh=True, last_access_us=[0, NOW_US - hour, 0])
    assert before.signals["recency"][1] > 0.99 and before.order[0] == 1


def test_within_one_type_the_order_is_unchanged():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = 12
        cosine = rng.uniform(0, 1, n).tolist()
        salience = rng.choice([0.5, 0.7], n).tolist()
        boost = rng.choice([1.0, 1.3], n).tolist()
        a = _rank(["episodic"] * n, cosine, reweigh=False, salience=salience, boost=boost)
        b = _rank(["episodic"] * n, cosine, reweigh=True, salience=salience, boost=boost)
        assert a.order.tolist() == b.order.tolist()


def test_a_member_takes_a_share_of_its_containers_score():
    """Protects: a module's docstring, matching a question's words, ranking above the
    function that does what it describes. Worked by hand with share .5: the module (two
    chunks, best .9) keeps .45; check (.6) gains .45; the class (.5) keeps .25 and gains
    .45 from the module; its method (.4) gains .25 from the class, not .45 from the
    module (its nearest container only); a commit (.7) is left alone."""
    module, cls = "code:a/r:k.py::<module>", "code:a/r:k.py::Keys"
    memories = [module, module, "code:a/r:k.py::check", cls, "code:a/r:k.py::Keys.get", "git:a/r:0123456789ab"]
    containers = [None, None, module, module, cls, None]
    scores = np.array([0.9, 0.3, 0.6, 0.5, 0.4, 0.7])
    out = support_from_containers(scores, memories, containers, 0.5)
    assert np.allclose(out, [0.45, 0.15, 1.05, 0.7, 0.65, 0.7])
    assert np.allclose(support_from_containers(scores, memories, [None] * 6, 0.5), scores), "no container: unchanged"

