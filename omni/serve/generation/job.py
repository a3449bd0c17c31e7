"""A request to the pipeline, as every endpoint builds it (a Job: the prompt for AsyncOmni.stream, per-stage
sampling, and what the reply needs), and the rule every spoken reply shares (voice_short_replies).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni.messages import StageInput
from omni.serve.state import PipelineInfo

# request field -> SamplingParams field, applied to the text stage
TOP_LEVEL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "min_tokens",
                      "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop_token_ids",
                      "structured_outputs", "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens",
                      "spaces_between_special_tokens")


@dataclass(slots=True)
class Job:
    """One request, ready for AsyncOmni.stream, and what its reply needs."""

    request_id: str
    prompt: StageInput
    sampling: dict[str, dict[str, Any]]
    text_stage: str | None  # None: no text wanted
    audio_stage: str | None  # None: no audio wanted
    usage_stage: str  # its prompt / generated / cached tokens are the usage
    stops: list[str]
    fields: dict[str, str]  # omni's names -> the request's fields (for error params)
    from_list: dict[str, tuple[int, set[str]]] = field(default_factory=dict)  # stage -> (index, fields)
    # completions' echo: the reply starts with the prompt as the text stage saw it, decoded (StageOutput.
    # prompt_text); echo_only: nothing generated is sent (max_tokens 0)
    echo: bool = False
    echo_only: bool = False
    echo_logprobs: bool = False  # the prompt's tokens lead the reply's logprobs
    show_prompt_logprobs: bool = True  # False: the prompt's logprobs were computed for echo only (not asked)
    # chat's forced tool_choice: "required" (the reply is a JSON list of {name, parameters}) or a function's
    # name (the reply is its arguments' JSON object); None: a text reply (generation/tools.py turns it into tool_calls)
    forced_tool: str | None = None
    # chat's tool_choice "auto": the format the reply's calls are read in (generation/tool_parser.py); None: not read
    tool_parser: str | None = None
    # tool_choice "auto" with audio out: the audio stage that voices the reply once its whole text is known to
    # hold no tool call (a call has no speech); the request itself runs text only (reply_stream.Run). Also a
    # spoken reply bounded below what the audio stages voice as it comes (voice_short_replies)
    voice_after: str | None = None
    # A voice agent's speech recognizer ahead of the text stage (PipelineInfo.recognizer): its transcript of the
    # user's new turn comes as HeardEvents (and its tokens are no part of the reply's usage)
    heard_stage: str | None = None

    def sampling_param(self, stage: str, name: str) -> str:
        """The request field that set `stage`'s sampling field `name`."""
        index, names = self.from_list.get(stage, (None, set()))
        if index is not None and name in names:
            return f"sampling_params_list[{index}].{name}"
        if name in self.fields:  # a field the request names itself (max_tokens, speech's forced input)
            return self.fields[name]
        if name == "max_tokens":
            return "max_tokens"
        return name if name in TOP_LEVEL_SAMPLING else "sampling_params_list"



def voice_short_replies(job: Job, info: PipelineInfo) -> None:
    """A spoken reply whose max_tokens is below info.min_spoken_tokens runs text only and is voiced once its text
    is whole (Job.voice_after): a talker voices the thinker's reply from the thinker's rows of its tokens, and
    the row of the last token sampled is never computed, so a one-token reply has nothing it could take
    (transformers' generate fails on it too). Its voicing forces the thinker's reply to that text and an
    end-of-sequence token: the talker then voices the whole text, what the user reads is what they hear."""
    bound = job.sampling.get(job.usage_stage, {}).get("max_tokens")
    if job.audio_stage is not None and isinstance(bound, int) and bound < info.min_spoken_tokens:
        job.voice_after, job.audio_stage = job.audio_stage, None

