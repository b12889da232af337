"""Paired statistics against hand-computed values, and the goal verdict on synthetic outcomes."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from kvcomm.eval_report import markdown_table, summarize
from kvcomm.metrics import (
    GOAL_LOWER_BOUND,
    NOT_ABOVE_CHANCE,
    UNDECIDED,
    above_chance,
    discordant_counts,
    first_token_kl,
    goal_verdict,
    mcnemar_exact,
    median_ci,
    min_text_right_to_pass,
    relative_ci,
    retention_ci,
    simultaneous_level,
)


def test_mcnemar_exact_matches_binomial_tails_by_hand():
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2 * P[Binom(5, 1/2) = 0]
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # 2 * P[Binom(10, 1/2) <= 1]
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)  # two-sided: the direction does not matter
    assert mcnemar_exact(2, 6) == pytest.approx(2 * (1 + 8 + 28) / 256)
    assert mcnemar_exact(3, 3) == 1.0  # 2 * 42/64 > 1 is capped
    assert mcnemar_exact(0, 0) == 1.0  # no discordant pair, no evidence
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_discordant_counts_pair_examples():
    text = [1, 1, 1, 0, 0, 1]
    proto = [1, 0, 0, 1, 0, 1]
    assert discordant_counts(proto, text) == (2, 1)  # two lost, one gained, concordant ones ignored
    with pytest.raises(ValueError):
        discordant_counts([1, 0], [1])


def test_first_token_kl_of_known_distributions():
    p, q = torch.tensor([0.5, 0.5], dtype=torch.float64).log(), torch.tensor([0.9, 0.1], dtype=torch.float64).log()
    # 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5 ln(25/9) = ln(5/3)
    assert first_token_kl(p, q) == pytest.approx(math.log(5 / 3), rel=1e-9)
    # the other direction: 0.9 ln(1.8) + 0.1 ln(0.2)
    assert first_token_kl(q, p) == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), rel=1e-9)
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    assert first_token_kl(logits, logits + 3.0) == pytest.approx(0.0, abs=1e-12)  # softmax ignores a shift
    assert first_token_kl(logits, logits * 0.5) > 0.05
    # a zero-probability reference token contributes nothing (no nan from -inf - -inf)
    assert first_token_kl(np.array([0.0, -np.inf]), np.array([0.0, 0.0])) == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        first_token_kl(np.zeros(3), np.zeros(4))


def _paired_outcomes(rng, n: int, text_acc: float, keep: float) -> tuple[np.ndarray, np.ndarray]:
    """text right with prob text_acc; the protocol keeps each right answer with prob ``keep``
    (true ratio = keep) and never fixes a wrong one."""
    text = (rng.random(n) < text_acc).astype(float)
    proto = text * (rng.random(n) < keep)
    return proto, text


def test_ratio_ci_covers_the_true_ratio_at_about_95_percent():
    rng = np.random.default_rng(7)
    covered = 0
    trials = 200
    for i in range(trials):
        proto, text = _paired_outcomes(rng, 150, 0.7, 0.85)
        _, lo, hi = relative_ci(proto, text, num_resamples=500, seed=i)
        covered += lo <= 0.85 <= hi
    # binomial(200, 0.95) is within [0.88, 0.99] with overwhelming probability; a CI that ignored the
    # pairing (or were a point) would fall far outside
    assert 0.88 <= covered / trials <= 0.99


def test_retention_excludes_a_rate_it_should_and_the_goal_follows():
    rng = np.random.default_rng(1)
    proto, text = _paired_outcomes(rng, 2000, 0.7, 0.80)
    kept, lo, hi = retention_ci(proto, text)
    assert lo <= 0.80 <= hi and hi < 0.95  # true rate inside, the goal (and 1.0) excluded
    assert goal_verdict(kept, lo, hi, 0.1, num_text_right=100) == "no"
    same, same_text = _paired_outcomes(rng, 2000, 0.7, 1.0)
    assert goal_verdict(*retention_ci(same, same_text), 0.1, num_text_right=int(same_text.sum())) == "yes"
    small, small_text = _paired_outcomes(np.random.default_rng(3), 20, 0.7, 0.9)
    kept, lo, hi = retention_ci(small, small_text)
    assert lo < 0.90 and hi >= 0.95 and goal_verdict(kept, lo, hi, 0.1, num_text_right=100) == UNDECIDED


def test_retention_is_not_fooled_by_lucky_gains_as_the_ratio_of_sums_is():
    """54 right under text, 43 of them kept, 11 lucky gains elsewhere: the sums' ratio reads 1.0."""
    text = np.array([1] * 54 + [0] * 46, dtype=float)
    proto = np.array([1] * 43 + [0] * 11 + [1] * 11 + [0] * 35, dtype=float)
    assert relative_ci(proto, text)[0] == pytest.approx(1.0)
    assert retention_ci(proto, text)[0] == pytest.approx(43 / 54)


def test_goal_verdict_cases():
    enough = min_text_right_to_pass(GOAL_LOWER_BOUND)
    assert enough == 29  # perfect retention's exact one-sided 95 % bound first reaches 0.90 at 29
    assert goal_verdict(0.97, 0.91, 1.0, 0.1, num_text_right=enough) == "yes"
    assert goal_verdict(0.95, 0.90, 1.0, 0.15, num_text_right=enough) == "yes"  # bounds inclusive
    assert goal_verdict(0.97, 0.91, 1.0, 0.1, num_text_right=enough - 1) == UNDECIDED
    assert goal_verdict(0.94, 0.91, 0.99, 0.0, num_text_right=enough) == UNDECIDED  # point under the goal
    assert goal_verdict(0.85, 0.80, 0.94, 0.0, num_text_right=enough) == "no"  # the whole interval below 0.95
    assert goal_verdict(0.99, 0.98, 1.00, 0.16, num_text_right=enough) == "no"  # too much recomputed
    assert goal_verdict(1.0, 1.0, 1.0, 0.0, num_text_right=99, text_above_chance=False) == NOT_ABOVE_CHANCE
    assert goal_verdict(float("nan"), float("nan"), float("nan"), 0.0, num_text_right=0) == UNDECIDED


def test_a_handful_of_agreeing_examples_cannot_pass():
    # text and the protocol both right on the same 3 of 3: every bootstrap resample keeps all, so the
    # interval is the point [1, 1]; that is not evidence of keeping 90 % of text
    kept, lo, hi = retention_ci([1, 1, 1], [1, 1, 1])
    assert lo == hi == kept == 1.0
    assert goal_verdict(kept, lo, hi, 0.0, num_text_right=3) == UNDECIDED
    k = min_text_right_to_pass(GOAL_LOWER_BOUND)
    assert 0.05 ** (1 / k) >= 0.90 > 0.05 ** (1 / (k - 1))
    assert goal_verdict(kept, lo, hi, 0.0, num_text_right=k) == "yes"
    assert min_text_right_to_pass() == 59  # the stretch goal's (0.95) floor


def test_simultaneous_level_and_the_chance_guard():
    assert simultaneous_level(1) == pytest.approx(0.95) and simultaneous_level(5) == pytest.approx(0.99)
    narrow = retention_ci(*_paired_outcomes(np.random.default_rng(4), 300, 0.7, 0.9), level=0.95)
    wide = retention_ci(*_paired_outcomes(np.random.default_rng(4), 300, 0.7, 0.9), level=simultaneous_level(5))
    assert wide[1] < narrow[1] and wide[2] >= narrow[2]  # more protocols, wider intervals
    # 1/4 chance: 14 of 40 (0.35) is not above it by its one-sided 95 % bound; 20 of 40 is
    assert not above_chance(14, 40, 0.25) and above_chance(20, 40, 0.25)
    assert above_chance(0, 10, None)  # free text: no chance rate to beat


def test_median_ci():
    med, lo, hi = median_ci(np.arange(1, 10, dtype=float))
    assert med == 5.0 and lo < 5.0 < hi and 1.0 <= lo and hi <= 9.0
    assert median_ci([2.0, np.nan, 2.0]) == (2.0, 2.0, 2.0)  # missing values are left out
    assert all(math.isnan(x) for x in median_ci([np.nan]))


def _rows(n: int, lost: int) -> pd.DataFrame:
    """text right on every example; 'kv-a' loses ``lost`` of them, 'kv-b' none."""
    rows = []
    for i in range(n):
        for proto, em, kl in (("text", 1.0, 0.0), ("kv-a", float(i >= lost), 0.1 + i / n), ("kv-b", 1.0, 0.01)):
            rows.append(dict(task="t", index=i, protocol=proto, em=em, f1=em, prefill_s=1.0, prediction=str(em),
                             num_imported=10, num_recomputed=0 if proto != "text" else 10, kl_text=kl))
    return pd.DataFrame(rows)


def test_summary_reports_mcnemar_kl_and_undecided_goal():
    s = summarize(_rows(10, 1)).set_index("protocol")
    assert (s.loc["kv-a", "text_only_right"], s.loc["kv-a", "protocol_only_right"]) == (1, 0)
    assert s.loc["kv-a", "mcnemar_p"] == 1.0 and s.loc["kv-b", "mcnemar_p"] == 1.0
    assert s.loc["kv-a", "kl_median"] == pytest.approx(np.median(0.1 + np.arange(10) / 10))
    assert s.loc["kv-a", "goal"] == UNDECIDED and not s.loc["kv-a", "meets_goal"]  # 0.9 with n = 10
    # kv-b matches text on all 10, yet 10 agreeing examples cannot show 95 % kept; 59 can
    assert s.loc["kv-b", "goal"] == UNDECIDED and s.loc["text", "goal"] == "-"
    assert summarize(_rows(59, 0)).set_index("protocol").loc["kv-b", "goal"] == "yes"
    assert UNDECIDED in markdown_table(summarize(_rows(10, 1)))
    big = summarize(_rows(200, 40)).set_index("protocol")  # 0.8 of text at n = 200: decided
    assert big.loc["kv-a", "goal"] == "no" and big.loc["kv-a", "mcnemar_p"] == pytest.approx(2 * 0.5 ** 40)
    old = summarize(_rows(5, 0).drop(columns="kl_text"))  # rows of runs before kl_text existed
    assert old["kl_median"].isna().all() and "not recorded" in markdown_table(old)


def _rouge_rows(n: int, protocol_f1: float) -> pd.DataFrame:
    rows = []
    for i in range(n):
        for proto, f1 in (("text", 0.6), ("kv-a", protocol_f1)):
            rows.append(dict(task="summary", index=i, protocol=proto, em=0.0, f1=f1, prefill_s=1.0, prediction=str(f1),
                             num_imported=10, num_recomputed=0 if proto != "text" else 10, kl_text=0.0,
                             scoring="rouge_l"))
    return pd.DataFrame(rows)


def test_a_free_text_task_is_judged_on_rouge_l_kept():
    # exact match is 0 everywhere (a sentence is rarely word-for-word); the goal reads ROUGE-L instead
    s = summarize(_rouge_rows(60, 0.6)).set_index("protocol")
    assert s.loc["kv-a", "goal_metric"] == "rouge_l" and s.loc["kv-a", "goal"] == "yes"
    assert summarize(_rouge_rows(60, 0.3)).set_index("protocol").loc["kv-a", "goal"] == "no"  # half of it kept
    assert summarize(_rouge_rows(20, 0.6)).set_index("protocol").loc["kv-a", "goal"] == UNDECIDED  # too few (< 29)
    assert "yes (on ROUGE-L)" in markdown_table(summarize(_rouge_rows(60, 0.6)))


def test_summary_judges_retention_simultaneously_and_nothing_when_text_is_at_chance():
    rows = []
    for i in range(120):
        text_right = i % 2 == 0  # keycode (chance 1/4): text right on 60 of 120
        for proto, em in (("text", float(text_right)), ("kv-a", float(text_right and i % 10 != 0)),
                          ("kv-b", float(text_right or i % 4 == 1))):  # kv-b keeps all and gains 30 lucky ones
            rows.append(dict(task="keycode", index=i, protocol=proto, em=em, f1=em, prefill_s=1.0,
                             prediction=str(int(em)) + str(i), num_imported=10, num_recomputed=0, kl_text=0.0))
    s = summarize(pd.DataFrame(rows)).set_index("protocol")
    assert s.loc["kv-a", "retention"] == pytest.approx(48 / 60) and s.loc["kv-a", "num_text_right"] == 60
    assert s.loc["kv-b", "retention"] == 1.0 and s.loc["kv-b", "rel_em"] == pytest.approx(1.5)  # the sums flatter
    assert s.loc["kv-a", "num_compared"] == 2 and s.loc["kv-a", "ci_level"] == pytest.approx(0.975)
    assert s.loc["kv-a", "goal"] == "no" and s.loc["kv-b", "goal"] == "yes"
    assert bool(s.loc["text", "text_above_chance"]) and s.loc["text", "chance"] == pytest.approx(0.25)
    at_chance = pd.DataFrame(rows)
    at_chance.loc[(at_chance.protocol == "text") & (at_chance.index % 4 == 0), "em"] = 0.0  # text right 30 of 120
    judged = summarize(at_chance).set_index("protocol")
    assert judged.loc["kv-b", "goal"] == NOT_ABOVE_CHANCE and not judged.loc["text", "text_above_chance"]
    assert "0.25: NOT above" in markdown_table(summarize(at_chance))


def test_end_to_end_charges_the_senders_extra_prefill_and_the_move():
    """remote-prefill's B is fast, but the sender prefilled again and the K/V cross a link: the end-to-end
    ratio reads what the receiver-only speedup hides."""
    from kvcomm.names import E2E_LINK_GBS

    rows = []
    moved = {"text_utf8": 100, "fp32": 4e6, "bf16": 2e6, "int8": 1e6}
    for i in range(40):
        rows.append(dict(task="keycode", index=i, protocol="text", em=1.0, f1=1.0, prefill_s=0.4, prediction="1",
                         num_imported=10, num_recomputed=10, extra={}, transfer_bytes=moved))
        rows.append(dict(task="keycode", index=i, protocol="remote-prefill", em=1.0, f1=1.0, prefill_s=0.1,
                         prediction="1", num_imported=10, num_recomputed=0, extra={"sender_reencode_s": 0.5},
                         transfer_bytes=moved))
    s = summarize(pd.DataFrame(rows)).set_index("protocol")
    e2e_text = 0.4 + 100 / (E2E_LINK_GBS * 1e9)
    e2e_remote = 0.1 + 0.5 + 2e6 / (E2E_LINK_GBS * 1e9)
    assert s.loc["remote-prefill", "speedup_median"] == pytest.approx(4.0)
    assert s.loc["remote-prefill", "e2e_speedup_median"] == pytest.approx(e2e_text / e2e_remote)
    assert s.loc["remote-prefill", "goal"].startswith("reference")
