"""The training reading order: each decompressed block of a shard is used for whole batches.

Reading one utterance decompresses its whole row group ("block"), so shuffling the whole corpus
would decompress a block for nearly every utterance. Per epoch, the blocks are shuffled and dealt
to ranks; each rank walks them in windows of ``window_blocks`` whose utterances are shuffled and
cut into duration-bucketed batches; with DataLoader workers, whole windows go to one worker and
the batches are interleaved so that DataLoader's round-robin hands each to the worker holding its
window. Every rank gets the same number of batches, a pure function of (seed, epoch, rank, world
size, workers), so a position in it resumes exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speech_assets.model.batches import cut_batches
from speech_assets.train.data import RankSampler


class BlockShuffleSampler(RankSampler):
    """Deterministic, block-local batching for one rank (see the module docstring)."""

    def __init__(
        self,
        blocks: Sequence[tuple[int, int]],
        seconds: Sequence[float],
        batch_seconds: float,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        window_blocks: int = 16,
        num_workers: int = 0,
    ) -> None:
        """``blocks[i]`` is utterance ``i``'s (shard, row group); ``seconds[i]`` its duration."""
        if len(blocks) != len(seconds):
            raise ValueError("need one block and one duration per utterance")
        super().__init__(seconds, batch_seconds, num_replicas=num_replicas, rank=rank, seed=seed)
        self.window_blocks, self.num_workers = max(1, window_blocks), max(0, num_workers)
        keys = sorted(set(blocks))
        index = {key: n for n, key in enumerate(keys)}
        self.members: list[list[int]] = [[] for _ in keys]
        for utterance, key in enumerate(blocks):
            self.members[index[key]].append(utterance)

    def _rank_windows(self, epoch: int, rank: int) -> list[list[list[int]]]:
        rng = np.random.default_rng([self.seed, epoch, 7919])
        order = rng.permutation(len(self.members))
        mine = order[rank :: self.num_replicas] if len(order) >= self.num_replicas else order[[rank % len(order)]]
        windows = []
        for start in range(0, len(mine), self.window_blocks):
            utterances = np.array(
                [u for block in mine[start : start + self.window_blocks] for u in self.members[block]]
            )
            window_rng = np.random.default_rng([self.seed, epoch, rank, start])
            batches = cut_batches(window_rng.permutation(utterances), self.seconds, self.batch_seconds)
            windows.append([batches[i] for i in window_rng.permutation(len(batches))])
        return windows

    def _arrange(self, windows: list[list[list[int]]]) -> list[list[int]]:
        if self.num_workers <= 1:
            return [batch for window in windows for batch in window]
        lanes: list[list[list[int]]] = [[] for _ in range(self.num_workers)]
        for window in windows:  # each window whole to the lane with the fewest batches so far
            min(lanes, key=len).extend(window)
        queues = [list(reversed(lane)) for lane in lanes]
        arranged = []
        while any(queues):
            for worker in range(self.num_workers):  # index k goes to worker k % num_workers
                # a lane that ran dry borrows from the fullest one, so every later index still
                # lands on the worker of its own lane (only borrowed batches are off-lane)
                queue = queues[worker] or max(queues, key=len)
                if queue:
                    arranged.append(queue.pop())
        return arranged

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``; the same count on every rank."""
        count = min(sum(len(w) for w in self._rank_windows(epoch, r)) for r in range(self.num_replicas))
        return self._arrange(self._rank_windows(epoch, self.rank))[:count]
