"""output_modalities: a request runs only the stages its wanted final outputs need (graph.stages_for), on the
fake engine: a text-only reply never reaches a talker that would fail on it."""
from __future__ import annotations

import asyncio

import pytest

from omni import AsyncOmni, Omni
from omni.errors import RequestError
from omni.messages import StageInput, StageOutput
from omni.registry import register_input_processor
from tests.fakes import diamond_config, expected_tokens, fake_factory, stage, text_ids


def needs_two_tokens(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """As the Qwen talkers' processors: a reply of one token cannot be voiced."""
    (out,) = upstream.values()
    if len(out.token_ids) < 2:
        raise ValueError(f"the talker needs >= 2 thinker tokens (got {len(out.token_ids)})")
    return StageInput(request.request_id, prompt_token_ids=list(out.token_ids))


def needs_two_tokens_chunk(chunk, request: StageInput, state: dict) -> StageInput:
    """needs_two_tokens on a streaming edge: the stream's last chunk fails a reply of fewer than 2 tokens."""
    state["n"] = state.get("n", 0) + len(chunk.token_ids)
    if chunk.finished and state["n"] < 2:
        raise ValueError(f"the talker needs >= 2 thinker tokens (the thinker finished with {state['n']})")
    return StageInput(request.request_id, prompt_token_ids=list(chunk.token_ids))


register_input_processor("test_needs_two_tokens", "tests.pipeline.test_output_modalities:needs_two_tokens",
                         incremental="tests.pipeline.test_output_modalities:needs_two_tokens_chunk")


def speech_config(stream: bool) -> dict:
    """thinker (text) -> talker -> vocoder (audio), the thinker giving one token."""
    talker_in = [{"stage": "thinker", "stream": True, "chunk_tokens": 1}] if stream else ["thinker"]
    return {"name": "fake_speech", "runtime": {"backend": "local"}, "stages": [
        stage("thinker", final_output="text", sampling={"max_tokens": 1}),
        stage("talker", inputs=talker_in, input_processor="test_needs_two_tokens", sampling={"max_tokens": 2}),
        stage("vocoder", inputs=["talker"], final_output="audio", sampling={"max_tokens": 2}),
    ]}


def submitted(o: Omni) -> dict[str, int]:
    return {n: s["orchestrator"]["submitted"] for n, s in o.stats()["stages"].items()}


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_only_request_runs_the_text_stage_alone(stream):
    with Omni(speech_config(stream), engine_factory=fake_factory) as o:
        [whole] = o.generate("hi", use_tqdm=False)
        assert whole.error is not None and "2 thinker tokens" in str(whole.error)  # what a text reply hit before
        before = submitted(o)
        [text] = o.generate("hi", use_tqdm=False, output_modalities=["text"])
        assert text.error is None and list(text.outputs) == ["thinker"]
        assert text.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids("hi"), 1)
        items = list(o.stream(["a", "b"], output_modalities="text"))  # a str is one modality
        assert {i.request_id for i in items if isinstance(i, StageOutput)} and all(
            i.stage == "thinker" and getattr(i, "error", None) is None for i in items)
        after = submitted(o)
        assert after["thinker"] - before["thinker"] == 3
        assert (after["talker"], after["vocoder"]) == (before["talker"], before["vocoder"])
        stats = o.stats()["requests"]
        assert stats["in_flight"] == 0 and stats["finished"] == 3 and stats["failed"] == 1


def test_async_omni_takes_output_modalities():
    async def main():
        omni = AsyncOmni(speech_config(stream=True), engine_factory=fake_factory)
        try:
            out = await omni.generate("hi", output_modalities=["text"])
            items = [i async for i in omni.stream("hi", output_modalities=["text"])]
            return out, items
        finally:
            await omni.close()

    out, items = asyncio.run(main())
    assert out.error is None and list(out.outputs) == ["thinker"]
    assert [i.stage for i in items if isinstance(i, StageOutput)] == ["thinker"]


def test_what_the_graph_runs_for_each_modality():
    with Omni(diamond_config(), engine_factory=fake_factory) as o:
        assert o.graph.stages_for(["tokens"]) == {"a", "b", "c", "d"} == o.graph.stages_for(None)
    with Omni(speech_config(stream=True), engine_factory=fake_factory) as o:
        g = o.graph
        assert g.stages_for(["text"]) == {"thinker"}
        assert g.stages_for(["audio"]) == g.stages_for(["text", "audio"]) == {"thinker", "talker", "vocoder"}


def cascade_config() -> dict:
    """A voice agent's shape: a recognizer's text -> an LLM's text -> a TTS's audio."""
    return {"name": "fake_cascade", "runtime": {"backend": "local"}, "stages": [
        stage("asr", final_output="text", sampling={"max_tokens": 2}),
        stage("llm", inputs=["asr"], final_output="text", sampling={"max_tokens": 3}),
        stage("tts", inputs=["llm"], final_output="audio", sampling={"max_tokens": 2}),
    ]}


def test_a_final_stage_named_runs_it_and_what_is_upstream_of_it_alone():
    """Two stages give text (a voice agent's transcript and reply): "text" runs both, the recognizer's name runs
    the recognizer alone (a transcription never starts the LLM)."""
    with Omni(cascade_config(), engine_factory=fake_factory) as o:
        g = o.graph
        assert g.stages_for(["text"]) == g.stages_for(["llm"]) == {"asr", "llm"}
        assert g.stages_for(["asr"]) == {"asr"} and g.stages_for(["tts"]) == g.stages_for(None)
        [heard] = o.generate("hi", use_tqdm=False, output_modalities=["asr"])
        assert heard.error is None and list(heard.outputs) == ["asr"]
        assert heard.outputs["asr"].token_ids == expected_tokens("asr", text_ids("hi"), 2)
        assert submitted(o) == {"asr": 1, "llm": 0, "tts": 0}
        with pytest.raises(RequestError) as e:  # a stage that is no final stage is not an output
            o.generate("hi", use_tqdm=False, output_modalities=["nope"])
        assert "name one of them: asr, llm, tts" in e.value.message


@pytest.mark.parametrize("bad,what", [(["video"], "'video' is not an output"), ([], "empty"),
                                       (["text", "hidden"], "'hidden' is not an output"), (5, "expected a list"),
                                       ([1], "expected a list")])
def test_a_modality_the_pipeline_lacks_is_refused_by_name(bad, what):
    with Omni(speech_config(stream=False), engine_factory=fake_factory) as o:
        with pytest.raises(RequestError) as e:
            o.generate("hi", use_tqdm=False, output_modalities=bad)
        assert e.value.field == "output_modalities" and what in e.value.message
        assert "audio, text" in e.value.message or "text, tokens, audio" in e.value.message  # what it takes
        assert submitted(o)["thinker"] == 0  # refused before anything ran


def test_a_list_of_sampling_params_as_long_as_the_prompts_is_said_to_be_per_stage(caplog):
    """vLLM reads a list as one SamplingParams per prompt; here it is one per stage (vLLM-Omni's): when both readings
    fit, a warning says which one holds."""
    from tests.fakes import chain_config

    with Omni(chain_config(), engine_factory=fake_factory) as o, caplog.at_level("WARNING", logger="omni.api"):
        o.generate(["a", "b"], [{"max_tokens": 1}, {"max_tokens": 1}], use_tqdm=False)
        assert any("one SamplingParams per stage (thinker, talker)" in r.message for r in caplog.records)
        caplog.clear()
        o.generate(["a", "b", "c"], [{"max_tokens": 1}, {"max_tokens": 1}], use_tqdm=False)
        assert not caplog.records
