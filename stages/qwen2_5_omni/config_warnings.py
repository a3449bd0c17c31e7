"""Why loading a Qwen2.5-Omni config prints no "Model config: ... within the vocabulary" warnings.

Qwen2.5-Omni's talker config carries seven token ids of the THINKER's text vocabulary
(tts_text_start/end/pad, vision_start/end, audio_start/end: the talker embeds them through the thinker's
embedding table), while its own `vocab_size` is the codec's (8448). transformers (>= 5) checks every
`*_token_id` of a config against that config's vocab_size and warns about each of the seven on every
load, of the real checkpoint as of our builtin recipes: the ids are right, the check reads the wrong
vocabulary. Only those seven names, and only with a value inside the thinker's vocabulary, are dropped;
any other token id out of range (a real mistake in a config) is still reported.
"""
from __future__ import annotations

import logging
import re

# the talker config's ids that index the thinker's text vocabulary
TALKER_THINKER_IDS = frozenset({
    "tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id",
    "vision_start_token_id", "vision_end_token_id", "audio_start_token_id", "audio_end_token_id"})
THINKER_VOCAB_SIZE = 152064  # Qwen2.5-Omni's text vocabulary (the thinker's text_config.vocab_size)
_WARNING = re.compile(r"^Model config: (\w+) must be `None` or an integer within the vocabulary .*, got (\d+)\.")


class TalkerThinkerIds(logging.Filter):
    """Drops transformers' out-of-vocabulary warning for the talker's thinker-vocabulary ids only."""

    def filter(self, record: logging.LogRecord) -> bool:
        m = _WARNING.match(record.getMessage())
        return not (m and m.group(1) in TALKER_THINKER_IDS and int(m.group(2)) < THINKER_VOCAB_SIZE)


def install() -> None:
    """Once per process (the logger keeps one filter of this kind)."""
    logger = logging.getLogger("transformers.configuration_utils")
    if not any(isinstance(f, TalkerThinkerIds) for f in logger.filters):
        logger.addFilter(TalkerThinkerIds())
