"""Offline benchmark for andpush: pushes per second against a local TLS fake FCM server.

Run ``python bench.py`` from the repository root (``--quick`` for a few-second run, ``--json``
for machine-readable output, ``--help`` for the rest). It needs no credentials and no network.

What it measures
    A fake FCM server runs in a separate process (this script re-run with a hidden ``--serve``
    flag) on 127.0.0.1 with the test certificates from ``test_andpush.py``. It speaks
    HTTP/1.1 with keep-alive and answers ``POST /fcm/send`` with a small legacy JSON response,
    optionally after a per-answer delay. Each row of the table is one way of sending the same
    push to it, measured in pushes per second:

    * ``andpush push() (keep-alive)``: one andpush client calling ``client.push(payload)``
      over and over; what the library costs for sequential sending.
    * ``http.client, new connection per push``: a new ``http.client.HTTPSConnection`` for each
      push (TCP connect, TLS handshake, request, response, close), the way slow clients work.
    * ``raw socket (floor)``: one kept-alive TLS socket writing pre-built request bytes and
      reading just enough of the answer (header end and Content-Length). No client can be
      much faster against this server, so this is the floor that andpush is compared with.

How it measures
    Each row is set up and warmed up first. Then the rows take turns: every round runs each row
    for one timed sample, so background load on the machine hits all rows alike. A sample
    counts the pushes done in a fixed time; its rate is pushes per second.

How to read the table (in the spirit of Ruby's benchmark-ips)
    ``rate`` is the mean of the samples' rates in iterations (pushes) per second, ``spread``
    the standard deviation of those rates as a percentage of the mean: a large spread means a
    noisy machine, so rerun before trusting small differences. ``comparison`` is how many
    times slower a row is than the fastest one. Below the table, rows with a target print
    their ratio to their baseline; the project target is andpush keep-alive reaching at least
    0.60 of the raw-socket floor.

Adding a row
    Write a ``Runner`` subclass (set up in ``__init__``; ``step()`` sends one or more pushes and
    returns how many; ``close()`` cleans up) and add a ``Row`` to ``ROWS``. A row with
    ``delay_ms`` gets its own fake server that waits that long before each answer.
"""

import argparse
import http.client
import itertools
import json
import os
import platform
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import andpush
from test_andpush import TEST_CA_PEM, TEST_SERVER_CERT_PEM, TEST_SERVER_KEY_PEM

# What is sent ##################################################################################

FCM_PATH = "/fcm/send"
SERVER_KEY = "bench-server-key"
PAYLOAD = {
    "to": "bench-registration-token:" + "APA91bH3x9Qd-7kL2mZ" * 7,
    "notification": {"title": "Benchmark", "body": "andpush offline benchmark push"},
    "data": {"kind": "bench", "id": "12345"},
}

# The fake FCM server ###########################################################################
# Thread per connection, chosen after measuring it against a selectors loop and asyncio
# (protocols and streams) on one kept-alive connection: blocking recv/sendall in a thread costs
# the server the least CPU per request, and time.sleep() in a connection's own thread delays
# that answer precisely without holding up any other connection.

RESPONSE_BODY = (
    b'{"multicast_id":1,"success":1,"failure":0,"canonical_ids":0,'
    b'"results":[{"message_id":"0:1"}]}'
)


def http_response(status: str, body: bytes, keep_alive: bool = True) -> bytes:
    head = "HTTP/1.1 %s\r\nContent-Type: application/json; charset=UTF-8\r\n" % status
    if not keep_alive:
        head += "Connection: close\r\n"
    head += "Content-Length: %d\r\n\r\n" % len(body)
    return head.encode("ascii") + body


OK_RESPONSE = http_response("200 OK", RESPONSE_BODY)
OK_RESPONSE_CLOSE = http_response("200 OK", RESPONSE_BODY, keep_alive=False)
NOT_FOUND_RESPONSE = http_response("404 Not Found", b'{"error":"not found"}')
LENGTH_REQUIRED_RESPONSE = http_response(
    "411 Length Required", b'{"error":"Content-Length required"}', keep_alive=False
)


def answer_request(head: bytes) -> Tuple[bytes, int, bool]:
    """Answer a request from its head (up to the blank line).

    Returns the response bytes, the request body's length and whether to keep the connection.
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
    if not request_line.startswith(b"POST " + FCM_PATH.encode("ascii") + b" "):
        return NOT_FOUND_RESPONSE, length, keep_alive
    return (OK_RESPONSE if keep_alive else OK_RESPONSE_CLOSE), length, keep_alive


def serve_connection(
    conn: socket.socket, context: ssl.SSLContext, delay: float, answered: "itertools.count[int]"
) -> None:
    """Answer the requests on one connection until the client closes it."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock = context.wrap_socket(conn, server_side=True)
    except OSError:
        conn.close()
        return
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
                next(answered)
                if not keep_alive:
                    return


def serve(cert_file: str, key_file: str, delay_ms: float) -> int:
    """Run the fake server (the ``--serve`` child): report the port, serve until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    answered = itertools.count()
    connections = itertools.count()

    def accept_forever() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            next(connections)
            threading.Thread(
                target=serve_connection, args=(conn, context, delay_ms / 1000.0, answered),
                daemon=True,
            ).start()

    def cpu_seconds() -> float:
        times = os.times()
        return times.user + times.system

    threading.Thread(target=accept_forever, daemon=True).start()
    cpu_at_start = cpu_seconds()
    print("READY %d" % listener.getsockname()[1], flush=True)
    sys.stdin.buffer.read()  # until the parent closes the pipe (or dies)
    listener.close()
    print("STATS %d %d %.3f" % (next(answered), next(connections), cpu_seconds() - cpu_at_start),
          flush=True)
    return 0


@dataclass
class ServerStats:
    requests: int = 0
    connections: int = 0
    cpu_seconds: float = 0.0


class FakeServer:
    """The parent's handle on one fake server process."""

    def __init__(self, cert_file: str, key_file: str, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve",
             "--cert", cert_file, "--key", key_file, "--server-delay-ms", str(delay_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode("ascii", "replace").split()
        if len(line) != 2 or line[0] != "READY":
            self.process.kill()
            raise RuntimeError("fake FCM server did not start (said %r)" % " ".join(line))
        self.port = int(line[1])

    def stop(self) -> ServerStats:
        """Close the server's stdin so that it exits, and collect what it reports."""
        stats = ServerStats()
        try:
            out, _ = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return stats
        fields = out.decode("ascii", "replace").split()
        if len(fields) == 4 and fields[0] == "STATS":
            stats = ServerStats(int(fields[1]), int(fields[2]), float(fields[3]))
        return stats


class Servers:
    """Fake servers started on demand, one per answer delay, all in separate processes."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.running: Dict[float, FakeServer] = {}

    def target(self, delay_ms: float) -> "Target":
        if delay_ms not in self.running:
            self.running[delay_ms] = FakeServer(self.cert_file, self.key_file, delay_ms)
        return Target("127.0.0.1", self.running[delay_ms].port, client_ssl_context())

    def stop_all(self) -> Dict[float, ServerStats]:
        stats = {delay: server.stop() for delay, server in self.running.items()}
        self.running.clear()
        return stats


# Clients: one Runner per row ###################################################################


def client_ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context(cadata=TEST_CA_PEM)


@dataclass
class Target:
    """Where a row sends its pushes."""

    host: str
    port: int
    ssl_context: ssl.SSLContext

    @property
    def endpoint(self) -> str:
        return "https://%s:%d" % (self.host, self.port)


class Runner:
    """One row's client. ``step()`` sends one or more pushes and returns how many it sent."""

    def step(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


def check_status(status: int, row: str) -> None:
    if status != 200:
        raise RuntimeError("%s: fake server answered HTTP %d" % (row, status))


class AndpushRunner(Runner):
    """``client.push(payload)`` in a loop on one andpush client (one kept-alive connection)."""

    def __init__(self, target: Target) -> None:
        self.client = andpush.new(SERVER_KEY, endpoint=target.endpoint,
                                  ssl_context=target.ssl_context)
        response = self.client.push(PAYLOAD)
        check_status(response.status_code, "andpush")
        if response.json.get("success") != 1:
            raise RuntimeError("andpush: unexpected response JSON %r" % (response.json,))

    def step(self) -> int:
        if self.client.push(PAYLOAD).status_code != 200:
            raise RuntimeError("andpush: fake server did not answer HTTP 200")
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


# The rows ######################################################################################


@dataclass
class Row:
    """One line of the table: a way of sending pushes, and what it is compared with."""

    name: str
    make: Callable[[Target], Runner]
    delay_ms: float = 0.0  # the fake server waits this long before each answer
    baseline: Optional[str] = None  # name of the row this one is compared with ...
    target: Optional[float] = None  # ... and the least rate / baseline rate it should reach


RAW_FLOOR = "raw socket (floor)"

ROWS: List[Row] = [
    Row("andpush push() (keep-alive)", AndpushRunner, baseline=RAW_FLOOR, target=0.60),
    Row("http.client, new connection per push", NewConnectionRunner),
    Row(RAW_FLOOR, RawSocketRunner),
]


# Measuring #####################################################################################


@dataclass
class Result:
    row: Row
    samples: List[float] = field(default_factory=list)  # pushes per second, one per sample
    pushes: int = 0
    status: str = "ok"  # or "error" (with a note saying what failed)
    note: str = ""

    @property
    def rate(self) -> float:
        return statistics.mean(self.samples) if self.samples else 0.0

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


def measure(rows: Sequence[Row], servers: Servers, warmup: float, samples: int,
            duration: float) -> List[Result]:
    """Set up and warm up every row, then take the samples in rounds, one row after another."""
    results = [Result(row) for row in rows]
    runners: Dict[int, Runner] = {}
    try:
        for index, result in enumerate(results):
            progress("warming up: %s" % result.row.name)
            try:
                runner = result.row.make(servers.target(result.row.delay_ms))
            except Exception as exc:  # a broken row must not hide the others' numbers
                result.status, result.note = "error", "set-up failed: %r" % exc
                continue
            runners[index] = runner
            try:
                run_for(runner, warmup)
            except Exception as exc:
                result.status, result.note = "error", "warm-up failed: %r" % exc
                runners.pop(index).close()
        for number in range(1, samples + 1):
            progress("sample %d of %d" % (number, samples))
            for index, runner in list(runners.items()):
                result = results[index]
                try:
                    count, elapsed = run_for(runner, duration)
                except Exception as exc:
                    result.status, result.note = "error", "sample failed: %r" % exc
                    runners.pop(index).close()
                    continue
                result.pushes += count
                result.samples.append(count / elapsed)
    finally:
        for runner in runners.values():
            runner.close()
    return results


# Reporting #####################################################################################


def ranked(results: Sequence[Result]) -> List[Result]:
    """Rows that ran, fastest first, then the rest in their order."""
    ran = sorted((r for r in results if r.status == "ok"), key=lambda r: -r.rate)
    return ran + [r for r in results if r.status != "ok"]


def fastest_rate(results: Sequence[Result]) -> float:
    return max((r.rate for r in results if r.status == "ok"), default=0.0)


@dataclass
class Comparison:
    """A row's rate relative to its baseline row's, and whether it reaches its target."""

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


def comparisons(results: Sequence[Result]) -> List[Comparison]:
    """One Comparison for each row that names a baseline."""
    by_name = {r.row.name: r for r in results}
    found = []
    for result in results:
        row = result.row
        if row.baseline is None:
            continue
        base = by_name.get(row.baseline)
        ratio = None
        if result.status == "ok" and base is not None and base.status == "ok" and base.rate:
            ratio = result.rate / base.rate
        found.append(Comparison(row.name, row.baseline, ratio, row.target))
    return found


def format_table(results: Sequence[Result]) -> str:
    fastest = fastest_rate(results)
    width = max([len("row")] + [len(r.row.name) for r in results])
    lines = ["%-*s  %14s  %8s  %s" % (width, "row", "rate (i/s)", "spread", "comparison")]
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
        lines.append("%-*s  %14s  %8s  %s" % (width, name, "{:,.1f}".format(result.rate),
                                              "± %.1f%%" % result.spread, comparison))
    found = comparisons(results)
    if found:
        lines.append("")
        lines.extend(comparison.describe() for comparison in found)
    return "\n".join(lines)


def json_results(results: Sequence[Result]) -> List[Dict[str, object]]:
    fastest = fastest_rate(results)
    compared = {c.row: c for c in comparisons(results)}
    out = []
    for result in results:
        item: Dict[str, object] = {
            "row": result.row.name,
            "status": result.status,
            "rate": result.rate,
            "spread": result.spread,
            "slower": fastest / result.rate if result.rate else None,
            "samples": result.samples,
            "pushes": result.pushes,
            "server_delay_ms": result.row.delay_ms,
        }
        if result.note:
            item["note"] = result.note
        found = compared.get(result.row.name)
        if found is not None:
            item.update(baseline=found.baseline, ratio=found.ratio, target=found.target,
                        target_met=found.met)
        out.append(item)
    return out


def describe_servers(stats: Dict[float, ServerStats], seconds: float) -> str:
    lines = []
    for delay, s in sorted(stats.items()):
        per_request = 1e6 * s.cpu_seconds / s.requests if s.requests else 0.0
        lines.append(
            "fake server (thread per connection, answer delay %g ms): %d requests on %d "
            "connections in %.1f s, %.1f s CPU (%.0f us/request incl. handshakes)"
            % (delay, s.requests, s.connections, seconds, s.cpu_seconds, per_request)
        )
    return "\n".join(lines)


# Command line ##################################################################################


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Offline benchmark: pushes per second of andpush and reference clients "
        "against a local TLS fake FCM server (see the module docstring for how to read it)."
    )
    parser.add_argument("--quick", action="store_true",
                        help="a few-second run: shorter warm-up, 3 short samples")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (a list of rows) instead of a table")
    parser.add_argument("--samples", type=int, help="timed samples per row (default 5)")
    parser.add_argument("--duration", type=float, help="seconds per sample (default 1.0)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per row (default 0.5)")
    parser.add_argument("--row", action="append", metavar="TEXT",
                        help="run only rows whose name contains TEXT (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    # The fake server's own process: this script started again by FakeServer.
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--server-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
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
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.cert, args.key, args.server_delay_ms)
    rows = [row for row in ROWS if not args.row or any(t in row.name for t in args.row)]
    if args.list or not rows:
        for row in ROWS:
            print(row.name)
        return 0 if args.list else 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="andpush-bench-") as folder:
        cert_file = os.path.join(folder, "server.pem")
        key_file = os.path.join(folder, "server.key")
        with open(cert_file, "w") as f:
            f.write(TEST_SERVER_CERT_PEM)
        with open(key_file, "w") as f:
            f.write(TEST_SERVER_KEY_PEM)
        servers = Servers(cert_file, key_file)
        try:
            results = measure(rows, servers, args.warmup, args.samples, args.duration)
        except KeyboardInterrupt:
            progress("interrupted")
            return 130
        finally:
            server_stats = servers.stop_all()
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps(json_results(results), indent=2))
    else:
        print("andpush benchmark: %d samples x %g s per row, rows interleaved, after %g s "
              "warm-up" % (args.samples, args.duration, args.warmup))
        print("andpush %s on %s %s, %s, %s CPUs" % (
            getattr(andpush, "__version__", "?"), platform.python_implementation(),
            platform.python_version(), ssl.OPENSSL_VERSION, os.cpu_count()))
        print()
        print(format_table(results))
        print()
        print(describe_servers(server_stats, elapsed))
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
