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
share of a cached turn, `stage_s`, 0.90-0.96 s before, 0.62-0.77 s after). Each layer's q/k/v projections and
its gate/up projections are fused into one GEMM each (the modules' weights become views of the fused tensors),
and q_norm, k_norm and the rotary run over q's and k's heads at once: 36 GEMMs a pass become 21 (the same
bench with `--edges plain`, the two versions run in turn, two runs each: the talker's cached-turn share
0.60-0.65 s -> 0.55-0.62 s). The attention reads the frame's keys so far
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

from omni.engine.runner.sampler import Sampler
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


def _fuse(module_weights: list[tuple[torch.nn.Module, str]]) -> torch.Tensor:
    """One tensor holding several modules' parameters (each a [rows, ...] block, concatenated along rows); the
    modules' parameters become views of it, so the memory is not doubled and the modules still read the same
    values. One GEMM over the fused weight computes every row's dot product as the separate GEMMs do (tested
    bitwise against transformers), with one dispatch instead of several: at batch 1 a frame's 15 inner passes
    are dominated by per-op costs, not arithmetic."""
    fused = torch.cat([getattr(m, name).detach() for m, name in module_weights])
    row = 0
    for m, name in module_weights:
        rows = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[row:row + rows], requires_grad=False))
        row += rows
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: the halves of the last dim swapped, the new first half negated (exact)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(slots=True)
class _LayerWeights:
    """One code-predictor decoder layer's parameters, as its modules hold them (q/k/v and gate/up fused)."""

    attn: torch.nn.Module  # sdpa_attention_forward reads its GQA grouping from the module
    eps: float
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # [q rows; k rows; v rows]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    qk_norm: torch.Tensor  # [q heads + kv heads, head_dim]: q_norm's weight per q head, k_norm's per k head
    q_heads: int
    kv_heads: int
    gate_up: torch.Tensor  # [gate rows; up rows]
    intermediate: int
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
        projections = (a.q_proj, a.k_proj, a.v_proj)
        biased = [p.bias is not None for p in projections]
        if any(biased) and not all(biased):
            raise ValueError("the code predictor's q/k/v projections disagree on biases; omni's pass fuses them")
        head_dim = a.head_dim
        q_heads, kv_heads = a.q_proj.out_features // head_dim, a.k_proj.out_features // head_dim
        qkv = _fuse([(p, "weight") for p in projections])
        qkv_bias = _fuse([(p, "bias") for p in projections]) if all(biased) else None
        qk_norm = torch.cat([a.q_norm.weight.detach().expand(q_heads, head_dim),
                             a.k_norm.weight.detach().expand(kv_heads, head_dim)])
        gate_up = _fuse([(mlp.gate_proj, "weight"), (mlp.up_proj, "weight")])
        return cls(a, norms[0].variance_epsilon, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   qkv, qkv_bias, a.o_proj.weight, a.o_proj.bias, qk_norm, q_heads, kv_heads,
                   gate_up, mlp.gate_proj.out_features, mlp.down_proj.weight, mlp.act_fn)


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

        linear = torch.nn.functional.linear
        batch, n = x.shape[:2]
        cos, sin = (t.unsqueeze(1) for t in rotary)  # apply_rotary_pos_emb's unsqueeze_dim=1
        hidden = x
        for w, (keys, values) in zip(self.layers, kv):
            residual = hidden
            h = _rms_norm(hidden, w.input_norm, w.eps)
            heads = linear(h, w.qkv, w.qkv_bias).view(batch, n, -1, self.head_dim)
            qk_heads = w.q_heads + w.kv_heads
            # q_norm and k_norm, then the rotary, over q's and k's heads at once: elementwise, each element
            # gets the same operations as transformers' separate calls (apply_rotary_pos_emb: x * cos +
            # rotate_half(x) * sin), so the result is bitwise theirs.
            qk = _rms_norm(heads[:, :, :qk_heads], w.qk_norm, w.eps).transpose(1, 2)
            qk = (qk * cos) + (_rotate_half(qk) * sin)
            q, k = qk[:, : w.q_heads], qk[:, w.q_heads :]
            v = heads[:, :, qk_heads:].transpose(1, 2)
            keys[:, :, pos:pos + n] = k
            values[:, :, pos:pos + n] = v
            # No mask: n > 1 only for the frame's first pass (positions 0 and 1), causal by itself.
            out, _ = sdpa_attention_forward(w.attn, q, keys[:, :, :pos + n], values[:, :, :pos + n], None,
                                            dropout=0.0, scaling=w.attn.scaling)
            hidden = residual + linear(out.reshape(batch, n, -1).contiguous(), w.o, w.o_bias)
            residual = hidden
            h = _rms_norm(hidden, w.post_norm, w.eps)
            gate_up = linear(h, w.gate_up)
            hidden = residual + linear(w.act(gate_up[..., : w.intermediate]) * gate_up[..., w.intermediate :], w.down)
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
