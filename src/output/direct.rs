//! How `rebuild`'s staging outputs keep their bytes out of the page cache.
//!
//! A rebuild writes every output byte once and must have all of them on disk before it swaps
//! the new outputs in, so keeping them in the page cache buys nothing: it costs a copy into
//! page-cache pages the kernel must first find (on a VM whose host takes idle guest memory
//! back, each fresh page is also a fault on the host: a 1 GiB buffered write ran at 349 MB/s
//! cold, 4 GB/s warm), and the closing sync writes them out anyway. Two ways, by output:
//!
//! - npy feature columns are long streams of rows: written straight to the disk (`O_DIRECT`)
//!   in large aligned writes from a reused buffer ([`DirectStream`]), about 2 MB per column
//!   per batch;
//! - HDF5 files are written by the library, one 60 KiB chunk per `pwrite`, too small for direct
//!   writes to keep up (a direct write waits for the device, a fraction of a millisecond each,
//!   under HDF5's global lock): they go through the page cache, which each batch gives back
//!   once written ([`Recycler`]), so the next batches reuse the same few warm pages.
//!
//! The narrow columns, HDF5's metadata and everything the service writes go through the page
//! cache as before. Measured figures: docs/benchmarks.md.
//!
//! `O_DIRECT` needs the file offset, the length and the buffer address aligned to the
//! device's logical block; [`BLOCK`] (4 KiB) covers every common device and is a whole number
//! of file-system blocks on ext4 and xfs, so a direct write never shares a page with bytes
//! written through the page cache. A file system that refuses `O_DIRECT` (at open or at the
//! first write, `EINVAL`) gets the same bytes through the page cache; the caller decides that,
//! with [`refused`].

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Alignment of every direct write: offset, length and buffer address.
pub const BLOCK: usize = 4096;

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Block([u8; BLOCK]);

// SAFETY: a plain byte array with no padding (size equals alignment); any bit pattern is valid.
unsafe impl bytemuck::Zeroable for Block {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for Block {}

/// A growable byte buffer whose start is [`BLOCK`]-aligned, kept for the life of a column so
/// that its pages are faulted in once.
#[derive(Default)]
struct AlignedBuf {
    blocks: Vec<Block>,
    len: usize,
}

impl AlignedBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.blocks)[..self.len]
    }

    fn push(&mut self, data: &[u8]) {
        let end = self.len + data.len();
        let blocks = end.div_ceil(BLOCK);
        if self.blocks.len() < blocks {
            self.blocks.resize(blocks, Block([0; BLOCK]));
        }
        bytemuck::cast_slice_mut(&mut self.blocks)[self.len..end].copy_from_slice(data);
        self.len = end;
    }

    /// Keep only the first `len` bytes.
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Drop the first `n` bytes (a multiple of [`BLOCK`]), moving the rest to the front.
    fn consume(&mut self, n: usize) {
        assert!(
            n.is_multiple_of(BLOCK) && n <= self.len,
            "consume {n} of {}",
            self.len
        );
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.blocks);
        bytes.copy_within(n..self.len, 0);
        self.len -= n;
    }
}

/// A second descriptor of an output file, opened with `O_DIRECT`.
struct DirectFile {
    file: File,
}

impl DirectFile {
    /// Open `path` (which exists) for direct writes; `None` where its file system refuses
    /// `O_DIRECT`.
    fn open(path: &Path) -> std::io::Result<Option<Self>> {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => Ok(Some(DirectFile { file })),
            Err(e) if refused(&e) => {
                log::debug!("{}: no direct writes here ({e})", path.display());
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Write `bytes` (a [`BLOCK`]-aligned buffer of whole blocks) at `offset` (a multiple of
    /// [`BLOCK`]).
    fn write_at(&self, bytes: &[u8], offset: u64) -> std::io::Result<()> {
        assert!(
            (bytes.as_ptr() as usize).is_multiple_of(BLOCK)
                && bytes.len().is_multiple_of(BLOCK)
                && offset.is_multiple_of(BLOCK as u64),
            "unaligned direct write of {} bytes at {offset}",
            bytes.len()
        );
        self.file.write_all_at(bytes, offset)
    }
}

/// Whether an error means "this file system does not do direct I/O here" (so the bytes go
/// through the page cache instead) rather than a failure to report.
pub fn refused(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// A column file's bytes from some offset on, written as a stream of appends: the bytes before
/// the first [`BLOCK`] boundary and the last partial block go through the page cache (`file`),
/// the whole blocks between them straight to the disk. Used by the npy columns, whose rows
/// follow the header back to back.
pub struct DirectStream {
    direct: DirectFile,
    buf: AlignedBuf,
    /// File offset of `buf`'s first byte (a multiple of [`BLOCK`]); bytes before it are in
    /// the file.
    at: u64,
    /// Bytes written directly so far.
    pub written: u64,
}

impl DirectStream {
    /// A stream whose next byte goes at `offset`; `None` where direct writes are refused.
    pub fn open(path: &Path, offset: u64) -> std::io::Result<Option<Self>> {
        Ok(DirectFile::open(path)?.map(|direct| DirectStream {
            direct,
            buf: AlignedBuf::default(),
            at: offset.next_multiple_of(BLOCK as u64),
            written: 0,
        }))
    }

    /// Offset of the next byte of the stream.
    pub fn end(&self) -> u64 {
        self.at + self.buf.len() as u64
    }

    /// Append `bytes` at `offset` (the stream's end, or before its first block boundary).
    /// Whole blocks are written at once; the rest waits for the next append or [`finish`].
    /// On an error nothing of `bytes` is kept, and the stream is as before.
    ///
    /// [`finish`]: DirectStream::finish
    pub fn append(&mut self, file: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
        // Bytes before the first block boundary (the stream has not reached it yet).
        let head = (self.at.saturating_sub(offset) as usize).min(bytes.len());
        if head > 0 {
            file.write_all_at(&bytes[..head], offset)?;
        }
        let (bytes, offset) = (&bytes[head..], offset + head as u64);
        if bytes.is_empty() {
            return Ok(());
        }
        assert_eq!(
            offset,
            self.end(),
            "direct stream appends must follow each other"
        );
        let before = self.buf.len();
        self.buf.push(bytes);
        let whole = self.buf.len() / BLOCK * BLOCK;
        if whole > 0 {
            if let Err(e) = self.direct.write_at(&self.buf.bytes()[..whole], self.at) {
                self.buf.truncate(before);
                return Err(e);
            }
            self.buf.consume(whole);
            self.at += whole as u64;
            self.written += whole as u64;
        }
        Ok(())
    }

    /// Write what is still buffered (less than a block) through `file`. The stream is done.
    pub fn finish(self, file: &File) -> std::io::Result<()> {
        file.write_all_at(self.buf.bytes(), self.at)
    }
}

/// Gives a file's page cache back as the file grows: each call waits for the writeback of what
/// the file held at the previous call (started then: the caller starts writeback after each
/// batch) and drops those pages, then notes the file's size. Pages are dropped a batch behind,
/// whole pages only, and only clean ones (`POSIX_FADV_DONTNEED` never drops a dirty page): a
/// page written again later is read back first, never lost.
#[derive(Default)]
pub struct Recycler {
    /// Bytes below this were given back.
    dropped: u64,
    /// The file's size at the previous call.
    seen: u64,
}

impl Recycler {
    pub fn recycle(&mut self, fd: std::os::fd::RawFd) -> std::io::Result<()> {
        let end = self.seen / BLOCK as u64 * BLOCK as u64;
        if end > self.dropped {
            let (offset, len) = (
                self.dropped as libc::off64_t,
                (end - self.dropped) as libc::off64_t,
            );
            // SAFETY: plain system calls on a descriptor the caller holds open.
            unsafe {
                let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER;
                if libc::sync_file_range(fd, offset, len, wait) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let r = libc::posix_fadvise(fd, offset, len, libc::POSIX_FADV_DONTNEED);
                if r != 0 {
                    return Err(std::io::Error::from_raw_os_error(r));
                }
            }
            self.dropped = end;
        }
        // SAFETY: as above; `st` is written by the call.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.seen = st.st_size as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_writes_every_byte_where_it_belongs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("col");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.write_all_at(b"header", 0).unwrap();
        let Some(mut s) = DirectStream::open(&path, 100).unwrap() else {
            // tmpfs and some network file systems refuse O_DIRECT: then the page cache is the
            // path, which the sinks' own tests cover.
            panic!(
                "{}: this test needs a file system with O_DIRECT",
                path.display()
            );
        };
        // Appends of odd sizes across the first block boundary and many blocks after it.
        let mut expected = vec![0u8; 100];
        expected[..6].copy_from_slice(b"header");
        let mut at = 100u64;
        for (i, n) in [10usize, 5000, 3, 9000, 4096, 1, 20000]
            .into_iter()
            .enumerate()
        {
            let chunk: Vec<u8> = (0..n).map(|k| (k * 7 + i) as u8).collect();
            s.append(&file, &chunk, at).unwrap();
            expected.extend(&chunk);
            at += n as u64;
        }
        assert!(s.written > 0, "whole blocks went the direct way");
        assert_eq!(s.written % BLOCK as u64, 0);
        s.finish(&file).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), expected);
    }

    #[test]
    fn an_aligned_buffer_keeps_its_bytes_when_consumed() {
        let mut b = AlignedBuf::default();
        let data: Vec<u8> = (0..3 * BLOCK + 17).map(|k| k as u8).collect();
        b.push(&data);
        assert_eq!(b.bytes().as_ptr() as usize % BLOCK, 0);
        b.consume(2 * BLOCK);
        assert_eq!(b.bytes(), &data[2 * BLOCK..]);
        b.truncate(5);
        assert_eq!(b.bytes(), &data[2 * BLOCK..2 * BLOCK + 5]);
        b.push(&data[..BLOCK]);
        assert_eq!(&b.bytes()[5..], &data[..BLOCK]);
    }
}
