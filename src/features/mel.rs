//! Mel filterbank (stub, being written).
