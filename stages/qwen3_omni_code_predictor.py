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
`num_code_groups` positions) lives in preallocated tensors (one pair per layer and batch size, made
once and overwritten by every frame), never in the paged cache.

The pass is the code predictor's own modules and transformers' own functions (apply_rotary_pos_emb,
sdpa_attention_forward) called in the order its decoder does, without the model's `forward` around
them: at batch 1 a frame is 15 passes of 5 small layers, and the generic forward (a causal mask and
the rotary table per call, the cache object's updates, output capture) cost about as much as the
layers' own small ops (`omni bench omni --config stage_configs/qwen3_omni_small.yaml`: the talker's
share of a cached turn, `stage_s`, 0.90-0.96 s before, 0.62-0.77 s after). The attention reads the frame's keys so far
(positions 0..p) with no mask, as transformers' generate does with its growing cache: the codes are
transformers' bitwise (tests/stages/test_qwen3_omni_*: every codebook against `generate`).

transformers mirrors the talker's `do_sample` onto the code predictor: a greedy talker request gets
greedy residual codes (argmax, as transformers), a sampling one samples them as transformers' code
predictor `generate(do_sample=True, top_k=50, top_p=0.8)` does (temperature from its generation config),
through omni's Sampler with the request's own generator (seeded requests are reproducible; the random
stream is omni's, not torch's global one, so sampled codes are not transformers' draws).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omni.engine.sampler import Sampler
from omni.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
# transformers' prepare_inputs_for_generation: code_predictor.generate(do_sample=True, top_k=50, top_p=0.8)
SAMPLED_TOP_K, SAMPLED_TOP_P = 50, 0.8


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3OmniMoeRMSNorm.forward's operations in its order (so, bitwise its result). At batch 1 a frame
    runs 315 of these norms, whose cost is the ops' dispatch, not their arithmetic: in fp32 the two casts
    are no-ops, skipped, and the temporaries are this function's own, updated in place (a product's
    operands commute bitwise)."""
    if x.dtype != torch.float32:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(dtype)
    variance = x.pow(2).mean(-1, keepdim=True)
    return (x * variance.add_(eps).rsqrt_()).mul_(weight)


@dataclass(slots=True)
class _LayerWeights:
    """One code-predictor decoder layer's parameters, as its modules hold them."""

    attn: torch.nn.Module  # sdpa_attention_forward reads its GQA grouping from the module
    eps: float
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    act: torch.nn.Module

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _LayerWeights:
        a, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm)
        if len({n.variance_epsilon for n in norms}) != 1:
            raise ValueError("the code predictor's RMSNorms have different epsilons")
        if any(p.bias is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            raise ValueError("the code predictor's MLP has biases; omni's pass expects none (as transformers' MLP)")
        return cls(a, norms[0].variance_epsilon, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias,
                   a.o_proj.weight, a.o_proj.bias, a.q_norm.weight, a.k_norm.weight,
                   mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, mlp.act_fn)


class CodePredictor:
    def __init__(self, code_predictor):
        self.cp = code_predictor  # Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
        self.num_groups = int(code_predictor.config.num_code_groups)
        self.embeddings = code_predictor.model.codec_embedding  # ModuleList, one per residual group
        self.sampler = Sampler()
        cfg = code_predictor.config
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("the code predictor's config has sliding-window layers (layer_types); omni's pass "
                             "attends over the whole frame and supports full attention only")
        # Each layer's parameters (the modules' own tensors, not copies), looked up once: the modules'
        # attribute lookups and calls, per layer and inner pass, were a measurable part of a frame at batch 1.
        self.layers = [_LayerWeights.of(layer) for layer in code_predictor.model.layers[: cfg.num_hidden_layers]]
        self.head_dim = self.layers[0].attn.head_dim
        self.kv_heads = int(cfg.num_key_value_heads)
        self._kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # batch size -> per layer (K, V)
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0..num_groups
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
        kv = self._kv_for(batch, past_hidden)
        x = torch.stack([past_hidden, c0_embeds], dim=1)  # [B, 2, H]
        cos_all, sin_all = self._rotary_table(x)
        greedy = params is None or all(p.is_greedy for p in params)
        pos = 0
        for g in range(self.num_groups - 1):
            n = x.shape[1]
            rotary = (cos_all[:, pos:pos + n].expand(batch, -1, -1), sin_all[:, pos:pos + n].expand(batch, -1, -1))
            hidden = self.cp.model.norm(self._layers(x, rotary, kv, pos))
            logits = self.cp.lm_head[g](hidden)[:, -1].float()
            if greedy:
                codes[:, g] = logits.argmax(-1)
            else:
                codes[:, g] = self.sampler(logits, params, generators or [None] * batch)
            pos += n
            if g + 1 < self.num_groups - 1:
                x = self.embeddings[g](codes[:, g : g + 1])
        return codes

    def _layers(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv: list[tuple[torch.Tensor, torch.Tensor]], pos: int) -> torch.Tensor:
        """The decoder layers over `x` [B, n, H] at positions pos..pos+n-1, the frame's keys and values
        written at those positions (Qwen3OmniMoeTalkerCodePredictorDecoderLayer's steps, in its order,
        on its own parameters: F.linear is nn.Linear's forward, _rms_norm Qwen3OmniMoeRMSNorm's)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

        linear = torch.nn.functional.linear
        batch, n = x.shape[:2]
        heads = (batch, n, -1, self.head_dim)
        hidden = x
        for w, (keys, values) in zip(self.layers, kv):
            residual = hidden
            h = _rms_norm(hidden, w.input_norm, w.eps)
            q = _rms_norm(linear(h, w.q, w.q_bias).view(heads), w.q_norm, w.eps).transpose(1, 2)
            k = _rms_norm(linear(h, w.k, w.k_bias).view(heads), w.k_norm, w.eps).transpose(1, 2)
            v = linear(h, w.v, w.v_bias).view(heads).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *rotary)
            keys[:, :, pos:pos + n] = k
            values[:, :, pos:pos + n] = v
            # No mask: n > 1 only for the frame's first pass (positions 0 and 1), causal by itself.
            out, _ = sdpa_attention_forward(w.attn, q, keys[:, :, :pos + n], values[:, :, :pos + n], None,
                                            dropout=0.0, scaling=w.attn.scaling)
            hidden = residual + linear(out.reshape(batch, n, -1).contiguous(), w.o, w.o_bias)
            residual = hidden
            h = _rms_norm(hidden, w.post_norm, w.eps)
            hidden = residual + linear(w.act(linear(h, w.gate)) * linear(h, w.up), w.down)
        return hidden

    def _kv_for(self, batch: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V for a batch of `batch` frames, made on first use; a frame overwrites
        positions 0.. before it reads them, so nothing is reset between frames."""
        kv = self._kv.get(batch)
        if kv is None:
            shape = (batch, self.kv_heads, self.num_groups, self.head_dim)
            kv = self._kv[batch] = [(like.new_zeros(shape), like.new_zeros(shape)) for _ in self.layers]
        return kv

    def _rotary_table(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, num_groups + 1, head_dim] of positions 0..num_groups, as the model's rotary
        embedding computes them for any batch (its values depend on the position only)."""
        if self._rotary is None or self._rotary[0].dtype != like.dtype or self._rotary[0].device != like.device:
            positions = torch.arange(self.num_groups + 1, device=like.device).unsqueeze(0)
            self._rotary = self.cp.model.rotary_emb(like, positions)
        return self._rotary

    def residual_embeds(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """[B, G - 1] residual codes -> their input embeddings, each [B, H] (what the talker sums)."""
        return [self.embeddings[g](codes[:, g]) for g in range(self.num_groups - 1)]
