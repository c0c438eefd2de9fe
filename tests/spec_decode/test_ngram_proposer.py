"""NgramProposer against a brute-force reference, plus hand-checked edge cases."""

import random

import pytest

from fp8serve.spec_decode.ngram_proposer import NgramProposer


def reference_propose(token_ids, min_n, max_n, k, max_tokens=None):
    """Brute force: the longest suffix (max_n down to min_n tokens) that also
    occurs earlier, ending before the last position (so at least one token
    follows it); among its occurrences the most recent one; the up to
    min(k, max_tokens) tokens after it."""
    limit = k if max_tokens is None else min(k, max_tokens)
    if limit <= 0:
        return []
    length = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue  # the suffix plus an earlier, different occurrence cannot fit
        suffix = list(token_ids[length - n:])
        # Start positions i with i + n < length (the occurrence ends at or
        # before length - 2), latest first.
        for i in range(length - n - 1, -1, -1):
            if list(token_ids[i:i + n]) == suffix:
                return list(token_ids[i + n:i + n + limit])
    return []


def test_reference_sanity():
    """The reference itself on cases worked out by hand."""
    assert reference_propose([1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1]
    assert reference_propose([1, 2, 3], 1, 3, 2) == []
    assert reference_propose([7, 7], 1, 3, 4) == [7]
    assert reference_propose([1, 2, 1, 2, 1, 2], 1, 3, 5) == [1, 2]


@pytest.mark.parametrize("token_ids", [[], [5], [5, 5], [4, 5]])
def test_short_sequences(token_ids):
    for min_n, max_n in ((1, 1), (1, 3), (2, 2), (2, 4)):
        proposer = NgramProposer(min_n, max_n, 3)
        got = proposer.propose(list(token_ids))
        assert got == reference_propose(token_ids, min_n, max_n, 3)
    # Spelled out: [5, 5] repeats its last token once, [4, 5] does not.
    assert NgramProposer(1, 3, 3).propose([5, 5]) == [5]
    assert NgramProposer(2, 3, 3).propose([5, 5]) == []
    assert NgramProposer(1, 3, 3).propose([4, 5]) == []
    assert NgramProposer(1, 3, 3).propose([]) == []


def test_longest_match_beats_a_more_recent_shorter_one():
    # [1, 2, 3] occurs at positions 1-3; only [2, 3] at the more recent 6-7.
    tokens = [5, 1, 2, 3, 9, 0, 2, 3, 7, 1, 2, 3]
    assert NgramProposer(1, 3, 4).propose(tokens) == [9, 0, 2, 3]
    # With max_n = 2 both occurrences of [2, 3] are as long as allowed: the most recent wins.
    assert NgramProposer(1, 2, 4).propose(tokens) == [7, 1, 2, 3]
    # And a suffix of one token: 3 last occurred at position 7.
    assert NgramProposer(1, 1, 2).propose(tokens) == [7, 1]
    for min_n, max_n, k in ((1, 3, 4), (1, 2, 4), (1, 1, 2), (2, 3, 1), (3, 5, 9)):
        assert NgramProposer(min_n, max_n, k).propose(tokens) == reference_propose(tokens, min_n, max_n, k)


def test_most_recent_of_equally_long_matches():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert NgramProposer(2, 2, 1).propose(tokens) == [30]
    assert NgramProposer(1, 4, 3).propose(tokens) == [30, 1, 2]


def test_min_n_rejects_shorter_matches():
    tokens = [8, 1, 4, 6, 2, 1]  # only the 1-token suffix [1] occurred before
    assert NgramProposer(1, 3, 2).propose(tokens) == [4, 6]
    assert NgramProposer(2, 3, 2).propose(tokens) == []


def test_no_match():
    assert NgramProposer(1, 4, 5).propose([1, 2, 3, 4, 5, 6]) == []


def test_overlapping_self_repeats():
    # The suffix [2, 1, 2] overlaps its earlier occurrence at 1-3; the continuation
    # runs into the suffix itself and stops at the end of the sequence.
    assert NgramProposer(1, 3, 5).propose([1, 2, 1, 2, 1, 2]) == [1, 2]
    assert NgramProposer(1, 3, 1).propose([1, 2, 1, 2, 1, 2]) == [1]
    # A run of one token: the longest earlier [7]*3 ends at position 2, one before the end.
    assert NgramProposer(1, 3, 4).propose([7, 7, 7, 7]) == [7]
    # max_n longer than the sequence allows: the match is capped at len - 1 tokens.
    assert NgramProposer(1, 10, 4).propose([7, 7, 7, 7]) == [7]
    assert NgramProposer(4, 10, 4).propose([7, 7, 7, 7]) == []
    assert NgramProposer(3, 10, 4).propose([7, 7, 7, 7]) == [7]
    for tokens in ([1, 2, 1, 2, 1, 2], [7, 7, 7, 7], [3, 3, 4, 3, 3, 4, 3, 3], [1, 1, 2, 1, 1, 2, 1, 1, 2, 1]):
        for min_n, max_n, k in ((1, 3, 5), (1, 1, 2), (2, 5, 3), (3, 3, 8)):
            assert NgramProposer(min_n, max_n, k).propose(tokens) == reference_propose(tokens, min_n, max_n, k)


def test_continuation_truncated_at_sequence_end():
    tokens = [4, 5, 6, 4, 5]  # [4, 5] occurred at 0-1; followed by [6, 4, 5] only
    assert NgramProposer(1, 2, 10).propose(tokens) == [6, 4, 5]
    assert NgramProposer(1, 2, 2).propose(tokens) == [6, 4]


def test_max_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    proposer = NgramProposer(1, 2, 3)
    assert proposer.propose(tokens) == [3, 4, 5]
    assert proposer.propose(tokens, max_tokens=None) == [3, 4, 5]
    assert proposer.propose(tokens, max_tokens=10) == [3, 4, 5]
    assert proposer.propose(tokens, max_tokens=3) == [3, 4, 5]
    assert proposer.propose(tokens, max_tokens=2) == [3, 4]
    assert proposer.propose(tokens, max_tokens=1) == [3]
    assert proposer.propose(tokens, max_tokens=0) == []
    assert proposer.propose(tokens, max_tokens=-1) == []


def test_returns_plain_ints_and_leaves_input_alone():
    tokens = [3, 1, 4, 1, 5, 9, 3, 1]
    before = list(tokens)
    got = NgramProposer(1, 3, 4).propose(tokens)
    assert got == [4, 1, 5, 9]
    assert all(type(t) is int for t in got)
    assert tokens == before


@pytest.mark.parametrize("vocab", [1, 2, 3, 5])
def test_matches_reference_on_random_sequences(seed, vocab):
    rng = random.Random(seed)
    for _ in range(400):
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        token_ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        max_tokens = rng.choice([None, None, 0, 1, 2, rng.randint(1, 8)])
        got = NgramProposer(min_n, max_n, k).propose(token_ids, max_tokens=max_tokens)
        want = reference_propose(token_ids, min_n, max_n, k, max_tokens)
        assert got == want, (seed, token_ids, min_n, max_n, k, max_tokens)


def test_matches_reference_on_sequences_with_planted_repeats(seed):
    """Copies of earlier spans inside larger-vocab noise, the pattern n-gram drafting targets."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(200):
        token_ids = [rng.randrange(50) for _ in range(rng.randint(5, 60))]
        for _ in range(rng.randint(0, 3)):
            start = rng.randrange(len(token_ids))
            span = token_ids[start:start + rng.randint(1, 8)]
            token_ids.extend(span + [rng.randrange(50) for _ in range(rng.randint(0, 4))])
        # End on a copied span so a match is likely.
        start = rng.randrange(len(token_ids))
        token_ids.extend(token_ids[start:start + rng.randint(1, 6)])
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        got = NgramProposer(min_n, max_n, k).propose(token_ids)
        want = reference_propose(token_ids, min_n, max_n, k)
        assert got == want, (seed, token_ids, min_n, max_n, k)
        hits += bool(want)
    assert hits > 50  # the comparison exercised real matches


def test_long_sequence_matches_reference(seed):
    rng = random.Random(seed)
    for vocab in (2, 3, 4):
        token_ids = [rng.randrange(vocab) for _ in range(1500)]
        for min_n, max_n, k in ((1, 4, 5), (2, 8, 3), (5, 12, 7)):
            got = NgramProposer(min_n, max_n, k).propose(token_ids)
            assert got == reference_propose(token_ids, min_n, max_n, k), (seed, vocab, min_n, max_n, k)


@pytest.mark.parametrize("args", [(0, 3, 2), (-1, 3, 2), (3, 2, 2), (1, 0, 2), (1, 3, 0), (1, 3, -2), (2, 2, 0)])
def test_constructor_validation(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)


def test_constructor_accepts_boundaries():
    proposer = NgramProposer(2, 2, 1)
    assert (proposer.min_n, proposer.max_n, proposer.k) == (2, 2, 1)
