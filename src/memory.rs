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

/// mimalloc's `mi_option_purge_delay` (the 16th option of mimalloc.h in v3, the version
/// `libmimalloc-sys` builds by default). Not among the options that crate names.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// From now on, pages freed go back to the system at once instead of a second later (mimalloc
/// v3's default delay). For `rebuild`, whose stages free large buffers on one thread that another
/// allocated, and which opens the previous manifest and lets it go: measured at 221,005
/// recordings (docs/benchmarks.md), its peak RSS fell by 40-50 MB at the same speed. The
/// service keeps the delay: its latency path would pay the page faults of memory handed back.
pub fn release_at_once() {
    // SAFETY: setting an option is a store to mimalloc's own table; any thread may do it.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option number is mimalloc's purge delay: its documented default (1,000 ms in v3)
    /// before, 0 after. A wrong number would show another option's value or leave the delay alone.
    #[test]
    fn release_at_once_sets_mimallocs_purge_delay_to_zero() {
        // SAFETY: reading and setting an option touch only mimalloc's own table.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        let before = get();
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(before, 1000, "mimalloc's default purge delay");
        }
        release_at_once();
        assert_eq!(get(), 0);
        // SAFETY: as above; the value before again for any later test in this process.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, before) };
    }
}
