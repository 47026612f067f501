"""Offline benchmark for andpush: messages per second against a local TLS fake FCM server.

Run ``python bench.py`` from the repository root (``--quick`` for a run of about 30 seconds,
``--json`` for machine-readable output, ``--help`` for the rest). It needs no credentials,
no network and no package beyond the standard library. The default run takes about a minute
and a half, 40 s of it the bounded-memory row.

The fake FCM server
    A fake FCM server runs in separate processes (this script re-run with a hidden ``--serve``
    flag) on 127.0.0.1 with the test certificates from ``test_andpush.py``, in two kinds:

    * HTTP/1.1 only (tables 1 and 2 but their last row): keep-alive, no ALPN, a thread per
      connection. Clients that offer HTTP/2, andpush among them, fall back to HTTP/1.1. After
      an optional per-answer delay that stands in for FCM's latency it answers ``POST
      /fcm/send`` (legacy API) with a legacy success, ``POST /v1/projects/<p>/messages:send``
      (v1 API) with ``{"name": ...}``, and ``POST /token`` (the OAuth2 token endpoint of the
      peers' service accounts) with an access token.
    * HTTP/2 (table 3 and the bounded-memory row): offers ``h2`` and ``http/1.1`` by ALPN. One
      thread runs a selector loop over non-blocking TLS sockets: it reads the client's frames
      without decoding their HPACK, answers SETTINGS and PING, gives the client's windows
      back with WINDOW_UPDATEs as its DATA arrives, and answers every stream that ends, after
      the delay (a timer queue; answers go out about 0.2 ms after it, see ``srv delay`` in
      table 3), with constant frames: HEADERS ``:status 200`` and ``content-type`` and DATA
      ``{"name": ...}``; one send per connection per turn of the loop. Its SETTINGS are those
      of Google's front end: MAX_CONCURRENT_STREAMS 100 (``--h2-max-streams`` changes it;
      andpush opens a connection per 100 streams in flight), INITIAL_WINDOW_SIZE 1 MiB. A
      client that does not pick h2 (``andpush.new(http2=False)``) gets the HTTP/1.1 serving
      above, on a thread of its own. It costs some 5 to 8 us of CPU per HTTP/2 answer, against
      80 to 140 us per HTTP/1.1 answer (handshakes included).

    Each kind and answer delay gets its own server processes (``--server-processes``,
    sharing one port with SO_REUSEPORT); every row reports how busy they were, so a row
    limited by the server rather than by the client says so. Client and server share the
    machine's cores: a client that keeps a core busy leaves the server the others.

Table 1: sequential pushes (one message at a time, zero answer delay, HTTP/1.1)
    * ``andpush push() (keep-alive)``: one andpush client calling ``client.push(payload)`` over
      and over (legacy API); what the library costs for sequential sending.
    * ``andpush push() v1 (keep-alive)``: the same with a v1 client (bearer token).
    * ``http.client, new connection per push``: a new ``http.client.HTTPSConnection`` for each
      push (TCP connect, TLS handshake, request, response, close), the way slow clients work.
    * ``raw socket (floor)``: one kept-alive TLS socket writing pre-built request bytes and
      reading just enough of the answer. No client can be much faster against this server, so
      andpush is compared with this floor (target: at least 0.60 of it).
    * peers, only when importable: ``pyfcm notify()`` and ``firebase-admin messaging.send()``,
      both v1 over requests, pointed at the fake server (see "Peers" below).

    Each row is set up and warmed up first. Then the rows take turns: every round runs each
    row for one timed sample, so background load hits all rows alike. ``rate`` is the mean of
    the samples' pushes per second, ``spread`` their standard deviation in percent of the mean
    (large: a noisy machine, rerun before trusting small differences), ``comparison`` how many
    times slower a row is than the fastest; ``client``, ``server`` and ``bound by`` as in
    table 2.

Table 2: bulk sends (the rows of issue 4; v1 API, ``andpush.new(access_token=...)``)
    Each row sends a fixed number of messages once, after an untimed set-up and warm-up.
    Issue 4 set these rows' targets before andpush spoke HTTP/2, for HTTP/1.1 with a thread and
    a connection per message in flight: its latency-bound rows keep to HTTP/1.1
    (``andpush.new(http2=False)`` against the HTTP/1.1 server), as do the peers, which speak
    nothing else. The bounded-memory row goes over HTTP/2, push_many's path against FCM now
    (and several times faster here). Column ``protocol`` says which a row used.

    * latency-bound, every answer delayed by ``--delay-ms`` (50 ms):
      ``andpush push_many`` of 5,000 messages at concurrency 100 and ``andpush push()``
      sequentially (a few dozen messages: at 50 ms each that is all it manages); ideal rates
      are concurrency / latency = 2,000 and 20 messages/s; target: push_many at least 0.80 of
      its ideal. Next to them the peers: ``firebase-admin send_each`` (chunks of 500) and
      ``pyfcm notify()`` sequentially.
    * "10 million in an hour": ``push_many`` of 20,000 messages at concurrency 200 and 50 ms
      (ideal 4,000/s). Target: at least 3,000 messages/s (10 million an hour is 2,778/s).
    * bounded memory: ``push_many`` of 1,000,000 messages from a generator at concurrency 50
      and zero delay, over HTTP/2 (``--quick``: 20,000, which says little about memory).
      Target: peak resident memory grows by less than 50 MB while it runs.

    Columns: ``msg/s`` is messages per second over the whole row (connection set-up included),
    ``of ideal`` that rate divided by concurrency / latency (capped as in table 3), ``CPU/msg``
    the client process's CPU time (``time.process_time()``, all its threads, not the
    server's) per message,
    ``csw/msg`` the client process's context switches per message (``ru_nvcsw + ru_nivcsw``:
    threads blocking on sockets, locks and the GIL), ``client`` and ``server`` their CPU time
    as a share of one core over the row's wall time (the server's: its busiest process),
    ``conns`` the TCP connections the server accepted during the row, ``peak RSS +`` how much
    the client's peak resident memory grew during the row (Linux: ``VmHWM`` after resetting it
    through ``/proc/self/clear_refs``; elsewhere ``ru_maxrss``, which can only show growth
    past the earlier peak). ``bound by`` is the verdict: ``latency`` (nobody is busy: the row
    waits on the answer delay), ``client CPU`` (the client process uses 75% of a core or more:
    with Python's GIL about all its threads get), ``server CPU`` (a server process uses 85% of
    a core or more: the row measures the fake server, not the client; try
    ``--server-processes 2``) or ``both cores`` (client and server together use 1.7 cores or
    more of the machine's); with no answer delay and nobody saturated, ``round trips``: client
    and server take turns, each waiting for the other (table 1's sequential rows). The header
    gives the machine's load average: other work on the machine slows every row, so compare
    runs made under similar load.

Table 3: push_many over HTTP/2 and over HTTP/1.1 (issue 6; v1 API, 50 ms answer delay)
    ``andpush push_many`` against the HTTP/2 server at concurrency 100, 500 and 700, over
    HTTP/2 (andpush's default: it multiplexes streams on a connection per 100 of them, all
    driven by one thread) and over HTTP/1.1 (``http2=False``: a thread and a connection per
    unit of concurrency, 700 threads at 700). Messages per row: 8,000, 30,000 and 42,000 over
    HTTP/2, a few seconds each; 5,000, 10,000 and 10,000 over HTTP/1.1, which is slower
    (``--quick``: fewer). ``ideal`` is concurrency / latency, capped by what the row can
    reach: its messages need at least ceil(messages / concurrency) answer delays one after
    another, and a row whose messages are no multiple of its concurrency says so (the rates
    include each row's connection set-up, TLS handshakes and all, which the ideal does not).
    ``CPU s/1k`` is the client process's CPU seconds (``time.process_time()``, all its
    threads) per 1,000 messages, ``srv delay`` how long after reading a request the HTTP/2
    server answered it on average (the fake latency plus the server's own lateness), ``h2
    conns`` how many of the row's connections the server saw pick h2 by ALPN: all of them in
    an HTTP/2 row, none in an HTTP/1.1 row, or the row fails (so an HTTP/2 row measures
    andpush's HTTP/2 path, not a fallback). Other columns as in table 2.

    Targets, for the HTTP/2 rows: at least 10,000 messages/s from one process (the best of
    the three concurrencies), at most 0.03 s of client CPU per 1,000 messages, and at least
    0.90 of the ideal (10,000/s at concurrency 500, 14,000/s at 700). The lines under the
    table compare HTTP/2 with HTTP/1.1 at each concurrency and say which rows the server
    limited.

Peers
    firebase-admin and pyfcm are used only when importable; bench.py never requires them (to
    see them: ``python3 -m venv /tmp/peers && /tmp/peers/bin/pip install firebase-admin
    pyfcm``, then run bench.py with ``/tmp/peers/bin/python``). Both keep FCM's URL in class
    constants, which bench.py patches (``firebase_admin.messaging._MessagingService.FCM_URL``,
    ``pyfcm.baseapi.BaseAPI.FCM_END_POINT_BASE``, set on the instance); both get a generated
    service account whose ``token_uri`` is the fake server's ``/token``, and trust the test CA
    through ``REQUESTS_CA_BUNDLE`` (requests) and ``SSL_CERT_FILE``. firebase-admin mounts a
    requests pool of 100 connections for the real FCM host only; bench.py mounts the same pool
    for the local server so the peer works as it would against FCM. ``send_each`` sends a
    chunk's 500 messages on 500 threads at once; chunks go one after another. The lines under
    table 2 give andpush's rate divided by each peer's.

Adding a row
    Table 1: write a ``Runner`` (set up in ``__init__``; ``step()`` sends one or more pushes
    and returns how many; ``close()`` cleans up) and add a ``Row`` to ``ROWS``. Table 2: write
    a ``BulkRunner`` (set up and warm up in ``__init__``; ``send(count)`` sends ``count``
    messages and returns a ``Sent``) and add a ``BulkRow`` to ``bulk_rows()`` (``table=3``
    for table 3; ``http2`` and ``h2_max_streams`` choose the client's and the server's
    protocol).

``--profile TEXT`` runs the first bulk row (table 2 or 3) whose name contains TEXT under
cProfile, one profiler per client thread (the HTTP/2 sender's among them) timed by that
thread's CPU time (``time.thread_time``: waiting on sockets and the GIL does not count),
merged, and prints where the client's CPU goes. The profiler slows the client several times
over, which changes the row's dynamics: lock waits look larger than they are, so read it for
the share of the andpush functions, not the rate.
"""

import argparse
import cProfile
import collections
import http.client
import importlib.util
import io
import itertools
import json
import logging
import math
import os
import platform
import pstats
import selectors
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import (
    Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple,
)

try:
    import resource  # Unix only: peak memory and context switches
except ImportError:
    resource = None  # type: ignore[assignment]

import andpush
from test_andpush import (
    TEST_CA_PEM, TEST_RSA_KEY_PKCS8_PEM, TEST_SERVER_CERT_PEM, TEST_SERVER_KEY_PEM,
)

# What is sent ##################################################################################

FCM_PATH = "/fcm/send"
SERVER_KEY = "bench-server-key"
PROJECT = "p"
V1_PATH_PREFIX = "/v1/projects/"
DEVICE_TOKEN = "bench-registration-token:" + "APA91bH3x9Qd-7kL2mZ" * 7
PAYLOAD = {  # a legacy push (table 1)
    "to": DEVICE_TOKEN,
    "notification": {"title": "Benchmark", "body": "andpush offline benchmark push"},
    "data": {"kind": "bench", "id": "12345"},
}
V1_MESSAGE = {  # the same push as a v1 message (table 2 and the v1 rows of table 1)
    "token": DEVICE_TOKEN,
    "notification": {"title": "Benchmark", "body": "andpush offline benchmark push"},
    "data": {"kind": "bench", "id": "12345"},
}


def v1_messages(count: int) -> Iterator[Dict[str, Any]]:
    """``count`` distinct v1 messages, made one at a time as they are read."""
    notification = V1_MESSAGE["notification"]
    for number in range(count):
        yield {"token": DEVICE_TOKEN, "notification": notification,
               "data": {"kind": "bench", "id": str(number)}}


# The fake FCM server ###########################################################################
# Thread per connection, chosen after measuring it against a selectors loop and asyncio
# (protocols and streams) on one kept-alive connection: blocking recv/sendall in a thread costs
# the server the least CPU per request, and time.sleep() in a connection's own thread delays
# that answer precisely without holding up any other connection. Several processes can share
# one port (SO_REUSEPORT) when one process is not enough.


def http_response(status: str, body: bytes, keep_alive: bool = True) -> bytes:
    head = "HTTP/1.1 %s\r\nContent-Type: application/json; charset=UTF-8\r\n" % status
    if not keep_alive:
        head += "Connection: close\r\n"
    head += "Content-Length: %d\r\n\r\n" % len(body)
    return head.encode("ascii") + body


LEGACY_BODY = (
    b'{"multicast_id":1,"success":1,"failure":0,"canonical_ids":0,'
    b'"results":[{"message_id":"0:1"}]}'
)
V1_BODY = b'{"name":"projects/p/messages/0:1"}'
TOKEN_BODY = b'{"access_token":"x","expires_in":3600,"token_type":"Bearer"}'
# (request line prefix, answer with keep-alive, answer with Connection: close)
ROUTES = [
    (b"POST " + FCM_PATH.encode("ascii") + b" ",
     http_response("200 OK", LEGACY_BODY), http_response("200 OK", LEGACY_BODY, False)),
    (b"POST " + V1_PATH_PREFIX.encode("ascii"),
     http_response("200 OK", V1_BODY), http_response("200 OK", V1_BODY, False)),
    (b"POST /token ",
     http_response("200 OK", TOKEN_BODY), http_response("200 OK", TOKEN_BODY, False)),
]
NOT_FOUND_RESPONSE = http_response("404 Not Found", b'{"error":"not found"}')
LENGTH_REQUIRED_RESPONSE = http_response(
    "411 Length Required", b'{"error":"Content-Length required"}', keep_alive=False
)


def answer_request(head: bytes) -> Tuple[bytes, int, bool]:
    """Answer a request from its head (up to the blank line).

    Returns the response bytes, the request body's length and whether to keep the connection.
    A v1 request is answered whatever its project, when its path ends in ``:send``.
    """
    lower = head.lower()
    if b"\r\ntransfer-encoding:" in lower:
        return LENGTH_REQUIRED_RESPONSE, 0, False
    length = 0
    start = lower.find(b"\r\ncontent-length:")
    if start >= 0:
        end = lower.find(b"\r\n", start + 2)
        length = int(lower[start + 17 : end if end >= 0 else len(lower)])
    line_end = lower.find(b"\r\n")
    request_line = head if line_end < 0 else head[:line_end]
    keep_alive = b"\r\nconnection: close" not in lower and not request_line.endswith(b"/1.0")
    for prefix, keep_answer, close_answer in ROUTES:
        if request_line.startswith(prefix):
            if prefix.startswith(b"POST /v1/") and b":send " not in request_line:
                break
            return (keep_answer if keep_alive else close_answer), length, keep_alive
    return NOT_FOUND_RESPONSE, length, keep_alive


class Tally:
    """A count that threads bump without a lock (``itertools.count`` is atomic under the GIL).

    Only one thread reads it (the one answering STATS); reading a count means advancing it,
    so the reads made so far are subtracted.
    """

    def __init__(self) -> None:
        self._count = itertools.count()
        self._reads = 0

    def add(self) -> None:
        next(self._count)

    def value(self) -> int:
        value = next(self._count) - self._reads
        self._reads += 1
        return value


def serve_connection(conn: socket.socket, context: ssl.SSLContext, delay: float,
                     answered: Tally) -> None:
    """Answer the HTTP/1.1 requests on one connection until the client closes it."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock = context.wrap_socket(conn, server_side=True)
    except OSError:
        conn.close()
        return
    serve_requests(sock, delay, answered)


def serve_requests(sock: ssl.SSLSocket, delay: float, answered: Tally) -> None:
    """Answer HTTP/1.1 requests on a (blocking) TLS socket until the client closes it."""
    with sock:
        buffer = b""
        while True:
            try:
                data = sock.recv(16384)
            except OSError:
                return
            if not data:
                return
            buffer = buffer + data if buffer else data
            while True:  # every complete request in the buffer (pipelining)
                head_end = buffer.find(b"\r\n\r\n")
                if head_end < 0:
                    break
                response, length, keep_alive = answer_request(buffer[:head_end])
                request_end = head_end + 4 + length
                if len(buffer) < request_end:
                    break
                buffer = buffer[request_end:]
                if delay:
                    time.sleep(delay)
                try:
                    sock.sendall(response)
                except OSError:
                    return
                answered.add()
                if not keep_alive:
                    return


# HTTP/2 (the ``--h2-max-streams`` server groups) -----------------------------------------------
# One thread runs a selector loop over non-blocking TLS sockets: TLS handshakes, HTTP/2 frames
# in, answers out after the delay, one send per connection per turn of the loop. A client that
# does not pick h2 by ALPN gets a thread of its own with the HTTP/1.1 serving above. The request
# headers are not decoded: every stream that ends is answered as a v1 send, with a constant
# HPACK block. What it sends first is what Google's front end (GFE) sends (nghttp -v against
# www.google.com): SETTINGS MAX_CONCURRENT_STREAMS 100, INITIAL_WINDOW_SIZE 1 MiB,
# MAX_HEADER_LIST_SIZE 16384, then a WINDOW_UPDATE of the connection to 1 MiB; the streams'
# limit is ``--h2-max-streams``. It does not track its own send windows: the answers are tiny
# and andpush lets a server send 16 MiB ahead, acknowledged as it reads.

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_DATA, H2_HEADERS, H2_RST_STREAM, H2_SETTINGS, H2_PING, H2_WINDOW_UPDATE, H2_CONTINUATION = (
    0, 1, 3, 4, 6, 8, 9)
H2_END_STREAM = H2_ACK = 0x1
H2_END_HEADERS = 0x4
H2_WINDOW = 1 << 20  # GFE's: the stream windows (INITIAL_WINDOW_SIZE) and the connection's
H2_GFE_MAX_STREAMS = 100  # GFE's SETTINGS_MAX_CONCURRENT_STREAMS


def h2_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


def h2_server_preface(max_streams: int) -> bytes:
    """The server's SETTINGS and its connection WINDOW_UPDATE, as GFE sends them."""
    settings = b"".join(name.to_bytes(2, "big") + value.to_bytes(4, "big") for name, value in (
        (0x3, max_streams), (0x4, H2_WINDOW), (0x6, 16384)))
    return (h2_frame(H2_SETTINGS, 0, 0, settings)
            + h2_frame(H2_WINDOW_UPDATE, 0, 0, (H2_WINDOW - 65535).to_bytes(4, "big")))


H2_SETTINGS_ACK = h2_frame(H2_SETTINGS, H2_ACK, 0)
H2_CONTENT_TYPE = b"application/json; charset=UTF-8"
# HPACK: ":status: 200" is static entry 8 (0x88); content-type, static name 31, as a literal
# without indexing (4-bit prefix: 15, then 31 - 15 = 16) with a plain 31-byte value.
H2_RESPONSE_BLOCK = b"\x88\x0f\x10" + bytes((len(H2_CONTENT_TYPE),)) + H2_CONTENT_TYPE
# An answer is HEADERS (END_HEADERS) and DATA (END_STREAM): H2_ANSWER_HEAD, the stream id,
# H2_ANSWER_MIDDLE, the stream id, V1_BODY.
H2_ANSWER_HEAD = len(H2_RESPONSE_BLOCK).to_bytes(3, "big") + bytes((H2_HEADERS, H2_END_HEADERS))
H2_ANSWER_MIDDLE = (H2_RESPONSE_BLOCK + len(V1_BODY).to_bytes(3, "big")
                    + bytes((H2_DATA, H2_END_STREAM)))


class H2ServerConnection:
    """One client connection of the HTTP/2 server: TLS handshake, then frames."""

    def __init__(self, sock: ssl.SSLSocket, max_streams: int) -> None:
        self.sock = sock
        self.handshaking = True
        self.open = True
        self.writing = False  # registered for EVENT_WRITE
        self.preface = False  # the client's preface has come
        self.inbound = bytearray()
        self.out = bytearray(h2_server_preface(max_streams))
        self.unacknowledged = 0  # DATA bytes received and not yet given back by WINDOW_UPDATE
        self.ending: Optional[bytes] = None  # a HEADERS with END_STREAM awaiting CONTINUATION
        self.reset: Set[bytes] = set()  # streams the client reset: not answered

    def receive(self, data: bytes, ended: List[bytes]) -> None:
        """Handle the frames in ``data``; append the ids (4 bytes) of the streams that end."""
        buffer = self.inbound
        buffer += data
        offset = 0
        if not self.preface:
            if len(buffer) < len(H2_PREFACE):
                return
            if not buffer.startswith(H2_PREFACE):
                raise ConnectionError("not an HTTP/2 client preface")
            self.preface = True
            offset = len(H2_PREFACE)
        end = len(buffer)
        received = 0
        out = self.out
        while end - offset >= 9:
            length = int.from_bytes(buffer[offset:offset + 3], "big")
            stop = offset + 9 + length
            if stop > end:
                break
            kind = buffer[offset + 3]
            flags = buffer[offset + 4]
            if kind == H2_DATA:
                received += length
                if flags & H2_END_STREAM:
                    ended.append(bytes(buffer[offset + 5:offset + 9]))
                elif length:  # the stream goes on: give its window back
                    out += (b"\x00\x00\x04\x08\x00" + buffer[offset + 5:offset + 9]
                            + length.to_bytes(4, "big"))
            elif kind == H2_HEADERS:
                if flags & H2_END_STREAM:
                    if flags & H2_END_HEADERS:
                        ended.append(bytes(buffer[offset + 5:offset + 9]))
                    else:
                        self.ending = bytes(buffer[offset + 5:offset + 9])
            elif kind == H2_CONTINUATION:
                if flags & H2_END_HEADERS and self.ending is not None:
                    ended.append(self.ending)
                    self.ending = None
            elif kind == H2_SETTINGS:
                if not flags & H2_ACK:
                    out += H2_SETTINGS_ACK
            elif kind == H2_PING:
                if not flags & H2_ACK:
                    out += h2_frame(H2_PING, H2_ACK, 0, bytes(buffer[offset + 9:stop]))
            elif kind == H2_RST_STREAM:
                self.reset.add(bytes(buffer[offset + 5:offset + 9]))
            offset = stop
        del buffer[:offset]
        if received:  # the connection's window: given back once half of it is used
            self.unacknowledged += received
            if self.unacknowledged >= H2_WINDOW // 2:
                out += h2_frame(H2_WINDOW_UPDATE, 0, 0, self.unacknowledged.to_bytes(4, "big"))
                self.unacknowledged = 0

    def answer(self, stream_ids: List[bytes]) -> int:
        """Queue the answers of these streams; how many."""
        if not self.open:
            return 0
        if self.reset:
            reset = self.reset
            stream_ids = [s for s in stream_ids if s not in reset]
            reset.difference_update(stream_ids)
        self.out += b"".join([H2_ANSWER_HEAD + s + H2_ANSWER_MIDDLE + s + V1_BODY
                              for s in stream_ids])
        return len(stream_ids)


class H2Server:
    """The HTTP/2 server's selector loop (see above); HTTP/1.1 clients get a thread each."""

    def __init__(self, listener: socket.socket, context: ssl.SSLContext, delay: float,
                 max_streams: int) -> None:
        self.listener = listener
        self.context = context
        self.delay = delay
        self.max_streams = max_streams
        self.selector = selectors.DefaultSelector()
        # (when due, connection, stream ids, when read): one delay for all, so they come due
        # in the order they were read.
        self.timers: Deque[Tuple[float, H2ServerConnection, List[bytes], float]] = (
            collections.deque())
        self.dirty: Set[H2ServerConnection] = set()  # connections with output this turn
        self.h2_answered = 0
        self.h2_delay = 0.0  # seconds from reading the streams' ends to answering, summed
        self.http1_answered = Tally()
        self.connections = 0
        self.h2_connections = 0

    def stats(self) -> str:
        times = os.times()
        return "STATS %d %d %.4f %d %d %.6f" % (
            self.h2_answered + self.http1_answered.value(), self.connections,
            times.user + times.system, self.h2_connections, self.h2_answered, self.h2_delay)

    def run(self) -> None:
        """Serve until stdin closes; answer each STATS line on it."""
        selector = self.selector
        self.listener.setblocking(False)
        selector.register(self.listener, selectors.EVENT_READ, "listener")
        stdin = sys.stdin.buffer.fileno()
        selector.register(stdin, selectors.EVENT_READ, "stdin")
        print("READY %d" % self.listener.getsockname()[1], flush=True)
        timers = self.timers
        pending = b""
        while True:
            timeout = None
            if timers:
                # epoll waits whole milliseconds, rounded up: wait the whole ones, then sleep
                # the rest, so that answers are not up to a millisecond late.
                timeout = timers[0][0] - time.monotonic()
                if 0 < timeout < 0.001:
                    time.sleep(timeout)
                timeout = max(0.0, math.floor(timeout * 1000) / 1000)
            for key, events in selector.select(timeout):
                what = key.data
                if what == "listener":
                    self.accept()
                elif what == "stdin":
                    data = os.read(stdin, 4096)
                    if not data:
                        return
                    pending += data
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        if line.strip() == b"STATS":
                            print(self.stats(), flush=True)
                elif what.handshaking:
                    self.handshake(what)
                else:
                    if events & selectors.EVENT_READ:
                        self.read(what)
                    if events & selectors.EVENT_WRITE:
                        self.dirty.add(what)
            now = time.monotonic()
            while timers and timers[0][0] <= now:
                _, connection, stream_ids, read_at = timers.popleft()
                answered = connection.answer(stream_ids)
                self.h2_answered += answered
                self.h2_delay += answered * (now - read_at)
                self.dirty.add(connection)
            for connection in self.dirty:
                self.flush(connection)
            self.dirty.clear()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.connections += 1
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            sock = self.context.wrap_socket(conn, server_side=True,
                                            do_handshake_on_connect=False)
            connection = H2ServerConnection(sock, self.max_streams)
            self.selector.register(sock, selectors.EVENT_READ, connection)
            self.handshake(connection)

    def handshake(self, connection: H2ServerConnection) -> None:
        sock = connection.sock
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self.selector.modify(sock, selectors.EVENT_READ, connection)
            return
        except ssl.SSLWantWriteError:
            self.selector.modify(sock, selectors.EVENT_WRITE, connection)
            return
        except OSError:
            self.close(connection)
            return
        connection.handshaking = False
        if sock.selected_alpn_protocol() != "h2":  # HTTP/1.1: a thread of its own
            self.selector.unregister(sock)
            sock.setblocking(True)
            threading.Thread(target=serve_requests, args=(sock, self.delay,
                                                          self.http1_answered),
                             daemon=True).start()
            return
        self.h2_connections += 1
        self.selector.modify(sock, selectors.EVENT_READ, connection)
        self.read(connection)  # the preface may have come with the handshake's last flight
        self.dirty.add(connection)  # our SETTINGS

    def read(self, connection: H2ServerConnection) -> None:
        """Read all the socket has, handle the frames, and schedule the streams that ended."""
        ended: List[bytes] = []
        sock = connection.sock
        while True:
            try:
                data = sock.recv(262144)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                break
            except OSError:
                self.close(connection)
                return
            if not data:
                self.close(connection)
                return
            try:
                connection.receive(data, ended)
            except ConnectionError:
                self.close(connection)
                return
        if ended:
            if self.delay:
                now = time.monotonic()
                self.timers.append((now + self.delay, connection, ended, now))
            else:
                self.h2_answered += connection.answer(ended)
        if connection.out:
            self.dirty.add(connection)

    def flush(self, connection: H2ServerConnection) -> None:
        """One send of what the connection has to say; wait for EVENT_WRITE if not all went."""
        if not connection.open or not connection.out:
            return
        try:
            sent = connection.sock.send(connection.out)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
            sent = 0
        except OSError:
            self.close(connection)
            return
        del connection.out[:sent]
        writing = bool(connection.out)
        if writing != connection.writing:
            connection.writing = writing
            self.selector.modify(connection.sock, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if writing else 0), connection)

    def close(self, connection: H2ServerConnection) -> None:
        if connection.open:
            connection.open = False
            self.selector.unregister(connection.sock)
            connection.sock.close()


def serve(cert_file: str, key_file: str, delay_ms: float, port: int, h2_max_streams: int) -> int:
    """Run one fake server process (the ``--serve`` child).

    It says ``READY <port>``, then answers each ``STATS`` line on its stdin with ``STATS
    <requests> <connections> <cpu seconds> <h2 connections> <h2 answers> <h2 answer delay
    seconds, summed>`` (counts since it started) and
    exits, after one last STATS line, when its stdin closes. ``port`` 0 picks a free port;
    processes sharing a port all listen with SO_REUSEPORT, and the kernel spreads the
    connections between them. ``h2_max_streams`` above 0 makes it offer h2 by ALPN (the
    selector loop of H2Server); 0 makes it an HTTP/1.1 server without ALPN.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if hasattr(socket, "SO_REUSEPORT"):
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    if h2_max_streams:
        context.set_alpn_protocols(["h2", "http/1.1"])
        server = H2Server(listener, context, delay_ms / 1000.0, h2_max_streams)
        server.run()
        listener.close()
        print(server.stats(), flush=True)
        return 0
    answered = Tally()
    connections = Tally()

    def accept_forever() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.add()
            threading.Thread(
                target=serve_connection, args=(conn, context, delay_ms / 1000.0, answered),
                daemon=True,
            ).start()

    def stats() -> str:
        times = os.times()
        return "STATS %d %d %.4f 0 0 0" % (answered.value(), connections.value(),
                                           times.user + times.system)

    threading.Thread(target=accept_forever, daemon=True).start()
    print("READY %d" % listener.getsockname()[1], flush=True)
    for line in sys.stdin.buffer:  # until the parent closes the pipe (or dies)
        if line.strip() == b"STATS":
            print(stats(), flush=True)
    listener.close()
    print(stats(), flush=True)
    return 0


@dataclass
class ServerStats:
    requests: int = 0
    connections: int = 0
    cpu_seconds: float = 0.0
    h2_connections: int = 0  # of the connections, those whose client picked h2 by ALPN
    h2_answers: int = 0  # of the requests, those answered over h2 ...
    h2_delay_seconds: float = 0.0  # ... and their delays (streams' ends read to answers), summed

    def __sub__(self, earlier: "ServerStats") -> "ServerStats":
        return ServerStats(self.requests - earlier.requests,
                           self.connections - earlier.connections,
                           self.cpu_seconds - earlier.cpu_seconds,
                           self.h2_connections - earlier.h2_connections,
                           self.h2_answers - earlier.h2_answers,
                           self.h2_delay_seconds - earlier.h2_delay_seconds)


def parse_stats(line: bytes) -> Optional[ServerStats]:
    fields = line.decode("ascii", "replace").split()
    if len(fields) == 7 and fields[0] == "STATS":
        return ServerStats(int(fields[1]), int(fields[2]), float(fields[3]), int(fields[4]),
                           int(fields[5]), float(fields[6]))
    return None


def mean_h2_delay_ms(stats: Sequence[ServerStats]) -> Optional[float]:
    """How long after reading a stream's end the HTTP/2 server answered it, on average."""
    answers = sum(s.h2_answers for s in stats)
    return 1000 * sum(s.h2_delay_seconds for s in stats) / answers if answers else None


@dataclass(frozen=True)
class ServerKind:
    """What a group of server processes does: its answer delay, and whether it offers h2."""

    delay_ms: float
    h2_max_streams: int = 0  # 0: HTTP/1.1 without ALPN; else h2 with this many streams

    def describe(self) -> str:
        if self.h2_max_streams:
            return ("selector loop offering h2 (MAX_CONCURRENT_STREAMS %d) and HTTP/1.1 "
                    "(a thread per connection), answer delay %g ms"
                    % (self.h2_max_streams, self.delay_ms))
        return "HTTP/1.1 only, thread per connection, answer delay %g ms" % self.delay_ms


class FakeServer:
    """The parent's handle on one fake server process."""

    def __init__(self, cert_file: str, key_file: str, kind: ServerKind, port: int = 0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port),
             "--cert", cert_file, "--key", key_file,
             "--server-delay-ms", str(kind.delay_ms), "--server-h2-streams",
             str(kind.h2_max_streams)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode("ascii", "replace").split()
        if len(line) != 2 or line[0] != "READY":
            self.process.kill()
            raise RuntimeError("fake FCM server did not start (said %r)" % " ".join(line))
        self.port = int(line[1])

    def stats(self) -> ServerStats:
        """The counts so far (requests, connections, CPU seconds since it started)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"STATS\n")
        self.process.stdin.flush()
        return parse_stats(self.process.stdout.readline()) or ServerStats()

    def stop(self) -> ServerStats:
        """Close the server's stdin so that it exits, and collect what it reports."""
        try:
            out, _ = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return ServerStats()
        lines = out.splitlines()
        return (parse_stats(lines[-1]) if lines else None) or ServerStats()


class ServerGroup:
    """The processes of one ServerKind, all listening on one port."""

    def __init__(self, cert_file: str, key_file: str, kind: ServerKind, processes: int) -> None:
        self.kind = kind
        first = FakeServer(cert_file, key_file, kind)
        self.members = [first] + [FakeServer(cert_file, key_file, kind, first.port)
                                  for _ in range(processes - 1)]
        self.port = first.port

    def stats(self) -> List[ServerStats]:
        return [member.stats() for member in self.members]

    def stop(self) -> List[ServerStats]:
        return [member.stop() for member in self.members]


class Servers:
    """Fake servers started on demand, one group of processes per ServerKind."""

    def __init__(self, cert_file: str, key_file: str, processes: int) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.processes = processes
        self.running: Dict[ServerKind, ServerGroup] = {}

    def group(self, kind: ServerKind) -> ServerGroup:
        if kind not in self.running:
            self.running[kind] = ServerGroup(self.cert_file, self.key_file, kind,
                                             self.processes)
        return self.running[kind]

    def target(self, kind: ServerKind, http2: bool = True) -> "Target":
        return Target("127.0.0.1", self.group(kind).port, client_ssl_context(), http2)

    def stop_all(self) -> Dict[ServerKind, List[ServerStats]]:
        stats = {kind: group.stop() for kind, group in self.running.items()}
        self.running.clear()
        return stats


# Clients ######################################################################################


def client_ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context(cadata=TEST_CA_PEM)


@dataclass
class Target:
    """Where a row sends its pushes, and whether andpush may offer h2 there."""

    host: str
    port: int
    ssl_context: ssl.SSLContext
    http2: bool = True  # andpush.new(http2=...)

    @property
    def endpoint(self) -> str:
        return "https://%s:%d" % (self.host, self.port)


def andpush_v1(target: Target) -> andpush.Client:
    """A v1 andpush client with a fixed access token (no token endpoint involved)."""
    return andpush.new(access_token="x", project_id=PROJECT, endpoint=target.endpoint,
                       ssl_context=target.ssl_context, http2=target.http2)


class Skipped(Exception):
    """A row that cannot run here (a peer that is not installed); the reason is its text."""


def check_status(status: int, row: str) -> None:
    if status != 200:
        raise RuntimeError("%s: fake server answered HTTP %d" % (row, status))


# Peers: firebase-admin and pyfcm, only when importable ########################################

PEER_MODULES = {"firebase-admin": "firebase_admin", "pyfcm": "pyfcm"}


def require_peer(name: str) -> None:
    """Raise Skipped unless the peer's package can be imported here."""
    if importlib.util.find_spec(PEER_MODULES[name]) is None:
        raise Skipped("%s is not installed (pip install %s)" % (name, name))


def service_account(target: Target) -> Dict[str, str]:
    """A service account key whose token endpoint is the fake server's ``/token``."""
    return {
        "type": "service_account",
        "project_id": PROJECT,
        "private_key_id": "bench-key",
        "private_key": TEST_RSA_KEY_PKCS8_PEM,
        "client_email": "bench@p.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": target.endpoint + "/token",
    }


def trust_test_ca(ca_file: str) -> None:
    """Make requests (and httpx, aiohttp) trust the test CA: the peers verify with it."""
    os.environ["REQUESTS_CA_BUNDLE"] = ca_file
    os.environ["SSL_CERT_FILE"] = ca_file
    # requests warns for each connection that a full pool discards (firebase-admin's 500
    # threads share 100 pooled connections): a flood of lines, not a result.
    logging.getLogger("urllib3").setLevel(logging.ERROR)


class FirebaseAdmin:
    """A firebase-admin App whose messaging service sends to the fake server."""

    names = itertools.count()

    def __init__(self, target: Target) -> None:
        require_peer("firebase-admin")
        import firebase_admin
        import requests
        from firebase_admin import _http_client, credentials, messaging

        self.firebase_admin = firebase_admin
        self.messaging = messaging
        self.app = firebase_admin.initialize_app(
            credentials.Certificate(service_account(target)),
            name="andpush-bench-%d" % next(self.names),
        )
        try:
            service = self._service_at(target.endpoint, messaging)
        except AttributeError as exc:  # a version that keeps its URL elsewhere
            firebase_admin.delete_app(self.app)
            raise Skipped("firebase-admin %s cannot be pointed at the local server: %s"
                          % (getattr(firebase_admin, "__version__", "?"), exc)) from exc
        # What firebase-admin mounts for https://fcm.googleapis.com, mounted for our server.
        service._client.session.mount(target.endpoint, requests.adapters.HTTPAdapter(
            pool_connections=100, pool_maxsize=100,
            max_retries=_http_client.DEFAULT_RETRY_CONFIG,
        ))
        self.message = messaging.Message(
            token=DEVICE_TOKEN,
            notification=messaging.Notification(title="Benchmark",
                                                body="andpush offline benchmark push"),
            data={"kind": "bench", "id": "12345"},
        )

    def _service_at(self, endpoint: str, messaging: Any) -> Any:
        """The app's messaging service, made while FCM_URL points at ``endpoint``.

        The service reads the constant once, when it is made: patch it around that only.
        """
        service_class = messaging._MessagingService
        original = service_class.FCM_URL
        service_class.FCM_URL = endpoint + V1_PATH_PREFIX + "{0}/messages:send"
        try:
            return messaging._get_messaging_service(self.app)
        finally:
            service_class.FCM_URL = original

    def close(self) -> None:
        self.firebase_admin.delete_app(self.app)


class Pyfcm:
    """A pyfcm FCMNotification that sends to the fake server."""

    def __init__(self, target: Target) -> None:
        require_peer("pyfcm")
        import pyfcm
        from google.oauth2 import service_account as google_service_account
        from pyfcm import FCMNotification

        if not hasattr(FCMNotification, "FCM_END_POINT_BASE"):  # pyfcm 1.x: legacy API only
            raise Skipped("pyfcm %s cannot be pointed at the local server: no "
                          "FCMNotification.FCM_END_POINT_BASE (pyfcm 2 has it)"
                          % getattr(pyfcm, "__version__", "?"))

        credentials = google_service_account.Credentials.from_service_account_info(
            service_account(target),
            scopes=["https://www.googleapis.com/auth/firebase.messaging"],
        )
        self.fcm = FCMNotification(credentials=credentials, project_id=PROJECT)
        # pyfcm builds its URL from this class constant; shadow it on our instance only.
        self.fcm.FCM_END_POINT_BASE = target.endpoint + "/v1/projects"

    def notify(self) -> None:
        answer = self.fcm.notify(
            fcm_token=DEVICE_TOKEN, notification_title="Benchmark",
            notification_body="andpush offline benchmark push",
            data_payload={"kind": "bench", "id": "12345"},
        )
        if not answer.get("name"):
            raise RuntimeError("pyfcm: unexpected answer %r" % (answer,))


# Table 1: sequential pushes, one Runner per row ###############################################


class Runner:
    """One row's client. ``step()`` sends one or more pushes and returns how many it sent."""

    def step(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class AndpushRunner(Runner):
    """``client.push(payload)`` in a loop on one andpush client (one kept-alive connection)."""

    def __init__(self, target: Target) -> None:
        self.client = andpush.new(SERVER_KEY, endpoint=target.endpoint,
                                  ssl_context=target.ssl_context)
        response = self.client.push(PAYLOAD)
        check_status(response.status_code, "andpush")
        if response.json().get("success") != 1:
            raise RuntimeError("andpush: unexpected response JSON %r" % (response.json(),))

    def step(self) -> int:
        if self.client.push(PAYLOAD).status_code != 200:
            raise RuntimeError("andpush: fake server did not answer HTTP 200")
        return 1

    def close(self) -> None:
        self.client.close()


class AndpushV1Runner(Runner):
    """``client.push(message)`` in a loop on one v1 andpush client."""

    def __init__(self, target: Target) -> None:
        self.client = andpush_v1(target)
        response = self.client.push(V1_MESSAGE)
        if not response.json().get("name"):
            raise RuntimeError("andpush v1: unexpected response JSON %r" % (response.json(),))

    def step(self) -> int:
        self.client.push(V1_MESSAGE)  # raises unless 2xx
        return 1

    def close(self) -> None:
        self.client.close()


class NewConnectionRunner(Runner):
    """A new ``http.client.HTTPSConnection`` per push: connect, handshake, request, close."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.headers = {"Authorization": "key=" + SERVER_KEY, "Content-Type": "application/json"}
        self.step()

    def step(self) -> int:
        conn = http.client.HTTPSConnection(
            self.target.host, self.target.port, context=self.target.ssl_context
        )
        try:
            conn.request("POST", FCM_PATH, body=json.dumps(PAYLOAD).encode("utf-8"),
                         headers=self.headers)
            response = conn.getresponse()
            json.loads(response.read())
        finally:
            conn.close()
        check_status(response.status, "http.client")
        return 1


def raw_request(target: Target) -> bytes:
    """The bytes of one push request, built once (the headers http.client would send)."""
    body = json.dumps(PAYLOAD).encode("utf-8")
    head = (
        "POST %s HTTP/1.1\r\nHost: %s:%d\r\nAccept-Encoding: identity\r\n"
        "Authorization: key=%s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (FCM_PATH, target.host, target.port, SERVER_KEY, len(body))
    )
    return head.encode("ascii") + body


class RawSocketRunner(Runner):
    """Pre-built request bytes on one kept-alive TLS socket: the floor for this server."""

    def __init__(self, target: Target) -> None:
        self.request = raw_request(target)
        sock = socket.create_connection((target.host, target.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = target.ssl_context.wrap_socket(sock, server_hostname=target.host)
        self.step()

    def step(self) -> int:
        sock = self.sock
        sock.sendall(self.request)
        data = sock.recv(16384)
        while True:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                head = data[:head_end].lower()
                start = head.find(b"\r\ncontent-length:") + 17
                end = head.find(b"\r\n", start)
                length = int(head[start : end if end >= 0 else len(head)])
                if len(data) >= head_end + 4 + length:
                    break
            more = sock.recv(16384)
            if not more:
                raise ConnectionError("raw socket: server closed the connection")
            data += more
        if not data.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError("raw socket: unexpected answer %r" % data[:40])
        return 1

    def close(self) -> None:
        self.sock.close()


class PyfcmRunner(Runner):
    """pyfcm ``notify()`` in a loop (v1 API over a requests session)."""

    def __init__(self, target: Target) -> None:
        self.peer = Pyfcm(target)
        self.step()

    def step(self) -> int:
        self.peer.notify()
        return 1


class FirebaseSendRunner(Runner):
    """firebase-admin ``messaging.send(message)`` in a loop (v1 API over requests)."""

    def __init__(self, target: Target) -> None:
        self.peer = FirebaseAdmin(target)
        self.step()

    def step(self) -> int:
        self.peer.messaging.send(self.peer.message, app=self.peer.app)
        return 1

    def close(self) -> None:
        self.peer.close()


@dataclass
class Row:
    """One line of table 1: a way of sending pushes, and what it is compared with."""

    name: str
    make: Callable[[Target], Runner]
    delay_ms: float = 0.0  # the fake server waits this long before each answer
    baseline: Optional[str] = None  # name of the row this one is compared with ...
    target: Optional[float] = None  # ... and the least rate / baseline rate it should reach


RAW_FLOOR = "raw socket (floor)"
ANDPUSH_PUSH = "andpush push() (keep-alive)"
ANDPUSH_PUSH_V1 = "andpush push() v1 (keep-alive)"
PYFCM_NOTIFY = "pyfcm notify() (peer)"
FIREBASE_SEND = "firebase-admin messaging.send() (peer)"

ROWS: List[Row] = [
    Row(ANDPUSH_PUSH, AndpushRunner, baseline=RAW_FLOOR, target=0.60),
    Row(ANDPUSH_PUSH_V1, AndpushV1Runner),
    Row("http.client, new connection per push", NewConnectionRunner),
    Row(RAW_FLOOR, RawSocketRunner),
    Row(PYFCM_NOTIFY, PyfcmRunner),
    Row(FIREBASE_SEND, FirebaseSendRunner),
]
# (andpush row, peer row): printed as andpush's rate divided by the peer's.
PEER_PAIRS = [(ANDPUSH_PUSH_V1, PYFCM_NOTIFY), (ANDPUSH_PUSH_V1, FIREBASE_SEND)]


@dataclass
class Result:
    row: Row
    samples: List[float] = field(default_factory=list)  # pushes per second, one per sample
    pushes: int = 0
    status: str = "ok"  # or "error"/"skipped" (with a note saying why)
    note: str = ""
    seconds: float = 0.0  # over all samples
    client_cpu: float = 0.0  # CPU seconds of this process during the samples
    server_cpu: float = 0.0  # of the busiest server process, during the samples
    server_total_cpu: float = 0.0  # of all server processes, during the samples

    @property
    def rate(self) -> float:
        return statistics.mean(self.samples) if self.samples else 0.0

    @property
    def bound(self) -> str:
        return verdict(self.seconds, self.client_cpu, self.server_cpu, self.server_total_cpu,
                       self.row.delay_ms)

    @property
    def spread(self) -> float:
        """Standard deviation of the samples' rates, in percent of their mean."""
        if len(self.samples) < 2 or not self.rate:
            return 0.0
        return 100.0 * statistics.stdev(self.samples) / self.rate


def run_for(runner: Runner, seconds: float) -> Tuple[int, float]:
    """Call ``runner.step()`` until ``seconds`` have passed: (pushes, elapsed seconds)."""
    step = runner.step
    clock = time.perf_counter
    start = clock()
    deadline = start + seconds
    count = 0
    while True:
        count += step()
        now = clock()
        if now >= deadline:
            return count, now - start


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mark_failed(result: Any, stage: str, exc: BaseException) -> None:
    """Mark a row of either table as skipped (a peer not installed) or failed."""
    if isinstance(exc, Skipped):
        result.status, result.note = "skipped", str(exc)
    else:
        result.status, result.note = "error", "%s failed: %r" % (stage, exc)


def measure(rows: Sequence[Row], servers: Servers, warmup: float, samples: int,
            duration: float) -> List[Result]:
    """Set up and warm up every row, then take the samples in rounds, one row after another."""
    results = [Result(row) for row in rows]
    runners: Dict[int, Runner] = {}
    try:
        for index, result in enumerate(results):
            progress("warming up: %s" % result.row.name)
            try:
                runner = result.row.make(servers.target(ServerKind(result.row.delay_ms)))
            except Exception as exc:  # a broken row must not hide the others' numbers
                mark_failed(result, "set-up", exc)
                continue
            runners[index] = runner
            try:
                run_for(runner, warmup)
            except Exception as exc:
                mark_failed(result, "warm-up", exc)
                runners.pop(index).close()
        for number in range(1, samples + 1):
            progress("sample %d of %d" % (number, samples))
            for index, runner in list(runners.items()):
                result = results[index]
                group = servers.group(ServerKind(result.row.delay_ms))
                try:
                    server_before = group.stats()
                    cpu_before = time.process_time()
                    count, elapsed = run_for(runner, duration)
                    result.client_cpu += time.process_time() - cpu_before
                    server = [after - before
                              for after, before in zip(group.stats(), server_before)]
                except Exception as exc:
                    mark_failed(result, "sample", exc)
                    runners.pop(index).close()
                    continue
                result.pushes += count
                result.samples.append(count / elapsed)
                result.seconds += elapsed
                result.server_cpu += max(s.cpu_seconds for s in server)
                result.server_total_cpu += sum(s.cpu_seconds for s in server)
    finally:
        for runner in runners.values():
            runner.close()
    return results


# Table 2: bulk sends, one BulkRunner per row ##################################################


@dataclass
class Sent:
    """What a bulk run sent: messages answered with a success, failures, the first failure."""

    ok: int = 0
    failed: int = 0
    first_error: str = ""

    def count(self, outcome: object) -> None:
        if isinstance(outcome, andpush.Response):
            self.ok += 1
            return
        self.failed += 1
        if not self.first_error:
            self.first_error = repr(outcome)


class BulkRunner:
    """One bulk row's client: set up and warmed up in ``__init__``, timed in ``send()``."""

    def send(self, count: int) -> Sent:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PushManyRunner(BulkRunner):
    """``client.push_many(messages, concurrency=...)`` on a v1 client, outcomes counted."""

    def __init__(self, target: Target, concurrency: int) -> None:
        self.client = andpush_v1(target)
        self.concurrency = concurrency
        self.send(concurrency)  # warm-up: every worker's code path once

    def send(self, count: int) -> Sent:
        sent = Sent()
        for outcome in self.client.push_many(v1_messages(count), concurrency=self.concurrency):
            sent.count(outcome)
        return sent

    def close(self) -> None:
        self.client.close()


class PushRunner(BulkRunner):
    """``client.push(message)`` one after another on a v1 client."""

    def __init__(self, target: Target, concurrency: int) -> None:
        self.client = andpush_v1(target)
        self.send(1)

    def send(self, count: int) -> Sent:
        sent = Sent()
        for message in v1_messages(count):
            try:
                sent.count(self.client.push(message))
            except andpush.Error as exc:
                sent.count(exc)
        return sent

    def close(self) -> None:
        self.client.close()


class SendEachRunner(BulkRunner):
    """firebase-admin ``messaging.send_each(chunk)`` for chunks of 500, one after another."""

    CHUNK = 500

    def __init__(self, target: Target, concurrency: int) -> None:
        self.peer = FirebaseAdmin(target)
        self.send(10)

    def send(self, count: int) -> Sent:
        sent = Sent()
        for start in range(0, count, self.CHUNK):
            chunk = [self.peer.message] * min(self.CHUNK, count - start)
            batch = self.peer.messaging.send_each(chunk, app=self.peer.app)
            sent.ok += batch.success_count
            sent.failed += batch.failure_count
            if batch.failure_count and not sent.first_error:
                sent.first_error = repr(next(r.exception for r in batch.responses
                                             if not r.success))
        return sent

    def close(self) -> None:
        self.peer.close()


class NotifyRunner(BulkRunner):
    """pyfcm ``notify()`` one after another."""

    def __init__(self, target: Target, concurrency: int) -> None:
        self.peer = Pyfcm(target)
        self.send(1)

    def send(self, count: int) -> Sent:
        sent = Sent()
        for _ in range(count):
            try:
                self.peer.notify()
                sent.ok += 1
            except Exception as exc:
                sent.count(exc)
        return sent


@dataclass
class BulkRow:
    """One line of table 2 or 3: how many messages, how, at what concurrency and answer delay,
    over which protocol."""

    name: str
    make: Callable[[Target, int], BulkRunner]
    messages: int
    concurrency: int  # messages in flight at once (1: sequential)
    delay_ms: float
    min_of_ideal: Optional[float] = None  # target: rate / ideal rate at least this
    min_rate: Optional[float] = None  # target: messages per second at least this
    max_memory_mb: Optional[float] = None  # target: peak resident memory growth below this
    max_cpu_per_1000: Optional[float] = None  # target: client CPU s per 1,000 messages at most
    note: str = ""
    http2: bool = False  # andpush.new(http2=...)
    h2_max_streams: int = 0  # the server offers h2 with this many streams; 0: HTTP/1.1 only
    table: int = 2

    @property
    def server(self) -> ServerKind:
        return ServerKind(self.delay_ms, self.h2_max_streams)

    @property
    def protocol(self) -> str:
        """What the row's client and server speak: HTTP/2 when both offer h2."""
        return "HTTP/2" if self.http2 and self.h2_max_streams else "HTTP/1.1"

    @property
    def unlimited_ideal(self) -> Optional[float]:
        """concurrency / latency: the rate of a client that costs nothing, sending forever."""
        return self.concurrency * 1000.0 / self.delay_ms if self.delay_ms else None

    @property
    def ideal(self) -> Optional[float]:
        """The most the row can reach: its messages need at least ceil(messages /
        concurrency) answer delays, one after another (concurrency / latency when the
        messages are a multiple of the concurrency)."""
        if not self.delay_ms:
            return None
        rounds = math.ceil(self.messages / self.concurrency)
        return self.messages * 1000.0 / (rounds * self.delay_ms)

    @property
    def ideal_note(self) -> str:
        """Says so when ``ideal`` is below concurrency / latency."""
        ideal, unlimited = self.ideal, self.unlimited_ideal
        if ideal is None or unlimited is None or ideal >= unlimited * 0.9995:
            return ""
        return ("ideal capped at {:,.0f}/s (concurrency / latency: {:,.0f}/s): {:,} messages "
                "need {} rounds of {:g} ms".format(
                    ideal, unlimited, self.messages,
                    math.ceil(self.messages / self.concurrency), self.delay_ms))


PUSH_MANY_100 = "andpush push_many, concurrency 100"
PUSH_SEQUENTIAL = "andpush push(), sequential"
SEND_EACH = "firebase-admin send_each, chunks of 500 (peer)"
NOTIFY_SEQUENTIAL = "pyfcm notify(), sequential (peer)"
TEN_MILLION = "andpush push_many, concurrency 200 (10M/hour)"
MEMORY = "andpush push_many, generator, concurrency 50"
# (andpush row, peer row) in table 2
BULK_PEER_PAIRS = [(PUSH_MANY_100, SEND_EACH), (PUSH_SEQUENTIAL, NOTIFY_SEQUENTIAL)]
# Table 3: push_many over HTTP/2 and over HTTP/1.1 at these concurrencies, and its targets.
H2_CONCURRENCIES = (100, 500, 700)
H2_MIN_RATE = 10000.0  # the best HTTP/2 row, msg/s from one process
H2_MIN_OF_IDEAL = 0.90  # each HTTP/2 row
H2_MAX_CPU_PER_1000 = 0.03  # each HTTP/2 row: client CPU seconds per 1,000 messages


def h2_row_name(protocol: str, concurrency: int) -> str:
    return "andpush push_many %s, concurrency %d" % (protocol, concurrency)


def bulk_rows(delay_ms: float, quick: bool, memory_messages: Optional[int],
              h2_max_streams: int = H2_GFE_MAX_STREAMS) -> List[BulkRow]:
    """The rows of tables 2 and 3; ``quick`` sends fewer messages.

    Table 2's latency-bound rows are issue 4's, whose targets were set for HTTP/1.1 with a
    thread per message in flight: they keep to HTTP/1.1 (``http2=False``, a server without
    h2), as do the peers, which only speak HTTP/1.1. The bounded-memory row goes over HTTP/2,
    push_many's path against FCM now (and four times faster here than over HTTP/1.1).
    """
    sequential = 20 if quick else 60
    memory = memory_messages or (20000 if quick else 1000000)
    rows = [
        BulkRow(PUSH_MANY_100, PushManyRunner, 5000, 100, delay_ms, min_of_ideal=0.80),
        BulkRow(PUSH_SEQUENTIAL, PushRunner, sequential, 1, delay_ms),
        BulkRow(SEND_EACH, SendEachRunner, 2000 if quick else 5000, 500, delay_ms,
                note="500 threads per chunk, 100 pooled connections"),
        BulkRow(NOTIFY_SEQUENTIAL, NotifyRunner, sequential, 1, delay_ms),
        BulkRow(TEN_MILLION, PushManyRunner, 8000 if quick else 20000, 200, delay_ms,
                min_rate=3000.0),
        BulkRow(MEMORY, PushManyRunner, memory, 50, 0.0, max_memory_mb=50.0,
                note="--quick: only {:,} messages, too few to judge memory".format(memory)
                if quick and not memory_messages else "", http2=True,
                h2_max_streams=h2_max_streams),
    ]
    # Messages per row: a few seconds each (--quick: about one). HTTP/1.1 sends more slowly
    # and opens a connection (and a thread) per unit of concurrency: fewer messages.
    h2_messages = {100: 2000, 500: 10000, 700: 14000} if quick else {
        100: 8000, 500: 30000, 700: 42000}
    http1_messages = {100: 2000, 500: 4000, 700: 7000} if quick else {
        100: 5000, 500: 10000, 700: 10000}
    for concurrency in H2_CONCURRENCIES:
        rows.append(BulkRow(
            h2_row_name("HTTP/2", concurrency), PushManyRunner, h2_messages[concurrency],
            concurrency, delay_ms, min_of_ideal=H2_MIN_OF_IDEAL,
            max_cpu_per_1000=H2_MAX_CPU_PER_1000, http2=True, h2_max_streams=h2_max_streams,
            table=3))
    for concurrency in H2_CONCURRENCIES:
        rows.append(BulkRow(
            h2_row_name("HTTP/1.1", concurrency), PushManyRunner,
            http1_messages[concurrency], concurrency, delay_ms, http2=False,
            h2_max_streams=h2_max_streams, table=3))
    return rows


@dataclass
class BulkResult:
    row: BulkRow
    status: str = "ok"  # or "error"/"skipped" (with a note saying why)
    note: str = ""
    sent: Sent = field(default_factory=Sent)
    seconds: float = 0.0
    client_cpu: float = 0.0  # seconds of CPU time of this process while sending
    context_switches: int = 0  # of this process (all its threads) while sending
    server: List[ServerStats] = field(default_factory=list)  # per server process, this row
    memory_growth: Optional[int] = None  # bytes of peak resident memory growth
    memory_how: str = ""

    @property
    def rate(self) -> float:
        return self.sent.ok / self.seconds if self.seconds else 0.0

    @property
    def of_ideal(self) -> Optional[float]:
        ideal = self.row.ideal
        return self.rate / ideal if ideal else None

    @property
    def cpu_per_message(self) -> float:
        """Client CPU seconds per message."""
        return self.client_cpu / self.sent.ok if self.sent.ok else 0.0

    @property
    def client_share(self) -> float:
        return self.client_cpu / self.seconds if self.seconds else 0.0

    @property
    def server_share(self) -> float:
        """CPU of the busiest server process, as a share of one core over the row."""
        busiest = max((s.cpu_seconds for s in self.server), default=0.0)
        return busiest / self.seconds if self.seconds else 0.0

    @property
    def server_total_share(self) -> float:
        """CPU of all the server processes, in cores over the row."""
        total = sum(s.cpu_seconds for s in self.server)
        return total / self.seconds if self.seconds else 0.0

    @property
    def connections(self) -> int:
        return sum(s.connections for s in self.server)

    @property
    def h2_connections(self) -> int:
        """The connections on which the server saw the client pick h2."""
        return sum(s.h2_connections for s in self.server)

    @property
    def bound(self) -> str:
        busiest = max((s.cpu_seconds for s in self.server), default=0.0)
        return verdict(self.seconds, self.client_cpu, busiest,
                       sum(s.cpu_seconds for s in self.server), self.row.delay_ms)

    def targets(self) -> List[Tuple[str, Optional[bool]]]:
        """(description, met: None when the row did not run) for each target of the row."""
        ran = self.status == "ok"
        row = self.row
        found: List[Tuple[str, Optional[bool]]] = []
        if row.min_of_ideal is not None:
            found.append(("%s: %s msg/s = %.3f of the ideal %s/s%s (target >= %.2f)" % (
                row.name, "{:,.0f}".format(self.rate), self.of_ideal or 0.0,
                "{:,.0f}".format(row.ideal or 0), " (capped)" if row.ideal_note else "",
                row.min_of_ideal),
                (self.of_ideal or 0.0) >= row.min_of_ideal if ran else None))
        if row.min_rate is not None:
            hours = 1e7 / self.rate / 3600 if self.rate else float("inf")
            found.append(("%s: %s msg/s, %.0f us client CPU/msg; 10 million take %.2f h "
                          "(target >= %s msg/s)" % (
                              row.name, "{:,.0f}".format(self.rate),
                              1e6 * self.cpu_per_message, hours,
                              "{:,.0f}".format(row.min_rate)),
                          self.rate >= row.min_rate if ran else None))
        if row.max_cpu_per_1000 is not None:
            per_1000 = 1000 * self.cpu_per_message
            found.append(("%s: %.4f s client CPU per 1,000 messages (target <= %g)" % (
                row.name, per_1000, row.max_cpu_per_1000),
                per_1000 <= row.max_cpu_per_1000 if ran else None))
        if row.max_memory_mb is not None:
            growth = self.memory_growth
            met = None if not ran or growth is None else growth < row.max_memory_mb * 1e6
            found.append(("%s: %s messages, peak RSS grew %s (%s) (target < %g MB)" % (
                row.name, "{:,}".format(self.sent.ok), mb_text(growth), self.memory_how,
                row.max_memory_mb), met))
        return found


def verdict(seconds: float, client_cpu: float, busiest_server_cpu: float,
            server_cpu: float, delay_ms: float) -> str:
    """What held a row back (see the module docstring), from CPU seconds over ``seconds``."""
    if not seconds:
        return "-"
    if busiest_server_cpu / seconds >= 0.85:
        return "server CPU"
    if (client_cpu + server_cpu) / seconds >= 1.7:
        return "both cores"
    if client_cpu / seconds >= 0.75:
        return "client CPU"
    return "latency" if delay_ms else "round trips"


def ratio_text(value: Optional[float]) -> str:
    return "-" if value is None else "%.2f" % value


def delay_text(ms: Optional[float]) -> str:
    return "-" if ms is None else "%.1f ms" % ms


def mb_text(size: Optional[int]) -> str:
    return "n/a" if size is None else "%.1f MB" % (size / 1e6)


# Peak resident memory of this process during a row.


def read_status_kib(name: str) -> Optional[int]:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM), or None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class PeakMemory:
    """Peak resident memory growth over a stretch of time.

    On Linux, writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current
    resident size, so the growth is VmHWM at the end minus VmRSS at the start. Elsewhere
    ru_maxrss before and after: growth past the process's earlier peak only.
    """

    def __init__(self) -> None:
        self.how = "ru_maxrss"
        self.start = self._maxrss()
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            rss = read_status_kib("VmRSS")
            if rss is not None and read_status_kib("VmHWM") is not None:
                self.start, self.how = rss * 1024, "VmHWM - VmRSS"
        except OSError:
            pass

    def growth(self) -> int:
        if self.how == "ru_maxrss":
            return self._maxrss() - self.start
        return (read_status_kib("VmHWM") or 0) * 1024 - self.start

    @staticmethod
    def _maxrss() -> int:
        if resource is None:
            return 0
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS: bytes


def context_switches() -> int:
    if resource is None:
        return 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def measure_bulk(rows: Sequence[BulkRow], servers: Servers) -> List[BulkResult]:
    """Run each bulk row once: set up and warm up (untimed), then send its messages."""
    results = []
    for row in rows:
        result = BulkResult(row)
        results.append(result)
        progress("bulk: %s (%s messages)" % (row.name, "{:,}".format(row.messages)))
        group = servers.group(row.server)
        try:
            runner = row.make(servers.target(row.server, row.http2), row.concurrency)
        except Exception as exc:
            mark_failed(result, "set-up", exc)
            continue
        try:
            server_before = group.stats()
            memory = PeakMemory()
            switches_before = context_switches()
            cpu_before = time.process_time()
            started = time.perf_counter()
            result.sent = runner.send(row.messages)
            result.seconds = time.perf_counter() - started
            result.client_cpu = time.process_time() - cpu_before
            result.context_switches = context_switches() - switches_before
            result.memory_growth, result.memory_how = memory.growth(), memory.how
            result.server = [after - before
                             for after, before in zip(group.stats(), server_before)]
        except Exception as exc:
            mark_failed(result, "run", exc)
        finally:
            runner.close()
        if result.status == "ok" and result.sent.failed:
            result.status = "error"
            result.note = "%d of %d messages failed, first: %s" % (
                result.sent.failed, row.messages, result.sent.first_error)
        if result.status == "ok":
            check_protocol(result)
    return results


def check_protocol(result: BulkResult) -> None:
    """Fail a row whose messages did not go over the protocol it says, by the server's count
    of the connections on which the client picked h2."""
    row, h2 = result.row, result.h2_connections
    if row.protocol == "HTTP/2" and (not h2 or h2 != result.connections):
        result.status = "error"
        result.note = ("meant for HTTP/2, but the client picked h2 on %d of the %d "
                       "connections the server accepted" % (h2, result.connections))
    elif row.protocol == "HTTP/1.1" and h2:
        result.status = "error"
        result.note = "meant for HTTP/1.1, but %d connections picked h2" % h2


def profile_bulk(row: BulkRow, servers: Servers, top: int) -> str:
    """Run one bulk row under cProfile, one profiler per client thread, and report the top."""
    profiles: List[cProfile.Profile] = []
    lock = threading.Lock()
    original_run = threading.Thread.run

    def profiled_run(thread: threading.Thread) -> None:
        profile = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(profile)
        profile.runcall(original_run, thread)

    runner = row.make(servers.target(row.server, row.http2), row.concurrency)
    main_profile = cProfile.Profile(time.thread_time)
    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        cpu_before = time.process_time()
        sent = main_profile.runcall(runner.send, row.messages)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_before
    finally:
        threading.Thread.run = original_run  # type: ignore[method-assign]
        runner.close()
    out = io.StringIO()
    stats = pstats.Stats(main_profile, stream=out)
    for profile in profiles:
        stats.add(profile)
    out.write("%s: %d messages in %.2f s under the profiler (%.0f/s), %.0f us CPU/msg; "
              "%d client threads profiled\n" % (row.name, sent.ok, seconds, sent.ok / seconds,
                                                1e6 * cpu / max(sent.ok, 1), len(profiles) + 1))
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# Reporting ###################################################################################


def ranked(results: Sequence[Result]) -> List[Result]:
    """Rows that ran, fastest first, then the rest in their order."""
    ran = sorted((r for r in results if r.status == "ok"), key=lambda r: -r.rate)
    return ran + [r for r in results if r.status != "ok"]


def fastest_rate(results: Sequence[Result]) -> float:
    return max((r.rate for r in results if r.status == "ok"), default=0.0)


@dataclass
class Comparison:
    """A row's rate relative to another row's, and whether it reaches its target."""

    row: str
    baseline: str
    ratio: Optional[float]  # None when either row did not run
    target: Optional[float]

    @property
    def met(self) -> Optional[bool]:
        if self.ratio is None or self.target is None:
            return None
        return self.ratio >= self.target

    def describe(self) -> str:
        text = "%s / %s = " % (self.row, self.baseline)
        text += "n/a" if self.ratio is None else "%.2f" % self.ratio
        if self.target is not None:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[self.met]
            text += "  (target >= %.2f: %s)" % (self.target, verdict)
        return text


def compare(rates: Dict[str, Optional[float]],
            pairs: Sequence[Tuple[str, str, Optional[float]]]) -> List[Comparison]:
    """Comparison of each (row, baseline, target) whose rows are known, ratio None if idle."""
    found = []
    for row, baseline, target in pairs:
        if row not in rates or baseline not in rates:
            continue
        rate, base = rates[row], rates[baseline]
        found.append(Comparison(row, baseline, rate / base if rate and base else None, target))
    return found


def comparisons(results: Sequence[Result]) -> List[Comparison]:
    rates = {r.row.name: (r.rate if r.status == "ok" else None) for r in results}
    pairs = [(r.row.name, r.row.baseline, r.row.target) for r in results if r.row.baseline]
    return compare(rates, pairs + [(a, p, None) for a, p in PEER_PAIRS])


def bulk_comparisons(results: Sequence[BulkResult]) -> List[Comparison]:
    rates = {r.row.name: (r.rate if r.status == "ok" else None) for r in results}
    return compare(rates, [(a, p, None) for a, p in BULK_PEER_PAIRS])


def format_table(results: Sequence[Result], processes: int) -> str:
    fastest = fastest_rate(results)
    width = max([len("row")] + [len(r.row.name) for r in results])
    layout = "%-*s  %14s  %8s  %13s  %6s  %6s  %10s"
    lines = [layout % (width, "row", "rate (i/s)", "spread", "comparison", "client", "server",
                       "bound by")]
    for result in ranked(results):
        name = result.row.name
        if result.status != "ok":
            lines.append("%-*s  %14s  %8s  %s: %s" % (width, name, "-", "-", result.status,
                                                       result.note))
            continue
        if result.rate == fastest:
            comparison = "fastest"
        else:
            comparison = "%.2fx slower" % (fastest / result.rate)
        seconds = result.seconds or 1.0
        lines.append(layout % (
            width, name, "{:,.1f}".format(result.rate), "± %.1f%%" % result.spread, comparison,
            "%.0f%%" % (100 * result.client_cpu / seconds),
            "%.0f%%" % (100 * result.server_cpu / seconds), result.bound))
    lines.append("")
    lines.extend(comparison.describe() for comparison in comparisons(results))
    lines.extend(server_notes([(r.row.name, r.bound, r.client_cpu / (r.seconds or 1.0),
                                r.server_cpu / (r.seconds or 1.0))
                               for r in results if r.status == "ok"], processes))
    return "\n".join(lines)


BULK_COLUMNS = [  # header, width
    ("row", 0), ("protocol", 8), ("messages", 9), ("conc.", 5), ("delay", 6), ("seconds", 7),
    ("msg/s", 8), ("of ideal", 8), ("CPU/msg", 8), ("csw/msg", 7), ("client", 6), ("server", 6),
    ("conns", 5), ("peak RSS +", 10), ("bound by", 10),
]
H2_COLUMNS = [  # header, width
    ("row", 0), ("messages", 8), ("seconds", 7), ("msg/s", 8), ("ideal", 8), ("of ideal", 8),
    ("CPU s/1k", 8), ("csw/msg", 7), ("client", 6), ("server", 6), ("srv delay", 9),
    ("conns", 5), ("h2 conns", 8), ("bound by", 10),
]


def table_line(widths: Sequence[int], cells: Sequence[str]) -> str:
    """The first cell left-aligned in widths[0], the rest right-aligned, two spaces apart."""
    first = "%-*s" % (widths[0], cells[0])
    return "  ".join([first] + ["%*s" % (w, c) for w, c in zip(widths[1:], cells[1:])])


def format_bulk_table(results: Sequence[BulkResult], processes: int) -> str:
    width = max([len("row")] + [len(r.row.name) for r in results])
    widths = [width] + [w for _, w in BULK_COLUMNS[1:]]

    def line(cells: Sequence[str]) -> str:
        return table_line(widths, cells)

    lines = [line([header for header, _ in BULK_COLUMNS])]
    for r in results:
        row = r.row
        cells = [row.name, row.protocol, "{:,}".format(row.messages), str(row.concurrency),
                 "%g ms" % row.delay_ms]
        if r.status != "ok":
            lines.append(line(cells) + "  %s: %s" % (r.status, r.note))
            continue
        cells += [
            "%.2f" % r.seconds, "{:,.0f}".format(r.rate), ratio_text(r.of_ideal),
            "%.0f us" % (1e6 * r.cpu_per_message),
            "%.1f" % (r.context_switches / r.sent.ok if r.sent.ok else 0.0),
            "%.0f%%" % (100 * r.client_share),
            "%.0f%%" % (100 * r.server_share), str(r.connections), mb_text(r.memory_growth),
            r.bound,
        ]
        lines.append(line(cells) + ("  (%s)" % row.note if row.note else ""))
    lines.append("")
    for r in results:
        for description, met in r.targets():
            verdict = {True: "met", False: "NOT met", None: "not measured"}[met]
            lines.append("%s: %s" % (description, verdict))
    for comparison in bulk_comparisons(results):
        lines.append(comparison.describe())
    lines.append("")
    lines.extend(server_notes([(r.row.name, r.bound, r.client_share, r.server_share)
                               for r in results if r.status == "ok"], processes))
    return "\n".join(lines)


def h2_results(results: Sequence[BulkResult], protocol: str) -> List[BulkResult]:
    return [r for r in results if r.row.table == 3 and r.row.protocol == protocol]


def h2_best_target(results: Sequence[BulkResult]) -> Tuple[str, Optional[bool]]:
    """The target of the best HTTP/2 row of table 3: messages per second from one process."""
    ran = [r for r in h2_results(results, "HTTP/2") if r.status == "ok"]
    goal = "target >= {:,.0f} msg/s from one process".format(H2_MIN_RATE)
    if not ran:
        return "HTTP/2 push_many, best of the concurrencies: not run (%s)" % goal, None
    best = max(ran, key=lambda r: r.rate)
    return ("HTTP/2 push_many, best of concurrencies %s: {:,.0f} msg/s at concurrency %d and "
            "%g ms (%s)".format(best.rate) % (
                ", ".join(str(r.row.concurrency) for r in ran), best.row.concurrency,
                best.row.delay_ms, goal), best.rate >= H2_MIN_RATE)


def h2_comparisons(results: Sequence[BulkResult]) -> List[str]:
    """HTTP/2 against HTTP/1.1 at each concurrency both ran at."""
    http1 = {r.row.concurrency: r for r in h2_results(results, "HTTP/1.1") if r.status == "ok"}
    lines = []
    for h2 in h2_results(results, "HTTP/2"):
        other = http1.get(h2.row.concurrency)
        if h2.status != "ok" or other is None or not other.rate or not h2.cpu_per_message:
            continue
        lines.append("HTTP/2 / HTTP/1.1 at concurrency %d: %.2f times the rate, %.2f times "
                     "the client CPU per message" % (
                         h2.row.concurrency, h2.rate / other.rate,
                         h2.cpu_per_message / other.cpu_per_message))
    return lines


def format_h2_table(results: Sequence[BulkResult], processes: int) -> str:
    width = max([len("row")] + [len(r.row.name) for r in results])
    widths = [width] + [w for _, w in H2_COLUMNS[1:]]
    lines = [table_line(widths, [header for header, _ in H2_COLUMNS])]
    for r in results:
        row = r.row
        cells = [row.name, "{:,}".format(row.messages)]
        if r.status != "ok":
            lines.append(table_line(widths, cells) + "  %s: %s" % (r.status, r.note))
            continue
        cells += [
            "%.2f" % r.seconds, "{:,.0f}".format(r.rate), "{:,.0f}".format(row.ideal or 0),
            ratio_text(r.of_ideal), "%.4f" % (1000 * r.cpu_per_message),
            "%.1f" % (r.context_switches / r.sent.ok if r.sent.ok else 0.0),
            "%.0f%%" % (100 * r.client_share), "%.0f%%" % (100 * r.server_share),
            delay_text(mean_h2_delay_ms(r.server)), str(r.connections), str(r.h2_connections),
            r.bound,
        ]
        notes = [text for text in (row.ideal_note, row.note) if text]
        lines.append(table_line(widths, cells) + ("  (%s)" % "; ".join(notes) if notes else ""))
    lines.append("")
    for r in results:
        for description, met in r.targets():
            lines.append("%s: %s" % (description, MET_TEXT[met]))
    description, met = h2_best_target(results)
    lines.append("%s: %s" % (description, MET_TEXT[met]))
    lines.extend(h2_comparisons(results))
    lines.append("")
    lines.extend(server_notes([(r.row.name, r.bound, r.client_share, r.server_share)
                               for r in results if r.status == "ok"], processes))
    ran = [r for r in results if r.status == "ok"]
    if ran:
        busiest_client = max(ran, key=lambda r: r.client_share)
        busiest_server = max(ran, key=lambda r: r.server_total_share)
        lines.append(
            "CPU on this machine's %s cores: the client (one Python process: with the GIL, "
            "about one core at most) used up to %.0f%% of a core (%s), the %d server "
            "process(es) up to %.0f%% of a core in all (%s)." % (
                os.cpu_count(), 100 * busiest_client.client_share, busiest_client.row.name,
                processes, 100 * busiest_server.server_total_share,
                busiest_server.row.name))
    return "\n".join(lines)


MET_TEXT = {True: "met", False: "NOT met", None: "not measured"}


def server_notes(rows: Sequence[Tuple[str, str, float, float]], processes: int) -> List[str]:
    """Say which rows of (name, bound by, client share, server share) the server limited."""
    notes = []
    for name, bound, client_share, server_share in rows:
        if bound in ("server CPU", "both cores"):
            notes.append(
                "NOTE %s: bound by %s: the busiest of %d server process(es) used %.0f%% of a "
                "core and the client %.0f%% (%s CPUs in all): the fake server limits this row, "
                "so its rate is a lower bound for the client" % (
                    name, bound, processes, 100 * server_share, 100 * client_share,
                    os.cpu_count()))
    if not notes:
        notes.append("The fake server limited no row of this table (each server process "
                     "stayed under 85% of a core, client and server under 1.7 cores).")
    return notes


def json_results(results: Sequence[Result]) -> List[Dict[str, object]]:
    fastest = fastest_rate(results)
    compared = {c.row: c for c in comparisons(results) if c.target is not None}
    out = []
    for result in results:
        item: Dict[str, object] = {
            "table": "sequential",
            "row": result.row.name,
            "status": result.status,
            "rate": result.rate,
            "spread": result.spread,
            "slower": fastest / result.rate if result.rate else None,
            "samples": result.samples,
            "pushes": result.pushes,
            "server_delay_ms": result.row.delay_ms,
            "client_cpu_share": result.client_cpu / result.seconds if result.seconds else None,
            "server_cpu_share": result.server_cpu / result.seconds if result.seconds else None,
            "bound_by": result.bound,
        }
        if result.note:
            item["note"] = result.note
        found = compared.get(result.row.name)
        if found is not None:
            item.update(baseline=found.baseline, ratio=found.ratio, target=found.target,
                        target_met=found.met)
        out.append(item)
    return out


def json_bulk_results(results: Sequence[BulkResult]) -> List[Dict[str, object]]:
    out = []
    for r in results:
        row = r.row
        item: Dict[str, object] = {
            "table": "bulk" if row.table == 2 else "http2", "row": row.name,
            "status": r.status, "protocol": row.protocol, "messages": row.messages,
            "concurrency": row.concurrency, "server_delay_ms": row.delay_ms,
            "server_h2_max_streams": row.h2_max_streams,
        }
        if r.status == "ok":
            item.update(
                ok=r.sent.ok, seconds=r.seconds, rate=r.rate, ideal=row.ideal,
                server_h2_answer_delay_ms=mean_h2_delay_ms(r.server),
                concurrency_over_latency=row.unlimited_ideal,
                of_ideal=r.of_ideal, client_cpu_seconds=r.client_cpu,
                client_cpu_per_message_us=1e6 * r.cpu_per_message,
                client_cpu_seconds_per_1000=1000 * r.cpu_per_message,
                client_cpu_share=r.client_share, server_cpu_share=r.server_share,
                client_context_switches=r.context_switches,
                server_cpu_seconds=[s.cpu_seconds for s in r.server],
                server_requests=sum(s.requests for s in r.server),
                server_connections=r.connections, server_h2_connections=r.h2_connections,
                server_total_cpu_share=r.server_total_share,
                peak_rss_growth_bytes=r.memory_growth,
                peak_rss_how=r.memory_how, bound_by=r.bound,
            )
        targets = r.targets()
        if targets:
            item["targets"] = [{"target": text, "met": met} for text, met in targets]
        notes = [text for text in (r.note, row.ideal_note, row.note) if text]
        if notes:
            item["note"] = "; ".join(notes)
        out.append(item)
    for comparison in bulk_comparisons(results):
        out.append({"table": "bulk", "comparison": comparison.describe(),
                    "row": comparison.row, "baseline": comparison.baseline,
                    "ratio": comparison.ratio})
    if any(r.row.table == 3 for r in results):
        description, met = h2_best_target(results)
        out.append({"table": "http2", "target": description, "met": met})
        out.extend({"table": "http2", "comparison": text} for text in h2_comparisons(results))
    return out


def describe_servers(stats: Dict[ServerKind, List[ServerStats]], seconds: float) -> str:
    lines = []
    for kind, group in sorted(stats.items(), key=lambda item: (item[0].h2_max_streams,
                                                               item[0].delay_ms)):
        requests = sum(s.requests for s in group)
        cpu = sum(s.cpu_seconds for s in group)
        per_request = 1e6 * cpu / requests if requests else 0.0
        h2 = sum(s.h2_connections for s in group)
        delay = mean_h2_delay_ms(group)
        lines.append(
            "fake server (%d process(es), %s): %s requests on %s connections (%s of them h2) "
            "in %.1f s, %.1f s CPU (%.0f us/request incl. handshakes)%s" % (
                len(group), kind.describe(), "{:,}".format(requests),
                "{:,}".format(sum(s.connections for s in group)), "{:,}".format(h2), seconds,
                cpu, per_request, "" if delay is None else
                "; h2 answers sent %.2f ms after their requests were read" % delay)
        )
    return "\n".join(lines)


# Command line ##################################################################################


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Offline benchmark: messages per second of andpush and other clients "
        "against a local TLS fake FCM server (see the module docstring for how to read it)."
    )
    parser.add_argument("--quick", action="store_true",
                        help="a run of about 20 s: short samples, fewer bulk messages")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (a list of rows) instead of tables")
    parser.add_argument("--samples", type=int, help="table 1: timed samples per row (default 5)")
    parser.add_argument("--duration", type=float,
                        help="table 1: seconds per sample (default 1.0)")
    parser.add_argument("--warmup", type=float,
                        help="table 1: warm-up seconds per row (default 0.5)")
    parser.add_argument("--delay-ms", type=float, default=50.0,
                        help="table 2: the fake FCM latency of the latency-bound rows "
                        "(default 50)")
    parser.add_argument("--memory-messages", type=int,
                        help="table 2: messages of the bounded-memory row (default 1,000,000; "
                        "--quick 20,000)")
    parser.add_argument("--server-processes", type=int, default=1,
                        help="fake server processes per answer delay and protocol, sharing a "
                        "port (default 1)")
    parser.add_argument("--h2-max-streams", type=int, default=H2_GFE_MAX_STREAMS,
                        help="the HTTP/2 fake server's SETTINGS_MAX_CONCURRENT_STREAMS "
                        "(default %d, what Google's front end says)" % H2_GFE_MAX_STREAMS)
    parser.add_argument("--row", action="append", metavar="TEXT",
                        help="run only rows whose name contains TEXT (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--profile", metavar="TEXT",
                        help="profile the client side of the first bulk row whose name "
                        "contains TEXT, instead of the tables")
    # The fake server's own process: this script started again by FakeServer.
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--server-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--server-h2-streams", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    if args.samples is None:
        args.samples = 3 if quick else 5
    if args.duration is None:
        args.duration = 0.3 if quick else 1.0
    if args.warmup is None:
        args.warmup = 0.2 if quick else 0.5
    if args.samples < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("need --samples >= 1, --duration > 0 and --warmup >= 0")
    if args.delay_ms <= 0 or args.server_processes < 1 or args.h2_max_streams < 1:
        parser.error("need --delay-ms > 0, --server-processes >= 1 and --h2-max-streams >= 1")
    return args


def peer_versions() -> str:
    """Which peers this run could use, with their versions."""
    found = []
    for name, module in PEER_MODULES.items():
        if importlib.util.find_spec(module) is None:
            found.append("%s not installed" % name)
            continue
        try:
            from importlib import metadata
            found.append("%s %s" % (name, metadata.version(name)))
        except Exception:  # no metadata: still say it is there
            found.append("%s (version unknown)" % name)
    return ", ".join(found)


def load_average() -> str:
    """The machine's 1-minute load average, or "?" where there is none."""
    try:
        return "%.1f" % os.getloadavg()[0]
    except (AttributeError, OSError):
        return "?"


def selected(names: Sequence[str], texts: Optional[Sequence[str]]) -> List[bool]:
    return [not texts or any(text in name for text in texts) for name in names]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.cert, args.key, args.server_delay_ms, args.port,
                     args.server_h2_streams)
    all_bulk = bulk_rows(args.delay_ms, args.quick, args.memory_messages, args.h2_max_streams)
    rows = [r for r, keep in zip(ROWS, selected([r.name for r in ROWS], args.row)) if keep]
    bulk = [r for r, keep in zip(all_bulk, selected([r.name for r in all_bulk], args.row))
            if keep]
    if args.list or not (rows or bulk):
        for name in [r.name for r in ROWS] + [r.name for r in all_bulk]:
            print(name)
        return 0 if args.list else 2
    load_before = load_average()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="andpush-bench-") as folder:
        cert_file = os.path.join(folder, "server.pem")
        key_file = os.path.join(folder, "server.key")
        ca_file = os.path.join(folder, "ca.pem")
        for path, text in ((cert_file, TEST_SERVER_CERT_PEM), (key_file, TEST_SERVER_KEY_PEM),
                           (ca_file, TEST_CA_PEM)):
            with open(path, "w") as f:
                f.write(text)
        trust_test_ca(ca_file)
        servers = Servers(cert_file, key_file, args.server_processes)
        try:
            if args.profile:
                chosen = [r for r in all_bulk if args.profile in r.name]
                if not chosen:
                    progress("no bulk row matches %r (see --list)" % args.profile)
                    return 2
                print(profile_bulk(chosen[0], servers, top=25))
                return 0
            results = measure(rows, servers, args.warmup, args.samples, args.duration)
            bulk_results = measure_bulk(bulk, servers)
        except KeyboardInterrupt:
            progress("interrupted")
            return 130
        finally:
            server_stats = servers.stop_all()
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps(json_results(results) + json_bulk_results(bulk_results), indent=2))
    else:
        print("andpush benchmark: %d samples x %g s per row of table 1, rows interleaved, "
              "after %g s warm-up%s" % (args.samples, args.duration, args.warmup,
                                        "; --quick" if args.quick else ""))
        print("andpush %s on %s %s, %s, %s CPUs; load average %s at the start, %s at the "
              "end; took %.0f s" % (
                  getattr(andpush, "__version__", "?"), platform.python_implementation(),
                  platform.python_version(), ssl.OPENSSL_VERSION, os.cpu_count(),
                  load_before, load_average(), elapsed))
        print("peers: %s" % peer_versions())
        if rows:
            print()
            print("Table 1: sequential pushes, zero answer delay, HTTP/1.1 (the server offers "
                  "no h2)")
            print(format_table(results, args.server_processes))
        table2 = [r for r in bulk_results if r.row.table == 2]
        table3 = [r for r in bulk_results if r.row.table == 3]
        if table2:
            print()
            print("Table 2: bulk sends, v1 API; ideal = concurrency / answer delay")
            print(format_bulk_table(table2, args.server_processes))
        if table3:
            print()
            print("Table 3: push_many over HTTP/2 and over HTTP/1.1 (http2=False), v1 API, "
                  "%g ms answer delay; the server offers h2 with MAX_CONCURRENT_STREAMS %d; "
                  "ideal = concurrency / latency (capped when the messages are no multiple "
                  "of the concurrency)" % (args.delay_ms, args.h2_max_streams))
            print(format_h2_table(table3, args.server_processes))
        print()
        print(describe_servers(server_stats, elapsed))
    everything = list(results) + list(bulk_results)
    return 1 if any(r.status == "error" for r in everything) else 0


if __name__ == "__main__":
    sys.exit(main())
