"""Read ailhd's live per-split datasets from Python (ailhd docs/reading.md).

    from ailhd_reader import LiveDataset, LiveSampler, collate
    ds = LiveDataset("/data/ailhd/out", split="training", source="npy")
    features, label = ds[0]          # float16 [num_long, num_short, n_mels, t_frames], label id
    ds.labels[label], ds.meta(0)     # label name; source_path, sensor_id, ..., blake3
    ds.refresh()                     # rows committed since: appear; superseded/deleted: drop out
    sampler = LiveSampler(ds)        # each epoch: refresh, then every row valid at its start
"""

from ._live import (HDF5_NAMES, Batch, LiveDataset, OutputsChanged, OutputsReplaced,
                    RowsWithdrawn, collate)
from ._sampler import LiveSampler

__all__ = ["LiveDataset", "LiveSampler", "Batch", "collate", "OutputsChanged", "OutputsReplaced",
           "RowsWithdrawn", "HDF5_NAMES"]
__version__ = "0.2.0"
