"""Volumes created while the cluster runs (issue 15): `starfish volume create`, `delete`,
`resize` and `list` with real clients, restarts of every process, bad requests, and kill -9
of the host element at each step of each operation (the intention log rolls it forward) and
of an element in the middle. Each check compares the elements' own copies (`starfish element
verify`)."""

import json
import os
import signal
import subprocess

import pytest

import harness
from harness import MiB, Client, run, starfish_bin

PATTERN_OFFSET = 3 * MiB


def volume_cmd(cluster, *args, check=True):
    return run([starfish_bin(), "volume", *args, "--admin", cluster.admin], timeout=60, check=check)


def create(cluster, name, size, check=True):
    result = volume_cmd(cluster, "create", name, size, "--json", check=check)
    return json.loads(result.stdout) if check else result


def listing(cluster):
    doc = json.loads(volume_cmd(cluster, "list", "--json").stdout)
    return {v["name"]: v for v in doc["volumes"]}


def abort_host_at(cluster, failpoint, operation):
    """Restart the host element with `STARFISH_FAILPOINT=failpoint`, run `operation` (which
    must fail: the host element aborts mid-way), wait for the abort, and start the host
    element again without the failpoint."""
    cluster.stop_host()
    cluster.host.env = {**os.environ, "STARFISH_FAILPOINT": failpoint}
    cluster.start_host()
    result = operation()
    assert result.returncode != 0, f"the host element aborted at {failpoint}"
    harness.wait_until(lambda: not cluster.host.alive(), 10, "the host element to abort")
    cluster.host.env = None
    cluster.start_host()


def write_pattern(cluster, name, seed):
    data = harness.random_bytes(256 * 1024, seed)
    with Client(cluster.uri(name)) as client:
        client.pwrite(data, PATTERN_OFFSET)
        client.flush()
    return data


def read_pattern(cluster, name, length):
    with Client(cluster.uri(name)) as client:
        return client.pread(length, PATTERN_OFFSET)


def restart_everything(cluster):
    assert not cluster.stop(), "every process stops cleanly"
    for element in cluster.elements.values():
        element.start()
    cluster.start_host()


def element_copies(cluster, storage_volume):
    """Per element (stopped), its copy of `storage_volume` as `element verify` reports it
    (None: it holds no such volume)."""
    copies = {}
    for name, element in cluster.elements.items():
        report = element.verify()
        found = [v for v in report["volumes"] if v["name"] == storage_volume]
        copies[name] = found[0] if found else None
    return copies


def assert_identical_everywhere(cluster, storage_volume):
    # Level, not only in sync: an in-sync element may still be applying the last writes
    # (acknowledged once a quorum had them), and a stopping host element does not wait for it.
    def level(status):
        applied = [e["applied_sequence"].get(storage_volume) for e in status["elements"]]
        return harness.healthy(status) and None not in applied and len(set(applied)) == 1

    cluster.wait_status(level, harness.START_TIMEOUT, f"every element in sync and level on {storage_volume}")
    assert not cluster.stop()
    copies = element_copies(cluster, storage_volume)
    assert all(copies.values()), f"{storage_volume} is missing on some element: {copies}"
    digests = {name: (c["applied_sequence"], c["digest"]) for name, c in copies.items()}
    assert len(set(digests.values())) == 1, f"the elements' copies of {storage_volume} differ: {digests}"


def test_create_write_list_and_survive_restarts_of_every_process(cluster):
    doc = create(cluster, "disk1", "64MiB")
    assert doc["name"] == "disk1" and doc["size_bytes"] == 64 * MiB
    assert doc["on_write_quorum"] is True
    storage = doc["storage_volume"]
    assert storage.startswith("disk1#"), doc
    volumes = listing(cluster)
    assert volumes["vol0"]["origin"] == "configured"
    assert volumes["disk1"]["origin"] == "created" and volumes["disk1"]["state"] == "ready"
    # Exported at once, to real clients: nbdinfo lists it, qemu-io writes and reads it.
    exports = run(["nbdinfo", "--list", "--json", f"nbd://{harness.LOCALHOST}:{cluster.nbd_port}"]).stdout
    assert "disk1" in [e["export-name"] for e in json.loads(exports)["exports"]]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x5c 1M 2M", cluster.uri("disk1")])
    data = write_pattern(cluster, "disk1", 1)
    assert read_pattern(cluster, "disk1", len(data)) == data
    # vol0 is untouched by it.
    with Client(cluster.uri("vol0")) as client:
        assert client.pread(4096, PATTERN_OFFSET) == bytes(4096)
    restart_everything(cluster)
    volumes = listing(cluster)
    assert volumes["disk1"]["storage_volume"] == storage and volumes["disk1"]["size_bytes"] == 64 * MiB
    assert read_pattern(cluster, "disk1", len(data)) == data
    run(["qemu-io", "-f", "raw", "-c", "read -P 0x5c 1M 2M", cluster.uri("disk1")])
    # A second volume after the restart, listed with the first.
    create(cluster, "disk2", "8MiB")
    assert set(listing(cluster)) == {"vol0", "disk1", "disk2"}
    assert_identical_everywhere(cluster, storage)


def test_bad_requests_get_a_clear_error_and_change_nothing(cluster):
    create(cluster, "taken", "4MiB")
    before = listing(cluster)
    cases = [
        (("vol0", "4MiB"), "exists"),
        (("taken", "4MiB"), "exists"),
        (("zero", "0"), "positive multiple"),
        (("odd", "1000"), "positive multiple"),
        (("half", "6144"), "positive multiple"),
        ((".hidden", "4MiB"), "reserved"),
        (("a#b", "4MiB"), "letters, digits"),
        (("huge", "15TiB"), "element"),
    ]
    for (name, size), reason in cases:
        result = create(cluster, name, size, check=False)
        assert result.returncode != 0, f"{name} {size} was accepted"
        assert reason in result.stderr, f"{name} {size}: {result.stderr}"
        print(f"volume create {name} {size}: {result.stderr.strip()}")
    result = volume_cmd(cluster, "create", "grouped", "4MiB", "--group", "g", check=False)
    assert result.returncode != 0 and "no consistency group g" in result.stderr, result.stderr
    # Below the write quorum the cluster is read-only: no volume is created.
    cluster.kill_element("near")
    cluster.kill_element("far")
    cluster.wait_status(lambda s: harness.volume_status(s)["mode"] == "read-only", 30, "read-only")
    result = create(cluster, "late", "4MiB", check=False)
    assert result.returncode != 0 and "write quorum" in result.stderr, result.stderr
    # Nor deleted, nor resized (checked here, where the cluster is read-only already).
    result = volume_cmd(cluster, "delete", "taken", check=False)
    assert result.returncode != 0 and "write quorum" in result.stderr, result.stderr
    print(f"volume delete taken (read-only): {result.stderr.strip()}")
    result = volume_cmd(cluster, "resize", "taken", "8MiB", check=False)
    assert result.returncode != 0 and "write quorum" in result.stderr, result.stderr
    print(f"volume resize taken (read-only): {result.stderr.strip()}")
    cluster.restart_element("near")
    cluster.restart_element("far")
    cluster.wait_healthy()
    assert listing(cluster) == before


def test_an_element_down_during_a_creation_gets_the_volume_when_it_comes_back(cluster):
    cluster.kill_element("far")
    doc = create(cluster, "while-far-down", "16MiB")
    data = write_pattern(cluster, "while-far-down", 2)
    cluster.restart_element("far")
    cluster.wait_healthy()
    assert read_pattern(cluster, "while-far-down", len(data)) == data
    assert_identical_everywhere(cluster, doc["storage_volume"])


@pytest.mark.parametrize("step", ["after-intention", "after-add", "before-completion"])
def test_a_host_element_killed_at_each_step_of_a_creation_rolls_it_forward(make_cluster, step):
    cluster = make_cluster()
    abort_host_at(cluster, f"volume-create:{step}", lambda: create(cluster, "crashy", "16MiB", check=False))
    # The intention was logged before anything was done: the new host element finished it.
    volumes = listing(cluster)
    assert "crashy" in volumes, f"after a crash {step}, the creation was lost: {volumes}"
    data = write_pattern(cluster, "crashy", 3)
    assert read_pattern(cluster, "crashy", len(data)) == data
    assert "crashy#" in volumes["crashy"]["storage_volume"]
    assert_identical_everywhere(cluster, volumes["crashy"]["storage_volume"])


def test_without_the_intention_log_a_crash_before_the_completion_leaves_an_orphan(make_cluster):
    """What the intention log is for (the paper's NONE policy): executed, then the host
    element dies before the completion is written — the volume exists on the elements, and
    no catalog names it."""
    cluster = make_cluster(host_extra=["--intention-log", "none"])
    abort_host_at(cluster, "volume-create:before-completion", lambda: create(cluster, "orphan", "16MiB", check=False))
    assert "orphan" not in listing(cluster)
    assert not cluster.stop()
    copies = element_copies(cluster, next(iter(orphans(cluster))))
    assert any(copies.values()), "the orphan is on the elements"


def orphans(cluster):
    names = set()
    for element in cluster.elements.values():
        for v in element.verify()["volumes"]:
            if v["name"].startswith("orphan#"):
                names.add(v["name"])
    assert names, "no element holds the orphaned volume"
    return names


# ----- deletion -----------------------------------------------------------------------------


def delete(cluster, name, check=True):
    result = volume_cmd(cluster, "delete", name, "--json", check=check)
    return json.loads(result.stdout) if check else result


def volume_files_bytes(element):
    """Bytes allocated on disk by the element's volume files (data and block maps)."""
    total = 0
    volumes = os.path.join(element.data, "volumes")
    for entry in os.listdir(volumes):
        total += os.stat(os.path.join(volumes, entry)).st_blocks * 512
    return total


def holders(cluster, storage_volume):
    """The elements (stopped) that hold `storage_volume`."""
    return {name for name, copy in element_copies(cluster, storage_volume).items() if copy}


def exported(cluster):
    listing_json = run(["nbdinfo", "--list", "--json", f"nbd://{harness.LOCALHOST}:{cluster.nbd_port}"]).stdout
    return [e["export-name"] for e in json.loads(listing_json)["exports"]]


def test_delete_stops_exporting_frees_the_space_and_survives_restarts(cluster):
    doc = create(cluster, "scratch", "64MiB")
    storage = doc["storage_volume"]
    # 32 MiB written, so the space it frees is plain to see.
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x6d 0 32M", cluster.uri("scratch")])
    with Client(cluster.uri("vol0")) as client:
        client.pwrite(b"\x42" * 4096, PATTERN_OFFSET)
        client.flush()
    # Answered once a write quorum held it: the third element may still be applying it.
    harness.wait_until(lambda: all(volume_files_bytes(e) >= 32 * MiB for e in cluster.elements.values()), 30,
                       "every element to hold what was written")
    before = {name: volume_files_bytes(e) for name, e in cluster.elements.items()}
    gone = delete(cluster, "scratch")
    assert gone["storage_volume"] == storage, gone
    assert gone["removed_from_live_elements"] is True, gone
    # All three elements are up: it is removed everywhere at once (or, if one was briefly
    # out of sync when asked, as soon as it answers), and the listing drops it then.
    harness.wait_until(lambda: "scratch" not in listing(cluster), 30, "the deletion's completion")
    assert "scratch" not in exported(cluster)
    # A client asking for it now is turned away by the handshake.
    refused = run(["nbdinfo", cluster.uri("scratch")], check=False)
    assert refused.returncode != 0
    after = {name: volume_files_bytes(e) for name, e in cluster.elements.items()}
    for name in cluster.elements:
        freed = before[name] - after[name]
        print(f"element {name}: volume files {before[name] // MiB} MiB -> {after[name] // MiB} MiB")
        assert freed >= 30 * MiB, f"element {name} freed only {freed} bytes"
    # The other volume is untouched, and everything survives restarts of every process.
    restart_everything(cluster)
    assert "scratch" not in listing(cluster) and "scratch" not in exported(cluster)
    with Client(cluster.uri("vol0")) as client:
        assert client.pread(4096, PATTERN_OFFSET) == b"\x42" * 4096
    # The name can be taken again: a new, empty volume (another storage volume).
    again = create(cluster, "scratch", "64MiB")
    assert again["storage_volume"] != storage
    with Client(cluster.uri("scratch")) as client:
        assert client.pread(1 * MiB, 0) == bytes(1 * MiB)
    cluster.wait_healthy()
    assert not cluster.stop()
    assert holders(cluster, storage) == set(), "no element holds the deleted volume"


def test_delete_refuses_what_it_must_and_changes_nothing(cluster):
    create(cluster, "kept", "8MiB")
    before = listing(cluster)
    cases = [
        ("vol0", "declared in the configuration"),
        ("nothing", "no volume nothing"),
    ]
    for name, reason in cases:
        result = delete(cluster, name, check=False)
        assert result.returncode != 0 and reason in result.stderr, f"{name}: {result.stderr}"
        print(f"volume delete {name}: {result.stderr.strip()}")
    # In use: an NBD client is connected to it.
    with Client(cluster.uri("kept")) as client:
        result = delete(cluster, "kept", check=False)
        assert result.returncode != 0 and "in use" in result.stderr, result.stderr
        print(f"volume delete kept (in use): {result.stderr.strip()}")
        client.pwrite(b"\x11" * 4096, 0)
    # Below the write quorum: see test_bad_requests_get_a_clear_error_and_change_nothing.
    assert listing(cluster) == before
    with Client(cluster.uri("kept")) as client:
        assert client.pread(4096, 0) == b"\x11" * 4096


def test_an_element_down_during_a_deletion_frees_it_when_it_comes_back(cluster):
    doc = create(cluster, "ephemeral", "16MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x21 0 8M", cluster.uri("ephemeral")])
    cluster.kill_element("far")
    gone = delete(cluster, "ephemeral")
    assert gone["removed_from_live_elements"] is True and gone["removed_everywhere"] is False, gone
    state = listing(cluster)["ephemeral"]["state"]
    assert state.startswith("deleting"), state
    cluster.restart_element("far")
    cluster.wait_healthy()
    harness.wait_until(lambda: "ephemeral" not in listing(cluster), 30, "the deletion's completion")
    assert not cluster.stop()
    assert holders(cluster, doc["storage_volume"]) == set()


@pytest.mark.parametrize("step", ["after-intention", "after-remove", "before-completion"])
def test_a_host_element_killed_at_each_step_of_a_deletion_rolls_it_forward(make_cluster, step):
    cluster = make_cluster()
    doc = create(cluster, "doomed", "16MiB")
    write_pattern(cluster, "doomed", 4)

    def operation():
        assert "doomed" in listing(cluster)
        return delete(cluster, "doomed", check=False)

    abort_host_at(cluster, f"volume-delete:{step}", operation)
    # The intention was logged before anything was done: the new host element finished it,
    # on every element.
    harness.wait_until(lambda: "doomed" not in listing(cluster), 30, "the deletion to be finished")
    assert "doomed" not in exported(cluster)
    cluster.wait_healthy()
    assert not cluster.stop()
    assert holders(cluster, doc["storage_volume"]) == set(), f"after a crash {step}"


# ----- resize -------------------------------------------------------------------------------


def resize(cluster, name, size, check=True):
    result = volume_cmd(cluster, "resize", name, size, "--json", check=check)
    return json.loads(result.stdout) if check else result


def nbd_size(cluster, name):
    return int(run(["nbdinfo", "--size", cluster.uri(name)]).stdout)


def test_resize_grows_a_volume_in_use_keeps_its_data_and_survives_restarts(cluster):
    doc = create(cluster, "growing", "16MiB")
    storage = doc["storage_volume"]
    data = write_pattern(cluster, "growing", 5)
    # Grown while a client is connected and writing: allowed; that client keeps its size.
    with Client(cluster.uri("growing")) as client:
        grown = resize(cluster, "growing", "48MiB")
        assert grown["size_bytes"] == 48 * MiB and grown["on_write_quorum"] is True, grown
        assert grown["storage_volume"] == storage, grown
        client.pwrite(b"\x77" * 4096, 8 * MiB)
        client.flush()
    # A client that connects now sees the new size; the new blocks read as zeroes and take
    # writes, across the old end too.
    assert nbd_size(cluster, "growing") == 48 * MiB
    assert listing(cluster)["growing"]["size_bytes"] == 48 * MiB
    assert listing(cluster)["growing"]["state"] == "ready"
    run(["qemu-io", "-f", "raw", "-c", "read -P 0 16M 32M", cluster.uri("growing")])
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x3e 15M 2M", "-c", "write -P 0x3f 47M 1M", cluster.uri("growing")])
    assert read_pattern(cluster, "growing", len(data)) == data
    # It grows again, and everything survives restarts of every process.
    resize(cluster, "growing", "64MiB")
    restart_everything(cluster)
    assert nbd_size(cluster, "growing") == 64 * MiB
    assert listing(cluster)["growing"]["size_bytes"] == 64 * MiB
    assert read_pattern(cluster, "growing", len(data)) == data
    run(["qemu-io", "-f", "raw", "-c", "read -P 0x77 8M 4k", "-c", "read -P 0x3e 15M 2M", "-c", "read -P 0x3f 47M 1M",
         "-c", "read -P 0 48M 16M", cluster.uri("growing")])
    assert_identical_everywhere(cluster, storage)


def test_resize_refuses_what_it_must_and_changes_nothing(cluster):
    create(cluster, "fixed", "8MiB")
    before = listing(cluster)
    cases = [
        (("vol0", "1GiB"), "declared in the configuration"),
        (("nothing", "1GiB"), "no volume nothing"),
        (("fixed", "4MiB"), "pass --shrink"),
        (("fixed", "8MiB"), "already"),
        (("fixed", "10000"), "positive multiple"),
        (("fixed", "15TiB"), "element"),
    ]
    for (name, size), reason in cases:
        result = resize(cluster, name, size, check=False)
        assert result.returncode != 0 and reason in result.stderr, f"{name} {size}: {result.stderr}"
        print(f"volume resize {name} {size}: {result.stderr.strip()}")
    result = volume_cmd(cluster, "resize", "fixed", "16MiB", "--shrink", check=False)
    assert result.returncode != 0 and "--shrink asks for fewer bytes" in result.stderr, result.stderr
    with Client(cluster.uri("fixed")):
        result = volume_cmd(cluster, "resize", "fixed", "4MiB", "--shrink", check=False)
        assert result.returncode != 0 and "in use by 1 NBD connection" in result.stderr, result.stderr
        print(f"volume resize fixed 4MiB --shrink (in use): {result.stderr.strip()}")
    assert listing(cluster) == before
    assert nbd_size(cluster, "fixed") == 8 * MiB


def test_an_element_down_during_a_resize_grows_it_when_it_comes_back(cluster):
    doc = create(cluster, "stretch", "16MiB")
    cluster.kill_element("far")
    resize(cluster, "stretch", "40MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x52 30M 4M", cluster.uri("stretch")])
    cluster.restart_element("far")
    cluster.wait_healthy()
    run(["qemu-io", "-f", "raw", "-c", "read -P 0x52 30M 4M", cluster.uri("stretch")])
    assert_identical_everywhere(cluster, doc["storage_volume"])


@pytest.mark.parametrize("step", ["after-intention", "after-resize", "before-completion"])
def test_a_host_element_killed_at_each_step_of_a_resize_rolls_it_forward(make_cluster, step):
    cluster = make_cluster()
    doc = create(cluster, "elastic", "16MiB")
    data = write_pattern(cluster, "elastic", 6)
    abort_host_at(cluster, f"volume-resize:{step}", lambda: resize(cluster, "elastic", "32MiB", check=False))
    # The intention was logged before anything was done: the new host element finished it,
    # and every element grew the volume.
    volumes = listing(cluster)
    assert volumes["elastic"]["size_bytes"] == 32 * MiB, f"after a crash {step}: {volumes['elastic']}"
    assert nbd_size(cluster, "elastic") == 32 * MiB
    assert read_pattern(cluster, "elastic", len(data)) == data
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x29 24M 8M", "-c", "read -P 0x29 24M 8M", cluster.uri("elastic")])
    assert_identical_everywhere(cluster, doc["storage_volume"])


def test_a_configured_volume_grows_when_the_host_element_restarts_with_a_larger_size(cluster):
    """What `volume resize` tells an operator to do for a configured volume: the elements grow
    it when the new host element's hello names the larger size."""
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x4c 1023M 1M", cluster.uri("vol0")])
    cluster.stop_host()
    cluster.volumes = [("vol0", "1536MiB")]
    cluster.host.args = [str(a) for a in cluster.host_args()]
    cluster.start_host()
    assert nbd_size(cluster, "vol0") == 1536 * MiB
    run(["qemu-io", "-f", "raw", "-c", "read -P 0x4c 1023M 1M", "-c", "read -P 0 1024M 8M",
         "-c", "write -P 0x4d 1535M 1M", "-c", "read -P 0x4d 1535M 1M", cluster.uri("vol0")])
    # A smaller size later is refused by every element: the volume stays as it is.
    cluster.stop_host()
    cluster.volumes = [("vol0", "1GiB")]
    cluster.host.args = [str(a) for a in cluster.host_args()]
    cluster.start_host(ready=False)
    harness.wait_until(lambda: harness.volume_status(cluster.status())["mode"] != "starting", 30, "a start-up decision")
    print("vol0 at a smaller size:", harness.volume_status(cluster.status()))
    assert harness.volume_status(cluster.status())["mode"] != "read-write"
    cluster.stop_host()
    cluster.volumes = [("vol0", "1536MiB")]
    cluster.host.args = [str(a) for a in cluster.host_args()]
    cluster.start_host()
    run(["qemu-io", "-f", "raw", "-c", "read -P 0x4d 1535M 1M", cluster.uri("vol0")])
    assert_identical_everywhere(cluster, "vol0")


# ----- shrink -------------------------------------------------------------------------------


def shrink(cluster, name, size, check=True):
    result = volume_cmd(cluster, "resize", name, size, "--shrink", "--json", check=check)
    return json.loads(result.stdout) if check else result


def test_shrink_zeroes_what_lies_past_the_new_end_frees_it_and_a_grow_back_reads_zeroes(cluster):
    doc = create(cluster, "shrinking", "64MiB")
    storage = doc["storage_volume"]
    data = write_pattern(cluster, "shrinking", 7)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x5a 32M 32M", cluster.uri("shrinking")])
    # The write was answered once a write quorum held it: the third element may still be
    # applying it.
    harness.wait_until(lambda: all(volume_files_bytes(e) >= 32 * MiB for e in cluster.elements.values()), 30,
                       "every element to hold what was written")
    before = {name: volume_files_bytes(e) for name, e in cluster.elements.items()}
    shrunk = shrink(cluster, "shrinking", "32MiB")
    assert shrunk["size_bytes"] == 32 * MiB and shrunk["on_write_quorum"] is True, shrunk
    # Clients that connect now see the new size; the data before the new end is kept.
    assert nbd_size(cluster, "shrinking") == 32 * MiB
    listed = listing(cluster)["shrinking"]
    assert (listed["size_bytes"], listed["storage_bytes"], listed["state"]) == (32 * MiB, 64 * MiB, "ready"), listed
    assert read_pattern(cluster, "shrinking", len(data)) == data
    # What lay past the new end was zeroed on every element: its space is freed.
    def freed():
        after = {name: volume_files_bytes(e) for name, e in cluster.elements.items()}
        return {name: (before[name] - after[name]) // MiB for name in before}
    harness.wait_until(lambda: all(f >= 24 for f in freed().values()), 30, "the tail's space to be freed")
    print(f"MiB freed per element by the shrink: {freed()}")
    # Grown back within its storage volume: the old tail reads as zeroes, not as what was
    # there before the shrink. Then grown past it.
    grown = resize(cluster, "shrinking", "48MiB")
    assert grown["size_bytes"] == 48 * MiB and grown["on_write_quorum"] is True, grown
    run(["qemu-io", "-f", "raw", "-c", "read -P 0 32M 16M", cluster.uri("shrinking")])
    resize(cluster, "shrinking", "80MiB")
    run(["qemu-io", "-f", "raw", "-c", "read -P 0 32M 48M", "-c", "write -P 0x61 70M 1M", cluster.uri("shrinking")])
    listed = listing(cluster)["shrinking"]
    assert (listed["size_bytes"], listed["storage_bytes"]) == (80 * MiB, 80 * MiB), listed
    # Shrunk again, and everything survives restarts of every process at the shrunk size.
    shrink(cluster, "shrinking", "16MiB")
    restart_everything(cluster)
    assert nbd_size(cluster, "shrinking") == 16 * MiB
    listed = listing(cluster)["shrinking"]
    assert (listed["size_bytes"], listed["storage_bytes"]) == (16 * MiB, 80 * MiB), listed
    table = volume_cmd(cluster, "list").stdout.splitlines()
    row = next(line.split() for line in table if line.startswith("shrinking "))
    assert row[1:3] == ["16.0MiB", "80.0MiB"], table
    assert read_pattern(cluster, "shrinking", len(data)) == data
    resize(cluster, "shrinking", "80MiB")
    run(["qemu-io", "-f", "raw", "-c", "read -P 0 16M 64M", cluster.uri("shrinking")])
    assert_identical_everywhere(cluster, storage)


def test_an_element_down_during_a_shrink_gets_the_zeroing_when_it_comes_back(cluster):
    doc = create(cluster, "narrow", "32MiB")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x33 0 32M", cluster.uri("narrow")])
    cluster.kill_element("far")
    shrink(cluster, "narrow", "8MiB")
    cluster.restart_element("far")
    cluster.wait_healthy()
    # Only far is in sync with near down: it must hold the zeroing too.
    cluster.kill_element("near")
    resize(cluster, "narrow", "32MiB")
    run(["qemu-io", "-f", "raw", "-c", "read -P 0x33 0 8M", "-c", "read -P 0 8M 24M", cluster.uri("narrow")])
    cluster.restart_element("near")
    assert_identical_everywhere(cluster, doc["storage_volume"])


def test_a_shrink_or_a_deletion_under_way_refuses_new_clients_and_says_why(make_cluster):
    """Between a shrink's or a deletion's (of a volume or a snapshot) check that no client is
    connected and its answer, no client gets in: one could write past the new end, or use an
    export about to go. The host element holds each operation 3 s after its intention is
    logged (a pause failpoint); a client that connects meanwhile is refused with the reason,
    and so is a deletion asked meanwhile. Each operation then finishes as it would have."""
    cluster = make_cluster()
    create(cluster, "narrowing", "32MiB")
    create(cluster, "going", "16MiB")
    create(cluster, "kept", "16MiB")
    run([starfish_bin(), "snapshot", "create", "kept", "s1", "--admin", cluster.admin])
    data = write_pattern(cluster, "narrowing", 9)
    cases = [
        ("narrowing", ["volume", "resize", "narrowing", "16MiB", "--shrink"], "volume-resize",
         "volume narrowing is being shrunk", {"size_bytes": 16 * MiB, "on_write_quorum": True}),
        ("going", ["volume", "delete", "going"], "volume-delete", "volume going is being deleted",
         {"removed_from_live_elements": True}),
        ("kept@s1", ["snapshot", "delete", "kept@s1"], "snapshot-delete", "snapshot kept@s1 is being deleted", {}),
    ]
    for name, command, kind, reason, expected in cases:
        cluster.stop_host()
        cluster.host.env = {**os.environ, "STARFISH_FAILPOINT": f"{kind}:after-intention=sleep(3000)"}
        cluster.start_host()
        log_start = os.path.getsize(cluster.host.log_path)

        def paused():
            with open(cluster.host.log_path, "rb") as log:
                log.seek(log_start)
                return b"failpoint: pausing" in log.read()

        operation = subprocess.Popen([starfish_bin(), *command, "--json", "--admin", cluster.admin],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            harness.wait_until(paused, 20, f"the {kind} to pause after its intention")
            # QEMU's client shows the server's message; libnbd's says the export is refused.
            refused = run(["qemu-img", "info", "-f", "raw", cluster.uri(name)], check=False)
            assert refused.returncode != 0 and reason in refused.stderr, refused.stderr
            print(f"qemu-img info {name} during the {kind}: {refused.stderr.strip()}")
            refused = run(["nbdinfo", cluster.uri(name)], check=False)
            assert refused.returncode != 0 and "error to opt_go" in refused.stderr, refused.stderr
            second = ["snapshot", "delete", name] if "@" in name else ["volume", "delete", name]
            again = run([starfish_bin(), *second, "--admin", cluster.admin], check=False)
            assert again.returncode != 0 and reason in again.stderr, again.stderr
            print(f"{' '.join(second)} during the {kind}: {again.stderr.strip()}")
            if name != "narrowing":
                # Other volumes are served as before.
                assert read_pattern(cluster, "narrowing", len(data)) == data
            out, err = operation.communicate(timeout=60)
        finally:
            if operation.poll() is None:
                operation.kill()
                operation.wait()
        assert operation.returncode == 0, err
        answer = json.loads(out)
        assert {key: answer.get(key) for key in expected} == expected, answer
    # Answered: the shrunk volume takes clients again at its new size; the deleted one is gone.
    cluster.stop_host()
    cluster.host.env = None
    cluster.start_host()
    assert nbd_size(cluster, "narrowing") == 16 * MiB
    assert read_pattern(cluster, "narrowing", len(data)) == data
    assert {"going", "kept@s1"}.isdisjoint(exported(cluster)), exported(cluster)
    refused = run(["nbdinfo", cluster.uri("going")], check=False)
    assert refused.returncode != 0 and "being deleted" not in refused.stderr, refused.stderr


@pytest.mark.parametrize("step", ["after-intention", "after-resize", "before-completion"])
def test_a_host_element_killed_at_each_step_of_a_shrink_finishes_it_on_restart(make_cluster, step):
    cluster = make_cluster()
    doc = create(cluster, "tight", "32MiB")
    data = write_pattern(cluster, "tight", 8)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x44 16M 16M", cluster.uri("tight")])
    abort_host_at(cluster, f"volume-resize:{step}", lambda: shrink(cluster, "tight", "16MiB", check=False))
    # The intention was logged first: the new host element serves the new size, zeroes the
    # tail again and completes the shrink.
    harness.wait_until(lambda: listing(cluster)["tight"]["state"] == "ready", 30, "the shrink's completion")
    listed = listing(cluster)["tight"]
    assert (listed["size_bytes"], listed["storage_bytes"]) == (16 * MiB, 32 * MiB), f"after a crash {step}: {listed}"
    assert nbd_size(cluster, "tight") == 16 * MiB
    assert read_pattern(cluster, "tight", len(data)) == data
    resize(cluster, "tight", "32MiB")
    run(["qemu-io", "-f", "raw", "-c", "read -P 0 16M 16M", cluster.uri("tight")])
    assert_identical_everywhere(cluster, doc["storage_volume"])
