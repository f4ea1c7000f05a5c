"""LiveSampler: epochs over a LiveDataset that grows while the trainer runs (ailhd
docs/reading.md)."""

import math

import numpy as np

from ._live import split_keys


class LiveSampler:
    """A sampler for a PyTorch DataLoader over a `LiveDataset` that grows while training runs.

    Each epoch covers the rows valid when it starts: `iter(sampler)` (which the DataLoader calls
    at the start of each epoch) first refreshes the dataset, then draws the epoch from that
    snapshot. It yields keys (`LiveDataset.keys`), which name a row and its label as of that
    snapshot, so every worker process serves exactly the rows drawn, whatever its own snapshot
    (a worker asked for a row it does not know yet catches up by itself). Rows superseded or
    deleted while the epoch runs are still served in it, as they were at its start (their
    features stay in the files: rows never move); a row moved to another label keeps the label
    it had at the epoch's start until the next epoch.

    - `shuffle` (default True): a new random order each epoch, from `seed` and the epoch number.
    - `recent_share` (0 <= s < 1, default 0): recency-weighted replay. On top of one pass over
      every row, the epoch draws extra samples (with replacement) from the newest rows, so that
      they make up the share `s` of the epoch: `round(n * s / (1 - s))` extra samples for n rows.
      The newest rows are the `recent_rows` valid rows with the highest row numbers (rows are
      appended in arrival order), or, when `recent_rows` is None, the rows that arrived since the
      previous epoch started (none in the first epoch).
    - Distributed training (`DistributedSampler` semantics): `num_replicas` and `rank` (default:
      from `torch.distributed` when it is initialised, else 1 and 0). Every rank draws the same
      epoch (same seed and epoch number) and takes every `num_replicas`-th sample from `rank` on,
      padded by repeating the start of the epoch so that each rank gets the same number
      (`drop_last=True` drops the remainder instead). When `torch.distributed` is initialised,
      rank 0's snapshot is broadcast at the start of each epoch, so ranks agree on it even though
      each refreshes at its own moment; without it, the ranks agree when their snapshots do.
      Call `set_epoch(epoch)` before each epoch as with `DistributedSampler` (without it, the
      epoch number advances by one at each `iter()`).
    - `refresh=False`: do not refresh the dataset at each epoch (the caller does).

    `len(sampler)`: this rank's samples in the last epoch drawn (before the first, an estimate
    from the dataset's current length). `sampler.epoch_keys` / `epoch_rows`: the rows the last
    epoch drew from (its snapshot), `sampler.epoch_committed`: the committed row count then.
    """

    def __init__(self, dataset, *, shuffle=True, seed=0, recent_share=0.0, recent_rows=None,
                 num_replicas=None, rank=None, drop_last=False, refresh=True):
        if not 0 <= recent_share < 1:
            raise ValueError(f"recent_share must lie in [0, 1), not {recent_share}")
        if recent_rows is not None and recent_rows < 1:
            raise ValueError(f"recent_rows must be at least 1, not {recent_rows}")
        dist = _dist()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist else 1
        if rank is None:
            rank = dist.get_rank() if dist else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.recent_share = float(recent_share)
        self.recent_rows = recent_rows
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.drop_last = bool(drop_last)
        self.refresh = bool(refresh)
        self.epoch = 0
        self.epoch_keys = None
        self.epoch_committed = None
        self._previous_committed = None
        self._len = None

    def set_epoch(self, epoch):
        """The epoch number the next `iter()` draws (as `DistributedSampler.set_epoch`)."""
        self.epoch = int(epoch)

    @property
    def epoch_rows(self):
        """Row numbers of the rows the last epoch drew from (None before the first)."""
        return None if self.epoch_keys is None else split_keys(self.epoch_keys)[0]

    def __len__(self):
        if self._len is not None:
            return self._len
        return self._per_rank(len(self.dataset))

    def __iter__(self):
        return iter(self.draw().tolist())

    def draw(self):
        """Refresh the dataset (unless refresh=False) and draw the next epoch: this rank's keys,
        as an int64 array (what `iter()` yields)."""
        ds = self.dataset
        if self.refresh:
            ds.refresh()
        keys, committed = ds.keys, ds.committed_rows
        dist = _dist()
        if dist and self.num_replicas > 1:
            box = [(keys, committed)] if dist.get_rank() == 0 else [None]
            dist.broadcast_object_list(box, src=0)
            keys, committed = box[0]
        epoch = self.epoch
        self.epoch += 1
        plan = self._plan(keys, committed, epoch)
        self.epoch_keys = keys
        self._previous_committed = committed
        self.epoch_committed = committed
        self._len = len(plan)
        return plan

    def _plan(self, keys, committed, epoch):
        rng = np.random.default_rng([self.seed, epoch])
        n = len(keys)
        plan = keys[rng.permutation(n)] if self.shuffle else keys.copy()
        if self.recent_share > 0 and n:
            rows = split_keys(keys)[0]
            if self.recent_rows is not None:
                recent = keys[-self.recent_rows:]  # keys are in row order
            elif self._previous_committed is not None:
                recent = keys[rows >= self._previous_committed]
            else:
                recent = keys[:0]
            if len(recent):
                extra = int(round(n * self.recent_share / (1 - self.recent_share)))
                draws = recent[rng.integers(0, len(recent), extra)]
                plan = np.concatenate([plan, draws])
                if self.shuffle:
                    plan = plan[rng.permutation(len(plan))]
        r = self.num_replicas
        if r > 1 and len(plan):
            per = self._per_rank(len(plan))
            size = per * r
            if size > len(plan):
                plan = np.resize(plan, size)  # repeats the start, as DistributedSampler pads
            plan = plan[self.rank:size:r]
        return plan

    def _per_rank(self, n):
        r = self.num_replicas
        if r == 1:
            return n
        return n // r if self.drop_last else math.ceil(n / r)


def _dist():
    """torch.distributed when it is there and initialised, else None."""
    import sys

    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None
