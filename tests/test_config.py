"""Typed configuration: YAML mirrors the defaults, unknown keys and bad ranges are refused."""

from __future__ import annotations

import pytest

from helix_ray.config import IngestConfig, RetrievalConfig, load_config
from helix_ray.errors import InvalidArgument
from tests.helpers import REPO


@pytest.mark.parametrize("name, model", [("ingest", IngestConfig), ("retrieval", RetrievalConfig)])
def test_yaml_in_configs_mirrors_the_defaults(name, model):
    assert load_config(model, REPO / "configs" / f"{name}.yaml") == model()


def test_unknown_key_is_refused_with_its_name():
    with pytest.raises(InvalidArgument, match="fusion.kk"):
        load_config(RetrievalConfig, overrides={"fusion": {"kk": 3}})


def test_out_of_range_value_says_what_is_allowed():
    with pytest.raises(InvalidArgument, match=r"diversity.mmr_lambda.*less than or equal to 1"):
        load_config(RetrievalConfig, overrides={"diversity": {"mmr_lambda": 1.5}})


def test_partial_weight_override_keeps_the_other_list():
    cfg = load_config(RetrievalConfig, overrides={"fusion": {"weights": {"dense": 2.0}}})
    assert cfg.fusion.weights == {"dense": 2.0, "bm25": 1.0}


def test_a_partial_type_weight_table_changes_what_it_names_only():
    cfg = load_config(RetrievalConfig, overrides={"rank": {"type_weights": {"semantic": {"salience": 0}}}})
    defaults = RetrievalConfig().rank.type_weights
    assert cfg.rank.type_weights["semantic"] == defaults["semantic"].model_copy(update={"salience": 0.0})
    assert {t: w for t, w in cfg.rank.type_weights.items() if t != "semantic"} == {
        t: w for t, w in defaults.items() if t != "semantic"}
    with pytest.raises(InvalidArgument, match=r"note is not a memory type \(allowed: episodic, "):
        load_config(RetrievalConfig, overrides={"rank": {"type_weights": {"note": {"salience": 0}}}})


@pytest.mark.parametrize("overrides, where", [
    ({"fusion": {"weights": {"bm25": float("nan")}}}, "fusion.weights.bm25"),
    ({"rank": {"type_weights": {"code": {"graph": float("nan")}}}}, "rank.type_weights.code.graph"),
    ({"rank": {"recency_half_life_days": float("inf")}}, "rank.recency_half_life_days"),  # inf > 0
])
def test_nan_and_infinity_are_refused(overrides, where):
    with pytest.raises(InvalidArgument, match=rf"{where}: Input should be a finite number"):
        load_config(RetrievalConfig, overrides=overrides)
