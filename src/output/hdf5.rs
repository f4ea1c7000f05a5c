//! HDF5 per-split file (stub, being written).
