"""Read ailhd's live per-split datasets from Python (ailhd README, "Reading from Python").

    from ailhd_reader import LiveDataset, collate
    ds = LiveDataset("/data/ailhd/out", split="training", source="npy")
    features, label = ds[0]          # float16 [num_long, num_short, n_mels, t_frames], label id
    ds.labels[label], ds.meta(0)     # label name; source_path, sensor_id, ..., blake3
    ds.refresh()                     # rows committed since: appear; superseded/deleted: drop out
"""

from ._live import HDF5_NAMES, Batch, LiveDataset, OutputsReplaced, collate

__all__ = ["LiveDataset", "Batch", "collate", "OutputsReplaced", "HDF5_NAMES"]
__version__ = "0.1.0"
