"""Checksums end to end and scrub, with real processes: `starfish scrub` (an admin order under
TLS) compares a volume's replicas block by block; a block that rots on one element's disk is
found, that element repairs itself from its peers, and afterwards every replica holds the same
content; a scheduled scrub that runs while a writer keeps writing reports no difference that is
not there."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest

import harness
from harness import Client, random_bytes

MIB = 1 << 20


def scrub(cluster, *extra, timeout=180):
    return subprocess.run([harness.starfish_bin(), "scrub", "vol0", "--admin", cluster.admin, *extra],
                          capture_output=True, text=True, timeout=timeout)


def report_of(result):
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"scrub printed no JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")


def data_file(element):
    path = os.path.join(element.data, "volumes", "0.data")
    assert os.path.isfile(path), f"no data file at {path}: {os.listdir(element.data)}"
    return path


@pytest.mark.time_limit(240)
def test_scrub_finds_a_rotten_block_and_its_element_repairs_itself(make_cluster):
    cluster = make_cluster(volumes=(("vol0", "64MiB"),), tls=True)
    admin = os.path.join(cluster.certs, "admin")
    expected = {}
    with Client(cluster.uri()) as c:
        for i in range(32):
            data = random_bytes(64 * 1024, i)
            c.pwrite(data, i * 2 * MIB)
            expected[i * 2 * MIB] = data
        c.flush()

    # Changing the cluster's state takes an operator's certificate.
    refused = scrub(cluster)
    assert refused.returncode != 0 and "403" in refused.stderr, refused.stderr

    clean = scrub(cluster, "--tls-dir", admin, "--json")
    assert clean.returncode == 0, clean.stderr
    report = report_of(clean)
    blocks = 64 * MIB // 4096
    assert (report["done_bytes"], report["blocks_compared"], report["blocks_mismatched"]) == (64 * MIB, blocks, 0)

    # Bit rot in one block of far's data file (the running element reads it through the same
    # page cache).
    far = cluster.elements["far"]
    with open(data_file(far), "r+b") as f:
        f.seek(4 * MIB + 100)
        f.write(b"rot")
    found = scrub(cluster, "--tls-dir", admin, "--json")
    assert found.returncode == 4, f"exit {found.returncode}: {found.stdout}\n{found.stderr}"
    report = report_of(found)
    assert report["element_errors"] >= 1, report
    assert "far" in report["last_error"] and "checksum" in report["last_error"], report

    # far made the volume a repair; a full recovery from a peer brings it back in sync.
    status = cluster.wait_healthy(timeout=60)
    far_status = next(e for e in status["elements"] if e["name"] == "far")
    assert far_status.get("last_recovery", {}).get("kind") == "full", far_status

    again = scrub(cluster, "--tls-dir", admin)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 repaired" in again.stdout and "agree" in again.stdout, again.stdout
    text = subprocess.run([harness.starfish_bin(), "status", "--admin", cluster.admin], capture_output=True,
                          text=True, timeout=30)
    assert "scrub (ordered): done" in text.stdout, text.stdout
    with urllib.request.urlopen(f"http://{cluster.admin}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    assert 'starfish_scrub_done_bytes{volume="vol0"} 67108864' in metrics, metrics

    with Client(cluster.uri()) as c:
        for offset, data in expected.items():
            assert c.pread(len(data), offset) == data, f"data at {offset} changed"
    assert cluster.stop() == []
    digests = {name: element.verify()["volumes"][0]["digest"] for name, element in cluster.elements.items()}
    assert len(set(digests.values())) == 1, f"replicas differ after the repair: {digests}"


@pytest.mark.time_limit(180)
def test_a_scheduled_scrub_under_writes_reports_no_false_difference(make_cluster, workdir):
    cluster = make_cluster(volumes=(("vol0", "128MiB"),),
                           host_extra=["--scrub-interval", "2s", "--scrub-rate", "32MiB"])
    log = os.path.join(workdir, "writer.log")
    stop = os.path.join(workdir, "stop-writer")
    writer = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "nbd_writer.py"),
                               cluster.uri(), log, "--offset", "0", "--blocks", str(128 * MIB // 4096),
                               "--seed", "7", "--max-seconds", "60", "--stop-file", stop])
    try:
        def finished_scrub(status):
            scrubs = harness.volume_status(status)["scrubs"]
            done = [s for s in scrubs if s["reason"] == "scheduled" and not s["running"]]
            return done[-1] if done else None

        status = cluster.wait_status(finished_scrub, 60, "a scheduled scrub to finish")
        report = finished_scrub(status)
    finally:
        open(stop, "w").close()
        writer.wait(timeout=60)
    assert writer.returncode == 0, harness.tail_file(log)
    with open(log) as f:
        acknowledged = sum(1 for line in f if line.startswith("A "))
    assert acknowledged > 100, f"the writer wrote only {acknowledged} times"
    assert report["done_bytes"] == 128 * MIB, report
    assert (report["blocks_mismatched"], report["blocks_undecided"], report["element_errors"]) == (0, 0, 0), report
    assert report["blocks_compared"] + report["blocks_changed"] == 128 * MIB // 4096, report
    assert report["repaired"] == [], report
    # Nothing was failed by the scrub: every element is still in sync.
    assert harness.healthy(cluster.status())


def failures(cluster, element, reason):
    """The host element's count of `element`'s failures for `reason` (`GET /metrics`)."""
    with urllib.request.urlopen(f"http://{cluster.admin}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    for line in metrics.splitlines():
        if (line.startswith("starfish_element_failures_total{") and f'element="{element}"' in line
                and f'reason="{reason}"' in line):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


@pytest.mark.time_limit(180)
@pytest.mark.parametrize("where", ["data", "checksums", "tls"])
def test_a_read_reply_damaged_on_the_way_is_read_again_from_another_element(make_cluster, where):
    """A 1 MiB read reply loses a bit between an element and the host element (a proxy in
    front of each element damages the first such reply after it is armed). In its data: the
    frame's checksum, made from the blocks' checksums, still matches, and the host element's
    check of the data against the blocks' checksums catches it (`read_checksum`), reads
    again from another element and scrubs what it read. In its block checksums: the frame's
    checksum does not match, and the session is dropped and redone. On a TLS session (`tls`:
    a bit of one sealed record of the reply): TLS refuses the record, and the session is
    dropped and redone. Either way the NBD client gets what it wrote, the element comes back
    in sync, and the replicas agree."""
    tls = where == "tls"
    cluster = make_cluster(start=False, volumes=(("vol0", "64MiB"),), tls=tls)
    shared = harness.TamperingProxy.Shared()
    proxies = {name: harness.TamperingProxy(name, e.port, shared, tls=tls) for name, e in cluster.elements.items()}
    try:
        cluster.addresses = {name: p.address for name, p in proxies.items()}
        cluster.host.args = [str(a) for a in cluster.host_args()]
        cluster.start()
        data = random_bytes(MIB, 11)
        with Client(cluster.uri()) as c:
            c.pwrite(data, 8 * MIB)
            c.flush()
            cluster.wait_caught_up()
            shared.arm(where)
            assert c.pread(MIB, 8 * MIB) == data, "the host element answered with damaged data"
            damage = [(w, n) for _, w, n in shared.damaged]
            if tls:
                assert [w for w, _ in damage] == [where] and damage[0][1] >= proxies["local"].TLS_RECORD_BYTES_MIN, damage
            else:
                assert damage == [(where, MIB)], damage
            damaged = shared.damaged[0][0]

            with open(cluster.host.log_path, errors="replace") as f:
                log = f.read()
            if where == "data":
                assert "read data damaged on the way" in log, harness.tail(log)
                assert failures(cluster, damaged, "read_checksum") == 1

                def scrubbed(status):
                    done = [s for s in harness.volume_status(status)["scrubs"]
                            if s["reason"] == "read-checksum" and not s["running"]]
                    return done[-1] if done else None

                report = scrubbed(cluster.wait_status(scrubbed, 60, "the scrub of the damaged read to finish"))
                assert (report["total_bytes"], report["blocks_mismatched"]) == (MIB, 0), report
            else:
                assert ("cannot decrypt peer's message" if tls else "frame checksum mismatch") in log, harness.tail(log)
                assert failures(cluster, damaged, "connection_lost") >= 1
                assert failures(cluster, damaged, "read_checksum") == 0

            cluster.wait_caught_up()
            assert c.pread(MIB, 8 * MIB) == data, "the data changed after the damaged read"
        assert cluster.stop() == []
        digests = {name: element.verify()["volumes"][0]["digest"] for name, element in cluster.elements.items()}
        assert len(set(digests.values())) == 1, f"replicas differ: {digests}"
    finally:
        for proxy in proxies.values():
            proxy.destroy()
