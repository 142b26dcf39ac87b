"""Faults of the environment (issue 11), each against real processes: the
same element reached under two names, no element answering at start, a
second host element started against the same elements, a volume too large
for the elements, and an element whose disk fills up."""

import errno
import json
import os
import time

import pytest

import harness
from harness import Client, Process, run, wait_until
from test_failures import digests_agree


def element_status(status, name):
    for element in status["elements"]:
        if element["name"] == name:
            return element
    raise AssertionError(f"element {name} missing from status: {status}")


@pytest.mark.time_limit(120)
def test_the_same_element_under_two_names_counts_once(make_cluster):
    """A fourth name whose address leads to `local`'s process: the host
    element recognises the element's identity and refuses whichever of the two
    names reaches it second, so one disk never counts twice toward the
    quorum."""
    cluster = make_cluster(start=False)
    for element in cluster.elements.values():
        element.start()
    relay = harness.Relay((harness.LOCALHOST, cluster.elements["local"].port))
    try:
        cluster.host_extra = ["--element", f"twin={relay.address}"]
        cluster.host.args = cluster.host_args()
        cluster.start_host(ready=False)

        def one_refused(s):
            local, twin = element_status(s, "local"), element_status(s, "twin")
            for refused, other in ((twin, "local"), (local, "twin")):
                if refused["state"] == "failed" and f"same element as {other}" in (refused.get("reason") or ""):
                    return refused["name"]
            return None

        status = cluster.wait_status(one_refused, 30, "local or twin refused as the same element as the other")
        refused = one_refused(status)
        admitted = "local" if refused == "twin" else "twin"
        cluster.wait_status(
            lambda s: all(element_status(s, n)["state"] == "in-sync" for n in (admitted, "near", "far"))
            and harness.volume_status(s)["mode"] == "read-write",
            30,
            f"{admitted}, near and far in sync",
        )
        data = harness.random_bytes(64 * 1024, seed=11)
        with Client(cluster.uri()) as client:
            client.pwrite(data, 0)
            client.flush()
            assert client.pread(len(data), 0) == data
        # Still refused later, however often it reconnects.
        time.sleep(3)
        status = cluster.status()
        assert element_status(status, refused)["state"] == "failed", status
        assert one_refused(status) == refused, status
    finally:
        relay.close()


@pytest.mark.time_limit(120)
def test_requests_fail_after_the_startup_timeout_when_no_element_answers(make_cluster):
    """No element is reachable: requests are held only for the start-up
    timeout, then fail with EIO (not hang), status says unavailable; once the
    elements come, the volume serves."""
    cluster = make_cluster(start=False, host_extra=["--startup-timeout-ms", "4000"])
    cluster.start_host(ready=False)
    with Client(cluster.uri()) as client:
        started = time.monotonic()
        harness.expect_nbd_error(lambda: client.pread(4096, 0), {errno.EIO}, "read with no element")
        waited = time.monotonic() - started
        assert waited < 30, f"the read was held {waited:.1f} s"
        mode = harness.volume_status(cluster.status())["mode"]
        assert mode == "unavailable", mode
        # Later requests fail at once.
        started = time.monotonic()
        harness.expect_nbd_error(lambda: client.pwrite(b"x" * 4096, 0), {errno.EIO}, "write with no element")
        assert time.monotonic() - started < 5
    for element in cluster.elements.values():
        element.start()
    cluster.wait_healthy()
    with Client(cluster.uri()) as client:
        client.pwrite(b"y" * 4096, 0)
        assert client.pread(4096, 0) == b"y" * 4096


@pytest.mark.time_limit(180)
def test_a_second_host_element_takes_over_and_the_first_stops_serving(make_cluster, workdir):
    """Epochs come from the elements, not from clocks: a second host element
    started against the same elements takes the next epoch (once the read lease
    the elements promised the first runs out), the first learns it from the
    elements, stops serving and turns standby (a client still connected to it
    gets errors, never data); the second serves everything the first
    acknowledged."""
    cluster = make_cluster()
    first_epoch = cluster.status()["epoch"]
    data = harness.random_bytes(256 * 1024, seed=12)
    old_client = Client(cluster.uri(), timeout=30)
    old_client.pwrite(data, 1 << 20)
    old_client.flush()
    nbd_port, admin_port = harness.free_port(), harness.free_port()
    args = cluster.host_args()
    args[args.index("--nbd") + 1] = f"{harness.LOCALHOST}:{nbd_port}"
    args[args.index("--admin") + 1] = f"{harness.LOCALHOST}:{admin_port}"
    second = Process("host-2", args, os.path.join(workdir, "host-2.log"))
    second.start()
    try:
        harness.wait_listening(second, admin_port)
        admin = f"{harness.LOCALHOST}:{admin_port}"

        def second_status():
            return json.loads(run([harness.starfish_bin(), "status", "--admin", admin, "--json"]).stdout)

        def second_healthy():
            s = second_status()
            return s if harness.healthy(s) else None

        status = wait_until(second_healthy, 30, "second host healthy")
        assert status["epoch"] == first_epoch + 1, (first_epoch, status["epoch"])
        with Client(f"nbd://{harness.LOCALHOST}:{nbd_port}/vol0") as client:
            assert client.pread(len(data), 1 << 20) == data
        first = cluster.wait_status(lambda s: s["role"] == "standby", 30, "first host superseded: a standby")
        assert first["epoch"] == first_epoch + 1, first
        # libnbd: the first failure says the connection went; later ones, that the handle is closed.
        gone = {errno.EIO, errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE, errno.ESHUTDOWN, errno.EINVAL}
        harness.expect_nbd_error(lambda: old_client.pread(4096, 1 << 20), gone, "read from the superseded host")
        harness.expect_nbd_error(lambda: old_client.pwrite(b"z" * 4096, 0), gone, "write to the superseded host")
        with Client(f"nbd://{harness.LOCALHOST}:{nbd_port}/vol0") as client:
            assert client.pread(len(data), 1 << 20) == data
            assert client.pread(4096, 0) != b"z" * 4096
    finally:
        old_client.close()
        second.stop()


@pytest.mark.time_limit(180)
def test_a_volume_too_large_for_the_elements_is_refused_and_nothing_is_lost(make_cluster):
    """`--volume big:15TiB` (TiB for GiB): every element refuses it before
    writing anything, the host element says why and serves nothing; started
    again without it, everything written before is there and the elements
    hold no trace of the big volume."""
    cluster = make_cluster()
    data = harness.random_bytes(128 * 1024, seed=13)
    with Client(cluster.uri()) as client:
        client.pwrite(data, 0)
        client.flush()
    cluster.stop_host()
    files_before = {n: sorted(os.listdir(os.path.join(e.data, "volumes"))) for n, e in cluster.elements.items()}
    cluster.host_extra = ["--volume", "big:15TiB", "--startup-timeout-ms", "4000"]
    cluster.host.args = cluster.host_args()
    cluster.start_host(ready=False)
    status = cluster.wait_status(
        lambda s: all("big" in (e.get("reason") or "") and "GiB" in (e.get("reason") or "") for e in s["elements"]),
        30,
        "every element refusing the big volume with a reason",
    )
    assert all(e["state"] == "failed" for e in status["elements"]), status
    for name, element in cluster.elements.items():
        assert element.process.alive(), f"element {name} died on the big volume"
        assert sorted(os.listdir(os.path.join(element.data, "volumes"))) == files_before[name]
    cluster.stop_host()
    cluster.host_extra = []
    cluster.host.args = cluster.host_args()
    cluster.start_host()
    with Client(cluster.uri()) as client:
        assert client.pread(len(data), 0) == data


def tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], timeout=30)


def unmount(path):
    for _ in range(20):
        if run(["umount", path], timeout=30, check=False).returncode == 0:
            return
        time.sleep(0.5)
    run(["umount", "-l", path], timeout=30, check=False)


@pytest.mark.time_limit(300)
@pytest.mark.parametrize("write_bytes", [2 * harness.MiB, 128 * 1024], ids=["2MiB", "128KiB"])
def test_an_element_whose_disk_fills_up_rejoins_by_itself_once_space_is_freed(make_cluster, workdir, write_bytes):
    """`far` keeps its data on a small file system (a tmpfs) that a filler file
    has almost filled. Writes go on (Q=2 with local and near); far runs out of
    space, stays alive, refuses with a clear reason, and rejoins without a
    restart once the filler is deleted; the three replicas end identical.
    Commits of 2 MiB writes run on far's committer thread; most of those of
    128 KiB writes on its actor (a small commit of a store in memory)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    cluster = make_cluster(start=False, volumes=[("vol0", "1GiB")])
    far = cluster.elements["far"]
    mountpoint = os.path.join(workdir, "far-disk")
    tmpfs(mountpoint, "448m")
    try:
        far.data = os.path.join(mountpoint, "data")
        os.makedirs(far.data)
        far.process.args = far.process.args + ["--overcommit", "--replay-log", "16MiB"]
        far.process.args[far.process.args.index("--data") + 1] = far.data
        cluster.start()
        filler = os.path.join(mountpoint, "filler")
        free = os.statvfs(mountpoint).f_bavail * os.statvfs(mountpoint).f_frsize
        with open(filler, "wb") as f:
            f.write(b"\xff" * (free - 24 * harness.MiB))
        written = []
        with Client(cluster.uri()) as client:
            for i in range(96 * harness.MiB // write_bytes):  # 96 MiB: more than far has room for
                block = harness.random_bytes(write_bytes, seed=100 + i)
                client.pwrite(block, i * write_bytes)
                written.append(block)
            client.flush()
        status = cluster.wait_status(
            lambda s: "space" in (element_status(s, "far").get("reason") or ""),
            60,
            "far failed for lack of space, saying so",
        )
        assert far.process.alive(), "far exited when its disk filled"
        assert harness.volume_status(status)["mode"] == "read-write"
        os.remove(filler)
        cluster.wait_healthy(timeout=120)
        assert far.process.alive()
        with Client(cluster.uri()) as client:
            for i, block in enumerate(written):
                assert client.pread(len(block), i * write_bytes) == block
        digests_agree(cluster)
    finally:
        cluster.destroy()
        unmount(mountpoint)


def flip(path, offset, mask):
    """Flip the bits `mask` of the byte at `offset` of a (stopped element's) file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def refused_then_repaired(cluster, name, action):
    """Element `name`, whose disk was damaged while stopped, refuses to start;
    `starfish element repair` reports `action` and marks its volumes for repair;
    started again, it is repaired from its peers and the cluster is healthy."""
    element = cluster.elements[name]
    element.process.start()
    code = element.process.wait(30)
    assert code not in (None, 0), f"{name} started with a damaged disk"
    result = run([harness.starfish_bin(), "element", "repair", "--data", element.data, "--json"], timeout=120)
    report = json.loads(result.stdout)
    # vol0 is repaired from its peers (and the catalog's volume when the damage touched every
    # volume, as a cut log does).
    assert "vol0" in report["volumes_to_repair"], report
    assert set(report["volumes_to_repair"]) <= {"vol0", ".catalog"}, report
    assert any(a.startswith(action) for a in report["actions"]), report
    cluster.restart_element(name)
    cluster.wait_healthy(timeout=120)
    return element.process.log()


@pytest.mark.time_limit(240)
def test_a_bad_block_is_never_served_and_is_repaired_from_a_peer(make_cluster):
    """One byte of `near`'s data file flips while it is stopped. Reads that
    reach the damaged block fail (EIO when near is the only element left),
    never return wrong data; near is not taken back in sync while it holds
    the block, and once a peer is back it is repaired by a full recovery that
    verifies every block. The three replicas end identical. (No read cache:
    reads must reach the elements.)"""
    cluster = make_cluster(host_extra=["--read-cache", "0"])
    data = harness.random_bytes(1 << 20, seed=14)
    with Client(cluster.uri()) as client:
        client.pwrite(data, 0)
        client.flush()
    cluster.wait_caught_up(("near",))  # a graceful stop keeps only what near committed
    near = cluster.elements["near"]
    assert near.process.stop()[0] == 0
    path = os.path.join(near.data, "volumes", "0.data")
    flip(path, 8192 + 100, 0x40)
    cluster.restart_element("near")
    cluster.wait_healthy()
    cluster.kill_element("local")
    cluster.kill_element("far")
    cluster.wait_status(
        lambda s: [e["name"] for e in s["elements"] if e["state"] == "in-sync"] == ["near"],
        30,
        "near the only element in sync",
    )
    with Client(cluster.uri()) as client:
        harness.expect_nbd_error(lambda: client.pread(4096, 8192), {errno.EIO}, "read of the damaged block")
        # Blocks near still serves are right, or fail: never wrong.
        try:
            assert client.pread(4096, 0) == data[:4096]
        except harness.nbd.Error as e:
            assert e.errnum == errno.EIO, e
    status = cluster.wait_status(
        lambda s: element_status(s, "near")["state"] == "failed"
        and "checksum" in (element_status(s, "near").get("reason") or ""),
        30,
        "near failed, saying a block fails its checksum",
    )
    cluster.restart_element("local")
    cluster.restart_element("far")
    cluster.wait_healthy(timeout=120)
    with Client(cluster.uri()) as client:
        assert client.pread(len(data), 0) == data
    digests_agree(cluster)


def newest_batch(data_dir):
    """(path, body offset, body length) of the newest batch of records in the
    live log segment of a stopped element (batches: 40-byte header, magic
    "SFLB", body length at byte 24, record count at byte 32)."""
    log_dir = os.path.join(data_dir, "log")
    segment = os.path.join(log_dir, max(n for n in os.listdir(log_dir) if n.endswith(".seg")))
    with open(segment, "rb") as f:
        data = f.read()
    offset, found = 40, None
    while offset + 40 <= len(data) and data[offset:offset + 4] == b"SFLB":
        body = int.from_bytes(data[offset + 24:offset + 32], "little")
        records = int.from_bytes(data[offset + 32:offset + 36], "little")
        if records:
            found = (segment, offset + 40, body)
        offset += 40 + body
    assert found, f"no batch of records in {segment}"
    return found


@pytest.mark.time_limit(240)
def test_a_bit_flip_in_the_newest_log_batch_is_caught_and_repaired(make_cluster):
    """`far` is killed right after acknowledging writes, and one bit of its
    newest log batch flips. The batch was synced (the sync mark after it says
    so), so far refuses to start instead of discarding acknowledged records as
    a torn tail; `starfish element repair` keeps the intact part, and far,
    started again, is repaired from its peers. The replicas end identical."""
    cluster = make_cluster()
    data = harness.random_bytes(512 * 1024, seed=15)
    with Client(cluster.uri()) as client:
        for i in range(8):
            client.pwrite(data[i * 65536:(i + 1) * 65536], i * 65536)
        client.flush()
    # The flush needs two elements: far may still be committing its last batch, which a kill
    # would then leave as a torn tail (no sync mark after it).
    cluster.wait_caught_up(("far",))
    far = cluster.elements["far"]
    cluster.kill_element("far")
    segment, body, length = newest_batch(far.data)
    flip(segment, body + length // 2, 0x04)
    log = refused_then_repaired(cluster, "far", "truncated log segment")
    assert "acknowledged" in log and "element repair" in log, log
    with Client(cluster.uri()) as client:
        assert client.pread(len(data), 0) == data
    digests_agree(cluster)


@pytest.mark.time_limit(240)
def test_a_damaged_block_map_is_rebuilt_by_repair(make_cluster):
    """`near`'s block map is damaged while it is stopped: it refuses to
    start; `starfish element repair` gives the volume an empty map and a
    pending repair; started again, near is rebuilt from a peer. The replicas
    end identical."""
    cluster = make_cluster()
    data = harness.random_bytes(256 * 1024, seed=16)
    with Client(cluster.uri()) as client:
        client.pwrite(data, 0)
        client.flush()
    cluster.wait_caught_up(("near",))  # a graceful stop keeps only what near committed
    near = cluster.elements["near"]
    assert near.process.stop()[0] == 0
    path = os.path.join(near.data, "volumes", "0.map")
    for at in (4096 + 16, 8192 + 16):  # the first entry of chunk 0, in both slots
        flip(path, at, 0x01)
    refused_then_repaired(cluster, "near", "rebuilt the block map of volume vol0")
    with Client(cluster.uri()) as client:
        assert client.pread(len(data), 0) == data
    digests_agree(cluster)


@pytest.mark.time_limit(240)
def test_a_partial_write_into_a_bad_block_repairs_instead_of_looping(make_cluster):
    """The issue's loop: one byte of `near`'s data file flips, then a 512-byte
    write lands in that block (its base must be read and fails its checksum).
    The write is acknowledged by the others; near does not flap between fault
    and quick recovery but is repaired once, and the replicas end identical."""
    cluster = make_cluster(host_extra=["--read-cache", "0"])
    data = bytearray(harness.random_bytes(64 * 1024, seed=17))
    with Client(cluster.uri()) as client:
        client.pwrite(bytes(data), 0)
        client.flush()
    cluster.wait_caught_up(("near",))  # a graceful stop keeps only what near committed
    near = cluster.elements["near"]
    assert near.process.stop()[0] == 0
    path = os.path.join(near.data, "volumes", "0.data")
    flip(path, 12288 + 7, 0x10)
    cluster.restart_element("near")
    cluster.wait_healthy()
    patch = harness.random_bytes(512, seed=18)
    with Client(cluster.uri()) as client:
        client.pwrite(patch, 12288 + 1024)
        client.flush()
    data[12288 + 1024:12288 + 1536] = patch

    def repairs():
        with open(near.process.log_path, errors="replace") as f:
            return f.read().count("repaired by a full recovery that verifies every block")

    wait_until(lambda: repairs() >= 1, 30, "near to find the bad block under the partial write")
    cluster.wait_status(
        lambda s: harness.healthy(s) and element_status(s, "near").get("recovery") is None,
        120,
        "near repaired and in sync",
    )
    time.sleep(3)  # a loop would fault and recover again within this
    assert repairs() == 1, f"near started {repairs()} repairs"
    assert element_status(cluster.status(), "near")["state"] == "in-sync"
    with Client(cluster.uri()) as client:
        assert client.pread(len(data), 0) == bytes(data)
    digests_agree(cluster)


def write_pending_repair(data_dir, index):
    """Leave on a stopped element's disk what it writes itself when a block of
    volume `index` fails its checksum: a copy state file asking for a repair
    (docs/on-disk-format.md: magic, crc32c of bytes 12..48, verify = 1,
    intact = 1, no epoch, base or cursor)."""
    from history_recorder import crc32c
    body = bytes([1, 1]) + bytes(34)
    state = b"SFCOPY02" + crc32c(body).to_bytes(4, "little") + body
    path = os.path.join(data_dir, "volumes", f"{index}.copy")
    with open(path, "wb") as f:
        f.write(state)
        os.fsync(f.fileno())


def data_file_of(data_dir, size):
    """The data file of a stopped element's volume of `size` bytes."""
    volumes = os.path.join(data_dir, "volumes")
    found = [n for n in os.listdir(volumes) if n.endswith(".data") and os.path.getsize(os.path.join(volumes, n)) == size]
    assert len(found) == 1, f"volumes of {size} bytes in {volumes}: {found}"
    return os.path.join(volumes, found[0]), int(found[0].split(".")[0])


@pytest.mark.time_limit(240)
def test_with_no_element_in_sync_each_element_is_copied_what_it_lacks_from_a_peer_that_holds_it(make_cluster):
    """Every element comes back with a bad block that it knows of (a pending
    repair): `local` in vol1, `near` and `far` in vol0, each block at its own
    place. So no element is in sync, yet every volume is whole somewhere. The
    host element copies vol0 to near and far from local and vol1 to local from
    near or far, none of them in sync (before, each was failed for want of an
    in-sync peer to copy from, and every volume stayed unavailable). The data
    read back is what was written, and the replicas end identical."""
    cluster = make_cluster(volumes=(("vol0", "64MiB"), ("vol1", "32MiB")), host_extra=["--read-cache", "0"])
    data = {name: harness.random_bytes(1 << 20, seed=seed) for name, seed in (("vol0", 31), ("vol1", 32))}
    for name, content in data.items():
        with Client(cluster.uri(name)) as client:
            client.pwrite(content, 0)
            client.flush()
    cluster.wait_caught_up()
    damage = {"local": ("vol1", 32 << 20, 8192), "near": ("vol0", 64 << 20, 4096), "far": ("vol0", 64 << 20, 65536)}
    for name in damage:
        assert cluster.elements[name].process.stop()[0] == 0
    for name, (_, size, offset) in damage.items():
        path, index = data_file_of(cluster.elements[name].data, size)
        flip(path, offset + 100, 0x08)
        write_pending_repair(cluster.elements[name].data, index)
    for name in damage:
        cluster.restart_element(name)
    cluster.wait_healthy(timeout=120)
    with open(cluster.host.log_path, errors="replace") as f:
        assert "not in sync, as none is" in f.read(), cluster.logs()
    for name, content in data.items():
        with Client(cluster.uri(name)) as client:
            assert client.pread(len(content), 0) == content, name
    digests_agree(cluster)


@pytest.mark.time_limit(240)
def test_with_a_bad_block_on_every_element_each_is_repaired_from_the_others(make_cluster):
    """Every element comes back knowing of a bad block of vol0, each at its own
    place (the pending repair it writes itself on finding one): no element is in
    sync, and none holds vol0 whole. A repair its element made itself keeps its
    block map and log as committed, so it serves copies of the blocks that pass
    their checksum: near and far are copied from local (the first of the most
    advanced), each fetching its own bad block there, then local from them.
    The data read back is what was written, and the replicas end identical."""
    cluster = make_cluster(host_extra=["--read-cache", "0"])
    data = harness.random_bytes(1 << 20, seed=33)
    with Client(cluster.uri()) as client:
        client.pwrite(data, 0)
        client.flush()
    cluster.wait_caught_up()
    damage = {"local": 4096, "near": 65536, "far": 131072}
    for name in damage:
        assert cluster.elements[name].process.stop()[0] == 0
    for name, offset in damage.items():
        element_data = cluster.elements[name].data
        flip(os.path.join(element_data, "volumes", "0.data"), offset + 100, 0x08)
        write_pending_repair(element_data, 0)
    for name in damage:
        cluster.restart_element(name)
    cluster.wait_healthy(timeout=120)
    with open(cluster.host.log_path, errors="replace") as f:
        assert "a repair, for the blocks it holds intact" in f.read(), cluster.logs()
    with Client(cluster.uri()) as client:
        assert client.pread(len(data), 0) == data
    digests_agree(cluster)
