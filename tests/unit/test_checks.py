"""The shared logprob-closeness check (tests.support.checks) fails where it should."""

from __future__ import annotations

import pytest

from tests.support.checks import check_logprobs_close

OURS = ([5, 7, 9], [{5: -0.10, 6: -2.0}, {7: -0.50, 8: -1.0}, {9: -0.2, 3: -1.9}])


def test_equal_outputs_pass_and_report_the_largest_difference():
    theirs = ([5, 7, 9], [{5: -0.11, 6: -2.0}, {7: -0.53, 8: -1.0}, {9: -0.2, 3: -1.9}])
    assert check_logprobs_close(OURS, theirs, "x", atol=0.05) == pytest.approx(0.03)


def test_a_logprob_on_the_common_prefix_too_far_apart_fails():
    theirs = ([5, 7, 9], [{5: -0.10, 6: -2.0}, {7: -0.90, 8: -1.0}, {9: -0.2, 3: -1.9}])
    with pytest.raises(AssertionError, match="token 1"):
        check_logprobs_close(OURS, theirs, "x", atol=0.05)


def test_a_divergence_must_stay_within_each_others_top_tokens():
    near = ([5, 8, 4], [{5: -0.10, 6: -2.0}, {8: -0.6, 7: -0.7}, {4: -0.1}])
    assert check_logprobs_close(OURS, near, "x", atol=0.05) == 0.0  # values after it: free
    far = ([5, 2, 9], [{5: -0.10, 6: -2.0}, {2: -0.1, 8: -0.7}, {9: -0.2}])
    with pytest.raises(AssertionError, match="not in their top"):
        check_logprobs_close(OURS, far, "x", atol=0.05)
