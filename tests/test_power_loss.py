"""Power loss, for real: the three elements keep their data on one file system (ext4 with or
without a journal, XFS or btrfs) whose disk loses every write it was not told to flush when
the power goes (`harness.VolatileDisk`: nbdkit's cache filter in writeback mode under nbdfuse
and a loop device). `kill -9` leaves the page cache alive, so it cannot tell a synced write
from one that only reached memory; this can.

The cut takes the whole machine: nbdkit first (the disk's cache is gone), then every StarFish
process. The image is then mounted as found (the file system replays its journal; ext4
without a journal is repaired by `e2fsck -fy` first, as at boot), the processes start on it,
and every acknowledged write must read back (`durable`: on stable storage on Q elements
before the host hears back), no request torn, the replicas equal in the end. Or the cut
takes one element's machine only, while the other two go on: it comes back behind and
catches up. ext4 without a journal cannot keep that promise (`e2fsck` may clear a file an
element synced): there the elements must warn, and what is served after the cut be right.

Real file systems keep more than POSIX promises (they commit renames and new names in order
with the rest of their metadata), so a missing directory sync passes a cut on them. The same
whole-machine check therefore also runs on `harness.ForgetfulDisk`, a FUSE file system that
keeps only what was synced: a file's data as of its last `fdatasync`, a directory's entries as
of its last `fsync`; and on its variant that also keeps, at random, half of what was written or
renamed since, as a disk that writes back on its own.

The broken variant the check must catch: elements that acknowledge on receipt (`received`, a
weaker promise by design) while the disk has stopped answering. Their acknowledgements go on,
the cut loses those writes, and the same check reports them lost, while what a FLUSH covered
before is still there, as that policy promises."""

import os
import signal

import pytest

import harness
from conftest import attach_logs, require_tools
from harness import MiB, Client, LoadWriter
from test_failures import WRITE_SIZES, check_region, combined_log, digests_agree, write_again_and_converge

REGION_BLOCKS = 8192  # 32 MiB of 4 KiB blocks
VOLUME = (("vol0", "512MiB"),)
# Placed writes (`--placed-writes`): of 256 KiB to 2 MiB, at random over 256 MiB, so that most
# of those written before the cut land in holes and are placed.
PLACED_REGION_BLOCKS = 65536
PLACED_WRITES = dict(min_blocks=64, max_blocks=512, inflight=4)
# Small writes (1 to 4 blocks) acknowledged before the cut of the `checkpoints` load, whose
# elements seal their log segments at 16 MiB (`--checkpoint-log`, default 64 MiB): about 50 MiB
# of log per element, so about three segments sealed and checkpointed.
CHECKPOINTS_ACKS = 5000
CHECKPOINTS_EXTRA = ["--checkpoint-log", "16MiB"]
CHECKPOINTS_SEALS_MIN = 2
# What an element logs at start when its data directory is on ext4 without a journal.
NO_JOURNAL_WARNING = "the data directory is on ext4 without a journal"
# Small logs: three elements share a 3 GiB disk image.
ELEMENT_EXTRA = ["--replay-log", "64MiB"]


@pytest.fixture
def volatile_disk(request, workdir):
    """A started `harness.VolatileDisk` with the file system `request.param` (default ext4), or
    with `forgetful` a `harness.ForgetfulDisk` (`forgetful-early`: keeping half of what is
    written or renamed at once, as a disk may)."""
    fs = getattr(request, "param", "ext4")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.geteuid() != 0:
        pytest.skip("loop devices and mount need root")
    if fs.startswith("forgetful"):
        require_tools("fusermount3")
        disk = harness.ForgetfulDisk(workdir, early=0.5 if fs == "forgetful-early" else 0.0, seed=47)
    else:
        mkfs = "mkfs." + fs.split("-")[0]
        require_tools("nbdkit", "nbdfuse", "fusermount3", "losetup", mkfs, "e2fsck", "mount", "umount")
        disk = harness.VolatileDisk(workdir, fs)
    attach_logs(request, disk)
    clusters = []
    try:
        disk.start()
        yield disk, clusters
    finally:
        # The processes first: none may hold the file system when it is unmounted.
        for cluster in clusters:
            cluster.destroy()
        problems = disk.teardown()
    assert not problems, problems


def power_cut(disk, cluster):
    """The machine loses power: the disk's cache, then every process (SIGKILL)."""
    disk.power_cut()
    processes = [cluster.host] + [e.process for e in cluster.elements.values()]
    for process in processes:
        process.send_signal(signal.SIGKILL)
    for process in processes:
        assert process.wait(harness.STOP_TIMEOUT) is not None, f"{process.name} outlived SIGKILL"


def element_log(element):
    with open(element.process.log_path, errors="replace") as f:
        return f.read()


def load_and_cut(disk, cluster, workdir, region, options, acks, seed, seals_min=0):
    """Writes under load until `acks` are acknowledged, then the power cut; returns the writer
    and its combined write log (what was acknowledged, what was in flight). With `seals_min`,
    each element must have sealed its log segment that many times before the cut."""
    before = {name: element.live_segment() for name, element in cluster.elements.items()}
    with LoadWriter(workdir, cluster.uri(), region, seed=seed, **options) as writer:
        writer.wait_acks(acks, timeout=300)
        sealed = {name: element.live_segment() - before[name] for name, element in cluster.elements.items()}
        print(f"seals before the cut: {sealed}")
        assert all(n >= seals_min for n in sealed.values()), f"seals before the cut: {sealed}"
        power_cut(disk, cluster)
        writer.process.wait(60)  # its connection broke: it stops by itself
    write_log = combined_log(workdir, [writer], region)
    assert write_log.acked_count > 0
    return writer, write_log


def power_on(disk, cluster):
    disk.power_on()
    for element in cluster.elements.values():
        element.start()
    cluster.start_host()


def region_problems(uri, write_log):
    with Client(uri) as client:
        return harness.check_stamped_region(client, write_log)


def fsync_path(path, data_only=False):
    fd = os.open(path, os.O_RDONLY)
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    finally:
        os.close(fd)


def write_file(path, data, sync=False):
    """Writes `data` at the start of `path` (created if need be), then `fdatasync` if `sync`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def read_tree(root):
    """Every file under `root` as relative path -> contents, every directory as path -> None."""
    tree = {}
    for top, dirs, files in os.walk(root):
        for name in dirs:
            tree[os.path.relpath(os.path.join(top, name), root)] = None
        for name in files:
            with open(os.path.join(top, name), "rb") as f:
                tree[os.path.relpath(os.path.join(top, name), root)] = f.read()
    return tree


@pytest.mark.time_limit(60)
@pytest.mark.parametrize("early", [0.0, 1.0])
def test_the_forgetful_disk_keeps_what_was_synced_and_nothing_else(workdir, request, early):
    """The check of the strong test's strictest disk itself. Without early write-back, a cut
    keeps a file's data as of its last sync and a directory's entries as of its last sync,
    nothing else; with every write and change kept at once (`early` 1), the cut keeps all
    that was there."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root")
    require_tools("fusermount3")
    disk = harness.ForgetfulDisk(workdir, early=early, seed=1)
    attach_logs(request, disk)
    try:
        disk.start()
        root = disk.mountpoint
        d = os.path.join(root, "d")
        os.mkdir(d)
        fsync_path(root)
        write_file(os.path.join(d, "synced"), b"A" * 8192, sync=True)
        fsync_path(d)
        write_file(os.path.join(d, "synced"), b"B" * 4096)  # never synced
        write_file(os.path.join(d, "empty"), b"D" * 5000)  # its name synced, never its data
        write_file(os.path.join(d, "tmp"), b"one", sync=True)
        os.rename(os.path.join(d, "tmp"), os.path.join(d, "meta"))
        write_file(os.path.join(d, "cut"), b"E" * 10000, sync=True)
        write_file(os.path.join(d, "gone"), b"F" * 10, sync=True)
        fsync_path(d)
        write_file(os.path.join(d, "unnamed"), b"C" * 100, sync=True)  # its name never synced
        write_file(os.path.join(d, "tmp"), b"two", sync=True)
        os.rename(os.path.join(d, "tmp"), os.path.join(d, "meta"))  # the directory never synced
        os.truncate(os.path.join(d, "cut"), 10)
        os.truncate(os.path.join(d, "cut"), 10000)  # zeroes from 10 on
        fsync_path(os.path.join(d, "cut"), data_only=True)
        os.unlink(os.path.join(d, "gone"))  # the directory never synced
        os.mkdir(os.path.join(d, "sub"))  # the directory never synced
        live = read_tree(root)
        assert live["d/synced"] == b"B" * 4096 + b"A" * 4096, "a read does not see an unsynced write"
        assert live["d/meta"] == b"two" and "d/gone" not in live and "d/tmp" not in live
        disk.power_cut()
        disk.power_on()
        after = read_tree(root)
    finally:
        problems = disk.teardown()
    assert not problems, problems
    if early:
        assert after == live, "every write and change kept at once, yet the cut lost some"
        return
    assert after == {
        "d": None,
        "d/synced": b"A" * 8192,
        "d/empty": b"",
        "d/meta": b"one",
        "d/cut": b"E" * 10 + bytes(9990),
        "d/gone": b"F" * 10,
    }


class Load:
    """What one load (`sizes`) of the tests below sets: the elements' extra arguments, the
    region written and the writes' sizes, the acknowledgements before the cut, the seals each
    element must have made by then, and the writes after it."""

    def __init__(self, sizes):
        placed = sizes == "placed"
        checkpoints = sizes == "checkpoints"
        self.element_extra = (ELEMENT_EXTRA + (["--placed-writes"] if placed else [])
                              + (CHECKPOINTS_EXTRA if checkpoints else []))
        if placed:
            self.region, self.options = PLACED_REGION_BLOCKS, PLACED_WRITES
        else:
            self.region, self.options = REGION_BLOCKS, WRITE_SIZES["small" if checkpoints else sizes]
        self.acks = {"small": 600, "large": 12, "placed": 40, "checkpoints": CHECKPOINTS_ACKS}[sizes]
        self.seals_min = CHECKPOINTS_SEALS_MIN if checkpoints else 0
        self.rewrites = 6 if sizes in ("large", "placed") else 200


# Every load on every disk, but the checkpoints load not on ext4 and XFS: their journals hid
# both syncs it is there for (docs/testing.md); the large load checkpoints on them too.
WHOLE_MACHINE_CASES = [
    (disk, sizes)
    for disk in ("ext4", "xfs", "btrfs", "forgetful", "forgetful-early")
    for sizes in ("small", "large", "placed", "checkpoints")
    if not (sizes == "checkpoints" and disk in ("ext4", "xfs"))
]


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("volatile_disk,sizes", WHOLE_MACHINE_CASES, indirect=["volatile_disk"])
def test_power_loss_keeps_every_acknowledged_write(volatile_disk, make_cluster, workdir, sizes):
    """Writes under load, the power cut at a random moment. With `placed`, elements with
    `--placed-writes` and writes of 256 KiB to 2 MiB, most of them into holes: their data goes
    to the data files and is made durable by the ranged sync of those files, not by the log.
    With `checkpoints`, small writes for long enough that each element seals its log segment
    and checkpoints about three times before the cut: what the log no longer holds must have
    been made durable in the data files."""
    disk, clusters = volatile_disk
    load = Load(sizes)
    cluster = make_cluster(volumes=VOLUME, data_root=disk.mountpoint, element_extra=load.element_extra)
    clusters.append(cluster)
    for element in cluster.elements.values():
        assert NO_JOURNAL_WARNING not in element_log(element), f"{element.name} warned on {disk.fs}"
    uri = cluster.uri()
    writer, write_log = load_and_cut(disk, cluster, workdir, load.region, load.options, load.acks, seed=41,
                                     seals_min=load.seals_min)
    power_on(disk, cluster)

    check_region(uri, write_log)
    write_again_and_converge(cluster, workdir, writer, load.region, 42, load.rewrites, load.options)


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("volatile_disk", ["ext4-nojournal"], indirect=True)
@pytest.mark.parametrize("sizes", ["large", "checkpoints"])
def test_on_ext4_without_a_journal_elements_warn_and_a_cut_serves_nothing_wrong(
    volatile_disk, make_cluster, workdir, sizes
):
    """ext4 without a journal cannot keep the promise above: after a cut, `e2fsck` may clear a
    whole file an element had synced, when another file's sync wrote its inode ahead of its
    extent blocks (CI saw `0.map` lost so, and the element refuse to start). What must hold
    there: every element warns at start; after the cut and `e2fsck -fy`, each element starts or
    refuses saying what it cannot open; while a write quorum starts, every acknowledged write
    reads back (the elements check every block they serve against its checksum), and with all
    three the replicas converge."""
    disk, clusters = volatile_disk
    load = Load(sizes)
    cluster = make_cluster(volumes=VOLUME, data_root=disk.mountpoint, element_extra=load.element_extra)
    clusters.append(cluster)
    for element in cluster.elements.values():
        assert NO_JOURNAL_WARNING in element_log(element), f"{element.name} did not warn"
    uri = cluster.uri()
    writer, write_log = load_and_cut(disk, cluster, workdir, load.region, load.options, load.acks, seed=43,
                                     seals_min=load.seals_min)
    disk.power_on()
    print(disk.fsck_output)
    refused = {}
    for name, element in cluster.elements.items():
        try:
            element.start()
        except AssertionError as e:
            refused[name] = str(e)
    for name, error in refused.items():
        assert "cannot open data directory" in error, f"{name} did not say why it stopped:\n{error}"
        print(f"{name} refused after the cut: {error.splitlines()[-1]}")
    if len(refused) > 1:
        return  # below the write quorum: nothing is served, so nothing wrong
    cluster.start_host(ready=not refused)
    if refused:
        up = [name for name in cluster.elements if name not in refused]
        cluster.wait_caught_up(up, timeout=harness.START_TIMEOUT)
    check_region(uri, write_log)
    if not refused:
        write_again_and_converge(cluster, workdir, writer, load.region, 44, load.rewrites, load.options)


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("volatile_disk", ["ext4", "forgetful"], indirect=True)
@pytest.mark.parametrize("sizes", ["small", "large"])
def test_an_element_that_loses_power_catches_up(volatile_disk, make_cluster, workdir, sizes):
    """Only `local`'s machine loses power (its disk's cache, then the element) while writes go
    on with the other two. It comes back on what its disk kept, behind by whatever it had not
    synced, and catches up; every acknowledged write reads back and the replicas end equal."""
    disk, clusters = volatile_disk
    cluster = make_cluster(volumes=VOLUME, data_root={"local": disk.mountpoint}, element_extra=ELEMENT_EXTRA)
    clusters.append(cluster)
    uri = cluster.uri()
    acks = 300 if sizes == "small" else 8
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=45, **WRITE_SIZES[sizes]) as writer:
        writer.wait_acks(acks)
        disk.power_cut()
        cluster.kill_element("local")
        writer.wait_acks(acks, what="acknowledged writes with local off")
        disk.power_on()
        cluster.restart_element("local")
        cluster.wait_healthy(timeout=120)
        writer.wait_acks(acks, what="acknowledged writes after local came back")
        code = writer.finish()
        assert code == 0, f"writer exit {code}\n{writer.output()}"
    write_log = combined_log(workdir, [writer])
    assert not write_log.failed, f"writes failed with one element off: {write_log.failed[:10]}"
    check_region(uri, write_log)
    cluster.wait_caught_up(timeout=90)
    digests_agree(cluster)


@pytest.mark.time_limit(300)
def test_power_loss_check_catches_writes_acknowledged_from_memory(volatile_disk, make_cluster, workdir):
    """Every element acknowledges on receipt. The disk stops answering, the writer still gets
    acknowledgements, then the power goes: the check must find acknowledged writes lost. What
    a FLUSH covered before the disk stopped survives (the policy's promise)."""
    disk, clusters = volatile_disk
    cluster = make_cluster(volumes=VOLUME, data_root=disk.mountpoint, element_extra=ELEMENT_EXTRA,
                           ack={name: "received" for name in harness.ELEMENT_NAMES})
    clusters.append(cluster)
    uri = cluster.uri()
    flushed_at = 128 * MiB  # beyond the writer's region
    flushed = harness.random_bytes(MiB, seed=43)
    with Client(uri) as client:
        client.pwrite(flushed, flushed_at)
        client.flush()
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=44, **WRITE_SIZES["small"]) as writer:
        writer.wait_acks(300)
        disk.pause()
        writer.wait_acks(100, timeout=60, what="writes acknowledged from memory while the disk hangs")
        power_cut(disk, cluster)
        writer.process.wait(60)
    write_log = combined_log(workdir, [writer], REGION_BLOCKS)
    power_on(disk, cluster)

    with Client(uri) as client:
        assert client.pread(MiB, flushed_at) == flushed, "data a FLUSH covered was lost"
    problems = region_problems(uri, write_log)
    lost = [p for p in problems if "acknowledged" in p]
    assert lost, f"a power cut after {write_log.acked_count} writes acknowledged from memory lost none of them"
