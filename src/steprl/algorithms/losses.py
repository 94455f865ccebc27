"""Policy losses, regularisers and loss aggregation: pure functions over (B, T) tensors.

Shapes: B rows (packed trajectories or steps), T token positions. `mask` is 1 on action tokens
(sampled by the policy) and 0 on prompt, observation and padding tokens. Policy losses return
per-token losses; `aggregate` reduces them to the scalar that is back-propagated.

Full actor loss per micro-batch (verl `dp_actor.py`):
    pg = aggregate(policy_loss.loss_per_token) - entropy_coef * aggregate(entropy)
         + kl_coef * aggregate(kl_penalty(logp, ref_logp, kind))
All three use the same mode and the same global denominators. Formulas and sources:
`reference/algorithms.md` sections 0.1-0.3, 1.6, 2 and 11.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

#: Loss aggregation modes accepted by `aggregate` (verl `agg_loss`, algorithms.md section 0.2).
AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

#: KL estimator names accepted by `kl_penalty` (verl aliases: kl=k1, mse=k2, low_var_kl=k3).
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+")
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: large enough for any real ratio, small enough to stay finite


@dataclass(frozen=True)
class PolicyLossOutput:
    """Per-token outputs of a policy loss, all (B, T). Aggregate `loss_per_token` with the mask."""

    loss_per_token: torch.Tensor  # to be aggregated with the mask
    clipped: torch.Tensor  # bool, where the clipped branch was taken (verl pg_clipfrac)
    log_ratio: torch.Tensor  # logp - old_logp (or - prox_logp), clamped to [-20, 20]
    clipped_lower: torch.Tensor | None = None  # bool, dual clip bound the loss (verl pg_clipfrac_lower)
    dropped: torch.Tensor | None = None  # bool, tokens masked out by the behaviour-weight cap
    behav_weight: torch.Tensor | None = None  # detached behaviour importance weight actually applied


# --------------------------------------------------------------------------------------------
# policy losses


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017; verl `compute_policy_loss_vanilla`).

    ratio = exp(clamp(logp - old_logp, -20, 20));
    L = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)).
    clip_high > clip_low is DAPO's clip-higher. With `dual_clip_c = c` (Ye et al. 2020, verl
    `clip_ratio_c`, default there 3.0, DAPO 10.0) the loss of negative-advantage tokens is also
    capped at -A * c, so a huge ratio on a bad token cannot blow up the update:
    L = min(-A * c, L) where A < 0.
    All inputs (B, T); returns per-token losses, `clipped` (pg2 > pg1) and `clipped_lower`
    (A < 0 and the dual cap was binding; all False without dual clip).
    """
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(
            f"dual_clip_c must be > 1 (got {dual_clip_c}); use e.g. 3.0 (verl) or 10.0 (DAPO), "
            "or None to disable dual clipping"
        )
    log_ratio = torch.clamp(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip_c is None:
        return PolicyLossOutput(clip1, clipped, log_ratio, clipped_lower=torch.zeros_like(clipped))
    pg3 = -advantages * dual_clip_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(pg3, clip1), clip1)
    return PolicyLossOutput(loss, clipped, log_ratio, clipped_lower=negative & (clip1 > pg3))


def loop_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *, eps: float = 0.1
) -> PolicyLossOutput:
    """LOOP's PPO objective (Chen et al. 2025, arXiv 2502.01600; apple/ml-loop `rl_utils.py`).

    rho = exp(clamp(logp - old_logp, -20, 20)); clip_max = 1 + eps; clip_min = 1 / (1 + eps)
    (note 1/(1+eps), not 1-eps); g(A) = clip_max * A if A >= 0 else clip_min * A;
    obj = min(rho * A, g(A)); loss = -obj. The value equals `ppo_clip` with
    clip_low = 1 - 1/(1+eps), clip_high = eps. LOOP aggregates per rollout then divides by the
    fixed minibatch size: `aggregate(..., "seq-mean-token-mean", num_seqs=minibatch_size)`.
    All inputs (B, T). `clipped` marks tokens where g(A) was the smaller term.
    """
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0 (got {eps}); LOOP uses ppo_epsilon=0.1")
    log_ratio = torch.clamp(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    surrogate = torch.exp(log_ratio) * advantages
    bound = torch.where(advantages >= 0, (1.0 + eps) * advantages, advantages / (1.0 + eps))
    obj = torch.minimum(surrogate, bound)
    return PolicyLossOutput(-obj, bound < surrogate, log_ratio)


_BEHAV_MODES = ("mask", "truncate", "none")


def decoupled_ppo(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_cap: float | None = 5.0,
    behav_mode: str = "mask",
    dual_clip_c: float | None = None,
) -> PolicyLossOutput:
    """AReaL's decoupled PPO for stale rollouts (Fu et al. 2025, arXiv 2505.24298; inclusionAI/AReaL
    `ppo_actor_loss_fn`; algorithms.md section 11).

    u = pi / pi_prox: the trust region is centred on the proximal policy (the learner's weights
    before this step's updates), not on the stale behaviour policy that sampled the tokens.
    loss = w * ppo_clip(logp, prox_logp, A), with the behaviour weight
    w = exp(clamp(prox_logp - behav_logp, -20, 20)), detached. `behav_mode`:
      "mask"     tokens with w > behav_cap are dropped (loss 0, `dropped` True); AReaL's old default
                 (`behave_imp_weight_cap=5`, token_mask). Aggregate with the ORIGINAL mask, so dropped
                 tokens still count in the denominator, as AReaL does; the dropped fraction is
                 `masked_mean(out.dropped.float(), mask)`.
      "truncate" w = min(w, behav_cap).
      "none"     no behaviour weight (w = 1): AReaL with `rejection_sampling=None`.
    behav_cap=None applies w uncapped in "mask"/"truncate" mode.
    Only `logp` carries gradient (prox and behav are detached). With staleness 0
    (prox == behav) w is exactly 1 and this equals `ppo_clip(logp, prox_logp, A)` bit for bit.
    All inputs (B, T).
    """
    if behav_mode not in _BEHAV_MODES:
        raise ValueError(f"unknown behav_mode {behav_mode!r}; allowed: {list(_BEHAV_MODES)}")
    if behav_cap is not None and not behav_cap >= 1.0:
        raise ValueError(
            f"behav_cap must be >= 1 (got {behav_cap}): a cap below 1 would drop or shrink on-policy "
            "tokens (w = 1); AReaL uses 5.0, None disables the cap"
        )
    out = ppo_clip(
        logp,
        prox_logp.detach(),
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
    )
    no_drop = torch.zeros_like(out.clipped)
    if behav_mode == "none":
        return replace(out, dropped=no_drop, behav_weight=torch.ones_like(out.loss_per_token))
    with torch.no_grad():
        behav_log = torch.clamp(prox_logp - behav_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        weight = torch.exp(behav_log).to(out.loss_per_token.dtype)
        dropped = no_drop
        if behav_cap is not None and behav_mode == "mask":
            dropped = weight > behav_cap
            weight = torch.where(dropped, torch.zeros_like(weight), weight)
        elif behav_cap is not None:
            weight = torch.clamp(weight, max=behav_cap)
    return replace(out, loss_per_token=out.loss_per_token * weight, dropped=dropped, behav_weight=weight)


# --------------------------------------------------------------------------------------------
# regularisers: KL and entropy


def _kl_value(diff: torch.Tensor, kind: str) -> torch.Tensor:
    """diff = logp - ref_logp."""
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    d = torch.clamp(-diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # k3: log(ref / pi)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) (Schulman, http://joschu.net/blog/kl-approx.html;
    verl `kl_penalty_forward`; algorithms.md section 0.3).

    k1 ("kl"):          logp - ref
    abs:                |logp - ref|
    k2 ("mse"):         0.5 * (logp - ref)^2
    k3 ("low_var_kl"):  d = clamp(ref - logp, -20, 20); clamp(exp(d) - d - 1, -10, 10)
    "<kind>+":          straight-through: the forward value of <kind>, the gradient of k2
                        (k2's gradient, logp - ref, is the unbiased KL gradient).
    logp, ref_logp: same shape, typically (B, T); returns that shape. Aggregate with the mask.
    """
    straight_through = kind.endswith("+")
    base = _KL_ALIASES.get(kind.removesuffix("+"), kind.removesuffix("+"))
    if base not in ("k1", "k2", "k3", "abs"):
        raise ValueError(
            f"unknown KL kind {kind!r}; allowed: {list(KL_KINDS)} (aliases: {sorted(_KL_ALIASES)}, "
            "each also with a '+' suffix); 'full' needs whole distributions and is not supported"
        )
    diff = logp - ref_logp
    value = _kl_value(diff, base)
    if not straight_through:
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


def kl_in_reward(
    token_rewards: torch.Tensor,
    logp_old: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
) -> torch.Tensor:
    """KL applied in the reward (verl `apply_kl_penalty`, `algorithm.use_kl_in_reward`):
    r'[b, t] = r[b, t] - beta * kl(old_logp, ref_logp)[b, t] * mask[b, t].

    Uses the behaviour (old) log-probs, so it carries no gradient. All inputs (B, T); returns (B, T).
    """
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (got {beta})")
    with torch.no_grad():
        kl = kl_penalty(logp_old.detach(), ref_logp.detach(), kind)
        return token_rewards - beta * kl * mask


def adaptive_kl_beta(beta: float, observed_kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Adaptive KL coefficient (Ziegler et al. 2019; verl `AdaptiveKLController.update`).

    beta * (1 + clip(observed_kl / target - 1, -0.2, 0.2) * n_steps / horizon).
    verl passes n_steps = the number of samples in the batch; defaults target=0.1, horizon=10000.
    """
    if not target > 0 or not horizon > 0:
        raise ValueError(f"target ({target}) and horizon ({horizon}) must be > 0; verl uses 0.1 and 10000")
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


@dataclass(frozen=True)
class AdaptiveKLController:
    """Immutable adaptive-KL state: `ctl = ctl.update(kl, n)` returns the next controller."""

    beta: float = 0.001  # verl kl_ctrl.kl_coef
    target: float = 0.1
    horizon: int = 10000

    def update(self, observed_kl: float, n_steps: int) -> AdaptiveKLController:
        return replace(
            self, beta=adaptive_kl_beta(self.beta, observed_kl, self.target, n_steps, self.horizon)
        )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: (B, T, V) -> (B, T), in float32.

    H = -sum_v p_v log p_v via log_softmax. Positions with -inf logits (banned tokens) contribute
    exactly 0 with finite gradients. The bonus enters the loss as `- coef * aggregate(entropy, mask)`.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    finite_logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return -(logp.exp() * finite_logp).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1; 0 when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def approx_kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token (Schulman, http://joschu.net/blog/kl-approx.html).

    d = clamp(ref - logp, -20, 20); k3 = exp(d) - d - 1 >= 0. Unlike `kl_penalty(..., "k3")` the
    result is not clamped to [-10, 10] (a diagnostic, not a loss term).
    """
    d = torch.clamp(ref_logp - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


# --------------------------------------------------------------------------------------------
# value loss and aggregation


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.5,
    mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """Clipped value loss (verl `compute_value_loss`, `critic.cliprange_value=0.5`).

    0.5 * aggregate(max((V - R)^2, (clamp(V, V_old - clip, V_old + clip) - R)^2)); with clip=None
    only the unclipped term. All inputs (B, T); the denominators are passed to `aggregate`.
    """
    unclipped = (values - returns).square()
    if clip is None:
        per_token = unclipped
    else:
        if not clip > 0:
            raise ValueError(f"value clip must be > 0 (got {clip}); verl uses 0.5, None disables it")
        clipped_v = torch.clamp(values, old_values - clip, old_values + clip)
        per_token = torch.maximum(unclipped, (clipped_v - returns).square())
    agg = aggregate(
        per_token, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor
    )
    return 0.5 * agg


def num_valid_seqs(mask: torch.Tensor) -> int:
    """Rows of a (B, T) mask with at least one valid token: the `num_seqs` of `aggregate`."""
    return int((mask.sum(-1) > 0).sum().item())


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar (verl `agg_loss`; algorithms.md section 0.2).

    token-mean               sum(L*M) / num_tokens                  (DAPO token-level loss)
    seq-mean-token-sum       sum_b sum_t(L*M) / num_seqs
    seq-mean-token-mean      sum_b [sum_t(L*M) / sum_t M] / num_seqs (original GRPO, LOOP)
    seq-mean-token-sum-norm  sum(L*M) / scale_factor                (Dr. GRPO; pin the constant,
                             e.g. the max response length; it is NOT divided by the row count)
    Denominators default to this batch's counts: num_tokens = sum(M), num_seqs = rows with at least
    one valid token (fully masked rows are excluded, as at verl HEAD). Pass the counts of the whole
    mini-batch (`num_valid_seqs`) when micro-batching: then the SUM of the micro-batch losses equals
    the mini-batch loss, in value and gradient (micro-batch 1x8 == 8x1).
    Masked positions never leak in (even NaN/inf there). No valid token gives 0, never NaN.
    Worked example: L=[[1,2,3,x],[4,x,x,x]], M=[[1,1,1,0],[1,0,0,0]] -> 2.5 / 5.0 / 3.0 / 2.5 (factor 4).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; allowed: {list(AGGREGATION_MODES)}")
    for name, value in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0 (got {value})")
    mask = mask.to(loss.dtype)
    masked = torch.where(mask != 0, loss * mask, torch.zeros_like(loss))
    if mode == "token-mean":
        denom = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
        return masked.sum() / max(denom, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if scale_factor is None:
            raise ValueError(
                "seq-mean-token-sum-norm needs a constant scale factor: set algorithm.loss_scale_factor "
                "(e.g. the max response length, Dr. GRPO)"
            )
        if not (scale_factor > 0 and math.isfinite(scale_factor)):
            raise ValueError(f"loss_scale_factor must be a finite number > 0 (got {scale_factor})")
        return masked.sum() / float(scale_factor)
    row_sums = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        row_tokens = mask.sum(-1)
        row_sums = row_sums / torch.where(row_tokens > 0, row_tokens, torch.ones_like(row_tokens))
    denom = float(num_valid_seqs(mask)) if num_seqs is None else float(num_seqs)
    return row_sums.sum() / max(denom, 1.0)
