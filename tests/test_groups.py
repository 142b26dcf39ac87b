"""Consistency groups (issue 14): `--group NAME:VOL,VOL…` and `[[group]]`. The group's volumes
are exported as usual but share one sequence space; after a disaster that leaves only the far
site, the far element's copy of the group is the result of a prefix of the one order in which
the host acknowledged the writes."""

import os
import signal
import struct
import subprocess
import time

import nbd
import pytest

import harness
from harness import Client, random_bytes

MiB = 1024 * 1024
BLOCK = 4096
STAMP = struct.Struct("<8sQ")


def volume(status, name):
    return next(v for v in status["volumes"] if v["name"] == name)


@pytest.mark.time_limit(120)
def test_a_groups_volumes_are_separate_disks_with_one_sequence(make_cluster):
    cluster = make_cluster(volumes=(("a", "8MiB"), ("b", "5MiB"), ("c", "4MiB")), use_config=True,
                           host_extra=["--group", "g:a,b"])
    status = cluster.status()
    assert [(v["name"], v["size_bytes"], v.get("group")) for v in status["volumes"]] == \
        [("a", 8 * MiB, "g"), ("b", 5 * MiB, "g"), ("c", 4 * MiB, None)]
    # Nothing written yet: at most the host element's beginning record is acknowledged.
    groups = status["groups"]
    assert len(groups) == 1 and groups[0]["acked_sequence"] <= 1, groups
    assert groups == [{"name": "g", "storage_volume": "g[a,b]", "size_bytes": 13 * MiB,
                       "mode": "read-write", "acked_sequence": groups[0]["acked_sequence"], "volumes": ["a", "b"]}]
    for name, size in (("a", 8 * MiB), ("b", 5 * MiB), ("c", 4 * MiB)):
        h = nbd.NBD()
        h.connect_uri(cluster.uri(name))
        assert h.get_size() == size, name
        h.shutdown()
    a, b, c = random_bytes(8 * MiB, 1), random_bytes(5 * MiB, 2), random_bytes(4 * MiB, 3)
    for name, data in (("a", a), ("b", b), ("c", c)):
        with Client(cluster.uri(name), timeout=60) as client:
            client.pwrite(data, 0)
            client.flush()
    status = cluster.wait_healthy(timeout=30)
    # One sequence: a and b report their group's, which counts the writes to both.
    assert volume(status, "a")["acked_sequence"] == volume(status, "b")["acked_sequence"] > 0
    assert status["groups"][0]["acked_sequence"] == volume(status, "a")["acked_sequence"]
    for element in status["elements"]:
        assert set(element["applied_sequence"]) == {"g[a,b]", "c"}, element
    # Neither member's writes reach the other; the last block of a and the first of b meet
    # at no boundary.
    for name, data in (("a", a), ("b", b), ("c", c)):
        with Client(cluster.uri(name)) as client:
            assert client.pread(len(data), 0) == data, name
    # Writes past a member's end are refused by the NBD layer, not written into the next one.
    h = nbd.NBD()
    h.connect_uri(cluster.uri("a"))
    with pytest.raises(nbd.Error):
        h.pwrite(b"x" * BLOCK, 8 * MiB)
    h.shutdown()
    with Client(cluster.uri("b")) as client:
        assert client.pread(BLOCK, 0) == b[:BLOCK]
    # A scrub of a member scrubs its group.
    scrub = subprocess.run([harness.starfish_bin(), "scrub", "a", "--admin", cluster.admin, "--json"],
                           capture_output=True, text=True, timeout=60)
    assert scrub.returncode == 0, scrub.stdout + scrub.stderr
    text = subprocess.run([harness.starfish_bin(), "status", "--admin", cluster.admin], capture_output=True,
                          text=True, timeout=30).stdout
    assert "group g" in text, text
    assert cluster.stop() == []


@pytest.mark.time_limit(60)
def test_bad_groups_are_refused_with_the_reason(workdir):
    for group, says in (("g:a,x", "not configured"), ("a:b", "name of a volume"), ("g:a,a", "named twice"),
                        ("g", "expected NAME:VOLUME")):
        result = subprocess.run(
            [harness.starfish_bin(), "host", "--nbd", "127.0.0.1:1", "--admin", "127.0.0.1:2",
             "--element", "e=127.0.0.1:3", "--quorum", "1", "--volume", "a:1MiB", "--volume", "b:1MiB",
             "--group", group], capture_output=True, text=True, timeout=30)
        assert result.returncode != 0 and says in result.stderr, (group, result.stderr)


def stamp(k):
    return STAMP.pack(b"GROUPord", k) + bytes(BLOCK - STAMP.size)


@pytest.mark.time_limit(240)
def test_after_a_disaster_the_far_copy_of_a_group_is_a_prefix_of_one_order(make_cluster, netns_link, workdir):
    link = netns_link(delay_ms=50, loss_pct=0, rate_mbit=10)
    # The far element lags (local-sync: never waited for) behind a thin, then lossy, long link.
    cluster = make_cluster(start=False, volumes=(("a", "8MiB"), ("b", "8MiB")), ack={"far": "local-sync"},
                           far_links={"far": ("8:3", "10Mbit")}, host_extra=["--group", "g:a,b"])
    far_address = harness.place_far_element_behind(cluster, link)
    harness.start_far_behind(cluster, far_address)
    handles = {}
    for name in ("a", "b"):
        handles[name] = nbd.NBD()
        handles[name].connect_uri(cluster.uri(name))
    # One order: write k (to a when k is even, else b) is sent after write k−1 was answered.
    acked = 0
    deadline = time.monotonic() + 4
    raised = False
    while time.monotonic() < deadline and acked < 2 * 8 * MiB // BLOCK:
        if not raised and time.monotonic() > deadline - 2:
            link.command("set --loss 1")
            raised = True
        name = "a" if acked % 2 == 0 else "b"
        handles[name].pwrite(stamp(acked), (acked // 2) * BLOCK)
        acked += 1
    # The disaster: everything but the far site dies at once.
    cluster.host.kill9()
    for name in ("local", "near"):
        cluster.kill_element(name)
    for h in handles.values():
        try:
            h.shutdown()
        except nbd.Error:
            pass
    time.sleep(1.0)  # what is on the wire arrives
    far = cluster.elements["far"]
    far.process.stop(signal.SIGTERM)
    link.command("set --loss 0")
    far.process.start()
    # The far site alone, opened by a new host element with the same volumes and group.
    nbd_port, admin_port = harness.free_port(), harness.free_port()
    survivor = harness.Process("survivor", [
        harness.starfish_bin(), "host", "--nbd", f"{harness.LOCALHOST}:{nbd_port}",
        "--admin", f"{harness.LOCALHOST}:{admin_port}", "--element", f"far={far_address}", "--quorum", "1",
        "--volume", "a:8MiB", "--volume", "b:8MiB", "--group", "g:a,b"], os.path.join(workdir, "survivor.log"))
    survivor.start()
    try:
        harness.wait_listening(survivor, nbd_port)

        # Whole volumes in one read each: 8 MiB takes ~7 s over the 10 Mbit/s link, longer
        # than the heartbeat timeout; the element must not be failed meanwhile.
        def read_all(name):
            with Client(f"nbd://{harness.LOCALHOST}:{nbd_port}/{name}", timeout=60) as client:
                return client.pread(8 * MiB, 0)

        try:
            contents = harness.wait_until(lambda: {n: read_all(n) for n in ("a", "b")}, 60, "the far copy readable")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- survivor log:\n{survivor.log()}\n--- far log:\n{far.process.log()}")
        present = set()
        for k in range(acked):
            data = contents["a" if k % 2 == 0 else "b"]
            offset = (k // 2) * BLOCK
            tag, value = STAMP.unpack_from(data, offset)
            if tag == b"GROUPord":
                assert value == k, f"block of write {k} holds write {value}"
                present.add(k)
        held = len(present)
        print(f"{acked} writes acknowledged in one order; the far copy holds the first {held}")
        assert present == set(range(held)), \
            f"not a prefix: the far copy holds writes up to {max(present)} but misses " \
            f"{sorted(set(range(max(present))) - present)[:10]}"
        assert held > 0
    finally:
        survivor.stop()
