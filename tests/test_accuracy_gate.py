"""The model accuracy gate's own logic (tests/test_models_accuracy.logprob_gate) on synthetic runs: positions that
routed differently are set aside from the max gate, and only up to a bounded fraction of them."""

from __future__ import annotations

import pytest

from test_models_accuracy import LOGPROB_ATOL_BF16, ROUTING_FLIP_MAX_FRACTION, logprob_gate

CASE = "qwen3.5-moe-block"  # a bf16 case
LENS = [12, 14, 16]  # prompt tokens; each prompt predicts len - 1 of them
K, LAYERS = 4, 2


def run(deltas: dict[int, float] | None = None, flipped: set[int] = frozenset()) -> dict:
    """A run with logprob 0 everywhere, ``deltas`` added at flattened predicted positions, and the last layer's
    routing changed at ``flipped`` ones."""
    lp, routing, idx = [], [[[e for e in range(K)] for _ in range(sum(LENS))] for _ in range(LAYERS)], 0
    start = 0
    for n in LENS:
        row = []
        for pos in range(start, start + n - 1):
            row.append((deltas or {}).get(idx, 0.0))
            if idx in flipped:
                routing[-1][pos] = [0, 1, 2, K]  # one expert swapped
            idx += 1
        lp.append(row)
        start += n
    return {"finite": True, "prompt_logprobs": lp, "prompt_lens": list(LENS), "routing": routing}


def test_a_near_tie_position_is_set_aside_from_the_max_gate():
    logprob_gate(CASE, run({5: 0.5}, flipped={5}), run())


def test_the_same_error_where_both_runs_routed_alike_is_refused():
    with pytest.raises(AssertionError, match=r"where both runs routed alike"):
        logprob_gate(CASE, run({5: 2 * LOGPROB_ATOL_BF16}), run())


def test_routing_that_differs_at_many_positions_is_refused():
    n = sum(n - 1 for n in LENS)
    many = set(range(int(ROUTING_FLIP_MAX_FRACTION * n) + 1))
    with pytest.raises(AssertionError, match=r"routed differently"):
        logprob_gate(CASE, run(flipped=many), run())


def test_the_mean_gate_counts_every_position():
    n = sum(n - 1 for n in LENS)
    with pytest.raises(AssertionError, match=r"mean \|dlogprob\|"):
        logprob_gate(CASE, run({i: 0.05 for i in range(n)}), run())
