"""Pure-PyTorch oracles of the flashspark ops.

Written for clarity, not speed: the tests compare every kernel against these
functions. Randomness uses the same Philox4x32-10 stream as the kernels
(csrc/include/flashspark/philox.h), bit for bit, so given equal seeds the
kernels and the oracles draw identical numbers.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashspark.ops import GREEDY_TEMPERATURE

# Purposes of draws; must match enum Purpose in philox.h.
PURPOSE_ACCEPT = 1
PURPOSE_RESAMPLE = 2
PURPOSE_DRAFT = 3
PURPOSE_PATH = 4

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a constant a and int64 tensor b < 2^32,
    using 16-bit halves so that no intermediate leaves int64."""
    ah, al = a >> 16, a & 0xFFFF
    bh, bl = b >> 16, b & 0xFFFF
    mid = ah * bl + al * bh
    t = al * bl + ((mid & 0xFFFF) << 16)
    return ah * bh + (mid >> 16) + (t >> 32), t & _MASK32


def philox4x32_10(counter: tuple, key: tuple) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors (or ints) holding 32-bit words.

    counter: four words (c0, c1, c2, c3); key: two words (k0, k1); all broadcast.
    Returns the four output words as int64 tensors in [0, 2^32).
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _MASK32 for k in key)
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_M0, c0)
        hi1, lo1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def philox_u32(seed: int, position: int, purpose: int, index: torch.Tensor | int) -> torch.Tensor:
    """32-bit draw for each ``index`` at (seed, position, purpose): lane index%4
    of the Philox block index//4, exactly as ``philox_u32`` in philox.h."""
    index = torch.as_tensor(index, dtype=torch.int64)
    seed &= (1 << 64) - 1
    position &= (1 << 64) - 1
    words = philox4x32_10(
        (index >> 2, position & _MASK32, position >> 32, purpose),
        (seed & _MASK32, seed >> 32),
    )
    out = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    return out.gather(-1, (index & 3).unsqueeze(-1).expand(out.shape[:-1] + (1,))).squeeze(-1)


def uniform_open01(bits: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) from 32-bit draws: (2*(x >> 9) + 1) * 2^-24, exact in fp32."""
    return (((bits >> 9) << 1) | 1).to(torch.float32) * (2.0**-24)


def gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log u): argmax(log r + g) samples from norm(r)."""
    return -torch.log(-torch.log(uniform_open01(bits)))


def _to_int(t) -> int:
    return int(t.item()) if isinstance(t, torch.Tensor) else int(t)


FLOAT_MAX = torch.finfo(torch.float32).max


def drafter_logits(x: torch.Tensor) -> torch.Tensor:
    """How the drafter-side ops read logits and scores: NaN as -inf, +inf as the
    largest finite float (the kernels' drafter_logit)."""
    x = x.float()
    return torch.where(torch.isnan(x), float("-inf"), x).clamp(max=FLOAT_MAX)


def log_softmax_shifted(rows: torch.Tensor, temp: float) -> torch.Tensor:
    """log softmax(rows / temp) computed as (x - max) / temp, as the kernels do, so
    that finite logits never overflow at small temperatures."""
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temp, dtype=torch.float32)  # fp32, as the kernels
    shifted = (rows - rows.max(dim=-1, keepdim=True).values) * inv_t
    return torch.log_softmax(shifted, dim=-1)


def verify_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_spec_len: int,
    draft_probs: Optional[torch.Tensor] = None,
    draft_probs_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle of :func:`flashspark.ops.verify` (same arguments and outputs)."""
    logits = target_logits.detach().float().cpu()
    tokens = draft_tokens.detach().long().cpu()
    cu = cu_num_draft.detach().long().cpu()
    vocab = logits.shape[1]
    batch = cu.numel() - 1
    out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    vocab_ids = torch.arange(vocab)
    for b in range(batch):
        lo, hi = int(cu[b]), int(cu[b + 1])
        n = hi - lo
        rows = logits[lo + b : hi + b + 1]
        temp = float(temperature[b])
        seed, offset = _to_int(seeds[b]), _to_int(offsets[b])
        if temp < GREEDY_TEMPERATURE:
            target = rows.argmax(dim=-1)  # first maximum on ties
            k = 0
            while k < n and int(target[k]) == int(tokens[lo + k]):
                k += 1
            out[b, :k] = tokens[lo : lo + k].int()
            out[b, k] = int(target[k])
            num_accepted[b] = k
            continue
        logp = log_softmax_shifted(rows, temp)
        emitted = None
        k = 0
        for k in range(n):
            x = int(tokens[lo + k])
            q = torch.zeros(vocab)
            if draft_probs is None:
                q[x] = 1.0
            elif draft_probs_ids is None:
                q = draft_probs[lo + k].detach().float().cpu()
            else:
                ids = draft_probs_ids[lo + k].detach().long().cpu()
                probs = draft_probs[lo + k].detach().float().cpu()
                q.index_add_(0, ids, probs)  # an id listed twice counts with the sum of its probabilities
            p_x = logp[k, x].exp()
            u = uniform_open01(philox_u32(seed, offset + k, PURPOSE_ACCEPT, 0))
            if u * q[x] < p_x:
                out[b, k] = x
                continue
            g = gumbel(philox_u32(seed, offset + k, PURPOSE_RESAMPLE, vocab_ids))
            residual = torch.clamp(logp[k].exp() - q, min=0.0)
            key = torch.where(q > 0, torch.log(residual), logp[k]) + g
            if torch.isneginf(key).all():  # p == q: residual empty, fall back to p
                key = logp[k] + g
            emitted = int(key.argmax())
            break
        else:
            k = n
        if emitted is None:
            g = gumbel(philox_u32(seed, offset + n, PURPOSE_RESAMPLE, vocab_ids))
            emitted = int((logp[n] + g).argmax())
        out[b, k] = emitted
        num_accepted[b] = k
    device = target_logits.device
    return out.to(device), num_accepted.to(device)


# ---------------------------------------------------------------- DFlash attention and KV injection


def block_diffusion_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_lens: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Oracle of :func:`flashspark.ops.block_diffusion_attention`.

    q [B, G, Hq, D] block queries; k_cache/v_cache [B, Hkv, S_max, D] context
    K/V, of which request b uses the first ctx_lens[b] positions; k_block /
    v_block [B, G, Hkv, D] the block's own K/V. No mask: every block query sees
    all of its request's context and the whole block. GQA: query head h reads
    KV head h // (Hq // Hkv). Computed in fp32, returned in q's dtype.
    """
    batch, gamma, hq, dim = q.shape
    hkv = k_block.shape[2]
    group = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(ctx_lens[b])
        keys = torch.cat([k_cache[b, :, :n].float(), k_block[b].float().transpose(0, 1)], dim=1)  # [Hkv, n+G, D]
        vals = torch.cat([v_cache[b, :, :n].float(), v_block[b].float().transpose(0, 1)], dim=1)
        keys = keys.repeat_interleave(group, dim=0)  # [Hq, n+G, D]
        vals = vals.repeat_interleave(group, dim=0)
        qb = q[b].float().transpose(0, 1)  # [Hq, G, D]
        probs = torch.softmax(qb @ keys.transpose(1, 2) * scale, dim=-1)
        out[b] = (probs @ vals).transpose(0, 1)
    return out.to(q.dtype)


def rope_cos_sin_cache(max_positions: int, head_dim: int, theta: float) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos(p * f_i) in the first half, sin in the
    second, f_i = theta^(-2i / head_dim) (rotate-half RoPE, as in Qwen3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def inject_context_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Oracle of :func:`flashspark.ops.inject_context_kv` (writes the caches in place).

    For each new context token i: k_cache[slots[i], :, positions[i]] =
    RoPE(RMSNorm(k[i]) * k_norm_weight) and v_cache[slots[i], :, positions[i]] = v[i].
    k, v [N, Hkv, D]; RMSNorm is over D per head, in fp32.
    """
    kf = k.float()
    kf = rms_norm(kf, k_norm_weight.float(), eps)
    half = k.shape[-1] // 2
    cs = cos_sin_cache.float()[positions.long()]  # [N, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = kf[..., :half], kf[..., half:]
    roped = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    slots_l, pos_l = slots.long(), positions.long()
    k_cache[slots_l, :, pos_l] = roped.to(k_cache.dtype)
    v_cache[slots_l, :, pos_l] = v.to(v_cache.dtype)


# ---------------------------------------------------------------- DFlash 2: conv, Top-K, path selection

CONV_GROUP = 16


def rms_norm(x, weight, eps):
    """Qwen3's RMSNorm: normalize in fp32, then scale by weight in x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def two_tap_conv_reference(
    x, base, delta, block_size=0, cu_blocks=None, residual=None, delta_weight=None, norm_weight=None, norm_eps=1e-6
):
    """Oracle of :func:`flashspark.ops.two_tap_conv`.

    out[t, c] = (base[0, c] + delta[t, 0, c // 16]) * x[t, c]
              + (base[1, c] + delta[t, 1, c // 16]) * x[t - 1, c]  (zero at a block's first row)
              (+ residual[t, c]); rows t run over x flattened to [N, C]. With
    `delta_weight` (and delta None), delta = x @ delta_weight.T in fp32. With
    `norm_weight`, x is first RMS-normalized in fp32 (`rms_norm` on fp32 rows).
    """
    shape = x.shape
    channels = shape[-1]
    xf = x.reshape(-1, channels).float()
    if norm_weight is not None:
        xf = rms_norm(xf, norm_weight.float(), norm_eps)
    rows = xf.shape[0]
    groups = (channels + CONV_GROUP - 1) // CONV_GROUP
    if delta_weight is not None:
        delta = xf @ delta_weight.float().t()
    d = delta.reshape(rows, 2, groups).float().repeat_interleave(CONV_GROUP, dim=-1)[..., :channels]
    taps = base.float()[None] + d  # [N, 2, C]
    left = torch.cat([torch.zeros(1, channels, device=x.device), xf[:-1]], dim=0)
    if cu_blocks is not None:
        first = torch.zeros(rows, dtype=torch.bool, device=x.device)
        starts = cu_blocks.long()[:-1]
        first[starts[starts < rows]] = True
    else:
        first = torch.arange(rows, device=x.device) % block_size == 0
    left = torch.where(first[:, None], torch.zeros_like(left), left)
    out = taps[:, 0] * xf + taps[:, 1] * left
    if residual is not None:
        out = out + residual.reshape(-1, channels).float()
    return out.to(x.dtype).reshape(shape)


def topk_select_reference(logits, k):
    """Oracle of :func:`flashspark.ops.topk_select`: the k largest logits per row
    (descending, ties to the lower id) as fp32, their int32 ids, and the row's
    log-sum-exp."""
    lf = drafter_logits(logits)
    values, ids = torch.sort(lf, dim=-1, descending=True, stable=True)  # stable: lower id first on ties
    return values[..., :k].contiguous(), ids[..., :k].to(torch.int32).contiguous(), torch.logsumexp(lf, dim=-1)


def path_pair_scores_reference(cand_ids, unary, a_emb, b_emb, g, prev_tokens, t):
    """S_t(a, b) = U_t(b) + <A[prev_a] * g_t, B[cand_t(b)]> for every listed predecessor a."""
    ag = a_emb.float()[prev_tokens.long()] * g.float()[t]  # [n_prev, r]
    return unary[t].float()[None, :] + ag @ b_emb.float()[cand_ids[t].long()].T


def path_select_reference(
    cand_ids, unary, a_emb, b_emb, g, anchor, mode, temperature, seeds, offsets, hidden=None, g_weight=None
):
    """Oracle of :func:`flashspark.ops.path_select` (plain loops over requests and positions).
    With g None, g = hidden @ g_weight.T in fp32."""
    if g is None:
        g = hidden.float() @ g_weight.float().t()
    requests, positions, k = cand_ids.shape
    tokens = torch.empty(requests, positions, dtype=torch.int32)
    choice = torch.empty(requests, positions, dtype=torch.int32)
    scores = torch.empty(requests, positions, k)
    q = torch.zeros(requests, positions, k)
    for r in range(requests):
        cid, un, gr = cand_ids[r].cpu(), unary[r].cpu(), g[r].cpu()
        anchor_r = anchor[r : r + 1].cpu()
        if mode == "backtrack":
            lattice = [
                drafter_logits(
                    path_pair_scores_reference(
                        cid, un, a_emb.cpu(), b_emb.cpu(), gr, anchor_r if t == 0 else cid[t - 1], t
                    )
                )
                for t in range(positions)
            ]
            best = lattice[0][0].clone()
            back = []
            for t in range(1, positions):
                total = best[:, None] + lattice[t]  # [a, b]
                best, arg = total.max(dim=0)  # ties: the lowest a
                best = drafter_logits(best)  # sums past the largest float stay finite, as in the kernel
                back.append(arg)
            c = int(best.argmax())
            path = [c]
            for arg in reversed(back):
                c = int(arg[c])
                path.append(c)
            path.reverse()
            for t, c in enumerate(path):
                scores[r, t] = lattice[t][0 if t == 0 else path[t - 1]]
                q[r, t, c] = 1.0
                choice[r, t] = c
            continue
        prev = anchor_r
        temp = float(temperature[r])
        for t in range(positions):
            row = drafter_logits(path_pair_scores_reference(cid, un, a_emb.cpu(), b_emb.cpu(), gr, prev, t)[0])
            scores[r, t] = row
            if mode == "sample" and temp >= GREEDY_TEMPERATURE and bool(torch.isfinite(row).any()):
                logp = log_softmax_shifted(row, temp)
                q[r, t] = logp.exp()
                noise = gumbel(philox_u32(_to_int(seeds[r]), _to_int(offsets[r]) + t, PURPOSE_PATH, torch.arange(k)))
                c = int((logp + noise).argmax())
            else:
                c = int(row.argmax())
                q[r, t, c] = 1.0
            choice[r, t] = c
            prev = cid[t, c : c + 1]
    for r in range(requests):
        tokens[r] = cand_ids[r].cpu().gather(-1, choice[r].long()[:, None]).squeeze(-1).int()
    device = cand_ids.device
    return tokens.to(device), choice.to(device), scores.to(device), q.to(device)


# ---------------------------------------------------------------- DSpark Markov step


def markov_step_reference(
    base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions
):
    """Oracle of :func:`flashspark.ops.markov_step`."""
    batch, vocab = base_logits.shape
    e = w1.float()[prev_tokens.long()]  # [B, r]
    logits = base_logits.float() + e @ w2.float().T  # [B, V]
    if bias is not None:
        logits = logits + bias.float()
    logits = drafter_logits(logits)
    tokens = torch.empty(batch, dtype=torch.int32)
    q = torch.zeros(batch, vocab)
    for b in range(batch):
        t = float(temperature[b])
        z = logits[b].cpu()
        if t < GREEDY_TEMPERATURE or not bool(torch.isfinite(z).any()):
            c = int(z.argmax())  # all -inf: token 0
            q[b, c] = 1.0
        else:
            q[b] = log_softmax_shifted(z, t).exp()
            # The race key z / T + g in fp64, as the kernel compares it across tiles.
            noise = gumbel(philox_u32(_to_int(seeds[b]), _to_int(positions[b]), PURPOSE_DRAFT, torch.arange(vocab)))
            c = int((z.double() * (1.0 / t) + noise.double()).argmax())
        tokens[b] = c
    feats = torch.cat([hidden.float(), e], dim=-1)
    conf = torch.sigmoid(feats @ conf_w.float() + conf_b.float().reshape(()))
    device = base_logits.device
    return tokens.to(device), q.to(device), conf.to(device)
