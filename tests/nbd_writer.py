"""Write load for the crash tests: writes self-describing blocks (each holds
its offset and the generation of the write that put it there) at random
places of a region, with several writes in flight (never two on one block
at once, so each block's writes land in the order they were submitted), and
logs every write when it is submitted and when it is acknowledged.

    python3 nbd_writer.py URI LOG --offset N --blocks N --seed N
        [--inflight 16] [--min-blocks 1] [--max-blocks 4] [--max-seconds 120] [--stop-file PATH]

Log lines (flushed one by one, so a reader sees every acknowledgement):
    S <generation> <offset> <nblocks>      submitted
    A <generation>                         acknowledged
    E <generation> <errno> <message>       failed
It stops when --stop-file exists or after --max-seconds, waits for what is
in flight (bounded), and exits 0 (1 if the connection broke).
"""

import argparse
import os
import random
import sys
import time

import nbd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BLOCK, stamp_block  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("log")
    parser.add_argument("--offset", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--min-blocks", type=int, default=1)
    parser.add_argument("--max-blocks", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=120)
    parser.add_argument("--stop-file")
    parser.add_argument("--first-generation", type=int, default=1)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    log = open(args.log, "a", buffering=1)
    h = nbd.NBD()
    h.connect_uri(args.uri)

    inflight = {}  # cookie -> (generation, buffer, block indexes)
    busy = set()  # blocks with a write in flight: writes to one block never overlap,
    # so the order of the writes to each block is the order they were submitted in
    generation = args.first_generation - 1
    deadline = time.monotonic() + args.max_seconds
    broken = False

    def stopping():
        return time.monotonic() > deadline or (args.stop_file and os.path.exists(args.stop_file))

    def reap():
        for cookie in list(inflight):
            gen, _, blocks = inflight[cookie]
            try:
                done = h.aio_command_completed(cookie)
            except nbd.Error as e:
                log.write(f"E {gen} {e.errnum} {e.string}\n")
                del inflight[cookie]
                busy.difference_update(blocks)
                continue
            if done:
                log.write(f"A {gen}\n")
                del inflight[cookie]
                busy.difference_update(blocks)

    while not stopping() and not broken:
        while len(inflight) < args.inflight:
            nblocks = rng.randint(args.min_blocks, args.max_blocks)
            index = rng.randrange(0, args.blocks - nblocks + 1)
            blocks = range(index, index + nblocks)
            if any(b in busy for b in blocks):
                continue
            offset = args.offset + index * BLOCK
            generation += 1
            data = b"".join(stamp_block(offset + i * BLOCK, generation) for i in range(nblocks))
            buf = nbd.Buffer.from_bytearray(bytearray(data))
            log.write(f"S {generation} {offset} {nblocks}\n")
            try:
                cookie = h.aio_pwrite(buf, offset)
            except nbd.Error as e:
                log.write(f"E {generation} {e.errnum} {e.string}\n")
                broken = h.aio_is_dead() or h.aio_is_closed()
                break
            inflight[cookie] = (generation, buf, blocks)
            busy.update(blocks)
        try:
            h.poll(100)
        except nbd.Error as e:
            log.write(f"# poll failed: {e}\n")
            broken = True
        reap()

    drain_deadline = time.monotonic() + 60
    while inflight and not broken and time.monotonic() < drain_deadline:
        try:
            h.poll(100)
        except nbd.Error:
            broken = True
        reap()
    for gen, _, _ in inflight.values():
        log.write(f"# still in flight at exit: {gen}\n")
    if not broken:
        try:
            h.shutdown()
        except nbd.Error:
            pass
    log.write("# done\n")
    log.close()
    sys.exit(1 if broken or inflight else 0)


if __name__ == "__main__":
    main()
