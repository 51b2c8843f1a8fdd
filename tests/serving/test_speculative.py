"""`seqlab.serving.speculative_generate` equals the target's greedy `generate` exactly, with a
different random draft and with the target as its own draft (then every draft is accepted)."""

import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.serving import generate, speculative_generate
from tests.serving.test_generate import LENGTHS, NEW, _cut, _left_padded, _model, _prompts

DRAFT = 3


@pytest.mark.parametrize("draft_name", ["tiny-gdn", "tiny-h2"])
def test_equals_the_targets_greedy_generate(draft_name):
    """Left-padded prompts of different lengths, a stop token: the tokens and lengths of greedy
    `generate` with the target, for a different random draft and for the target itself (then
    every draft token is accepted)."""
    target, target_params = _model()
    draft, draft_params = _model(draft_name)
    prompts = _prompts(target.vocab_size)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    free = generate(target, target_params, prompts, lengths=lengths, max_new_tokens=NEW).tokens
    stops = (int(free[1, 3]),)  # row 1 stops at its fourth token at the latest
    expected = _cut(np.asarray(free), stops, -1)
    out = speculative_generate(
        target, target_params, draft, draft_params, _left_padded(prompts, LENGTHS),
        lengths=lengths, padding="left", max_new_tokens=NEW, num_draft=DRAFT,
        stop_tokens=stops, pad_id=-1,
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(out.lengths, np.sum(expected != -1, axis=1))
    assert int(out.lengths[1]) <= 4
    rounds, accepted = np.asarray(out.rounds), np.asarray(out.accepted)
    print(f"draft {draft_name}: mean accepted {accepted.sum() / rounds.sum():.2f} of {DRAFT}")
    assert rounds.sum() >= 1
    if draft_name == "tiny-h2":  # the target drafts for itself: all accepted, k + 1 per round
        np.testing.assert_array_equal(accepted, DRAFT * rounds)
        np.testing.assert_array_less(rounds, NEW)
    else:
        assert np.all((accepted >= 0) & (accepted <= DRAFT * rounds))


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (dict(num_draft=0), "num_draft"),
        (dict(num_draft=4), "num_draft"),  # the sliding window holds 4 tokens
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(padding="both"), "padding"),
        (dict(stop_tokens=(-1,)), "stop_tokens"),
        (dict(draft="tiny-other-vocab"), "draft"),
    ],
)
def test_bad_arguments_raise(change, name):
    target, params = _model()
    draft = target.clone(vocab_size=7) if change.pop("draft", None) else target
    args = {"max_new_tokens": 2, "num_draft": 2, **change}
    with pytest.raises(ValueError, match=name):
        speculative_generate(target, params, draft, params, np.ones((2, 3), np.int32), **args)
