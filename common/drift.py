"""Drift diagnostics that every script logs under the same names: how far the policy being trained has moved from
the behaviour policy mu that sampled its data, and how much of the minibatch the algorithm's correction removed."""

import torch


def ess(log_w: torch.Tensor) -> float:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) of the weights w = exp(log_w): 1 when all are equal,
    1/n when one dominates. It is computed from log w shifted by its maximum (the value does not change when every
    weight is scaled), so that sequence weights, which are products of many token ratios, cannot overflow."""
    if log_w.numel() == 0:
        return 1.0
    x = log_w.double()
    w = torch.exp(x - x.max())
    return (w.sum() ** 2 / (w.numel() * (w * w).sum())).item()


def drift_metrics(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    seq: torch.Tensor,
    corrected: torch.Tensor | None = None,
    fresh: bool | torch.Tensor = False,
) -> dict[str, float]:
    """The async/ drift diagnostics of one minibatch (docs/grpo.md, "Logged metrics").

    Every argument holds one value per response token of the minibatch: ``logp`` under the policy being trained
    (before its step), ``logp_behav`` under the behaviour policy mu (the engine's log-probs of the sampled tokens),
    ``seq`` the id of the token's response, ``corrected`` True where the algorithm's correction removed the token's
    gradient (None: the algorithm has no such correction), ``fresh`` True for tokens sampled by the very weights
    being trained (staleness 0; a bool applies to all tokens). With w = pi_theta / mu per token:

    - async/ess: normalised ESS of the token weights w (ess);
    - async/ess_seq: normalised ESS of the sequence weights, the product of w over each response's tokens;
    - async/log_ratio_m2: mean (log pi_theta - log mu)^2 over tokens (M2PO's second moment M2);
    - async/corrected_frac: the share of tokens in ``corrected``;
    - async/mismatch_kl, only when some token is fresh: the k3 estimate of KL(mu || pi_theta) over the fresh tokens,
      mean of w - 1 - log w (the tokens are samples of mu): engine/trainer mismatch, apart from staleness.
    """
    d = (logp - logp_behav).double()
    if d.numel() == 0:
        return {"async/ess": 1.0, "async/ess_seq": 1.0, "async/log_ratio_m2": 0.0, "async/corrected_frac": 0.0}
    ids = torch.unique(seq, return_inverse=True)[1]
    seq_log_w = torch.zeros(int(ids.max()) + 1, dtype=d.dtype, device=d.device).index_add_(0, ids, d)
    out = {
        "async/ess": ess(d),
        "async/ess_seq": ess(seq_log_w),
        "async/log_ratio_m2": (d * d).mean().item(),
        "async/corrected_frac": corrected.double().mean().item() if corrected is not None else 0.0,
    }
    f = fresh if torch.is_tensor(fresh) else torch.full_like(d, bool(fresh), dtype=torch.bool)
    if f.any():
        out["async/mismatch_kl"] = (torch.exp(d[f]) - 1.0 - d[f]).mean().item()
    return out
