"""Joining a consistency group while running (issue 15): `starfish volume create NAME SIZE
--group G` makes the new volume a window of the group's storage volume, past its members, so
that its writes share the group's one order and the group's snapshots from then on take it
too. It survives restarts of every process; its deletion zeroes its window; a host element
killed at each step of a join or of a member's deletion finishes it when it starts again."""

import json

import pytest

import harness
from harness import MiB, Client, run
from test_snapshots import snapshot_cmd, snapshots
from test_volume_ops import (abort_host_at, assert_identical_everywhere, create, listing, restart_everything,
                             volume_cmd)


def join(cluster, name, size, group="g", check=True):
    result = volume_cmd(cluster, "create", name, size, "--group", group, "--json", check=check)
    return json.loads(result.stdout) if check else result


def exported(cluster):
    return listing(cluster)


def read(cluster, export, offset, length):
    with Client(cluster.uri(export)) as client:
        return client.pread(length, offset)


def group_cluster(make_cluster):
    return make_cluster(volumes=(("a", "8MiB"), ("b", "5MiB"), ("c", "4MiB")), use_config=True,
                        host_extra=["--group", "g:a,b"])


def test_a_volume_joins_a_group_shares_its_order_and_its_snapshots_and_survives_restarts(make_cluster):
    cluster = group_cluster(make_cluster)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x61 0 8M", cluster.uri("a")])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x62 0 5M", cluster.uri("b")])
    doc = join(cluster, "log", "3MiB")
    assert doc["group"] == "g" and doc["storage_volume"] == "g[a,b]" and doc["on_write_quorum"], doc
    listed = exported(cluster)
    assert listed["log"]["group"] == "g" and listed["log"]["size_bytes"] == 3 * MiB, listed["log"]
    info = json.loads(run(["nbdinfo", "--json", cluster.uri("log")]).stdout)
    assert info["exports"][0]["export-size"] == 3 * MiB, info
    # A new member starts empty, and writing it leaves the others as they were.
    assert read(cluster, "log", 0, 3 * MiB) == bytes(3 * MiB)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x6c 0 3M", "-c", "write -P 0x6d 5000 3000", cluster.uri("log")])
    assert read(cluster, "a", 0, 8 * MiB) == b"\x61" * (8 * MiB)
    assert read(cluster, "b", 0, 5 * MiB) == b"\x62" * (5 * MiB)
    # One order: a writer that writes a counter to a, then (acknowledged) to the new member, is
    # caught by the group's snapshot between two writes.
    taken, last = harness.during_counter_writes(
        cluster, "a", "log", lambda: json.loads(snapshot_cmd(cluster, "create", "--group", "g", "s1", "--json").stdout))
    assert sorted(taken["exports"]) == ["a@s1", "b@s1", "log@s1"], taken
    counters = {m: int.from_bytes(read(cluster, f"{m}@s1", 0, 4096)[:8], "little") for m in ("a", "log")}
    print(f"the snapshot holds counter {counters['a']} in a and {counters['log']} in the joined member")
    assert counters["log"] <= counters["a"] <= counters["log"] + 1, f"not one point of the group's order: {counters}"
    assert 0 < counters["a"] < last
    # A second member joins after the snapshot: past it, and not in it.
    join(cluster, "idx", "1MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x69 0 1M", cluster.uri("idx")])
    assert "idx@s1" not in snapshots(cluster)
    assert run(["nbdinfo", cluster.uri("idx@s1")], check=False).returncode != 0
    log_now = read(cluster, "log", 0, 3 * MiB)
    restart_everything(cluster)
    listed = exported(cluster)
    assert listed["log"]["group"] == "g" and listed["idx"]["group"] == "g", listed
    assert read(cluster, "log", 0, 3 * MiB) == log_now
    assert read(cluster, "idx", 0, MiB) == b"\x69" * MiB
    assert read(cluster, "a", 4096, 8 * MiB - 4096) == b"\x61" * (8 * MiB - 4096)
    assert int.from_bytes(read(cluster, "log@s1", 0, 4096)[:8], "little") == counters["log"]
    assert sorted(snapshots(cluster)) == ["a@s1", "b@s1", "log@s1"]
    # Deleting the newest member zeroes its window: one that joins in its place reads zeroes.
    volume_cmd(cluster, "delete", "idx")
    assert "idx" not in exported(cluster)
    join(cluster, "idx2", "1MiB")
    assert read(cluster, "idx2", 0, MiB) == bytes(MiB), "the deleted member's data is gone"
    # Deleting a member a snapshot covers: its snapshot export goes with it; the others stay.
    volume_cmd(cluster, "delete", "log")
    assert sorted(snapshots(cluster)) == ["a@s1", "b@s1"]
    assert "log" not in exported(cluster)
    restart_everything(cluster)
    assert set(exported(cluster)) >= {"a", "b", "c", "idx2"} and "log" not in exported(cluster)
    assert_identical_everywhere(cluster, "g[a,b]")


def test_joining_refuses_what_it_must_and_changes_nothing(make_cluster):
    cluster = group_cluster(make_cluster)
    join(cluster, "log", "1MiB")
    before = exported(cluster)
    for args, reason in [
        (["x", "1MiB", "--group", "nosuch"], "no consistency group nosuch"),
        (["x", "1MiB", "--group", "c"], "no consistency group c"),
        (["a", "1MiB", "--group", "g"], "exists"),
        (["g", "1MiB", "--group", "g"], "exists"),
        (["x", "1000", "--group", "g"], "multiple"),
        (["bad/name", "1MiB", "--group", "g"], "volume name"),
    ]:
        result = volume_cmd(cluster, "create", *args, check=False)
        assert result.returncode != 0 and reason in result.stderr, (args, result.stderr)
    result = volume_cmd(cluster, "resize", "log", "2MiB", check=False)
    assert result.returncode != 0 and "member of consistency group g" in result.stderr, result.stderr
    result = snapshot_cmd(cluster, "create", "log", "s", check=False)
    assert result.returncode != 0 and "--group g" in result.stderr, result.stderr
    assert exported(cluster) == before
    assert snapshots(cluster) == {}


@pytest.mark.parametrize("step", ["volume-create:after-intention", "volume-create:after-add",
                                  "volume-create:before-completion", "volume-delete:after-intention",
                                  "volume-delete:after-remove"])
def test_a_host_element_killed_at_each_step_of_a_join_or_a_members_deletion_finishes_it(make_cluster, step):
    cluster = make_cluster(volumes=(("a", "4MiB"), ("b", "4MiB")), use_config=True, host_extra=["--group", "g:a,b"])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x71 0 4M", cluster.uri("a")])
    if step.startswith("volume-create"):
        abort_host_at(cluster, step, lambda: join(cluster, "log", "2MiB", check=False))
        # Rolled forward: the member is served, empty, and writable.
        harness.wait_until(lambda: exported(cluster).get("log", {}).get("state") == "ready", 30,
                           "the member whose join was logged to be served")
        assert exported(cluster)["log"]["group"] == "g"
        assert read(cluster, "log", 0, 2 * MiB) == bytes(2 * MiB)
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x6c 0 2M", cluster.uri("log")])
    else:
        join(cluster, "log", "2MiB")
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x6c 0 2M", cluster.uri("log")])
        abort_host_at(cluster, step, lambda: volume_cmd(cluster, "delete", "log", check=False))
        harness.wait_until(lambda: "log" not in exported(cluster), 30, "the deletion to be finished")
        # Its window was zeroed again: a member that joins in its place reads zeroes.
        join(cluster, "log2", "2MiB")
        assert read(cluster, "log2", 0, 2 * MiB) == bytes(2 * MiB)
    assert read(cluster, "a", 0, 4 * MiB) == b"\x71" * (4 * MiB)
    assert_identical_everywhere(cluster, "g[a,b]")


def test_an_element_down_during_a_join_catches_up_after_the_host_element_restarts(make_cluster):
    """The element was down while the group grew and the member was written; it comes back
    while the host element restarts. The new host element names the group's storage volume at
    its configured size until it has read the catalog (the element keeps what it holds, and
    cannot take the member's writes yet); then at the grown size: the element grows it and
    catches up, and every element's copy of the group is the same."""
    cluster = group_cluster(make_cluster)
    cluster.kill_element("far")
    join(cluster, "log", "3MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x6c 0 3M", "-c", "write -P 0x61 0 1M", cluster.uri("log")])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x62 0 1M", cluster.uri("a")])
    cluster.stop_host()
    cluster.restart_element("far")
    cluster.start_host()
    cluster.wait_healthy()
    assert read(cluster, "log", MiB, 2 * MiB) == b"\x6c" * (2 * MiB)
    assert_identical_everywhere(cluster, "g[a,b]")
