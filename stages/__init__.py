"""Model-specific code: stage models, input processors and builtin checkpoints.

omni never imports this package: `register()` (omni's default plugin, see
omni/registry.py) records every name below as an import string, so nothing here
is imported until a stage is built. Keep this module free of torch imports.
"""
from __future__ import annotations


def register() -> None:
    from omni.registry import register_input_processor, register_model_path_scheme, register_stage_model

    # `info`: the StageInfo object the class declares as its `info` (torch-free, one module a family); none: the
    # defaults (an autoregressive model that emits hidden states).
    register_stage_model("causal_lm", "stages.causal_lm:CausalLMStage")
    register_stage_model("qwen2_5_omni_thinker", "stages.qwen2_5_omni.edges:Qwen2_5OmniThinkerStage",
                         info="stages.qwen2_5_omni.info:THINKER")
    register_stage_model("qwen2_5_omni_talker", "stages.qwen2_5_omni.edges:Qwen2_5OmniTalkerStage",
                         info="stages.qwen2_5_omni.info:TALKER")
    register_stage_model("qwen2_5_omni_token2wav", "stages.qwen2_5_omni.edges:Qwen2_5OmniToken2WavStage",
                         info="stages.qwen2_5_omni.info:TOKEN2WAV")
    register_stage_model("qwen3_omni_thinker", "stages.qwen3_omni.edges:Qwen3OmniThinkerStage",
                         info="stages.qwen3_omni.info:THINKER")
    register_stage_model("qwen3_omni_talker", "stages.qwen3_omni.edges:Qwen3OmniTalkerStage",
                         info="stages.qwen3_omni.info:TALKER")
    register_stage_model("qwen3_omni_code2wav", "stages.qwen3_omni.edges:Qwen3OmniCode2WavStage",
                         info="stages.qwen3_omni.info:CODE2WAV")
    register_stage_model("higgs_audio_v2", "stages.higgs_audio_v2.edges:HiggsAudioV2Stage",
                         info="stages.higgs_audio_v2.info:MODEL")
    register_stage_model("higgs_audio_v2_codec", "stages.higgs_audio_v2.edges:HiggsAudioV2CodecStage",
                         info="stages.higgs_audio_v2.info:CODEC")
    register_stage_model("qwen3_asr", "stages.qwen3_asr.model:Qwen3ASRStage", info="stages.qwen3_asr.info:ASR")

    register_input_processor("hidden_to_embeds", "stages.common.processors:hidden_to_embeds", needs_hidden_states=True,
                             incremental="stages.common.processors:hidden_to_embeds_chunk")
    register_input_processor("thinker2talker", "stages.qwen2_5_omni.edges:thinker2talker", needs_hidden_states=True,
                             incremental="stages.qwen2_5_omni.edges:thinker2talker_chunk",
                             chunk_state="stages.common.talker_feed:TalkerFeed")
    register_input_processor("talker2wav", "stages.qwen2_5_omni.edges:talker2wav",
                             incremental="stages.qwen2_5_omni.edges:talker2wav_chunk",
                             chunk_state="stages.qwen2_5_omni.edges:CodesFeed")
    # Qwen3-Omni: the talker reads the thinker's embeds / accept_hidden rows, code2wav the talker's `codes` rows.
    register_input_processor("qwen3_omni_thinker2talker", "stages.qwen3_omni.edges:thinker2talker", needs_hidden_states=True,
                             incremental="stages.qwen3_omni.edges:thinker2talker_chunk",
                             chunk_state="stages.common.talker_feed:TalkerFeed")
    register_input_processor("qwen3_omni_talker2code2wav", "stages.qwen3_omni.edges:talker2code2wav",
                             needs_hidden_states=True, incremental="stages.qwen3_omni.edges:talker2code2wav_chunk",
                             chunk_state="stages.qwen3_omni.edges:FramesFeed")
    # Higgs Audio v2: the codec reads the model's `audio_codes` rows, aligned (the delay pattern undone).
    register_input_processor("higgs_audio_v2_to_codec", "stages.higgs_audio_v2.edges:model2codec",
                             needs_hidden_states=True, incremental="stages.higgs_audio_v2.edges:model2codec_chunk",
                             chunk_state="stages.higgs_audio_v2.edges:DelayedFrames")

    # A voice agent: the recognizer's transcript is the user's turn of the LLM's conversation; the LLM's reply is
    # spoken piece by piece as it streams (cut at sentence ends).
    register_input_processor("qwen3_asr_to_chat", "stages.qwen3_asr.edges:asr2chat")
    register_input_processor("text_to_higgs_audio_v2", "stages.higgs_audio_v2.speak_edges:text2speech",
                             incremental="stages.higgs_audio_v2.speak_edges:text2speech_chunk",
                             chunk_state="stages.higgs_audio_v2.speak_edges:SpokenPieces")

    register_model_path_scheme("builtin", "stages.checkpoints.builtin:builtin_path", check="stages.checkpoints.builtin:check_builtin")
