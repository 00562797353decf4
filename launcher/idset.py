"""The ids a driver holds, compactly: 24 bytes an id, however long the ids and however many.

A job of 100 million records reads every id once, and must tell a repeated one (launcher.inputs,
`_unique_ids`) naming where the id was first used; a re-run looks every record up among the ids
its results file holds (launcher.writer.ResultWriter.done_ids) and their input digests
(launcher.writer.input_digest_index). A Python dict or set of the ids costs 100-180 bytes an id;
this holds each id as a 128-bit hash (blake2b, two uint64 words: two distinct ids share one with a
chance of ~1e-23 in 1e8) with one uint64 value, in numpy runs sorted by the first word that merge
as they grow (a log-structured index: each lookup searches a few runs; each id is merged about
log2(n / chunk) times). Ids are added and looked up a chunk at a time, so the searches are
numpy's, not Python's.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Iterable, Iterator

import numpy as np

EMPTY = np.zeros(0, np.uint64)
CHUNK = 4096        # records looked up at a time


def place(number: int, line: int) -> int:
    """Where a line is, as one value: its file's number and its line number (below 2**40)."""
    return (number << 40) | line


def unplace(value: int) -> tuple[int, int]:
    """`place`'s (file number, line number)."""
    return value >> 40, value & (1 << 40) - 1


def chunks(items: Iterable, size: int | None = None) -> Iterator[list]:
    """`items` in lists of `size` (CHUNK, as it is when the iteration starts), read as they are
    asked for."""
    items, size = iter(items), size or CHUNK
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def id_hash(record_id: str) -> bytes:
    """An id's 16 bytes: its two 64-bit words, little-endian (`words`)."""
    return hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class IdIndex:
    """Ids (as `id_hash`) with a value each (a uint64 below 2**63), in runs sorted by their first
    word (ids that share it, one in 2**64 pairs, are told apart by the second)."""

    def __init__(self):
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []     # (word 1, word 2, value), sorted

    def __len__(self) -> int:
        return sum(len(run[0]) for run in self.runs)

    def nbytes(self) -> int:
        return sum(a.nbytes for run in self.runs for a in run)

    def find(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        """Per id (its words h1, h2), its value, or -1 (as int64) where it is not held; an id held
        more than once, its latest value (runs go from the oldest, and a run keeps the order its
        entries came in among those of one first word)."""
        found = np.full(len(h1), -1, np.int64)
        for a, b, v in self.runs:
            lo = np.searchsorted(a, h1, "left")
            hi = np.searchsorted(a, h1, "right")
            one = hi - lo == 1                  # (almost always 0 or 1 entry with this first word)
            at = np.minimum(lo, len(a) - 1)
            hit = one & (b[at] == h2)
            found[hit] = v[at[hit]].astype(np.int64)
            for i in np.flatnonzero(hi - lo > 1):     # several ids share the first word: look at each
                for j in range(lo[i], hi[i]):
                    if b[j] == h2[i]:
                        found[i] = int(v[j])
        return found

    def add(self, h1: np.ndarray, h2: np.ndarray, values: np.ndarray) -> None:
        """Adds ids as one run (an id held already: `find` gives its newest value), then merges
        the newest runs while the one before is at most twice the size."""
        if not len(h1):
            return
        order = np.argsort(h1, kind="stable")
        self.runs.append((h1[order], h2[order], values[order]))
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            (a1, a2, av), (b1, b2, bv) = self.runs.pop(), self.runs.pop()
            w1 = np.concatenate([b1, a1])
            del a1, b1                                  # (each column's old arrays go as the new one comes)
            order = np.argsort(w1, kind="stable")      # (two sorted runs: a merge, in linear time)
            w1 = w1[order]
            w2 = np.concatenate([b2, a2])[order]
            del a2, b2
            v = np.concatenate([bv, av])[order]
            del av, bv
            self.runs.append((w1, w2, v))


def words(hashes: list[bytes] | bytes) -> tuple[np.ndarray, np.ndarray]:
    """`id_hash`es (a list, or joined) as the two uint64 arrays IdIndex takes."""
    joined = hashes if isinstance(hashes, bytes) else b"".join(hashes)
    if not joined:
        return EMPTY, EMPTY
    pair = np.frombuffer(joined, dtype="<u8").reshape(-1, 2)
    return pair[:, 0].astype(np.uint64), pair[:, 1].astype(np.uint64)


class IdSet:
    """Ids as IdIndex holds them, each with a value (0 unless given): `update` a batch, `lookup` a
    batch, `in` for one (a few searches of each run: for a check now and then, not per record)."""

    def __init__(self):
        self.index = IdIndex()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def update(self, ids: list[str], values: list[int] | None = None) -> None:
        """Adds a batch; an id added again (or twice in one batch) takes its latest value."""
        if not ids:
            return
        h1, h2 = words([id_hash(i) for i in ids])
        v = np.zeros(len(ids), np.uint64) if values is None else np.asarray(values, np.uint64)
        self.index.add(h1, h2, v)
        self.size += len(ids)

    def lookup(self, ids: list[str]) -> list[int]:
        """Per id, its latest value, or -1 where it is not held."""
        if not ids or not self.size:
            return [-1] * len(ids)
        return self.index.find(*words([id_hash(i) for i in ids])).tolist()

    def __contains__(self, record_id: str) -> bool:
        return self.lookup([record_id])[0] >= 0
