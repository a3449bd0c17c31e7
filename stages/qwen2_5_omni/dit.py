"""Qwen2.5-Omni's DiT sampler (codec tokens -> mel) with the request's constants computed once,
for one request or several in lockstep.

transformers' `Qwen2_5OmniToken2WavDiTModel.sample` integrates an ODE with 10 Runge-Kutta steps
(36 DiT evaluations, each on the classifier-free-guidance batch of 2). Every evaluation recomputes
parts that depend only on the request, not on the ODE time or state:

    the speaker encoder (an ECAPA-TDNN over the reference mel), the codec embeddings (with and
    without codes), the speaker vector, the rotary tables, and each layer's block attention mask
    (kept in the additive form SDPA turns a boolean mask into, one [frames, frames] per layer kind,
    broadcast over the CFG rows and heads; built only where the layer attends to the whole request,
    see below; elsewhere the block-local pass keeps a [blocks, window] one).

`DiTVelocity` computes them once per request and then runs, per evaluation, the tensor ops transformers
runs on the same inputs, but for attention: where a request spans at least two DiT blocks more than a
layer's window (its block, look_backward_block before it, look_ahead_block after it), that layer attends
block by block over the window only (dit_attention.py) instead of computing all frames x
frames scores and masking most of them. A request of at most two blocks (48 frames: 24 codes, which
covers a streamed first window of 8 codes plus a block of look-ahead) is therefore bitwise `dit.sample`'s mel
(tested: the velocity with `torch.equal` against the DiT's forward, the waveform with `array_equal`
against transformers' token2wav); a longer one is the same math with its attention sums in another
order (tested against the derived bound). On the small checkpoint (`omni bench token2wav`, one thread)
the hoisted constants (mostly the speaker encoder) made token2wav 1.4-1.5x faster than transformers';
block-local attention then took a 250-code request from 1.74 s to 1.04 s (the code before and after it,
one sitting).

Several requests (or streamed windows of several requests) integrate in lockstep: their frames are
*packed* along the time axis, [2 (guided, null), frames of request 1 + frames of request 2 + ..., D],
not padded. Every op of the DiT but attention works row by row (the linear layers, LayerNorm, the
MLP, the time modulation, which depends only on the ODE time that all requests share) and runs once
over the packed rows; attention runs per request on its own slice with its own block mask, the very
call the one-request path makes; no frame is computed for padding. The ODE's Runge-Kutta arithmetic
is elementwise, so stepping the packed state is stepping each request's. A request's mel in a batch
is therefore bitwise its mel alone wherever a matrix product's row does not depend on how many rows
it is computed with: with MKL on a CPU, every window measured but a 1-code request alone without
guidance (2 rows: MKL's small-matrix kernel sums in another order, 6e-8 apart). The test holds it to
the bound of a reordered fp32 chain (tests/stages/omni_utils.py mel_atol), whatever the BLAS picks.

Requests at different steps of their ODEs (token2wav's streamed windows, which the one-shot engine
batches continuously as their codes arrive) are packed the same way (`ode_step`): the time embedding and each layer's time
modulation are computed per request and spread over its frames, and the Runge-Kutta arithmetic takes
each request's own times and step size; with every request at one step it is the lockstep path above.

What it relies on from transformers' DiT (checked by the equality tests on every run): the input
embedding concatenates [state, speaker-encoder output, code embedding, speaker vector] before
`input_embed.proj`; a decoder layer is AdaLayerNormZero -> block-masked attention (q/k/v
projections, rotary on the first head of the de-interleaved q and k, SDPA, output projection) ->
gated residual -> LayerNorm with the MLP modulation -> MLP -> gated residual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.qwen2_5_omni.dit_attention import BlockLocalAttention, needs_blocks


@dataclass(frozen=True, slots=True)
class DiTRequest:
    """One request (or streamed window) for the DiT: conditioning [1, D], reference mel [1, frames, mel],
    codes [1, n] and the ODE's initial state [1, n * repeats, mel]."""

    conditioning: torch.Tensor
    reference_mel: torch.Tensor
    code: torch.Tensor
    noise: torch.Tensor


def _request_constant(dit, conditioning: torch.Tensor, reference_mel: torch.Tensor, code: torch.Tensor,
                      cfg: bool) -> torch.Tensor:
    """Everything input_embed.proj sees after the ODE state, in its order: [batch, frames, C]."""
    frames = code.shape[1] * dit.repeats
    speaker = conditioning.unsqueeze(1).repeat(1, frames, 1)
    code_embed = dit.text_embed(code, drop_code=False)
    if cfg:
        # The guided batch: row 0 conditioned, row 1 with speaker, reference mel and codes dropped.
        speaker = torch.cat([speaker, torch.zeros_like(speaker)], dim=0)
        reference_mel = torch.cat([reference_mel, torch.zeros_like(reference_mel)], dim=0)
        code_embed = torch.cat([code_embed, dit.text_embed(code, drop_code=True)], dim=0)
    encoded = dit.input_embed.spk_encoder(reference_mel).unsqueeze(1).repeat(1, frames, 1)
    return torch.cat((encoded, code_embed, speaker), dim=-1)


def _mask(dit, masks: dict, frames: int, layer, like: torch.Tensor) -> torch.Tensor | None:
    key = (frames, layer.look_backward_block, layer.look_ahead_block)
    if needs_blocks(frames, dit.block_size, key[1], key[2]):
        return None  # block-local (dit_attention.py): no [frames, frames] mask at all
    if key not in masks:
        blocks = torch.arange(frames, device=like.device) // dit.block_size
        # [1, 1, frames, frames], broadcast by SDPA over the CFG rows and the heads (the same values
        # as transformers' [batch, heads, frames, frames] mask: the same scores, tested bitwise), so a
        # mask costs frames^2 floats, not batch * heads times that (for a 2,048-code request with 16
        # heads: 64 MB per layer kind instead of 2 GB).
        diff = (blocks.unsqueeze(0) - blocks.unsqueeze(1))[None, None]
        allowed = (diff >= -float(key[1])) & (diff <= float(key[2]))
        # As the additive mask SDPA makes of a boolean one (0 where allowed, -inf elsewhere:
        # adding either to a score is exact), built once instead of per layer and evaluation.
        masks[key] = torch.zeros(allowed.shape, dtype=like.dtype,
                                 device=like.device).masked_fill_(~allowed, float("-inf"))
    return masks[key]


@dataclass(frozen=True, slots=True)
class DiTParts:
    """What the DiT needs of one request besides the ODE's time and state, computed once per request:
    everything input_embed.proj sees after the state [batch, frames, C], the rotary tables, and each
    layer's attention mask (None where the layer runs block-local)."""

    constant: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    masks: list[torch.Tensor | None]

    @property
    def frames(self) -> int:
        return self.constant.shape[1]


def request_parts(dit, r: DiTRequest, cfg: bool, masks: dict | None = None) -> DiTParts:
    """A request's DiTParts (`masks`: a cache shared by requests of one call)."""
    _check(dit, r)
    masks = {} if masks is None else masks
    batch = 2 if cfg else 1
    constant = _request_constant(dit, r.conditioning, r.reference_mel, r.code, cfg)
    frames = constant.shape[1]
    position_ids = torch.arange(frames, device=r.code.device)[None, :].repeat(batch, 1)
    cos, sin = dit.rotary_embed(constant, position_ids)
    return DiTParts(constant, cos, sin, [_mask(dit, masks, frames, layer, constant) for layer in dit.transformer_blocks])


class DiTVelocity:
    """The ODE's right-hand side for one or more requests packed along time: v(t, x) with
    classifier-free guidance; x and v are [1, total frames, mel]."""

    def __init__(self, dit, requests: list[DiTRequest], guidance_scale: float,
                 parts: list[DiTParts] | None = None):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if not requests and not parts:
            raise ValueError("DiTVelocity needs at least one request")
        self.dit = dit
        self.cfg = guidance_scale >= 1e-5  # transformers' switch between the guided and plain forward
        self.guidance_scale = guidance_scale
        self.batch = 2 if self.cfg else 1
        self.attention = ALL_ATTENTION_FUNCTIONS[dit.transformer_blocks[0].attn.config._attn_implementation]
        self.blocks = BlockLocalAttention(dit.block_size)
        if parts is None:
            masks: dict[tuple[int, int, int], torch.Tensor] = {}  # (frames, look back, look ahead) -> mask
            parts = [request_parts(dit, r, self.cfg, masks) for r in requests]
        # per request, per layer: the full attention's mask, or None where the layer runs block-local
        self.masks: list[list[torch.Tensor | None]] = [p.masks for p in parts]
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for p in parts:
            self.bounds.append((start, start + p.frames))
            start += p.frames
        self.frames = start
        # One request: its own tensors, no copy.
        self.constant = parts[0].constant if len(parts) == 1 else torch.cat([p.constant for p in parts], dim=1)
        self.position_embeddings = ((parts[0].cos, parts[0].sin) if len(parts) == 1
                                    else (torch.cat([p.cos for p in parts], dim=1),
                                          torch.cat([p.sin for p in parts], dim=1)))
        # Packed requests at different ODE times (mixed_step): each frame's request, to spread per-request
        # time modulations over its frames.
        self.frame_request = (torch.cat([torch.full((p.frames,), i, dtype=torch.long) for i, p in enumerate(parts)])
                              if len(parts) > 1 else None)

    def _attention(self, index: int, attn, hidden: torch.Tensor) -> torch.Tensor:
        """DiTAttention.forward on the packed rows, its attention core per request."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            apply_rotary_pos_emb,
            deinterleave_head_dim,
        )

        batch = hidden.shape[0]
        query, key, value = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        cos, sin = self.position_embeddings
        # Only the first head is rotated, as in transformers (its checkpoint's training quirk).
        query[:, :1], key[:, :1] = apply_rotary_pos_emb(
            deinterleave_head_dim(query[:, :1]), deinterleave_head_dim(key[:, :1]), cos, sin)
        outs = []
        layer = self.dit.transformer_blocks[index]
        for (lo, hi), masks in zip(self.bounds, self.masks):
            if masks[index] is None:
                # [batch, frames, heads, head_dim], as the attention function returns it
                outs.append(self.blocks(query[:, :, lo:hi].transpose(1, 2), key[:, :, lo:hi].transpose(1, 2),
                                        value[:, :, lo:hi].transpose(1, 2), layer.look_backward_block,
                                        layer.look_ahead_block, getattr(attn, "scaling", None)))
                continue
            out, _ = self.attention(attn, query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi],
                                    attention_mask=masks[index], is_causal=False)
            outs.append(out)
        weights = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        weights = weights.reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](weights))

    def __call__(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """v(t, x): `t` the ODE time shared by every packed request (0-d; transformers' call), or one time
        per request [requests] (mixed_step: requests at different steps of their ODEs)."""
        dit = self.dit
        per_request = t.ndim == 1 and self.frame_request is not None
        if per_request:
            # [batch * requests] time embeddings (CFG rows outer), each request's modulation spread over
            # its frames: the elementwise ops below are then those of the shared-time path, row by row.
            time_embedding = dit.time_embed(t.repeat(self.batch)).view(self.batch, t.shape[0], -1)
        else:
            # The ODE time is the same for every packed request: one time embedding row per CFG row.
            time_embedding = dit.time_embed(t.repeat(self.batch) if t.ndim == 0 else t)
        state = torch.cat([x, x], dim=0) if self.cfg else x
        hidden = dit.input_embed.proj(torch.cat((state, self.constant), dim=-1))
        for index, layer in enumerate(dit.transformer_blocks):
            if per_request:
                norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self._modulate(layer.attn_norm, hidden,
                                                                                time_embedding)
            else:
                norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer.attn_norm(hidden, emb=time_embedding)
                gate_msa, shift_mlp, scale_mlp, gate_mlp = (v.unsqueeze(1) for v in (gate_msa, shift_mlp,
                                                                                      scale_mlp, gate_mlp))
            attn = self._attention(index, layer.attn, norm)
            hidden = hidden + gate_msa * attn
            norm = layer.ff_norm(hidden) * (1 + scale_mlp) + shift_mlp
            hidden = hidden + gate_mlp * layer.ff(norm)
        if per_request:
            final = dit.norm_out
            scale, shift = (self._spread(v) for v in
                            torch.chunk(final.linear(final.silu(time_embedding)), 2, dim=-1))
            out = dit.proj_out(final.norm(hidden) * (1 + scale) + shift)
        else:
            out = dit.proj_out(dit.norm_out(hidden, time_embedding))
        if not self.cfg:
            return out
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * self.guidance_scale

    def _spread(self, per_request: torch.Tensor) -> torch.Tensor:
        """[batch, requests, D] -> [batch, frames, D]: each frame its request's row."""
        return per_request.index_select(1, self.frame_request)

    def _modulate(self, norm, hidden: torch.Tensor, time_embedding: torch.Tensor):
        """AdaLayerNormZero.forward with a time embedding per request ([batch, requests, D]): the same
        ops, each frame modulated by its request's row; the gates and MLP terms come back per frame."""
        emb = norm.linear(norm.silu(time_embedding))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self._spread(v) for v in torch.chunk(emb, 6, dim=-1))
        return norm.norm(hidden) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _check(dit, r: DiTRequest) -> None:
    frames = r.code.shape[1] * dit.repeats
    if r.noise.shape[1] != frames:
        raise ValueError(f"noise has {r.noise.shape[1]} frames for {frames} mel frames")
    if frames > dit.config.max_position_embeddings:
        raise ValueError(f"{frames} mel frames exceed dit_config.max_position_embeddings "
                         f"({dit.config.max_position_embeddings})")


@dataclass(eq=False, slots=True)
class ODEWindow:
    """One request's ODE in flight: its DiTParts, its state [1, frames, mel] and the Runge-Kutta steps it
    has taken on the shared time grid (time_grid)."""

    parts: DiTParts
    state: torch.Tensor
    steps_done: int = 0

    def done(self, times: torch.Tensor) -> bool:
        return self.steps_done >= len(times) - 1

    def mel(self) -> torch.Tensor:
        return self.state.permute(0, 2, 1)


def time_grid(num_steps: int, sway_coefficient: float | None, dtype: torch.dtype, device) -> torch.Tensor:
    """transformers' sampling times: linspace(0, 1, num_steps), swayed."""
    t = torch.linspace(0, 1, num_steps, device=device, dtype=dtype)
    if sway_coefficient is not None:
        t = t + sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def ode_window(dit, r: DiTRequest, guidance_scale: float, masks: dict | None = None) -> ODEWindow:
    """A request's ODE at its start: its DiTParts and its noise (`masks`: shared by requests of one call)."""
    return ODEWindow(request_parts(dit, r, guidance_scale >= 1e-5, masks), r.noise.to(r.conditioning.dtype))


def ode_step(dit, windows: list[ODEWindow], times: torch.Tensor, guidance_scale: float) -> None:
    """One Runge-Kutta step of every window, packed along time into one velocity call per evaluation.

    Windows at the same step: transformers' RungeKutta4ODESolver step itself (its `_compute_step`, then
    `state + delta` as its integrate does), so a request stepped alone to the end is `dit.sample`'s mel
    bitwise, and windows packed are dit_sample_batch's. Windows at different steps (a stream's window
    admitted while others were part way): the same arithmetic with each window's own times and step
    size, the step size spread over its frames; each window then gets its lockstep values up to the
    blocking of the time embedding's matrix product over more rows (the bound of tests/stages)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    velocity = DiTVelocity(dit, [], guidance_scale, parts=[w.parts for w in windows])
    x = windows[0].state if len(windows) == 1 else torch.cat([w.state for w in windows], dim=1)
    steps = {w.steps_done for w in windows}
    if len(steps) == 1:
        k = steps.pop()
        start, end = times[k], times[k + 1]
        solver = RungeKutta4ODESolver(function=velocity, initial_value=x)
        delta, _ = solver._compute_step(velocity, start, end - start, end, x)
    else:
        index = torch.tensor([w.steps_done for w in windows], device=times.device)
        start, end = times[index], times[index + 1]
        step = end - start
        frame_step = step.index_select(0, velocity.frame_request).view(1, -1, 1)
        k1 = velocity(start, x)
        k2 = velocity(start + step * (1 / 3), x + frame_step * k1 * (1 / 3))
        k3 = velocity(start + step * (2 / 3), x + frame_step * (k2 - k1 * (1 / 3)))
        k4 = velocity(end, x + frame_step * (k1 - k2 + k3))
        delta = (k1 + 3 * (k2 + k3) + k4) * frame_step / 8
    x = x + delta
    for w, (lo, hi) in zip(windows, velocity.bounds):
        w.state = x if len(windows) == 1 else x[:, lo:hi]
        w.steps_done += 1


def dit_sample_batch(dit, requests: list[DiTRequest], num_steps: int = 10, guidance_scale: float = 0.5,
                     sway_coefficient: float = -1.0) -> list[torch.Tensor]:
    """transformers' Qwen2_5OmniToken2WavDiTModel.sample for several requests in lockstep (packed along
    time), each with its initial noise given, not drawn (a window of a longer request must start from
    that request's noise for its frames): the same time grid (sway), classifier-free guidance and
    Runge-Kutta solver. Returns each request's mel [1, mel, frames]."""
    masks: dict = {}
    windows = [ode_window(dit, r, guidance_scale, masks) for r in requests]
    times = time_grid(num_steps, sway_coefficient, requests[0].conditioning.dtype, windows[0].state.device)
    while not windows[0].done(times):
        ode_step(dit, windows, times, guidance_scale)
    return [w.mel() for w in windows]


def dit_sample(dit, conditioning: torch.Tensor, reference_mel: torch.Tensor, code: torch.Tensor,
               noise: torch.Tensor, num_steps: int = 10, guidance_scale: float = 0.5,
               sway_coefficient: float = -1.0) -> torch.Tensor:
    """dit_sample_batch for one request: its mel [1, mel, frames]."""
    (mel,) = dit_sample_batch(dit, [DiTRequest(conditioning, reference_mel, code, noise)], num_steps,
                              guidance_scale, sway_coefficient)
    return mel
