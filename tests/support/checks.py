"""Checks shared by tests that compare two engines' outputs."""

from __future__ import annotations


def check_logprobs_close(ours, theirs, name: str, *, atol: float) -> float:
    """vLLM's rule, with the values checked too. `ours` and `theirs` are (token ids, per-token
    {token id: logprob} of the top tokens and the chosen one). On the common prefix the tokens
    are equal and each chosen token's logprob is within `atol` on both sides; at the first
    difference each side's token is among the other's top tokens. Returns the largest
    logprob difference seen on the common prefix (0 when it is empty)."""
    (our_tokens, our_logprobs), (their_tokens, their_logprobs) = ours, theirs
    largest = 0.0
    for i, (a, b) in enumerate(zip(our_tokens, their_tokens, strict=False)):
        if a != b:
            assert a in their_logprobs[i], (
                f"{name}: token {i}: ours {a} not in their top tokens {their_logprobs[i]}"
            )
            assert b in our_logprobs[i], (
                f"{name}: token {i}: theirs {b} not in our top tokens {our_logprobs[i]}"
            )
            break
        difference = abs(our_logprobs[i][a] - their_logprobs[i][a])
        assert difference <= atol, (
            f"{name}: token {i} ({a}): logprob {our_logprobs[i][a]:.5f} against "
            f"{their_logprobs[i][a]:.5f}, more than {atol} apart"
        )
        largest = max(largest, difference)
    return largest
