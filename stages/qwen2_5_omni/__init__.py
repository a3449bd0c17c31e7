"""Qwen2.5-Omni: thinker -> talker -> token2wav. Importing any of its modules first quiets transformers'
false out-of-vocabulary warnings about the talker config's thinker-vocabulary ids (config_warnings.py)."""
from stages.qwen2_5_omni import config_warnings

config_warnings.install()
