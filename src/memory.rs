//! Memory the process no longer uses goes back to the system.
//!
//! The `ailhd` binary allocates through mimalloc (see `main.rs`), which keeps freed pages for
//! reuse. After a burst that touched much memory once (a rescan lists the whole tree: ~30 MB at
//! 200,000 recordings), the service's resident memory would otherwise stay at the burst's peak
//! for as long as it runs. Where mimalloc is not the allocator (the tests' binaries), this frees
//! what little mimalloc itself holds.

/// Hand the pages freed since the last call back to the system (a few milliseconds at most;
/// called after a rescan and when the service goes idle).
pub fn release_free_memory() {
    // SAFETY: mi_collect only walks the allocator's own structures; any thread may call it.
    unsafe { libmimalloc_sys::mi_collect(true) }
}
