//! A test-support file system held in memory and served through FUSE (the `fuser` crate), for
//! the power-cut and failing-disk tests (tests/power_loss.rs).
//!
//! - It serves what the service needs from a local disk: files read and written at any offset
//!   (`pread`/`pwrite`), truncated, extended, memory-mapped shared and writable (the kernel's page
//!   cache is used: no `direct_io`), `fsync`/`fdatasync`, folders (`mkdir`, `readdir`, `rmdir`),
//!   `rename` (also over an existing name, and `RENAME_NOREPLACE`), `unlink`, `fallocate` (to
//!   extend, and `PUNCH_HOLE | KEEP_SIZE`, pending until a sync as a write is), attributes (size,
//!   mode, mtime) and `statfs` (plenty of free space). `flock` and POSIX locks are not forwarded
//!   to it: the kernel keeps them locally, which is all one host needs. `O_DIRECT` opens are
//!   refused with `EINVAL`, as tmpfs and many network file systems do (the service falls back
//!   to the page cache).
//! - It keeps durability as a pessimistic disk does (the LazyFS model): a file's bytes and size
//!   become durable only at an `fsync`/`fdatasync` of that file; a folder's entries (a file or
//!   folder created, renamed or removed) only at an `fsync` of that folder. Every file keeps its
//!   current and its durable content, every folder its current and its durable entries.
//! - [`FaultFs::cut`] is a power cut: the test first kills the writers, then the file system is
//!   unmounted, every file and folder goes back to its durable state (what was never made
//!   durable is gone, and so is a file no durable entry names), and it is mounted again at the
//!   same place. [`FaultFs::cut_at_sync`] picks the instant: the power goes at the n-th sync
//!   (`fsync` or folder `fsync`) seen since the mount was made, before that sync takes effect;
//!   from then on every operation fails with `EIO` until the cut, so nothing done after that
//!   instant reaches the disk. Only syncs change the durable state, so cutting at every sync
//!   count reaches every state a power cut can leave.
//! - [`FaultFs::fail`] makes the disk fail with `EIO`: every modifying operation
//!   ([`Mode::AllWrites`]) or only the syncs ([`Mode::FsyncOnly`]).
//!
//! The file system is served by threads of the test process: that process must never map one
//! of its files into memory (a page fault it would have to serve itself, while its own memory
//! allocations wait for the fault's lock, hangs the process). Other processes (the service, a
//! Python helper) map them freely.
//!
//! Content is kept in copy-on-write pages, so a sync (the durable copy taking the current one)
//! costs a page list, not the file's bytes.
#![allow(dead_code)]

use fuser::{
    BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

/// Size of a copy-on-write page of file content.
const PAGE: usize = 16 * 1024;
/// How long the kernel may keep attributes and names: short, so nothing it caches hides a
/// change for long (every change goes through this mount anyway, and a cut remounts it).
const TTL: Duration = Duration::from_millis(100);
const ROOT: u64 = 1;

/// Which operations fail with `EIO`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The disk works.
    None,
    /// Every write, sync, create, mkdir, rename, unlink, rmdir, truncate and size change fails.
    AllWrites,
    /// Only `fsync`, `fdatasync` (and `msync`) and folder syncs fail.
    FsyncOnly,
}

/// Operations seen since the file system was made (they go on counting across cuts).
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub writes: u64,
    pub bytes_written: u64,
    /// `fsync`/`fdatasync` of files (`msync` arrives as one too).
    pub fsyncs: u64,
    /// `fsync` of folders.
    pub fsyncdirs: u64,
    pub creates: u64,
    pub renames: u64,
    pub unlinks: u64,
    pub truncates: u64,
    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)` calls (sled deallocates its free log segments so).
    pub punches: u64,
    /// Operations answered with `EIO` by [`FaultFs::fail`] or after the power went.
    pub failed: u64,
    /// Power cuts so far.
    pub cuts: u64,
}

impl Stats {
    /// Syncs of files and folders: the only operations that change the durable state.
    pub fn syncs(&self) -> u64 {
        self.fsyncs + self.fsyncdirs
    }
}

/// `offset..end` cut at page boundaries: (page, offset within it, length, position in the file).
fn pieces(offset: u64, end: u64) -> impl Iterator<Item = (usize, usize, usize, u64)> {
    let mut pos = offset;
    std::iter::from_fn(move || {
        (pos < end).then(|| {
            let within = (pos % PAGE as u64) as usize;
            let n = (PAGE - within).min((end - pos) as usize);
            let piece = ((pos / PAGE as u64) as usize, within, n, pos);
            pos += n as u64;
            piece
        })
    })
}

/// A file's bytes: pages of `PAGE` bytes (None: zeros), and the size. Bytes past the size in
/// the last page are always zero.
#[derive(Clone, Default)]
struct Content {
    pages: Vec<Option<Arc<Vec<u8>>>>,
    size: u64,
}

impl Content {
    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        if offset >= self.size {
            return Vec::new();
        }
        let end = (offset + len as u64).min(self.size);
        let mut out = vec![0u8; (end - offset) as usize];
        for (p, within, n, pos) in pieces(offset, end) {
            if let Some(Some(page)) = self.pages.get(p) {
                let at = (pos - offset) as usize;
                out[at..at + n].copy_from_slice(&page[within..within + n]);
            }
        }
        out
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        let need = end.div_ceil(PAGE as u64) as usize;
        if self.pages.len() < need {
            self.pages.resize(need, None);
        }
        for (p, within, n, pos) in pieces(offset, end) {
            let page = self.pages[p].get_or_insert_with(|| Arc::new(vec![0u8; PAGE]));
            let at = (pos - offset) as usize;
            Arc::make_mut(page)[within..within + n].copy_from_slice(&data[at..at + n]);
        }
        self.size = self.size.max(end);
    }

    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)`: the range (clipped to the size) reads as zeros; whole
    /// pages are dropped, as a file system deallocates their blocks.
    fn punch(&mut self, offset: u64, len: u64) {
        for (p, within, n, _) in pieces(offset, (offset + len).min(self.size)) {
            if let Some(slot) = self.pages.get_mut(p) {
                if n == PAGE {
                    *slot = None;
                } else if let Some(page) = slot {
                    Arc::make_mut(page)[within..within + n].fill(0);
                }
            }
        }
    }

    fn truncate(&mut self, size: u64) {
        if size < self.size {
            self.pages.truncate(size.div_ceil(PAGE as u64) as usize);
            // The page holding the new end (if it has bytes at all) is zero past it.
            let within = (size % PAGE as u64) as usize;
            if within != 0 {
                if let Some(Some(page)) = self.pages.get_mut((size / PAGE as u64) as usize) {
                    Arc::make_mut(page)[within..].fill(0);
                }
            }
        }
        self.size = size;
    }
}

enum Body {
    File {
        cur: Content,
        durable: Content,
    },
    Dir {
        cur: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
    },
}

struct Node {
    body: Body,
    perm: u16,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
    ctime: SystemTime,
    atime: SystemTime,
    /// Entries naming it now, and in the folders' durable entries.
    links: u32,
    durable_links: u32,
    /// Open handles (and mappings) the kernel holds.
    open: u32,
}

impl Node {
    fn new(body: Body, perm: u16, uid: u32, gid: u32) -> Node {
        let now = SystemTime::now();
        Node {
            body,
            perm,
            uid,
            gid,
            mtime: now,
            ctime: now,
            atime: now,
            links: 0,
            durable_links: 0,
            open: 0,
        }
    }

    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, size, nlink) = match &self.body {
            Body::File { cur, .. } => (FileType::RegularFile, cur.size, self.links.max(1)),
            Body::Dir { cur, .. } => (FileType::Directory, 4096, 2 + cur.len() as u32),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            crtime: self.ctime,
            kind,
            perm: self.perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    next_fh: u64,
    mode: Mode,
    /// How long a refused `write` takes to answer ([`FaultFs::refuse_slowly`]).
    refusal: Duration,
    /// The power is off: every operation fails until the cut.
    dead: bool,
    /// The power goes when the sync count reaches this (before that sync takes effect).
    trigger: Option<u64>,
    /// Bumped at every cut: handlers of an older mount are refused.
    generation: u64,
    stats: Stats,
}

impl State {
    fn new() -> State {
        let mut root = Node::new(
            Body::Dir {
                cur: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
            0o755,
            0,
            0,
        );
        root.links = 1;
        root.durable_links = 1;
        let mut nodes = HashMap::new();
        nodes.insert(ROOT, root);
        State {
            nodes,
            next_ino: 2,
            next_fh: 1,
            mode: Mode::None,
            refusal: Duration::ZERO,
            dead: false,
            trigger: None,
            generation: 0,
            stats: Stats::default(),
        }
    }

    fn dir(&self, ino: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match self.nodes.get(&ino).map(|n| &n.body) {
            Some(Body::Dir { cur, .. }) => Ok(cur),
            Some(_) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn dir_mut(&mut self, ino: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match self.nodes.get_mut(&ino).map(|n| &mut n.body) {
            Some(Body::Dir { cur, .. }) => Ok(cur),
            Some(_) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn touch(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            let now = SystemTime::now();
            n.mtime = now;
            n.ctime = now;
        }
    }

    /// A modifying operation: refused while the power is off or writes fail.
    fn may_write(&mut self) -> Result<(), Errno> {
        if self.dead || self.mode == Mode::AllWrites {
            self.stats.failed += 1;
            return Err(Errno::EIO);
        }
        Ok(())
    }

    /// A sync: counts, may be where the power goes, may fail.
    fn may_sync(&mut self) -> Result<(), Errno> {
        if self.dead {
            self.stats.failed += 1;
            return Err(Errno::EIO);
        }
        let n = self.stats.syncs() + 1;
        if self.trigger.is_some_and(|t| n >= t) {
            self.dead = true;
            self.trigger = None;
            self.stats.failed += 1;
            return Err(Errno::EIO);
        }
        if self.mode != Mode::None {
            self.stats.failed += 1;
            return Err(Errno::EIO);
        }
        Ok(())
    }

    /// Drop a file nothing names, now or durably, and nobody holds open (folders are kept
    /// until the next cut: they are few and small).
    fn maybe_drop(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get(&ino) {
            if matches!(n.body, Body::File { .. })
                && n.links == 0
                && n.durable_links == 0
                && n.open == 0
            {
                self.nodes.remove(&ino);
            }
        }
    }

    fn new_node(&mut self, body: Body, perm: u16, req: &Request) -> u64 {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes
            .insert(ino, Node::new(body, perm, req.uid(), req.gid()));
        ino
    }

    /// The power cut: everything back to its durable state.
    fn reset_to_durable(&mut self) {
        let mut reachable = HashMap::<u64, u32>::new();
        let mut stack = vec![ROOT];
        reachable.insert(ROOT, 1);
        while let Some(ino) = stack.pop() {
            if let Some(Node {
                body: Body::Dir { durable, .. },
                ..
            }) = self.nodes.get(&ino)
            {
                for child in durable.values() {
                    let seen = reachable.contains_key(child);
                    *reachable.entry(*child).or_insert(0) += 1;
                    if !seen {
                        stack.push(*child);
                    }
                }
            }
        }
        self.nodes.retain(|ino, _| reachable.contains_key(ino));
        for (ino, node) in self.nodes.iter_mut() {
            match &mut node.body {
                Body::File { cur, durable } => *cur = durable.clone(),
                Body::Dir { cur, durable } => *cur = durable.clone(),
            }
            node.links = reachable[ino];
            node.durable_links = reachable[ino];
            node.open = 0;
        }
        self.dead = false;
        self.trigger = None;
        self.mode = Mode::None;
        self.generation += 1;
        self.stats.cuts += 1;
    }
}

/// What a `setattr` asks to change.
struct AttrChange {
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    size: Option<u64>,
    atime: Option<TimeOrNow>,
    mtime: Option<TimeOrNow>,
}

/// The FUSE side: every request takes the shared state's lock for a moment.
struct Handler {
    state: Arc<Mutex<State>>,
    generation: u64,
}

fn valid_name(name: &OsStr) -> Result<OsString, Errno> {
    if name.is_empty() || name.len() > 255 {
        return Err(Errno::ENAMETOOLONG);
    }
    Ok(name.to_os_string())
}

fn to_system_time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Handler {
    /// The state, or EIO for a request of a mount that a cut has ended.
    fn lock(&self) -> Result<MutexGuard<'_, State>, Errno> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.generation != self.generation {
            return Err(Errno::EIO);
        }
        Ok(st)
    }

    /// A read-only operation: works unless the power is off.
    fn live(&self) -> Result<MutexGuard<'_, State>, Errno> {
        let mut st = self.lock()?;
        if st.dead {
            st.stats.failed += 1;
            return Err(Errno::EIO);
        }
        Ok(st)
    }

    fn do_create(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        mode: u32,
        dir: bool,
    ) -> Result<FileAttr, Errno> {
        let name = valid_name(name)?;
        let mut st = self.lock()?;
        st.may_write()?;
        if st.dir(parent)?.contains_key(&name) {
            return Err(Errno::EEXIST);
        }
        let body = if dir {
            Body::Dir {
                cur: BTreeMap::new(),
                durable: BTreeMap::new(),
            }
        } else {
            Body::File {
                cur: Content::default(),
                durable: Content::default(),
            }
        };
        let ino = st.new_node(body, (mode & 0o7777) as u16, req);
        st.dir_mut(parent)?.insert(name, ino);
        st.node_mut(ino)?.links = 1;
        st.touch(parent);
        st.stats.creates += 1;
        Ok(st.node(ino)?.attr(ino))
    }

    fn do_remove(&self, parent: u64, name: &OsStr, dir: bool) -> Result<(), Errno> {
        let mut st = self.lock()?;
        st.may_write()?;
        let ino = *st.dir(parent)?.get(name).ok_or(Errno::ENOENT)?;
        match &st.node(ino)?.body {
            Body::Dir { cur, .. } => {
                if !dir {
                    return Err(Errno::EISDIR);
                }
                if !cur.is_empty() {
                    return Err(Errno::ENOTEMPTY);
                }
            }
            Body::File { .. } => {
                if dir {
                    return Err(Errno::ENOTDIR);
                }
            }
        }
        st.dir_mut(parent)?.remove(name);
        st.touch(parent);
        let n = st.node_mut(ino)?;
        n.links = n.links.saturating_sub(1);
        n.ctime = SystemTime::now();
        st.stats.unlinks += 1;
        st.maybe_drop(ino);
        Ok(())
    }

    fn do_rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: RenameFlags,
    ) -> Result<(), Errno> {
        let newname = valid_name(newname)?;
        let mut st = self.lock()?;
        st.may_write()?;
        if flags.contains(RenameFlags::RENAME_EXCHANGE)
            || flags.contains(RenameFlags::RENAME_WHITEOUT)
        {
            return Err(Errno::EINVAL);
        }
        let ino = *st.dir(parent)?.get(name).ok_or(Errno::ENOENT)?;
        let is_dir = matches!(st.node(ino)?.body, Body::Dir { .. });
        let target = st.dir(newparent)?.get(&newname).copied();
        if let Some(t) = target {
            if t == ino {
                return Ok(());
            }
            if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                return Err(Errno::EEXIST);
            }
            match &st.node(t)?.body {
                Body::Dir { cur, .. } => {
                    if !is_dir {
                        return Err(Errno::EISDIR);
                    }
                    if !cur.is_empty() {
                        return Err(Errno::ENOTEMPTY);
                    }
                }
                Body::File { .. } => {
                    if is_dir {
                        return Err(Errno::ENOTDIR);
                    }
                }
            }
        }
        if is_dir {
            // A folder may not move into itself or below itself.
            let mut stack = vec![ino];
            while let Some(d) = stack.pop() {
                if d == newparent {
                    return Err(Errno::EINVAL);
                }
                if let Ok(entries) = st.dir(d) {
                    stack.extend(entries.values().copied());
                }
            }
        }
        st.dir_mut(parent)?.remove(name);
        st.dir_mut(newparent)?.insert(newname, ino);
        st.touch(parent);
        st.touch(newparent);
        if let Some(t) = target {
            let n = st.node_mut(t)?;
            n.links = n.links.saturating_sub(1);
            st.maybe_drop(t);
        }
        st.stats.renames += 1;
        Ok(())
    }

    fn do_setattr(&self, ino: u64, c: AttrChange) -> Result<FileAttr, Errno> {
        let mut st = self.lock()?;
        if st.dead {
            st.stats.failed += 1;
            return Err(Errno::EIO);
        }
        if let Some(size) = c.size {
            st.may_write()?;
            match &mut st.node_mut(ino)?.body {
                Body::File { cur, .. } => cur.truncate(size),
                Body::Dir { .. } => return Err(Errno::EISDIR),
            }
            st.touch(ino);
            st.stats.truncates += 1;
        }
        let n = st.node_mut(ino)?;
        if let Some(m) = c.mode {
            n.perm = (m & 0o7777) as u16;
        }
        if let Some(u) = c.uid {
            n.uid = u;
        }
        if let Some(g) = c.gid {
            n.gid = g;
        }
        if let Some(t) = c.atime {
            n.atime = to_system_time(t);
        }
        if let Some(t) = c.mtime {
            n.mtime = to_system_time(t);
        }
        n.ctime = SystemTime::now();
        Ok(n.attr(ino))
    }
}

impl Filesystem for Handler {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.live().and_then(|st| {
            let ino = *st.dir(parent.0)?.get(name).ok_or(Errno::ENOENT)?;
            Ok(st.node(ino)?.attr(ino))
        });
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.live().and_then(|st| Ok(st.node(ino.0)?.attr(ino.0))) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let change = AttrChange {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
        };
        match self.do_setattr(ino.0, change) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        match self.do_create(req, parent.0, name, mode, false) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        match self.do_create(req, parent.0, name, mode, true) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.do_remove(parent.0, name, false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.do_remove(parent.0, name, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        match self.do_rename(parent.0, name, newparent.0, newname, flags) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_DIRECT != 0 {
            return reply.error(Errno::EINVAL);
        }
        let r = self.live().and_then(|mut st| {
            let n = st.node_mut(ino.0)?;
            if matches!(n.body, Body::Dir { .. }) {
                return Err(Errno::EISDIR);
            }
            n.open += 1;
            st.next_fh += 1;
            Ok(st.next_fh)
        });
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = self.live().and_then(|st| match &st.node(ino.0)?.body {
            Body::File { cur, .. } => Ok(cur.read(offset, size as usize)),
            Body::Dir { .. } => Err(Errno::EISDIR),
        });
        match r {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut refusal = Duration::ZERO;
        let r = self.lock().and_then(|mut st| {
            refusal = st.refusal;
            st.may_write()?;
            match &mut st.node_mut(ino.0)?.body {
                Body::File { cur, .. } => cur.write(offset, data),
                Body::Dir { .. } => return Err(Errno::EISDIR),
            }
            st.touch(ino.0);
            st.stats.writes += 1;
            st.stats.bytes_written += data.len() as u64;
            Ok(())
        });
        match r {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => {
                // Outside the lock: other requests are served meanwhile.
                std::thread::sleep(refusal);
                reply.error(e)
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Ok(mut st) = self.lock() {
            if let Ok(n) = st.node_mut(ino.0) {
                n.open = n.open.saturating_sub(1);
            }
            st.maybe_drop(ino.0);
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let r = self.lock().and_then(|mut st| {
            st.may_sync()?;
            st.stats.fsyncs += 1;
            if let Body::File { cur, durable } = &mut st.node_mut(ino.0)?.body {
                *durable = cur.clone();
            }
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.live().and_then(|st| st.dir(ino.0).map(|_| ())) {
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = self.live().and_then(|st| {
            let dir = st.dir(ino.0)?;
            let mut all = vec![
                (ino.0, FileType::Directory, OsString::from(".")),
                (ino.0, FileType::Directory, OsString::from("..")),
            ];
            for (name, child) in dir {
                let kind = match st.nodes.get(child).map(|n| &n.body) {
                    Some(Body::Dir { .. }) => FileType::Directory,
                    _ => FileType::RegularFile,
                };
                all.push((*child, kind, name.clone()));
            }
            Ok(all)
        });
        match r {
            Ok(all) => {
                for (i, (child, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(child), i as u64 + 1, kind, &name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let r = self.lock().and_then(|mut st| {
            st.may_sync()?;
            st.stats.fsyncdirs += 1;
            let (old, new) = match &mut st.node_mut(ino.0)?.body {
                Body::Dir { cur, durable } => {
                    let old = std::mem::replace(durable, cur.clone());
                    (old, cur.clone())
                }
                Body::File { .. } => return Err(Errno::ENOTDIR),
            };
            for child in new.values() {
                if let Some(n) = st.nodes.get_mut(child) {
                    n.durable_links += 1;
                }
            }
            // A folder has one parent: on a journaling file system a rename is one transaction,
            // so a folder renamed here and made durable here is no longer durable where it was
            // (without this, a power cut could leave it in both places, which no disk does).
            let moved: Vec<u64> = new
                .values()
                .filter(|c| !old.values().any(|o| o == *c))
                .filter(|c| {
                    matches!(
                        st.nodes.get(c),
                        Some(Node {
                            body: Body::Dir { .. },
                            ..
                        })
                    )
                })
                .copied()
                .collect();
            if !moved.is_empty() {
                let parent = ino.0;
                let mut unlinked = Vec::new();
                for (other, node) in st.nodes.iter_mut() {
                    if *other == parent {
                        continue;
                    }
                    if let Body::Dir { durable, .. } = &mut node.body {
                        durable.retain(|_, c| {
                            let keep = !moved.contains(c);
                            if !keep {
                                unlinked.push(*c);
                            }
                            keep
                        });
                    }
                }
                for c in unlinked {
                    if let Some(n) = st.nodes.get_mut(&c) {
                        n.durable_links = n.durable_links.saturating_sub(1);
                    }
                }
            }
            for child in old.values() {
                if let Some(n) = st.nodes.get_mut(child) {
                    n.durable_links = n.durable_links.saturating_sub(1);
                }
                st.maybe_drop(*child);
            }
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // 4 TiB, all of it free.
        let blocks = 1u64 << 30;
        reply.statfs(blocks, blocks, blocks, 1 << 24, 1 << 24, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        if flags & libc::O_DIRECT != 0 {
            return reply.error(Errno::EINVAL);
        }
        let r = self
            .do_create(req, parent.0, name, mode, false)
            .and_then(|a| {
                let mut st = self.lock()?;
                st.node_mut(a.ino.0)?.open += 1;
                st.next_fh += 1;
                Ok((a, st.next_fh))
            });
        match r {
            Ok((a, fh)) => {
                reply.created(&TTL, &a, Generation(0), FileHandle(fh), FopenFlags::empty())
            }
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if mode != 0 && mode != libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let r = self.lock().and_then(|mut st| {
            st.may_write()?;
            match &mut st.node_mut(ino.0)?.body {
                // A hole is pending, as a write is: durable at the file's next sync.
                Body::File { cur, .. } if mode != 0 => cur.punch(offset, length),
                Body::File { cur, .. } if offset + length > cur.size => {
                    cur.truncate(offset + length)
                }
                Body::File { .. } => {}
                Body::Dir { .. } => return Err(Errno::EISDIR),
            }
            if mode != 0 {
                st.touch(ino.0);
                st.stats.punches += 1;
            }
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

/// The file system, mounted on a folder of the test's; unmounted when dropped.
pub struct FaultFs {
    state: Arc<Mutex<State>>,
    mountpoint: PathBuf,
    session: Option<fuser::BackgroundSession>,
}

impl FaultFs {
    /// Make an empty file system and mount it on `mountpoint` (created if missing).
    pub fn mount(mountpoint: &Path) -> FaultFs {
        std::fs::create_dir_all(mountpoint).unwrap();
        let mut fs = FaultFs {
            state: Arc::new(Mutex::new(State::new())),
            mountpoint: mountpoint.to_path_buf(),
            session: None,
        };
        fs.attach();
        fs
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attach(&mut self) {
        let generation = self.st().generation;
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName("ailhd-faultfs".into()),
            fuser::MountOption::Subtype("faultfs".into()),
        ];
        config.n_threads = Some(2);
        let handler = Handler {
            state: self.state.clone(),
            generation,
        };
        let session = fuser::spawn_mount(handler, &self.mountpoint, &config).unwrap_or_else(|e| {
            panic!(
                "mounting the test file system on {} (FUSE: needs /dev/fuse and root, or fusermount3 from Debian's fuse3): {e}",
                self.mountpoint.display()
            )
        });
        self.session = Some(session);
        // The mount is served once the root answers.
        let t = Instant::now();
        while std::fs::read_dir(&self.mountpoint).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the FUSE mount does not answer"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Unmount and wait for the session to end. The writers must be gone (killed): files still
    /// open keep the mount busy; after 5 s of that it is detached lazily (and the old session's
    /// requests fail from then on: a cut bumps the generation they check).
    fn detach(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes()).unwrap();
        let t = Instant::now();
        loop {
            // SAFETY: a NUL-terminated path.
            if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBUSY) || t.elapsed() > Duration::from_secs(5) {
                eprintln!(
                    "faultfs: unmounting {}: {e}; detaching it lazily",
                    self.mountpoint.display()
                );
                // SAFETY: as above.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                // The session thread ends when the last user lets go: do not wait for it.
                std::mem::forget(session);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = session.join();
    }

    /// Which operations fail with `EIO` from now on.
    pub fn fail(&self, mode: Mode) {
        self.st().mode = mode;
    }

    /// From now on a refused `write` answers only after `d`, as a disk that retries before it
    /// gives up does: meanwhile the kernel's page cache shows readers the refused bytes (see
    /// tests/power_loss.rs, `failing_disk`), long enough for a test to catch it.
    pub fn refuse_slowly(&self, d: Duration) {
        self.st().refusal = d;
    }

    pub fn mode(&self) -> Mode {
        self.st().mode
    }

    pub fn stats(&self) -> Stats {
        self.st().stats
    }

    /// The power goes now: every operation fails from this instant until [`cut`](Self::cut).
    pub fn power_off(&self) {
        self.st().dead = true;
    }

    /// The power goes at the `n`-th sync since the file system was made ([`Stats::syncs`]),
    /// before it takes effect (at the next one if `n` has passed).
    pub fn cut_at_sync(&self, n: u64) {
        self.st().trigger = Some(n);
    }

    /// Whether the power is off (by [`power_off`](Self::power_off) or a
    /// [`cut_at_sync`](Self::cut_at_sync) that has fired).
    pub fn is_off(&self) -> bool {
        self.st().dead
    }

    /// The power cut, after the test has killed every process writing here: unmount, every
    /// file and folder back to its durable state, mount again at the same place. The disk works
    /// again afterwards ([`Mode::None`]).
    pub fn cut(&mut self) {
        self.st().dead = true;
        self.detach();
        self.st().reset_to_durable();
        self.attach();
    }
}

impl Drop for FaultFs {
    fn drop(&mut self) {
        self.st().dead = true;
        self.detach();
    }
}
