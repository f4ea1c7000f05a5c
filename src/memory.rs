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

/// The binary's allocator: mimalloc, except that a zeroed allocation of [`ZEROED_MAPPED`] or
/// more is a fresh anonymous mapping of its own, whose pages the kernel supplies zeroed when
/// first touched.
///
/// mimalloc fills a zeroed allocation with zeros itself whenever it reuses memory, and after
/// [`release_free_memory`] each of those pages is faulted in again on the way. sled allocates
/// its page table zeroed on every open of the manifest (6 MiB, nearly all of it never touched
/// for a manifest of this size), so each reopen after an idle close zeroed 6 MiB of memory
/// handed back minutes before, in the wait of the first recording after the idle, and kept it
/// resident. A mapping costs two system calls and nothing for the pages never touched, which
/// is what glibc's `calloc` does for sizes like these.
pub struct Allocator;

/// Zeroed allocations from this size up are mappings of their own (see [`Allocator`]).
pub const ZEROED_MAPPED: usize = 1 << 20;

/// The mappings made, by address (0: a free slot). A full table sends further zeroed
/// allocations to mimalloc, which only costs the zeroing again; no allocation waits for it.
static MAPPED: std::sync::Mutex<[usize; MAPPED_SLOTS]> = std::sync::Mutex::new([0; MAPPED_SLOTS]);
const MAPPED_SLOTS: usize = 64;

/// The page size mappings are aligned to: a larger alignment goes to mimalloc.
const PAGE: usize = 4096;

fn mapped_table() -> std::sync::MutexGuard<'static, [usize; MAPPED_SLOTS]> {
    // Nothing panics while the table is held; a poisoned lock holds a table still whole.
    MAPPED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh zeroed mapping of `size` bytes recorded in the table, or None (no slot, or the
/// kernel refused).
fn map_zeroed(size: usize) -> Option<*mut u8> {
    let mut table = mapped_table();
    let slot = table.iter().position(|&a| a == 0)?;
    // SAFETY: an anonymous private mapping at an address the kernel picks; nothing else is
    // touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    table[slot] = p as usize;
    Some(p.cast())
}

/// Unmap `p` if it is one of the table's mappings; false if it is not.
fn unmap_if_mapped(p: *mut u8, size: usize) -> bool {
    let mut table = mapped_table();
    let Some(slot) = table.iter().position(|&a| a == p as usize) else {
        return false;
    };
    table[slot] = 0;
    drop(table);
    // SAFETY: `p` is a mapping of `size` bytes this allocator made (the table says so) and
    // the caller gives it up.
    unsafe { libc::munmap(p.cast(), size) };
    true
}

fn is_mapped(p: *mut u8) -> bool {
    mapped_table().contains(&(p as usize))
}

// SAFETY: every block comes from mimalloc or from a mapping of at least its size made here,
// page-aligned (so aligned for any layout whose alignment is at most a page); a block goes
// back the way it came, the table telling which.
unsafe impl std::alloc::GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        mimalloc::MiMalloc.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= ZEROED_MAPPED && layout.align() <= PAGE {
            if let Some(p) = map_zeroed(layout.size()) {
                return p;
            }
        }
        mimalloc::MiMalloc.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: std::alloc::Layout) {
        if layout.size() >= ZEROED_MAPPED && unmap_if_mapped(p, layout.size()) {
            return;
        }
        mimalloc::MiMalloc.dealloc(p, layout)
    }

    unsafe fn realloc(&self, p: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if layout.size() >= ZEROED_MAPPED && is_mapped(p) {
            // A mapping never changes size: the block moves to mimalloc.
            let moved = std::alloc::Layout::from_size_align_unchecked(new_size, layout.align());
            let q = mimalloc::MiMalloc.alloc(moved);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                unmap_if_mapped(p, layout.size());
            }
            return q;
        }
        mimalloc::MiMalloc.realloc(p, layout, new_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::alloc::{GlobalAlloc, Layout};

    /// The two tests below share the table (one fills it): one at a time.
    static TABLE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Pages of `[p, p + len)` the kernel has in memory (`mincore`).
    fn resident_pages(p: *mut u8, len: usize) -> usize {
        let pages = len.div_ceil(PAGE);
        let mut vec = vec![0u8; pages];
        // SAFETY: `p` is page-aligned and mapped for `len` bytes; `vec` has a byte per page.
        let r = unsafe { libc::mincore(p.cast(), len, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// A large zeroed block reads as zeros and has no page in memory until written, even where
    /// the same size was just used and freed (mimalloc would reuse that memory and zero it
    /// itself, making every page resident); it can be written, grown and freed.
    #[test]
    fn a_large_zeroed_allocation_is_fresh_untouched_memory() {
        let _one = TABLE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let a = Allocator;
        let size = 8 << 20;
        let layout = Layout::from_size_align(size, 64).unwrap();
        // SAFETY: layouts of non-zero size; each block is written within its size and freed
        // once with the layout it was allocated with.
        unsafe {
            let used = a.alloc(layout);
            std::ptr::write_bytes(used, 0xAB, size);
            a.dealloc(used, layout);

            let p = a.alloc_zeroed(layout);
            assert!(!p.is_null());
            assert!(
                is_mapped(p),
                "a block of {size} bytes is a mapping of its own"
            );
            assert_eq!(resident_pages(p, size), 0, "no page touched yet");
            let bytes = std::slice::from_raw_parts(p, size);
            assert!(bytes.iter().all(|&b| b == 0));
            *p.add(size - 1) = 7;
            assert!(resident_pages(p, size) >= 1);
            // Growing it moves it to mimalloc with its bytes.
            let q = a.realloc(p, layout, size * 2);
            assert!(!q.is_null());
            assert!(!is_mapped(p) && !is_mapped(q));
            assert_eq!(*q.add(size - 1), 7);
            assert_eq!(*q, 0);
            a.dealloc(q, Layout::from_size_align(size * 2, 64).unwrap());
        }
    }

    /// Small zeroed blocks, larger alignments and blocks past the table's slots still come
    /// zeroed (from mimalloc), and every block is freed the way it came.
    #[test]
    fn zeroed_blocks_the_table_does_not_take_still_come_zeroed() {
        let _one = TABLE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let a = Allocator;
        let small = Layout::from_size_align(ZEROED_MAPPED - 1, 8).unwrap();
        let aligned = Layout::from_size_align(ZEROED_MAPPED, 2 * PAGE).unwrap();
        let large = Layout::from_size_align(ZEROED_MAPPED, 8).unwrap();
        // SAFETY: as above.
        unsafe {
            for layout in [small, aligned] {
                let p = a.alloc_zeroed(layout);
                assert!(!is_mapped(p));
                assert_eq!(p as usize % layout.align(), 0);
                assert!(std::slice::from_raw_parts(p, layout.size())
                    .iter()
                    .all(|&b| b == 0));
                a.dealloc(p, layout);
            }
            // More blocks than slots (other tests may hold some): the rest from mimalloc.
            let blocks: Vec<*mut u8> = (0..MAPPED_SLOTS + 4)
                .map(|_| a.alloc_zeroed(large))
                .collect();
            assert!(
                blocks.iter().any(|&p| !is_mapped(p)),
                "the table has {MAPPED_SLOTS} slots"
            );
            for &p in &blocks {
                assert!(std::slice::from_raw_parts(p, large.size())
                    .iter()
                    .all(|&b| b == 0));
                std::ptr::write_bytes(p, 1, large.size());
            }
            for p in blocks {
                a.dealloc(p, large);
                assert!(!is_mapped(p));
            }
        }
    }

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
