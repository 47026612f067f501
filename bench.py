"""Benchmark andpush against a server we did not write (nginx on loopback), beside a client we
did not write (h2load, in C).

``python bench.py`` (a few minutes); ``--quick`` (a smoke run), ``--rows NAME,...`` (parts of
names; ``--list`` shows them), ``--json`` (one JSON object: every row, its figures and targets),
``--own-server``. No network, no credentials. The peers (pyfcm, firebase-admin) run when
importable: use a virtual environment's interpreter that has them. The last line is the
verdict: the exit status is 1 if a row failed (it errored, or a message got no outcome or a
failure); a target MISSED is not a failure. Under ``python -B`` no bytecode is written.

nginx (``apt-get install nginx-light``) runs from a temporary folder with the tests' throw-away
certificate: one worker, HTTP/2 and HTTP/1.1 by ALPN, 100 streams a connection and TLS 1.3 (a
one-round-trip handshake; nginx before 1.23.4 offers only 1.2 unless told) as FCM; its
access log gives ``proto`` and ``conns`` (the connections that carried pushes). Without it (or
with ``--own-server``) the standard library's HTTP/1.1 server stands in: its figures do not
count, the HTTP/2 rows are not measured. Column ``server`` says which server a row used.

``(50 ms)`` rows go through a relay that holds bytes 25 ms each way (a new connection's first
bytes a round trip more: its handshake). Their ideal is the concurrency (over HTTP/2, at most
100 streams on each connection used) over the measured round trip; ``relay-ceiling`` shows the
relay carries 3x the top one. Each row runs in a child process: ``msg/s`` is successes over
wall time, ``CPU/1k`` the child's CPU (all threads) per 1,000 messages, ``ratio`` to the ideal
or to the floor (raw requests on one kept-alive TLS socket, taking turns with the row),
``srv/relay`` the share of a core the server and relay used.

Beside each bulk row, h2load (``apt-get install nghttp2-client``) sends the same request (path,
headers, body) the same way (the row's connections, streams, server and relay), just after the
row: ``h2load/s`` and ``h2load CPU`` (its user + system time per 1,000, less its start-up),
``rate/h2`` and ``CPU/h2`` the row's as ratios of them. A row's batches are one h2load run, and
for a row timed after a warm-up h2load's rate is taken after as many of its requests ended.
The targets are all in ROWS: ratios to h2load where it applies, else to the ideal or floor.
A row whose CPU per message is judged (by a target of its own, or as what another row's is
measured against: push-h1 for push-h2) runs three times, taking turns with h2load where it
applies, as one run swings by a fifth or more: the run whose CPU figure is the median is the
one judged, and the row's note lists all three.
"""

import argparse
import collections
import concurrent.futures
import functools
import heapq
import http.server
import importlib.util
import itertools
import json
import os
import re
import resource
import selectors
import shlex
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = [sys.executable, os.path.abspath(__file__)]  #: how bench.py starts its helpers, children
PROJECT = "p"
FLOOR_PROJECT = "floor"  #: the project of a row's own floor requests, told apart in the log
V1_BODY = b'{"name": "projects/p/messages/0:1"}'  #: the own server's answer to a send
OWN_LOG = "own.log"  #: the own server's log in the run's folder, made before the port listens
TOKEN_BODY = b'{"access_token": "bench-token", "expires_in": 3600, "token_type": "Bearer"}'
DEVICE_TOKEN = "bench-device-token:" + "APA91bH3x9Qd-7kL2mZ" * 7
ONE_WAY_DELAY = 0.025  #: seconds the relay holds bytes in each direction
RTT_SAMPLES = 9  #: sequential requests whose median is the measured round trip
IMPORT_SAMPLES = 10  #: interpreter starts whose median is an import time
QUICK_SHARE = 5  #: --quick times this share of each row's messages
FLOOR_SLICES = 5  #: a row compared with the floor takes turns with it this many times
REPEATS = 3  #: runs of a row whose CPU is judged (see judged_on_cpu): the median counts
CEILING_CONNECTIONS = 50  #: relay-ceiling: connections through the relay ...
CEILING_DEPTH = 100  #: ... each with this many pipelined requests in flight
H2_STREAMS = 100  #: the server's SETTINGS_MAX_CONCURRENT_STREAMS, as FCM's
KEEPALIVE_REQUESTS = 10_000_000  #: nginx closes no connection in a run ...
KEEPALIVE_SECONDS = 3600  #: ... nor for idleness
CHILD_DEADLINE = 600  #: seconds a row may take before it is killed
START_DEADLINE = 10  #: seconds a server or the relay may take to listen
LISTEN_BACKLOG = 1024  #: the own server's and the relay's: up to 700 connections come at once


# The rows and their targets, in one place ######################################################

@dataclass(frozen=True)
class Row:
    """One row: what its child process runs, and the targets it must reach."""

    name: str
    kind: str  # what runs it: a key of SETUPS, or "import"
    title: str
    count: int = 0  # messages timed (per batch); a fifth with --quick
    relayed: bool = False  # through the 50 ms relay
    http2: bool = True  # andpush.new(http2=...); the protocol the server must see
    concurrency: int = 1  # threads, tasks or push_many's concurrency: the ideal's numerator
    warm: int = 0  # messages sent first, untimed, by the row's own work on the same client
    batches: int = 1
    base: str = ""  # what ``ratio`` divides by: "floor" or "ideal"
    min_ratio: Optional[float] = None
    max_cpu: Optional[float] = None  # client CPU seconds per 1,000 messages
    cpu_below: Tuple[str, float] = ("", 1.0)  # CPU per message at most that row's / this
    max_conns: Optional[int] = None
    h2load: bool = False  # measured beside h2load: the same requests at the same concurrency
    min_h2load_rate: Optional[float] = None  # msg/s at least this share of h2load's
    max_h2load_cpu: Optional[float] = None  # CPU per message at most this times h2load's
    min_relay_headroom: Optional[float] = None  # msg/s / relay's CPU share, over the ideal
    min_rate: Optional[float] = None  # msg/s at least (the fake FCM's row)
    module: str = ""  # what an import row imports, or a peer row needs
    max_ms: Optional[float] = None  # import rows


FBADMIN, PYFCM = "firebase_admin", "pyfcm"
ROWS = [
    Row("floor", "floor", "raw socket, sequential HTTP/1.1, one kept-alive TLS socket",
        count=5000, http2=False),
    Row("push-h1", "push", "push() sequential, http2=False", count=5000, http2=False, warm=1,
        base="floor", min_ratio=0.6),  # warm=1: connected, as the floor is
    Row("push-h2", "push", "push() sequential, HTTP/2", count=5000, warm=1, base="floor",
        cpu_below=("push-h1", 1.0)),
    Row("relay-ceiling", "ceiling", "raw pipelined HTTP/1.1 through the relay, %d conns x %d"
        % (CEILING_CONNECTIONS, CEILING_DEPTH), count=100_000, relayed=True, http2=False,
        concurrency=700, base="ideal", min_relay_headroom=3.0),
    Row("threads-100", "threads", "push() from 100 threads, each after one push", count=4000,
        relayed=True, concurrency=100, warm=100, base="ideal", min_ratio=0.9, max_conns=2,
        max_cpu=0.10, h2load=True),
    Row("async-push-1000", "async-push", "asyncio: await push() from 1,000 tasks, after one each",
        count=40_000, relayed=True, concurrency=1000, warm=1000, base="ideal", h2load=True,
        min_h2load_rate=0.95, max_h2load_cpu=2.0),
    Row("many-100-new", "many", "push_many(concurrency=100), 10k on a new client",
        count=10_000, relayed=True, concurrency=100, base="ideal", h2load=True),
    Row("many-700-new", "many", "push_many(concurrency=700), 10k on a new client",
        count=10_000, relayed=True, concurrency=700, base="ideal", h2load=True),
    Row("many-100-warm", "many", "push_many(concurrency=100), 10k after a warm-up batch",
        count=10_000, relayed=True, concurrency=100, warm=100, base="ideal", h2load=True),
    Row("many-700-warm", "many", "push_many(concurrency=700), 10k after a warm-up batch",
        count=10_000, relayed=True, concurrency=700, warm=700, base="ideal", h2load=True),
    Row("many-700-x10", "many", "push_many(concurrency=700), 10 batches of 10k, one client",
        count=10_000, relayed=True, concurrency=700, batches=10, base="ideal", h2load=True,
        max_h2load_cpu=2.0),
    Row("multicast-700-x10", "multicast", "push_multicast(concurrency=700), 10 x 10k tokens",
        count=10_000, relayed=True, concurrency=700, batches=10, base="ideal", h2load=True,
        max_h2load_cpu=1.6),
    Row("async-many-700-new", "async-many", "asyncio: push_many(concurrency=700), 10k, new client",
        count=10_000, relayed=True, concurrency=700, base="ideal", h2load=True),
    Row("async-many-700-x10", "async-many", "asyncio: push_many(concurrency=700), 10 x 10k",
        count=10_000, relayed=True, concurrency=700, batches=10, base="ideal", h2load=True,
        max_h2load_cpu=2.0, cpu_below=("fbadmin-async", 10.0)),
    Row("many-direct", "many", "push_many(concurrency=100), no delay: client-bound",
        count=50_000, concurrency=100, warm=100, h2load=True),
    Row("many-h1-100", "many", "push_many(concurrency=100), http2=False, new client", count=10_000,
        relayed=True, http2=False, concurrency=100, base="ideal", h2load=True),
    Row("many-h1-200", "many", "push_many(concurrency=200), http2=False, new client", count=10_000,
        relayed=True, http2=False, concurrency=200, base="ideal", h2load=True),
    Row("fake-fcm", "fake", "push_many(concurrency=100) over HTTP/2 to andpush fake-fcm, 50k",
        count=50_000, concurrency=100, warm=100, min_rate=10_000),
    Row("pyfcm-notify", "pyfcm", "peer: pyfcm notify() sequential", count=1000, http2=False,
        base="floor", module=PYFCM),
    Row("fbadmin-send", "fbadmin-send", "peer: firebase-admin messaging.send() sequential",
        count=1000, http2=False, base="floor", module=FBADMIN),
    Row("fbadmin-each", "fbadmin-each", "peer: firebase-admin send_each, chunks of 500",
        count=2000, relayed=True, http2=False, concurrency=100, base="ideal", module=FBADMIN),
    Row("fbadmin-async", "fbadmin-async", "peer: firebase-admin send_each_async, chunks of 500",
        count=2000, relayed=True, concurrency=500, base="ideal", module=FBADMIN),
    Row("import-andpush", "import", "import andpush (cached bytecode, median of 10)",
        module="andpush", max_ms=40),
    Row("import-pyfcm", "import", "import pyfcm", module=PYFCM),
    Row("import-fbadmin", "import", "import firebase_admin.messaging",
        module=FBADMIN + ".messaging"),
]


def missing_package(row: Row) -> str:
    """The pip name of what a row needs and cannot import here, or ""."""
    top = row.module.split(".")[0]
    return top.replace("_", "-") if top and importlib.util.find_spec(top) is None else ""


# Processes this run starts, stopped whatever happens ###########################################

_helpers: List["subprocess.Popen[bytes]"] = []


def _die_with_parent() -> None:
    """In a helper, before exec: get SIGTERM when bench.py dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(argv: List[str], what: str, port: int) -> "subprocess.Popen[bytes]":
    """Start a helper (server, relay) that stop_all() stops; wait until it listens on ``port``."""
    helper = subprocess.Popen(argv, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    _helpers.append(helper)
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline and helper.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return helper
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("%s did not start (exit status %s)" % (what, helper.poll()))


def stop_all() -> None:
    while _helpers:
        helper = _helpers.pop()
        helper.terminate()  # nothing if it has ended
        try:
            helper.wait(5)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()


def cpu_seconds(pid: int) -> Optional[float]:
    """A process's user + system CPU time from /proc (Linux), or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_certificates(folder: str) -> Dict[str, str]:
    """The fake FCM's throw-away CA, server certificate and key for 127.0.0.1, and its
    service account's RSA key (andpush ships them, their keys public), in ``folder``."""
    import andpush
    paths = {}
    for name, text in (("ca.pem", andpush._FAKE_CA_PEM), ("cert.pem", andpush._FAKE_CERT_PEM),
                       ("key.pem", andpush._FAKE_CERT_KEY_PEM),
                       ("rsa.pem", andpush._FAKE_ACCOUNT_KEY_PEM)):
        paths[name] = os.path.join(folder, name)
        with open(paths[name], "w") as f:
            f.write(text)
    return paths


# nginx #########################################################################################

NGINX_CONFIG = """daemon off;
master_process on;
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    log_format bench '$connection $server_protocol $request_uri';
    access_log {dir}/access.log bench;
    {temp_paths}
    keepalive_requests {keepalive_requests};
    keepalive_timeout {keepalive_seconds}s;
    http2_max_concurrent_streams {streams};
    server {{
        listen 127.0.0.1:{port} ssl{listen_http2};
        {http2_on}
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        default_type application/json;
        location ~ ^/v1/projects/([^/]+)/messages:send$ {{
            return 200 '{{"name": "projects/$1/messages/0:1"}}';
        }}
        location = /token {{ return 200 '{token}'; }}
        location / {{ return 404 '{{"error": "not found"}}'; }}
    }}
}}
"""


def start_nginx(nginx: str, folder: str, certs: Dict[str, str]) -> Tuple[int, int, str]:
    """Start nginx on a free loopback port: its port, its worker's pid, its access log."""
    built = subprocess.run([nginx, "-V"], capture_output=True, text=True).stderr
    found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", built)
    temp = ["client_body"] + [m for m in ("proxy", "fastcgi", "uwsgi", "scgi")
                              if "--without-http_%s_module" % m not in built]
    modern = found is not None and tuple(map(int, found.groups())) >= (1, 25, 1)
    port = free_port()
    config = os.path.join(folder, "nginx.conf")
    with open(config, "w") as f:
        f.write(NGINX_CONFIG.format(
            dir=folder, port=port, cert=certs["cert.pem"], key=certs["key.pem"],
            user="user root;" if os.geteuid() == 0 else "", streams=H2_STREAMS,
            temp_paths=" ".join("%s_temp_path %s/%s;" % (m, folder, m) for m in temp),
            keepalive_requests=KEEPALIVE_REQUESTS, keepalive_seconds=KEEPALIVE_SECONDS,
            listen_http2="" if modern else " http2",  # "http2 on;" is nginx 1.25.1's
            http2_on="http2 on;" if modern else "", token=TOKEN_BODY.decode()))
    try:
        master = start([nginx, "-p", folder, "-c", config, "-e", folder + "/error.log"],
                       "nginx", port)
    except RuntimeError:
        with open(os.path.join(folder, "error.log")) as f:
            raise RuntimeError("nginx did not start:\n" + f.read()[-2000:]) from None
    try:
        with open("/proc/%d/task/%d/children" % (master.pid, master.pid)) as f:
            worker = int(f.read().split()[0])
    except (OSError, IndexError):
        worker = master.pid
    return port, worker, os.path.join(folder, "access.log")


# bench.py's own server (only without nginx) ####################################################
# The standard library's threading HTTP/1.1 server (the HTTP/2 rows need nginx), logging as
# nginx does: a connection (its client's port), the protocol, the path.

class OwnHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    wbufsize = 65536  # an answer goes out in one write, at the flush after do_POST
    disable_nagle_algorithm = True  # TCP_NODELAY, as nginx
    log_fd = -1  # the log, opened to append: each line is one atomic write, no lock

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = ((200, V1_BODY) if self.path.endswith("/messages:send") else
                        (200, TOKEN_BODY) if self.path == "/token" else (404, b"{}"))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, *args: Any) -> None:
        os.write(self.log_fd, b"%d HTTP/1.1 %s\n" % (self.client_address[1], self.path.encode()))


def serve(port: int, folder: str) -> None:
    """The own server (``--serve``): serves on ``port`` until killed, logs to ``folder``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem"))
    context.set_alpn_protocols(["http/1.1"])
    OwnHandler.log_fd = os.open(os.path.join(folder, OWN_LOG),
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), OwnHandler)
    server.socket.listen(LISTEN_BACKLOG)
    server.socket = context.wrap_socket(server.socket, server_side=True,
                                        do_handshake_on_connect=False)  # in each thread
    server.serve_forever()


# The relay: 25 ms each way #####################################################################

class Leg:
    """One socket of a relayed connection and the bytes due to be written to it."""

    def __init__(self, sock: socket.socket, selector: selectors.BaseSelector,
                 not_before: float) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.selector = sock, selector
        self.not_before = not_before  # what this socket reads goes on no earlier than this
        self.out = bytearray()
        self.peer: "Leg" = self
        self.writing = self.closed = False  # writing: the selector watches for writability
        selector.register(sock, selectors.EVENT_READ, self)

    def deliver(self, data: bytes) -> None:
        """Bytes whose delay is over (b"": the other side closed: close after them)."""
        if not self.closed:
            self.out += data
            self.flush()
            if not data:
                self.close()

    def flush(self) -> None:
        try:
            while self.out:
                del self.out[:self.sock.send(self.out)]
        except BlockingIOError:
            pass
        except OSError:  # the far end is gone: so is the connection
            self.close()
            self.peer.close()
        if not self.closed and self.writing != bool(self.out):
            self.writing = bool(self.out)
            self.selector.modify(self.sock, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if self.writing else 0), self)

    def receive(self) -> Optional[bytes]:
        """What the socket has (b"" at its end, and the socket is closed), None if nothing yet."""
        try:
            data = self.sock.recv(262144)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self.close()
        return data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.selector.unregister(self.sock)
            self.sock.close()


def relay(port: int, upstream_port: int, delay: float) -> None:
    """The relay's loop (``--relay``): relays from ``port`` until killed."""
    listener = socket.create_server(("127.0.0.1", port), backlog=LISTEN_BACKLOG)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    due: List[Tuple[float, int, Leg, bytes]] = []  # a heap: (when, order, to whom, what)
    order = itertools.count()
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, leg, data = heapq.heappop(due)
            leg.deliver(data)
        timeout = max(0.0, due[0][0] - now) if due else None
        for key, events in selector.select(timeout):
            now = time.monotonic()
            if key.data is None:
                try:
                    client, _ = listener.accept()
                except BlockingIOError:
                    continue
                upstream = socket.create_connection(("127.0.0.1", upstream_port))
                # the client's first bytes wait a round trip more: its TCP handshake
                near, far = Leg(client, selector, now + 2 * delay), Leg(upstream, selector, now)
                near.peer, far.peer = far, near
                continue
            leg = key.data
            if events & selectors.EVENT_WRITE:
                leg.flush()
            if leg.closed or not events & selectors.EVENT_READ:
                continue
            data = leg.receive()
            if data is not None:
                heapq.heappush(due, (max(now, leg.not_before) + delay, next(order), leg.peer,
                                     data))


# The rows' clients (each row runs in a child process: --child NAME) ############################

MESSAGE = {"token": DEVICE_TOKEN,
           "notification": {"title": "Benchmark", "body": "andpush benchmark push"},
           "data": {"kind": "bench", "id": "0"}}
TARGETLESS = {key: value for key, value in MESSAGE.items() if key != "token"}  #: multicast's


def messages(count: int) -> Iterator[Dict[str, Any]]:
    """``count`` distinct v1 messages, made as they are read."""
    for number in range(count):
        yield dict(MESSAGE, data={"kind": "bench", "id": str(number)})


def device_tokens(count: int) -> Iterator[str]:
    """``count`` distinct device tokens as long as MESSAGE's, made as they are read."""
    for number in range(count):
        yield "%s%07d" % (DEVICE_TOKEN[:-7], number)


class Tally:
    """What a row's pushes ended in: successes, failures, the first failure; and how many
    pushes the row asked for, so that one without an outcome shows as lost."""

    def __init__(self) -> None:
        self.ok, self.failed, self.first_error, self.asked = 0, 0, "", 0

    def add(self, outcome: object) -> None:
        if isinstance(outcome, Exception):
            self.failed += 1
            self.first_error = self.first_error or repr(outcome)[:300]
        else:
            self.ok += 1

    def call(self, function: Callable[..., object], *args: Any) -> None:
        try:
            self.add(function(*args))
        except Exception as exc:  # andpush.Error or a peer's: counted, not fatal
            self.add(exc)


def message_length(data: bytes) -> int:
    """The length of the whole HTTP/1.1 answer at the start of ``data``, or 0 while incomplete."""
    end = data.find(b"\r\n\r\n")
    found = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", data[:end]) if end > 0 else None
    length = end + 4 + (int(found.group(1)) if found else 0)
    return length if end > 0 and len(data) >= length else 0


class RawConnection:
    """Pre-built HTTP/1.1 requests on one kept-alive TLS socket: no client can do less."""

    def __init__(self, port: int, cafile: str, project: str = PROJECT) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = ssl.create_default_context(cafile=cafile)
        self.sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        body = json.dumps({"message": MESSAGE}).encode()
        self.request = b"".join((
            b"POST /v1/projects/%s/messages:send HTTP/1.1\r\n" % project.encode(),
            b"Host: 127.0.0.1:%d\r\nAuthorization: Bearer bench-token\r\n" % port,
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body), body))
        self.answer_length = len(self.exchange())  # every answer is as long (a fixed body)
        self.sent = self.done = self.received = 0  # for pipelining

    def exchange(self) -> bytes:
        self.sock.sendall(self.request)
        data = b""
        while not message_length(data):
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("the server closed the connection")
            data += more
        if not data.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError("unexpected answer %r" % data[:60])
        return data


def pipeline(connections: List[RawConnection], tally: Tally, count: int) -> None:
    """Send ``count`` requests over the connections, CEILING_DEPTH in flight on each."""
    each = count // len(connections)
    tally.asked += each * len(connections)
    selector = selectors.DefaultSelector()
    for connection in connections:
        connection.sent = min(CEILING_DEPTH, each)
        connection.sock.sendall(connection.request * connection.sent)
        selector.register(connection.sock, selectors.EVENT_READ, connection)
    busy = len(connections)
    while busy:
        ready = selector.select(CHILD_DEADLINE)
        if not ready:
            raise TimeoutError("no answer for %d s" % CHILD_DEADLINE)
        for key, _ in ready:
            connection = key.data
            data = connection.sock.recv(262144)
            while connection.sock.pending():
                data += connection.sock.recv(262144)
            if not data:
                raise ConnectionError("the server closed a connection")
            connection.received += len(data)
            done = connection.received // connection.answer_length
            more = min(done - connection.done, each - connection.sent)
            tally.ok, connection.done = tally.ok + done - connection.done, done
            if more:
                connection.sock.sendall(connection.request * more)
                connection.sent += more
            if done >= each:
                selector.unregister(connection.sock)
                busy -= 1


Work = Tuple[Callable[[Tally, int], None], Callable[[], object]]  # timed part, clean-up


def repeated(call: Callable[[], object]) -> Callable[[Tally, int], None]:
    """A sequential row's timed part: ``call`` as many times as it is told, tallied."""
    def work(tally: Tally, count: int) -> None:
        tally.asked += count
        for _ in range(count):
            tally.call(call)
    return work


def warm_up(work: Callable[[Tally, int], None], count: int) -> None:
    """Run ``count`` messages of a row's own work first, untimed (raise if any failed):
    the connections it needs are up, as in a client that has sent before."""
    warm = Tally()
    if count:
        work(warm, count)
    if warm.failed:
        raise RuntimeError("warm-up failed: " + warm.first_error)


def setup_floor(row: Row, port: int, cafile: str, project: str = PROJECT) -> Work:
    connection = RawConnection(port, cafile, project)
    return repeated(connection.exchange), connection.sock.close


def setup_ceiling(row: Row, port: int, cafile: str) -> Work:
    with concurrent.futures.ThreadPoolExecutor(CEILING_CONNECTIONS) as pool:  # handshakes
        connections = list(pool.map(lambda _: RawConnection(port, cafile),
                                    range(CEILING_CONNECTIONS)))
    return functools.partial(pipeline, connections), lambda: [c.sock.close() for c in connections]


def setup_andpush(row: Row, port: int, cafile: str) -> Work:
    """A new client: push() in sequence or from threads, or push_many batches."""
    import andpush
    client = andpush.new(access_token="bench-token", project_id=PROJECT,
                         endpoint="https://127.0.0.1:%d" % port,
                         ssl_context=ssl.create_default_context(cafile=cafile), http2=row.http2)

    def sequential(tally: Tally, count: int) -> None:
        tally.asked += count
        for message in messages(count):
            tally.call(client.push, message)

    # The threads row's threads live as long as the client, as an application's pool does:
    # those that pushed in the warm-up push in the timed part, and no thread starts in it.
    pool = concurrent.futures.ThreadPoolExecutor(row.concurrency)

    def threads(tally: Tally, count: int) -> None:
        parts = [Tally() for _ in range(row.concurrency)]  # one per thread: no lock
        list(pool.map(lambda part: sequential(part, count // row.concurrency), parts))
        for part in parts:
            tally.ok, tally.failed = tally.ok + part.ok, tally.failed + part.failed
            tally.asked += part.asked
            tally.first_error = tally.first_error or part.first_error

    def many(tally: Tally, count: int, batches: int = row.batches) -> None:
        for _ in range(batches):
            tally.asked += count
            for _, outcome in client.push_many(messages(count), concurrency=row.concurrency):
                tally.add(outcome)

    def multicast(tally: Tally, count: int, batches: int = row.batches) -> None:
        for _ in range(batches):
            tally.asked += count
            for _, outcome in client.push_multicast(TARGETLESS, device_tokens(count),
                                                    concurrency=row.concurrency):
                tally.add(outcome)

    work = {"push": sequential, "threads": threads, "many": many, "multicast": multicast}[
        row.kind]
    warm_up((lambda tally, count: many(tally, count, 1)) if row.kind == "many" else work,
            row.warm)

    def close() -> None:
        pool.shutdown()
        client.close()
    return work, close


def setup_fake(row: Row, port: int, cafile: str) -> Work:
    """A client of the fake FCM listening on ``port``, with the credentials it takes."""
    import andpush
    client = andpush.new(access_token=andpush._FAKE_ACCESS_TOKEN,
                         project_id=andpush._FAKE_PROJECT, endpoint="https://127.0.0.1:%d" % port,
                         ssl_context=andpush.FakeFCM().ssl_context())

    def many(tally: Tally, count: int) -> None:
        tally.asked += count
        for _, outcome in client.push_many(messages(count), concurrency=row.concurrency):
            tally.add(outcome)
    warm_up(many, row.warm)
    return many, client.close


def setup_async(row: Row, port: int, cafile: str) -> Work:
    """A new asyncio client on a loop of its own: push() from concurrent tasks, or push_many."""
    import asyncio

    import andpush
    loop = asyncio.new_event_loop()
    client = andpush.new_async(access_token="bench-token", project_id=PROJECT,
                               endpoint="https://127.0.0.1:%d" % port,
                               ssl_context=ssl.create_default_context(cafile=cafile))

    async def task(tally: Tally, count: int) -> None:
        tally.asked += count
        for message in messages(count):
            try:
                tally.add(await client.push(message))
            except andpush.Error as exc:
                tally.add(exc)

    async def tasks(tally: Tally, count: int) -> None:
        await asyncio.gather(*[task(tally, count // row.concurrency)
                               for _ in range(row.concurrency)])

    async def many(tally: Tally, count: int) -> None:
        for _ in range(row.batches):
            tally.asked += count
            async for _, outcome in client.push_many(messages(count),
                                                     concurrency=row.concurrency):
                tally.add(outcome)
    work = tasks if row.kind == "async-push" else many
    warm_up(lambda tally, count: loop.run_until_complete(tasks(tally, count)), row.warm)
    return (lambda tally, count: loop.run_until_complete(work(tally, count)),
            lambda: (loop.run_until_complete(client.aclose()), loop.close()))


def service_account(port: int, rsa_key: str) -> Dict[str, str]:
    with open(rsa_key) as f:
        key = f.read()
    return {"type": "service_account", "project_id": PROJECT, "private_key_id": "bench",
            "private_key": key, "client_email": "bench@p.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": "https://127.0.0.1:%d/token" % port}


def setup_pyfcm(row: Row, port: int, cafile: str, rsa_key: str) -> Work:
    from google.oauth2 import service_account as google_service_account
    from pyfcm import FCMNotification
    credentials = google_service_account.Credentials.from_service_account_info(
        service_account(port, rsa_key),
        scopes=["https://www.googleapis.com/auth/firebase.messaging"])
    fcm = FCMNotification(credentials=credentials, project_id=PROJECT)
    fcm.FCM_END_POINT_BASE = "https://127.0.0.1:%d/v1/projects" % port  # a class constant

    notify = functools.partial(fcm.notify, fcm_token=DEVICE_TOKEN,
                               notification_title="Benchmark",
                               notification_body="andpush benchmark push",
                               data_payload={"kind": "bench", "id": "0"})
    notify()
    return repeated(notify), lambda: None


def setup_fbadmin(row: Row, port: int, cafile: str, rsa_key: str) -> Work:
    import asyncio

    import firebase_admin
    import requests
    from firebase_admin import _http_client, credentials, messaging
    app = firebase_admin.initialize_app(
        credentials.Certificate(service_account(port, rsa_key)), name="bench")
    endpoint = "https://127.0.0.1:%d" % port
    service_class = messaging._MessagingService  # it reads FCM_URL when it is made
    original, service_class.FCM_URL = (service_class.FCM_URL,
                                       endpoint + "/v1/projects/{0}/messages:send")
    try:
        service = messaging._get_messaging_service(app)
    finally:
        service_class.FCM_URL = original
    # the pool firebase-admin mounts for FCM's host, mounted for this one
    service._client.session.mount(endpoint, requests.adapters.HTTPAdapter(
        pool_connections=100, pool_maxsize=100, max_retries=_http_client.DEFAULT_RETRY_CONFIG))
    message = messaging.Message(token=DEVICE_TOKEN, data=MESSAGE["data"],
                                notification=messaging.Notification(title="Benchmark",
                                                                    body="andpush push"))
    loop = asyncio.new_event_loop()  # send_each_async's, kept for its connections

    def in_chunks(send_chunk: Callable[[List[Any]], Any]) -> Callable[[Tally, int], None]:
        def work(tally: Tally, count: int) -> None:
            tally.asked += count
            for start_at in range(0, count, 500):
                for response in send_chunk([message] * min(500, count - start_at)).responses:
                    tally.add(response.message_id if response.success else response.exception)
        return work

    def clean_up() -> None:
        loop.run_until_complete(service._async_client.aclose())  # on the loop it used
        loop.close()
        firebase_admin.delete_app(app)
    work = {"fbadmin-send": repeated(functools.partial(messaging.send, message, app=app)),
            "fbadmin-each": in_chunks(lambda chunk: messaging.send_each(chunk, app=app)),
            "fbadmin-async": in_chunks(lambda chunk: loop.run_until_complete(
                messaging.send_each_async(chunk, app=app)))}[row.kind]
    work(Tally(), 1)  # untimed: the access token, a connection
    return work, clean_up


SETUPS: Dict[str, Callable[..., Work]] = {
    "floor": setup_floor, "ceiling": setup_ceiling, "push": setup_andpush,
    "threads": setup_andpush, "many": setup_andpush, "multicast": setup_andpush,
    "pyfcm": setup_pyfcm,
    "fbadmin-send": setup_fbadmin, "fbadmin-each": setup_fbadmin, "async-push": setup_async,
    "async-many": setup_async, "fbadmin-async": setup_fbadmin, "fake": setup_fake,
}


def run_child(row: Row, port: int, cafile: str, rsa_key: str, quick: bool) -> Dict[str, Any]:
    """Set a row's client up, time its work (taking turns with a floor of its own when it is
    compared with the floor), and say how it went: printed as JSON for the parent."""
    count = row.count // QUICK_SHARE if quick else row.count
    sides = {"row": SETUPS[row.kind](row, port, cafile, *[rsa_key] * bool(row.module))}
    if row.base == "floor":
        sides["floor"] = setup_floor(row, port, cafile, FLOOR_PROJECT)
    slices = FLOOR_SLICES if row.base == "floor" else 1
    report: Dict[str, Any] = collections.defaultdict(float)
    tallies = {side: Tally() for side in sides}
    for _ in range(slices):
        for side, (work, _) in sides.items():
            wall, cpu = time.perf_counter(), time.process_time()
            work(tallies[side], count // slices)
            report[side + "_seconds"] += time.perf_counter() - wall
            report[side + "_cpu"] += time.process_time() - cpu
    for side, (_, clean_up) in sides.items():
        clean_up()
        report.update({side + "_ok": tallies[side].ok, side + "_failed": tallies[side].failed,
                       side + "_asked": tallies[side].asked,
                       side + "_error": tallies[side].first_error})
    return report


# Running the rows, the table ###################################################################

@dataclass
class Setting:
    """What the rows run against."""

    server: str  # "nginx" or "own"
    port: int
    relay_port: int
    server_pid: int  # nginx's worker or the own server
    relay_pid: int
    log: str  # lines of "connection protocol path"
    certs: Dict[str, str]
    folder: str  # the run's temporary folder
    rtt: float = 0.0
    h2load: str = ""  # its path, "" when it is not installed
    h2load_start_up: float = 0.0  # its CPU seconds before it connects


@dataclass
class Result:
    row: Row
    figures: Dict[str, Any] = field(default_factory=dict)  # what --json prints of the row
    checks: Tuple[Tuple[str, Optional[bool]], ...] = ()  # (target, met; None: not judged)
    failure: str = ""  # why the row failed: it errored, lost messages, or h2load failed
    note: str = ""

    @property
    def met(self) -> str:
        """The column ``met``: met, MISSED, not judged (a target needs h2load), - (none)."""
        verdicts = [ok for _, ok in self.checks]
        return ("-" if not verdicts else "MISSED" if False in verdicts else
                "not judged" if None in verdicts else "met")


def cpu_share(pid: int, before: Optional[float], seconds: float) -> Optional[float]:
    after = cpu_seconds(pid)
    return None if before is None or after is None else (after - before) / seconds


# h2load, a client written in C, sends a bulk row's request (the same path, headers and body)
# through the same nginx and relay, with the row's connections and streams, just after the row:
# what a frugal client gets here, in the same run. It reports no CPU of its own: its user +
# system time is this process's RUSAGE_CHILDREN across its run, less its start-up (an h2load
# that finds no server), which a row's timed part does not pay either.

H2LOAD_STARTS = 5  #: runs of h2load against no server whose median is its start-up CPU


def children_cpu() -> float:
    """User + system CPU seconds of this process's ended children, waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def h2load_start_up(h2load: str) -> float:
    """h2load's CPU seconds before its first connection: a run against a port nobody serves."""
    def one() -> float:
        before = children_cpu()
        subprocess.run([h2load, "-n", "1", "https://127.0.0.1:%d/" % free_port()],
                       capture_output=True, timeout=START_DEADLINE)
        return children_cpu() - before
    return statistics.median(one() for _ in range(H2LOAD_STARTS))


def h2load_command(row: Row, setting: Setting, count: int) -> List[str]:
    """h2load's run for a row: its connections and streams (HTTP/2: 100 on each connection the
    concurrency needs; HTTP/1.1: one request on each of concurrency connections), its warm-up
    and all its batches in one run, andpush's request (body, access token, user agent)."""
    import andpush  # the parent has it already: test_andpush imported it
    connections = -(-row.concurrency // H2_STREAMS) if row.http2 else row.concurrency
    body = os.path.join(setting.folder, "body.json")
    with open(body, "wb") as f:
        f.write(b'{"message":%s,"validate_only":false}'
                % json.dumps(MESSAGE, separators=(",", ":")).encode())
    return [setting.h2load, "-n", str(row.warm + count * row.batches), "-c", str(connections),
            "-m", str(min(row.concurrency, H2_STREAMS) if row.http2 else 1), "-t", "1",
            "-d", body, "-H", "authorization: Bearer bench-token",
            "-H", "content-type: application/json", "-H", "user-agent: andpush/" +
            andpush.__version__] + ["--h1"] * (not row.http2) + [
            "--log-file=" + os.path.join(setting.folder, row.name + ".h2load")] * bool(row.warm) + [
            "https://127.0.0.1:%d/v1/projects/%s/messages:send"
            % (setting.relay_port if row.relayed else setting.port, PROJECT)]


def steady_rate(log: str, warm: int) -> float:
    """Requests a second after the first ``warm`` ended, from h2load's per-request log (start
    in microseconds, status, microseconds to the end), as a row times after its warm-up."""
    with open(log) as f:
        ends = sorted(int(start) + int(took) for start, _, took in
                      (line.split("\t")[:3] for line in f))
    return (len(ends) - warm) / ((ends[-1] - ends[warm - 1]) / 1e6)


def run_h2load(row: Row, setting: Setting, count: int) -> Dict[str, Any]:
    """h2load's figures for a row (its rate as the row's is measured, its CPU per 1,000
    requests), or {"error": why}."""
    command = h2load_command(row, setting, count)
    requests = row.warm + count * row.batches
    log = command[-2][len("--log-file="):] if row.warm else ""
    if log and os.path.exists(log):  # h2load adds to it: a repeat starts afresh
        os.remove(log)
    before = children_cpu()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_DEADLINE)
    except subprocess.TimeoutExpired:
        return {"error": "h2load killed after %d s" % CHILD_DEADLINE}
    cpu = children_cpu() - before - setting.h2load_start_up
    answered = re.search(r"status codes: (\d+) 2xx", done.stdout)
    protocol = re.search(r"Application protocol: (\S+)", done.stdout)
    rate = re.search(r"finished in [^,]+, ([\d.]+) req/s", done.stdout)
    if answered and int(answered.group(1)) != requests:
        return {"error": "h2load: %s of %d requests answered 2xx" % (answered.group(1), requests)}
    if done.returncode or not answered or not rate:
        said = (done.stderr + done.stdout).strip().splitlines()
        return {"error": "h2load: " + (said[-1] if said else "exit status %d" % done.returncode)}
    if not protocol or protocol.group(1) != ("h2" if row.http2 else "http/1.1"):
        return {"error": "h2load spoke %s" % (protocol and protocol.group(1))}
    return {"command": shlex.join(command), "requests": requests,
            "rate": steady_rate(log, row.warm) if log else float(rate.group(1)),
            "cpu_per_1k": 1000 * cpu / requests}


def run_row(row: Row, setting: Setting, quick: bool) -> Result:
    """Run a row in a child process (and h2load after it), judge it against its targets.

    A row whose CPU is judged (judged_on_cpu) runs REPEATS times, taking turns with h2load
    where it applies, as one run swings by a fifth or more: the run whose CPU figure is the
    median is judged, and the note gives all of them."""
    result = Result(row)
    if missing_package(row):
        result.note = "not installed (pip install %s)" % missing_package(row)
        return result
    if row.kind == "import":
        return import_row(row, result)
    if row.kind == "fake":
        return fake_row(row, quick, result)
    if row.http2 and setting.server != "nginx":
        result.note = "not measured: needs nginx"
        return result
    if quick or not judged_on_cpu(row):
        return measure_row(row, setting, quick)
    runs = []
    for repeat in range(REPEATS):
        if repeat:
            print("running %s again (%d of %d) ..." % (row.name, repeat + 1, REPEATS),
                  file=sys.stderr, flush=True)
        runs.append(measure_row(row, setting, quick))
        if runs[-1].failure:
            return runs[-1]
    by_h2load = row.max_h2load_cpu is not None and all("cpu_vs_h2load" in r.figures for r in runs)
    key = "cpu_vs_h2load" if by_h2load else "cpu_per_1k"  # the figure its CPU target judges
    runs.sort(key=lambda r: float(r.figures[key]))
    median = runs[len(runs) // 2]
    median.figures["cpu_runs"] = [r.figures[key] for r in runs]
    median.note = "the median of %d runs by %s: %s" % (
        REPEATS, "CPU/h2" if by_h2load else "CPU/1k",
        ", ".join(("%.2fx" if by_h2load else "%.3f") % r.figures[key] for r in runs))
    return median


def judged_on_cpu(row: Row) -> bool:
    """Whether a row's CPU per message is judged: by a target of its own, or as the CPU
    another row's target is measured against."""
    return (row.max_cpu is not None or row.max_h2load_cpu is not None
            or bool(row.cpu_below[0]) or any(other.cpu_below[0] == row.name for other in ROWS))


def measure_row(row: Row, setting: Setting, quick: bool) -> Result:
    """One run of a row in a child process (and h2load after it), judged against its targets."""
    result = Result(row)
    with open(setting.log, "rb") as f:
        offset = f.seek(0, os.SEEK_END)
    before = cpu_seconds(setting.server_pid), cpu_seconds(setting.relay_pid)
    started = time.perf_counter()
    port, ca = (setting.relay_port if row.relayed else setting.port), setting.certs["ca.pem"]
    command = BENCH + ["--child", row.name, "--port", str(port), "--cafile", ca, "--rsa-key",
                       setting.certs["rsa.pem"]] + ["--quick"] * quick
    env = dict(os.environ, REQUESTS_CA_BUNDLE=ca, SSL_CERT_FILE=ca)
    try:
        child = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE,
                               timeout=CHILD_DEADLINE)
    except subprocess.TimeoutExpired:
        result.failure = "killed after %d s" % CHILD_DEADLINE
        return result
    seconds = time.perf_counter() - started
    shares = cpu_share(setting.server_pid, before[0], seconds), (
        cpu_share(setting.relay_pid, before[1], seconds) if row.relayed else None)
    if child.returncode:
        result.failure = (child.stderr.strip().splitlines() or ["?"])[-1][:200]
        return result
    report = json.loads(child.stdout.strip().splitlines()[-1])
    with open(setting.log, "rb") as f:  # the row's pushes: not its floor's, nor tokens
        f.seek(offset)
        lines = [line.split() for line in f.read().decode().splitlines()
                 if line.endswith("/projects/%s/messages:send" % PROJECT)]
    protocols = collections.Counter(line[1] for line in lines)
    conns = len({line[0] for line in lines})
    rate = report["row_ok"] / report["row_seconds"]
    cpu = 1000 * report["row_cpu"] / max(report["row_ok"] + report["row_failed"], 1)
    in_flight = min(row.concurrency, H2_STREAMS * conns) if row.http2 else row.concurrency
    base = (in_flight / setting.rtt if row.base == "ideal" else
            report["floor_ok"] / report["floor_seconds"] if row.base == "floor" else None)
    result.figures = {
        "server": setting.server, "proto": {p: n for p, n in sorted(protocols.items())},
        "conns": conns, "rate": rate, "ratio": rate / base if base else None,
        "base": row.base or None, "cpu_per_1k": cpu, "server_share": shares[0],
        "relay_share": shares[1]}
    checks: List[Tuple[str, Optional[bool]]] = [
        ("all %s" % ("h2" if row.http2 else "http/1.1"), False)] * (
        set(protocols) != {"HTTP/2.0" if row.http2 else "HTTP/1.1"})
    if base and row.min_ratio is not None:
        checks.append((">=%g %s" % (row.min_ratio, row.base), rate / base >= row.min_ratio))
    if row.max_conns is not None:
        checks.append(("conns<=%d" % row.max_conns, conns <= row.max_conns))
    if row.max_cpu is not None:
        checks.append(("CPU<=%g" % row.max_cpu, cpu <= row.max_cpu))
    if base and row.min_relay_headroom is not None and shares[1]:  # the relay's capacity
        checks.append(("relay cap>=%gx ideal" % row.min_relay_headroom,
                       rate / shares[1] / base >= row.min_relay_headroom))
    for side in ("row", "floor"):
        lost = report.get(side + "_asked", 0) - report.get(side + "_ok", 0) - report.get(
            side + "_failed", 0)
        if report.get(side + "_failed") or lost:
            result.failure = "%s%d failed, %d without an outcome%s" % (
                "its floor: " * (side == "floor"), report[side + "_failed"], lost,
                ", first: " + report[side + "_error"] if report[side + "_error"] else "")
    if row.h2load and setting.h2load:
        print("running %s beside h2load ..." % row.name, file=sys.stderr, flush=True)
        h2load = run_h2load(row, setting, row.count // QUICK_SHARE if quick else row.count)
        result.figures["h2load"] = h2load
        if "error" in h2load:
            result.failure = result.failure or h2load["error"]
        else:
            result.figures.update(rate_vs_h2load=rate / h2load["rate"],
                                  cpu_vs_h2load=cpu / h2load["cpu_per_1k"])
    by_h2load = result.figures.get("rate_vs_h2load"), result.figures.get("cpu_vs_h2load")
    if row.min_h2load_rate is not None:
        checks.append((">=%g h2load" % row.min_h2load_rate,
                       None if by_h2load[0] is None else by_h2load[0] >= row.min_h2load_rate))
    if row.max_h2load_cpu is not None:
        checks.append(("CPU<=%gx h2load" % row.max_h2load_cpu,
                       None if by_h2load[1] is None else by_h2load[1] <= row.max_h2load_cpu))
    result.checks = tuple(checks)
    return result


def compare_cpu(results: Dict[str, Result]) -> None:
    """Add each row's CPU target that is relative to another row, once both have run."""
    for result in results.values():
        name, factor = result.row.cpu_below
        other = results.get(name)
        if name and "cpu_per_1k" in result.figures and other and "cpu_per_1k" in other.figures:
            result.checks += (("CPU<=%s's%s" % (name, "/%g" % factor if factor != 1 else ""),
                               result.figures["cpu_per_1k"]
                               <= other.figures["cpu_per_1k"] / factor),)


def fake_row(row: Row, quick: bool, result: Result) -> Result:
    """The fake FCM's rate: ``andpush fake-fcm`` in a process of its own, and a child that
    sends to it, as a user's load test would."""
    port = free_port()
    fake = start([sys.executable, os.path.join(HERE, "andpush.py"), "fake-fcm", "--port",
                  str(port), "--quiet"], "the fake FCM", port)
    before, started = cpu_seconds(fake.pid), time.perf_counter()
    try:
        child = subprocess.run(BENCH + ["--child", row.name, "--port", str(port)]
                               + ["--quick"] * quick, capture_output=True, text=True, cwd=HERE,
                               timeout=CHILD_DEADLINE)
        share = cpu_share(fake.pid, before, time.perf_counter() - started)
    finally:
        fake.terminate()
        fake.wait()
    if child.returncode:
        result.failure = (child.stderr.strip().splitlines() or ["?"])[-1][:200]
        return result
    report = json.loads(child.stdout.strip().splitlines()[-1])
    rate = report["row_ok"] / report["row_seconds"]
    result.figures = {
        "server": "fake", "proto": {}, "conns": None, "rate": rate, "ratio": None,
        "base": None, "cpu_per_1k": 1000 * report["row_cpu"] / max(
            report["row_ok"] + report["row_failed"], 1), "server_share": share,
        "relay_share": None}
    lost = report["row_asked"] - report["row_ok"] - report["row_failed"]
    if report["row_failed"] or lost:
        result.failure = "%d failed, %d without an outcome" % (report["row_failed"], lost)
    if row.min_rate is not None:
        result.checks = ((">=%s/s" % "{:,}".format(int(row.min_rate)), rate >= row.min_rate),)
    return result


IMPORT_SNIPPET = ("import time; started = time.perf_counter(); import %s; "
                  "print(time.perf_counter() - started)")


def import_row(row: Row, result: Result) -> Result:
    """The median time to import a module in a new interpreter, bytecode cached: in a folder
    of its own (PYTHONPYCACHEPREFIX), which the first import writes, so none is left behind."""
    command = [sys.executable, "-c", IMPORT_SNIPPET % row.module]
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="andpush-bench-pycache-") as cache:
        environment["PYTHONPYCACHEPREFIX"] = cache
        runs = [float(subprocess.run(command, capture_output=True, text=True, check=True,
                                     cwd=HERE, env=environment).stdout)
                for _ in range(IMPORT_SAMPLES + 1)][1:]  # the first writes the cache
    milliseconds = 1000 * statistics.median(runs)
    result.figures = {"import_ms": milliseconds}
    if row.max_ms is not None:
        result.checks = (("<=%g ms" % row.max_ms, milliseconds <= row.max_ms),)
    return result


COLUMNS = ("row", "server", "proto", "conns", "msg/s", "ratio", "CPU/1k", "srv/relay",
           "h2load/s", "h2load CPU", "rate/h2", "CPU/h2", "target", "met")


def cells(result: Result) -> Tuple[str, ...]:
    """A result's cells of the table, from its figures ("-" where it has none)."""
    figures, h2load = result.figures, result.figures.get("h2load") or {}
    if "import_ms" in figures:
        return ("-",) * 3 + ("%.1f ms" % figures["import_ms"],) + ("-",) * 7
    if not figures:
        return ("-",) * 11
    proto = "+".join({"HTTP/2.0": "h2"}.get(p, p.lower()) + (
        "" if len(figures["proto"]) == 1 else " %d" % n) for p, n in figures["proto"].items())
    shares = (figures["server_share"], figures["relay_share"])
    return (figures["server"], proto or "-",
            "-" if figures["conns"] is None else str(figures["conns"]),
            "{:,.0f}".format(figures["rate"]),
            "-" if figures["ratio"] is None else "%.2f %s" % (figures["ratio"], figures["base"]),
            "%.3f" % figures["cpu_per_1k"],
            "/".join("-" if s is None else "%d%%" % (100 * s) for s in shares),
            "{:,.0f}".format(h2load["rate"]) if "rate" in h2load else "-",
            "%.3f" % h2load["cpu_per_1k"] if "rate" in h2load else "-",
            "%.2f" % figures["rate_vs_h2load"] if "rate_vs_h2load" in figures else "-",
            "%.2fx" % figures["cpu_vs_h2load"] if "cpu_vs_h2load" in figures else "-")


def missed(result: Result) -> str:
    """Which of a row's targets were missed, when it has more than one."""
    texts = [text for text, ok in result.checks if ok is False]
    return " (%s)" % ", ".join(texts) if texts and len(result.checks) > 1 else ""


def table(results: List[Result]) -> str:
    rows = [COLUMNS] + [(r.row.name + " (50 ms)" * r.row.relayed,) + cells(r) + (
        " ".join(text for text, _ in r.checks) or "-", r.met + missed(r)) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if 3 <= i <= 11 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    notes = ["%s: %s%s" % (r.row.name, r.row.title, "".join(
        " -- " + text for text in (r.note, r.failure and "FAILED: " + r.failure) if text))
        for r in results]
    return "\n".join(lines + [""] + notes)


def verdict(results: List[Result], setting: Setting) -> str:
    """The run's last line: whether anything failed, and what MISSED means."""
    failed = [r.row.name for r in results if r.failure]
    judged = [ok for r in results for _, ok in r.checks]
    counts = "of %d targets %d met, %d MISSED%s" % (
        len(judged), judged.count(True), judged.count(False), (
        ", %d not judged (h2load is not installed: apt-get install nghttp2-client)"
        % judged.count(None)) if None in judged else "")
    meaning = ("MISSED means a speed or CPU target was not reached in this run on this machine "
               "(targets are ratios to h2load, a C client, to the ideal or to a raw socket, "
               "from the same run); it is not an error")
    if setting.server == "own":
        meaning += "; bench.py's own server stood in for nginx, so these figures do not count"
    if failed:
        return ("verdict: FAILED: %s errored or lost messages (their notes say how); %s. %s."
                % (", ".join(failed), counts, meaning))
    return ("verdict: OK: every row ran and every message got its outcome; %s. %s."
            % (counts, meaning))


def start_servers(folder: str, certs: Dict[str, str], own: bool) -> Setting:
    """nginx (or the own server), the relay in front of it, and the round trip through it."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    server = "nginx" if nginx and not own else "own"
    if server == "nginx":
        port, pid, log = start_nginx(nginx, folder, certs)
        print("server: nginx (%s, one worker), HTTP/2 and HTTP/1.1 on 127.0.0.1:%d"
              % (nginx, port), file=sys.stderr, flush=True)
    else:
        port, log = free_port(), os.path.join(folder, OWN_LOG)
        pid = start(BENCH + ["--serve", str(port), folder], "the own server", port).pid
        print("NO NGINX%s: bench.py's own HTTP/1.1 server stands in; its figures do not count, "
              "the HTTP/2 rows are not measured (apt-get install nginx-light)"
              % (" (--own-server)" if nginx else " installed"), file=sys.stderr, flush=True)
    relay_port = free_port()
    relay_process = start(BENCH + ["--relay", str(relay_port), str(port)], "the relay", relay_port)
    setting = Setting(server, port, relay_port, pid, relay_process.pid, log, certs, folder)
    probe = RawConnection(relay_port, certs["ca.pem"])
    setting.rtt = statistics.median(timeit.repeat(probe.exchange, repeat=RTT_SAMPLES, number=1))
    probe.sock.close()
    print("relay: %g ms each way; measured round trip %.1f ms (median of %d), the RTT of the "
          "ideals" % (1000 * ONE_WAY_DELAY, 1000 * setting.rtt, RTT_SAMPLES), file=sys.stderr,
          flush=True)
    setting.h2load = shutil.which("h2load") or ""
    if setting.h2load:
        setting.h2load_start_up = h2load_start_up(setting.h2load)
        print("h2load: %s beside the bulk rows (its start-up, %.1f ms of CPU, not counted)"
              % (setting.h2load, 1000 * setting.h2load_start_up), file=sys.stderr, flush=True)
    else:
        print("NO H2LOAD: the bulk rows are not measured beside a C client and their targets "
              "relative to it are not judged (apt-get install nghttp2-client)", file=sys.stderr,
              flush=True)
    return setting


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="andpush benchmark against nginx")
    parser.add_argument("--quick", action="store_true", help="smaller counts: a smoke run")
    parser.add_argument("--rows", help="comma-separated row names (or parts of names)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (every row, its figures and targets)")
    parser.add_argument("--own-server", action="store_true",
                        help="use bench.py's own server even where nginx is installed")
    for hidden in ("--child", "--cafile", "--rsa-key"):  # what bench.py passes its helpers
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--relay", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    by_name = {row.name: row for row in ROWS}
    if args.child:
        print(json.dumps(run_child(by_name[args.child], args.port, args.cafile, args.rsa_key,
                                   args.quick)))
        return 0
    if args.relay:
        relay(*args.relay, ONE_WAY_DELAY)
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
    wanted = args.rows.split(",") if args.rows else []
    rows = [row for row in ROWS if not wanted or any(w and w in row.name for w in wanted)]
    if args.list or not rows:
        print("\n".join("%-18s %s" % (row.name, row.title) for row in ROWS))
        return 0 if args.list else 2
    if sys.dont_write_bytecode:  # python -B: the rows' children, the relay, write none either
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the helpers stop
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="andpush-bench-") as folder:
            setting = start_servers(folder, write_certificates(folder), args.own_server)
            done: Dict[str, Result] = {}
            for row in rows:
                print("running %s ..." % row.name, file=sys.stderr, flush=True)
                done[row.name] = run_row(row, setting, args.quick)
            compare_cpu(done)
    except KeyboardInterrupt:
        return 130
    finally:
        stop_all()
    results = list(done.values())
    status = 1 if any(r.failure for r in results) else 0
    header = {"python": sys.version.split()[0], "openssl": ssl.OPENSSL_VERSION,
              "cpus": os.cpu_count() or 0, "load": os.getloadavg()[0], "quick": args.quick,
              "seconds": time.perf_counter() - started, "server": setting.server,
              "round_trip_ms": 1000 * setting.rtt, "h2load": setting.h2load or None}
    if args.json:
        print(json.dumps(dict(header, rows=[dict(
            name=r.row.name, title=r.row.title, relayed=r.row.relayed, **r.figures,
            targets=[{"target": text, "met": ok} for text, ok in r.checks], met=r.met,
            note=r.note, failure=r.failure) for r in results],
            verdict=verdict(results, setting), exit_status=status), indent=1))
        return status
    print("andpush bench: Python %s, %s, %d CPUs, load %.1f%s; %.0f s; server: %s; h2load: %s"
          % (header["python"], header["openssl"], header["cpus"], header["load"],
             ", --quick" if args.quick else "", header["seconds"], setting.server + (
                 " (bench.py's own: these figures do not count)" * (setting.server == "own")),
             "beside the bulk rows" if setting.h2load else "not installed"))
    print(table(results))
    print(verdict(results, setting))
    return status


if __name__ == "__main__":
    sys.exit(main())
