"""A real file system on the volume: nbdfuse exposes the export as a file,
a loop device (direct I/O) turns it into a block device, ext4 goes on it,
PostMark works it hard, and fsck finds it clean."""

import os
import time

import pytest

from conftest import attach_logs, require_tools
from harness import Ext4OnNbd, run

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
