"""Position schemes: how the engine turns a token's place in its sequence into rotary angles.

A scheme gives P position components per token and a [P, head_dim/2] frequency matrix; the
network computes angles = components @ matrix, so a new scheme touches no model code. The engine
calls `components` for every prefill and every decode step: callers never pass positions.
"""

from __future__ import annotations

import numpy as np

from sharding.config import ModelConfig


class RopePositions:
    """Plain 1-D RoPE: one component, the token's index in its sequence."""
    name = "rope"
    num_components = 1

    def freq_matrix(self, cfg: ModelConfig) -> np.ndarray:
        return cfg.inv_freq()[None, :]

    def components(self, start: int, count: int) -> np.ndarray:
        return np.arange(start, start + count, dtype=np.float32)[:, None]


SCHEMES = {"rope": RopePositions}


def make_scheme(name: str = "rope", **options):
    if name not in SCHEMES:
        raise ValueError(f"model.positions.scheme '{name}' is unknown; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name](**options)
