"""Clones (issue 15): `starfish volume clone VOLUME@NAME NEW` with real clients. A clone reads
as its snapshot (`qemu-img compare` against a copy of the snapshot), diverges with its own
writes while its snapshot and volume stay as they were, costs the elements only what it
writes, can be snapshotted and cloned, keeps its snapshot from being deleted, survives
restarts of every process, reaches an element that was down (which lacks the snapshot, and
gets the clone by full recovery), and a host element killed at each step of making one
finishes it. Each end state is checked on the elements' own copies (`starfish element
verify`)."""

import glob
import json
import os
import shutil

import harness
from harness import MiB, run, starfish_bin
from test_snapshots import copy_of, same_as, snapshots, snapshot_cmd, take
from test_volume_ops import (abort_host_at, assert_identical_everywhere, create, element_copies, listing,
                             restart_everything, volume_cmd)


def clone(cluster, snapshot, name, check=True):
    result = volume_cmd(cluster, "clone", snapshot, name, "--json", check=check)
    return json.loads(result.stdout) if check else result


def data_bytes_on_disk(cluster):
    """Per element, the disk space its volumes' data files take (sparse files: what is held)."""
    return {name: sum(os.stat(path).st_blocks * 512 for path in glob.glob(os.path.join(e.data, "volumes", "*.data")))
            for name, e in cluster.elements.items()}


def expect(path, out, changes):
    """`out`: a copy of the raw file `path` with `changes` applied: (offset, bytes) writes,
    (offset, length) zeroings as a discard reads."""
    shutil.copyfile(path, out)
    with open(out, "r+b") as f:
        for offset, change in changes:
            f.seek(offset)
            f.write(change if isinstance(change, bytes) else bytes(change))
    return out


def test_a_clone_starts_as_its_snapshot_diverges_and_costs_only_what_it_writes(cluster, workdir):
    create(cluster, "base", "64MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x11 0 40M", "-c", "write -P 0x12 50M 1M", cluster.uri("base")])
    take(cluster, "base", "gold")
    gold = copy_of(cluster, "base@gold", os.path.join(workdir, "gold.raw"))
    before = data_bytes_on_disk(cluster)
    doc = clone(cluster, "base@gold", "test")
    assert doc["name"] == "test" and doc["clone_of"] == "base@gold", doc
    assert doc["size_bytes"] == 64 * MiB and doc["on_write_quorum"] is True, doc
    assert same_as(cluster, "test", gold), "a new clone reads as its snapshot"
    grown = {name: data_bytes_on_disk(cluster)[name] - before[name] for name in before}
    print(f"data files grew by {grown} bytes when a clone of 41 MiB of data was made")
    assert all(g < 2 * MiB for g in grown.values()), f"a clone shares its snapshot's blocks: {grown}"
    # The clone diverges; its snapshot and its volume do not see it, nor it theirs.
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x77 4M 4M", "-c", "write -P 0x78 5000 3000",
         "-c", "discard 20M 4M", cluster.uri("test")])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x99 0 8M", cluster.uri("base")])
    expected = expect(gold, os.path.join(workdir, "test.raw"),
                      [(4 * MiB, b"\x77" * (4 * MiB)), (5000, b"\x78" * 3000), (20 * MiB, bytearray(4 * MiB))])
    assert same_as(cluster, "test", expected), "the clone holds its snapshot with its own writes"
    assert same_as(cluster, "base@gold", gold), "the snapshot does not change"
    assert not same_as(cluster, "base", gold) and not same_as(cluster, "base", expected)
    written = {name: data_bytes_on_disk(cluster)[name] - before[name] for name in before}
    print(f"after 4 MiB written to the clone and 8 MiB to its volume: data files grew by {written} bytes")
    assert all(w < 24 * MiB for w in written.values()), f"the clone holds only what it wrote: {written}"
    assert listing(cluster)["test"]["clone_of"] == "base@gold"
    assert snapshots(cluster)["base@gold"]["clones"] == ["test"]
    # A snapshot with clones stays, and so does its volume.
    refused = snapshot_cmd(cluster, "delete", "base@gold", check=False)
    assert refused.returncode != 0 and "clone" in refused.stderr and "test" in refused.stderr, refused.stderr
    refused = volume_cmd(cluster, "delete", "base", "--with-snapshots", check=False)
    assert refused.returncode != 0 and "test" in refused.stderr, refused.stderr
    # A clone's snapshot, and a clone of that.
    take(cluster, "test", "t1")
    clone(cluster, "test@t1", "test2")
    assert same_as(cluster, "test2", expected)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x55 0 1M", cluster.uri("test2")])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x66 30M 1M", cluster.uri("test")])
    expected2 = expect(expected, os.path.join(workdir, "test2.raw"), [(0, b"\x55" * MiB)])
    expected = expect(expected, os.path.join(workdir, "test-b.raw"), [(30 * MiB, b"\x66" * MiB)])
    assert same_as(cluster, "test2", expected2) and same_as(cluster, "test", expected)
    # A clone grows like any volume: past its snapshot's end it reads zeroes.
    volume_cmd(cluster, "resize", "test2", "96MiB")
    expected2 = expect(expected2, os.path.join(workdir, "test2-grown.raw"), [(64 * MiB, bytearray(32 * MiB))])
    assert same_as(cluster, "test2", expected2)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x56 70M 1M", cluster.uri("test2")])
    expected2 = expect(expected2, os.path.join(workdir, "test2-b.raw"), [(70 * MiB, b"\x56" * MiB)])
    restart_everything(cluster)
    assert same_as(cluster, "test", expected) and same_as(cluster, "test2", expected2)
    assert same_as(cluster, "base@gold", gold)
    storage = listing(cluster)["test"]["storage_volume"]
    # The elements' own copies of the clone agree (one shares its snapshot's blocks as much as
    # the next).
    assert_identical_everywhere(cluster, storage)


def test_bad_clone_requests_get_a_clear_error_and_change_nothing_and_clones_go_before_their_snapshot(cluster):
    create(cluster, "src", "8MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x21 0 2M", cluster.uri("src")])
    take(cluster, "src", "s1")
    before = listing(cluster)
    for (snapshot, name), reason in [
        (("src@nosuch", "c1"), "no snapshot src@nosuch"),
        (("nosuch@s1", "c1"), "no snapshot nosuch@s1"),
        (("src", "c1"), "VOLUME@NAME"),
        (("src@s1", "src"), "exists"),
        (("src@s1", "vol0"), "exists"),
        (("src@s1", "bad/name"), "letters"),
    ]:
        result = clone(cluster, snapshot, name, check=False)
        assert result.returncode != 0 and reason in result.stderr, (snapshot, name, result.stderr)
        print(f"clone {snapshot} {name}: {result.stderr.strip().splitlines()[-1]}")
    assert listing(cluster) == before, "nothing changed"
    # A clone of a configured volume's snapshot, too; the snapshot goes once its clone went.
    take(cluster, "vol0", "v1")
    clone(cluster, "vol0@v1", "from-vol0")
    clone(cluster, "src@s1", "c1")
    for snapshot, holder in [("src@s1", "c1"), ("vol0@v1", "from-vol0")]:
        refused = snapshot_cmd(cluster, "delete", snapshot, check=False)
        assert refused.returncode != 0 and holder in refused.stderr, refused.stderr
        volume_cmd(cluster, "delete", holder)
        harness.wait_until(lambda: holder not in listing(cluster), 30, f"{holder}'s deletion")
        snapshot_cmd(cluster, "delete", snapshot)
    assert snapshots(cluster) == {}
    volume_cmd(cluster, "delete", "src")


def test_an_element_down_when_the_clone_is_made_gets_it_by_full_recovery(cluster, workdir):
    create(cluster, "origin", "32MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x31 0 16M", cluster.uri("origin")])
    # far misses the snapshot and the clone: coming back, it has not taken the snapshot when
    # the host element's hello names the clone, so it creates it empty for a full recovery.
    cluster.kill_element("far")
    take(cluster, "origin", "snap")
    gold = copy_of(cluster, "origin@snap", os.path.join(workdir, "gold.raw"))
    doc = clone(cluster, "origin@snap", "copy")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x32 1M 2M", cluster.uri("copy")])
    expected = expect(gold, os.path.join(workdir, "copy.raw"), [(MiB, b"\x32" * (2 * MiB))])
    # The copy's sources restart first: they know the clone from their own storage then, not
    # from the host element's creation.
    for name in ("local", "near"):
        cluster.kill_element(name)
        cluster.restart_element(name)

        def in_sync(status, name=name):
            return next(e for e in status["elements"] if e["name"] == name)["state"] == "in-sync"

        cluster.wait_status(in_sync, 60, f"{name} back in sync")
    cluster.restart_element("far")

    def far_copied(status):
        far = next(e for e in status["elements"] if e["name"] == "far")
        return far["state"] == "in-sync" and (far.get("last_recovery") or {}).get("kind") == "full"

    cluster.wait_status(far_copied, 60, "far back in sync, the clone copied by a full recovery")
    assert same_as(cluster, "copy", expected)
    assert_identical_everywhere(cluster, doc["storage_volume"])


def test_a_host_element_killed_at_each_step_of_a_clone_finishes_it(make_cluster, workdir):
    cluster = make_cluster()
    create(cluster, "crashy", "16MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x41 0 4M", cluster.uri("crashy")])
    take(cluster, "crashy", "s")
    gold = copy_of(cluster, "crashy@s", os.path.join(workdir, "gold.raw"))
    made = []
    for step in ["after-intention", "after-add", "before-completion"]:
        name = f"c-{step}"
        abort_host_at(cluster, f"volume-create:{step}", lambda: clone(cluster, "crashy@s", name, check=False))
        # The new host element finishes the logged clone (its hellos create it): all or nothing.
        harness.wait_until(lambda: listing(cluster).get(name, {}).get("state") == "ready", 30,
                           f"the clone made before a crash {step}")
        assert listing(cluster)[name]["clone_of"] == "crashy@s"
        assert same_as(cluster, name, gold), f"after a crash {step}"
        made.append(listing(cluster)[name]["storage_volume"])
    assert snapshots(cluster)["crashy@s"]["clones"] == [f"c-{s}" for s in
                                                        ["after-intention", "after-add", "before-completion"]]
    cluster.wait_healthy()
    assert not cluster.stop()
    for storage in made:
        copies = element_copies(cluster, storage)
        assert all(copies.values()), f"{storage} is missing on some element: {copies}"
        assert len({(c["applied_sequence"], c["digest"]) for c in copies.values()}) == 1, copies
