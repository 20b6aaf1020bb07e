"""common/drift.py: the drift diagnostics every script logs, each checked against a direct computation of its
definition (docs/grpo.md, "Logged metrics"); tests/test_reproducible.py checks them in every script's runs."""

import math

import pytest
import torch

from common.drift import drift_metrics, ess

pytestmark = pytest.mark.unit


def ess_by_definition(log_w: list[float]) -> float:
    """(sum w)^2 / (n sum w^2), in plain floats."""
    w = [math.exp(x) for x in log_w]
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w))


def test_ess_of_equal_weights_is_one_and_of_one_dominant_weight_is_one_over_n():
    assert ess(torch.zeros(7)) == pytest.approx(1.0)
    assert ess(torch.full((5,), 3.0)) == pytest.approx(1.0)  # any common scale
    assert ess(torch.tensor([0.0, 0.0, 0.0, 200.0])) == pytest.approx(0.25)  # w = e^200 outweighs the rest
    assert ess(torch.tensor([])) == 1.0


def test_ess_matches_its_definition_and_survives_sequence_sized_log_weights():
    g = torch.Generator().manual_seed(0)
    log_w = torch.randn(50, generator=g)
    assert ess(log_w) == pytest.approx(ess_by_definition(log_w.tolist()), rel=1e-12)
    # products of hundreds of token ratios: e^900 overflows a float, the shifted computation does not
    big = torch.tensor([900.0, 899.0, 0.0])
    expected = ess_by_definition([1.0, 0.0, -900.0])  # the same weights scaled by e^-899
    assert ess(big) == pytest.approx(expected, rel=1e-12) and math.isfinite(ess(big))


def test_drift_metrics_match_their_definitions():
    g = torch.Generator().manual_seed(1)
    n = 40
    logp_behav = -torch.rand(n, generator=g) * 3
    logp = logp_behav + 0.3 * torch.randn(n, generator=g)
    seq = torch.tensor([7] * 10 + [2] * 5 + [9] * 25)  # response ids: any integers, tokens of a response adjacent
    corrected = torch.rand(n, generator=g) < 0.3
    fresh = torch.tensor([False] * 15 + [True] * 25)  # only response 9 was sampled by the trained weights
    out = drift_metrics(logp, logp_behav, seq, corrected, fresh=fresh)
    d = (logp.double() - logp_behav.double()).tolist()
    seq_sums = [sum(d[:10]), sum(d[10:15]), sum(d[15:])]
    assert out["async/ess"] == pytest.approx(ess_by_definition(d), rel=1e-12)
    assert out["async/ess_seq"] == pytest.approx(ess_by_definition(seq_sums), rel=1e-12)
    assert out["async/log_ratio_m2"] == pytest.approx(sum(x * x for x in d) / n, rel=1e-12)
    assert out["async/corrected_frac"] == pytest.approx(corrected.sum().item() / n)
    k3 = [math.exp(x) - 1 - x for x in d[15:]]  # k3 of KL(mu || pi_theta): w - 1 - log w, tokens sampled from mu
    assert out["async/mismatch_kl"] == pytest.approx(sum(k3) / 25, rel=1e-12)
    assert out["async/mismatch_kl"] >= 0


def test_drift_metrics_fresh_flag_none_corrected_and_identical_policies():
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.1])
    seq = torch.tensor([0, 0, 1, 1])
    stale = drift_metrics(logp, logp - 0.2, seq, None, fresh=False)
    assert "async/mismatch_kl" not in stale  # no token sampled by the trained weights: not logged
    assert stale["async/corrected_frac"] == 0.0  # an algorithm without a correction
    assert stale["async/ess"] == pytest.approx(1.0) and stale["async/log_ratio_m2"] == pytest.approx(0.04)
    same = drift_metrics(logp, logp.clone(), seq, torch.zeros(4, dtype=torch.bool), fresh=True)
    assert same == {
        "async/ess": 1.0,
        "async/ess_seq": 1.0,
        "async/log_ratio_m2": 0.0,
        "async/corrected_frac": 0.0,
        "async/mismatch_kl": 0.0,
    }
    empty = drift_metrics(torch.tensor([]), torch.tensor([]), torch.tensor([], dtype=torch.long), None, fresh=True)
    assert empty == {"async/ess": 1.0, "async/ess_seq": 1.0, "async/log_ratio_m2": 0.0, "async/corrected_frac": 0.0}


def test_sequence_ess_weights_a_response_by_its_whole_ratio():
    # two responses with the same token ratios in total: equal sequence weights, though the tokens differ
    logp_behav = torch.zeros(5)
    logp = torch.tensor([0.5, 0.5, 1.0, 0.0, 0.0])
    out = drift_metrics(logp, logp_behav, torch.tensor([0, 0, 1, 1, 1]), None)
    assert out["async/ess_seq"] == pytest.approx(1.0)
    assert out["async/ess"] < 1.0
