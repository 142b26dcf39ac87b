"""Bad NBD input gets the error the protocol prescribes, never a crash or a
hung connection, and never disturbs another client."""

import errno
import os
import struct

import nbd
import pytest

import harness
from harness import MiB, Client, RawNbd, expect_nbd_error

SIZE = 1 << 30
U64 = 1 << 64


class Bystander:
    """A second client, connected throughout, that checks its data after
    every step."""

    def __init__(self, uri):
        self.client = Client(uri)
        self.offset = 900 * MiB
        self.data = harness.random_bytes(256 * 1024, seed=99)
        self.client.pwrite(self.data, self.offset)

    def check(self, step):
        got = self.client.pread(len(self.data), self.offset)
        assert got == self.data, f"bystander's data changed after: {step}"

    def close(self):
        self.client.close()


@pytest.fixture
def bystander(target):
    b = Bystander(target.uri())
    yield b
    b.close()


def assert_alive(target, step):
    assert target.host.alive(), f"server process exited with {target.host.returncode()} after: {step}"


def raw(target):
    return RawNbd(target.nbd_port, timeout=10)


@pytest.mark.time_limit(180)
def test_garbage_after_handshake_closes_only_that_connection(target, bystander):
    for seed in range(5):
        conn = raw(target)
        try:
            conn.handshake("vol0")
            garbage = bytearray(harness.random_bytes(4096, seed))
            garbage[0:4] = b"\xde\xad\xbe\xef"  # never the request magic
            conn.sock.sendall(garbage)
            assert conn.closed_by_server(10), "server kept a connection open after a bad request magic"
        finally:
            conn.close()
        assert_alive(target, f"garbage after handshake (seed {seed})")
        bystander.check(f"garbage after handshake (seed {seed})")


@pytest.mark.time_limit(180)
def test_garbage_during_handshake(target, bystander):
    # Unknown client flags: the server must drop the connection.
    conn = raw(target)
    try:
        conn.greeting()
        conn.sock.sendall(b"\xff\xff\xff\xff" + harness.random_bytes(60, 1))
        assert conn.closed_by_server(10), "server accepted unknown client flags"
    finally:
        conn.close()
    bystander.check("unknown client flags")

    # A bad option magic.
    conn = raw(target)
    try:
        conn.greeting()
        conn.client_flags()
        conn.sock.sendall(b"\x00\x01\x02\x03" + harness.random_bytes(200, 2))
        assert conn.closed_by_server(10), "server kept a connection open after a bad option magic"
    finally:
        conn.close()
    bystander.check("bad option magic")

    # A known option with more data than the server buffers: refused
    # (NBD_REP_ERR_TOO_BIG or another error) or dropped, never a hang.
    conn = raw(target)
    try:
        conn.greeting()
        conn.client_flags()
        conn.send_option(harness.NBD_OPT_GO, b"\0" * (1 << 20))
        try:
            _, reply, _ = conn.option_reply()
            assert reply & 0x80000000, f"a 1 MiB NBD_OPT_GO got reply {reply:#x}"
            size, _ = conn.go("vol0")  # and the connection goes on
            assert size == SIZE
        except (ConnectionError, ConnectionResetError, BrokenPipeError):
            pass  # dropped: also fine
    finally:
        conn.close()
    bystander.check("oversized option")

    # An option header claiming 4 GiB of data, then the client vanishes.
    conn = raw(target)
    try:
        conn.greeting()
        conn.client_flags()
        conn.sock.sendall(struct.pack(">QII", harness.IHAVEOPT, harness.NBD_OPT_GO, 0xFFFFFFF0) + b"\0" * 64)
    finally:
        conn.close()
    bystander.check("huge option length")

    # Just a greeting, then the client vanishes.
    for _ in range(20):
        conn = raw(target)
        conn.greeting()
        conn.close()
    assert_alive(target, "handshake garbage")
    bystander.check("abandoned handshakes")


@pytest.mark.time_limit(120)
def test_unknown_option_and_export_then_go(target, bystander):
    conn = raw(target)
    try:
        conn.greeting()
        conn.client_flags()
        conn.send_option(0x7777, b"whatever")
        option, reply, _ = conn.option_reply()
        assert (option, reply) == (0x7777, harness.NBD_REP_ERR_UNSUP), (option, hex(reply))

        name = b"no-such-volume"
        conn.send_option(harness.NBD_OPT_GO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
        option, reply, _ = conn.option_reply()
        assert option == harness.NBD_OPT_GO and reply & 0x80000000, f"GO of a missing export: {reply:#x}"

        size, flags = conn.go("vol0")
        assert size == SIZE

        # A command the protocol does not define: EINVAL, and the connection goes on.
        conn.request(0x55, 0, 4096, handle=1)
        error, handle = conn.simple_reply()
        assert (error, handle) == (errno.EINVAL, 1)

        conn.request(harness.NBD_CMD_READ, bystander.offset, 4096, handle=2)
        error, handle = conn.simple_reply()
        assert (error, handle) == (0, 2)
        assert conn.recv_exact(4096) == bystander.data[:4096]
    finally:
        conn.close()
    bystander.check("unknown option, unknown export, unknown command")


@pytest.mark.time_limit(180)
def test_out_of_range_and_unaligned_requests(target, bystander):
    with Client(target.uri(), strict=False) as client:
        cases = [
            ("read at the end", lambda: client.pread(512, SIZE), {errno.EINVAL}),
            ("read across the end", lambda: client.pread(1024, SIZE - 512), {errno.EINVAL}),
            ("read at 2^63", lambda: client.pread(512, 1 << 63), {errno.EINVAL}),
            ("read whose end wraps past 2^64", lambda: client.pread(1024, U64 - 512), {errno.EINVAL}),
            ("write at the end", lambda: client.pwrite(b"\x01" * 512, SIZE), {errno.ENOSPC, errno.EINVAL}),
            ("write across the end", lambda: client.pwrite(b"\x01" * 1024, SIZE - 512), {errno.ENOSPC, errno.EINVAL}),
            ("write whose end wraps", lambda: client.pwrite(b"\x01" * 1024, U64 - 512), {errno.ENOSPC, errno.EINVAL}),
            ("trim across the end", lambda: client.trim(8192, SIZE - 4096), {errno.EINVAL}),
            ("write-zeroes across the end", lambda: client.zero(8192, SIZE - 4096), {errno.ENOSPC, errno.EINVAL}),
            ("read at an unaligned offset", lambda: client.pread(512, 1), {errno.EINVAL}),
            ("read of an unaligned length", lambda: client.pread(100, 0), {errno.EINVAL}),
            ("write at an unaligned offset", lambda: client.pwrite(b"\x02" * 512, 4096 + 1), {errno.EINVAL}),
            ("write of an unaligned length", lambda: client.pwrite(b"\x02" * 700, 4096), {errno.EINVAL}),
            ("read longer than 32 MiB", lambda: client.pread(32 * MiB + 4096, 0), {errno.EINVAL, errno.EOVERFLOW}),
        ]
        for what, fn, errnos in cases:
            expect_nbd_error(fn, errnos, what)
            # The same connection still works after each refusal.
            assert client.pread(4096, bystander.offset) == bystander.data[:4096], f"connection broken after: {what}"
            bystander.check(what)
        # The refused writes changed nothing.
        assert client.pread(8192, 0) == bytes(8192)
        assert client.pread(4096, SIZE - 4096) == bytes(4096)
    assert_alive(target, "out-of-range requests")


@pytest.mark.time_limit(180)
def test_oversized_write(target, bystander):
    """A write longer than the advertised maximum: an error (the connection
    may go on) or a hard disconnect; never a crash, never a write."""
    client = Client(target.uri(), strict=False)
    try:
        try:
            client.pwrite(b"\x03" * (32 * MiB + 4096), 0)
            raise AssertionError("a write of 32 MiB + 4 KiB succeeded")
        except nbd.Error as e:
            assert e.errnum in (errno.EINVAL, errno.EOVERFLOW, errno.ENOMEM, errno.ECONNRESET, errno.ENOTCONN), e
        if client.h.aio_is_ready():
            assert client.pread(4096, 0) == bytes(4096)
    finally:
        client.close()
    bystander.check("oversized write")

    # A write header announcing 4 GiB, then a few bytes, then the client vanishes.
    conn = raw(target)
    try:
        conn.handshake("vol0")
        conn.request(1, 0, 0xFFFFFFFF, handle=7, payload=b"\x04" * 4096)
    finally:
        conn.close()
    assert_alive(target, "oversized write")
    bystander.check("abandoned oversized write")
    with Client(target.uri()) as client:
        assert client.pread(8192, 0) == bytes(8192), "a refused oversized write changed data"


@pytest.mark.time_limit(180)
def test_many_connections_opened_and_dropped(target, bystander):
    """Clients that connect and vanish mid-request do not leak into others."""
    for i in range(50):
        conn = raw(target)
        try:
            conn.handshake("vol0")
            if i % 3 == 0:
                conn.request(harness.NBD_CMD_READ, 0, 1 * MiB, handle=i)
            elif i % 3 == 1:
                conn.request(1, 0, 8192, handle=i, payload=b"\x09" * 100)  # truncated payload
        finally:
            conn.close()
    assert_alive(target, "dropped connections")
    bystander.check("dropped connections")
    with Client(target.uri()) as client:
        assert client.pread(8192, 0) == bytes(8192), "a truncated write was applied"
        client.pwrite(os.urandom(4096), 4096)
