"""Qwen3-Omni's code predictor, batched over the talker's running requests.

Each talker step samples a frame's first codebook c0; the code predictor (a small dense decoder)
then generates that frame's remaining `num_code_groups - 1` codes from scratch, as transformers'
`Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation` does with its own
`generate`:

    inner step 0   input  [talker's last hidden state of the previous position, codec_embed(c0)]
                   output code 1 = argmax lm_head[0](last row)
    inner step g   input  codec_embedding[g - 1](code g)             (positions 2, 3, ...)
                   output code g + 1 = argmax lm_head[g](row)

Here every inner step is one pass over the whole batch (all frames of a step have the same length,
so there is no padding and the mask is the plain causal one); the frame's short KV (at most
`num_code_groups` positions) lives in preallocated tensors (a transformers StaticCache per batch size,
made once and reset for every frame), never in the paged cache.

transformers mirrors the talker's `do_sample` onto the code predictor: a greedy talker request gets
greedy residual codes (argmax, as transformers), a sampling one samples them as transformers' code
predictor `generate(do_sample=True, top_k=50, top_p=0.8)` does (temperature from its generation config),
through omni's Sampler with the request's own generator (seeded requests are reproducible; the random
stream is omni's, not torch's global one, so sampled codes are not transformers' draws).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from omni.engine.sampler import Sampler
from omni.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
# transformers' prepare_inputs_for_generation: code_predictor.generate(do_sample=True, top_k=50, top_p=0.8)
SAMPLED_TOP_K, SAMPLED_TOP_P = 50, 0.8


class CodePredictor:
    def __init__(self, code_predictor):
        self.cp = code_predictor  # Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
        self.num_groups = int(code_predictor.config.num_code_groups)
        self.embeddings = code_predictor.model.codec_embedding  # ModuleList, one per residual group
        self.sampler = Sampler()
        self._caches: dict[int, object] = {}  # batch size -> StaticCache of num_code_groups positions
        gen_cfg = getattr(code_predictor, "generation_config", None)
        self.temperature = float(getattr(gen_cfg, "temperature", None) or 1.0)

    def params_for(self, talker_params: SamplingParams | None) -> tuple[SamplingParams, torch.Generator | None]:
        """The residual codes' sampling for a talker request: greedy when it is, else transformers' choice;
        a seeded request gets its own generator (seeded apart from the talker's own stream)."""
        if talker_params is None or talker_params.is_greedy:
            return GREEDY, None
        seed = None if talker_params.seed is None else (talker_params.seed + 1) % 2**63
        params = SamplingParams(temperature=self.temperature, top_k=SAMPLED_TOP_K, top_p=SAMPLED_TOP_P, seed=seed)
        return params, None if seed is None else torch.Generator(device=self.cp.device).manual_seed(seed)

    @torch.inference_mode()
    def predict(self, past_hidden: torch.Tensor, c0_embeds: torch.Tensor,
                params: Sequence[SamplingParams] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
        """[B, H] talker hidden states + [B, H] first-codebook embeddings -> [B, G - 1] residual codes, one
        SamplingParams and generator per row (None: all greedy)."""
        batch = past_hidden.shape[0]
        codes = torch.empty((batch, self.num_groups - 1), dtype=torch.long, device=past_hidden.device)
        if self.num_groups == 1:
            return codes
        cache = self._cache(batch)
        x = torch.stack([past_hidden, c0_embeds], dim=1)  # [B, 2, H]
        pos = 0
        for g in range(self.num_groups - 1):
            n = x.shape[1]
            position_ids = torch.arange(pos, pos + n, device=x.device).unsqueeze(0).expand(batch, -1)
            out = self.cp.model(inputs_embeds=x, position_ids=position_ids, past_key_values=cache, use_cache=True)
            logits = self.cp.lm_head[g](out.last_hidden_state)[:, -1].float()
            if params is None or all(p.is_greedy for p in params):
                codes[:, g] = logits.argmax(-1)
            else:
                codes[:, g] = self.sampler(logits, params, generators or [None] * batch)
            pos += n
            if g + 1 < self.num_groups - 1:
                x = self.embeddings[g](codes[:, g : g + 1])
        return codes

    def _cache(self, batch: int):
        """The KV tensors for a batch of `batch` frames: allocated on first use, zeroed for every frame."""
        from transformers import StaticCache

        cache = self._caches.get(batch)
        if cache is None:
            cache = self._caches[batch] = StaticCache(config=self.cp.config, max_cache_len=self.num_groups)
        else:
            cache.reset()
        return cache

    def residual_embeds(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """[B, G - 1] residual codes -> their input embeddings, each [B, H] (what the talker sums)."""
        return [self.embeddings[g](codes[:, g]) for g in range(self.num_groups - 1)]
