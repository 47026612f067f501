"""Benchmark andpush against a server we did not write: nginx on loopback.

``python bench.py`` (a few minutes); ``--quick`` (a smoke run), ``--rows NAME,...`` (parts of
names; ``--list`` shows them), ``--own-server``. No network, no credentials. The peers (pyfcm,
firebase-admin) run when importable: use a virtual environment's interpreter that has them.

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
``srv/relay`` the share of a core the server and relay used. The targets are all in ROWS.
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
import selectors
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
from dataclasses import dataclass
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
    min_rate: Optional[float] = None  # messages per second
    min_relay_headroom: Optional[float] = None  # msg/s / relay's CPU share, over the ideal
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
        max_cpu=0.08),
    Row("async-push-1000", "async-push", "asyncio: await push() from 1,000 tasks, after one each",
        count=40_000, relayed=True, concurrency=1000, warm=1000, base="ideal", min_ratio=0.9,
        max_cpu=0.05),
    Row("many-100-new", "many", "push_many(concurrency=100), 10k on a new client",
        count=10_000, relayed=True, concurrency=100, base="ideal"),
    Row("many-700-new", "many", "push_many(concurrency=700), 10k on a new client",
        count=10_000, relayed=True, concurrency=700, base="ideal", min_ratio=0.8),
    Row("many-100-warm", "many", "push_many(concurrency=100), 10k after a warm-up batch",
        count=10_000, relayed=True, concurrency=100, warm=100, base="ideal"),
    Row("many-700-warm", "many", "push_many(concurrency=700), 10k after a warm-up batch",
        count=10_000, relayed=True, concurrency=700, warm=700, base="ideal", min_ratio=0.88),
    Row("many-700-x10", "many", "push_many(concurrency=700), 10 batches of 10k, one client",
        count=10_000, relayed=True, concurrency=700, batches=10, base="ideal", min_ratio=0.92,
        max_cpu=0.025),
    Row("async-many-700-new", "async-many", "asyncio: push_many(concurrency=700), 10k, new client",
        count=10_000, relayed=True, concurrency=700, base="ideal"),
    Row("async-many-700-x10", "async-many", "asyncio: push_many(concurrency=700), 10 x 10k",
        count=10_000, relayed=True, concurrency=700, batches=10, base="ideal", min_ratio=0.9,
        max_cpu=0.03, cpu_below=("fbadmin-async", 10.0)),
    Row("many-direct", "many", "push_many(concurrency=100), no delay: client-bound",
        count=50_000, concurrency=100, warm=100, min_rate=40_000),
    Row("many-h1-100", "many", "push_many(concurrency=100), http2=False, new client", count=10_000,
        relayed=True, http2=False, concurrency=100, base="ideal", min_ratio=0.9, max_cpu=0.10),
    Row("many-h1-200", "many", "push_many(concurrency=200), http2=False, new client", count=10_000,
        relayed=True, http2=False, concurrency=200, base="ideal", min_ratio=0.9, max_cpu=0.10),
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
    """The test suite's throw-away CA, server certificate and key, and RSA key, in ``folder``."""
    import test_andpush as t
    paths = {}
    for name, text in (("ca.pem", t.TEST_CA_PEM), ("cert.pem", t.TEST_SERVER_CERT_PEM),
                       ("key.pem", t.TEST_SERVER_KEY_PEM), ("rsa.pem", t.TEST_RSA_KEY_PKCS8_PEM)):
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


def messages(count: int) -> Iterator[Dict[str, Any]]:
    """``count`` distinct v1 messages, made as they are read."""
    for number in range(count):
        yield dict(MESSAGE, data={"kind": "bench", "id": str(number)})


class Tally:
    """What a row's pushes ended in: successes, failures, the first failure."""

    def __init__(self) -> None:
        self.ok, self.failed, self.first_error = 0, 0, ""

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
        for message in messages(count):
            tally.call(client.push, message)

    def threads(tally: Tally, count: int) -> None:
        parts = [Tally() for _ in range(row.concurrency)]  # one per thread: no lock
        with concurrent.futures.ThreadPoolExecutor(row.concurrency) as pool:
            list(pool.map(lambda part: sequential(part, count // row.concurrency), parts))
        for part in parts:
            tally.ok, tally.failed = tally.ok + part.ok, tally.failed + part.failed
            tally.first_error = tally.first_error or part.first_error

    def many(tally: Tally, count: int, batches: int = row.batches) -> None:
        for _ in range(batches):
            for _, outcome in client.push_many(messages(count), concurrency=row.concurrency):
                tally.add(outcome)

    work = {"push": sequential, "threads": threads, "many": many}[row.kind]
    warm_up((lambda tally, count: many(tally, count, 1)) if row.kind == "many" else work,
            row.warm)
    return work, client.close


def setup_async(row: Row, port: int, cafile: str) -> Work:
    """A new asyncio client on a loop of its own: push() from concurrent tasks, or push_many."""
    import asyncio

    import andpush
    loop = asyncio.new_event_loop()
    client = andpush.new_async(access_token="bench-token", project_id=PROJECT,
                               endpoint="https://127.0.0.1:%d" % port,
                               ssl_context=ssl.create_default_context(cafile=cafile))

    async def task(tally: Tally, count: int) -> None:
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
    "threads": setup_andpush, "many": setup_andpush, "pyfcm": setup_pyfcm,
    "fbadmin-send": setup_fbadmin, "fbadmin-each": setup_fbadmin, "async-push": setup_async,
    "async-many": setup_async, "fbadmin-async": setup_fbadmin,
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
    rtt: float = 0.0


@dataclass
class Result:
    row: Row
    cells: Tuple[str, ...] = ("-",) * 7  # server, proto, conns, msg/s, ratio, CPU/1k, srv/relay
    cpu: Optional[float] = None  # seconds per 1,000 messages
    checks: Tuple[Tuple[str, bool], ...] = ()  # (target, met)
    note: str = ""


def cpu_share(pid: int, before: Optional[float], seconds: float) -> Optional[float]:
    after = cpu_seconds(pid)
    return None if before is None or after is None else (after - before) / seconds


def run_row(row: Row, setting: Setting, quick: bool) -> Result:
    """Run a row in a child process and judge it against its targets."""
    result = Result(row)
    if missing_package(row):
        result.note = "not installed (pip install %s)" % missing_package(row)
        return result
    if row.kind == "import":
        return import_row(row, result)
    if row.http2 and setting.server != "nginx":
        result.note = "not measured: needs nginx"
        return result
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
        result.note = "failed: killed after %d s" % CHILD_DEADLINE
        return result
    seconds = time.perf_counter() - started
    shares = cpu_share(setting.server_pid, before[0], seconds), (
        cpu_share(setting.relay_pid, before[1], seconds) if row.relayed else None)
    if child.returncode:
        result.note = "failed: " + (child.stderr.strip().splitlines() or ["?"])[-1][:200]
        return result
    report = json.loads(child.stdout.strip().splitlines()[-1])
    with open(setting.log, "rb") as f:  # the row's pushes: not its floor's, nor tokens
        f.seek(offset)
        lines = [line.split() for line in f.read().decode().splitlines()
                 if line.endswith("/projects/%s/messages:send" % PROJECT)]
    protocols = collections.Counter(line[1] for line in lines)
    conns = len({line[0] for line in lines})
    rate = report["row_ok"] / report["row_seconds"]
    result.cpu = 1000 * report["row_cpu"] / max(report["row_ok"] + report["row_failed"], 1)
    in_flight = min(row.concurrency, H2_STREAMS * conns) if row.http2 else row.concurrency
    base = (in_flight / setting.rtt if row.base == "ideal" else
            report["floor_ok"] / report["floor_seconds"] if row.base == "floor" else None)
    result.cells = (setting.server, "+".join(
        {"HTTP/2.0": "h2"}.get(p, p.lower()) + ("" if len(protocols) == 1 else " %d" % n)
        for p, n in sorted(protocols.items())) or "-", str(conns), "{:,.0f}".format(rate),
        "%.2f %s" % (rate / base, row.base) if base else "-", "%.3f" % result.cpu,
        "/".join("-" if s is None else "%d%%" % (100 * s) for s in shares))
    checks = [("all %s" % ("h2" if row.http2 else "http/1.1"), False)] * (
        set(protocols) != {"HTTP/2.0" if row.http2 else "HTTP/1.1"})
    if base and row.min_ratio is not None:
        checks.append((">=%g %s" % (row.min_ratio, row.base), rate / base >= row.min_ratio))
    if row.max_conns is not None:
        checks.append(("conns<=%d" % row.max_conns, conns <= row.max_conns))
    if row.min_rate is not None:
        checks.append((">={:,.0f}/s".format(row.min_rate), rate >= row.min_rate))
    if row.max_cpu is not None:
        checks.append(("CPU<=%g" % row.max_cpu, result.cpu <= row.max_cpu))
    if base and row.min_relay_headroom is not None and shares[1]:  # the relay's capacity
        checks.append(("relay cap>=%gx ideal" % row.min_relay_headroom,
                       rate / shares[1] / base >= row.min_relay_headroom))
    for side in ("row", "floor"):
        if report.get(side + "_failed"):
            checks.append(("no failures", False))
            result.note = "%d failed, first: %s" % (report[side + "_failed"],
                                                     report[side + "_error"])
    result.checks = tuple(checks)
    return result


def compare_cpu(results: Dict[str, Result]) -> None:
    """Add each row's CPU target that is relative to another row, once both have run."""
    for result in results.values():
        name, factor = result.row.cpu_below
        other = results.get(name)
        if result.cpu is not None and other is not None and other.cpu is not None:
            result.checks += (("CPU<=%s's%s" % (name, "/%g" % factor if factor != 1 else ""),
                               result.cpu <= other.cpu / factor),)


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
    result.cells = ("-",) * 3 + ("%.1f ms" % milliseconds,) + ("-",) * 3
    if row.max_ms is not None:
        result.checks = (("<=%g ms" % row.max_ms, milliseconds <= row.max_ms),)
    return result


COLUMNS = ("row", "server", "proto", "conns", "msg/s", "ratio", "CPU/1k", "srv/relay",
           "target", "met")


def table(results: List[Result]) -> str:
    rows = [COLUMNS] + [(r.row.name + " (50 ms)" * r.row.relayed,) + r.cells + (
        " ".join(text for text, _ in r.checks) or "-",
        ("met" if all(ok for _, ok in r.checks) else "MISSED") if r.checks else "-",
    ) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if 3 <= i <= 7 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    notes = ["%s: %s%s" % (r.row.name, r.row.title, " -- " + r.note if r.note else "")
             for r in results]
    return "\n".join(lines + [""] + notes)


def start_servers(folder: str, certs: Dict[str, str], own: bool) -> Setting:
    """nginx (or the own server), the relay in front of it, and the round trip through it."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    server = "nginx" if nginx and not own else "own"
    if server == "nginx":
        port, pid, log = start_nginx(nginx, folder, certs)
        print("server: nginx (%s, one worker), HTTP/2 and HTTP/1.1 on 127.0.0.1:%d"
              % (nginx, port), flush=True)
    else:
        port, log = free_port(), os.path.join(folder, OWN_LOG)
        pid = start(BENCH + ["--serve", str(port), folder], "the own server", port).pid
        print("NO NGINX%s: bench.py's own HTTP/1.1 server stands in; its figures do not count, "
              "the HTTP/2 rows are not measured (apt-get install nginx-light)"
              % (" (--own-server)" if nginx else " installed"), flush=True)
    relay_port = free_port()
    relay_process = start(BENCH + ["--relay", str(relay_port), str(port)], "the relay", relay_port)
    setting = Setting(server, port, relay_port, pid, relay_process.pid, log, certs)
    probe = RawConnection(relay_port, certs["ca.pem"])
    setting.rtt = statistics.median(timeit.repeat(probe.exchange, repeat=RTT_SAMPLES, number=1))
    probe.sock.close()
    print("relay: %g ms each way; measured round trip %.1f ms (median of %d), the RTT of the "
          "ideals" % (1000 * ONE_WAY_DELAY, 1000 * setting.rtt, RTT_SAMPLES), flush=True)
    return setting


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="andpush benchmark against nginx")
    parser.add_argument("--quick", action="store_true", help="smaller counts: a smoke run")
    parser.add_argument("--rows", help="comma-separated row names (or parts of names)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
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
        print("\n".join("%-15s %s" % (row.name, row.title) for row in ROWS))
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
    print("andpush bench: Python %s, %s, %d CPUs, load %.1f%s; %.0f s; server: %s" % (
        sys.version.split()[0], ssl.OPENSSL_VERSION, os.cpu_count() or 0, os.getloadavg()[0],
        ", --quick" if args.quick else "", time.perf_counter() - started, setting.server + (
            " (bench.py's own: these figures do not count)" * (setting.server == "own"))))
    print(table(list(done.values())))
    return 1 if any(r.note.startswith("failed") for r in done.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
