"""Position schemes: how the engine turns a token's place in its sequence into rotary angles.

A scheme gives P position components per token and a [P, head_dim/2] frequency matrix; the
network computes angles = components @ matrix, so a new scheme touches no model code. The engine
calls `at` (every token's position) for every prefill and every decode step: callers never pass
positions.
"""

from __future__ import annotations

import numpy as np

from msinfer.sharding.config import ModelConfig


class RopePositions:
    """Plain 1-D RoPE: one component, the token's index in its sequence."""
    name = "rope"
    num_components = 1

    def freq_matrix(self, cfg: ModelConfig) -> np.ndarray:
        return cfg.inv_freq()[None, :]

    def components(self, start: int, count: int) -> np.ndarray:
        return self.at(np.arange(start, start + count))

    def at(self, positions: np.ndarray) -> np.ndarray:
        """[len(positions), P] components of tokens at these positions (of plain prompts)."""
        return positions.astype(np.float32)[:, None]


class Rope2DPositions:
    """Two components, (branch id, time id), for models trained with branch/time positions.

    A fraction `ratio` of the head_dim/2 rotary frequency pairs turns with the branch id and the
    rest with the time id. The branch pairs are interleaved, spread evenly over the frequency
    range: with n = round(ratio * head_dim/2) of them, pair j is a branch pair for
    j = (k+1) * (head_dim/2) // n - 1, k = 0..n-1 (ratio 0.25: every 4th pair, ending at the
    lowest frequency). A plain prompt is branch 0, time = the token's index; its branch pairs
    then do not turn. With ratio 0 this is plain RoPE.
    """
    name = "rope2d"
    num_components = 2

    def __init__(self, ratio: float = 0.0):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"model.positions.ratio must be within [0, 1], got {ratio}")
        self.ratio = float(ratio)

    def branch_pairs(self, half: int) -> np.ndarray:
        """Indices of the frequency pairs driven by the branch id."""
        n = int(round(self.ratio * half))
        return (np.arange(1, n + 1) * half) // n - 1 if n else np.zeros(0, np.int64)

    def freq_matrix(self, cfg: ModelConfig) -> np.ndarray:
        inv = cfg.inv_freq()
        branch = np.zeros(inv.shape, bool)
        branch[self.branch_pairs(len(inv))] = True
        return np.stack([np.where(branch, inv, 0), np.where(branch, 0, inv)]).astype(np.float32)

    def components(self, start: int, count: int, branch: int = 0) -> np.ndarray:
        return self.at(np.arange(start, start + count), branch)

    def at(self, positions: np.ndarray, branch: int = 0) -> np.ndarray:
        return np.stack([np.full(len(positions), branch, np.float32), positions.astype(np.float32)], axis=1)


SCHEMES = {"rope": RopePositions, "rope2d": Rope2DPositions}


def make_scheme(name: str = "rope", **options):
    if name not in SCHEMES:
        raise ValueError(f"model.positions.scheme '{name}' is unknown; choose one of {', '.join(SCHEMES)}")
    try:
        return SCHEMES[name](**options)
    except TypeError:
        raise ValueError(f"model.positions: scheme '{name}' does not take option(s) {', '.join(options)}") from None
