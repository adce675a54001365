"""A language with a known loss floor: a fixed random Markov chain over a small vocab.

Every token has `branching` possible successors with fixed probabilities, the same
for every token, so the best possible next-token loss is their entropy (nats), whatever
model learns it. A model that learns the chain reaches that floor; one that does not
stays near log(vocab).

Batches are drawn from a numpy generator seeded per step, as global arrays: the same
tokens reach the model whatever the mesh, so runs at different cp can be compared.
"""

from __future__ import annotations

import math

import numpy as np

SUCCESSOR_PROBS = (0.4, 0.3, 0.2, 0.1)  # of each token's successors, in a fixed order


class MarkovLanguage:
    def __init__(self, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.successors = np.stack(
            [rng.choice(vocab, len(SUCCESSOR_PROBS), replace=False) for _ in range(vocab)]
        )
        self.probs = np.asarray(SUCCESSOR_PROBS)

    @property
    def floor(self) -> float:
        """The lowest achievable mean next-token cross-entropy, in nats."""
        return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)

    def batch(self, step: int, batch: int, seq: int, seed: int = 0) -> np.ndarray:
        """(batch, seq + 1) int32 tokens: inputs are [:, :-1], targets [:, 1:]."""
        rng = np.random.default_rng([seed, step])
        tokens = np.empty((batch, seq + 1), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab, batch)
        choice = rng.choice(len(self.probs), size=(batch, seq), p=self.probs)
        for t in range(seq):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens
