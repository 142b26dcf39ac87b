"""Snapshots (issue 15): `starfish snapshot create/list/delete` with real clients. A snapshot
is compared with `qemu-img compare` against a copy of its volume taken at the same point; it
is exported read-only as VOLUME@NAME; it survives restarts of every process; an element that
was down takes it (and a deletion) when it catches up; a host element killed at each step of
taking or deleting one finishes it on restart. Each check compares the elements' own copies
(`starfish element verify`, which digests every snapshot too)."""

import errno
import json
import os

import pytest

import harness
from harness import MiB, Client, run, starfish_bin
from test_volume_ops import abort_host_at, create, element_copies, listing, restart_everything, volume_cmd


def snapshot_cmd(cluster, *args, check=True):
    return run([starfish_bin(), "snapshot", *args, "--admin", cluster.admin], timeout=60, check=check)


def take(cluster, volume, name, check=True):
    result = snapshot_cmd(cluster, "create", volume, name, "--json", check=check)
    return json.loads(result.stdout) if check else result


def snapshots(cluster):
    doc = json.loads(snapshot_cmd(cluster, "list", "--json").stdout)
    return {s["name"]: s for s in doc["snapshots"]}


def copy_of(cluster, export, path):
    """A raw copy of `export` as it reads now (qemu-img convert over NBD)."""
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", cluster.uri(export), path], timeout=120)
    return path


def same_as(cluster, export, path):
    """`qemu-img compare` of `export` with the raw file `path`: True if identical."""
    result = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", cluster.uri(export), path], check=False, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode == 0


def snapshot_copies(cluster, storage_volume, snapshot_id):
    """Per element (stopped), its copy of the snapshot as `element verify` reports it."""
    return element_copies(cluster, f"{storage_volume}@{snapshot_id}")


def assert_snapshot_identical_everywhere(cluster, storage_volume, snapshot_id):
    cluster.wait_healthy()
    assert not cluster.stop()
    copies = snapshot_copies(cluster, storage_volume, snapshot_id)
    assert all(copies.values()), f"snapshot {snapshot_id} of {storage_volume} is missing on some element: {copies}"
    digests = {name: (c["applied_sequence"], c["digest"]) for name, c in copies.items()}
    assert len(set(digests.values())) == 1, f"the elements' copies of the snapshot differ: {digests}"


def scribble(cluster, export):
    """Change the first 12 MiB of `export` every way: writes, a partial write, a trim."""
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x22 0 4M", "-c", "write -P 0x23 5000 3000",
         "-c", "discard 8M 4M", cluster.uri(export)])


def test_a_snapshot_holds_its_volume_at_one_point_read_only_and_survives_restarts(cluster, workdir):
    doc = create(cluster, "data", "64MiB")
    storage = doc["storage_volume"]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x11 0 16M", "-c", "write -P 0x12 40M 1M", cluster.uri("data")])
    before = copy_of(cluster, "data", os.path.join(workdir, "before.raw"))
    taken = take(cluster, "data", "monday")
    assert taken["name"] == "data@monday" and taken["on_write_quorum"] is True, taken
    assert taken["size_bytes"] == 64 * MiB and taken["taken_at"] > 0, taken
    scribble(cluster, "data")
    assert not same_as(cluster, "data", before), "the volume changed"
    assert same_as(cluster, "data@monday", before), "the snapshot holds the volume as it was"
    # Exported read-only: nbdinfo says so, and a write is refused (EPERM), changing nothing.
    info = json.loads(run(["nbdinfo", "--json", cluster.uri("data@monday")]).stdout)
    assert info["exports"][0]["is_read_only"] is True, info
    refused = run(["qemu-io", "-f", "raw", "-c", "write -P 0x33 0 64k", cluster.uri("data@monday")], check=False)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused
    print(f"qemu-io opening the snapshot to write: {refused.stderr.strip()}")
    # A client that writes anyway (libnbd, not strict) is answered EPERM by the server.
    with Client(cluster.uri("data@monday"), strict=False) as client:
        with pytest.raises(harness.nbd.Error) as error:
            client.pwrite(b"\x33" * 4096, 0)
        assert error.value.errno in (errno.EPERM, "EPERM"), error.value
        for trim in (client.trim, client.zero):
            with pytest.raises(harness.nbd.Error):
                trim(4096, 0)
    listed = snapshots(cluster)
    assert listed["data@monday"]["state"] == "ready" and listed["data@monday"]["volume"] == "data", listed
    # A second snapshot after more writes, of a configured volume too.
    middle = copy_of(cluster, "data", os.path.join(workdir, "middle.raw"))
    take(cluster, "data", "tuesday")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x44 2M 20M", cluster.uri("data")])
    with Client(cluster.uri("vol0")) as client:
        client.pwrite(b"\x55" * 65536, 0)
        client.flush()
    take(cluster, "vol0", "first")
    with Client(cluster.uri("vol0")) as client:
        client.pwrite(b"\x66" * 65536, 0)
        client.flush()
    with Client(cluster.uri("vol0@first")) as client:
        assert client.pread(65536, 0) == b"\x55" * 65536
    restart_everything(cluster)
    assert set(snapshots(cluster)) == {"data@monday", "data@tuesday", "vol0@first"}
    assert same_as(cluster, "data@monday", before) and same_as(cluster, "data@tuesday", middle)
    with Client(cluster.uri("vol0@first")) as client:
        assert client.pread(65536, 0) == b"\x55" * 65536
    assert_snapshot_identical_everywhere(cluster, storage, taken["id"])


def test_bad_snapshot_requests_get_a_clear_error_and_change_nothing(cluster):
    create(cluster, "disk", "8MiB")
    take(cluster, "disk", "s1")
    before = snapshots(cluster)
    for (volume, name), reason in [
        (("disk", "s1"), "has a snapshot named s1"),
        (("nosuch", "s1"), "no volume nosuch"),
        (("disk", "a@b"), "letters, digits"),
        (("disk", ".x"), "reserved"),
    ]:
        result = take(cluster, volume, name, check=False)
        assert result.returncode != 0 and reason in result.stderr, f"{volume} {name}: {result.stderr}"
        print(f"snapshot create {volume} {name}: {result.stderr.strip()}")
    result = snapshot_cmd(cluster, "delete", "disk@nosuch", check=False)
    assert result.returncode != 0 and "no snapshot disk@nosuch" in result.stderr, result.stderr
    result = snapshot_cmd(cluster, "delete", "disk", check=False)
    assert result.returncode != 0 and "VOLUME@NAME" in result.stderr, result.stderr
    # A volume with snapshots is deleted only with them.
    result = volume_cmd(cluster, "delete", "disk", check=False)
    assert result.returncode != 0 and "--with-snapshots" in result.stderr, result.stderr
    print(f"volume delete disk: {result.stderr.strip()}")
    # A snapshot read by a client is not deleted.
    with Client(cluster.uri("disk@s1")) as client:
        client.pread(4096, 0)
        result = snapshot_cmd(cluster, "delete", "disk@s1", check=False)
        assert result.returncode != 0 and "in use" in result.stderr, result.stderr
    # Below the write quorum nothing is taken or deleted.
    cluster.kill_element("near")
    cluster.kill_element("far")
    cluster.wait_status(lambda s: harness.volume_status(s)["mode"] == "read-only", 30, "read-only")
    result = take(cluster, "disk", "late", check=False)
    assert result.returncode != 0 and "write quorum" in result.stderr, result.stderr
    result = snapshot_cmd(cluster, "delete", "disk@s1", check=False)
    assert result.returncode != 0 and "write quorum" in result.stderr, result.stderr
    cluster.restart_element("near")
    cluster.restart_element("far")
    cluster.wait_healthy()
    assert snapshots(cluster) == before
    assert "disk" in listing(cluster)


def test_deleting_snapshots_frees_them_and_a_volume_goes_with_its_snapshots(cluster, workdir):
    doc = create(cluster, "work", "32MiB")
    storage = doc["storage_volume"]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x21 0 16M", cluster.uri("work")])
    first = copy_of(cluster, "work", os.path.join(workdir, "first.raw"))
    a = take(cluster, "work", "a")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x22 0 8M", cluster.uri("work")])
    take(cluster, "work", "b")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x23 4M 8M", cluster.uri("work")])
    # Deleting the newer one: the older one still reads as it was (it read through it).
    gone = json.loads(snapshot_cmd(cluster, "delete", "work@b", "--json").stdout)
    assert gone["deleted"] is True and gone["on_write_quorum"] is True, gone
    assert "work@b" not in snapshots(cluster)
    assert run(["nbdinfo", cluster.uri("work@b")], check=False).returncode != 0, "no longer exported"
    assert same_as(cluster, "work@a", first)
    # The volume goes only with its snapshots, and then they go everywhere.
    deleted = json.loads(volume_cmd(cluster, "delete", "work", "--with-snapshots", "--json").stdout)
    assert deleted["removed_from_live_elements"] is True, deleted
    harness.wait_until(lambda: "work" not in listing(cluster), 30, "the deletion's completion")
    assert snapshots(cluster) == {}
    restart_everything(cluster)
    assert snapshots(cluster) == {}
    cluster.wait_healthy()
    assert not cluster.stop()
    for name, element in cluster.elements.items():
        held = [v["name"] for v in element.verify()["volumes"] if v["name"].startswith(storage)]
        assert held == [], f"element {name} still holds {held}"
    del a


def test_an_element_down_takes_the_snapshot_and_its_deletion_when_it_comes_back(cluster, workdir):
    doc = create(cluster, "far-off", "16MiB")
    storage = doc["storage_volume"]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x31 0 8M", cluster.uri("far-off")])
    cluster.kill_element("far")
    before = copy_of(cluster, "far-off", os.path.join(workdir, "before.raw"))
    kept = take(cluster, "far-off", "kept")
    dropped = take(cluster, "far-off", "dropped")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x32 1M 4M", cluster.uri("far-off")])
    snapshot_cmd(cluster, "delete", "far-off@dropped")
    cluster.restart_element("far")
    cluster.wait_healthy()
    assert same_as(cluster, "far-off@kept", before)
    assert_snapshot_identical_everywhere(cluster, storage, kept["id"])
    # Its deletion reached the element that was down too.
    copies = snapshot_copies(cluster, storage, dropped["id"])
    assert not any(copies.values()), f"a deleted snapshot is still held: {copies}"


@pytest.mark.parametrize("operation", ["snapshot-create", "snapshot-delete"])
def test_a_host_element_killed_at_each_step_finishes_the_snapshot_operation(make_cluster, workdir, operation):
    cluster = make_cluster()
    doc = create(cluster, "crashy", "16MiB")
    storage = doc["storage_volume"]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x41 0 4M", cluster.uri("crashy")])
    before = copy_of(cluster, "crashy", os.path.join(workdir, "before.raw"))
    for step in ["after-intention", "after-record", "before-completion"]:
        name = f"s-{step}"
        if operation == "snapshot-create":
            abort_host_at(cluster, f"snapshot-create:{step}", lambda: take(cluster, "crashy", name, check=False))
            # The new host element sends the pending snapshot's record again, then lists it.
            harness.wait_until(lambda: snapshots(cluster).get(f"crashy@{name}", {}).get("state") == "ready", 30,
                               f"the snapshot taken before a crash {step} to be ready")
            assert same_as(cluster, f"crashy@{name}", before), f"after a crash {step}"
        else:
            take(cluster, "crashy", name)

            def delete_it():
                # The host element was just restarted: the completion of the taking (written
                # with the next group commit) may not have reached the catalog before, and the
                # new host element finishes it first; a deletion meanwhile is refused.
                harness.wait_until(lambda: snapshots(cluster).get(f"crashy@{name}", {}).get("state") == "ready", 30,
                                   "the snapshot to be ready")
                return snapshot_cmd(cluster, "delete", f"crashy@{name}", check=False)

            abort_host_at(cluster, f"snapshot-delete:{step}", delete_it)
            harness.wait_until(lambda: f"crashy@{name}" not in snapshots(cluster), 30, "the deletion's completion")
    ids = {s["id"] for s in snapshots(cluster).values()}
    cluster.wait_healthy()
    assert not cluster.stop()
    for element in cluster.elements.values():
        held = {int(v["name"].rsplit("@", 1)[1]) for v in element.verify()["volumes"]
                if v["name"].startswith(storage + "@")}
        assert held == ids, f"element {element.name} holds snapshots {held}, the catalog lists {ids}"


def test_a_wiped_element_gets_the_snapshots_back_by_full_recovery(make_cluster, workdir):
    """A replaced disk: far comes back with nothing, and neither the write queue nor a peer's
    replay log reaches back to its start: a full recovery rebuilds it, and copies the volume's
    snapshots too (each whole); its copies end identical to the others'."""
    cluster = make_cluster(start=False, host_extra=["--write-queue", "40MiB"])
    for element in cluster.elements.values():
        element.process.args += ["--replay-log", "32MiB"]
    cluster.start()
    doc = create(cluster, "kept", "64MiB")
    storage = doc["storage_volume"]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x51 0 40M", cluster.uri("kept")])
    before = copy_of(cluster, "kept", os.path.join(workdir, "before.raw"))
    one = take(cluster, "kept", "one")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x52 2M 4M", "-c", "discard 12M 2M", cluster.uri("kept")])
    two = take(cluster, "kept", "two")
    # Past every replay log and the write queue.
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x53 0 48M", cluster.uri("kept")])
    cluster.kill_element("far")
    data = cluster.elements["far"].data
    harness.shutil.rmtree(data)
    os.makedirs(data)
    cluster.restart_element("far")

    def far_rebuilt(status):
        far = next(e for e in status["elements"] if e["name"] == "far")
        return far["state"] == "in-sync" and (far.get("last_recovery") or {}).get("kind") == "full"

    cluster.wait_status(far_rebuilt, 90, "far back in sync by full recovery")
    # The elements' own copies (stopped): far's, copied, equal to the others'.
    assert_snapshot_identical_everywhere(cluster, storage, one["id"])
    copies = snapshot_copies(cluster, storage, two["id"])
    assert all(copies.values()) and len({c["digest"] for c in copies.values()}) == 1, copies
    for element in cluster.elements.values():
        element.start()
    cluster.start_host()
    assert same_as(cluster, "kept@one", before)


def test_a_consistency_groups_snapshot_takes_all_its_volumes_at_one_point(make_cluster, workdir):
    """`snapshot create --group G NAME`: one record in the group's one stream, so every
    member's snapshot (`M@NAME`, read-only) is of one point: a writer that writes a counter to
    a, then (acknowledged) the same counter to b, is caught by the snapshot between two
    writes, never with b ahead of a or a two steps ahead of b."""
    cluster = make_cluster(volumes=(("a", "8MiB"), ("b", "5MiB"), ("c", "4MiB")), use_config=True,
                           host_extra=["--group", "g:a,b"])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x61 1M 2M", cluster.uri("a")])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x62 4096 1M", cluster.uri("b")])
    doc, last = harness.during_counter_writes(
        cluster, "a", "b", lambda: json.loads(snapshot_cmd(cluster, "create", "--group", "g", "s1", "--json").stdout))
    assert doc["exports"] == ["a@s1", "b@s1"] and doc["volume"] == "g", doc
    counters = {}
    for member in ("a", "b"):
        with Client(cluster.uri(f"{member}@s1")) as client:
            counters[member] = int.from_bytes(client.pread(4096, 0)[:8], "little")
    print(f"the snapshot holds counter {counters['a']} in a and {counters['b']} in b; the writer reached {last}")
    assert counters["b"] <= counters["a"] <= counters["b"] + 1, f"not one point of the group's stream: {counters}"
    assert 0 < counters["a"] < last, "taken while the writer ran"
    a0 = os.path.join(workdir, "a.raw")
    with Client(cluster.uri("a@s1")) as client:
        image = client.pread(8 * MiB, 0)
    with open(a0, "wb") as f:
        f.write(image)
    assert image[MiB:3 * MiB] == b"\x61" * (2 * MiB)
    info = json.loads(run(["nbdinfo", "--json", cluster.uri("b@s1")]).stdout)
    assert info["exports"][0]["is_read_only"] is True and info["exports"][0]["export-size"] == 5 * MiB, info
    listed = snapshots(cluster)
    assert {n: s.get("group") for n, s in listed.items()} == {"a@s1": "g", "b@s1": "g"}, listed
    # Refused, changing nothing: a member alone, --group of a volume or of nothing, a clone.
    for args, reason in [(["a", "s2"], "--group g"), (["--group", "c", "s2"], "not a consistency group"),
                         (["--group", "nosuch", "s2"], "no consistency group nosuch")]:
        result = snapshot_cmd(cluster, "create", *args, check=False)
        assert result.returncode != 0 and reason in result.stderr, (args, result.stderr)
    result = volume_cmd(cluster, "clone", "a@s1", "copy", check=False)
    assert result.returncode != 0 and "consistency group" in result.stderr, result.stderr
    assert set(snapshots(cluster)) == {"a@s1", "b@s1"}
    restart_everything(cluster)
    assert set(snapshots(cluster)) == {"a@s1", "b@s1"}
    assert same_as(cluster, "a@s1", a0)
    with Client(cluster.uri("b@s1")) as client:
        assert int.from_bytes(client.pread(4096, 0)[:8], "little") == counters["b"]
    # Deleted through either member's name: both go.
    snapshot_cmd(cluster, "delete", "b@s1")
    assert snapshots(cluster) == {}
    assert run(["nbdinfo", cluster.uri("a@s1")], check=False).returncode != 0, "no longer exported"
    # The elements' own copies of a group's snapshot (of its storage volume) agree.
    again = json.loads(snapshot_cmd(cluster, "create", "--group", "g", "s2", "--json").stdout)
    assert_snapshot_identical_everywhere(cluster, "g[a,b]", again["id"])


def test_a_host_element_killed_after_a_group_snapshots_intention_finishes_it(make_cluster):
    cluster = make_cluster(volumes=(("a", "4MiB"), ("b", "4MiB")), use_config=True, host_extra=["--group", "g:a,b"])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x71 0 1M", cluster.uri("a")])
    abort_host_at(cluster, "snapshot-create:after-intention",
                  lambda: snapshot_cmd(cluster, "create", "--group", "g", "s", check=False))
    # The new host element sends the group's pending snapshot record, then exports both.
    harness.wait_until(lambda: {n: s["state"] for n, s in snapshots(cluster).items()} == {"a@s": "ready", "b@s": "ready"},
                       30, "the group's snapshot taken before the crash to be ready")
    with Client(cluster.uri("a@s")) as client:
        assert client.pread(MiB, 0) == b"\x71" * MiB


def test_a_group_snapshots_deletion_finished_at_start_up_refuses_each_members_export_meanwhile(make_cluster):
    """A host element killed after a group snapshot's deletion was logged: the next one finishes
    the deletion, and until then a client asking for a member's `M@NAME` hears why it is
    refused (the deletion is held 3 s after its record by a failpoint)."""
    cluster = make_cluster(volumes=(("a", "4MiB"), ("b", "4MiB")), use_config=True, host_extra=["--group", "g:a,b"])
    snapshot_cmd(cluster, "create", "--group", "g", "s")
    assert {n: s["state"] for n, s in snapshots(cluster).items()} == {"a@s": "ready", "b@s": "ready"}
    cluster.stop_host()
    cluster.host.env = {**os.environ, "STARFISH_FAILPOINT": "snapshot-delete:after-intention"}
    cluster.start_host()
    assert snapshot_cmd(cluster, "delete", "a@s", check=False).returncode != 0, "the host element aborted"
    harness.wait_until(lambda: not cluster.host.alive(), 10, "the host element to abort")

    cluster.host.env = {**os.environ, "STARFISH_FAILPOINT": "snapshot-delete:after-record=sleep(3000)"}
    log_start = os.path.getsize(cluster.host.log_path)

    def paused():
        with open(cluster.host.log_path, "rb") as log:
            log.seek(log_start)
            return b"failpoint: pausing" in log.read()

    cluster.start_host()
    harness.wait_until(paused, 20, "the pending deletion to pause after its record")
    for member in ["a", "b"]:
        refused = run(["qemu-img", "info", "-f", "raw", cluster.uri(f"{member}@s")], check=False)
        assert refused.returncode != 0, refused.stdout
        assert f"snapshot {member}@s is being deleted" in refused.stderr, refused.stderr
    # The members themselves are served meanwhile.
    with Client(cluster.uri("b")) as client:
        assert client.pread(4096, 0) == bytes(4096)
    harness.wait_until(lambda: snapshots(cluster) == {}, 30, "the deletion to complete")
    refused = run(["qemu-img", "info", "-f", "raw", cluster.uri("a@s")], check=False)
    assert refused.returncode != 0 and "being deleted" not in refused.stderr, refused.stderr
