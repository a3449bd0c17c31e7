"""What omni's benchmarks compare against: the same models run by transformers as a user without omni
runs them (causal_lm: `generate` and continuous batching; qwen2_5_omni, qwen3_omni: the omni models'
`generate` with audio out)."""
