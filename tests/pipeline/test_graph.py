"""StageGraph: topological order, entry/final stages, fan-out and fan-in."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from omni.config.loader import load_config
from omni.errors import ConfigError
from omni.pipeline.graph import StageGraph
from tests.fakes import chain_config, diamond_config

REPO = Path(__file__).resolve().parents[2]


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
    with pytest.raises(ConfigError, match="cycle: a -> b -> a"):  # (it said "no entry stage", naming no stage)
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


def test_per_token_rows_leave_a_stage_only_where_they_are_read():
    omni_tiny = StageGraph(load_config(REPO / "stage_configs" / "qwen2_5_omni_tiny.yaml").stages)
    # thinker2talker reads the thinker's hidden states; talker2wav only the talker's codec tokens.
    assert {n: omni_tiny.emits_hidden_states(n) for n in omni_tiny.order} == \
        {"thinker": True, "talker": False, "token2wav": False}
    chain = chain_config()
    assert not StageGraph(load_config(chain).stages).emits_hidden_states("thinker")  # passthrough_tokens
    chain["stages"][1]["input_processor"] = "tests.fakes:fake_hidden_to_embeds"
    assert StageGraph(load_config(chain).stages).emits_hidden_states("thinker")  # a target: not known, so yes
    chain["stages"][1]["final_output"] = "hidden"
    assert StageGraph(load_config(chain).stages).emits_hidden_states("talker")  # the final output itself


def test_an_edge_reading_hidden_states_needs_an_upstream_that_emits_them():
    data = chain_config()
    data["stages"][0].update(model="fake_nar", enable_prefix_caching=False)
    data["stages"][1]["input_processor"] = "hidden_to_embeds"
    with pytest.raises(ConfigError, match="stage 'talker': input_processor: 'hidden_to_embeds' reads the hidden "
                                          "states of stage 'thinker', whose model 'fake_nar' emits none"):
        load_config(data)


def test_the_graph_is_built_once_where_the_config_is_loaded():
    from omni import Omni
    from omni.config.schema import PipelineConfig
    from tests.fakes import fake_factory

    cfg = load_config(chain_config())
    graph = StageGraph.of(cfg)
    assert StageGraph.of(cfg) is graph  # load_config built it; it is handed on, not rebuilt
    with Omni(cfg, backend="local", engine_factory=fake_factory) as o:  # a runtime change keeps the stages
        assert o.graph is graph and o._backend.graph is graph and o._orch.graph is graph
    # Another config's stages get their own graph; the graph is not part of the data.
    other = cfg.model_copy(update={"stages": [st.model_copy() for st in cfg.stages]})
    assert StageGraph.of(other) is not graph and StageGraph.of(other).order == graph.order
    assert other == cfg == load_config(chain_config())
    # A config made without load_config is checked when its graph is first asked for.
    data = chain_config()
    data["stages"][1]["inputs"] = ["nope"]
    with pytest.raises(ConfigError, match="stage 'talker': inputs: unknown stage 'nope'"):
        StageGraph.of(PipelineConfig.model_validate(data))
