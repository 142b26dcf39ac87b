"""A file system that keeps, when the power goes, no more than POSIX promises: a file's data
(and size) as of its last `fsync` or `fdatasync`, and a directory's entries as of its last
`fsync`. Nothing else: not a rename, a new file's name or an unlink that its directory was not
synced after, not a byte written after the file's last sync. Real file systems keep more (ext4,
XFS and btrfs commit renames and new names in order with other metadata, and write dirty pages
back on their own), which is why a missing sync can pass a power cut on them for years.

It is a FUSE file system (pyfuse3) over a directory on the machine's own file system:

    forgetful_fs.py serve WORK MOUNTPOINT [--early FRACTION --seed SEED]
    forgetful_fs.py materialize WORK OUT

`serve` mounts it at MOUNTPOINT (in the foreground; SIGTERM unmounts). Every operation goes
through to WORK/live at once, so reads see every write, as a page cache does. Alongside, it
keeps what the power would leave: WORK/state/data/INODE holds a file's synced contents (its
unsynced pages are only remembered, in memory), and WORK/state/dirs.json every directory's
entries as its last sync left them (replaced whole, atomically, at each directory sync).

The power cut is SIGKILL of `serve`: what it only remembered is gone, as a disk cache's
contents are, and the mount is dead (`fusermount3 -u -z` clears it). `materialize` then builds,
in the empty directory OUT, the tree the power left: the synced directories, and in them the
files with their synced contents (a name synced before its file's data holds an empty file, as
a file system that allocates on write-back leaves it).

`--early FRACTION` (with `--seed`): like a disk that writes back on its own, each written page
is also kept at once with that probability, and each changed directory is kept whole at once
(as its sync would) with it. Without it, nothing unsynced is kept. Hard links, symbolic links,
device nodes, extended attributes and `fallocate` are refused."""

import argparse
import errno
import functools
import json
import os
import random
import shutil
import signal
import stat
import sys

import pyfuse3
import trio

PAGE = 4096
ROOT = 1


def page_runs(pages):
    """Sorted page numbers as runs `(first, last + 1)`."""
    runs = []
    for page in sorted(pages):
        if runs and runs[-1][1] == page:
            runs[-1][1] = page + 1
        else:
            runs.append([page, page + 1])
    return runs


class Forgetful(pyfuse3.Operations):
    """The operations: every public method is a pyfuse3 handler (its `OSError`s and lookups of
    a gone inode answered as errors, below the class)."""

    def __init__(self, work, early=0.0, seed=0):
        self.live = os.path.join(work, "live")
        self.orphans = os.path.join(work, "orphans")
        self.state = os.path.join(work, "state")
        self.data = os.path.join(self.state, "data")
        for path in (self.live, self.orphans, self.data):
            os.makedirs(path, exist_ok=True)
        if os.listdir(self.live):
            raise SystemExit(f"forgetful_fs: {self.live} is not empty (each mount starts empty)")
        self.early = early
        self.random = random.Random(seed)
        # Our inode numbers, never reused: the durable directories may name an inode whose
        # live file is long gone.
        self.path = {ROOT: self.live}
        self.inode = {self.live: ROOT}
        self.next_inode = ROOT + 1
        self.parent = {ROOT: ROOT}
        # Unsynced written pages, and the smallest size since the last sync, per inode.
        self.dirty = {}
        self.floor = {}
        self.open_count = {}
        # Open files and directories: handle -> (descriptor, inode) or (inode, names).
        self.files = {}
        self.dirs = {}
        self.next_dir_handle = 1
        # What the power would leave of the directories: inode -> name -> [inode, is_dir, mode].
        self.durable_dirs = {ROOT: {}}
        self._save_dirs()

    # --- the durable state -------------------------------------------------------------

    def _save_dirs(self):
        temp = os.path.join(self.state, "dirs.json.tmp")
        with open(temp, "w") as f:
            json.dump({str(k): v for k, v in self.durable_dirs.items()}, f)
        # Atomic on the machine's own file system; a SIGKILL of this process leaves it whole.
        os.replace(temp, os.path.join(self.state, "dirs.json"))

    def _keep_dir(self, inode):
        """Make directory `inode`'s live entries what the power leaves of it."""
        entries = {}
        path = self.path[inode]
        for name in os.listdir(path):
            child = self.inode[os.path.join(path, name)]
            st = os.lstat(os.path.join(path, name))
            entries[name] = [child, stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode)]
        self.durable_dirs[inode] = entries
        self._collect()
        self._save_dirs()

    def _collect(self):
        """Forget the kept data of files no durable directory and no live name reaches."""
        reached = {ROOT}
        stack = [ROOT]
        while stack:
            for child, is_dir, _ in self.durable_dirs.get(stack.pop(), {}).values():
                if child not in reached:
                    reached.add(child)
                    if is_dir:
                        stack.append(child)
        for name in os.listdir(self.data):
            inode = int(name)
            if inode not in reached and inode not in self.path:
                os.unlink(os.path.join(self.data, name))
        for inode in list(self.durable_dirs):
            if inode not in reached and inode not in self.path:
                del self.durable_dirs[inode]

    def _kept_file(self, inode):
        return os.open(os.path.join(self.data, str(inode)), os.O_RDWR | os.O_CREAT, 0o600)

    def _keep_pages(self, inode, fd, pages, size=None):
        """Copy `pages` of the live file (open as `fd`) to what the power leaves; with `size`,
        also make the kept file that long first (a sync), after any truncation since."""
        kept = self._kept_file(inode)
        try:
            if size is not None:
                floor = self.floor.pop(inode, None)
                if floor is not None:
                    os.ftruncate(kept, min(floor, os.fstat(kept).st_size))
                os.ftruncate(kept, size)
            live_size = os.fstat(fd).st_size
            for first, end in page_runs(pages):
                start, stop = first * PAGE, min(end * PAGE, live_size)
                while start < stop:
                    chunk = os.pread(fd, min(stop - start, 1 << 20), start)
                    if not chunk:
                        break
                    os.pwrite(kept, chunk, start)
                    start += len(chunk)
        finally:
            os.close(kept)

    def _sync_file(self, inode, fd):
        pages = self.dirty.pop(inode, set())
        self._keep_pages(inode, fd, pages, size=os.fstat(fd).st_size)

    def _changed_dir(self, *inodes):
        if self.early and self.random.random() < self.early:
            for inode in set(inodes):
                self._keep_dir(inode)

    # --- the live tree -----------------------------------------------------------------

    def _attr(self, inode):
        st = os.lstat(self.path[inode])
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.generation = 0
        attr.entry_timeout = 0
        attr.attr_timeout = 0
        attr.st_mode = st.st_mode
        attr.st_nlink = st.st_nlink
        attr.st_uid = st.st_uid
        attr.st_gid = st.st_gid
        attr.st_rdev = st.st_rdev
        attr.st_size = st.st_size
        attr.st_blksize = st.st_blksize
        attr.st_blocks = st.st_blocks
        attr.st_atime_ns = st.st_atime_ns
        attr.st_mtime_ns = st.st_mtime_ns
        attr.st_ctime_ns = st.st_ctime_ns
        return attr

    def _child(self, parent, name):
        name = os.fsdecode(name)
        if name == ".":
            return self.path[parent], parent
        if name == "..":
            up = self.parent[parent]
            return self.path[up], up
        path = os.path.join(self.path[parent], name)
        return path, self.inode.get(path)

    def _new(self, parent, path):
        inode = self.next_inode
        self.next_inode += 1
        self.path[inode] = path
        self.inode[path] = inode
        self.parent[inode] = parent
        return inode

    def _drop_name(self, path):
        """`path` (a file or empty directory) leaves the live tree: its inode lives on, in the
        orphans while a descriptor holds it open."""
        inode = self.inode.pop(path)
        if self.open_count.get(inode):
            orphan = os.path.join(self.orphans, str(inode))
            os.rename(path, orphan)
            self.path[inode] = orphan
        else:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
            del self.path[inode]
            self.dirty.pop(inode, None)
            self.floor.pop(inode, None)

    async def lookup(self, parent_inode, name, ctx):
        path, inode = self._child(parent_inode, name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def getattr(self, inode, ctx):
        return self._attr(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self.path[inode]
        if fields.update_size:
            if fh is not None and fh in self.files:
                os.ftruncate(self.files[fh][0], attr.st_size)
            else:
                os.truncate(path, attr.st_size)
            self.floor[inode] = min(self.floor.get(inode, attr.st_size), attr.st_size)
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode))
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(path)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(path, ns=(atime, mtime))
        if fields.update_uid or fields.update_gid:
            os.chown(path, attr.st_uid if fields.update_uid else -1, attr.st_gid if fields.update_gid else -1)
        return self._attr(inode)

    async def statfs(self, ctx):
        st = os.statvfs(self.live)
        reply = pyfuse3.StatvfsData()
        for field in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                      "f_favail", "f_namemax"):
            setattr(reply, field, getattr(st, field))
        return reply

    async def mkdir(self, parent_inode, name, mode, ctx):
        path, existing = self._child(parent_inode, name)
        if existing is not None:
            raise pyfuse3.FUSEError(errno.EEXIST)
        os.mkdir(path, mode)
        inode = self._new(parent_inode, path)
        self._changed_dir(parent_inode)
        return self._attr(inode)

    async def rmdir(self, parent_inode, name, ctx):
        path, inode = self._child(parent_inode, name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if os.listdir(path):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self._drop_name(path)
        self._changed_dir(parent_inode)

    async def unlink(self, parent_inode, name, ctx):
        path, inode = self._child(parent_inode, name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if os.path.isdir(path):
            raise pyfuse3.FUSEError(errno.EISDIR)
        self._drop_name(path)
        self._changed_dir(parent_inode)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old, inode = self._child(parent_inode_old, name_old)
        new, replaced = self._child(parent_inode_new, name_new)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if replaced is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise pyfuse3.FUSEError(errno.EEXIST)
            if replaced == inode:
                return
            old_is_dir, new_is_dir = os.path.isdir(old), os.path.isdir(new)
            if new_is_dir and not old_is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if old_is_dir and not new_is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if new_is_dir and os.listdir(new):
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            self._drop_name(new)
        os.rename(old, new)
        # The inode and, for a directory, everything under it take their new paths.
        moved = {}
        for path, number in self.inode.items():
            if path == old or path.startswith(old + os.sep):
                moved[path] = number
        for path, number in moved.items():
            del self.inode[path]
        for path, number in moved.items():
            renamed = new + path[len(old):]
            self.inode[renamed] = number
            self.path[number] = renamed
        self.parent[inode] = parent_inode_new
        self._changed_dir(parent_inode_old, parent_inode_new)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def symlink(self, parent_inode, name, target, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def create(self, parent_inode, name, mode, flags, ctx):
        path, existing = self._child(parent_inode, name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise pyfuse3.FUSEError(errno.EEXIST)
            info = await self.open(existing, flags & ~os.O_CREAT, ctx)
            return info, self._attr(existing)
        fd = os.open(path, _own_flags(flags) | os.O_CREAT | os.O_EXCL, mode)
        inode = self._new(parent_inode, path)
        self.open_count[inode] = self.open_count.get(inode, 0) + 1
        self.files[fd] = (fd, inode)
        self._changed_dir(parent_inode)
        return pyfuse3.FileInfo(fh=fd), self._attr(inode)

    async def open(self, inode, flags, ctx):
        fd = os.open(self.path[inode], _own_flags(flags))
        if flags & os.O_TRUNC:
            self.floor[inode] = 0
        self.open_count[inode] = self.open_count.get(inode, 0) + 1
        self.files[fd] = (fd, inode)
        return pyfuse3.FileInfo(fh=fd)

    async def read(self, fh, off, size):
        return os.pread(self.files[fh][0], size, off)

    async def write(self, fh, off, buf):
        fd, inode = self.files[fh]
        written = os.pwrite(fd, buf, off)
        if written:
            pages = range(off // PAGE, (off + written - 1) // PAGE + 1)
            dirty = self.dirty.setdefault(inode, set())
            if self.early:
                early = {page for page in pages if self.random.random() < self.early}
                if early:
                    self._keep_pages(inode, fd, early)
                dirty.update(page for page in pages if page not in early)
            else:
                dirty.update(pages)
        return written

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        fd, inode = self.files[fh]
        self._sync_file(inode, fd)

    async def release(self, fh):
        fd, inode = self.files.pop(fh)
        os.close(fd)
        self.open_count[inode] -= 1
        if not self.open_count[inode]:
            del self.open_count[inode]
            path = self.path.get(inode)
            if path is not None and path.startswith(self.orphans + os.sep):
                os.unlink(path)
                del self.path[inode]
                self.dirty.pop(inode, None)
                self.floor.pop(inode, None)

    async def opendir(self, inode, ctx):
        handle = self.next_dir_handle
        self.next_dir_handle += 1
        self.dirs[handle] = (inode, sorted(os.listdir(self.path[inode])))
        return handle

    async def readdir(self, fh, start_id, token):
        inode, names = self.dirs[fh]
        for index in range(start_id, len(names)):
            path = os.path.join(self.path[inode], names[index])
            child = self.inode.get(path)
            if child is None:
                continue  # gone since the listing
            if not pyfuse3.readdir_reply(token, os.fsencode(names[index]), self._attr(child), index + 1):
                break

    async def fsyncdir(self, fh, datasync):
        self._keep_dir(self.dirs[fh][0])

    async def releasedir(self, fh):
        del self.dirs[fh]

    async def forget(self, inode_list):
        pass  # inode numbers are never reused; nothing to free


def _own_flags(flags):
    """The flags this file system opens a live file with for a caller's `flags`: always for
    reading and writing (a sync reads what a caller only writes; the kernel has checked the
    caller's access already), never appending (the kernel gives each write its offset)."""
    dropped = os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND
    return (flags & ~dropped) | os.O_RDWR


def _as_fuse_errors(method):
    @functools.wraps(method)
    async def handler(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    return handler


for _name, _method in list(vars(Forgetful).items()):
    if not _name.startswith("_") and callable(_method):
        setattr(Forgetful, _name, _as_fuse_errors(_method))


def serve(work, mountpoint, early, seed):
    ops = Forgetful(work, early, seed)
    options = set(pyfuse3.default_options)
    options.add("fsname=forgetful")
    options.discard("default_permissions")
    pyfuse3.init(ops, mountpoint, options)

    async def main():
        async with trio.open_nursery() as nursery:
            async def on_term():
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(on_term)
            nursery.start_soon(pyfuse3.main)

    try:
        print("forgetful_fs: mounted", flush=True)
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)


def materialize(work, out):
    """Build in the empty directory `out` the tree the power left (see the module)."""
    state = os.path.join(work, "state")
    with open(os.path.join(state, "dirs.json")) as f:
        dirs = {int(k): v for k, v in json.load(f).items()}
    if os.listdir(out):
        raise SystemExit(f"forgetful_fs: {out} is not empty")
    placed = {}  # inode -> where its kept data went

    def build(inode, path):
        for name, (child, is_dir, mode) in sorted(dirs.get(inode, {}).items()):
            target = os.path.join(path, name)
            if is_dir:
                os.mkdir(target, mode)
                build(child, target)
                continue
            kept = os.path.join(state, "data", str(child))
            if child in placed:
                shutil.copyfile(placed[child], target)  # named twice: renamed across directories
            elif os.path.exists(kept):
                os.rename(kept, target)  # keeps a sparse file sparse
                placed[child] = target
            else:
                open(target, "wb").close()  # a name synced, never its data
            os.chmod(target, mode)

    build(ROOT, out)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve")
    serve_parser.add_argument("work")
    serve_parser.add_argument("mountpoint")
    serve_parser.add_argument("--early", type=float, default=0.0)
    serve_parser.add_argument("--seed", type=int, default=0)
    materialize_parser = commands.add_parser("materialize")
    materialize_parser.add_argument("work")
    materialize_parser.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.work, args.mountpoint, args.early, args.seed)
    else:
        materialize(args.work, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
