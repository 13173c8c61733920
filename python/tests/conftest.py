import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import reference`

import reference as ref  # noqa: E402


def random_top_experts(rng, tokens, top_k, num_experts, skip_expert=None):
    """[T, K] int32 router ids: K distinct experts per token, like a top-k router
    (optionally never choosing `skip_expert`, to get an empty expert)."""
    choices = [e for e in range(num_experts) if e != skip_expert]
    top = np.empty((tokens, top_k), dtype=np.int32)
    for t in range(tokens):
        top[t] = rng.choice(choices, size=top_k, replace=False)
    return top


def rows(rng, shape, dtype):
    """Random rows in [-1, 1), exactly representable in `dtype`."""
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


class Routing:
    """A small routing problem with its reference plan."""

    def __init__(self, tokens=37, top_k=3, num_experts=6, alignment=4, hidden=24, seed=0, skip_expert=2):
        self.rng = np.random.default_rng(seed)
        self.T, self.K, self.E, self.m, self.H = tokens, top_k, num_experts, alignment, hidden
        self.A = tokens * top_k
        self.top = random_top_experts(self.rng, tokens, top_k, num_experts, skip_expert)
        self.ref = ref.make_plan(self.top, num_experts, alignment)
        self.P = self.ref["P"]


@pytest.fixture
def routing():
    return Routing()


# Tolerances against the float64 reference, per output dtype.
TOL = {
    np.dtype(np.float32): dict(rtol=1e-5, atol=1e-5),
    np.dtype(np.float16): dict(rtol=2e-3, atol=1e-2),
}
