//! npy column files (stub, being written).
