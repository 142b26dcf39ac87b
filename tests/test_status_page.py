"""The admin address's HTTP server (hyper, through axum) and the live status page's feed:
what a browser gets, how many pages may follow the feed at once, and junk on the port.
The page in a real browser during a recovery is tested in test_recovery.py
(`test_paced_replay_shows_progress`)."""

import json
import socket
import time
import urllib.error
import urllib.request

import harness

EVENT_STREAMS_MAX = 8  # status_page.rs


def connect(cluster):
    host, port = cluster.admin.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def open_events(cluster):
    """A connection following GET /events (HTTP/1.0: the body is not chunked); its status
    line and head, and the body bytes that came with them."""
    s = connect(cluster)
    s.sendall(f"GET /events HTTP/1.0\r\nHost: {cluster.admin}\r\nAccept: text/event-stream\r\n\r\n".encode())
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = s.recv(4096)
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return s, head, body


def answered(head, code):
    return head.split(b" ")[1:2] == [str(code).encode()]


def events(s, names, buffer=b"", timeout=10):
    """Reads server-sent events from `s` until one of each name in `names` came: {name: data}."""
    found = {}
    deadline = time.monotonic() + timeout
    s.settimeout(timeout)
    while set(names) - set(found) and time.monotonic() < deadline:
        chunk = s.recv(65536)
        assert chunk, f"the feed ended; got {list(found)}"
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            fields = {}
            for line in block.decode().splitlines():
                key, _, value = line.partition(":")
                fields.setdefault(key, []).append(value[1:] if value.startswith(" ") else value)
            if "event" in fields:
                found.setdefault(fields["event"][0], json.loads("\n".join(fields.get("data", []))))
    return found


def test_the_page_and_its_feed(cluster):
    """GET / is the page (HTML, nothing loaded from elsewhere); GET /events sends the samples
    kept, then the status document with each new sample."""
    with urllib.request.urlopen(f"http://{cluster.admin}/", timeout=10) as answer:
        page = answer.read().decode()
        assert answer.headers["Content-Type"].startswith("text/html"), answer.headers
        assert "default-src 'none'" in answer.headers["Content-Security-Policy"], answer.headers
    assert 'new EventSource("/events")' in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", ""), "the page loads nothing from elsewhere"
    s, head, body = open_events(cluster)
    with s:
        assert answered(head, 200) and b"text/event-stream" in head, head
        got = events(s, ["history", "update"], body)
    assert isinstance(got["history"]["samples"], list) and got["history"]["interval_ms"] == 1000, got["history"]
    status = got["update"]["status"]
    assert status["role"] == "active" and [v["name"] for v in status["volumes"]] == ["vol0"], status
    assert {e["name"] for e in status["elements"]} == set(harness.ELEMENT_NAMES), status


def test_followers_of_the_feed_are_bounded_and_junk_is_answered(cluster):
    """At most EVENT_STREAMS_MAX pages follow the feed at once (one more is told why, and a
    closed one frees its place); junk and oversized requests get an error, and the admin
    address keeps answering."""
    streams = [open_events(cluster) for _ in range(EVENT_STREAMS_MAX)]
    try:
        for s, head, _ in streams:
            assert answered(head, 200), head
        extra, head, body = open_events(cluster)
        extra.close()
        assert answered(head, 503) and b"too many status pages" in body, (head, body)
        streams.pop()[0].close()
        # The server sees the page gone at its next update (one a second) at the latest.
        deadline = time.monotonic() + 5
        while True:
            again, head, _ = open_events(cluster)
            again.close()
            if answered(head, 200) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert answered(head, 200), head
    finally:
        for s, _, _ in streams:
            s.close()
    for junk, expected in [
        (b"\x00\x01garbage\r\n\r\n", b"HTTP/1.1 400"),
        (b"GET /status HTTP/1.1\r\nX-Big: " + b"x" * 20000 + b"\r\n\r\n", b"HTTP/1.1 431"),
        (b"BREW /status HTTP/1.1\r\n\r\n", b"HTTP/1.1 404"),
    ]:
        with connect(cluster) as s:
            s.sendall(junk)
            s.settimeout(10)
            answer = b""
            try:
                while chunk := s.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        assert answer.startswith(expected), (junk[:40], answer[:200])
    with urllib.request.urlopen(f"http://{cluster.admin}/status", timeout=10) as answer:
        assert json.load(answer)["role"] == "active"


CONNECTIONS_MAX = 32  # admin.rs


def test_connections_beyond_the_limit_are_told_to_come_back(cluster):
    """While CONNECTIONS_MAX connections are open (here idle, as a stalled client would be),
    one more is answered 503 with Retry-After rather than closed unanswered; once they go,
    the admin address answers again."""
    idle = [connect(cluster) for _ in range(CONNECTIONS_MAX)]
    try:
        time.sleep(0.3)
        with connect(cluster) as s:
            s.sendall(f"GET /status HTTP/1.0\r\nHost: {cluster.admin}\r\n\r\n".encode())
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert answered(head, 503) and b"Retry-After: 1" in head and b"try again" in body, answer
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://{cluster.admin}/status", timeout=10) as answer:
                assert json.load(answer)["role"] == "active"
                break
        except urllib.error.HTTPError as e:
            assert e.code == 503 and time.monotonic() < deadline, e
            time.sleep(0.2)
