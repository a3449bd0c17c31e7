"""What a `/v1/realtime` session checks of a `session.update` or `response.create` before it applies any of it
(a refused event changes nothing): the voice, the tools and tool choice, the output modality. Each refusal is a
RealtimeEventError naming the field (`param`), checked once here rather than failed by every response."""
from __future__ import annotations

from omni.serve.protocol import realtime as E
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.hub import RealtimeHub
from omni.serve.voices.choice import uploaded_for_cascade


def voice(server: RealtimeHub, name: str, param: str, event_id: str | None) -> None:
    """A voice the pipeline's talker would refuse (a voice agent's speech stage also speaks the uploaded ones)."""
    if uploaded_for_cascade(server.info, server.state.uploaded_voices, name) is not None:
        return
    unknown = server.info.unknown_voice(name, param)
    if unknown is not None:
        raise RealtimeEventError(unknown, param, "invalid_value", event_id)


def tools(server: RealtimeHub, model: str, functions: list[E.RealtimeTool], choice: str | E.FunctionChoice,
          at: str, event_id: str | None) -> None:
    """Calls are read from the reply as chat completions' "auto" reads them: with the server's parser; a forced
    choice constrains the reply to a call of the tools (or of the one named)."""
    names = [t.name for t in functions]
    if functions and server.info.shows_tools is False:
        raise RealtimeEventError(f"{at}.tools: pipeline {model!r} shows its model no tools (its thinker's own "
                                 "prompt format has none); send no tools", f"{at}.tools", "unsupported_value",
                                 event_id)
    if len(set(names)) != len(names):
        raise RealtimeEventError(f"{at}.tools: function names must be unique, got {names}", f"{at}.tools",
                                 "invalid_value", event_id)
    forced = E.forced_tool(choice)
    if forced is not None and not functions:
        raise RealtimeEventError(f"{at}.tool_choice: a forced call ({forced!r}) needs tools; send them with it",
                                 f"{at}.tool_choice", "invalid_value", event_id)
    if forced not in (None, "required") and forced not in names:
        raise RealtimeEventError(f"{at}.tool_choice.name: {forced!r} is none of the tools {names}",
                                 f"{at}.tool_choice.name", "invalid_value", event_id)
    if functions and choice == "auto" and not server.settings.enable_auto_tool_choice:
        raise RealtimeEventError(f"{at}.tools: reading calls from the reply needs a server started with "
                                 "--enable-auto-tool-choice --tool-call-parser hermes (as vLLM's); or send "
                                 'tool_choice "none"', f"{at}.tools", "unsupported_value", event_id)


def modality(server: RealtimeHub, model: str, want: str, param: str, event_id: str | None) -> None:
    stage = server.info.audio_stage if want == "audio" else server.info.text_stage
    if stage is None:
        raise RealtimeEventError(f"{param}: pipeline {model!r} has no {want} output stage", param,
                                 "invalid_value", event_id)
