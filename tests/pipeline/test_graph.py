"""StageGraph: topological order, entry/final stages, fan-out and fan-in."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from omni.config import load_config
from omni.errors import ConfigError
from omni.pipeline.graph import StageGraph
from tests.pipeline.test_fake_engine import chain_config, diamond_config


def s(name, inputs=(), final=None):
    """A duck-typed stage: StageGraph needs only name, inputs, final_output (and summary() a few more)."""
    return NS(name=name, inputs=list(inputs), final_output=final, model="fake", model_path="x",
              input_processor=None, enable_prefix_caching=True)


def test_chain():
    g = StageGraph(load_config(chain_config()).stages)
    assert g.order == ["thinker", "talker"]
    assert g.entry_stages == ["thinker"] and g.final_stages == ["thinker", "talker"]
    assert g.upstream == {"thinker": [], "talker": ["thinker"]}
    assert g.downstream == {"thinker": ["talker"], "talker": []}
    assert "talker" in g and len(g) == 2 and g.is_final("talker")


def test_diamond_fan_out_fan_in():
    g = StageGraph(load_config(diamond_config()).stages)
    assert g.order == ["a", "b", "c", "d"]
    assert g.downstream["a"] == ["b", "c"]  # fan-out
    assert g.upstream["d"] == ["b", "c"]  # fan-in, in `inputs` order
    assert g.entry_stages == ["a"] and g.final_stages == ["d"]


def test_order_respects_dependencies_not_config_order():
    g = StageGraph([s("late", ["mid"], "text"), s("mid", ["src"]), s("src"), s("other", ["src"], "tokens")])
    assert g.order.index("src") < g.order.index("mid") < g.order.index("late")
    assert g.order.index("src") < g.order.index("other")
    assert g.order == ["src", "mid", "other", "late"] or g.order == ["src", "mid", "late", "other"]
    # final stages are listed in topological order
    assert g.final_stages == [n for n in g.order if n in ("late", "other")]


def test_several_entry_stages():
    g = StageGraph([s("text_in"), s("audio_in"), s("fuse", ["text_in", "audio_in"], "text")])
    assert g.entry_stages == ["text_in", "audio_in"]
    assert g.order[-1] == "fuse"


def test_single_stage():
    g = StageGraph([s("only", final="text")])
    assert g.order == g.entry_stages == g.final_stages == ["only"]


def test_errors():
    with pytest.raises(ConfigError, match="cycle: b -> c -> b"):
        StageGraph([s("a"), s("b", ["a", "c"]), s("c", ["b"], "text")])
    with pytest.raises(ConfigError, match="no entry stage"):
        StageGraph([s("a", ["b"]), s("b", ["a"], "text")])
    with pytest.raises(ConfigError, match="unique"):
        StageGraph([s("a", final="text"), s("a", final="text")])
    with pytest.raises(ConfigError, match="no final output"):
        StageGraph([s("a"), s("b", ["a"])])
    with pytest.raises(ConfigError, match="at least one stage"):
        StageGraph([])


def test_summary_mentions_every_stage_and_edge():
    text = StageGraph(load_config(diamond_config()).stages).summary()
    assert "d: fake" in text and "<- b, c via tagged_concat" in text
    assert "b: fake" in text and "<- a via passthrough_tokens" in text
    assert "a: fake (unused)  <- <prompt>" in text
