"""A real file system on the volume: nbdfuse exposes the export as a file,
a loop device (direct I/O) turns it into a block device, ext4 goes on it,
PostMark works it hard, and fsck finds it clean."""

import os
import signal
import time

import pytest

import harness
from conftest import attach_logs, require_tools
from harness import run

POSTMARK_CONFIG = """set location {location}
set number 500
set transactions 2000
set size 512 16384
set subdirectories 10
set read 4096
set write 4096
set seed 42
run
quit
"""


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def abort_fuse(mountpoint):
    """Last resort for a FUSE mount whose server hangs: abort the connection
    through fusectl, so nothing stays stuck in the kernel."""
    try:
        minor = os.minor(os.stat(mountpoint).st_dev)
        path = f"/sys/fs/fuse/connections/{minor}/abort"
        if os.path.exists(path):
            with open(path, "w") as f:
                f.write("1")
    except OSError:
        pass


class Ext4OnNbd:
    """nbdfuse + loop device + ext4, torn down in reverse on every path."""

    def __init__(self, workdir, uri):
        self.uri = uri
        self.fuse_dir = os.path.join(workdir, "fuse")
        self.disk = os.path.join(self.fuse_dir, "disk")
        self.mountpoint = os.path.join(workdir, "fs")
        self.pidfile = os.path.join(workdir, "nbdfuse.pid")
        os.makedirs(self.fuse_dir)
        os.makedirs(self.mountpoint)
        self.nbdfuse = harness.Process(
            "nbdfuse", ["nbdfuse", "-P", self.pidfile, self.disk, uri], os.path.join(workdir, "nbdfuse.log")
        )
        self.loop = None

    def attach(self):
        self.nbdfuse.start()
        harness.wait_until(
            lambda: os.path.exists(self.pidfile) or not self.nbdfuse.alive(), 30, "nbdfuse to be ready"
        )
        assert self.nbdfuse.alive(), f"nbdfuse exited with {self.nbdfuse.returncode()}:\n{self.nbdfuse.log()}"
        assert os.path.getsize(self.disk) == harness.GiB
        self.loop = run(["losetup", "--direct-io=on", "-f", "--show", self.disk], timeout=30).stdout.strip()
        assert self.loop.startswith("/dev/loop"), self.loop

    def logs(self):
        return [(self.nbdfuse.name, self.nbdfuse.log())]

    def teardown(self):
        problems = []
        if mounted(self.mountpoint):
            if run(["umount", self.mountpoint], timeout=60, check=False).returncode != 0:
                problems.append("umount failed; lazy unmount")
                run(["umount", "-l", self.mountpoint], timeout=30, check=False)
        if self.loop:
            if run(["losetup", "-d", self.loop], timeout=30, check=False).returncode != 0:
                problems.append(f"losetup -d {self.loop} failed")
            self.loop = None
        if mounted(self.fuse_dir):
            if run(["fusermount3", "-u", self.fuse_dir], timeout=30, check=False).returncode != 0:
                abort_fuse(self.fuse_dir)
                run(["fusermount3", "-uz", self.fuse_dir], timeout=30, check=False)
                problems.append("fusermount3 -u failed; aborted the FUSE connection")
        code, killed = self.nbdfuse.stop(signal.SIGTERM, timeout=15)
        if killed:
            problems.append("nbdfuse had to be killed")
        return problems


@pytest.mark.time_limit(600)
def test_ext4_postmark_fsck(request, target, workdir):
    require_tools("nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "fsck.ext4", "mount", "umount", "postmark")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.geteuid() != 0:
        pytest.skip("loop devices and mount need root")

    # First attachment: make the file system and work it.
    stack = Ext4OnNbd(os.path.join(workdir, "first"), target.uri())
    attach_logs(request, stack)
    marker = os.path.join(stack.mountpoint, "marker")
    payload = os.urandom(1 << 20)
    try:
        stack.attach()
        run(["mkfs.ext4", "-q", stack.loop], timeout=180)
        run(["mount", "-t", "ext4", stack.loop, stack.mountpoint], timeout=60)
        config = os.path.join(workdir, "postmark.cfg")
        with open(config, "w") as f:
            f.write(POSTMARK_CONFIG.format(location=stack.mountpoint))
        started = time.monotonic()
        result = run(["postmark", config], timeout=420, cwd=workdir)
        assert "Time:" in result.stdout, result.stdout
        print(f"postmark took {time.monotonic() - started:.1f}s\n{result.stdout}")
        with open(marker, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        run(["umount", stack.mountpoint], timeout=120)
    finally:
        problems = stack.teardown()
    assert not problems, problems

    # Second attachment, with nothing cached on this side: what fsck and
    # the mount see comes from the server.
    stack = Ext4OnNbd(os.path.join(workdir, "second"), target.uri())
    attach_logs(request, stack)
    marker = os.path.join(stack.mountpoint, "marker")
    try:
        stack.attach()
        fsck = run(["fsck.ext4", "-fn", stack.loop], timeout=180, check=False)
        assert fsck.returncode == 0, f"fsck.ext4 -fn exit {fsck.returncode}\n{fsck.stdout}\n{fsck.stderr}"
        run(["mount", "-t", "ext4", "-o", "ro", stack.loop, stack.mountpoint], timeout=60)
        with open(marker, "rb") as f:
            assert f.read() == payload, "file written before unmount differs"
    finally:
        problems = stack.teardown()
    assert target.host.alive(), "the NBD server died"
    assert not problems, problems
