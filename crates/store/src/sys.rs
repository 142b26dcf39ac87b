//! The few system calls std does not offer: vectored positional writes, reads from the page
//! cache only, hole punching, `flock`, syncing a directory, syncing a range of a file, and
//! writes through a shared mapping of a file in memory.

use std::{
    fs::File,
    io,
    mem::MaybeUninit,
    ops::Range,
    os::fd::AsRawFd,
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
};

/// Most buffers handed to one `pwritev` (Linux's `IOV_MAX`).
const IOVECS_MAX: usize = 1024;

/// Write every buffer of `bufs`, back to back, at `offset`: one `pwritev` per 1024 buffers,
/// more only after a short write.
pub fn write_all_vectored_at(file: &File, bufs: &[&[u8]], mut offset: u64) -> io::Result<()> {
    let mut iovecs: Vec<libc::iovec> = Vec::with_capacity(bufs.len().min(IOVECS_MAX));
    let mut next = 0; // first buffer not yet (fully) written
    let mut skip = 0; // bytes of bufs[next] already written
    while next < bufs.len() {
        iovecs.clear();
        let mut first = true;
        for buf in bufs[next..].iter().take(IOVECS_MAX) {
            let start = if first { skip } else { 0 };
            first = false;
            iovecs
                .push(libc::iovec { iov_base: buf[start..].as_ptr() as *mut libc::c_void, iov_len: buf.len() - start });
        }
        let offset_os = libc::off_t::try_from(offset).expect("file offsets stay below 2^63");
        // SAFETY: every iovec points into a live borrowed slice for the duration of the call.
        let written =
            unsafe { libc::pwritev(file.as_raw_fd(), iovecs.as_ptr(), iovecs.len() as libc::c_int, offset_os) };
        if written < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        let mut written = written as usize;
        let total: usize = iovecs.iter().map(|v| v.iov_len).sum();
        if written == 0 && total > 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing"));
        }
        offset += written as u64;
        while next < bufs.len() && written >= bufs[next].len() - skip {
            written -= bufs[next].len() - skip;
            next += 1;
            skip = 0;
        }
        skip += written;
    }
    Ok(())
}

/// [`write_all_vectored_at`] one aligned `window` of the file at a time: no single write
/// crosses a multiple of `window` bytes (a power of two).
pub fn write_all_vectored_at_windowed(file: &File, bufs: &[&[u8]], offset: u64, window: u64) -> io::Result<()> {
    for_each_window(bufs, offset, window, |pieces, at| write_all_vectored_at(file, pieces, at))
}

/// Cut `bufs`, laid back to back from file offset `offset`, at every multiple of `window` (a
/// power of two), and hand each window's pieces in order to `write` with their file offset.
fn for_each_window(
    bufs: &[&[u8]],
    offset: u64,
    window: u64,
    mut write: impl FnMut(&[&[u8]], u64) -> io::Result<()>,
) -> io::Result<()> {
    assert!(window.is_power_of_two(), "a write window is a power of two");
    let total: u64 = bufs.iter().map(|buf| buf.len() as u64).sum();
    if total == 0 {
        return Ok(());
    }
    // Offsets and lengths stay below 2^63: no overflow.
    if offset / window == (offset + total - 1) / window {
        // Within one window (any write of a store in memory): as it is, nothing to cut.
        return write(bufs, offset);
    }
    let mut pieces: Vec<&[u8]> = Vec::new();
    let mut pieces_at = offset; // file offset of pieces[0]
    let mut at = offset; // file offset after the last piece
    for buf in bufs {
        let mut rest = *buf;
        while !rest.is_empty() {
            let window_end = (at | (window - 1)) + 1;
            let room = usize::try_from(window_end - at).unwrap_or(usize::MAX);
            let (piece, after) = rest.split_at(rest.len().min(room));
            pieces.push(piece);
            rest = after;
            at += piece.len() as u64;
            if at == window_end {
                write(&pieces, pieces_at)?;
                pieces.clear();
                pieces_at = at;
            }
        }
    }
    if !pieces.is_empty() {
        write(&pieces, pieces_at)?;
    }
    Ok(())
}

/// How reads of a store's data files may be made without blocking the caller on a disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonBlockingReads {
    /// The file system holds everything in memory (tmpfs, ramfs): a read never waits for I/O.
    Always,
    /// A read asks the page cache only (`preadv2` with `RWF_NOWAIT`) and says when it would
    /// have to wait for the disk.
    PageCacheOnly,
}

/// What reads of files under `dir` can do without blocking on I/O.
pub fn non_blocking_reads(dir: &Path) -> io::Result<NonBlockingReads> {
    use std::os::unix::ffi::OsStrExt;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: `path` is a valid C string and `stat` a plain out-parameter of the right type.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between C libraries
    let kind = stat.f_type as i64;
    Ok(if kind == TMPFS_MAGIC || kind == RAMFS_MAGIC {
        NonBlockingReads::Always
    } else {
        NonBlockingReads::PageCacheOnly
    })
}

/// Fill `buf` from `offset` with `pread`s, and return it, every byte now written. A buffer read
/// into need not be zeroed first (a 1 MiB read's zeroing was 9 % of an element's CPU).
pub fn read_exact_at_uninit<'a>(file: &File, buf: &'a mut [MaybeUninit<u8>], offset: u64) -> io::Result<&'a mut [u8]> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let offset_os = libc::off_t::try_from(offset + done as u64).expect("file offsets stay below 2^63");
        // SAFETY: pread writes at most `rest.len()` bytes into `rest`, borrowed mutably for the
        // call (`MaybeUninit<u8>` is laid out as `u8`).
        let read =
            unsafe { libc::pread(file.as_raw_fd(), rest.as_mut_ptr() as *mut libc::c_void, rest.len(), offset_os) };
        if read < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if read == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the file"));
        }
        done += read as usize;
    }
    // SAFETY: the reads above wrote every byte of `buf`.
    Ok(unsafe { assume_init(buf) })
}

/// As [`read_exact_at_uninit`], only from what the page cache holds (`RWF_NOWAIT`): `Ok(None)`
/// if part of it would have to come from the disk. A file system that cannot tell answers
/// `Unsupported`.
pub fn read_exact_at_cached<'a>(
    file: &File,
    buf: &'a mut [MaybeUninit<u8>],
    offset: u64,
) -> io::Result<Option<&'a mut [u8]>> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let iovec = libc::iovec { iov_base: rest.as_mut_ptr() as *mut libc::c_void, iov_len: rest.len() };
        let offset_os = libc::off_t::try_from(offset + done as u64).expect("file offsets stay below 2^63");
        // SAFETY: the iovec points into `rest`, borrowed mutably for the duration of the call.
        let read = unsafe { libc::preadv2(file.as_raw_fd(), &iovec, 1, offset_os, libc::RWF_NOWAIT) };
        if read < 0 {
            let error = io::Error::last_os_error();
            match error.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(None),
                Some(libc::EOPNOTSUPP) => return Err(io::Error::new(io::ErrorKind::Unsupported, error)),
                _ => return Err(error),
            }
        }
        if read == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the file"));
        }
        done += read as usize;
    }
    // SAFETY: the reads above wrote every byte of `buf`.
    Ok(Some(unsafe { assume_init(buf) }))
}

/// `buf` with zeroes written into every byte.
pub fn zero_uninit(buf: &mut [MaybeUninit<u8>]) -> &mut [u8] {
    // SAFETY: `buf` is borrowed mutably and `write_bytes` writes all `buf.len()` bytes of it.
    unsafe {
        std::ptr::write_bytes(buf.as_mut_ptr(), 0, buf.len());
        assume_init(buf)
    }
}

/// `buf` viewed as possibly uninitialized, to be filled by [`read_exact_at_uninit`],
/// [`read_exact_at_cached`] and [`zero_uninit`].
///
/// # Safety
/// The caller writes only initialized bytes through the result (those three functions do).
pub unsafe fn as_uninit(buf: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` is laid out as `u8`; the caller keeps every byte initialized.
    unsafe { &mut *(buf as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

/// # Safety
/// Every byte of `buf` has been written.
unsafe fn assume_init(buf: &mut [MaybeUninit<u8>]) -> &mut [u8] {
    // SAFETY: the caller promises every byte is initialized; `MaybeUninit<u8>` is laid out as `u8`.
    unsafe { &mut *(buf as *mut [MaybeUninit<u8>] as *mut [u8]) }
}

/// Deallocate `length` bytes at `offset` (they read back as zeroes) without changing the file
/// size. On a file system without hole punching this does nothing: the block map already says
/// the range is a hole and reads never look at it, so only the space is not reclaimed.
pub fn punch_hole(file: &File, offset: u64, length: u64) -> io::Result<()> {
    static UNSUPPORTED_REPORTED: AtomicBool = AtomicBool::new(false);
    if length == 0 {
        return Ok(());
    }
    let offset = libc::off_t::try_from(offset).expect("file offsets stay below 2^63");
    let length = libc::off_t::try_from(length).expect("lengths stay below 2^63");
    loop {
        // SAFETY: plain system call on an owned descriptor.
        let result = unsafe {
            libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, length)
        };
        if result == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) => {
                if !UNSUPPORTED_REPORTED.swap(true, Ordering::Relaxed) {
                    tracing::warn!("file system cannot punch holes: trimmed space is not reclaimed");
                }
                return Ok(());
            }
            _ => return Err(error),
        }
    }
}

/// Take an exclusive advisory lock on `file` without waiting. `Ok(false)`: someone holds it.
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    // SAFETY: plain system call on an owned descriptor.
    let result = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if result == 0 {
        return Ok(true);
    }
    let error = io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(false);
    }
    Err(error)
}

/// Make the creations, renames and deletions of entries of `dir` durable.
/// Bytes of the file system holding `dir` that an unprivileged writer can still allocate.
pub fn available_bytes(dir: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: `path` is a valid C string and `stat` a plain out-parameter of the right type.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// Bytes the files under `dir` occupy on disk (allocated blocks, not apparent sizes).
pub fn allocated_bytes_under(dir: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        // A file the store's threads renamed or deleted since the listing (a log segment)
        // takes no space here any more.
        let meta = match entry.metadata() {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            meta => meta?,
        };
        total += match meta.is_dir() {
            true => allocated_bytes_under(&entry.path())?,
            false => meta.blocks() * 512,
        };
    }
    Ok(total)
}

/// The machine's memory (0 if it cannot be told).
pub fn physical_memory_bytes() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages <= 0 || page <= 0 {
        return 0;
    }
    pages as u64 * page as u64
}

pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The block device (as `/sys` names it) if `dir` lies on an ext4 file system mounted without
/// a journal: Linux shows `<none>` in `/sys/fs/ext4/DEVICE/journal_task` then. `None` for a
/// journal, any other file system, or when it cannot be told.
pub fn ext4_without_journal(dir: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let device = std::fs::metadata(dir).ok()?.dev();
    let (major, minor) = (libc::major(device), libc::minor(device));
    let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    let name = link.file_name()?.to_str()?.to_string();
    let task = std::fs::read_to_string(format!("/sys/fs/ext4/{name}/journal_task")).ok()?;
    (task.trim() == "<none>").then_some(name)
}

/// The first offset at or after `offset` where `file` holds data (`lseek(SEEK_DATA)`), or
/// `None` if only a hole follows. File systems without hole tracking report all data.
pub fn next_data(file: &File, offset: u64) -> io::Result<Option<u64>> {
    let offset = libc::off_t::try_from(offset).expect("file offsets stay below 2^63");
    // SAFETY: plain system call on an owned descriptor.
    let result = unsafe { libc::lseek(file.as_raw_fd(), offset, libc::SEEK_DATA) };
    if result >= 0 {
        return Ok(Some(result as u64));
    }
    let error = io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::ENXIO) {
        return Ok(None);
    }
    Err(error)
}

/// The first hole at or after `offset` (`lseek(SEEK_HOLE)`; the end of the file counts).
pub fn next_hole(file: &File, offset: u64) -> io::Result<u64> {
    let offset = libc::off_t::try_from(offset).expect("file offsets stay below 2^63");
    // SAFETY: plain system call on an owned descriptor.
    let result = unsafe { libc::lseek(file.as_raw_fd(), offset, libc::SEEK_HOLE) };
    if result >= 0 {
        return Ok(result as u64);
    }
    Err(io::Error::last_os_error())
}

/// Start writing back the dirty pages of a range without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so a later `fdatasync` has less to do.
pub fn start_writeback(file: &File, offset: u64, length: u64) -> io::Result<()> {
    sync_file_range(file, offset, length, libc::SYNC_FILE_RANGE_WRITE)
}

/// Write back the dirty pages of `file` over `offset..offset + length` and wait for them
/// (`sync_file_range` with `WAIT_BEFORE | WRITE | WAIT_AFTER`; the file's metadata and the
/// device cache are left to a later `fdatasync`). An error it returns is not returned again
/// by a later `fdatasync` of the same open file: treat it as that `fdatasync`'s.
pub fn write_back(file: &File, offset: u64, length: u64) -> io::Result<()> {
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    sync_file_range(file, offset, length, flags)
}

/// Make `offset..offset + length` of `file` durable as `fdatasync` would (its data, and the
/// metadata needed to read it back, such as the blocks a write into a hole allocated), without
/// writing back the rest of the file's dirty pages, which `fdatasync` would wait for too.
///
/// Linux has no ranged `fdatasync` call, but `msync(MS_SYNC)` of a shared mapping is one: it
/// calls the file system's `fsync` over the mapped range of the file with `datasync` set
/// (`vfs_fsync_range`), and the page cache it syncs is the one `pwrite` filled. So the range is
/// mapped only for that, and never touched. (POSIX promises `msync` only for changes made
/// through the mapping; that it syncs writes made with `pwrite` too is Linux's behaviour, which
/// this relies on, as it relies on Linux elsewhere.) The file must be open for reading and
/// writing (a shared mapping of a file open for reading only is not shared for `msync`, which
/// would then sync nothing): otherwise an error. An error it returns is not returned again by a
/// later `fdatasync` of the same open file.
pub fn sync_data_range(file: &File, offset: u64, length: u64) -> io::Result<()> {
    // SAFETY: plain system call on an owned descriptor.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_ACCMODE != libc::O_RDWR {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a ranged sync needs a file open for reading and writing",
        ));
    }
    if length == 0 {
        return Ok(());
    }
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
    let start = offset - offset % page;
    let mapped = offset
        .checked_add(length)
        .and_then(|end| usize::try_from(end - start).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "range too large to map"))?;
    let start_os = libc::off_t::try_from(start).expect("file offsets stay below 2^63");
    // SAFETY: a new shared read-only mapping of an open file; nothing reads or writes through
    // it, and it is unmapped below whatever msync returns.
    let address = unsafe {
        libc::mmap(std::ptr::null_mut(), mapped, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), start_os)
    };
    if address == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `address..address + mapped` is the mapping made above.
    let synced = unsafe { libc::msync(address, mapped, libc::MS_SYNC) };
    let error = (synced != 0).then(io::Error::last_os_error);
    // SAFETY: the same mapping, unmapped once.
    unsafe { libc::munmap(address, mapped) };
    error.map_or(Ok(()), Err)
}

fn sync_file_range(file: &File, offset: u64, length: u64, flags: libc::c_uint) -> io::Result<()> {
    let offset = libc::off64_t::try_from(offset).expect("file offsets stay below 2^63");
    let length = libc::off64_t::try_from(length).expect("lengths stay below 2^63");
    // SAFETY: plain system call on an owned descriptor.
    let result = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, length, flags) };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Writes to a file on a file system in memory (tmpfs, ramfs) through a shared mapping of it:
/// its pages are the file's page cache, so a copy into them is the write, without a system call
/// per write nor the page cache's lookup and locking of every page, which cost an element more
/// than the copy itself at 1 MiB writes (docs/benchmarks.md, 2026-12-02). Writes past the
/// mapped size, and every write where mapping is off or unsupported, are `pwritev`s.
pub struct MappedWrites {
    state: MappedState,
}

enum MappedState {
    /// Never mapped: a file on a disk (writes must go through the page cache's writeback
    /// accounting, and a store into a page whose block the disk cannot allocate is a `SIGBUS`),
    /// or mapping failed once.
    Off,
    Unmapped,
    Mapped(Mapping),
}

impl MappedWrites {
    /// Writes through a mapping if `on` (the file is on a file system in memory).
    pub fn new(on: bool) -> MappedWrites {
        MappedWrites { state: if on { MappedState::Unmapped } else { MappedState::Off } }
    }

    /// Write `bufs`, back to back, at `offset` of `file`, whose size is `file_bytes`. The caller
    /// serializes these writes with whatever punches or truncates the file.
    pub fn write(&mut self, file: &File, file_bytes: u64, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let total: u64 = bufs.iter().map(|buf| buf.len() as u64).sum();
        if total > 0 && offset.checked_add(total).is_some_and(|end| end <= file_bytes) {
            if let Some(mapping) = self.mapping(file, file_bytes) {
                match mapping.write_vectored_at(bufs, offset) {
                    Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                        tracing::info!(error = %e, "writes to files in memory go through write(2)");
                        self.state = MappedState::Off;
                    }
                    result => return result,
                }
            }
        }
        write_all_vectored_at(file, bufs, offset)
    }

    /// Let go of the mapping (before the file is emptied or dropped); the next write maps again.
    pub fn unmap(&mut self) {
        if matches!(self.state, MappedState::Mapped(_)) {
            self.state = MappedState::Unmapped;
        }
    }

    /// `length` bytes at `offset` of the file are about to be punched (made a hole): their
    /// pages are no longer known to be present, so the next write there makes them present
    /// again (and fails for space if the file system has no room for them).
    pub fn punched(&mut self, offset: u64, length: u64) {
        if let MappedState::Mapped(mapping) = &mut self.state {
            mapping.populated.clear(offset, length);
        }
    }

    /// How many times a write made pages present (`MADV_POPULATE_WRITE`), for tests.
    #[cfg(test)]
    pub fn populate_calls(&self) -> u64 {
        match &self.state {
            MappedState::Mapped(mapping) => mapping.populate_calls,
            MappedState::Off | MappedState::Unmapped => 0,
        }
    }

    /// Whether writes go through a mapping (now or once one is made).
    pub fn is_on(&self) -> bool {
        !matches!(self.state, MappedState::Off)
    }

    /// The mapping of all `file_bytes` bytes of `file`, made (again) if the file's size changed.
    fn mapping(&mut self, file: &File, file_bytes: u64) -> Option<&mut Mapping> {
        match &self.state {
            MappedState::Off => return None,
            MappedState::Mapped(mapping) if mapping.len() == file_bytes => {}
            MappedState::Mapped(_) | MappedState::Unmapped => {
                // The old mapping goes first: two of a large file need not fit at once.
                self.state = MappedState::Unmapped;
                match Mapping::new(file, file_bytes) {
                    Ok(mapping) => self.state = MappedState::Mapped(mapping),
                    Err(e) => {
                        tracing::warn!(error = %e, bytes = file_bytes, "cannot map a file in memory; writing it with write(2)");
                        self.state = MappedState::Off;
                        return None;
                    }
                }
            }
        }
        match &mut self.state {
            MappedState::Mapped(mapping) => Some(mapping),
            MappedState::Off | MappedState::Unmapped => unreachable!("mapped just above"),
        }
    }
}

/// A shared, writable mapping of the first bytes of a file (see [`MappedWrites`]).
struct Mapping {
    base: *mut u8,
    len: usize,
    /// The 4 KiB pieces of the mapping that a write made present: a page of a file in memory
    /// stays allocated to the file until it is punched or the file shrinks (swapped out, it is
    /// still the file's), so writes there need no `MADV_POPULATE_WRITE` again (at 4 KiB
    /// writes that call was about an eighth of an element's CPU, docs/benchmarks.md). Pieces
    /// are 4 KiB whatever the page size: a page that a populated range overlaps is whole
    /// present, and holds every aligned piece that overlaps the range too.
    populated: PieceSet,
    #[cfg(test)]
    populate_calls: u64,
}

/// A set of 4 KiB pieces of a mapping, one bit each.
struct PieceSet {
    words: Vec<u64>,
}

impl PieceSet {
    const PIECE_BYTES: u64 = 4096;

    fn new(len: u64) -> PieceSet {
        PieceSet { words: vec![0; len.div_ceil(Self::PIECE_BYTES).div_ceil(64) as usize] }
    }

    /// The pieces that `length` bytes at `offset` overlap, as a range of piece numbers.
    fn pieces(offset: u64, length: u64) -> Range<u64> {
        offset / Self::PIECE_BYTES..(offset + length).div_ceil(Self::PIECE_BYTES)
    }

    fn contains_all(&self, offset: u64, length: u64) -> bool {
        crate::word_masks(Self::pieces(offset, length)).all(|(word, mask)| self.words[word] & mask == mask)
    }

    fn insert(&mut self, offset: u64, length: u64) {
        crate::word_masks(Self::pieces(offset, length)).for_each(|(word, mask)| self.words[word] |= mask);
    }

    /// Forget the pieces that `length` bytes at `offset` overlap, within the mapping.
    fn clear(&mut self, offset: u64, length: u64) {
        let limit = self.words.len() as u64 * 64 * Self::PIECE_BYTES;
        let (offset, end) = (offset.min(limit), offset.saturating_add(length).min(limit));
        crate::word_masks(Self::pieces(offset, end - offset)).for_each(|(word, mask)| self.words[word] &= !mask);
    }
}

// SAFETY: the mapping is plain memory shared with the file; its one owner (a `MappedWrites`,
// behind the store's locks) writes through it and unmaps it only on drop.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map the first `len` bytes of `file` (`len` > 0, at most the file's size).
    fn new(file: &File, len: u64) -> io::Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "mapping too large"))?;
        assert!(len > 0, "a mapping of no bytes");
        // SAFETY: a fresh shared mapping of a file held open, checked for failure; nothing
        // else is mapped at the address the kernel picks.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            base: base as *mut u8,
            len,
            populated: PieceSet::new(len as u64),
            #[cfg(test)]
            populate_calls: 0,
        })
    }

    fn len(&self) -> u64 {
        self.len as u64
    }

    /// Copy `bufs`, back to back, to `offset` (the range within the mapping). The pages are
    /// first made present (`MADV_POPULATE_WRITE`): a page the file system cannot allocate (it
    /// is full) is then an error (`ENOSPC`), where a plain store into it would kill the process
    /// with `SIGBUS`. `Unsupported`: the kernel has no such advice (before Linux 5.14).
    fn write_vectored_at(&mut self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let total: u64 = bufs.iter().map(|buf| buf.len() as u64).sum();
        let end = offset.checked_add(total).expect("offsets stay below 2^63");
        assert!(end <= self.len as u64, "a write within the mapping");
        if total == 0 {
            return Ok(());
        }
        const PAGE_BYTES: u64 = 4096;
        let first_page = offset / PAGE_BYTES * PAGE_BYTES;
        let populate_bytes = (end.div_ceil(PAGE_BYTES) * PAGE_BYTES).min(self.len as u64) - first_page;
        while !self.populated.contains_all(offset, total) {
            // SAFETY: the range lies within the mapping (asserted above); advice only.
            let result = unsafe {
                libc::madvise(
                    self.base.add(first_page as usize) as *mut libc::c_void,
                    populate_bytes as usize,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if result == 0 {
                self.populated.insert(offset, total);
                #[cfg(test)]
                {
                    self.populate_calls += 1;
                }
                break;
            }
            let error = io::Error::last_os_error();
            return Err(match error.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                // A store would have raised SIGBUS: on a file in memory, no room for the page.
                Some(libc::EFAULT) => io::Error::from_raw_os_error(libc::ENOSPC),
                Some(libc::EINVAL) => io::Error::new(io::ErrorKind::Unsupported, "no MADV_POPULATE_WRITE"),
                _ => error,
            });
        }
        let mut at = offset as usize;
        for buf in bufs {
            // SAFETY: [at, at + len) lies within the mapping and its pages are present; `buf`
            // is memory of the caller's, not of this mapping.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), self.base.add(at), buf.len()) };
            at += buf.len();
        }
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use std::{io::Write, mem::MaybeUninit};

    use super::{for_each_window, read_exact_at_cached, read_exact_at_uninit, zero_uninit};

    /// Reads into buffers that hold garbage give exactly the file's bytes, in memory or not;
    /// a read past the end is an error; zeroing writes every byte.
    #[test]
    fn reads_into_unzeroed_buffers_give_the_files_bytes_and_nothing_else() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        let mut file = tempfile_in(std::env::temp_dir());
        file.write_all(&data).unwrap();
        let garbage = |n: usize| vec![MaybeUninit::new(0xa5u8); n];
        for (offset, len) in [(0u64, 200_000usize), (4096, 65_536), (199_999, 1), (7, 0)] {
            let mut buf = garbage(len);
            let read = read_exact_at_uninit(&file, &mut buf, offset).expect("read");
            assert_eq!(read, &data[offset as usize..offset as usize + len]);
            let mut buf = garbage(len);
            // The page cache holds what was just written; a file system may not tell.
            if let Ok(Some(read)) = read_exact_at_cached(&file, &mut buf, offset) {
                assert_eq!(read, &data[offset as usize..offset as usize + len]);
            }
        }
        let mut buf = garbage(10);
        let error = read_exact_at_uninit(&file, &mut buf, 199_995).expect_err("past the end");
        assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(zero_uninit(&mut garbage(5000)), &[0u8; 5000][..]);
    }

    /// Pages of `file` over `offset..offset + length` that are dirty or under writeback, by
    /// `cachestat` (Linux 6.5; the same number, 451, on every architecture). `None` if the
    /// kernel has no such call or a sandbox refuses it.
    fn unwritten_pages(file: &std::fs::File, offset: u64, length: u64) -> Option<u64> {
        use std::os::fd::AsRawFd;
        const SYS_CACHESTAT: libc::c_long = 451;
        let range = [offset, length];
        // nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted.
        let mut stat = [0u64; 5];
        // SAFETY: both structures are as the kernel defines them and outlive the call.
        let result = unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), range.as_ptr(), stat.as_mut_ptr(), 0) };
        if result != 0 {
            let error = std::io::Error::last_os_error();
            assert!(matches!(error.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)), "cachestat: {error}");
            return None;
        }
        Some(stat[1] + stat[2])
    }

    /// The ranged sync writes back the pages of its range (from the page holding its first
    /// byte) and leaves the rest of the file's dirty pages alone, as a placed write needs.
    #[test]
    fn a_ranged_sync_writes_back_its_range_and_no_other() {
        let dir = std::env::temp_dir();
        if super::non_blocking_reads(&dir).expect("statfs") == super::NonBlockingReads::Always {
            eprintln!("{} is in memory, where nothing is written back: not tested here", dir.display());
            return;
        }
        let file = tempfile_in(dir);
        let data = vec![0x5au8; 1 << 20];
        super::write_all_vectored_at(&file, &[&data], 0).expect("write");
        super::write_all_vectored_at(&file, &[&data], 2 << 20).expect("write");
        super::sync_data_range(&file, 100, (1 << 20) - 100).expect("ranged sync");
        super::sync_data_range(&file, 12_345, 0).expect("an empty range");
        let Some(first) = unwritten_pages(&file, 0, 1 << 20) else {
            eprintln!("no cachestat here (an older kernel, or a sandbox): not tested");
            return;
        };
        assert_eq!(first, 0, "pages of the synced range still dirty");
        let second = unwritten_pages(&file, 2 << 20, 1 << 20).expect("cachestat");
        assert!(second > 0, "the range not synced was written back too");
    }

    #[test]
    fn a_ranged_sync_refuses_a_file_not_open_for_reading_and_writing() {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("starfish-sys-test-ro-{}", std::process::id()));
        std::fs::write(&path, vec![1u8; 8192]).expect("write");
        let read_only = std::fs::File::open(&path).expect("open");
        let write_only = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
        std::fs::remove_file(&path).expect("unlink");
        for file in [&read_only, &write_only] {
            let error = super::sync_data_range(file, 0, 4096).expect_err("not open for both");
            assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput, "{error}");
        }
    }

    /// A file in memory (`/dev/shm`), if this system has one.
    fn memory_file() -> Option<std::fs::File> {
        let dir = std::path::PathBuf::from("/dev/shm");
        if !dir.is_dir() || super::non_blocking_reads(&dir).ok() != Some(super::NonBlockingReads::Always) {
            eprintln!("no tmpfs at /dev/shm: not tested here");
            return None;
        }
        Some(tempfile_in(dir))
    }

    /// Writes through a mapping land in the file (its reads and its size agree), writes past
    /// its size go through `pwritev` and grow it, and a size change maps it again.
    #[test]
    fn mapped_writes_are_the_files_bytes_and_writes_past_its_end_grow_it() {
        use std::os::unix::fs::FileExt;
        let Some(file) = memory_file() else { return };
        file.set_len(1 << 20).expect("size");
        let mut writes = super::MappedWrites::new(true);
        let a = vec![0x11u8; 5000];
        let b: Vec<u8> = (0..70_000u32).map(|i| (i % 249) as u8).collect();
        writes.write(&file, 1 << 20, &[&a, &b], 4000).expect("mapped write");
        assert!(matches!(writes.state, super::MappedState::Mapped(_)), "a write within the file is mapped");
        let mut back = vec![0u8; 75_000];
        file.read_exact_at(&mut back, 4000).expect("read");
        assert_eq!(&back[..5000], &a[..]);
        assert_eq!(&back[5000..], &b[..]);
        // The last bytes of the file, then past its end.
        writes.write(&file, 1 << 20, &[&a[..10]], (1 << 20) - 10).expect("to the end");
        writes.write(&file, 1 << 20, &[&a[..10]], 1 << 20).expect("past the end");
        assert_eq!(file.metadata().expect("stat").len(), (1 << 20) + 10, "a write past the end grows the file");
        let mut tail = vec![0u8; 20];
        file.read_exact_at(&mut tail, (1 << 20) - 10).expect("read");
        assert_eq!(tail, vec![0x11u8; 20]);
        // The file grew: the next write maps all of it.
        writes.write(&file, (1 << 20) + 10, &[&b[..3]], (1 << 20) + 7).expect("mapped again");
        match &writes.state {
            super::MappedState::Mapped(mapping) => assert_eq!(mapping.len(), (1 << 20) + 10),
            _ => panic!("not mapped"),
        }
        file.read_exact_at(&mut tail[..3], (1 << 20) + 7).expect("read");
        assert_eq!(&tail[..3], &b[..3]);
        // Off (a file on a disk): never mapped.
        let mut off = super::MappedWrites::new(false);
        off.write(&file, (1 << 20) + 10, &[&a[..1]], 0).expect("write");
        assert!(!off.is_on());
        assert!(matches!(off.state, super::MappedState::Off));
    }

    /// A page the file system cannot give a mapped write is an error, not a `SIGBUS` that kills
    /// the process: here the file shrank behind the mapping's back (a full tmpfs fails the
    /// same way, with real processes in `tests/test_environment.py`).
    #[test]
    fn a_mapped_write_to_a_page_the_file_cannot_have_is_an_error_not_a_crash() {
        let Some(file) = memory_file() else { return };
        file.set_len(1 << 20).expect("size");
        let mut writes = super::MappedWrites::new(true);
        writes.write(&file, 1 << 20, &[&[1u8; 4096]], 0).expect("mapped write");
        file.set_len(8192).expect("shrink");
        let error = writes.write(&file, 1 << 20, &[&[2u8; 4096]], 65_536).expect_err("no page there");
        assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
        // Within what is left of the file, and once the mapping follows the size, it works.
        writes.write(&file, 1 << 20, &[&[3u8; 4096]], 4096).expect("within the file");
        writes.unmap();
        writes.write(&file, 8192, &[&[4u8; 100]], 0).expect("mapped again");
        assert!(matches!(writes.state, super::MappedState::Mapped(_)));
    }

    /// The set of populated pieces against a plain model: every range, across word boundaries,
    /// to the last piece; a clear past the end is cut to the mapping.
    #[test]
    fn piece_sets_hold_exactly_the_pieces_their_ranges_overlap() {
        const PIECE: u64 = super::PieceSet::PIECE_BYTES;
        let len = 200 * PIECE - 100; // the last piece is partial
        let pieces = len.div_ceil(PIECE) as usize;
        let mut set = super::PieceSet::new(len);
        let mut model = vec![false; pieces];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound
        };
        for round in 0..4000 {
            let offset = next(len);
            let length = 1 + next((len - offset).min(if round % 3 == 0 { 70 * PIECE } else { 3 * PIECE }));
            let covered = (offset / PIECE) as usize..(offset + length).div_ceil(PIECE) as usize;
            let expected = model[covered.clone()].iter().all(|&p| p);
            assert_eq!(set.contains_all(offset, length), expected, "round {round}: {length} at {offset}");
            match next(3) {
                0 => {
                    set.insert(offset, length);
                    model[covered].fill(true);
                }
                1 => {
                    set.clear(offset, length);
                    model[covered].fill(false);
                }
                _ => {}
            }
        }
        set.insert(0, len);
        assert!(set.contains_all(0, len) && set.contains_all(len - 1, 1));
        set.clear(len - 1, 1 << 40);
        assert!(set.contains_all(0, len - PIECE) && !set.contains_all(len - 1, 1));
        set.clear(u64::MAX - 5, 5);
        assert!(set.contains_all(0, len - PIECE));
    }

    /// A mapped write makes its pages present once; a write over them again does not ask
    /// again, and a punched range is made present again.
    #[test]
    fn mapped_writes_make_pages_present_once_until_they_are_punched() {
        let Some(file) = memory_file() else { return };
        file.set_len(1 << 20).expect("size");
        let mut writes = super::MappedWrites::new(true);
        let block = [7u8; 4096];
        writes.write(&file, 1 << 20, &[&block], 8192).expect("write");
        assert_eq!(writes.populate_calls(), 1);
        writes.write(&file, 1 << 20, &[&block[..100]], 8192 + 50).expect("write");
        writes.write(&file, 1 << 20, &[&block], 8192).expect("write");
        assert_eq!(writes.populate_calls(), 1, "the page is present");
        writes.write(&file, 1 << 20, &[&block, &block], 4096).expect("write");
        assert_eq!(writes.populate_calls(), 2, "one more page, one more call");
        writes.punched(8192, 4096);
        super::punch_hole(&file, 8192, 4096).expect("punch");
        writes.write(&file, 1 << 20, &[&block[..10]], 8192).expect("write");
        assert_eq!(writes.populate_calls(), 3, "a punched page is made present again");
        let mut back = [0u8; 4096];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut back, 8192).expect("read");
        assert_eq!(&back[..10], &block[..10]);
        assert!(back[10..].iter().all(|&b| b == 0), "the rest of the punched page reads as zeroes");
    }

    fn tempfile_in(dir: std::path::PathBuf) -> std::fs::File {
        let path = dir.join(format!("starfish-sys-test-{}-{:?}", std::process::id(), std::thread::current().id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).expect("create");
        std::fs::remove_file(&path).expect("unlink");
        file
    }

    #[test]
    fn windowed_writes_never_cross_a_window_and_keep_every_byte_in_place() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        // Buffers of awkward sizes, starting at aligned and unaligned offsets.
        for (offset, sizes) in [
            (0u64, vec![65_536usize]),
            (4096, vec![4096; 40]),
            (65_536 - 4096, vec![8192, 100_000, 1, 4095]),
            (1_000_000, vec![200_000]),
            (7, vec![3, 65_536, 65_529]),
            (8192, vec![4096, 0, 4096]),
            (65_536 - 4096, vec![4096]),
            (100, vec![]),
        ] {
            let mut bufs = Vec::new();
            let mut used = 0;
            for size in &sizes {
                bufs.push(&data[used..used + size]);
                used += size;
            }
            let mut next = offset;
            let mut seen = Vec::new();
            for_each_window(&bufs, offset, 65_536, |pieces, at| {
                let bytes: u64 = pieces.iter().map(|p| p.len() as u64).sum();
                assert_eq!(at, next, "windows follow each other");
                assert!(bytes > 0, "no empty write");
                assert_eq!(at / 65_536, (at + bytes - 1) / 65_536, "a write within one window");
                pieces.iter().for_each(|p| seen.extend_from_slice(p));
                next = at + bytes;
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, data[..used], "every byte, in order");
            assert_eq!(next, offset + used as u64);

            // An unbounded window (a store in memory): one write of everything, or none.
            let mut calls = 0;
            for_each_window(&bufs, offset, 1 << 63, |pieces, at| {
                assert_eq!((at, pieces.concat()), (offset, data[..used].to_vec()));
                calls += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(calls, usize::from(used > 0));
        }
    }
}
