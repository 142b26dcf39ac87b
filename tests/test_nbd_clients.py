"""The volume seen through real NBD clients: nbdinfo, nbdcopy, qemu-img,
qemu-io, fio's nbd engine and libnbd."""

import errno
import hashlib
import json
import os

import nbd
import pytest

import harness
from conftest import require_tools
from harness import GiB, KiB, MiB, run

VOLUME_SIZE = 1 * GiB


def nbdinfo_json(*args):
    return json.loads(run(["nbdinfo", "--json", *args], timeout=60).stdout)


@pytest.mark.time_limit(120)
def test_nbdinfo_shows_export_and_block_sizes(target):
    require_tools("nbdinfo")
    info = nbdinfo_json(target.uri("vol0"))
    exports = info["exports"]
    assert len(exports) == 1, info
    export = exports[0]
    assert export["export-name"] == "vol0"
    assert export["export-size"] == VOLUME_SIZE
    assert export["block_size_minimum"] == 512
    assert export["block_size_preferred"] == 4096
    assert export["block_size_maximum"] == 32 * MiB
    assert export["is_read_only"] is False
    for capability in ("can_flush", "can_fua", "can_trim", "can_zero", "can_multi_conn"):
        assert export[capability] is True, f"{capability} is false: {export}"
    assert "base:allocation" in export["contexts"]


@pytest.mark.time_limit(120)
def test_nbdinfo_list(target):
    require_tools("nbdinfo")
    info = nbdinfo_json("--list", f"nbd://127.0.0.1:{target.nbd_port}")
    names = {e["export-name"]: e for e in info["exports"]}
    assert "vol0" in names, info
    assert names["vol0"]["export-size"] == VOLUME_SIZE


@pytest.mark.time_limit(120)
def test_nbdinfo_list_several_volumes(make_cluster):
    require_tools("nbdinfo")
    cluster = make_cluster(volumes=[("vol0", "1GiB"), ("small", "64MiB"), ("tiny", "512KiB")])
    info = nbdinfo_json("--list", f"nbd://127.0.0.1:{cluster.nbd_port}")
    sizes = {e["export-name"]: e["export-size"] for e in info["exports"]}
    assert sizes == {"vol0": 1 * GiB, "small": 64 * MiB, "tiny": 512 * KiB}
    # Each export is its own disk.
    with harness.Client(cluster.uri("small")) as small, harness.Client(cluster.uri("tiny")) as tiny:
        small.pwrite(b"S" * 4096, 0)
        tiny.pwrite(b"T" * 4096, 0)
        assert small.pread(4096, 0) == b"S" * 4096
        assert tiny.pread(4096, 0) == b"T" * 4096
    with harness.Client(cluster.uri("vol0")) as vol0:
        assert vol0.pread(4096, 0) == bytes(4096)
    # An export that does not exist is refused.
    with pytest.raises(nbd.Error):
        harness.Client(cluster.uri("nope"), timeout=20)


@pytest.mark.time_limit(300)
def test_nbdcopy_round_trip_and_sparseness(target, workdir):
    require_tools("nbdcopy", "nbdinfo", "qemu-img")
    size = 64 * MiB
    source = os.path.join(workdir, "in.img")
    with open(source, "wb") as f:
        f.write(os.urandom(size))
    run(["nbdcopy", source, target.uri()], timeout=180)

    copy = os.path.join(workdir, "out.img")
    run(["nbdcopy", target.uri(), copy], timeout=180)
    assert os.path.getsize(copy) == VOLUME_SIZE
    with open(copy, "rb") as f:
        head = f.read(size)
    assert hashlib.sha256(head).hexdigest() == harness.sha256_file(source), "data read back differs"
    with open(copy, "rb") as f:
        f.seek(size)
        for chunk in iter(lambda: f.read(16 * MiB), b""):
            assert chunk.count(0) == len(chunk), "never-written region is not zero"
    os.unlink(copy)

    # Never-written space is reported as a hole, written space as data.
    extents = [
        (int(parts[0]), int(parts[1]), int(parts[2]))
        for parts in (line.split() for line in run(["nbdinfo", "--map", target.uri()], timeout=60).stdout.splitlines())
        if len(parts) >= 3
    ]
    assert sum(length for _, length, _ in extents) == VOLUME_SIZE, extents
    for offset, length, kind in extents:
        if offset < size:
            assert kind & nbd.STATE_HOLE == 0, f"written extent reported as a hole: {extents}"
    hole = sum(length for offset, length, kind in extents if offset >= size and kind & nbd.STATE_HOLE)
    assert hole == VOLUME_SIZE - size, f"never-written space not reported as holes: {extents}"

    qemu_map = json.loads(run(["qemu-img", "map", "--output=json", "-f", "raw", target.uri()], timeout=60).stdout)
    data = sum(e["length"] for e in qemu_map if e["data"])
    assert data == size, f"qemu-img map shows {data} bytes of data, expected {size}: {qemu_map}"


QEMU_IO_WRITES = [
    # (offset, length, pattern)
    (0, 4 * KiB, 0x11),
    (8 * KiB + 512, 512, 0x22),  # 512-aligned, not 4K-aligned
    (64 * KiB + 1536, 3 * KiB, 0x33),  # 512-aligned, crosses a 4K boundary
    (1 * MiB - 512, 1 * KiB, 0x44),  # crosses a megabyte
    (100 * MiB + 512, 64 * KiB + 512, 0x55),
    (200 * MiB, 4 * MiB, 0x66),
    (300 * MiB + 7, 100, 0x77),  # byte-granular: qemu does read-modify-write
    (VOLUME_SIZE - 4 * KiB, 4 * KiB, 0x88),  # the last block
]


def qemu_io(uri, commands, timeout=120):
    args = ["qemu-io", "-f", "raw"]
    for command in commands:
        args += ["-c", command]
    result = run(args + [uri], timeout=timeout, check=False)
    output = result.stdout + result.stderr
    bad = [line for line in output.splitlines() if "fail" in line.lower() or "error" in line.lower()]
    assert result.returncode == 0 and not bad, f"qemu-io {commands}: exit {result.returncode}\n{output}"
    return output


@pytest.mark.time_limit(300)
def test_qemu_io_patterns(target):
    require_tools("qemu-io")
    uri = target.uri()
    qemu_io(uri, [f"write -P {p:#x} {o} {n}" for o, n, p in QEMU_IO_WRITES] + ["flush"])
    # Read back on a new connection: each write, and the 512 bytes on either
    # side untouched (still zero).
    checks = []
    for offset, length, pattern in QEMU_IO_WRITES:
        checks.append(f"read -P {pattern:#x} {offset} {length}")
        if offset >= 512:
            checks.append(f"read -P 0 {offset - 512} 512" if offset % 512 == 0 else f"read -P 0 {offset - 7 - 512} {512 + 7}")
        end = offset + length
        if end + 512 <= VOLUME_SIZE:
            checks.append(f"read -P 0 {end} 512")
    qemu_io(uri, checks)

    # Overwrite part of a written range: only that part changes.
    qemu_io(uri, ["write -P 0x99 {} 1024".format(200 * MiB + 4096)])
    qemu_io(uri, [
        f"read -P 0x66 {200 * MiB} 4096",
        f"read -P 0x99 {200 * MiB + 4096} 1024",
        f"read -P 0x66 {200 * MiB + 5120} {4 * MiB - 5120}",
    ])


@pytest.mark.time_limit(300)
def test_discard_and_write_zeroes_read_back_zero(target):
    require_tools("qemu-io")
    uri = target.uri()
    qemu_io(uri, [f"write -P 0xaa {8 * MiB} {8 * MiB}", "flush"])
    qemu_io(uri, [
        f"discard {8 * MiB} {1 * MiB}",  # NBD_CMD_TRIM
        f"write -z {10 * MiB} {1 * MiB}",  # NBD_CMD_WRITE_ZEROES
        f"write -z {12 * MiB + 512} {4 * KiB}",  # unaligned to 4K
        "flush",
    ])
    qemu_io(uri, [
        f"read -P 0 {8 * MiB} {1 * MiB}",
        f"read -P 0xaa {9 * MiB} {1 * MiB}",
        f"read -P 0 {10 * MiB} {1 * MiB}",
        f"read -P 0xaa {11 * MiB} {1 * MiB + 512}",
        f"read -P 0 {12 * MiB + 512} {4 * KiB}",
        f"read -P 0xaa {12 * MiB + 512 + 4 * KiB} {4 * MiB - 512 - 4 * KiB}",
    ])
    # The same through libnbd, with FUA and fast-zero variants.
    with harness.Client(uri) as client:
        client.pwrite(b"\xbb" * (64 * KiB), 20 * MiB, flags=nbd.CMD_FLAG_FUA)
        client.trim(16 * KiB, 20 * MiB, flags=nbd.CMD_FLAG_FUA)
        client.zero(16 * KiB, 20 * MiB + 16 * KiB, flags=nbd.CMD_FLAG_NO_HOLE)
        data = client.pread(64 * KiB, 20 * MiB)
        assert data[: 32 * KiB] == bytes(32 * KiB)
        assert data[32 * KiB:] == b"\xbb" * (32 * KiB)
        client.flush()


@pytest.mark.time_limit(400)
def test_fio_random_write_verify(target, workdir):
    require_tools("fio")
    result = run([
        "fio", "--name=randwrite-verify", "--ioengine=nbd", f"--uri={target.uri()}",
        "--rw=randwrite", "--bsrange=4k-128k", "--size=64m", "--iodepth=16", "--numjobs=1",
        "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_backlog=1024",
        "--randrepeat=0", "--output-format=json",
    ], timeout=360, check=False, cwd=workdir)
    assert result.returncode == 0, f"fio exit {result.returncode}\n{harness.tail(result.stdout)}\n{result.stderr}"
    report = json.loads(result.stdout[result.stdout.index("{"):])
    job = report["jobs"][0]
    assert job["error"] == 0, job
    assert job["write"]["io_bytes"] >= 64 * MiB, job["write"]
    assert job["read"]["io_bytes"] > 0, "fio verified nothing"


@pytest.mark.time_limit(300)
def test_libnbd_multi_conn_and_concurrent_writers(target):
    """Writes on one connection are visible on another once acknowledged
    (multi-conn); many writes in flight land where they belong."""
    uri = target.uri()
    with harness.Client(uri) as a, harness.Client(uri) as b:
        assert a.h.can_multi_conn()
        block = harness.BLOCK
        base = 512 * MiB
        cookies = []
        buffers = []
        for i in range(256):
            buf = nbd.Buffer.from_bytearray(bytearray(harness.stamp_block(base + i * block, 1)))
            buffers.append(buf)
            cookies.append(a.h.aio_pwrite(buf, base + i * block))
        for cookie in cookies:
            a._wait(cookie, "concurrent write")
        a.flush()
        data = b.pread(256 * block, base)
        for i in range(256):
            assert harness.parse_block(bytes(data[i * block:(i + 1) * block])) == (base + i * block, 1)
        # A write acknowledged on b is read on a at once.
        b.pwrite(harness.stamp_block(base, 2), base)
        assert harness.parse_block(bytes(a.pread(block, base))) == (base, 2)
        # A read that spans the maximum request size works.
        assert len(a.pread(32 * MiB, 0)) == 32 * MiB
        with pytest.raises(nbd.Error) as excinfo:
            a.h.set_strict_mode(0)
            a.pread(512, VOLUME_SIZE)
        assert excinfo.value.errnum == errno.EINVAL


@pytest.mark.time_limit(120)
def test_the_read_cache_takes_a_block_a_read_missed_on_its_second_miss(cluster):
    """A block read once is not cached: a miss, and one block declined (status and metrics
    say so). Read again, it is taken (a miss, none declined), and the third read is a hit. A
    block written is cached at once: its first read is a hit."""
    import urllib.request

    def counts():
        cache = cluster.status()["read_cache"]
        return cache["hits"], cache["misses"], cache["declined"], cache["used_bytes"]

    block = 100 * MiB
    with harness.Client(cluster.uri()) as client:
        before = counts()
        assert client.pread(4096, block) == bytes(4096)
        once = counts()
        assert [a - b for a, b in zip(once, before)] == [0, 1, 1, 0], (before, once)
        assert client.pread(4096, block) == bytes(4096)
        twice = counts()
        assert [a - b for a, b in zip(twice, once)] == [0, 1, 0, 4096], (once, twice)
        assert client.pread(4096, block) == bytes(4096)
        thrice = counts()
        assert [a - b for a, b in zip(thrice, twice)] == [1, 0, 0, 0], (twice, thrice)
        data = harness.random_bytes(8192, seed=41)
        client.pwrite(data, 200 * MiB)
        written = counts()
        assert written[3] - thrice[3] == 8192, (thrice, written)
        assert client.pread(8192, 200 * MiB) == data
        assert [a - b for a, b in zip(counts(), written)] == [1, 0, 0, 0]
    with urllib.request.urlopen(f"http://{cluster.admin}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    declined = [line for line in metrics.splitlines() if line.startswith("starfish_read_cache_declined_total ")]
    assert declined and float(declined[0].split()[1]) >= 1, declined
