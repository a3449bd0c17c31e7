"""The batched sampler (SamplingParams live in sampling_params.py, which needs no torch).

The sampler follows Hugging Face `generate` semantics so that our engine's tokens can be compared
against transformers' token for token:

    logits -> allowed tokens (structured outputs) -> banned tokens (min_tokens) -> logit bias
           -> repetition penalty -> presence / frequency penalties
           -> greedy: argmax
           \\-> random: / temperature -> top-k -> top-p -> min-p -> sample

(transformers has no logit bias or presence / frequency penalty: they are OpenAI's and vLLM's, applied
where vLLM applies them: the bias with the other logits processors, before the penalties; the presence
and frequency penalties after the repetition penalty, over the output tokens only.)

Random rows are sampled with an "exponential race" (argmax of probs / Exponential(1) noise), which is
an exact draw from the categorical distribution and lets every seeded request draw its noise from its
*own* generator: a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from omni.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The request's own generator (None when it has no seed or is greedy and needs no randomness).

    Create it once per request and pass it to every `Sampler` call for that request, so its random
    stream continues across steps. `device` must match the logits' device (CPU by default).
    """
    if params.seed is None or params.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    """Picks one token per row of a logits batch. Stateless; per-request state lives in the generators."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        token_histories: Sequence[Sequence[int]] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [N, V]; params/generators one per row; token_histories (prompt + output ids per row)
        are needed only when some row has a repetition penalty, outputs (the output ids so far per row)
        only when some row has a presence or frequency penalty; banned (token ids per row that must not
        be sampled: a request short of its min_tokens bans its eos and stop tokens); allowed ([N, words] int32
        bitmasks, structured_output.py: bit t of row i set when row i may take token t; applied first, so no
        bias or penalty can bring a disallowed token back). Returns int64 token ids [N]."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [num_rows, vocab_size], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {n} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        # Sampling math in fp32 (like HF, which upcasts scores); never modify the caller's tensor.
        logits = logits.float()
        if allowed is not None:
            logits = apply_bitmask(logits, allowed)
        if banned is not None and any(banned):
            logits = ban_tokens(logits, banned)

        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        penalties = [p.repetition_penalty for p in params]
        if any(p != 1.0 for p in penalties):
            if token_histories is None or len(token_histories) != n:
                raise ValueError("repetition_penalty != 1 needs token_histories, one list per row")
            logits = apply_repetition_penalty(logits, penalties, token_histories)
        if any(p.uses_output_penalties for p in params):
            if outputs is None or len(outputs) != n:
                raise ValueError("presence_penalty / frequency_penalty != 0 need outputs, one list per row")
            logits = apply_output_penalties(logits, params, outputs)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)

        out = torch.empty(n, dtype=torch.long, device=logits.device)
        rand_rows = [i for i in range(n) if not greedy[i]]
        if len(rand_rows) < n:
            greedy_rows = [i for i in range(n) if greedy[i]]
            g_idx = torch.tensor(greedy_rows, device=logits.device)
            out[g_idx] = logits[g_idx].argmax(dim=-1)

        r_idx = torch.tensor(rand_rows, device=logits.device)
        rparams = [params[i] for i in rand_rows]
        temps = torch.tensor([p.temperature for p in rparams], device=logits.device)
        scores = logits[r_idx] / temps.unsqueeze(1)
        if any(p.uses_top_k or p.uses_top_p for p in rparams):
            scores = apply_top_k_top_p(
                scores, [p.top_k for p in rparams], [p.top_p for p in rparams]
            )
        if any(p.min_p > 0 for p in rparams):
            scores = apply_min_p(scores, [p.min_p for p in rparams])
        probs = scores.softmax(dim=-1)
        out[r_idx] = _exponential_race(probs, [generators[i] for i in rand_rows])
        return out


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: Sequence[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: the log-probability of its token (`tokens`, on the logits' device) under the row's raw logits
    (fp32 log-softmax) and the `top[i]` most likely (id, log-probability), best first."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).view(-1).tolist()
    k = max(top, default=0)
    best_lp, best_id = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    best_lp, best_id = best_lp.tolist(), best_id.tolist()
    return [(chosen[i], list(zip(best_id[i][:top[i]], best_lp[i][:top[i]]))) for i in range(len(top))]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a row's bitmask ([N, words] int32, bit t of word t // 32) has bit t clear; a copy (the caller's
    fp32 logits are this sampler's own already). Rows whose mask is all ones are left as they are."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [N, words, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def ban_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set the banned token ids of each row to -inf (returns a new tensor; ids past the vocabulary
    are ignored: a stop token the model cannot produce needs no mask)."""
    rows = [i for i, ids in enumerate(banned) for t in ids if 0 <= t < logits.shape[1]]
    cols = [t for ids in banned for t in ids if 0 <= t < logits.shape[1]]
    out = logits.clone()
    if rows:
        out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = -math.inf
    return out


def _token_counts(histories: Sequence[Sequence[int]], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(histories), vocab] on the CPU: how often each token id occurs in each history. Ids >= vocab size
    (an embedding larger than the LM head) cannot be sampled and are not counted."""
    lengths = torch.tensor([len(h) for h in histories])
    flat = torch.tensor(list(itertools.chain.from_iterable(histories)), dtype=torch.long)
    # One extra column absorbs the out-of-vocabulary ids (clamped to `vocab`), then is dropped.
    counts = torch.zeros(len(histories), vocab + 1, dtype=dtype)
    counts.index_put_((torch.repeat_interleave(torch.arange(len(histories)), lengths), flat.clamp(0, vocab)),
                      torch.ones(len(flat), dtype=dtype), accumulate=True)
    return counts[:, :vocab]


def apply_repetition_penalty(
    logits: torch.Tensor, penalties: Sequence[float], token_histories: Sequence[Sequence[int]]
) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor on the rows whose penalty != 1 (returns a new tensor).

    Every token that occurs in the row's history is penalised once: logits < 0 are multiplied by the
    penalty, others divided. Ids >= vocab size (embedding larger than the LM head) cannot be sampled
    and are ignored, as in HF.
    """
    n, vocab = logits.shape
    rows = [i for i, p in enumerate(penalties) if p != 1.0]
    if not rows:
        return logits
    seen = _token_counts([token_histories[i] for i in rows], vocab, logits.dtype).to(logits.device) > 0

    row_idx = torch.tensor(rows, device=logits.device)
    sub = logits[row_idx]
    pen = torch.tensor([penalties[i] for i in rows], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    penalised = torch.where(sub < 0, sub * pen, sub / pen)
    out = logits.clone()
    out[row_idx] = torch.where(seen, penalised, sub)
    return out


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's biases to its logits (returns a new tensor; ids past the vocabulary are ignored:
    the stage refuses them at admission, request_checks.py)."""
    vocab = logits.shape[1]
    rows = [i for i, b in enumerate(biases) if b for t in b if 0 <= t < vocab]
    cols = [t for b in biases if b for t in b if 0 <= t < vocab]
    vals = [v for b in biases if b for t, v in b.items() if 0 <= t < vocab]
    out = logits.clone()
    if rows:
        idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        out[idx] = out[idx] + torch.tensor(vals, dtype=logits.dtype, device=logits.device)
    return out


def apply_output_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """vLLM's presence and frequency penalties on the rows that have one (returns a new tensor): a token
    the row's output holds c > 0 times loses frequency_penalty * c + presence_penalty. Ids >= vocab size
    cannot be sampled and are ignored."""
    n, vocab = logits.shape
    rows = [i for i, p in enumerate(params) if p.uses_output_penalties]
    counts = _token_counts([outputs[i] for i in rows], vocab, logits.dtype).to(logits.device)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype, device=logits.device)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype, device=logits.device)
    row_idx = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[row_idx] = logits[row_idx] - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return out


def apply_min_p(scores: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """HF MinPLogitsWarper per row: tokens whose probability is below min_p times the row's largest are
    set to -inf; the most likely token always stays (min_p 0: nothing is dropped)."""
    probs = scores.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    drop = probs < torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1) * top
    drop.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(drop, -math.inf)


def apply_top_k_top_p(scores: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """HF TopKLogitsWarper then TopPLogitsWarper, per row, masked entries set to -inf.

    top-k keeps every token whose score is >= the k-th largest (ties with it survive, as in HF);
    top-p keeps the smallest set of most likely tokens with cumulative probability >= p, and always
    the most likely token. One ascending sort serves both.
    """
    n, vocab = scores.shape
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)

    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    if any(k < vocab for k in ks):
        k_t = torch.tensor(ks, device=scores.device)
        # Ascending order: the k-th largest sits at position vocab - k.
        kth = sorted_scores.gather(1, (vocab - k_t).unsqueeze(1))
        sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, -math.inf)

    if any(p < 1.0 for p in top_p):
        p_t = torch.tensor(top_p, dtype=scores.dtype, device=scores.device).unsqueeze(1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p_t)
        drop[:, -1] = False  # the most likely token always survives
        sorted_scores = sorted_scores.masked_fill(drop, -math.inf)

    return torch.empty_like(scores).scatter_(1, sorted_idx, sorted_scores)


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One categorical draw per row: argmax(probs / E), E ~ Exponential(1) i.i.d.

    Rows with a generator draw their noise from it alone (batch-independent); the others share one
    draw from the global RNG.
    """
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        if len(unseeded) == len(generators):
            q.exponential_()
        else:
            u_idx = torch.tensor(unseeded, device=probs.device)
            q[u_idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            if g.device.type == probs.device.type:
                q[i].exponential_(generator=g)
            else:  # e.g. a CPU generator for CUDA logits: draw where the generator lives
                q[i] = torch.empty(probs.shape[1], device=g.device).exponential_(generator=g).to(probs.device)
    # A zero draw would turn a masked token (prob 0) into 0/0 = NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)
