"""A recorded client workload for the simulator's checker (`sim check-history`,
crates/sim/src/history.rs, which documents the file format).

Several libnbd connections send writes of self-describing sectors (the
simulator's format, crates/sim/src/sector.rs), trims, write-zeroes, reads,
flushes and block status, a few requests in flight on each, and every request
is recorded with the monotonic time before it was sent and after its answer
came, its outcome, and for a read the bytes it returned. Ids are handed out
with the submission time under one lock, so they follow submission order: the
id a write puts in its sectors is the checker's id for it.

NBD does not order requests in flight, so two overlapping write-likes are
never in flight at once (the checker takes the higher id as the newer write
where they overlap): a write-like whose range overlaps one still unanswered is
not sent; the worker picks another request.
"""

import errno
import os
import random
import struct
import threading
import time

import crcmod._crcfunext  # noqa: F401 (crcmod's C code: missing, it would fall back to slow Python)
import crcmod.predefined
import nbd

SECTOR = 512
_MASK = (1 << 64) - 1
_MAGIC = 0x5346_5345


# ---------------------------------------------------------------------------
# Self-describing sectors (byte for byte crates/sim/src/sector.rs)


# CRC-32C in C (Debian's python3-crcmod, with its extension module): the pure-Python loop this
# replaced cost the fault-history test about 4 s of CPU more (12.4 against 8.0 s of user time
# for the whole test). `crc32c(data, crc)` goes on from `crc`.
crc32c = crcmod.predefined.mkPredefinedCrcFun("crc-32c")


_GAMMA = 0x9E3779B97F4A7C15


def splitmix64(x):
    x = (x + _GAMMA) & _MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_FILLER = struct.Struct("<60Q")


def sector_bytes(write_id, volume, sector):
    """`fill_sector(id, volume, sector)`: [u64 id][u64 sector][u32 magic]
    [u32 volume][480 bytes: the splitmix64 stream from the first three][u32 0][u32 crc32c]."""
    assert write_id != 0, "write ids start at 1"
    head = struct.pack("<QQII", write_id, sector, _MAGIC, volume)
    seed = (write_id ^ (((sector << 32) | (sector >> 32)) & _MASK) ^ ((volume << 56) & _MASK)) & _MASK
    words = [splitmix64((seed + i * _GAMMA) & _MASK) for i in range(60)]
    body = head + _FILLER.pack(*words) + b"\0\0\0\0"
    return body + struct.pack("<I", crc32c(body))


# ---------------------------------------------------------------------------
# The history file


class History:
    """Records requests; `save()` writes the history and its data file."""

    def __init__(self, path, volume_bytes):
        self.path = path
        self.volume_bytes = volume_bytes
        self.lock = threading.Lock()
        self.next_id = 1
        self.next_instance = 1
        self.records = {}
        self.writing = {}  # write-likes in flight: id -> (start, end) in bytes
        self.data = open(path + ".data", "wb")
        self.data_at = 0

    def new_instance(self):
        with self.lock:
            instance = self.next_instance
            self.next_instance += 1
            return instance

    def begin(self, instance, kind, offset, length):
        """A request about to be sent: its id (taken with the time, under the lock);
        None for a write-like that overlaps one in flight (not to be sent)."""
        with self.lock:
            if kind in WRITE_LIKE:
                end = offset + length
                if any(o < end and offset < e for o, e in self.writing.values()):
                    return None
            request = self.next_id
            if kind in WRITE_LIKE:
                self.writing[request] = (offset, offset + length)
            self.next_id += 1
            self.records[request] = {
                "instance": instance, "kind": kind, "offset": offset, "length": length,
                "submit": time.monotonic_ns(), "reply": None, "outcome": "none", "extra": "",
            }
            return request

    def end(self, request, outcome, data=None, extents=None, final=False):
        """Its answer: `outcome` "ok" or an errno name; a read's data, a block
        status' [(length, allocated)]."""
        now = time.monotonic_ns()
        with self.lock:
            record = self.records[request]
            assert record["reply"] is None, f"request {request} answered twice"
            record["reply"] = now
            record["outcome"] = outcome
            # Answered, whatever the outcome: a later overlapping write is sequenced after it.
            # (One never answered keeps its range: it may still land.)
            self.writing.pop(request, None)
            extra = []
            if data is not None:
                assert len(data) == record["length"], (request, len(data), record["length"])
                extra.append(f"data={self.data_at}")
                self.data.write(data)
                self.data_at += len(data)
            if extents is not None:
                extra.append("extents=" + ",".join(f"{n}:{'a' if a else 'h'}" for n, a in extents))
            if final:
                extra.append("final")
            record["extra"] = " " + " ".join(extra) if extra else ""

    def counts(self):
        with self.lock:
            acked = sum(1 for r in self.records.values() if r["kind"] in ("write", "trim", "zero") and r["outcome"] == "ok")
            return len(self.records), acked

    def save(self):
        with self.lock:
            self.data.flush()
            with open(self.path, "w") as f:
                f.write(f"starfish-history 1 volumes=1 volume_bytes={self.volume_bytes}\n")
                for request in sorted(self.records):
                    r = self.records[request]
                    reply = "-" if r["reply"] is None else r["reply"]
                    f.write(
                        f"{request} {r['instance']} {r['kind']} 0 {r['offset']} {r['length']} "
                        f"{r['submit']} {reply} {r['outcome']}{r['extra']}\n"
                    )

    def close(self):
        self.data.close()


WRITE_LIKE = ("write", "trim", "zero")


def errno_name(value):
    return errno.errorcode.get(value, f"E{value}") if value else "ok"


# ---------------------------------------------------------------------------
# Workers: one NBD connection each, a few requests in flight


KINDS = (("write", 42), ("trim", 5), ("zero", 5), ("read", 32), ("flush", 8), ("status", 8))
HOT_SECTORS = 256  # 128 KiB: half the requests go there, so writes overlap


class Worker(threading.Thread):
    """Sends a random mix of requests (as the simulator's hosts do) on one
    connection, `depth` in flight, until `stop` is set; reconnects if the
    connection goes. Counts what it could not do in `problems`."""

    def __init__(self, history, uri, seed, stop, depth=4, rate=120.0, volume=0):
        super().__init__(name=f"worker-{seed}", daemon=True)
        self.history = history
        self.uri = uri
        self.rng = random.Random(seed)
        self.stop = stop
        self.depth = depth
        self.interval = 1.0 / rate  # seconds between submissions: bounds the history's size
        self.volume = volume
        self.sectors = history.volume_bytes // SECTOR
        self.problems = []
        self.connections = 0
        self.overlaps_skipped = 0
        self.error = None

    def pick(self):
        r = self.rng
        roll = r.randrange(100)
        for kind, weight in KINDS:
            if roll < weight:
                break
            roll -= weight
        if kind == "flush":
            return kind, 0, 0
        if kind in ("write", "trim", "zero"):
            count = r.randint(16, 128) if r.random() < 0.25 else r.randint(1, 16)
        elif kind == "read":
            # Shorter than the simulator's (1..128, sometimes ..1024): every byte read is kept.
            count = r.randint(32, 256) if r.random() < 0.02 else r.randint(1, 32)
        else:
            count = r.randint(8, 1024)
        total = self.sectors
        span = min(total, HOT_SECTORS) if r.random() < 0.5 else total
        if count > span:
            span = total
        count = min(count, total)
        first = r.randrange(span - count + 1)
        if r.random() < 0.3:
            first = first // 8 * 8
            count = min((count + 7) // 8 * 8, total - first)
        return kind, first, count

    def submit(self, h, instance, inflight):
        while True:
            kind, first, count = self.pick()
            offset, length = first * SECTOR, count * SECTOR
            request = self.history.begin(instance, kind, offset, length)
            if request is not None:
                break
            self.overlaps_skipped += 1
        holder = {}

        def done(err):
            outcome = errno_name(err.value)
            if kind == "read" and outcome == "ok":
                self.history.end(request, outcome, data=bytes(holder["buf"].to_bytearray()))
            elif kind == "status" and outcome == "ok":
                self.history.end(request, outcome, extents=holder["extents"])
            else:
                self.history.end(request, outcome)
            inflight.discard(request)
            return 1

        inflight.add(request)
        try:
            if kind == "write":
                data = b"".join(sector_bytes(request, self.volume, first + i) for i in range(count))
                holder["buf"] = nbd.Buffer.from_bytearray(bytearray(data))
                h.aio_pwrite(holder["buf"], offset, completion=done)
            elif kind == "read":
                holder["buf"] = nbd.Buffer(length)
                h.aio_pread(holder["buf"], offset, completion=done)
            elif kind == "trim":
                h.aio_trim(length, offset, completion=done)
            elif kind == "zero":
                h.aio_zero(length, offset, completion=done)
            elif kind == "flush":
                h.aio_flush(completion=done)
            else:
                holder["extents"] = []

                def extent(metacontext, at, entries, err):
                    if metacontext == nbd.CONTEXT_BASE_ALLOCATION:
                        for i in range(0, len(entries), 2):
                            holder["extents"].append((entries[i], not entries[i + 1] & nbd.STATE_HOLE))
                    return 0

                h.aio_block_status(length, offset, extent, completion=done)
        except nbd.Error as e:
            # Refused before it was sent (the connection is gone): it never reached the server.
            inflight.discard(request)
            self.history.end(request, errno_name(e.errnum or errno.ENOTCONN))
            raise

    def connect(self):
        h = nbd.NBD()
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
        h.set_handle_name(self.name)
        h.connect_uri(self.uri)
        self.connections += 1
        return h

    def run(self):
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = f"{type(e).__name__}: {e}"

    def _run(self):
        while not self.stop.is_set():
            try:
                h = self.connect()
            except nbd.Error as e:
                self.problems.append(f"connect: {e}")
                time.sleep(0.2)
                continue
            instance = self.history.new_instance()
            inflight = set()
            next_at = time.monotonic()
            try:
                while not self.stop.is_set():
                    while len(inflight) < self.depth and not self.stop.is_set() and time.monotonic() >= next_at:
                        self.submit(h, instance, inflight)
                        next_at = max(next_at + self.interval, time.monotonic() - 1.0)
                    wait_ms = int(max(0.0, min(0.1, next_at - time.monotonic())) * 1000)
                    h.poll(max(wait_ms, 1) if len(inflight) < self.depth else 100)
                # Drain what is in flight (bounded), then disconnect.
                deadline = time.monotonic() + 60
                while inflight and time.monotonic() < deadline:
                    h.poll(100)
                if inflight:
                    self.problems.append(f"{len(inflight)} requests unanswered 60 s after the stop")
                    return
                h.shutdown()
            except nbd.Error as e:
                self.problems.append(f"connection {instance}: {e}")
                time.sleep(0.1)
            finally:
                # Requests libnbd never completed stay "none" (no answer) in the history.
                # Dropping the last reference closes the handle and its socket.
                del h


def read_back(history, uri, volume_bytes, chunk=256 * 1024, volume=0):
    """Reads the whole volume on a fresh connection, recorded as final reads."""
    h = nbd.NBD()
    h.connect_uri(uri)
    instance = history.new_instance()
    try:
        for offset in range(0, volume_bytes, chunk):
            length = min(chunk, volume_bytes - offset)
            request = history.begin(instance, "read", offset, length)
            try:
                data = h.pread(length, offset)
            except nbd.Error as e:
                history.end(request, errno_name(e.errnum or errno.EIO))
                raise
            history.end(request, "ok", data=bytes(data), final=True)
        h.shutdown()
    finally:
        del h
