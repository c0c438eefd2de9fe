"""N-gram drafts (prompt lookup): guess a sequence's next tokens from its own past.

Text that quotes, edits or summarizes its prompt, code that repeats
identifiers, and lists with a shared shape repeat runs of tokens the
sequence already holds. If the last n tokens occurred before, the tokens that
followed them then are a cheap guess at what follows now; the model checks
the guess in one forward pass (rejection_sampler.py), which on this CPU costs
little more than a decode step because a small batch's step is bound by
reading the weights, not by the arithmetic.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed the most recent earlier
        occurrence of the longest suffix of `token_ids` of max_n down to min_n
        tokens; [] when no such suffix occurred before.

        The most recent occurrence, because a sequence that repeats itself
        (a list, a loop, a quoted passage being copied) continues its latest
        repetition. Cost: one vectorized comparison of the last token against
        the whole sequence, then a check of the few candidate positions
        (~20-40 us for 1,000 tokens), once per sequence per step."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # Earlier positions holding the last token, where a match of length
        # >= 1 ends; the suffix's own last token (position n_tokens - 1) is not one.
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        if ends.size == 0:
            return []
        # For each candidate end e, how many tokens before it (up to max_n) agree with the suffix.
        max_n = min(self.max_n, n_tokens - 1)
        lengths = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, max_n):
            pos = ends - back
            ok = alive & (pos >= 0)
            ok[ok] = arr[pos[ok]] == arr[n_tokens - 1 - back]
            alive = ok
            if not alive.any():
                break
            lengths += alive
        best = lengths.max()
        if best < self.min_n:
            return []
        # The most recent among the longest matches.
        end = int(ends[np.flatnonzero(lengths == best)[-1]])
        return arr[end + 1: end + 1 + k].tolist()
