"""Tests for andpush: a specification of the library, run against a local TLS fake FCM server.

Run with ``python -m unittest`` from the repository root; nothing needs to be installed
and nothing touches the internet. Socket-free tests of the pure parts come first, then
the ones that talk to the fake server, each asserting both what the client saw and what
the server processed.
"""

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import copy
import datetime
import email.utils
import functools
import gc
import hashlib
import heapq
import inspect
import io
import json
import logging
import math
import multiprocessing
import os
import pathlib
import pickle
import pydoc
import queue
import random
import re
import selectors
import shlex
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import types
import unittest
import unittest.mock
import warnings
import urllib.parse
from collections import deque
from typing import (
    Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union,
)

import andpush
from andpush import (
    _HPACK_CACHE_ENTRIES, _HPACK_CACHE_MAX_BLOCK, _HPACK_STATIC_TABLE, _HUFFMAN_CODE,
    _b64url, _der_read, _HPACKDecoder, _HPACKError, _hpack_decode_int, _hpack_encode,
    _hpack_encode_int, _huffman_decode, _jwt, _parse_private_key, _rs256_sign, _RSAPrivateKey,
)

# The 429 tests make andpush log a warning; without a handler Python would print it.
logging.getLogger("andpush").addHandler(logging.NullHandler())

# Test RSA keys ##############################################################################
# One 1024-bit RSA key made once with
#   openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:1024        (PKCS#8)
#   openssl rsa -in key.pem -traditional                                (PKCS#1)
# (the smallest andpush takes: it signs in 1 ms where Google's 2048 bits take 6, and the
# suite signs a hundred JWTs; the key format and signing tests check the fake's 2048-bit
# account key, andpush._FAKE_ACCOUNT_KEY_PEM, as well)
# plus a P-256 and an Ed25519 key (openssl genpkey) to check non-RSA keys are refused, and
# another RSA key whose signatures the fake token endpoint must refuse.

TEST_RSA_KEY_PKCS8_PEM = """\
-----BEGIN PRIVATE KEY-----
MIICdwIBADANBgkqhkiG9w0BAQEFAASCAmEwggJdAgEAAoGBAOHk8mo+tAk7uHsN
dmHTaG3gtMDPOkviJQ6/9xeq0a+jjBHlTfnpnRdDmLwWTP0Qm2m4goT4RCng2Bx0
/ivHJARWz4tD8oeN2Jr6qsMLwSpQVItA15sA2DHc38lUx06YhdYeP9bptTzOXRhF
A44gDFwJYOziOubcThF2cMRTaU2XAgMBAAECgYEA02aDRtKvggSVvPL4WsyR6mJk
RhypHeLhc1BLWabO3WRc7VJ/CuaJ0P+9rCfinOIxz1qRKwd8IwT8uoTyaN3Q4UyA
TerTao70AMt+nPSet/fMtIR3CqH4PQsW5dICEUCTotZeXo+ZsldS3W2MVPlfAZYa
NMeBL833SVGFv/aE1OECQQD00+2W5+TTlYTZmZ8A9q4I3KRPgiT895ysIWDijADc
K13fE65CcIGdfvFAIsW29YVUkQboD2oX1XKSeBPOg0PzAkEA7DPWh42tSUk/kh4+
yti5hr5TGDh/RvdxmOkURx99vhHC0cq3i96G3H9uyyLJ0pMg0LZGTlwTXnqgjoZu
uBGMzQJBANR820iOG1xH+PWjDw2XC5VFapZXLiMgBSqgDaaSPGzadq6WNjgTzWsU
Me6oP1F75ixvcr8WIc5twvK8pPQnmWECQHDD7s+YW/p49diUh/XfsfMaOiF+F4WR
7LHL1Np/tlBfulreJPKpskjircpdOW1GwIvj+Xy/iJ+6e5yPoZxPBKECQHIx3wB9
7T/fOHHpMyflRf7sflUHcWZbn+zF6i1JxNktPyiQRi6z06h2mOrz2q6rSquH/Yo8
8DM4FLlgh/N5/GQ=
-----END PRIVATE KEY-----
"""

TEST_RSA_KEY_PKCS1_PEM = """\
-----BEGIN RSA PRIVATE KEY-----
MIICXQIBAAKBgQDh5PJqPrQJO7h7DXZh02ht4LTAzzpL4iUOv/cXqtGvo4wR5U35
6Z0XQ5i8Fkz9EJtpuIKE+EQp4NgcdP4rxyQEVs+LQ/KHjdia+qrDC8EqUFSLQNeb
ANgx3N/JVMdOmIXWHj/W6bU8zl0YRQOOIAxcCWDs4jrm3E4RdnDEU2lNlwIDAQAB
AoGBANNmg0bSr4IElbzy+FrMkepiZEYcqR3i4XNQS1mmzt1kXO1SfwrmidD/vawn
4pziMc9akSsHfCME/LqE8mjd0OFMgE3q02qO9ADLfpz0nrf3zLSEdwqh+D0LFuXS
AhFAk6LWXl6PmbJXUt1tjFT5XwGWGjTHgS/N90lRhb/2hNThAkEA9NPtlufk05WE
2ZmfAPauCNykT4Ik/PecrCFg4owA3Ctd3xOuQnCBnX7xQCLFtvWFVJEG6A9qF9Vy
kngTzoND8wJBAOwz1oeNrUlJP5IePsrYuYa+Uxg4f0b3cZjpFEcffb4RwtHKt4ve
htx/bssiydKTINC2Rk5cE156oI6GbrgRjM0CQQDUfNtIjhtcR/j1ow8NlwuVRWqW
Vy4jIAUqoA2mkjxs2nauljY4E81rFDHuqD9Re+Ysb3K/FiHObcLyvKT0J5lhAkBw
w+7PmFv6ePXYlIf137HzGjohfheFkeyxy9Taf7ZQX7pa3iTyqbJI4q3KXTltRsCL
4/l8v4ifunucj6GcTwShAkByMd8Afe0/3zhx6TMn5UX+7H5VB3FmW5/sxeotScTZ
LT8okEYus9Oodpjq89quq0qrh/2KPPAzOBS5YIfzefxk
-----END RSA PRIVATE KEY-----
"""

TEST_EC_KEY_PKCS8_PEM = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgazGx9Bp7NaKnDyRw
6dFH2E5+sLjvlZXyHw4y+PgylnShRANCAATISJGbTgZGlgdJqMTvXsI33KuUm67X
lC7pTYt5pLkIZd19dKaPc78eTTCSnp6369NNIdT8wwDpbVGWnBwZ6bqz
-----END PRIVATE KEY-----
"""

TEST_ED25519_KEY_PKCS8_PEM = """\
-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIAXOCo/SH1cecbWjgZ020dCO0jMQpV38jXN2NpgdCgAR
-----END PRIVATE KEY-----
"""

TEST_OTHER_RSA_KEY_PEM = """\
-----BEGIN PRIVATE KEY-----
MIICdgIBADANBgkqhkiG9w0BAQEFAASCAmAwggJcAgEAAoGBALpQqUkp8yFJJfdf
9zG4+/TvKwE+IABIBE2Y6wEZ+PaXjRktixZN6neamtYAdYdO0WE/54DRkMXCL4Wu
uPmBALJGYHRgfpaz+DR0/dquoWZAiGfRxyCgYjDL8Om2EpHQcWi+8LDSkyfuwWtI
8YZumMn+LFH99zuQFXKWoS3BsNTpAgMBAAECgYBPzZLlArHgFPvNHG69/nT1Magi
7SA53p7xOcmW/C/2N225VheYIyGFv1QIy8OLhEgMtpmLRLgU7Jr8UJ1sSUQpXGnM
ZTZRcw0NaZe8BVg8BSngu4GFDQkY93MQoYqLQrrry6rbWrxTDkqPQLr5DfYydP7y
fRx+OR1VE4Q7Qf85HQJBAOyKdhSVEVEIdIcnXPOpS/pfxJVWNvmK6VWRIMwtKAUN
eJDkjyDaKB8uh3FAfQ8Mcu05YUPktwAKciJtMCEOZtsCQQDJpHKVBxcdzeuf+zqb
v/6lkf+06RG4AL8eDvJgJBhQ+XzmrfYIXO/92c8oBnQ4ehse1auy9YhCfin8jvr4
t7SLAkEAigAh8dIiPy96pJtPfIyp2hHjY+jfu+jSRuybwOMbdQ8t5wKhil4ciEyi
Em24SH5P0pzmZTDbnzd47SLcsHxxfwJALdDyxA/fXcNLNYeU8oy2ZJJ+4nFOuFtb
EY5d3iB1cfiuO4/tZksPsMNLwZFt2ONNxDzSjZAijNEz4xHtzpOXLwJAM+zdSPVI
Gt3vDwx9fui9DmVotED/LahlLc3uYUq1vLZtQNrJW8xAJ3ug/TNS16coIv7bpy9i
e6/RmZX70R6tMg==
-----END PRIVATE KEY-----
"""


# The fake FCM, as andpush's tests use it ######################################################
# andpush.FakeFCM, the fake FCM andpush ships, is the server of these tests: real sockets, TLS
# and HTTP on 127.0.0.1, so that the tests run andpush's own. FakeFCM below adds what only
# andpush's tests need: every request recorded whole, answers scripted request by request,
# and the misbehaviours of real servers and networks, each a named constant:
#
#     with FakeFCM() as server:
#         server.inject(Reply(503, json={}, headers={"Retry-After": "1"}), RESET_AFTER_READ)
#         ...  # a client on server.endpoint, its TLS context from client_context()
#         self.assertEqual(server.processed, 2)
#         self.assertEqual(server.errors, [])
#
# Injected actions (a Reply or a misbehaviour) are taken one per request, in arrival order
# across all connections, when a request's first bytes arrive (over HTTP/2: its HEADERS); then
# by_token's, once the request is read; else the shipped fake answers. A connection that
# closes while idle takes none. The knobs are read as each connection or request reaches
# them: set them before the traffic.

# Misbehaviours for FakeFCM.inject(), each for one request. All but RESET_BEFORE_READ record
# the request in FakeFCM.requests before misbehaving.
#: Once the request's first bytes arrive, reset the connection (TCP RST) without reading it.
RESET_BEFORE_READ = "RESET_BEFORE_READ"
#: Read the whole request, then reset the connection (TCP RST) without answering.
RESET_AFTER_READ = "RESET_AFTER_READ"
#: Wait FakeFCM.slow_seconds, then answer normally.
SLOW = "SLOW"
#: Answer normally with "Connection: close", then close (TLS close_notify, then FIN).
CONNECTION_CLOSE = "CONNECTION_CLOSE"
#: Answer normally but chunked, with a chunk extension and a trailer.
CHUNKED = "CHUNKED"
#: Send the status line "HTTP/1.1 OK-ish" and nothing else, then close.
MALFORMED_STATUS = "MALFORMED_STATUS"
#: Answer normally but send only half the body that Content-Length promises, then close
#: (over HTTP/2: half the body content-length promises, then END_STREAM).
TRUNCATED_BODY = "TRUNCATED_BODY"
#: 200 with the text/html body <html>oops</html>.
NON_JSON = "NON_JSON"
#: 200 with a body of HUGE_BODY_SIZE bytes (valid JSON).
HUGE_BODY = "HUGE_BODY"
MISBEHAVIOURS = (RESET_BEFORE_READ, RESET_AFTER_READ, SLOW, CONNECTION_CLOSE, CHUNKED,
                 MALFORMED_STATUS, TRUNCATED_BODY, NON_JSON, HUGE_BODY)
# HTTP/2's own, for FakeFCM2.inject(). A stream takes its action when its HEADERS arrive; a
# stream that took one but is never recorded (above a GOAWAY's last stream id, reset by the
# client, cut off by the connection's end) gives it back to the front of the queue, except
# REFUSE_STREAM, GOAWAY_BEFORE_READ and RESET_BEFORE_READ, which are used up.
#: Answer RST_STREAM(REFUSED_STREAM) to the HEADERS; not recorded.
REFUSE_STREAM = "REFUSE_STREAM"
#: Read the whole request (recorded), then RST_STREAM(INTERNAL_ERROR) instead of an answer.
RESET_STREAM_AFTER_READ = "RESET_STREAM_AFTER_READ"
#: Read the request (recorded), send GOAWAY(NO_ERROR, last stream id: this one), answer it
#: and every stream up to it, ignore those above it (not recorded), then close.
GOAWAY_AFTER_READ = "GOAWAY_AFTER_READ"
#: When the HEADERS arrive, send GOAWAY(NO_ERROR, last stream id: the stream opened before
#: this one): this stream and those above it are ignored (not recorded), the ones below are
#: answered, then close. From by_token, which acts once the request is read, the request is
#: dropped unrecorded all the same.
GOAWAY_BEFORE_READ = "GOAWAY_BEFORE_READ"
#: Read the request (recorded), answer it, and send the graceful-shutdown notice
#: GOAWAY(NO_ERROR, 2^31-1) and a PING; FakeFCM.shutdown_grace seconds later the real
#: GOAWAY(NO_ERROR, the highest stream opened), then the streams up to it are answered and
#: the connection closed, as h2o and apache do on a reload.
SHUTDOWN_NOTICE_AFTER_READ = "SHUTDOWN_NOTICE_AFTER_READ"
#: Read the request (recorded), then close the connection with streams in flight: what was
#: already queued is sent, then FIN without GOAWAY or close_notify.
DROP_CONNECTION_AFTER_READ = "DROP_CONNECTION_AFTER_READ"
H2_MISBEHAVIOURS = (REFUSE_STREAM, RESET_STREAM_AFTER_READ, GOAWAY_AFTER_READ,
                    GOAWAY_BEFORE_READ, SHUTDOWN_NOTICE_AFTER_READ, DROP_CONNECTION_AFTER_READ)
#: What FakeFCM2.inject() takes besides a Reply: HTTP/1.1's misbehaviours that mean something
#: in HTTP/2 (the two resets reset the whole TCP connection) and HTTP/2's own.
H2_ACTIONS = H2_MISBEHAVIOURS + (
    RESET_BEFORE_READ, RESET_AFTER_READ, SLOW, TRUNCATED_BODY, NON_JSON, HUGE_BODY)
#: Bytes in the body of a HUGE_BODY answer (5 MiB).
HUGE_BODY_SIZE = 5 * 1024 * 1024
#: Content-Type of JSON answers, with the charset parameter as Google's front ends send it.
JSON_CONTENT_TYPE = andpush._JSON_TYPE

TEST_PROJECT = "test-project"
TEST_CLIENT_EMAIL = "pusher@test-project.iam.gserviceaccount.com"
TEST_KEY_ID = "test-key-id-0123"
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
_GOAWAY_PING = b"goaway!!"  # the PING after each GOAWAY: its ACK says the client saw it
_SERVER_PING = b"fakefcm2"  # the PINGs of ping_before_answers
_SPLIT_SIZES = (1, 2, 3, 5, 8, 13, 21)  # bytes per TLS record with split_tls_records
_HOLD_POLL = 0.005  # seconds between two looks at whether a held answer may go
_METADATA_TOKEN = "/computeMetadata/v1/instance/service-accounts/default/token"
_METADATA_PROJECT = "/computeMetadata/v1/project/project-id"


def client_context() -> ssl.SSLContext:
    """A client context that trusts the fake's certificate (and only it)."""
    return ssl.create_default_context(cadata=andpush._FAKE_CA_PEM)


def h2_client_context() -> ssl.SSLContext:
    """client_context() offering h2 first, then http/1.1, by ALPN."""
    context = client_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


class Request:
    """One request as the fake server read it."""

    def __init__(self, request: andpush._FakeRequest) -> None:
        self.method = request.method
        self.path = request.path  # the request target as sent, query string included
        self.headers = request.headers  # lower-case names; repeated headers joined with ", "
        self.body = request.body
        self.version = request.protocol  # "HTTP/1.1" or "HTTP/2"
        self.connection = request.connection  # which TCP connection (1, 2, ...) it came on
        self.stream_id = request.stream

    @property
    def json(self) -> Any:
        """The body parsed as JSON (ValueError if it is not JSON)."""
        return json.loads(self.body.decode("utf-8"))

    def __repr__(self) -> str:
        return "Request(%r, %r, connection=%d, %d body bytes)" % (
            self.method, self.path, self.connection, len(self.body))


class Reply:
    """A scripted answer: json= is sent serialised as application/json, body= as raw bytes."""

    def __init__(self, status: int = 200, json: Any = None, body: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        if json is not None and body is not None:
            raise ValueError("Reply takes json= or body=, not both")
        self.status = status
        self.json = json
        self.headers = dict(headers or {})  # sent as given, but for the framing ones
        if json is not None:
            self.body = _json_bytes(json)
            if not any(name.lower() == "content-type" for name in self.headers):
                self.headers["Content-Type"] = JSON_CONTENT_TYPE
        else:
            self.body = body or b""

    @property
    def closes(self) -> bool:
        """Whether the scripted headers ask for the connection to be closed after it."""
        return any(name.lower() == "connection" and value.strip().lower() == "close"
                   for name, value in self.headers.items())

    def answer(self) -> andpush._FakeAnswer:
        """The reply as the fake sends it."""
        headers = tuple((name.lower(), value) for name, value in self.headers.items()
                        if name.lower() not in ("content-length", "transfer-encoding",
                                                "connection"))
        return andpush._FakeAnswer(self.status, headers, self.body)

    def __repr__(self) -> str:
        return "Reply(%d, %r)" % (self.status, self.body[:80])


Action = Union[Reply, str]


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8")


def fcm_error(status: int, error_code: Optional[str], message: str = "", **headers: str) -> Reply:
    """A v1 error answer as FCM sends it; error_code None leaves out the FcmError detail."""
    states = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
              404: "NOT_FOUND", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
              500: "INTERNAL", 503: "UNAVAILABLE"}
    error: Dict[str, Any] = {"code": status, "message": message or "error %d" % status,
                             "status": states.get(status, "UNKNOWN")}
    if error_code:
        error["details"] = [{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                             "errorCode": error_code}]
    return Reply(status, json={"error": error}, headers=dict(
        (name.replace("_", "-"), value) for name, value in headers.items()))


def service_account_info(server: "FakeFCM", key_pem: str = "") -> Dict[str, Any]:
    """A service account key file's contents, pointing at the fake token endpoint."""
    return {
        "type": "service_account",
        "project_id": TEST_PROJECT,
        "private_key_id": TEST_KEY_ID,
        "private_key": key_pem or TEST_RSA_KEY_PKCS8_PEM,
        "client_email": TEST_CLIENT_EMAIL,
        "client_id": "1234567890",
        "token_uri": server.endpoint + "/token",
    }


def _render_head(answer: andpush._FakeAnswer, framing: List[str]) -> bytes:
    lines = ["HTTP/1.1 %d %s" % (answer.status, andpush._phrase(answer.status))]
    lines.extend("%s: %s" % field for field in answer.headers)
    lines.extend(framing)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunked(body: bytes) -> bytes:
    """body in four chunks (upper-case hex sizes, an extension on the first), then a trailer."""
    step = max(1, -(-len(body) // 4))
    out = []
    for index, start in enumerate(range(0, len(body), step)):
        piece = body[start:start + step]
        extension = b';fakefcm="nasty; but legal"' if index == 0 else b""
        out.append(b"%X%s\r\n%s\r\n" % (len(piece), extension, piece))
    out.append(b"0\r\nX-Fake-Trailer: yes\r\n\r\n")
    return b"".join(out)


def _huge_json_body() -> bytes:
    head, tail = b'{"padding": "', b'"}'
    return head + b"x" * (HUGE_BODY_SIZE - len(head) - len(tail)) + tail


class _Cut(Exception):
    """End the connection now: how ("reset", "drop") is the argument."""


class FakeFCM(andpush.FakeFCM):
    """andpush.FakeFCM for andpush's tests (see above). Use: with FakeFCM() as server: ...

    By default its TLS offers no ALPN, so that clients speak HTTP/1.1; FakeFCM2 offers h2.
    With tls=False its endpoint is http://, as the GCE metadata server's. It takes the test
    key's JWTs and SERVER_KEY, and sends to any project. All counters and lists may be read
    by tests at any time.
    """

    actions: Tuple[str, ...] = MISBEHAVIOURS  # what inject() takes besides a Reply

    def __init__(self, tls: bool = True, alpn: Tuple[str, ...] = (),
                 max_concurrent_streams: int = 100) -> None:
        super().__init__(TEST_PROJECT)
        self._alpn = tuple(alpn)
        self._account_key = andpush._parse_private_key(TEST_RSA_KEY_PKCS8_PEM)
        self._client_email = TEST_CLIENT_EMAIL
        self.server_key = SERVER_KEY
        self.tls = tls
        self.max_concurrent_streams = max_concurrent_streams
        # What tests set.
        self.slow_seconds = 1.0  # how long SLOW holds its answer
        self.reply_delay = 0.0  # seconds before every answer
        self.close_every: Optional[int] = None  # HTTP/1.1 answers before an abrupt close
        self.unregistered_tokens = self._unregistered
        self.canonical_tokens: Dict[str, str] = {}
        # Actions for the requests of one device token (legacy "to", v1 message.token), taken
        # in turn once such a request has been read; injected actions come first.
        self.by_token: Dict[str, List[Action]] = {}
        # Answers by (method, path prefix), before the fake's own; the longest prefix wins.
        self.routes: Dict[Tuple[str, str], Callable[[Request], Reply]] = {}
        self.token_lifetime = 3600  # expires_in of the access tokens it issues
        self.valid_tokens: Set[str] = set()  # the access tokens sends may carry
        self.refresh_token = "test-refresh-token"  # an authorized user's
        # HTTP/2's knob, read as each connection starts. n: once n streams are recorded on a
        # connection, GOAWAY as GOAWAY_AFTER_READ does.
        self.goaway_after: Optional[int] = None
        # False: complete TLS with ALPN h2, then send nothing at all, not even SETTINGS.
        self.send_settings = True
        # Answers with a 4096-byte dynamic table, whatever the client's HEADER_TABLE_SIZE, and
        # headers like Google's plus x-fake: <answer number>, so entries are indexed, reused
        # and evicted (see _H2HeaderEncoder), as h2o does.
        self.use_dynamic_table = False
        # SETTINGS_INITIAL_WINDOW_SIZE stall_window_size and no WINDOW_UPDATE at all (the
        # connection's 65535 bytes are used up for good too) until release_window(). DATA
        # beyond a window is a FLOW_CONTROL_ERROR and counts in flow_control_violations.
        self.stall_window = False
        self.stall_window_size = 16
        # n: after n PINGs from the client with no new stream between, GOAWAY
        # (ENHANCE_YOUR_CALM, "too_many_pings") and close, as Google's front end does.
        self.too_many_pings: Optional[int] = None
        self.shutdown_grace = 0.1  # seconds between the notice and the real GOAWAY
        self.ping_before_answers = False  # a PING before every answer, for the client to ACK
        self.continuation = False  # header blocks in CONTINUATION frames of this many bytes:
        self.continuation_fragment = 10
        self.split_tls_records = False  # everything in TLS records of 1, 2, 3, 5, 8, ... bytes
        self.record_per_frame = False  # every frame in a TLS record of its own (caddy)
        # What tests read (besides connections, processed, errors below).
        self.handshakes = 0  # TLS handshakes completed
        self.requests: List[Request] = []  # processed requests, in processing order
        self.issued: List[str] = []  # access tokens issued, in order
        self.jwt_claims: List[Dict[str, Any]] = []
        self.protocols: List[Optional[str]] = []  # the ALPN result of each handshake
        self.settings_received: List[Dict[int, int]] = []  # the client's SETTINGS frames
        self.frames_received: Dict[str, int] = collections.Counter()
        self.streams_refused = 0  # RST_STREAM(REFUSED_STREAM) sent, for any reason
        self.flow_control_violations = 0
        self.stalled_streams = 0  # streams that ran out of window (stall_window), ever
        self.stalled_connections = 0  # connections whose own window ran out (stall_window)
        self.max_open_streams_seen = 0  # most streams open at once on one connection
        self.streams_reset_by_client = 0
        self.streams_after_goaway = 0  # streams opened once the client had seen a GOAWAY
        self.goaways_sent = 0
        self.goaways_received = 0
        self.pings_received = 0
        self.pings_acked = 0  # ACKs of this server's PINGs
        self.protocol_errors: List[str] = []  # what clients sent that broke HTTP/2
        # Internals.
        self._injected: Deque[Action] = deque()
        self._taken: Dict[Tuple[int, int], Action] = {}  # by (connection, stream)
        self._answered: Dict[int, int] = collections.Counter()  # answers by connection
        self._holds: List[Tuple[Callable[[Request], bool], threading.Event]] = []
        self._answer_numbers = 0
        self._h2: Set["_TestH2"] = set()

    @property
    def endpoint(self) -> str:
        return super().endpoint if self.tls else "http://127.0.0.1:%d" % self.port

    @property
    def connections(self) -> int:
        """TCP connections accepted."""
        return self.counts["connections"]

    @property
    def processed(self) -> int:
        """How many requests the server has read whole (len(self.requests))."""
        return len(self.requests)

    @property
    def errors(self) -> List[str]:
        """Tracebacks of the fake's own failures: should stay empty."""
        return self._errors

    @property
    def pending(self) -> int:
        """How many injected actions are still waiting for a request."""
        return len(self._injected)

    @property
    def open_connections(self) -> int:
        """Connections open: one the server closed no longer counts once its FIN is sent."""
        return sum(1 for link in list(self._links) if not link.lingering)

    @property
    def subscriptions(self) -> Set[Tuple[str, str]]:
        """The (token, topic) memberships."""
        with self._lock:
            return {(token, topic) for topic, tokens in self._topics.items() for token in tokens}

    def subscribe(self, *pairs: Tuple[str, str]) -> None:
        """Add (token, topic) memberships, as if subscribed earlier."""
        with self._lock:
            for token, topic in pairs:
                self._topics.setdefault(topic, set()).add(token)

    def inject(self, *actions: Action) -> None:
        """Queue answers for the next requests, across all connections, in arrival order."""
        for action in actions:
            if not isinstance(action, Reply) and action not in self.actions:
                raise ValueError("not a Reply nor one of %s: %r" % (self.actions, action))
        with self._lock:
            self._injected.extend(actions)

    def revoke_tokens(self) -> None:
        """Make every token issued so far invalid, as if revoked early."""
        self.valid_tokens.clear()

    def hold(self, picks: Callable[[Request], bool]) -> threading.Event:
        """Answer the requests ``picks`` chooses (read and recorded as usual) only once the
        returned event is set; the others go on meanwhile."""
        released = threading.Event()
        self._holds.append((picks, released))
        return released

    def release_window(self) -> None:
        """End stall_window: every connection gives the client its windows back, for good."""
        self.stall_window = False
        self._call_soon(self._release_windows)

    def release_window_once(self, stalled: Callable[[], bool]) -> None:
        """release_window() as soon as ``stalled()`` says the client used a window up (at
        the wait limit if it never does), from a thread of its own: when the client got
        there, not after a fixed time, which a busy machine may not have reached."""
        def release() -> None:
            wait_until(stalled)
            self.release_window()
        threading.Thread(target=release, daemon=True).start()

    # How the shipped fake's thread is used ------------------------------------------------

    def _next_action(self) -> Optional[Action]:
        with self._lock:
            return self._injected.popleft() if self._injected else None

    def _give_back(self, connection: int, stream: int) -> None:
        """A request that took an action is not recorded: the action goes back in front."""
        with self._lock:
            action = self._taken.pop((connection, stream), None)
            if action is not None:
                self._injected.appendleft(action)

    def _secured(self, link: andpush._FakeLink) -> None:
        assert link.tls is not None
        self.handshakes += 1
        self.protocols.append(link.tls.selected_alpn_protocol())
        super()._secured(link)

    def _protocol(self, name: str, number: int) -> Union[andpush._FakeH1, andpush._FakeH2]:
        if name == "h2":
            protocol = _TestH2(self, number)
            self._h2.add(protocol)
            return protocol
        return super()._protocol(name, number)

    def _shut(self, link: andpush._FakeLink) -> None:
        if not link.closed:
            with self._lock:
                taken = [key for key in self._taken if key[0] == link.number]
            for connection, stream in sorted(taken):
                self._give_back(connection, stream)
            self._h2.discard(link.protocol)  # type: ignore[arg-type]
        super()._shut(link)

    def _take(self, link: andpush._FakeLink, data: bytes) -> None:
        protocol = link.protocol
        if protocol is None or isinstance(protocol, andpush._FakeH1) and protocol.idle:
            action = self._next_action()  # the first bytes of a request
            if action == RESET_BEFORE_READ:
                self._reset(link)
                return
            if action is not None:
                self._taken[(link.number, 0)] = action
        try:
            super()._take(link, data)
        except _Cut as cut:
            if str(cut) == "reset":
                self._reset(link)
            else:
                self._close(link, "drop")

    def _write(self, link: andpush._FakeLink, data: bytes) -> None:
        if link.tls is None or not (self.split_tls_records or self.record_per_frame):
            super()._write(link, data)
            return
        pieces = []
        if self.split_tls_records:
            position, number = 0, 0
            while position < len(data):
                size = _SPLIT_SIZES[number % len(_SPLIT_SIZES)]
                pieces.append(data[position:position + size])
                position, number = position + size, number + 1
        else:  # record_per_frame
            position = 0
            while position < len(data):
                end = position + 9 + int.from_bytes(data[position:position + 3], "big")
                pieces.append(data[position:end])
                position = end
        for piece in pieces:
            super()._write(link, piece)

    def _dispatch(self, link: andpush._FakeLink, request: andpush._FakeRequest) -> None:
        protocol = link.protocol
        if link.closed or isinstance(protocol, andpush._FakeH2) and (
                request.stream not in protocol.streams):
            self._give_back(request.connection, request.stream)
            return  # read with others, then beyond a GOAWAY: not processed
        record = Request(request)
        with self._lock:
            action = self._taken.pop((request.connection, request.stream), None)
        if action is None:
            action = self._action_for_token(record)
        if isinstance(protocol, _TestH2) and action in (REFUSE_STREAM, GOAWAY_BEFORE_READ):
            protocol.drop_read(request.stream, action)  # by_token's: as if never read
            return
        if action == RESET_BEFORE_READ:
            self._reset(link)
            return
        with self._lock:
            self.requests.append(record)
        if action == RESET_AFTER_READ:
            self._reset(link)
            return
        if isinstance(protocol, _TestH2) and not protocol.act(request.stream, action):
            return
        answer = self._scripted(record, request, action)
        delay = self.reply_delay + (self.slow_seconds if action == SLOW else 0.0)
        if delay:
            self._later(delay, lambda: self._respond(link, request, record, answer, action, True))
        else:
            self._respond(link, request, record, answer, action, False)

    def _action_for_token(self, record: Request) -> Optional[Action]:
        """The next of by_token's actions for the request's device token, if any."""
        try:
            payload = record.json
            token = payload.get("to") or payload.get("message", {}).get("token")
        except (ValueError, AttributeError):
            return None
        with self._lock:
            actions = self.by_token.get(token) if isinstance(token, str) else None
            return actions.pop(0) if actions else None

    def _scripted(self, record: Request, request: andpush._FakeRequest,
                  action: Optional[Action]) -> andpush._FakeAnswer:
        """The answer an action asks for, or the one the routes or the shipped fake give."""
        if isinstance(action, Reply):
            return action.answer()
        if action == NON_JSON:
            return Reply(200, body=b"<html>oops</html>",
                         headers={"Content-Type": "text/html"}).answer()
        if action == HUGE_BODY:
            return Reply(200, body=_huge_json_body(),
                         headers={"Content-Type": JSON_CONTENT_TYPE}).answer()
        path = record.path.partition("?")[0]
        routes = [(len(prefix), handler) for (method, prefix), handler in list(self.routes.items())
                  if method == record.method and path.startswith(prefix)]
        try:
            if routes:
                return max(routes, key=lambda route: route[0])[1](record).answer()
            if record.method == "GET" and path == _METADATA_TOKEN:
                if record.headers.get("metadata-flavor") != "Google":
                    return Reply(403, body=b"Missing Metadata-Flavor:Google header.").answer()
                return Reply(200, json=self._grant()).answer()
            if record.method == "GET" and path == _METADATA_PROJECT:
                return Reply(200, body=b"metadata-project",
                             headers={"Content-Type": "text/plain"}).answer()
            return self._answer(request)
        except Exception:  # noqa: BLE001 (a bug in a handler: answer 500, keep it in errors)
            self._fail()
            return Reply(500, body=b"fake FCM handler failed").answer()

    def _respond(self, link: andpush._FakeLink, request: andpush._FakeRequest, record: Request,
                 answer: andpush._FakeAnswer, action: Optional[Action], late: bool) -> None:
        """Send the answer, as the action says (now, or once held no more)."""
        if link.closed or link.closing:
            return
        if any(picks(record) and not released.is_set() for picks, released in self._holds):
            self._later(_HOLD_POLL, lambda: self._respond(link, request, record, answer, action,
                                                         True))
            return
        protocol = link.protocol
        if isinstance(protocol, _TestH2):
            if action == TRUNCATED_BODY:
                protocol.truncated(request.stream, answer)
            else:
                self._deliver(link, request, answer)
        elif isinstance(protocol, andpush._FakeH1):
            self._respond_h1(link, protocol, request, answer, action,
                             isinstance(action, Reply) and action.closes)
        if late:
            self._unflushed.add(link)

    def _respond_h1(self, link: andpush._FakeLink, protocol: andpush._FakeH1,
                    request: andpush._FakeRequest, answer: andpush._FakeAnswer,
                    action: Optional[Action], closes: bool) -> None:
        framing = ["Content-Length: %d" % len(answer.body)]
        if action == MALFORMED_STATUS:
            self._send_raw(link, protocol, b"HTTP/1.1 OK-ish\r\n", close=True)
        elif action == TRUNCATED_BODY:
            promised = max(len(answer.body), 2)
            framing = ["Content-Length: %d" % promised]
            self._send_raw(link, protocol, _render_head(answer, framing)
                           + answer.body[:promised // 2], close=True)
        elif action == CHUNKED:
            framing = ["Transfer-Encoding: chunked", "Trailer: X-Fake-Trailer"]
            self._send_raw(link, protocol, _render_head(answer, framing) + _chunked(answer.body),
                           close=False)
        else:
            if action == CONNECTION_CLOSE or closes:
                protocol._keep = False
            self._deliver(link, request, answer)
        self._answered[link.number] += 1
        if self.close_every and self._answered[link.number] % self.close_every == 0:
            self._close(link, "drop")  # abrupt: no close_notify, no "Connection: close"

    def _send_raw(self, link: andpush._FakeLink, protocol: andpush._FakeH1, data: bytes,
                  close: bool) -> None:
        protocol.waiting = False
        protocol.outgoing += data
        if close:
            self._close(link, "notify")
            return
        for following in protocol._next():
            self._dispatch(link, following)

    def _release_windows(self) -> None:
        for protocol in list(self._h2):
            protocol.release()
        for link in list(self._links):
            if isinstance(link.protocol, _TestH2):
                self._flush(link)

    # Google's side: tokens for the test key, authorized users and the metadata server.

    def _refused(self, request: andpush._FakeRequest) -> Optional[andpush._FakeAnswer]:
        authorization = request.headers.get("authorization", "")
        if not authorization.startswith("Bearer ") or authorization[7:] not in self.valid_tokens:
            return fcm_error(401, None, "Request had invalid authentication credentials.").answer()
        return None

    def _send(self, request: andpush._FakeRequest, path: str) -> andpush._FakeAnswer:
        return super()._send(request, self._send_path)  # any project's sends are this one's

    def _token(self, request: andpush._FakeRequest) -> andpush._FakeAnswer:
        form = dict(urllib.parse.parse_qsl(request.body.decode("ascii")))
        problem = self._grant_problem(form)
        if problem is not None:
            return Reply(400, json={"error": problem[0], "error_description": problem[1]}).answer()
        return Reply(200, json=self._grant()).answer()

    def _grant_problem(self, form: Dict[str, str]) -> Optional[Tuple[str, str]]:
        if form.get("grant_type") == "refresh_token":
            if form.get("refresh_token") == self.refresh_token:
                return None
            return "invalid_grant", "bad refresh token"
        with contextlib.suppress(ValueError, IndexError):
            self.jwt_claims.append(json.loads(b64url_decode(form["assertion"].split(".")[1])))
        return super()._grant_problem(form)

    def _grant(self) -> Dict[str, Any]:
        with self._lock:
            token = "ya29.test-token-%d" % (len(self.issued) + 1)
            self.issued.append(token)
            self.valid_tokens.add(token)
        return {"access_token": token, "expires_in": self.token_lifetime, "token_type": "Bearer"}

    def _legacy_result(self, token: str, dry_run: bool) -> Dict[str, Any]:
        result = super()._legacy_result(token, dry_run)
        if "message_id" in result and token in self.canonical_tokens:
            result["registration_id"] = self.canonical_tokens[token]
        return result


class FakeFCM2(FakeFCM):
    """FakeFCM over HTTP/2: its TLS offers h2 (alpn=("h2", "http/1.1"): either)."""

    actions = H2_ACTIONS

    def __init__(self, alpn: Tuple[str, ...] = ("h2",), max_concurrent_streams: int = 100) -> None:
        super().__init__(alpn=alpn, max_concurrent_streams=max_concurrent_streams)


class _TestH2(andpush._FakeH2):
    """The shipped fake's HTTP/2 with the misbehaviours and counters of FakeFCM's knobs."""

    def __init__(self, server: FakeFCM, connection: int) -> None:
        super().__init__(connection, server.max_concurrent_streams)
        self.server = server
        self.silent = not server.send_settings
        self.stalling = server.stall_window
        self.stall_size = server.stall_window_size
        self.goaway_after = server.goaway_after
        self.encoder = _H2HeaderEncoder(server.use_dynamic_table)
        self.recorded = 0
        self.highest_recorded = 0
        self.goaway_seen = False  # the client ACKed the PING after our GOAWAY
        self.pings_in_a_row = 0  # client PINGs since the last new stream
        self.stalled: Set[int] = set()
        if self.silent:
            self.outgoing.clear()
        elif self.stalling:  # the SETTINGS again with a small window, and no WINDOW_UPDATE
            self.outgoing.clear()
            self._unacked.clear()
            self._window = andpush._H2_DEFAULT_WINDOW
            self.settings({andpush._SETTINGS_MAX_CONCURRENT_STREAMS: server.max_concurrent_streams,
                           andpush._SETTINGS_INITIAL_WINDOW_SIZE: self.stall_size})

    def receive(self, data: bytes) -> List[andpush._FakeRequest]:
        if self.silent:
            return []  # reads nothing, says nothing: the client gives up
        try:
            return super().receive(data)
        except andpush._H2Error as error:
            self.server.protocol_errors.append(str(error))
            if error.code == andpush._FLOW_CONTROL_ERROR:
                self.server.flow_control_violations += 1
            raise

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes,
                  done: List[andpush._FakeRequest]) -> None:
        server = self.server
        server.frames_received[_H2_FRAME_NAMES[kind] if kind < 10 else "0x%02x" % kind] += 1
        new = kind == andpush._HEADERS and stream_id > self._highest and stream_id % 2 == 1
        action: Optional[Action] = None
        if new:
            self.pings_in_a_row = 0
            if self.last_stream_id is not None:
                server.streams_after_goaway += self.goaway_seen
            elif len(self.streams) < self._limit:
                action = server._next_action()
                if action == GOAWAY_BEFORE_READ:
                    self.go_away(last=self._highest)
        elif kind == andpush._PING:
            self.on_ping(flags, payload)
        elif kind == andpush._SETTINGS and not flags & andpush._ACK:
            server.settings_received.append({
                int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                for i in range(0, len(payload) - 5, 6)})
        elif kind == andpush._RST_STREAM:
            server.streams_reset_by_client += 1
            server._give_back(self.connection, stream_id)
        elif kind == andpush._GOAWAY:
            server.goaways_received += 1
        super()._on_frame(kind, flags, stream_id, payload, done)
        if self.too_many(kind, flags):
            self.go_away(H2_ENHANCE_YOUR_CALM, self._highest, b"too_many_pings")
            raise _Cut("drop")
        if new and stream_id in self.streams:
            if self.stalling:
                self.streams[stream_id].window = self.stall_size
            server.max_open_streams_seen = max(server.max_open_streams_seen, len(self.streams))
            if action == RESET_BEFORE_READ:
                raise _Cut("reset")
            if action == REFUSE_STREAM:
                self.refuse(stream_id)
            elif action is not None:
                server._taken[(self.connection, stream_id)] = action

    def on_ping(self, flags: int, payload: bytes) -> None:
        if flags & andpush._ACK:
            self.server.pings_acked += 1
            self.goaway_seen = self.goaway_seen or payload == _GOAWAY_PING
        else:
            self.server.pings_received += 1
            self.pings_in_a_row += 1

    def too_many(self, kind: int, flags: int) -> bool:
        limit = self.server.too_many_pings
        return kind == andpush._PING and not flags & andpush._ACK and limit is not None and (
            self.pings_in_a_row >= limit)

    def act(self, stream_id: int, action: Optional[Action]) -> bool:
        """What a recorded stream's action does to the connection first; False if the
        stream is to get no answer."""
        server = self.server
        self.recorded += 1
        self.highest_recorded = max(self.highest_recorded, stream_id)
        if action == RESET_STREAM_AFTER_READ:
            self.reset_stream(stream_id, H2_INTERNAL_ERROR)
            return False
        if action == DROP_CONNECTION_AFTER_READ:
            raise _Cut("drop")
        if action == GOAWAY_AFTER_READ or (
                self.goaway_after is not None and self.recorded == self.goaway_after):
            self.go_away(last=stream_id)
        if action == SHUTDOWN_NOTICE_AFTER_READ and self.last_stream_id is None:
            self.outgoing += andpush._frame(andpush._GOAWAY, 0, 0, andpush._H2_LAST_STREAM.to_bytes(
                4, "big") + bytes(4)) + andpush._frame(andpush._PING, 0, 0, _GOAWAY_PING)
            server.goaways_sent += 1
            server._later(server.shutdown_grace, self.shut_down)
        return True

    def shut_down(self) -> None:
        """The real GOAWAY after the shutdown notice."""
        self.go_away()
        for link in list(self.server._links):
            if link.protocol is self:
                self.server._flush(link)

    def go_away(self, code: int = andpush._NO_ERROR, last: Optional[int] = None,
                debug: bytes = b"") -> None:
        """Never disowns a recorded stream; a PING follows, whose ACK says it was seen."""
        last = max(self._highest if last is None else last, self.highest_recorded)
        self.server.goaways_sent += 1
        super().go_away(code, last, debug)
        self.outgoing += andpush._frame(andpush._PING, 0, 0, _GOAWAY_PING)

    def _forget(self, stream_id: int) -> None:
        self.server._give_back(self.connection, stream_id)
        super()._forget(stream_id)

    def refuse(self, stream_id: int) -> None:
        self.server.streams_refused += 1
        self.reset_stream(stream_id, andpush._REFUSED_STREAM)

    def reset_stream(self, stream_id: int, code: int) -> None:
        super()._forget(stream_id)
        self.outgoing += andpush._frame(andpush._RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))

    def drop_read(self, stream_id: int, action: Action) -> None:
        """A by_token REFUSE_STREAM or GOAWAY_BEFORE_READ: the stream, read, is dropped as if
        it never was; refused too when a GOAWAY cannot disown it."""
        if action == GOAWAY_BEFORE_READ:
            self.go_away(last=stream_id - 2)
        if action == REFUSE_STREAM or stream_id <= (self.last_stream_id or 0):
            self.refuse(stream_id)
        else:
            super()._forget(stream_id)

    def truncated(self, stream_id: int, answer: andpush._FakeAnswer) -> None:
        """TRUNCATED_BODY: content-length promises twice the body that comes."""
        promised = max(len(answer.body), 2)
        fields = [(":status", str(answer.status)), *answer.headers,
                  ("content-length", str(promised))]
        self._queue_headers(stream_id, andpush._hpack_encode(fields), False)
        self.outgoing += andpush._frame(andpush._DATA, andpush._END_STREAM, stream_id,
                                        answer.body[:promised // 2])
        super()._forget(stream_id)

    def answer(self, request: andpush._FakeRequest, status: int,
               headers: Iterable[Tuple[str, str]], body: bytes) -> List[andpush._FakeRequest]:
        if self.server.ping_before_answers:
            self.outgoing += andpush._frame(andpush._PING, 0, 0, _SERVER_PING)
        if not self.encoder.dynamic:
            return super().answer(request, status, headers, body)
        stream = self.streams.get(request.stream)
        if stream is None:
            return []
        with self.server._lock:
            self.server._answer_numbers += 1
            number = self.server._answer_numbers
        fields = [(b":status", b"%d" % status)] + [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers] + [
            (b"content-length", b"%d" % len(body)), (b"date", email.utils.formatdate(
                usegmt=True).encode("ascii")), (b"vary", b"Origin, X-Origin, Referer"),
            (b"server", b"ESF"), (b"x-xss-protection", b"0"), (b"x-frame-options", b"SAMEORIGIN"),
            (b"alt-svc", b'h3=":443"; ma=2592000,h3-29=":443"; ma=2592000'),
            (b"x-fake", b"%d" % number)]
        self._queue_headers(stream.id, self.encoder.encode(fields), not body)
        stream.pending = body
        self._send_data(stream)
        return []

    def _queue_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if not self.server.continuation:
            super()._queue_headers(stream_id, block, end_stream)
            return
        size = self.server.continuation_fragment
        pieces = [block[start:start + size] for start in range(0, len(block), size)] or [b""]
        for number, piece in enumerate(pieces):
            last = andpush._END_HEADERS if number == len(pieces) - 1 else 0
            if number == 0:
                flags = last | (andpush._END_STREAM if end_stream else 0)
                self.outgoing += andpush._frame(andpush._HEADERS, flags, stream_id, piece)
            else:
                self.outgoing += andpush._frame(andpush._CONTINUATION, last, stream_id, piece)

    def _replenish(self, stream: Optional[andpush._FakeStream]) -> None:
        if not self.stalling:
            super()._replenish(stream)
            return
        if stream is not None and stream.window <= 0 and stream.id not in self.stalled:
            self.stalled.add(stream.id)
            self.server.stalled_streams += 1
        if self._window <= 0 and 0 not in self.stalled:  # (0: the connection's window)
            self.stalled.add(0)
            self.server.stalled_connections += 1

    def release(self) -> None:
        """The windows stall_window held, given back for good."""
        if not self.stalling:
            return
        self.stalling = False
        self.settings({andpush._SETTINGS_INITIAL_WINDOW_SIZE: andpush._H2_DEFAULT_WINDOW})
        for stream in self.streams.values():
            stream.window += andpush._H2_DEFAULT_WINDOW - self.stall_size
        super()._replenish(None)
        for stream in list(self.streams.values()):
            if not stream.read:
                super()._replenish(stream)


_H2_FRAME_NAMES = (
    "DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY",
    "WINDOW_UPDATE", "CONTINUATION",
)
_H2_TABLE_SIZE = 4096  # HPACK dynamic table size: the default, and use_dynamic_table's
_H2_ENTRY_OVERHEAD = 32  # octets an HPACK table entry costs beyond its name and value
_H2_STATIC_ENTRIES = 61  # dynamic table indices start after the static table's


def _hpack_string(data: bytes) -> bytes:
    """An HPACK string literal, raw (no Huffman), as haproxy and mostly h2o send them."""
    return _hpack_encode_int(len(data), 7, 0) + data


class _H2HeaderEncoder:
    """Encodes the answers' header blocks of one connection with use_dynamic_table.

    Without a dynamic table every field is a literal without indexing (RFC 7541 6.2.2). With
    one, as h2o does whatever HEADER_TABLE_SIZE the client sent: the first block opens with
    the size updates 0 then 4096, every field not in the table is added (literal with
    incremental indexing), every field already there is sent as its index, and old entries
    are evicted as the table fills.
    """

    def __init__(self, dynamic: bool) -> None:
        self.dynamic = dynamic
        self.announce = dynamic
        self.entries: List[Tuple[bytes, bytes]] = []  # newest first
        self.size = 0

    def encode(self, fields: List[Tuple[bytes, bytes]]) -> bytes:
        out = bytearray()
        if self.announce:
            self.announce = False
            out += _hpack_encode_int(0, 5, 0x20) + _hpack_encode_int(_H2_TABLE_SIZE, 5, 0x20)
        for field in fields:
            if not self.dynamic:
                out += b"\x00" + _hpack_string(field[0]) + _hpack_string(field[1])
            elif field in self.entries:
                index = _H2_STATIC_ENTRIES + 1 + self.entries.index(field)
                out += _hpack_encode_int(index, 7, 0x80)
            else:
                out += b"\x40" + _hpack_string(field[0]) + _hpack_string(field[1])
                self._insert(field)
        return bytes(out)

    def _insert(self, field: Tuple[bytes, bytes]) -> None:
        self.entries.insert(0, field)
        self.size += len(field[0]) + len(field[1]) + _H2_ENTRY_OVERHEAD
        while self.size > _H2_TABLE_SIZE:
            name, value = self.entries.pop()
            self.size -= len(name) + len(value) + _H2_ENTRY_OVERHEAD


SERVER_KEY = "AAAA-test-server-key-0123456789"
TOKEN = "device-token-0123456789abcdef"
LEGACY_MESSAGE = {"to": TOKEN, "notification": {"title": "Update", "body": "Ready"},
                  "data": {"extra": "data"}}
V1_MESSAGE = {"token": TOKEN, "notification": {"title": "Update", "body": "Ready"}}


def response(status: int, body: Any = None, **headers: str) -> andpush.Response:
    """A Response built by hand, for the socket-free tests."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    names = {name.replace("_", "-").lower(): value for name, value in headers.items()}
    return andpush.Response(status, "Reason", andpush.Headers(names), raw)


_WAIT_LIMIT = 5.0  # seconds wait_until() waits for a condition before the test fails
_WAIT_STEP = 0.002  # seconds between two looks at the condition


def wait_until(condition: Callable[[], bool], limit: float = _WAIT_LIMIT) -> bool:
    """Whether condition() became true within limit seconds: a wait as long as it needs to
    be, instead of a fixed sleep that is too long on a quiet machine or too short on a busy
    one. Use as self.assertTrue(wait_until(...))."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_WAIT_STEP)
    return True


def settles(client: Any) -> bool:
    """Wait until the client (or AsyncClient) holds no request: none waiting, due or in
    flight, and no push_many that could start more; after that nothing more goes out.
    False if it still holds one after the wait."""
    return wait_until(lambda: not client._driver._has_work())


class ServerTestCase(unittest.TestCase):
    """A test with its own fake server, and clients that are closed at the end."""

    server_class = FakeFCM

    def setUp(self) -> None:
        self.server = self.server_class()
        self.server.start()
        self.addCleanup(self.server.close)
        self.addCleanup(lambda: self.assertEqual(self.server.errors, []))

    def client(self, key: str = SERVER_KEY, **options: Any) -> andpush.Client:
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        client = andpush.new(key, **options)
        self.addCleanup(client.close)
        return client


# Socket-free: errors, headers, retries ######################################################

class ErrorClassificationTest(unittest.TestCase):
    def test_error_codes_map_to_classes_named_like_firebase_admin(self) -> None:
        table = [
            (400, "INVALID_ARGUMENT", andpush.InvalidArgumentError),
            (404, "UNREGISTERED", andpush.UnregisteredError),
            (403, "SENDER_ID_MISMATCH", andpush.SenderIdMismatchError),
            (429, "QUOTA_EXCEEDED", andpush.QuotaExceededError),
            (503, "UNAVAILABLE", andpush.UnavailableError),
            (500, "INTERNAL", andpush.InternalError),
            (401, "THIRD_PARTY_AUTH_ERROR", andpush.ThirdPartyAuthError),
            (401, "APNS_AUTH_ERROR", andpush.ThirdPartyAuthError),
        ]
        for status, code, cls in table:
            with self.subTest(code):
                error = andpush._http_error(response(status, fcm_error(status, code).json))
                self.assertIs(type(error), cls)
                self.assertEqual(error.error_code, code)
                self.assertEqual(error.status_code, status)
                base = andpush.ClientError if status < 500 else andpush.ServerError
                self.assertIsInstance(error, base)

    def test_the_senders_own_credentials_refused_are_auth_errors_too(self) -> None:
        table = [(401, andpush.UnauthenticatedError), (403, andpush.PermissionDeniedError)]
        for status, cls in table:
            with self.subTest(cls.__name__):
                error = andpush._http_error(response(status, fcm_error(status, None).json))
                self.assertIs(type(error), cls)
                self.assertIsInstance(error, andpush.ClientError)
                self.assertIsInstance(error, andpush.AuthError)

    def test_device_and_third_party_credential_errors_are_not_auth_errors(self) -> None:
        # Their envelopes say UNAUTHENTICATED/PERMISSION_DENIED too: the errorCode wins.
        for status, code in ((401, "THIRD_PARTY_AUTH_ERROR"), (403, "SENDER_ID_MISMATCH")):
            with self.subTest(code):
                error = andpush._http_error(response(status, fcm_error(status, code).json))
                self.assertNotIsInstance(error, andpush.AuthError)

    def test_without_an_error_code_the_status_decides(self) -> None:
        table = [
            (400, andpush.InvalidArgumentError), (429, andpush.QuotaExceededError),
            (500, andpush.InternalError), (503, andpush.UnavailableError),
            (401, andpush.ClientError), (502, andpush.ServerError), (301, andpush.HTTPError),
        ]
        for status, cls in table:
            with self.subTest(status):
                self.assertIs(type(andpush._http_error(response(status, b"<html>"))), cls)

    def test_a_bare_404_is_never_unregistered(self) -> None:
        # A wrong project id answers 404 NOT_FOUND too; deleting tokens on it would be a disaster.
        error = andpush._http_error(response(404, fcm_error(404, None).json))
        self.assertIs(type(error), andpush.ClientError)
        self.assertEqual(error.error_code, "NOT_FOUND")

    def test_a_code_counts_only_from_the_fcm_error_detail(self) -> None:
        fcm_type = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
        def answer(details: Any, status: Any = "NOT_FOUND") -> andpush.HTTPError:
            body = {"error": {"code": 404, "message": "x", "status": status, "details": details}}
            return andpush._http_error(response(404, body))
        untyped = answer([{"errorCode": "UNREGISTERED"}])
        self.assertIs(type(untyped), andpush.ClientError)
        self.assertEqual(untyped.error_code, "NOT_FOUND")
        other = answer([{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                         "errorCode": "UNREGISTERED", "reason": "UNREGISTERED"}])
        self.assertIs(type(other), andpush.ClientError)
        after_others = answer([{"@type": "type.googleapis.com/google.rpc.BadRequest"},
                               {"@type": fcm_type, "errorCode": "UNREGISTERED"}])
        self.assertIs(type(after_others), andpush.UnregisteredError)
        self.assertEqual(after_others.error_code, "UNREGISTERED")

    def test_a_status_counts_only_when_it_is_a_canonical_code(self) -> None:
        for status in ["UNREGISTERED", ["NOT_FOUND"], {"a": 1}, 404, None]:
            with self.subTest(status=status):
                body = {"error": {"code": 404, "message": "x", "status": status}}
                error = andpush._http_error(response(404, body))
                self.assertIs(type(error), andpush.ClientError)
                self.assertIsNone(error.error_code)

    def test_message_says_status_code_and_server_explanation(self) -> None:
        error = andpush._http_error(response(404, fcm_error(404, "UNREGISTERED", "gone").json))
        self.assertEqual(str(error), "HTTP 404 Reason (UNREGISTERED): gone")


class RetryAfterTest(unittest.TestCase):
    def test_seconds_and_http_dates(self) -> None:
        self.assertEqual(andpush._retry_after("120"), 120.0)
        self.assertIsNone(andpush._retry_after(None))
        self.assertIsNone(andpush._retry_after("soon"))
        later = email.utils.formatdate(time.time() + 30, usegmt=True)
        self.assertAlmostEqual(andpush._retry_after(later) or 0, 30, delta=2)
        earlier = email.utils.formatdate(time.time() - 30, usegmt=True)
        self.assertEqual(andpush._retry_after(earlier), 0.0)

    def test_all_three_rfc_9110_date_forms_give_the_same_time(self) -> None:
        later = time.gmtime(int(time.time()) + 30)
        forms = [
            time.strftime("%a, %d %b %Y %H:%M:%S GMT", later),   # IMF-fixdate
            time.strftime("%A, %d-%b-%y %H:%M:%S GMT", later),   # obsolete RFC 850
            time.strftime("%a %b ", later) + "%2d" % later.tm_mday
            + time.strftime(" %H:%M:%S %Y", later),               # asctime
        ]
        for form in forms:
            with self.subTest(form):
                self.assertAlmostEqual(andpush._retry_after(form) or 0, 30, delta=2)

    def test_known_dates_in_each_form(self) -> None:
        rfc_example = 784111777  # Sun, 06 Nov 1994 08:49:37 GMT, RFC 9110's example
        for form in ("Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
                     "Sun Nov  6 08:49:37 1994"):
            with self.subTest(form):
                self.assertEqual(andpush._http_date(form), rfc_example)
        self.assertEqual(andpush._http_date("Tue, 29 Feb 2000 00:00:00 GMT"), 951782400)
        self.assertEqual(andpush._http_date("Fri, 31 Dec 9999 23:59:59 GMT"), 253402300799)

    def test_a_two_digit_year_more_than_50_years_ahead_is_in_the_past(self) -> None:
        this_year = time.gmtime().tm_year
        ahead = (this_year + 60) % 100
        when = andpush._http_date("Monday, 01-Jan-%02d 00:00:00 GMT" % ahead)
        self.assertEqual(time.gmtime(when).tm_year, this_year + 60 - 100)

    def test_what_is_not_an_ascii_number_or_a_real_date_is_absent(self) -> None:
        for value in ["\u00b2", "1\u00b2", "\u0663", "-5", "1.5", "12 0", "120, 120", "",
                      "Sun, 31 Feb 1994 08:49:37 GMT", "Sun, 06 Nov 1994 24:00:00 GMT",
                      "Sun, 06 Nov 1994 08:49:37 +0000", "Sun, \u00b206 Nov 1994 08:49:37 GMT",
                      "Sun Nov  6 08:49:37 \u0661\u0669\u0669\u0664", "Sun, 06 Nov 1994"]:
            with self.subTest(value):
                self.assertIsNone(andpush._retry_after(value))

    def test_a_huge_delta_seconds_counts_as_2_to_the_31(self) -> None:
        self.assertEqual(andpush._retry_after("9" * 5000), 2.0 ** 31)
        self.assertEqual(andpush._retry_after("0000000000005"), 5.0)

    def test_http_error_carries_retry_after(self) -> None:
        error = andpush._http_error(response(503, b"", retry_after="7"))
        self.assertEqual(error.retry_after, 7.0)


def every_public_error() -> List[andpush.Error]:
    """One instance of each public exception class, with every attribute set."""
    errors: List[andpush.Error] = []
    for name in andpush.__all__:
        cls = getattr(andpush, name)
        if not (isinstance(cls, type) and issubclass(cls, andpush.Error)):
            continue
        if issubclass(cls, andpush.HTTPError):
            answer = fcm_error(429, "QUOTA_EXCEEDED", "slow down", retry_after="7")
            errors.append(cls(response(429, answer.json, retry_after="7")))
        elif issubclass(cls, andpush.NetworkError):
            errors.append(cls("connection reset", may_have_been_delivered=True))
            errors.append(cls("refused", may_have_been_delivered=False))
        else:
            errors.append(cls("no credentials"))
    return errors


def raise_unregistered_error() -> None:
    """Run in a worker process: fail the way a push to a deleted token fails."""
    raise andpush._http_error(response(404, fcm_error(404, "UNREGISTERED").json))


class ErrorCopyTest(unittest.TestCase):
    """Errors cross process pools and result backends: pickle and copy keep all they say."""

    def assertSameError(self, copied: BaseException, original: andpush.Error) -> None:
        self.assertIs(type(copied), type(original))
        self.assertEqual(str(copied), str(original))
        self.assertEqual(copied.args, original.args)
        for name in ("status_code", "error_code", "retry_after", "may_have_been_delivered"):
            self.assertEqual(getattr(copied, name, None), getattr(original, name, None), name)
        if isinstance(original, andpush.HTTPError):
            assert isinstance(copied, andpush.HTTPError)
            self.assertEqual(copied.response.status_code, original.response.status_code)
            self.assertEqual(copied.response.reason, original.response.reason)
            self.assertEqual(dict(copied.response.headers), dict(original.response.headers))
            self.assertEqual(copied.response.body, original.response.body)
            self.assertEqual(copied.response.json(), original.response.json())

    def test_every_public_error_survives_pickle_in_every_protocol(self) -> None:
        for error in every_public_error():
            for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
                with self.subTest(type(error).__name__, protocol=protocol):
                    self.assertSameError(pickle.loads(pickle.dumps(error, protocol)), error)

    def test_every_public_error_survives_copy_and_deepcopy(self) -> None:
        for error in every_public_error():
            with self.subTest(type(error).__name__):
                self.assertSameError(copy.copy(error), error)
                self.assertSameError(copy.deepcopy(error), error)

    def test_a_response_pickles_as_plain_data_and_parses_its_json_again(self) -> None:
        original = response(200, {"results": [{"error": "NotRegistered"}]}, x_id="1")
        original._device_tokens = ("device-a",)
        self.assertEqual(original.errors, {"device-a": "NotRegistered"})  # parsed once here
        copied = pickle.loads(pickle.dumps(original))
        self.assertEqual(copied.json(), original.json())
        self.assertEqual(copied.errors, {"device-a": "NotRegistered"})
        self.assertEqual(copied.headers["X-Id"], "1")

    def test_every_public_error_is_rebuilt_from_its_args(self) -> None:
        # Celery's json result backend stores type(e).__name__, its module and e.args (as
        # JSON), and re-creates the exception as cls(*args).
        for error in every_public_error():
            with self.subTest(type(error).__name__):
                args = json.loads(json.dumps(error.args))
                rebuilt = type(error)(*args)
                self.assertIs(type(rebuilt), type(error))
                self.assertEqual(str(rebuilt), str(error))
                self.assertEqual(rebuilt.args, error.args)
                for name in ("status_code", "error_code", "retry_after",
                             "may_have_been_delivered"):
                    self.assertEqual(getattr(rebuilt, name, None), getattr(error, name, None))
                if isinstance(error, andpush.HTTPError):
                    assert isinstance(rebuilt, andpush.HTTPError)
                    self.assertEqual((rebuilt.response.status_code, rebuilt.response.body),
                                     (error.status_code, b""))
                copied = pickle.loads(pickle.dumps(rebuilt))
                self.assertEqual((type(copied), copied.args), (type(error), error.args))

    def test_the_paused_quota_error_is_rebuilt_with_what_is_left_to_wait(self) -> None:
        cause = response(429, fcm_error(429, "QUOTA_EXCEEDED").json)
        error = andpush._paused(cause, 12.5)
        rebuilt = type(error)(*json.loads(json.dumps(error.args)))
        self.assertEqual((str(rebuilt), rebuilt.retry_after), (str(error), 12.5))
        self.assertIn("waits 12.5 s more", str(rebuilt))

    def test_an_http_error_is_still_made_from_a_response_only(self) -> None:
        with self.assertRaisesRegex(TypeError, "from a Response, or from a message and the "
                                    "status code"):
            andpush.HTTPError("no status")

    def test_an_error_raised_in_a_process_pool_worker_reaches_the_caller(self) -> None:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            future = pool.submit(raise_unregistered_error)
            with self.assertRaises(andpush.UnregisteredError) as caught:
                future.result(timeout=10)
        self.assertEqual(caught.exception.status_code, 404)
        self.assertEqual(caught.exception.error_code, "UNREGISTERED")


class RetryPolicyTest(unittest.TestCase):
    def test_what_is_retried(self) -> None:
        retry = andpush._Retry(3, 0.01, may_refresh=False)
        def error(status: int, code: Optional[str] = None) -> andpush.Error:
            return andpush._http_error(response(status, fcm_error(status, code).json))
        retried = [error(503), error(500), error(429), error(503, "UNAVAILABLE"),
                   andpush.NetworkError("x", may_have_been_delivered=False)]
        not_retried = [error(400), error(404, "UNREGISTERED"), error(403), error(401),
                       error(502), andpush.NetworkError("x", may_have_been_delivered=True)]
        for e in retried:
            with self.subTest(repr(e)):
                self.assertIsNotNone(retry.after(e))
        for e in not_retried:
            with self.subTest(repr(e)):
                self.assertIsNone(retry.after(e))

    def test_budget_runs_out_and_waits_grow(self) -> None:
        retry: Optional[andpush._Retry] = andpush._Retry(3, 1.0)
        waits = []
        error = andpush._http_error(response(503, b""))
        while retry is not None:
            step = retry.after(error)
            if step is None:
                break
            retry, wait = step
            waits.append(wait)
        self.assertEqual(len(waits), 3)
        for attempt, wait in enumerate(waits):
            self.assertTrue(0.5 * 2 ** attempt <= wait <= 1.5 * 2 ** attempt, waits)

    def test_retry_after_wins_when_longer_and_too_long_gives_up(self) -> None:
        retry = andpush._Retry(3, 0.01)
        step = retry.after(andpush._http_error(response(503, b"", retry_after="5")))
        self.assertEqual(step and step[1], 5.0)
        self.assertIsNone(retry.after(andpush._http_error(response(503, b"", retry_after="3600"))))

    def test_quota_exceeded_waits_a_minute_without_retry_after(self) -> None:
        step = andpush._Retry(3, 0.01).after(andpush._http_error(response(429, b"")))
        self.assertEqual(step and step[1], 60.0)

    def test_a_rejected_access_token_is_refreshed_once(self) -> None:
        rejected = andpush._http_error(response(401, fcm_error(401, None).json))
        step = andpush._Retry(0, 0.01).after(rejected)
        self.assertIsNotNone(step)
        assert step is not None
        self.assertEqual(step[1], 0.0)
        self.assertIsNone(step[0].after(rejected))
        apns = andpush._http_error(response(401, fcm_error(401, "THIRD_PARTY_AUTH_ERROR").json))
        self.assertIsNone(andpush._Retry(3, 0.01).after(apns))


class HeadersAndResponseTest(unittest.TestCase):
    def test_headers_are_case_insensitive(self) -> None:
        headers = andpush.Headers({"content-type": "application/json"})
        self.assertEqual(headers["Content-Type"], "application/json")
        self.assertIn("CONTENT-TYPE", headers)
        self.assertEqual(dict(headers), {"content-type": "application/json"})

    def test_json_is_parsed_once_and_non_json_says_so(self) -> None:
        ok = response(200, {"a": 1})
        self.assertIs(ok.json(), ok.json())
        with self.assertRaisesRegex(ValueError, "not JSON"):
            response(200, b"<html>").json()

    def test_repr_shows_no_body(self) -> None:
        self.assertEqual(repr(response(200, {"token": TOKEN})), "<Response [200]>")

    def test_json_is_a_method_as_in_requests(self) -> None:
        self.assertEqual(response(200, {"name": "n"}).json(), {"name": "n"})

    def test_text_is_the_body_decoded_as_utf8_with_bad_bytes_replaced(self) -> None:
        self.assertEqual(response(200, '{"title": "Grüße"}'.encode()).text, '{"title": "Grüße"}')
        self.assertEqual(response(502, b"bad \xff gateway").text, "bad \ufffd gateway")

    def test_ok_is_true_only_for_2xx(self) -> None:
        self.assertEqual(
            [response(status, {}).ok for status in (200, 204, 299, 302, 400, 503)],
            [True, True, True, False, False, False],
        )


def deeply_nested(depth: int) -> Dict[str, Any]:
    """A dict ``depth`` dicts deep, made without recursion."""
    value: Dict[str, Any] = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def holding_itself() -> Dict[str, Any]:
    """A dict that is one of its own values."""
    value: Dict[str, Any] = {}
    value["x"] = value
    return value


class BadInputTest(ServerTestCase):
    """Bad input raises a TypeError or ValueError that says what to fix, before any I/O."""

    def test_bad_options(self) -> None:
        table: List[Tuple[Dict[str, Any], type, str]] = [
            ({"server_key": ""}, ValueError, "empty"),
            ({"server_key": 5}, TypeError, "must be a str"),
            ({"server_key": "a\r\nInjected: 1"}, ValueError, "line break"),
            ({"server_key": "k", "endpoint": "http://127.0.0.1"}, ValueError, "https"),
            ({"server_key": "k", "endpoint": "https://h/fcm"}, ValueError, "only scheme"),
            ({"server_key": "k", "endpoint": "fcm.googleapis.com"}, ValueError, "https://"),
            ({"server_key": "k", "timeout": 0}, ValueError, "timeout"),
            ({"server_key": "k", "pool_size": 0}, ValueError, "pool_size"),
            ({"server_key": "k", "max_retries": -1}, ValueError, "max_retries"),
            ({"server_key": "k", "rate_limit": 0}, ValueError, "rate_limit"),
            ({"server_key": "k", "ssl_context": "no"}, TypeError, "SSLContext"),
            ({"server_key": "k", "proxy": "socks5://p:1"}, ValueError, "proxy"),
            ({"server_key": "k", "access_token": "t"}, ValueError, "only one"),
            ({"access_token": "t"}, ValueError, "project_id"),
            ({"credentials": 42}, TypeError, "credentials"),
        ]
        for options, error, fragment in table:
            with self.subTest(options):
                with self.assertRaisesRegex(error, fragment):
                    # A good context where the row is not about it: the default one would
                    # load the system's CA store (30 ms) each time.
                    andpush.new(**{"ssl_context": client_context(), **options})

    def test_bad_messages_are_refused_before_any_connection(self) -> None:
        client = self.client()
        table: List[Tuple[Any, type, str]] = [
            ([TOKEN], TypeError, "must be a dict"),
            ({"to": TOKEN, "data": {"when": datetime.datetime.now()}}, TypeError, "serialisable"),
            ({"to": TOKEN, "data": {"x": float("nan")}}, ValueError, "serialisable"),
            ({"to": TOKEN, "notification": deeply_nested(100_000)}, ValueError, "too deeply"),
            ({"to": TOKEN, "notification": holding_itself()}, ValueError, "holds itself"),
        ]
        for message, error, fragment in table:
            with self.subTest(message=message):
                with self.assertRaisesRegex(error, fragment):
                    client.push(message)
        self.assertEqual(self.server.connections, 0)

    def test_andpush_build_is_andpush_new(self) -> None:
        self.assertIs(andpush.build, andpush.new)


# The transport, against the fake server ####################################################

class KeepAliveTest(ServerTestCase):
    def test_one_handshake_serves_many_pushes(self) -> None:
        client = self.client()
        for _ in range(20):
            self.assertEqual(client.push(LEGACY_MESSAGE).status_code, 200)
        self.assertEqual((self.server.connections, self.server.handshakes), (1, 1))
        self.assertEqual(self.server.processed, 20)

    def test_healthy_idle_tls13_connection_is_reused(self) -> None:
        # TLS 1.3 session tickets make an idle socket readable; that is not a dead connection.
        client = self.client()
        client.push(LEGACY_MESSAGE)
        time.sleep(0.02)  # the tickets came with the handshake: long since in the socket
        client.push(LEGACY_MESSAGE)
        self.assertEqual(self.server.handshakes, 1)

    def test_response_fields(self) -> None:
        response = self.client().push(LEGACY_MESSAGE)
        self.assertEqual(response.status_code, 200)
        self.assertEqual(response.headers["Content-Type"], JSON_CONTENT_TYPE)
        self.assertEqual(json.loads(response.body), response.json())
        self.assertEqual(response.json()["success"], 1)
        sent = self.server.requests[0]
        self.assertEqual(sent.headers["authorization"], "key=" + SERVER_KEY)
        self.assertEqual(sent.json, LEGACY_MESSAGE)

    def test_context_manager_closes_the_client(self) -> None:
        with self.client() as client:
            client.push(LEGACY_MESSAGE)
        with self.assertRaisesRegex(ValueError, "closed"):
            client.push(LEGACY_MESSAGE)

    def test_idle_longer_than_keep_alive_timeout_is_replaced(self) -> None:
        client = self.client(keep_alive_timeout=0.05)
        clock = FakeClock.install(client)
        client.push(LEGACY_MESSAGE)
        clock.time += 0.15  # idle that long, by the client's clock
        client.push(LEGACY_MESSAGE)
        self.assertEqual((self.server.handshakes, self.server.processed), (2, 2))

    def test_many_threads_share_one_client(self) -> None:
        client = self.client(pool_size=3)
        errors: List[BaseException] = []

        def send() -> None:
            try:
                for _ in range(25):
                    client.push(LEGACY_MESSAGE)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        self.assertEqual(self.server.processed, 200)
        self.assertLessEqual(self.server.connections, 3)

    @unittest.skipUnless(hasattr(os, "fork"), "needs os.fork")
    def test_a_forked_child_never_uses_the_parents_connection(self) -> None:
        client = self.client()
        client.push(LEGACY_MESSAGE)
        pid = os.fork()
        if pid == 0:  # the child: push, and report through the exit status
            try:
                client.push(LEGACY_MESSAGE)
                os._exit(0)
            except BaseException:  # noqa: BLE001
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(status, 0)
        client.push(LEGACY_MESSAGE)
        self.assertEqual(self.server.processed, 3)
        self.assertEqual(self.server.handshakes, 2)
        self.assertEqual([r.connection for r in self.server.requests], [1, 2, 1])


class ServerClosesConnectionTest(ServerTestCase):
    """Connections the server closed are replaced; a request is never lost or duplicated."""

    def test_idle_close_with_close_notify_is_detected_before_reuse(self) -> None:
        self.server.idle_timeout = 0.02
        client = self.client()
        client.push(LEGACY_MESSAGE)
        self.assertTrue(wait_until(lambda: self.server.open_connections == 0))
        client.push(LEGACY_MESSAGE)
        self.assertEqual((self.server.handshakes, self.server.processed), (2, 2))

    def test_abrupt_close_without_close_notify_is_detected_before_reuse(self) -> None:
        self.server.close_every = 1
        client = self.client()
        for _ in range(3):
            client.push(LEGACY_MESSAGE)
            self.assertTrue(wait_until(lambda: self.server.open_connections == 0))
        self.assertEqual((self.server.handshakes, self.server.processed), (3, 3))

    def test_close_right_after_each_answer_in_a_tight_loop(self) -> None:
        # The server's FIN may race the next request: either way, one processing per push.
        self.server.close_every = 2
        client = self.client()
        for _ in range(20):
            client.push(LEGACY_MESSAGE)
        self.assertEqual(self.server.processed, 20)

    def test_reset_before_read_on_a_reused_connection_is_sent_once_more(self) -> None:
        # What a server closing a connection with the next request unread looks like.
        client = self.client()
        client.push(LEGACY_MESSAGE)
        self.server.inject(RESET_BEFORE_READ)
        self.assertEqual(client.push(LEGACY_MESSAGE).status_code, 200)
        self.assertEqual((self.server.processed, self.server.handshakes), (2, 2))

    def test_eof_on_a_reused_connection_is_sent_once_more(self) -> None:
        # The server's FIN can race the next request on the wire: lose that race on purpose.
        self.server.close_every = 2
        client = self.client()
        client.push(LEGACY_MESSAGE)
        client.push(LEGACY_MESSAGE)  # answered, then the server closes
        self.assertTrue(wait_until(lambda: self.server.open_connections == 0))
        read = andpush._ThreadDriver._read

        def blind_to_idle_links(driver: andpush._ThreadDriver, link: andpush._Link) -> None:
            if not isinstance(link, andpush._H1Link) or link.exchange is not None:
                read(driver, link)

        with unittest.mock.patch.object(andpush._ThreadDriver, "_read", blind_to_idle_links):
            client.push(LEGACY_MESSAGE)
        self.assertEqual((self.server.processed, self.server.handshakes), (3, 2))

    def test_reset_before_read_on_a_new_connection_raises(self) -> None:
        self.server.inject(RESET_BEFORE_READ)
        with self.assertRaises(andpush.NetworkError) as caught:
            self.client().push(LEGACY_MESSAGE)
        # The client cannot know that the server did not process it.
        self.assertTrue(caught.exception.may_have_been_delivered)
        self.assertEqual(self.server.processed, 0)

    def test_reset_after_read_raises_and_is_not_resent(self) -> None:
        self.server.inject(RESET_AFTER_READ)
        client = self.client()
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(LEGACY_MESSAGE)
        self.assertTrue(caught.exception.may_have_been_delivered)
        self.assertEqual(self.server.processed, 1)
        client.push(LEGACY_MESSAGE)
        self.assertEqual(self.server.processed, 2)

    def test_connection_close_header_ends_the_connection(self) -> None:
        self.server.inject(CONNECTION_CLOSE)
        client = self.client()
        client.push(LEGACY_MESSAGE)
        client.push(LEGACY_MESSAGE)
        self.assertEqual((self.server.handshakes, self.server.processed), (2, 2))


class ConnectFailureTest(unittest.TestCase):
    def test_nothing_listening_is_not_delivered(self) -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        client = andpush.new(SERVER_KEY, endpoint="https://127.0.0.1:%d" % port, max_retries=0,
                             ssl_context=client_context())
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(LEGACY_MESSAGE)
        self.assertFalse(caught.exception.may_have_been_delivered)
        self.assertIsInstance(caught.exception, OSError)

    def test_an_untrusted_certificate_is_refused(self) -> None:
        with FakeFCM() as server:
            client = andpush.new(SERVER_KEY, endpoint=server.endpoint, max_retries=0)
            with self.assertRaises(andpush.NetworkError) as caught:
                client.push(LEGACY_MESSAGE)
            self.assertFalse(caught.exception.may_have_been_delivered)
            self.assertIn("CERTIFICATE_VERIFY_FAILED", str(caught.exception))
            self.assertEqual(server.processed, 0)

    def test_a_host_name_mismatch_is_refused(self) -> None:
        with FakeFCM() as server:
            endpoint = server.endpoint.replace("127.0.0.1", "127.0.0.2")
            client = andpush.new(SERVER_KEY, endpoint=endpoint, ssl_context=client_context(),
                                 max_retries=0)
            with self.assertRaises(andpush.NetworkError):
                client.push(LEGACY_MESSAGE)


class TLSOverMemoryTest(unittest.TestCase):
    """The thread driver's TLS socket: raw bytes the kernel does not take at once wait, and
    go out whole and in order, before anything encrypted after them."""

    SEND_BUFFER = 16 * 1024  # bytes: the client's socket buffer, small enough to fill at once
    PAYLOAD = bytes(range(256)) * 2048  # 512 KB: more than the server takes before it reads

    def test_raw_bytes_the_socket_does_not_take_go_out_later_in_order(self) -> None:
        received = bytearray()
        client_blocked = threading.Event()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()

            def serve() -> None:
                raw, _ = listener.accept()
                with andpush._fake_server_context(()).wrap_socket(raw, server_side=True) as conn:
                    client_blocked.wait(_WAIT_LIMIT)
                    for data in iter(lambda: conn.recv(65536), b""):
                        received.extend(data)
            server = threading.Thread(target=serve)
            server.start()
            origin = andpush._Origin("https://127.0.0.1:%d" % listener.getsockname()[1], None)
            sock = andpush._connect(origin, client_context(), _WAIT_LIMIT)
            assert isinstance(sock, andpush._TLSSocket)
            sock.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.SEND_BUFFER)
            sock.setblocking(False)
            out = bytearray(self.PAYLOAD)
            with selectors.DefaultSelector() as selector:
                selector.register(sock, selectors.EVENT_WRITE)
                while out or sock.unsent:
                    try:
                        while out:
                            del out[:sock.send(out[:andpush._WRITE_SIZE])]
                        sock.flush()
                    except BlockingIOError:
                        self.assertTrue(sock.unsent)  # what was taken waits, encrypted
                        client_blocked.set()
                        selector.select(_WAIT_LIMIT)
            sock.close()
            server.join(_WAIT_LIMIT)
        self.assertTrue(client_blocked.is_set())
        self.assertEqual(bytes(received), self.PAYLOAD)


class MalformedAnswerTest(ServerTestCase):
    """Answers that break HTTP raise NetworkError(may_have_been_delivered=True)."""

    def assert_delivered_maybe(self, misbehaviour: str, **options: Any) -> None:
        self.server.inject(misbehaviour)
        client = self.client(**options)
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(LEGACY_MESSAGE)
        self.assertTrue(caught.exception.may_have_been_delivered)
        self.assertEqual(self.server.processed, 1)
        client.push(LEGACY_MESSAGE)  # and the client goes on with a fresh connection
        self.assertEqual((self.server.processed, self.server.handshakes), (2, 2))

    def test_timeout(self) -> None:
        self.server.slow_seconds = 1.0
        self.assert_delivered_maybe(SLOW, timeout=0.05)

    def test_malformed_status_line(self) -> None:
        self.assert_delivered_maybe(MALFORMED_STATUS)

    def test_truncated_body(self) -> None:
        self.assert_delivered_maybe(TRUNCATED_BODY)

    def test_body_over_the_size_cap(self) -> None:
        self.assert_delivered_maybe(HUGE_BODY)

    def test_chunked_body_is_read_and_the_connection_kept(self) -> None:
        self.server.inject(CHUNKED)
        client = self.client()
        self.assertEqual(client.push(LEGACY_MESSAGE).json()["success"], 1)
        client.push(LEGACY_MESSAGE)
        self.assertEqual(self.server.handshakes, 1)

    def test_non_json_success_is_returned_with_its_body(self) -> None:
        self.server.inject(NON_JSON)
        answer = self.client().push(LEGACY_MESSAGE)
        self.assertEqual(answer.body, b"<html>oops</html>")
        with self.assertRaisesRegex(ValueError, "not JSON"):
            answer.json()


class ErrorAnswerTest(ServerTestCase):
    def test_4xx_and_5xx_raise_with_retry_after(self) -> None:
        self.server.inject(
            Reply(503, body=b"busy", headers={"Retry-After": "30"}),
            Reply(401, body=b"<HTML>Unauthorized</HTML>"),
            Reply(500, body=b""),
        )
        client = self.client()
        with self.assertRaises(andpush.UnavailableError) as unavailable:
            client.push(LEGACY_MESSAGE)
        self.assertEqual(unavailable.exception.retry_after, 30.0)
        self.assertEqual(unavailable.exception.response.body, b"busy")
        with self.assertRaises(andpush.ClientError) as unauthorized:
            client.push(LEGACY_MESSAGE)
        self.assertEqual(unauthorized.exception.status_code, 401)
        self.assertIsNone(unauthorized.exception.error_code)
        self.assertIsNone(unauthorized.exception.retry_after)
        with self.assertRaises(andpush.ServerError):
            client.push(LEGACY_MESSAGE)
        self.assertEqual(self.server.processed, 3)
        self.assertEqual(self.server.handshakes, 1)


class LegacyResultsTest(ServerTestCase):
    def test_per_token_errors_and_canonical_ids_are_a_success(self) -> None:
        self.server.unregistered_tokens.add("gone")
        self.server.canonical_tokens["old"] = "new"
        answer = self.client().push({"registration_ids": ["ok", "gone", "old"], "data": {}})
        self.assertEqual(answer.errors, {"gone": "NotRegistered"})
        self.assertEqual(answer.canonical_tokens, {"old": "new"})

    def test_validate_only_is_a_dry_run(self) -> None:
        answer = self.client().push(LEGACY_MESSAGE, validate_only=True)
        self.assertEqual(answer.json()["multicast_id"], -1)
        self.assertIs(self.server.requests[0].json["dry_run"], True)


class SecretsTest(ServerTestCase):
    def test_secrets_stay_out_of_repr_messages_and_logs(self) -> None:
        with self.assertLogs("andpush", "DEBUG") as logs:
            client = self.client()
            texts = [repr(client), repr(client.push(LEGACY_MESSAGE))]
            self.server.inject(Reply(401, body=b"no"), RESET_AFTER_READ)
            for _ in range(2):
                try:
                    client.push(LEGACY_MESSAGE)
                except andpush.Error as exc:
                    texts.append(str(exc))
                    texts.append(repr(exc))
        texts.extend(logs.output)
        for text in texts:
            self.assertNotIn(SERVER_KEY, text)
            self.assertNotIn(TOKEN, text)


class ProxyTest(ServerTestCase):
    def test_connect_tunnel_with_credentials(self) -> None:
        with ConnectProxy() as proxy:
            with self.client(proxy="http://user:secret@127.0.0.1:%d" % proxy.port) as client:
                client.push(LEGACY_MESSAGE)
                client.push(LEGACY_MESSAGE)  # the tunnel is closed before the proxy stops
        self.assertEqual(proxy.targets, ["127.0.0.1:%d" % self.server.port])
        basic = "Basic " + base64.b64encode(b"user:secret").decode()
        self.assertEqual(proxy.authorizations, [basic])
        self.assertEqual(self.server.processed, 2)

    def test_https_proxy_and_no_proxy_from_the_environment(self) -> None:
        with ConnectProxy() as proxy:
            with environment(HTTPS_PROXY="http://127.0.0.1:%d" % proxy.port, NO_PROXY=""):
                with self.client() as client:
                    client.push(LEGACY_MESSAGE)
            with environment(HTTPS_PROXY="http://127.0.0.1:%d" % proxy.port,
                             NO_PROXY="example.com,127.0.0.1"):
                with self.client() as client:
                    client.push(LEGACY_MESSAGE)
        self.assertEqual(len(proxy.targets), 1)
        self.assertEqual(self.server.processed, 2)

    def test_a_refusing_proxy_is_a_network_error_and_its_socket_is_closed(self) -> None:
        with ConnectProxy(status=407) as proxy:
            client = self.client(proxy="http://127.0.0.1:%d" % proxy.port)
            with warnings.catch_warnings(record=True) as caught_warnings:
                warnings.simplefilter("always", ResourceWarning)
                try:  # not assertRaises, which clears the frames: a socket they held would
                    client.push(LEGACY_MESSAGE)  # be freed in another order, and not warn
                except andpush.NetworkError as error:
                    delivered, text = error.may_have_been_delivered, str(error)
                else:
                    self.fail("a push through a proxy that refused the tunnel succeeded")
                client.close()
                gc.collect()
        self.assertFalse(delivered)
        self.assertIn("the proxy 127.0.0.1:%d" % proxy.port, text)
        self.assertEqual([w for w in caught_warnings if w.category is ResourceWarning], [])
        self.assertEqual(self.server.processed, 0)

    def test_a_proxy_that_cannot_be_reached_is_named_in_the_error(self) -> None:
        client = self.client(proxy="http://127.0.0.1:%d" % _closed_port(), max_retries=0)
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(LEGACY_MESSAGE)
        self.assertIn("could not connect to the proxy 127.0.0.1:", str(caught.exception))
        self.assertFalse(caught.exception.may_have_been_delivered)


class ProxyFromEnvironmentTest(unittest.TestCase):
    """Which proxy the environment selects, read as curl and requests read it (no sockets)."""

    HOST = "fcm.googleapis.com"
    CLEAR = {"HTTPS_PROXY": "", "ALL_PROXY": "", "NO_PROXY": ""}

    def selected(self, **variables: str) -> Optional[str]:
        with environment(**dict(self.CLEAR, **variables)):
            return andpush._proxy_from_environment(self.HOST)

    def test_https_proxy_then_all_proxy(self) -> None:
        self.assertIsNone(self.selected())
        self.assertEqual(self.selected(ALL_PROXY="http://all:3128"), "http://all:3128")
        self.assertEqual(self.selected(HTTPS_PROXY="http://https:3128", ALL_PROXY="http://all:1"),
                         "http://https:3128")

    def test_the_lower_case_spelling_wins(self) -> None:
        with environment(**self.CLEAR):
            os.environ.update(all_proxy="http://lower:1", ALL_PROXY="http://upper:2")
            self.assertEqual(andpush._proxy_from_environment(self.HOST), "http://lower:1")

    def test_no_proxy_names_the_host_a_parent_domain_or_everything(self) -> None:
        for no_proxy in ("fcm.googleapis.com", ".googleapis.com", "example.com, googleapis.com",
                         "*"):
            with self.subTest(no_proxy):
                self.assertIsNone(self.selected(ALL_PROXY="http://p:1", NO_PROXY=no_proxy))
        self.assertEqual(self.selected(ALL_PROXY="http://p:1", NO_PROXY="apis.com"), "http://p:1")

    def test_an_unusable_proxy_names_its_variable_and_how_to_go_direct(self) -> None:
        for variable, url in (("HTTPS_PROXY", "https://user:secret@proxy:443"),
                              ("ALL_PROXY", "socks5://user:secret@proxy:1080")):
            with self.subTest(variable):
                with self.assertRaises(ValueError) as caught:
                    self.selected(**{variable: url})
                message = str(caught.exception)
                scheme = url.split(":")[0]
                self.assertIn("%s is a %s:// proxy" % (variable, scheme), message)
                self.assertIn("NO_PROXY", message)
                self.assertIn('proxy=""', message)
                self.assertNotIn("secret", message)

    def test_no_proxy_also_bypasses_an_unusable_proxy(self) -> None:
        self.assertIsNone(self.selected(ALL_PROXY="socks5://proxy:1080", NO_PROXY=self.HOST))

    def test_a_proxy_argument_andpush_cannot_use_says_what_it_must_look_like(self) -> None:
        for url, problem in (("socks5://u:secret@proxy:1080", "is a socks5:// proxy"),
                             ("http://:8080", "has no host")):
            with self.subTest(url):
                with self.assertRaises(ValueError) as caught:
                    andpush._parse_proxy(url)
                message = str(caught.exception)
                self.assertIn("proxy must look like http://[user:pass@]host:port", message)
                self.assertIn(problem, message)
                self.assertNotIn("secret", message)

    def test_host_port_and_credentials_of_a_proxy(self) -> None:
        basic = "Basic " + base64.b64encode(b"us er:p@ss").decode()
        self.assertEqual(andpush._parse_proxy("http://us%20er:p%40ss@proxy.example:3128"),
                         ("proxy.example", 3128, {"Proxy-Authorization": basic}))
        self.assertEqual(andpush._parse_proxy("proxy.example"), ("proxy.example", 8080, {}))


class ConnectProxy:
    """A tiny HTTP CONNECT proxy on 127.0.0.1 that records what it was asked."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.targets: List[str] = []
        self.authorizations: List[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._threads: List[threading.Thread] = []
        self._sockets: List[socket.socket] = []
        self._stopping = threading.Event()

    def __enter__(self) -> "ConnectProxy":
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):  # wakes accept() at once on Linux; else its timeout
            self._listener.shutdown(socket.SHUT_RDWR)
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:  # shut down by __exit__
                return
            conn.settimeout(None)
            self._sockets.append(conn)
            self._spawn(self._tunnel, conn)

    def _tunnel(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            lines = head.decode("latin-1").split("\r\n")
            self.targets.append(lines[0].split()[1])
            for line in lines[1:]:
                if line.lower().startswith("proxy-authorization:"):
                    self.authorizations.append(line.split(":", 1)[1].strip())
            if self.status != 200:
                conn.sendall(b"HTTP/1.1 %d No\r\nContent-Length: 0\r\n\r\n" % self.status)
                return
            host, port = lines[0].split()[1].rsplit(":", 1)
            with socket.create_connection((host, int(port))) as upstream:
                for sock in (conn, upstream):  # relayed at once, as the client and server write
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(upstream)
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                self._spawn(self._pipe, upstream, conn)
                self._pipe(conn, upstream)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """Set environment variables (empty string: remove) for the duration of a block."""
    names = set(variables) | {name.lower() for name in variables}
    saved = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ.pop(name, None)
    for name, value in variables.items():
        if value:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


# Child interpreters ###########################################################################
# The few tests that need a fresh interpreter start it with -S (andpush needs nothing from
# site-packages) and let the children share one bytecode cache in a temporary folder, so that
# only the first child compiles andpush.py, even where PYTHONDONTWRITEBYTECODE is set.

@functools.lru_cache(maxsize=None)
def _child_bytecode_folder() -> "tempfile.TemporaryDirectory[str]":
    """The children's shared bytecode cache (their PYTHONPYCACHEPREFIX), removed when the test
    run ends. It starts with a copy of the bytecode this process loaded the standard library
    from: a child would otherwise compile every module again, since a cache folder replaces
    the __pycache__ folders (40 ms each time for the command line's 60 modules)."""
    folder = tempfile.TemporaryDirectory(prefix="andpush-test-bytecode-")
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        cached = getattr(module, "__cached__", None)
        if source and cached and os.path.isfile(cached):
            # Where the prefix puts it: the source's folder under the prefix, root left out.
            mirror = os.path.join(folder.name, os.path.dirname(os.path.abspath(source))
                                  .lstrip(os.sep), os.path.basename(cached))
            os.makedirs(os.path.dirname(mirror), exist_ok=True)
            shutil.copyfile(cached, mirror)
    return folder


def python_command(*args: str) -> List[str]:
    """The command line of a child interpreter running ``args``."""
    return [sys.executable, "-S", *args]


def child_environment(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) for a child, using the shared bytecode cache."""
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = _child_bytecode_folder().name
    return env


# RS256 signing and private-key parsing ####################################################
# Signatures are checked with pow(signature, e, n), independently of the signing code.

# EMSA-PKCS1-v1_5 for SHA-256 as RFC 8017 9.2 spells it, written out again on purpose.
SHA256_DIGEST_INFO_PREFIX = bytes.fromhex("3031300d060960864801650304020105000420")
RSA_ALGORITHM_IDENTIFIER = bytes.fromhex("300d06092a864886f70d0101010500")
OPENSSL = shutil.which("openssl")


def expected_pkcs1_v15_sha256(message: bytes, k: int) -> int:
    """EM = 00 01 FF..FF 00 DigestInfo(SHA-256(message)), as an integer."""
    t = SHA256_DIGEST_INFO_PREFIX + hashlib.sha256(message).digest()
    return int.from_bytes(b"\x00\x01" + b"\xff" * (k - len(t) - 3) + b"\x00" + t, "big")


def der(tag: int, value: bytes) -> bytes:
    """A minimal DER encoder for building test keys, broken ones included."""
    n = len(value)
    if n < 0x80:
        return bytes([tag, n]) + value
    length = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + value


def der_int(value: int) -> bytes:
    return der(0x02, value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True))


def pkcs1_der(fields: List[int], version: int = 0) -> bytes:
    return der(0x30, b"".join(der_int(x) for x in [version] + fields))


def pkcs8_der(pkcs1: bytes, algorithm: bytes = RSA_ALGORITHM_IDENTIFIER, version: int = 0) -> bytes:
    return der(0x30, der_int(version) + algorithm + der(0x04, pkcs1))


def pem(label: str, data: bytes) -> str:
    body = "\n".join(textwrap.wrap(base64.b64encode(data).decode("ascii"), 64))
    return f"-----BEGIN {label}-----\n{body}\n-----END {label}-----\n"


def key_fields(key: _RSAPrivateKey) -> List[int]:
    return [key.n, key.e, key.d, key.p, key.q, key.dp, key.dq, key.qinv]


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def run_openssl(*args: str) -> bytes:
    assert OPENSSL is not None
    return subprocess.run([OPENSSL, *args], check=True, capture_output=True).stdout


class PrivateKeyParsingTest(unittest.TestCase):
    def test_pkcs8_key(self) -> None:
        for pem, bits in ((TEST_RSA_KEY_PKCS8_PEM, 1024), (andpush._FAKE_ACCOUNT_KEY_PEM, 2048)):
            with self.subTest(bits=bits):
                key = _parse_private_key(pem)
                self.assertEqual(key.n.bit_length(), bits)
                self.assertEqual(key.size, bits // 8)
                self.assertEqual(key.e, 65537)
                self.assertEqual(key.p * key.q, key.n)

    def test_pkcs1_and_pkcs8_forms_give_the_same_numbers(self) -> None:
        pkcs8 = _parse_private_key(TEST_RSA_KEY_PKCS8_PEM)
        pkcs1 = _parse_private_key(TEST_RSA_KEY_PKCS1_PEM)
        self.assertEqual(key_fields(pkcs8), key_fields(pkcs1))
        self.assertEqual(pkcs8.size, pkcs1.size)

    def test_numbers_re_encode_to_the_openssl_files(self) -> None:
        # Checks every parsed number, and that the broken keys below are built realistically.
        fields = key_fields(_parse_private_key(TEST_RSA_KEY_PKCS8_PEM))
        self.assertEqual(pem("RSA PRIVATE KEY", pkcs1_der(fields)), TEST_RSA_KEY_PKCS1_PEM)
        self.assertEqual(pem("PRIVATE KEY", pkcs8_der(pkcs1_der(fields))), TEST_RSA_KEY_PKCS8_PEM)

    @unittest.skipUnless(OPENSSL, "openssl not found on PATH; cannot cross-check the modulus")
    def test_modulus_matches_openssl(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "key.pem")
            with open(path, "w") as f:
                f.write(TEST_RSA_KEY_PKCS8_PEM)
            out = run_openssl("rsa", "-in", path, "-noout", "-modulus").decode("ascii")
        self.assertEqual(
            int(out.strip().split("=", 1)[1], 16), _parse_private_key(TEST_RSA_KEY_PKCS8_PEM).n
        )

    def test_tolerates_crlf_whitespace_and_line_width(self) -> None:
        expected = key_fields(_parse_private_key(TEST_RSA_KEY_PKCS8_PEM))
        body = "".join(TEST_RSA_KEY_PKCS8_PEM.splitlines()[1:-1])
        variants = [
            TEST_RSA_KEY_PKCS8_PEM.replace("\n", "\r\n"),
            "\n\n  " + TEST_RSA_KEY_PKCS8_PEM + "  \n\t",
            TEST_RSA_KEY_PKCS8_PEM.rstrip("\n"),
            "\n".join("    " + line for line in TEST_RSA_KEY_PKCS8_PEM.splitlines()),
            f"-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----",
            TEST_RSA_KEY_PKCS1_PEM.replace("\n", "\r\n"),
        ]
        for variant in variants:
            with self.subTest(variant=variant[:40]):
                self.assertEqual(key_fields(_parse_private_key(variant)), expected)

    def test_text_outside_the_block_is_skipped_as_rfc_7468_allows(self) -> None:
        expected = key_fields(_parse_private_key(TEST_RSA_KEY_PKCS8_PEM))
        variants = [
            "Bag Attributes\n    friendlyName: fcm\nKey Attributes: <No Attributes>\n"
            + TEST_RSA_KEY_PKCS8_PEM,
            TEST_RSA_KEY_PKCS8_PEM + "Comment: issued for andpush tests\n",
            "before\n" + TEST_RSA_KEY_PKCS1_PEM + "\nafter\n",
        ]
        for variant in variants:
            with self.subTest(variant=variant[:30]):
                self.assertEqual(key_fields(_parse_private_key(variant)), expected)

    def test_a_second_block_is_refused_even_after_text(self) -> None:
        for two in [TEST_RSA_KEY_PKCS8_PEM + "text\n" + TEST_RSA_KEY_PKCS8_PEM,
                    "intro\n" + TEST_RSA_KEY_PKCS1_PEM + TEST_EC_KEY_PKCS8_PEM]:
            with self.subTest(two=two[:10]):
                with self.assertRaisesRegex(ValueError, "more than one PEM block"):
                    _parse_private_key(two)

    def test_accepts_optional_pkcs8_forms(self) -> None:
        key = _parse_private_key(TEST_RSA_KEY_PKCS8_PEM)
        pkcs1 = pkcs1_der(key_fields(key))
        no_params = der(0x30, der(0x06, bytes.fromhex("2a864886f70d010101")))
        with_attributes = der(
            0x30, der_int(1) + RSA_ALGORITHM_IDENTIFIER + der(0x04, pkcs1) + der(0xA0, b"")
        )
        for data in [pkcs8_der(pkcs1, algorithm=no_params), with_attributes]:
            with self.subTest(data=data[:8].hex()):
                self.assertEqual(
                    key_fields(_parse_private_key(pem("PRIVATE KEY", data))), key_fields(key)
                )

    def test_non_string_is_a_type_error(self) -> None:
        with self.assertRaisesRegex(TypeError, "private_key must be a PEM string, not bytes"):
            _parse_private_key(TEST_RSA_KEY_PKCS8_PEM.encode())  # type: ignore[arg-type]

    def test_repr_hides_key_material(self) -> None:
        key = _parse_private_key(TEST_RSA_KEY_PKCS8_PEM)
        self.assertEqual(repr(key), "<RSA private key, 1024 bits>")
        self.assertEqual(str(key), "<RSA private key, 1024 bits>")
        self.assertFalse(hasattr(key, "__dict__"))
        for number in key_fields(key):
            if number > 65537:
                self.assertNotIn(str(number)[:12], repr(key))
                self.assertNotIn(format(number, "x")[:12], repr(key))

    def broken_inputs(self) -> List[Tuple[str, str, str]]:
        fields = key_fields(_parse_private_key(TEST_RSA_KEY_PKCS8_PEM))
        n, e, d, p, q, dp, dq, qinv = fields
        good = pkcs8_der(pkcs1_der(fields))
        lines = TEST_RSA_KEY_PKCS8_PEM.splitlines()
        body = "\n".join(lines[1:-1])
        # A consistent but far too small key, from the Mersenne primes 2^127-1 and 2^89-1.
        tp, tq = 2**127 - 1, 2**89 - 1
        td = pow(65537, -1, (tp - 1) * (tq - 1))
        tiny = [tp * tq, 65537, td, tp, tq, td % (tp - 1), td % (tq - 1), pow(tq, -1, tp)]
        non_null_params = bytes.fromhex("300f06092a864886f70d0101010402abcd")
        return [
            # (what, input, fragment of the expected message)
            ("empty string", "", "not a PEM private key"),
            ("not PEM", "hello", "not a PEM private key"),
            ("raw base64 without armor", body, "not a PEM private key"),
            ("literal backslash-n", TEST_RSA_KEY_PKCS8_PEM.replace("\n", "\\n"), "literal '\\n'"),
            (
                "encrypted PKCS#8",
                TEST_RSA_KEY_PKCS8_PEM.replace("PRIVATE KEY", "ENCRYPTED PRIVATE KEY"),
                "encrypted PKCS#8 key; export the service account key unencrypted",
            ),
            (
                "encrypted PKCS#1",
                TEST_RSA_KEY_PKCS1_PEM.replace(
                    "KEY-----\n",
                    "KEY-----\nProc-Type: 4,ENCRYPTED\n"
                    "DEK-Info: AES-128-CBC,00112233445566778899AABBCCDDEEFF\n\n",
                    1,
                ),
                "encrypted PEM key",
            ),
            (
                "EC PEM label",
                f"-----BEGIN EC PRIVATE KEY-----\n{body}\n-----END EC PRIVATE KEY-----",
                "is an EC key",
            ),
            ("EC PKCS#8 key", TEST_EC_KEY_PKCS8_PEM, "is an EC key"),
            ("Ed25519 PKCS#8 key", TEST_ED25519_KEY_PKCS8_PEM, "is an Ed25519 key"),
            ("public key", TEST_RSA_KEY_PKCS8_PEM.replace("PRIVATE", "PUBLIC"), "is a public key"),
            (
                "certificate",
                TEST_RSA_KEY_PKCS8_PEM.replace("PRIVATE KEY", "CERTIFICATE"),
                "is a certificate",
            ),
            (
                "unknown label",
                TEST_RSA_KEY_PKCS8_PEM.replace("PRIVATE KEY", "DSA PRIVATE KEY"),
                "unsupported PEM type 'DSA PRIVATE KEY'",
            ),
            ("missing END line", "\n".join(lines[:-1]), "no '-----END PRIVATE KEY-----' line"),
            (
                "mismatched END line",
                TEST_RSA_KEY_PKCS8_PEM.replace("END PRIVATE", "END RSA PRIVATE"),
                "no '-----END PRIVATE KEY-----' line",
            ),
            (
                "two PEM blocks",
                TEST_RSA_KEY_PKCS8_PEM + TEST_EC_KEY_PKCS8_PEM,
                "more than one PEM block",
            ),
            (
                "bad base64 character",
                TEST_RSA_KEY_PKCS8_PEM.replace("M", "!", 2),
                "not valid base64",
            ),
            (
                "bad base64 length",
                "\n".join([lines[0], lines[1][:-1], lines[-1]]),
                "not valid base64",
            ),
            ("truncated PEM body", "\n".join(lines[:5] + lines[-1:]), "truncated"),
            ("truncated DER", pem("PRIVATE KEY", good[:-10]), "truncated"),
            (
                "trailing garbage",
                pem("PRIVATE KEY", good + b"\x00\x00"),
                "2 bytes of trailing data",
            ),
            ("not a SEQUENCE", pem("PRIVATE KEY", der_int(5)), "not a DER SEQUENCE"),
            (
                "indefinite length",
                pem("PRIVATE KEY", b"\x30\x80" + good[4:] + b"\x00\x00"),
                "unsupported DER length encoding",
            ),
            (
                "4-byte length",
                pem("PRIVATE KEY", b"\x30\x84\x00\x00" + good[2:]),
                "unsupported DER length encoding",
            ),
            (
                "PKCS#8 version 2",
                pem("PRIVATE KEY", pkcs8_der(pkcs1_der(fields), version=2)),
                "unsupported PrivateKeyInfo version",
            ),
            (
                "PKCS#8 rsaEncryption with parameters",
                pem("PRIVATE KEY", pkcs8_der(pkcs1_der(fields), algorithm=non_null_params)),
                "unexpected rsaEncryption parameters",
            ),
            ("PKCS#8 missing fields", pem("PRIVATE KEY", der(0x30, der_int(0))), "missing fields"),
            (
                "PKCS#1 multi-prime version",
                pem("RSA PRIVATE KEY", pkcs1_der(fields, version=1)),
                "multi-prime keys are unsupported",
            ),
            (
                "PKCS#1 missing qInv",
                pem("RSA PRIVATE KEY", pkcs1_der(fields[:-1])),
                "8 fields instead of 9",
            ),
            ("PKCS#1 under PKCS#8 label", pem("PRIVATE KEY", pkcs1_der(fields)), "not a SEQUENCE"),
            (
                "negative INTEGER",
                pem("RSA PRIVATE KEY", pkcs1_der([-n] + fields[1:])),
                "negative INTEGER",
            ),
            (
                "p*q != n",
                pem("RSA PRIVATE KEY", pkcs1_der([n, e, d, p + 2, q, dp, dq, qinv])),
                "p*q != n",
            ),
            (
                "wrong dP",
                pem("RSA PRIVATE KEY", pkcs1_der([n, e, d, p, q, dp + 1, dq, qinv])),
                "CRT exponents do not match d",
            ),
            (
                "wrong e",
                pem("RSA PRIVATE KEY", pkcs1_der([n, 3, d, p, q, dp, dq, qinv])),
                "private exponent does not match e",
            ),
            (
                "wrong qInv",
                pem("RSA PRIVATE KEY", pkcs1_der([n, e, d, p, q, dp, dq, qinv + 1])),
                "CRT coefficient",
            ),
            (
                "even e",
                pem("RSA PRIVATE KEY", pkcs1_der([n, 65536, d, p, q, dp, dq, qinv])),
                "exponent out of range",
            ),
            (
                "216-bit key",
                pem("RSA PRIVATE KEY", pkcs1_der(tiny)),
                "216-bit RSA key, but at least 1024",
            ),
        ]

    def test_broken_inputs_raise_helpful_value_errors(self) -> None:
        key = _parse_private_key(TEST_RSA_KEY_PKCS8_PEM)
        numbers = [x for x in key_fields(key) if x != key.e]
        secrets = [str(x)[:12] for x in numbers] + [format(x, "x")[:12] for x in numbers]
        for what, broken, fragment in self.broken_inputs():
            with self.subTest(what):
                with self.assertRaises(ValueError) as caught:
                    _parse_private_key(broken)
                message = str(caught.exception)
                self.assertIn(fragment, message)
                self.assertTrue(message.startswith("private_key "), message)
                # No key material: no long base64 runs and no prefix of any key number.
                self.assertIsNone(re.search(r"[A-Za-z0-9+/=]{20,}", message), message)
                for secret in secrets:
                    self.assertNotIn(secret, message)


class DERReaderTest(unittest.TestCase):
    def test_short_and_long_form_lengths(self) -> None:
        for size, header in [
            (0, "0400"),
            (127, "047f"),
            (128, "048180"),
            (255, "0481ff"),
            (256, "04820100"),
            (65535, "0482ffff"),
            (65536, "0483010000"),
        ]:
            with self.subTest(size=size):
                data = b"\xaa" + bytes.fromhex(header) + b"\x07" * size + b"\xbb"
                self.assertEqual(_der_read(data, 1), (0x04, b"\x07" * size, len(data) - 1))

    def test_truncated_elements(self) -> None:
        for data in [b"", b"\x30", b"\x04\x05abcd", b"\x04\x82\x01", b"\x04\x81\x80" + b"x" * 127]:
            with self.subTest(data=data[:8]), self.assertRaisesRegex(ValueError, "truncated"):
                _der_read(data, 0)


class RS256SigningTest(unittest.TestCase):
    """Signatures with the suite's 1024-bit key and the fake's 2048-bit one, the size Google
    issues."""

    MESSAGES = (b"", b"abc", b"eyJhbGciOiJSUzI1NiJ9.e30", bytes(range(256)) * 100)
    PEMS = (TEST_RSA_KEY_PKCS8_PEM, andpush._FAKE_ACCOUNT_KEY_PEM)

    def setUp(self) -> None:
        self.keys = [_parse_private_key(pem) for pem in self.PEMS]
        self.key = self.keys[0]  # the suite's

    def test_b64url(self) -> None:
        self.assertEqual(_b64url(b""), "")
        self.assertEqual(_b64url(b"\xfb\xff\xfe"), "-__-")
        self.assertEqual(_b64url(b"\xfb\xff"), "-_8")
        self.assertEqual(_b64url(b"a"), "YQ")

    def test_signature_verifies_with_the_public_key(self) -> None:
        for key in self.keys:
            for message in self.MESSAGES:
                with self.subTest(bits=key.size * 8, length=len(message)):
                    signature = _rs256_sign(key, message)
                    self.assertEqual(len(signature), key.size)
                    recovered = pow(int.from_bytes(signature, "big"), key.e, key.n)
                    self.assertEqual(recovered, expected_pkcs1_v15_sha256(message, key.size))

    def test_pkcs1_key_signs_identically(self) -> None:
        pkcs1 = _parse_private_key(TEST_RSA_KEY_PKCS1_PEM)
        self.assertEqual(_rs256_sign(pkcs1, b"abc"), _rs256_sign(self.key, b"abc"))

    def test_signature_does_not_verify_for_another_message(self) -> None:
        for key in self.keys:
            signature = int.from_bytes(_rs256_sign(key, b"abc"), "big")
            self.assertNotEqual(
                pow(signature, key.e, key.n), expected_pkcs1_v15_sha256(b"abd", key.size))

    @unittest.skipUnless(
        OPENSSL, "openssl not found on PATH; skipping cross-check with `openssl dgst`"
    )
    def test_matches_openssl_dgst(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            key_path = os.path.join(tmp, "key.pem")
            message_path = os.path.join(tmp, "message.bin")
            for pem, key in zip(self.PEMS, self.keys):
                with open(key_path, "w") as f:
                    f.write(pem)
                for message in self.MESSAGES:
                    with self.subTest(bits=key.size * 8, length=len(message)):
                        with open(message_path, "wb") as f:
                            f.write(message)
                        expected = run_openssl("dgst", "-sha256", "-sign", key_path,
                                               message_path)
                        self.assertEqual(_rs256_sign(key, message), expected)

    def test_jwt(self) -> None:
        header = {"alg": "RS256", "typ": "JWT", "kid": "0123456789abcdef"}
        claims = {
            "iss": "andpush@example.iam.gserviceaccount.com",
            "scope": "https://www.googleapis.com/auth/firebase.messaging",
            "aud": "https://oauth2.googleapis.com/token",
            "iat": 1700000000,
            "exp": 1700003600,
            "note": "caf\u00e9 \u2603",
        }
        key = self.keys[1]  # Google's size
        token = _jwt(header, claims, key)
        self.assertRegex(token, r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$")
        encoded_header, encoded_claims, encoded_signature = token.split(".")
        decoded_header = json.loads(b64url_decode(encoded_header))
        self.assertEqual(decoded_header["alg"], "RS256")
        self.assertEqual(decoded_header["typ"], "JWT")
        self.assertEqual(decoded_header["kid"], "0123456789abcdef")
        self.assertEqual(json.loads(b64url_decode(encoded_claims)), claims)
        compact = json.dumps(header, separators=(",", ":")).encode("ascii")
        self.assertEqual(b64url_decode(encoded_header), compact)
        signature = b64url_decode(encoded_signature)
        self.assertEqual(len(signature), 256)
        signing_input = f"{encoded_header}.{encoded_claims}".encode("ascii")
        recovered = pow(int.from_bytes(signature, "big"), key.e, key.n)
        self.assertEqual(recovered, expected_pkcs1_v15_sha256(signing_input, 256))


# HPACK ######################################################################################
# RFC 7541 Appendix C verbatim, bad blocks, the decoder's cache, the encoder.

Fields = List[Tuple[str, str]]


def random_latin1(rng: random.Random, length: int) -> str:
    """length characters of U+0000 to U+00FF, each as likely, drawn in one call."""
    return rng.getrandbits(8 * length).to_bytes(length, "big").decode("latin-1") if length else ""


def huffman_encode(data: bytes) -> bytes:
    """``data`` Huffman-coded with RFC 7541's code, padded with ones: the tests' own encoder."""
    bits = count = 0
    for octet in data:
        code, length = _HUFFMAN_CODE[octet]
        bits = bits << length | code
        count += length
    padding = -count % 8
    return (bits << padding | (1 << padding) - 1).to_bytes((count + padding) // 8, "big")



class HPACKIntegerTest(unittest.TestCase):
    """RFC 7541 C.1, both ways, plus the limits."""

    EXAMPLES = [                         # (value, prefix bits, encoding)
        (10, 5, "0a"),                   # C.1.1
        (1337, 5, "1f9a0a"),             # C.1.2
        (42, 8, "2a"),                   # C.1.3
        (0, 7, "00"), (126, 7, "7e"), (127, 7, "7f00"), (128, 7, "7f01"),
        (15 + 2 ** 28 - 1, 4, "0fffffff7f"),
    ]

    def test_examples(self) -> None:
        for value, prefix_bits, encoding in self.EXAMPLES:
            with self.subTest(value=value, prefix_bits=prefix_bits):
                data = bytes.fromhex(encoding)
                self.assertEqual(_hpack_encode_int(value, prefix_bits, 0), data)
                self.assertEqual(_hpack_decode_int(data + b"\x99", 0, prefix_bits),
                                 (value, len(data)))

    def test_flags_and_prefix_bits_outside_the_prefix(self) -> None:
        self.assertEqual(_hpack_encode_int(1337, 5, 0xE0), bytes.fromhex("ff9a0a"))
        self.assertEqual(_hpack_decode_int(bytes.fromhex("ff9a0a"), 0, 5), (1337, 3))
        self.assertEqual(_hpack_decode_int(bytes.fromhex("eaea"), 1, 5), (10, 2))

    def test_truncated_or_absurdly_long(self) -> None:
        for data in ["", "1f", "1f9a", "1f" + "80" * 4 + "01", "1f" + "ff" * 100]:
            with self.subTest(data=data), self.assertRaises(_HPACKError):
                _hpack_decode_int(bytes.fromhex(data), 0, 5)


class HPACKFieldExamplesTest(unittest.TestCase):
    """RFC 7541 C.2: one field per block, with the dynamic table after it."""

    EXAMPLES = [                         # (block, fields, table after, its size)
        ("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572",   # C.2.1
         [("custom-key", "custom-header")], [("custom-key", "custom-header")], 55),
        ("040c 2f73 616d 706c 652f 7061 7468",                                 # C.2.2
         [(":path", "/sample/path")], [], 0),
        ("1008 7061 7373 776f 7264 0673 6563 7265 74",                         # C.2.3
         [("password", "secret")], [], 0),
        ("82", [(":method", "GET")], [], 0),                                   # C.2.4
    ]

    def test_examples(self) -> None:
        for block, fields, table, size in self.EXAMPLES:
            with self.subTest(block=block):
                decoder = _HPACKDecoder(4096)
                self.assertEqual(decoder.decode(bytes.fromhex(block)), tuple(fields))
                self.assertEqual(decoder.entries, table)
                self.assertEqual(decoder.size, size)


C3_FIELDS: List[Fields] = [
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")],
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"),
     ("cache-control", "no-cache")],
    [(":method", "GET"), (":scheme", "https"), (":path", "/index.html"),
     (":authority", "www.example.com"), ("custom-key", "custom-value")],
]
C3_TABLES: List[Tuple[Fields, int]] = [
    ([(":authority", "www.example.com")], 57),
    ([("cache-control", "no-cache"), (":authority", "www.example.com")], 110),
    ([("custom-key", "custom-value"), ("cache-control", "no-cache"),
      (":authority", "www.example.com")], 164),
]
C5_FIELDS: List[Fields] = [
    [(":status", "302"), ("cache-control", "private"),
     ("date", "Mon, 21 Oct 2013 20:13:21 GMT"), ("location", "https://www.example.com")],
    [(":status", "307"), ("cache-control", "private"),
     ("date", "Mon, 21 Oct 2013 20:13:21 GMT"), ("location", "https://www.example.com")],
    [(":status", "200"), ("cache-control", "private"),
     ("date", "Mon, 21 Oct 2013 20:13:22 GMT"), ("location", "https://www.example.com"),
     ("content-encoding", "gzip"),
     ("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1")],
]
C5_TABLES: List[Tuple[Fields, int]] = [
    ([("location", "https://www.example.com"), ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
      ("cache-control", "private"), (":status", "302")], 222),
    ([(":status", "307"), ("location", "https://www.example.com"),
      ("date", "Mon, 21 Oct 2013 20:13:21 GMT"), ("cache-control", "private")], 222),
    ([("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"),
      ("content-encoding", "gzip"), ("date", "Mon, 21 Oct 2013 20:13:22 GMT")], 215),
]


class HPACKSequenceExamplesTest(unittest.TestCase):
    """RFC 7541 C.3 to C.6: blocks in sequence on one decoder, the dynamic table after each."""

    def check(self, max_table_size: int, blocks: List[str], fields: List[Fields],
              tables: List[Tuple[Fields, int]]) -> None:
        decoder = _HPACKDecoder(max_table_size)
        for number, (block, expected, (table, size)) in enumerate(zip(blocks, fields, tables)):
            with self.subTest(block=number + 1):
                self.assertEqual(decoder.decode(bytes.fromhex(block)), tuple(expected))
                self.assertEqual(decoder.entries, table)
                self.assertEqual(decoder.size, size)
                self.assertEqual(decoder.size, sum(len(n) + len(v) + 32 for n, v in table))

    def test_c3_requests_without_huffman(self) -> None:
        self.check(4096, [
            "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
            "8286 84be 5808 6e6f 2d63 6163 6865",
            "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
        ], C3_FIELDS, C3_TABLES)

    def test_c4_requests_with_huffman(self) -> None:
        self.check(4096, [
            "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
            "8286 84be 5886 a8eb 1064 9cbf",
            "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
        ], C3_FIELDS, C3_TABLES)

    def test_c5_responses_without_huffman(self) -> None:
        self.check(256, [
            "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230"
            " 3133 2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65"
            " 7861 6d70 6c65 2e63 6f6d",
            "4803 3330 37c1 c0bf",
            "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220"
            " 474d 54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157"
            " 454f 5049 5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076"
            " 6572 7369 6f6e 3d31",
        ], C5_FIELDS, C5_TABLES)

    def test_c6_responses_with_huffman(self) -> None:
        self.check(256, [
            "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0"
            " 82a6 2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
            "4883 640e ffc1 c0bf",
            "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b"
            " d9ab 77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27"
            " 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
        ], C5_FIELDS, C5_TABLES)


class HuffmanTest(unittest.TestCase):
    """The code as transcribed, and decoding with the checks of RFC 7541 5.2."""

    def test_code_is_canonical_and_complete(self) -> None:
        # Appendix B's code is canonical: ordered by (length, symbol), each code is the one
        # before plus one, shifted to its length; a typo in the table would break this.
        order = sorted(range(257), key=lambda symbol: (_HUFFMAN_CODE[symbol][1], symbol))
        code, length = _HUFFMAN_CODE[order[0]]
        self.assertEqual((code, length), (0, 5))
        for symbol in order[1:]:
            code = (code + 1) << (_HUFFMAN_CODE[symbol][1] - length)
            length = _HUFFMAN_CODE[symbol][1]
            self.assertEqual(_HUFFMAN_CODE[symbol], (code, length), symbol)
        self.assertEqual(sum(2 ** (30 - length) for _, length in _HUFFMAN_CODE), 2 ** 30)
        self.assertEqual(_HUFFMAN_CODE[256], (2 ** 30 - 1, 30))

    def test_rfc_strings(self) -> None:
        for text, coded in [
            (b"www.example.com", "f1e3c2e5f23a6ba0ab90f4ff"),
            (b"no-cache", "a8eb10649cbf"),
            (b"custom-key", "25a849e95ba97d7f"),
            (b"custom-value", "25a849e95bb8e8b4bf"),
            (b"302", "6402"), (b"private", "aec3771a4b"),
            (b"https://www.example.com", "9d29ad171863c78f0b97c8e9ae82ae43d3"),
            (b"", ""),
        ]:
            with self.subTest(text=text):
                self.assertEqual(_huffman_decode(bytes.fromhex(coded)), text)
                self.assertEqual(huffman_encode(text), bytes.fromhex(coded))

    def test_every_octet_round_trips(self) -> None:
        for octet in range(256):
            for text in [bytes([octet]), bytes([octet]) * 3, b"a" + bytes([octet]) + b"zz"]:
                with self.subTest(text=text):
                    self.assertEqual(_huffman_decode(huffman_encode(text)), text)
        everything = bytes(range(256)) * 2
        self.assertEqual(_huffman_decode(huffman_encode(everything)), everything)

    def test_forgetting_steps_when_full(self) -> None:
        everything = bytes(range(256))
        with unittest.mock.patch.object(andpush, "_HUFFMAN_MAX_STEPS", 50):
            andpush._HUFFMAN_STEPS.clear()
            for _ in range(3):
                self.assertEqual(_huffman_decode(huffman_encode(everything)), everything)
                self.assertLessEqual(len(andpush._HUFFMAN_STEPS), 50)

    def test_malformed(self) -> None:
        for coded, error in [
            ("ff", "padding"),                   # 8 bits of padding
            ("1fff", "padding"),                 # 'a', then 11 bits of padding
            ("18", "padding"),                   # 'a', padded with 000
            ("1e", "padding"),                   # 'a', padded with 110
            ("ffffffff", "EOS"),                 # EOS, then 2 bits of padding
            ("1fffffffff", "EOS"),               # 'a', then EOS
            ("fffffffc", "EOS"),                 # EOS, then '0' cut short
        ]:
            with self.subTest(coded=coded), self.assertRaisesRegex(_HPACKError, error):
                _huffman_decode(bytes.fromhex(coded))


class HPACKDecoderErrorTest(unittest.TestCase):
    """Blocks that break HPACK raise _HPACKError, and nothing else."""

    CASES = [                            # (max table size, block, what the error says)
        (4096, "80", "index 0 "),                                   # indexed field 0
        (4096, "be", "index 62 "),                                  # empty dynamic table
        (4096, "ff80ff03", "index 65535 "),
        (4096, "0f2f0161", "index 62 "),                            # literal naming it
        (4096, "40", "ends before an integer"),                     # no name
        (4096, "0003616263", "ends before an integer"),             # a name, no value
        (4096, "000a6162", "ends inside a string"),                 # name cut short
        (4096, "04056162", "ends inside a string"),                 # value cut short
        (4096, "04ff", "ends inside an integer"),                   # value length cut short
        (4096, "ff" + "80" * 5 + "01", "longer than 5 octets"),
        (0, "21", "update to 1 exceeds the 0 we allow"),
        (4096, "3fe21f", "update to 4097 exceeds the 4096 we allow"),
        (4096, "823f", "size update after a header field"),
        (4096, "8220", "size update after a header field"),
        (4096, "0484ffffffff", "contains EOS"),                     # Huffman-coded value
        (4096, "048118", "padding"),                                # 'a', padded with 000
        (4096, "04821fff", "padding"),                              # 'a', 11 bits of padding
    ]

    def test_malformed_blocks(self) -> None:
        for max_table_size, block, error in self.CASES:
            with self.subTest(block=block), self.assertRaisesRegex(_HPACKError, error):
                _HPACKDecoder(max_table_size).decode(bytes.fromhex(block))

    def test_size_updates_at_the_start_are_allowed(self) -> None:
        decoder = _HPACKDecoder(4096)
        decoder.decode(bytes.fromhex("4003616263036465664003676869036a6b6c"))
        self.assertEqual(decoder.size, 76)
        # Two updates at the start (down, then up again) are legal; the first evicts all.
        self.assertEqual(decoder.decode(bytes.fromhex("203fe11f82")), ((":method", "GET"),))
        self.assertEqual((decoder.entries, decoder.size, decoder.capacity), ([], 0, 4096))

    def test_size_update_evicts_the_oldest(self) -> None:
        decoder = _HPACKDecoder(4096)
        decoder.decode(bytes.fromhex("4003616263036465664003676869036a6b6c"))
        decoder.decode(bytes.fromhex("3f0b"))                   # 31 + 11 = 42 octets
        self.assertEqual((decoder.entries, decoder.size), ([("ghi", "jkl")], 38))
        self.assertEqual(decoder.decode(bytes.fromhex("be")), (("ghi", "jkl"),))
        with self.assertRaises(_HPACKError):
            decoder.decode(bytes.fromhex("bf"))

    def test_entry_larger_than_the_table_empties_it(self) -> None:
        decoder = _HPACKDecoder(40)
        decoder.decode(bytes.fromhex("4001610162"))             # 34 octets: fits
        self.assertEqual(decoder.size, 34)
        fields = decoder.decode(bytes.fromhex("4001610463636363"))  # 37 octets: evicts first
        self.assertEqual(fields, (("a", "cccc"),))
        self.assertEqual((decoder.entries, decoder.size), ([("a", "cccc")], 37))
        fields = decoder.decode(bytes.fromhex("400161086464646464646464"))  # 41 > 40
        self.assertEqual(fields, (("a", "dddddddd"),))
        self.assertEqual((decoder.entries, decoder.size), ([], 0))

    def test_a_zero_table_still_takes_incremental_indexing(self) -> None:
        decoder = _HPACKDecoder(0)
        fields = decoder.decode(bytes.fromhex("20" "5f" "10" "6170706c69636174696f6e2f6a736f6e"))
        self.assertEqual(fields, (("content-type", "application/json"),))
        self.assertEqual((decoder.entries, decoder.size), ([], 0))

    def test_empty_block(self) -> None:
        self.assertEqual(_HPACKDecoder(0).decode(b""), ())

    def test_latin_1_values(self) -> None:
        fields = _HPACKDecoder(0).decode(bytes.fromhex("0f1002e9ff"))
        self.assertEqual(fields, (("content-type", "\u00e9\u00ff"),))


class HPACKCacheTest(unittest.TestCase):
    """Blocks that leave the dynamic table alone are remembered; others never are."""

    STATELESS = bytes.fromhex("88" "0f10" "10" "6170706c69636174696f6e2f6a736f6e"
                              "1003616263" "0161")   # static, name-indexed, never indexed

    def test_stateless_block_is_remembered_and_immutable(self) -> None:
        decoder = _HPACKDecoder(0)
        first = decoder.decode(self.STATELESS)
        self.assertEqual(first, ((":status", "200"), ("content-type", "application/json"),
                                 ("abc", "a")))
        self.assertIsInstance(first, tuple)
        self.assertIn(self.STATELESS, decoder._cache)
        self.assertIs(decoder.decode(bytes(bytearray(self.STATELESS))), first)
        self.assertEqual(len(decoder._cache), 1)

    def test_blocks_that_change_the_table_are_not_remembered(self) -> None:
        decoder = _HPACKDecoder(4096)
        block = bytes.fromhex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d")   # C.3.1
        decoder.decode(block)
        decoder.decode(block)
        self.assertEqual(decoder.entries, [(":authority", "www.example.com")] * 2)
        self.assertEqual(decoder.size, 114)
        decoder.decode(bytes.fromhex("3f1b"))                   # size update alone
        self.assertEqual(decoder._cache, {})

    def test_blocks_that_read_the_table_are_not_remembered(self) -> None:
        decoder = _HPACKDecoder(4096)
        decoder.decode(bytes.fromhex("4003616263036465664003676869036a6b6c"))
        indexed, named = bytes.fromhex("be"), bytes.fromhex("0f2f0178")
        self.assertEqual(decoder.decode(indexed), (("ghi", "jkl"),))
        self.assertEqual(decoder.decode(named), (("ghi", "x"),))
        decoder.decode(bytes.fromhex("4003787878027979"))   # now ("xxx", "yy") is index 62
        self.assertEqual(decoder.decode(indexed), (("xxx", "yy"),))
        self.assertEqual(decoder.decode(named), (("xxx", "x"),))
        decoder.decode(bytes.fromhex("20"))                     # empty the table
        for block in [indexed, named]:
            with self.assertRaises(_HPACKError):
                decoder.decode(block)
        self.assertEqual(decoder._cache, {})

    def test_incremental_indexing_into_a_table_of_size_0_is_remembered(self) -> None:
        # What h2-based servers send even after we advertise HEADER_TABLE_SIZE 0.
        decoder = _HPACKDecoder(4096)
        decoder.decode(bytes.fromhex("20"))                         # the table goes to 0
        block = bytes.fromhex("88" "4003616263016b")                # abc: k, indexed
        self.assertEqual(decoder.decode(block), ((":status", "200"), ("abc", "k")))
        self.assertIn(block, decoder._cache)
        self.assertEqual((decoder.entries, decoder.size), ([], 0))
        decoder.decode(bytes.fromhex("3fe11f"))                     # back to 4096
        self.assertEqual(decoder._cache, {})
        decoder.decode(block)
        self.assertEqual(decoder.entries, [("abc", "k")])          # this time it indexes

    def test_cache_is_bounded(self) -> None:
        decoder = _HPACKDecoder(0)
        for number in range(3 * _HPACK_CACHE_ENTRIES):
            block = b"\x88\x00\x01x" + _hpack_encode_int(len(str(number)), 7, 0)
            fields = decoder.decode(block + str(number).encode())
            self.assertEqual(fields, ((":status", "200"), ("x", str(number))))
            self.assertLessEqual(len(decoder._cache), _HPACK_CACHE_ENTRIES)
        big = b"\x88\x00\x01x" + _hpack_encode_int(_HPACK_CACHE_MAX_BLOCK, 7, 0)
        decoder.decode(big + b"v" * _HPACK_CACHE_MAX_BLOCK)
        self.assertNotIn(big + b"v" * _HPACK_CACHE_MAX_BLOCK, decoder._cache)


ROUND_TRIP_HEADERS: Fields = [
    (":method", "POST"), (":scheme", "https"), (":authority", "fcm.googleapis.com"),
    (":path", "/v1/projects/my-project/messages:send"),
    ("authorization", "Bearer ya29." + "x" * 200), ("content-type", "application/json"),
    ("content-length", "1234"), ("user-agent", "andpush/0.1.0"), ("te", "trailers"),
    (":path", "/"), (":method", "GET"), ("accept-encoding", "gzip, deflate"),
    ("accept-encoding", "br"), ("x-empty", ""), ("", "empty name"), ("www-authenticate", ""),
    ("x-latin-1", "caf\u00e9 \u00ff"), ("x-" + "n" * 130, "v" * 300),
]


class HPACKEncoderTest(unittest.TestCase):
    """The encoder: static indexes where it can, plain literals otherwise, no state."""

    def test_exact_output(self) -> None:
        for fields, encoding in [
            ([(":method", "POST"), (":scheme", "https")], "8387"),
            ([(":path", "/v1")], "0403" "2f7631"),
            ([("content-type", "application/json")],
             "0f10" "10" "6170706c69636174696f6e2f6a736f6e"),
            ([("www-authenticate", "x")], "0f2e" "0178"),
            ([("x-a", "b")], "00" "03782d61" "0162"),
            ([(":status", "200"), (":status", "201")], "88" "0803323031"),
            ([], ""),
        ]:
            with self.subTest(fields=fields):
                self.assertEqual(_hpack_encode(fields), bytes.fromhex(encoding))

    def test_upper_case_name(self) -> None:
        for name in ["Content-Type", "X-A", ":Path"]:
            with self.subTest(name), self.assertRaisesRegex(ValueError, "lower-case"):
                _hpack_encode([(name, "x")])

    def test_value_outside_latin_1(self) -> None:
        with self.assertRaises(ValueError):
            _hpack_encode([("x-a", "\u20ac")])

    def test_round_trip(self) -> None:
        decoder = _HPACKDecoder(0)
        self.assertEqual(decoder.decode(_hpack_encode(ROUND_TRIP_HEADERS)),
                         tuple(ROUND_TRIP_HEADERS))
        self.assertEqual(decoder.decode(_hpack_encode(ROUND_TRIP_HEADERS)),   # cached now
                         tuple(ROUND_TRIP_HEADERS))
        for name, value in _HPACK_STATIC_TABLE:
            for fields in [[(name, value)], [(name, value + "x")], [(name + "x", value)]]:
                with self.subTest(fields=fields):
                    self.assertEqual(decoder.decode(_hpack_encode(fields)), tuple(fields))

    def test_random_round_trip(self) -> None:
        rng = random.Random(7541)
        names = [name for name, _ in _HPACK_STATIC_TABLE] + ["x-custom", "grpc-status"]
        decoder = _HPACKDecoder(0)
        for _ in range(200):
            fields = [(rng.choice(names), random_latin1(rng, rng.randrange(200)))
                      for _ in range(rng.randrange(12))]
            self.assertEqual(decoder.decode(_hpack_encode(fields)), tuple(fields))

    def test_cached_fields_stay_correct(self) -> None:
        for _ in range(2):
            for number in range(600):
                fields = [(":method", "POST"), ("content-length", str(number))]
                block = _hpack_encode(fields)
                self.assertEqual(_HPACKDecoder(0).decode(block), tuple(fields))


# The wires, without sockets #################################################################
# The sans-I/O protocol code fed hand-built bytes and frames: what a server may send, split
# anywhere, and what must come of it.

H1Answer = Tuple[int, str, Dict[str, str], bytes, bool]   # status, reason, headers, body, keep


class H1ReaderTest(unittest.TestCase):
    """_H1Reader: every way an answer may be framed, however its bytes arrive."""

    def read(self, pieces: List[bytes], heads: Optional[Dict[bytes, Any]] = None) -> H1Answer:
        """The answer an _H1Reader makes of ``pieces`` fed one by one, then eof() if need be.

        Fails unless the answer comes with the last piece that holds a byte, not before.
        """
        reader = andpush._H1Reader(heads)
        last = max((i for i, piece in enumerate(pieces) if piece), default=-1)
        result = None
        for i, piece in enumerate(pieces):
            result = reader.feed(piece)
            if result is not None:
                self.assertGreaterEqual(i, last, "the answer was whole before its last byte")
                break
        if result is None:
            result = reader.eof()
        response, keep_alive = result
        return (response.status_code, response.reason, dict(response.headers), response.body,
                keep_alive)

    ANSWERS: List[Tuple[str, bytes, H1Answer]] = [
        ("content-length",
         b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n"
         b'{"name": "x"}',
         (200, "OK", {"content-type": "application/json", "content-length": "13"},
          b'{"name": "x"}', True)),
        ("chunked, with extensions and trailers",
         b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"5;name=value\r\nhello\r\nA ; quoted=\"a;b\"\r\n, world!\r\n\r\n"
         b"0;last\r\nX-Checksum: 1234\r\nX-Other: x\r\n\r\n",
         (200, "OK", {"transfer-encoding": "chunked"}, b"hello, world!\r\n", True)),
        ("no length: the body runs until EOF",
         b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it\r\n\r\nuntil the end",
         (200, "OK", {"content-type": "text/plain"}, b"all of it\r\n\r\nuntil the end", False)),
        ("204 has no body",
         b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n",
         (204, "No Content", {"x-a": "1"}, b"", True)),
        ("304 has no body",
         b'HTTP/1.1 304 Not Modified\r\nETag: "x"\r\n\r\n',
         (304, "Not Modified", {"etag": '"x"'}, b"", True)),
        ("HTTP/1.0 closes by default",
         b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
         (200, "OK", {"content-length": "2"}, b"ok", False)),
        ("HTTP/1.0 with keep-alive",
         b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\nok",
         (200, "OK", {"connection": "Keep-Alive", "content-length": "2"}, b"ok", True)),
        ("Connection: close",
         b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 5\r\n"
         b"Content-Length: 0\r\n\r\n",
         (503, "Service Unavailable",
          {"connection": "close", "retry-after": "5", "content-length": "0"}, b"", False)),
        ("chunked, Connection: close",
         b"HTTP/1.1 500 Internal Server Error\r\nConnection: Close\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n3\r\nerr\r\n0\r\n\r\n",
         (500, "Internal Server Error",
          {"connection": "Close", "transfer-encoding": "chunked"}, b"err", False)),
        ("repeated headers joined, names in any case, no reason phrase",
         b"HTTP/1.1 200\r\nx-a: 1\r\nX-A:2\r\nCONTENT-LENGTH:  0  \r\n\r\n",
         (200, "", {"x-a": "1, 2", "content-length": "0"}, b"", True)),
    ]

    def test_answers_fed_whole(self) -> None:
        for name, data, expected in self.ANSWERS:
            with self.subTest(name):
                self.assertEqual(self.read([data]), expected)

    def test_answers_fed_byte_by_byte(self) -> None:
        for name, data, expected in self.ANSWERS:
            with self.subTest(name):
                self.assertEqual(self.read([data[i:i + 1] for i in range(len(data))]), expected)

    def test_answers_split_at_every_position(self) -> None:
        for name, data, expected in self.ANSWERS:
            for cut in range(len(data) + 1):
                with self.subTest(name, cut=cut):
                    self.assertEqual(self.read([data[:cut], data[cut:]]), expected)

    def test_answers_read_with_the_heads_of_earlier_answers(self) -> None:
        # A route's readers share the heads they parsed: the same bytes give the same answer.
        heads: Dict[bytes, Any] = {}
        for turn in ("parsed", "remembered"):
            for name, data, expected in self.ANSWERS:
                with self.subTest(name, turn=turn):
                    self.assertEqual(self.read([data], heads), expected)
        self.assertEqual(len(heads), len(self.ANSWERS))

    def test_heads_remembered_are_bounded(self) -> None:
        heads: Dict[bytes, Any] = {}
        for i in range(3 * andpush._H1_HEAD_CACHE):
            date = b"Date: Tue, 01 Dec 2026 15:%02d:%02d GMT" % divmod(i, 60)
            self.read([b"HTTP/1.1 200 OK\r\n" + date + b"\r\nContent-Length: 2\r\n\r\nok"],
                      heads)
            self.assertLessEqual(len(heads), andpush._H1_HEAD_CACHE)

    def test_headers_are_looked_up_in_any_case(self) -> None:
        response, _ = andpush._H1Reader().feed(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(response.headers["CONTENT-TYPE"], "application/json")

    def test_bytes_beyond_the_answer_mean_the_connection_is_not_kept(self) -> None:
        # A server that answers more than it was asked cannot be trusted with the next request.
        one = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        for data in [one + one, one + b"\r\n", one + b"x"]:
            with self.subTest(data=data):
                response, keep_alive = andpush._H1Reader().feed(data)
                self.assertEqual((response.status_code, response.body, keep_alive),
                                 (200, b"ok", False))

    MALFORMED = [
        ("not HTTP/1.x", b"HTTP/2 200 OK\r\n\r\n"),
        ("not HTTP at all", b"ICY 200 OK\r\n\r\n"),
        ("no status", b"HTTP/1.1\r\n\r\n"),
        ("two-digit status", b"HTTP/1.1 20 OK\r\n\r\n"),
        ("four-digit status", b"HTTP/1.1 2000 OK\r\n\r\n"),
        ("letters for a status", b"HTTP/1.1 2oo OK\r\n\r\n"),
        ("a status of superscript digits", b"HTTP/1.1 2\xb2\xb2 OK\r\n\r\n"),
        ("a status with a UTF-8 superscript two", "HTTP/1.1 2\u00b2 OK\r\n\r\n".encode()),
        ("a header line without a colon", b"HTTP/1.1 200 OK\r\nNoColon\r\n\r\n"),
        ("space before the colon", b"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n"),
        ("a folded header line", b"HTTP/1.1 200 OK\r\nX-A: 1\r\n 2\r\n\r\n"),
        ("an empty header name", b"HTTP/1.1 200 OK\r\n: v\r\n\r\n"),
        ("letters for a length", b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n"),
        ("a negative length", b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
        ("a signed length", b"HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n"),
        ("a hexadecimal length", b"HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n"),
        ("two lengths", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok"),
        ("a length in superscript", b"HTTP/1.1 200 OK\r\nContent-Length: 1\xb2\r\n\r\n"),
        ("a length in UTF-8 superscript",
         "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode()),
        ("letters for a chunk size",
         b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nxyz\r\n"),
        ("an empty chunk size", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n"),
        ("a negative chunk size",
         b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"),
        ("a chunk size with 0x", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n"),
        ("two chunk sizes", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2 2\r\n"),
        ("a chunk size in superscript",
         b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\xb2\r\n"),
        ("a chunk not followed by CRLF",
         b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokX\r\n0\r\n\r\n"),
        ("a chunk followed by LF alone",
         b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\n0\r\n\r\n"),
    ]

    def test_malformed_answers(self) -> None:
        for name, data in self.MALFORMED:
            with self.subTest(name), self.assertRaises(andpush._ProtocolError):
                andpush._H1Reader().feed(data)

    def test_malformed_answers_fed_byte_by_byte(self) -> None:
        for name, data in self.MALFORMED:
            reader = andpush._H1Reader()
            with self.subTest(name), self.assertRaises(andpush._ProtocolError):
                for i in range(len(data)):
                    reader.feed(data[i:i + 1])

    def test_head_over_the_limit(self) -> None:
        unended = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * andpush._MAX_HEAD
        with self.assertRaisesRegex(andpush._ProtocolError, "head exceeds"):
            andpush._H1Reader().feed(unended)
        reader = andpush._H1Reader()
        with self.assertRaisesRegex(andpush._ProtocolError, "head exceeds"):
            for start in range(0, len(unended), 4096):
                reader.feed(unended[start:start + 4096])

    def test_head_over_the_limit_in_one_piece(self) -> None:
        # The limit holds however the bytes arrive: one read may hold a whole oversized head.
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Big: " + b"a" * andpush._MAX_HEAD
        with self.assertRaisesRegex(andpush._ProtocolError, "head exceeds"):
            andpush._H1Reader().feed(head + b"\r\n\r\n")

    def test_chunk_line_over_the_limit_in_one_piece(self) -> None:
        for name, line in [("a chunk line", b"1;" + b"e" * andpush._MAX_HEAD + b"\r\nx\r\n"),
                           ("a trailer line", b"0\r\nX: " + b"t" * andpush._MAX_HEAD + b"\r\n")]:
            with self.subTest(name), self.assertRaisesRegex(andpush._ProtocolError,
                                                            name + " exceeds"):
                andpush._H1Reader().feed(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + line + b"\r\n")

    def test_head_just_under_the_limit(self) -> None:
        start = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Big: "
        value = b"a" * (andpush._MAX_HEAD - len(start) - 4)     # the blank line counts
        for pieces in ([start + value + b"\r\n\r\n"], [start + value, b"\r\n", b"\r", b"\n"]):
            with self.subTest(pieces=len(pieces)):
                self.assertEqual(self.read(pieces)[2]["x-big"], value.decode())

    def test_bodies_over_the_limit(self) -> None:
        too_big = andpush._MAX_BODY + 1
        for name, head, body in [
            ("content-length", b"Content-Length: %d\r\n" % too_big, b""),
            ("a chunk", b"Transfer-Encoding: chunked\r\n", b"%x\r\n" % too_big),
            ("chunks", b"Transfer-Encoding: chunked\r\n",
             b"%x\r\n%s\r\n2\r\n" % (andpush._MAX_BODY - 1, b"x" * (andpush._MAX_BODY - 1))),
            ("until EOF", b"", b"x" * too_big),
        ]:
            with self.subTest(name), self.assertRaisesRegex(andpush._ProtocolError, "exceeds"):
                andpush._H1Reader().feed(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n" + body)

    def test_lengths_of_thousands_of_digits(self) -> None:
        # Beyond 4,300 digits int() itself refuses (Python 3.11+): the reader must answer first.
        for digits, error in [("1" * 5000, "exceeds"), ("0" * 5000 + "2", None)]:
            data = b"HTTP/1.1 200 OK\r\nContent-Length: %s\r\n\r\nok" % digits.encode()
            with self.subTest(digits=len(digits)):
                if error:
                    with self.assertRaisesRegex(andpush._ProtocolError, error):
                        andpush._H1Reader().feed(data)
                else:
                    self.assertEqual(self.read([data])[3], b"ok")

    def test_body_of_exactly_the_limit(self) -> None:
        body = b"x" * andpush._MAX_BODY
        for head in [b"", b"Content-Length: %d\r\n" % len(body)]:
            reader = andpush._H1Reader()
            self.assertIsNone(reader.feed(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n"))
            result = reader.feed(body) or reader.eof()
            self.assertEqual(len(result[0].body), andpush._MAX_BODY)

    def test_eof_mid_answer(self) -> None:
        whole = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                 b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        for data in whole:
            for cut in range(len(data)):
                reader = andpush._H1Reader()
                self.assertIsNone(reader.feed(data[:cut]))
                with self.subTest(data=data[:cut]), self.assertRaisesRegex(
                        andpush._ProtocolError, "closed the connection mid-response"):
                    reader.eof()

    def test_started_once_any_byte_arrived(self) -> None:
        reader = andpush._H1Reader()
        self.assertFalse(reader.started)
        reader.feed(b"")
        self.assertFalse(reader.started)
        reader.feed(b"H")
        self.assertTrue(reader.started)
        reader.feed(b"TTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n")
        self.assertTrue(reader.started)     # the head is consumed: the state says so


class EncodeRequestTest(unittest.TestCase):
    """_encode_request: one HTTP/1.1 request as bytes."""

    def test_request_bytes(self) -> None:
        data = andpush._encode_request("fcm.googleapis.com", "POST", "/fcm/send",
                                       {"Content-Type": "application/json"}, b"{}")
        self.assertEqual(data, b"POST /fcm/send HTTP/1.1\r\nHost: fcm.googleapis.com\r\n"
                               b"User-Agent: andpush/" + andpush.__version__.encode()
                         + b"\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")


# HTTP/2 frame types, flags, settings and error codes, as RFC 9113 numbers them.
H2_DATA, H2_HEADERS, H2_PRIORITY, H2_RST_STREAM, H2_SETTINGS, H2_PUSH_PROMISE = range(6)
H2_PING, H2_GOAWAY, H2_WINDOW_UPDATE, H2_CONTINUATION = range(6, 10)
H2_END_STREAM = H2_ACK = 0x1
H2_END_HEADERS, H2_PADDED, H2_PRIORITY_FLAG = 0x4, 0x8, 0x20
H2_HEADER_TABLE_SIZE, H2_ENABLE_PUSH, H2_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
H2_INITIAL_WINDOW_SIZE, H2_MAX_FRAME_SIZE = 0x4, 0x5
H2_PROTOCOL_ERROR, H2_INTERNAL_ERROR, H2_FLOW_CONTROL_ERROR = 0x1, 0x2, 0x3
H2_FRAME_SIZE_ERROR, H2_ENHANCE_YOUR_CALM = 0x6, 0xB
H2_REFUSED_STREAM, H2_CANCEL, H2_COMPRESSION_ERROR = 0x7, 0x8, 0x9
H2_CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

Frame = Tuple[int, int, int, bytes]   # type, flags, stream id, payload


def h2_frame(kind: int, flags: int = 0, stream_id: int = 0, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: the 9-byte header (length, type, flags, stream id), then the payload."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream_id) \
        + payload


def h2_settings(*settings: Tuple[int, int]) -> bytes:
    return h2_frame(H2_SETTINGS, payload=b"".join(struct.pack(">HI", *s) for s in settings))


def h2_frames(data: bytes) -> List[Frame]:
    """The frames ``data`` holds, which must be whole."""
    frames = []
    while data:
        length, = struct.unpack(">I", b"\0" + data[:3])
        kind, flags, stream_id = struct.unpack(">BBI", data[3:9])
        if len(data) < 9 + length:
            raise AssertionError("a partial frame")
        frames.append((kind, flags, stream_id, data[9:9 + length]))
        data = data[9 + length:]
    return frames


def h2_answer(stream_id: int, status: str = "200", body: bytes = b"",
              headers: Tuple[Tuple[str, str], ...] = ()) -> bytes:
    """A whole response on one stream: HEADERS, then DATA with END_STREAM if there is a body."""
    block = _hpack_encode([(":status", status), *headers])
    if not body:
        return h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, stream_id, block)
    return (h2_frame(H2_HEADERS, H2_END_HEADERS, stream_id, block)
            + h2_frame(H2_DATA, H2_END_STREAM, stream_id, body))


class H2TestCase(unittest.TestCase):
    """An _H2Connection with the frames it sends taken out and read as they are queued."""

    def connect(self) -> andpush._H2Connection:
        """A connection whose preface and first frames were written: still no SETTINGS."""
        conn = andpush._H2Connection("fcm.googleapis.com", "https")
        conn.wrote(len(conn.outgoing))
        return conn

    def open(self, *settings: Tuple[int, int]) -> andpush._H2Connection:
        """A connection the server's SETTINGS opened, its ACK written."""
        conn = self.connect()
        conn.receive(h2_settings(*settings))
        self.assertEqual(self.sent(conn), [(H2_SETTINGS, H2_ACK, 0, b"")])
        return conn

    def sent(self, conn: andpush._H2Connection) -> List[Frame]:
        """The frames queued since last asked, now written."""
        frames = h2_frames(bytes(conn.outgoing))
        conn.wrote(len(conn.outgoing))
        return frames

    def start(self, conn: andpush._H2Connection, key: object, body: bytes = b"",
              deadline: float = 1e9) -> int:
        return conn.start("POST", "/v1/projects/p/messages:send",
                          {"content-type": "application/json"}, body, key, deadline)

    def outcome(self, conn: andpush._H2Connection) -> Tuple[object, object]:
        """The one outcome finished since last asked."""
        self.assertEqual(len(conn.finished), 1, conn.finished)
        return conn.finished.pop()


class H2ConnectionTest(H2TestCase):
    """_H2Connection, fed hand-built frames: no server, no socket."""

    def test_preface_settings_and_window_update_come_first(self) -> None:
        conn = andpush._H2Connection("fcm.googleapis.com", "https")
        data = bytes(conn.outgoing)
        self.assertTrue(data.startswith(H2_CLIENT_PREFACE))
        settings, window_update = h2_frames(data[len(H2_CLIENT_PREFACE):])
        self.assertEqual(settings, (H2_SETTINGS, 0, 0, struct.pack(
            ">HIHIHI", H2_HEADER_TABLE_SIZE, 0, H2_ENABLE_PUSH, 0,
            H2_INITIAL_WINDOW_SIZE, andpush._H2_WINDOW)))
        self.assertEqual(window_update, (H2_WINDOW_UPDATE, 0, 0, struct.pack(
            ">I", andpush._H2_WINDOW - 65535)))

    def test_no_stream_before_the_servers_settings(self) -> None:
        conn = self.connect()
        self.assertEqual((conn.state, conn.free_streams()), ("WAITING_FOR_SETTINGS", 0))
        with self.assertRaises(RuntimeError):
            self.start(conn, "early")
        self.assertEqual(self.sent(conn), [])
        with self.assertRaisesRegex(andpush._H2Error, "first frame was not SETTINGS"):
            conn.receive(h2_frame(H2_PING, payload=bytes(8)))

    def test_settings_open_the_connection_and_are_acknowledged(self) -> None:
        conn = self.connect()
        conn.receive(h2_settings((H2_MAX_CONCURRENT_STREAMS, 2))[:-1])
        self.assertEqual(conn.state, "WAITING_FOR_SETTINGS")
        conn.receive(h2_settings((H2_MAX_CONCURRENT_STREAMS, 2))[-1:])
        self.assertEqual((conn.state, conn.max_streams, conn.free_streams()), ("OPEN", 2, 2))
        self.assertEqual(self.sent(conn), [(H2_SETTINGS, H2_ACK, 0, b"")])
        conn.receive(h2_frame(H2_SETTINGS, H2_ACK))         # the ACK of ours: nothing to say
        self.assertEqual(self.sent(conn), [])

    def test_settings_without_a_stream_limit_leave_streams_unlimited(self) -> None:
        conn = self.open()
        self.assertGreater(conn.free_streams(), 10000)

    def test_max_concurrent_streams_is_followed_as_it_changes(self) -> None:
        conn = self.open((H2_MAX_CONCURRENT_STREAMS, 2))
        self.assertEqual([self.start(conn, "a"), self.start(conn, "b")], [1, 3])
        self.assertEqual(conn.free_streams(), 0)
        with self.assertRaises(RuntimeError):
            self.start(conn, "c")
        conn.receive(h2_settings((H2_MAX_CONCURRENT_STREAMS, 1)))   # the limit shrinks
        self.assertEqual(conn.max_streams, 1)
        conn.receive(h2_answer(1))
        self.assertEqual(self.outcome(conn)[0], "a")
        self.assertEqual(conn.free_streams(), 0)              # one is still open: the limit
        conn.receive(h2_answer(3))
        self.assertEqual(self.outcome(conn)[0], "b")
        self.assertEqual(conn.free_streams(), 1)
        conn.receive(h2_settings((H2_MAX_CONCURRENT_STREAMS, 0)))
        self.assertEqual(conn.free_streams(), 0)

    def test_request_headers_and_body(self) -> None:
        conn = self.open()
        self.assertEqual(self.start(conn, "k", b'{"message": {}}'), 1)
        headers, data = self.sent(conn)
        self.assertEqual(headers[:3], (H2_HEADERS, H2_END_HEADERS, 1))
        self.assertEqual(_HPACKDecoder(0).decode(headers[3]), (
            (":method", "POST"), (":scheme", "https"), (":authority", "fcm.googleapis.com"),
            (":path", "/v1/projects/p/messages:send"),
            ("user-agent", "andpush/" + andpush.__version__), ("content-length", "15"),
            ("content-type", "application/json")))
        self.assertEqual(data, (H2_DATA, H2_END_STREAM, 1, b'{"message": {}}'))
        self.start(conn, "no body")
        (headers,) = self.sent(conn)
        self.assertEqual(headers[:3], (H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 3))

    def test_each_request_carries_its_own_length_and_headers(self) -> None:
        # A signer gives the same headers dict while its token lasts: given again, it is not
        # encoded again, but another dict, path or method is (and another body length).
        conn = self.open()
        decoder = _HPACKDecoder(0)
        signed = {token: {"Authorization": "Bearer " + token} for token in "ab"}
        for stream_id, (method, path, token, body) in zip(range(1, 100, 2), [
                ("POST", "/p", "a", b"{}"), ("POST", "/p", "a", b"[1, 2]"),
                ("POST", "/p", "a", b"[3, 4]"), ("POST", "/p", "b", b"{}"),
                ("POST", "/q", "b", b"{}"), ("PUT", "/q", "b", b"{}"),
                ("POST", "/p", "a", b"{}"), ("POST", "/p", "b", b"")]):
            conn.start(method, path, signed[token], body, token, 1e9)
            frames = self.sent(conn)
            fields = dict(decoder.decode(frames[0][3]))
            self.assertEqual((fields[":method"], fields[":path"], fields["content-length"],
                              fields["authorization"]),
                             (method, path, str(len(body)), "Bearer " + token))
            self.assertEqual([(kind, stream) for kind, _, stream, _ in frames],
                             [(H2_HEADERS, stream_id)] + [(H2_DATA, stream_id)] * bool(body))
            self.assertEqual(b"".join(f[3] for f in frames[1:]), body)

    def test_the_last_stream_ids_are_used_then_no_stream_starts(self) -> None:
        conn = self.open()
        conn._next_id = andpush._H2_LAST_STREAM - 4
        self.assertEqual(conn.free_streams(), 2)
        self.assertEqual([self.start(conn, "a"), self.start(conn, "b")],
                         [andpush._H2_LAST_STREAM - 4, andpush._H2_LAST_STREAM - 2])
        self.assertEqual(conn.free_streams(), 0)
        with self.assertRaises(RuntimeError):
            self.start(conn, "c")

    def test_answers_alike_are_read_alike_and_others_afresh(self) -> None:
        conn = self.open()
        answers = [("200", (("x-a", "1"), ("x-a", "2"))), ("200", (("x-a", "1"), ("x-a", "2"))),
                   ("200", (("x-a", "3"),)), ("201", (("x-a", "3"),)), ("2000", ())]
        for stream_id, (status, headers) in zip(range(1, 100, 2), answers):
            self.start(conn, stream_id)
            conn.receive(h2_answer(stream_id, status, b"{}", headers))
        outcomes = [outcome for _, outcome in conn.finished]
        self.assertEqual([(r.status_code, dict(r.headers)) for r in outcomes[:4]], [
            (200, {"x-a": "1, 2"}), (200, {"x-a": "1, 2"}), (200, {"x-a": "3"}),
            (201, {"x-a": "3"})])
        self.assertIsInstance(outcomes[4], andpush.NetworkError)

    def test_response_over_headers_continuation_and_data_frames(self) -> None:
        block = _hpack_encode([(":status", "200"), ("content-type", "application/json"),
                               ("x-a", "1"), ("x-a", "2")])
        data = (h2_frame(H2_HEADERS, 0, 3, block[:3])
                + h2_frame(H2_CONTINUATION, 0, 3, block[3:10])
                + h2_frame(H2_CONTINUATION, H2_END_HEADERS, 3, block[10:])
                + h2_frame(H2_DATA, 0, 3, b'{"name": ')
                + h2_frame(H2_DATA, 0, 3, b"")
                + h2_frame(H2_DATA, H2_END_STREAM, 3, b'"x"}'))
        for pieces in [[data], [data[i:i + 1] for i in range(len(data))]]:
            with self.subTest(pieces=len(pieces)):
                conn = self.open()
                self.start(conn, "first")
                self.start(conn, "second")
                for piece in pieces:
                    conn.receive(piece)
                key, response = self.outcome(conn)
                self.assertEqual(key, "second")
                self.assertIsInstance(response, andpush.Response)
                self.assertEqual((response.status_code, dict(response.headers), response.json()),
                                 (200, {"content-type": "application/json", "x-a": "1, 2"},
                                  {"name": "x"}))
                self.assertEqual(list(conn.streams), [1])

    def test_1xx_headers_are_skipped_and_trailers_ignored(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        conn.receive(h2_frame(H2_HEADERS, H2_END_HEADERS, 1, _hpack_encode([(":status", "103")]))
                     + h2_frame(H2_HEADERS, H2_END_HEADERS, 1, _hpack_encode(
                         [(":status", "404"), ("x-a", "1")]))
                     + h2_frame(H2_DATA, 0, 1, b"{}")
                     + h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 1,
                                _hpack_encode([("grpc-status", "0")])))
        _, response = self.outcome(conn)
        self.assertEqual((response.status_code, dict(response.headers), response.body),
                         (404, {"x-a": "1"}, b"{}"))

    def test_padding_and_priority_are_stripped(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        block = _hpack_encode([(":status", "201")])
        conn.receive(h2_frame(H2_HEADERS, H2_END_HEADERS | H2_PADDED | H2_PRIORITY_FLAG, 1,
                              b"\x03" + struct.pack(">IB", 0x80000003, 200) + block + bytes(3))
                     + h2_frame(H2_DATA, H2_PADDED, 1, b"\x02ab" + bytes(2))
                     + h2_frame(H2_DATA, H2_PADDED | H2_END_STREAM, 1, b"\x00c"))
        _, response = self.outcome(conn)
        self.assertEqual((response.status_code, response.body), (201, b"abc"))

    def test_padding_longer_than_the_frame(self) -> None:
        for frame in [h2_frame(H2_DATA, H2_PADDED, 1, b"\x03ab"),
                      h2_frame(H2_DATA, H2_PADDED, 1, b""),
                      h2_frame(H2_HEADERS, H2_PADDED | H2_END_HEADERS, 1, b"\x05\x88")]:
            conn = self.open()
            self.start(conn, "k")
            with self.subTest(frame=frame), self.assertRaisesRegex(andpush._H2Error, "padding"):
                conn.receive(frame)

    def test_refused_stream_was_not_processed(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        conn.receive(h2_frame(H2_RST_STREAM, 0, 1, struct.pack(">I", H2_REFUSED_STREAM)))
        key, outcome = self.outcome(conn)
        self.assertEqual(key, "k")
        self.assertIsInstance(outcome, andpush._NotProcessed)
        self.assertEqual((conn.streams, conn.state), ({}, "OPEN"))

    def test_other_resets_may_have_been_delivered(self) -> None:
        for code in [0, H2_INTERNAL_ERROR, H2_CANCEL, 0xFF]:
            conn = self.open()
            self.start(conn, "k")
            conn.receive(h2_frame(H2_RST_STREAM, 0, 1, struct.pack(">I", code)))
            _, outcome = self.outcome(conn)
            with self.subTest(code=code):
                self.assertIsInstance(outcome, andpush.NetworkError)
                self.assertTrue(outcome.may_have_been_delivered)
                self.assertIn("error %d" % code, str(outcome))

    def test_goaway_ends_new_streams_and_those_above_its_last_id(self) -> None:
        conn = self.open()
        for key in "abc":
            self.start(conn, key)
        conn.receive(h2_frame(H2_GOAWAY, payload=struct.pack(">II", 3, 0)))
        self.assertEqual((conn.state, conn.free_streams(), conn.last_stream_id),
                         ("GOING_AWAY", 0, 3))
        key, outcome = self.outcome(conn)
        self.assertEqual(key, "c")
        self.assertIsInstance(outcome, andpush._NotProcessed)
        with self.assertRaises(RuntimeError):
            self.start(conn, "d")
        conn.receive(h2_answer(3, body=b"{}") + h2_answer(1, "500"))
        self.assertEqual([(key, response.status_code) for key, response in conn.finished],
                         [("b", 200), ("a", 500)])

    def test_shutdown_notice_ends_new_streams_only(self) -> None:
        conn = self.open()
        self.start(conn, "a")
        conn.receive(h2_frame(H2_GOAWAY, payload=struct.pack(">II", 2 ** 31 - 1, 0)))
        self.assertEqual((conn.state, conn.free_streams(), conn.finished), ("GOING_AWAY", 0, []))
        conn.receive(h2_frame(H2_GOAWAY, payload=struct.pack(">II", 1, 0) + b"debug data"))
        self.assertEqual((conn.state, conn.last_stream_id, conn.finished), ("GOING_AWAY", 1, []))
        conn.receive(h2_answer(1))
        self.assertEqual(self.outcome(conn)[1].status_code, 200)

    def test_lost_streams_whose_bytes_were_never_written_were_not_processed(self) -> None:
        conn = self.open()
        self.start(conn, "written")
        conn.wrote(len(conn.outgoing))
        self.start(conn, "partly written")
        conn.wrote(1)
        self.start(conn, "queued")
        conn.lost("connection reset")
        self.assertEqual(conn.state, "CLOSED")
        outcomes = dict(conn.finished)
        self.assertEqual(list(outcomes), ["written", "partly written", "queued"])
        for key in ["written", "partly written"]:
            self.assertIsInstance(outcomes[key], andpush.NetworkError)
            self.assertTrue(outcomes[key].may_have_been_delivered)
        self.assertIsInstance(outcomes["queued"], andpush._NotProcessed)
        self.assertEqual(conn.free_streams(), 0)

    def test_abort_says_why_and_ends_every_stream(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        self.sent(conn)
        conn.abort(andpush._H2Error("bad", H2_COMPRESSION_ERROR))
        self.assertEqual(self.sent(conn), [(H2_GOAWAY, 0, 0, struct.pack(
            ">II", 0, H2_COMPRESSION_ERROR))])
        self.assertEqual(conn.state, "CLOSED")
        self.assertTrue(self.outcome(conn)[1].may_have_been_delivered)

    def test_close_says_goodbye_and_ends_every_stream(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        conn.close()
        self.assertEqual(self.sent(conn)[-1], (H2_GOAWAY, 0, 0, bytes(8)))
        self.assertIsInstance(self.outcome(conn)[1], andpush._NotProcessed)

    def test_cancel_resets_the_stream_without_an_outcome(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        self.sent(conn)
        conn.cancel(1)
        self.assertEqual(self.sent(conn), [(H2_RST_STREAM, 0, 1, struct.pack(">I", H2_CANCEL))])
        conn.receive(h2_answer(1, body=b"late"))
        self.assertEqual((conn.finished, conn.streams), ([], {}))

    def test_expire_resets_the_streams_past_their_deadline(self) -> None:
        conn = self.open()
        for key, deadline in [("a", 10.0), ("b", 20.0), ("c", 30.0)]:
            self.start(conn, key, deadline=deadline)
        self.sent(conn)

        def no_answer(key: object, sent: bool) -> Exception:
            self.assertTrue(sent)
            return andpush.NetworkError("no answer for %s" % key, may_have_been_delivered=True)
        conn.expire(9.9, no_answer)
        self.assertEqual(conn.finished, [])
        conn.expire(20.0, no_answer)
        self.assertEqual([key for key, _ in conn.finished], ["a", "b"])
        for key, outcome in conn.finished:
            self.assertEqual(str(outcome), "no answer for %s" % key)
        self.assertEqual(self.sent(conn), [(H2_RST_STREAM, 0, stream_id, struct.pack(
            ">I", H2_CANCEL)) for stream_id in (1, 3)])
        self.assertEqual((list(conn.streams), conn.next_deadline()), ([5], 30.0))

    def test_a_stream_that_expires_before_any_byte_of_it_was_written_is_taken_back(
            self) -> None:
        # Its bytes leave the output (no RST_STREAM for a stream the server never heard
        # of), so it was provably not processed; one written is reset, and may have been.
        conn = self.open()
        self.start(conn, "written", body=b"{}", deadline=10.0)
        self.sent(conn)
        self.start(conn, "queued", body=b'{"a": 1}', deadline=10.0)
        self.start(conn, "later", body=b"{}", deadline=30.0)
        window = conn._peer_window
        said: Dict[object, bool] = {}

        def no_answer(key: object, sent: bool) -> Exception:
            said[key] = sent
            return andpush.NetworkError(str(key), may_have_been_delivered=sent)
        conn.expire(10.0, no_answer)
        self.assertEqual(said, {"written": True, "queued": False})
        self.assertEqual([(kind, stream_id) for kind, _, stream_id, _ in self.sent(conn)],
                         [(H2_HEADERS, 5), (H2_DATA, 5), (H2_RST_STREAM, 1)])
        self.assertEqual(conn._peer_window, window + len(b'{"a": 1}'))
        self.assertEqual(list(conn.streams), [5])

    def test_a_stream_whose_data_came_after_another_is_reset_when_it_expires(self) -> None:
        # Its bytes are no longer one run, so it is not taken back: what is queued goes out,
        # and the server may process it.
        conn = self.open((H2_INITIAL_WINDOW_SIZE, 4))
        self.start(conn, "split", body=b"12345678", deadline=10.0)
        self.start(conn, "other", body=b"{}", deadline=30.0)
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 1, struct.pack(">I", 4)))
        said: Dict[object, bool] = {}

        def no_answer(key: object, sent: bool) -> Exception:
            said[key] = sent
            return andpush.NetworkError(str(key), may_have_been_delivered=sent)
        conn.expire(10.0, no_answer)
        self.assertEqual(said, {"split": True})
        self.assertEqual([(kind, stream_id) for kind, _, stream_id, _ in self.sent(conn)],
                         [(H2_HEADERS, 1), (H2_DATA, 1), (H2_HEADERS, 3), (H2_DATA, 3),
                          (H2_DATA, 1), (H2_RST_STREAM, 1)])

    def test_cancel_before_any_byte_was_written_sends_nothing_of_the_stream(self) -> None:
        conn = self.open()
        self.start(conn, "k", body=b"{}")
        conn.cancel(1)
        self.assertEqual((self.sent(conn), conn.streams), ([], {}))

    def test_ping_is_answered_with_its_payload(self) -> None:
        conn = self.open()
        conn.receive(h2_frame(H2_PING, payload=b"12345678"))
        self.assertEqual(self.sent(conn), [(H2_PING, H2_ACK, 0, b"12345678")])
        conn.receive(h2_frame(H2_PING, H2_ACK, payload=b"andpush!"))    # the answer to ours
        self.assertEqual(self.sent(conn), [])
        conn.ping()
        self.assertEqual(self.sent(conn), [(H2_PING, 0, 0, b"andpush!")])

    def test_frames_of_unknown_type_and_priority_are_ignored(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        self.sent(conn)
        conn.receive(h2_frame(0xFA, 0xFF, 1, b"whatever")
                     + h2_frame(H2_PRIORITY, 0, 1, struct.pack(">IB", 0, 16)))
        self.assertEqual((self.sent(conn), conn.finished, conn.state), ([], [], "OPEN"))


class H2FlowControlTest(H2TestCase):
    """What we send stays within both of the server's windows; what we take, we give back."""

    def data_sent(self, conn: andpush._H2Connection) -> List[Tuple[int, int, int]]:
        """(stream, size, flags) of each DATA frame queued since last asked."""
        return [(stream_id, len(payload), flags)
                for kind, flags, stream_id, payload in self.sent(conn) if kind == H2_DATA]

    def test_a_body_waits_for_the_streams_window(self) -> None:
        conn = self.open((H2_INITIAL_WINDOW_SIZE, 100))
        self.start(conn, "k", b"x" * 250)
        self.assertEqual(self.data_sent(conn), [(1, 100, 0)])
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000)))
        self.assertEqual(self.data_sent(conn), [])          # the connection's is not the one
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
        self.assertEqual(self.data_sent(conn), [(1, 100, 0)])
        conn.receive(h2_settings((H2_INITIAL_WINDOW_SIZE, 150)))   # 50 more for each stream
        self.assertEqual(self.data_sent(conn), [(1, 50, H2_END_STREAM)])

    def test_a_body_waits_for_the_connections_window(self) -> None:
        conn = self.open((H2_INITIAL_WINDOW_SIZE, 1 << 20))
        self.start(conn, "a", b"x" * 60000)
        self.start(conn, "b", b"y" * 10000)
        sent = self.data_sent(conn)
        self.assertEqual(sum(size for _, size, _ in sent), 65535)     # RFC 9113's default
        self.assertLessEqual(max(size for _, size, _ in sent), 16384)
        self.assertEqual([flags for stream_id, _, flags in sent if stream_id == 1][-1],
                         H2_END_STREAM)
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 3, struct.pack(">I", 100000)))
        self.assertEqual(self.data_sent(conn), [])
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", 4000)))
        self.assertEqual(self.data_sent(conn), [(3, 4000, 0)])
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", 100000)))
        self.assertEqual(self.data_sent(conn), [(3, 465, H2_END_STREAM)])

    def test_bodies_waiting_go_out_oldest_first_and_never_for_a_stream_ended(self) -> None:
        conn = self.open((H2_INITIAL_WINDOW_SIZE, 100))
        for key in ("a", "b", "c"):
            self.start(conn, key, b"x" * 150)
        self.assertEqual(self.data_sent(conn), [(1, 100, 0), (3, 100, 0), (5, 100, 0)])
        conn.cancel(3)
        conn.receive(h2_settings((H2_INITIAL_WINDOW_SIZE, 200)))   # 100 more for each stream
        self.assertEqual(self.data_sent(conn), [(1, 50, H2_END_STREAM), (5, 50, H2_END_STREAM)])
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000)))
        self.assertEqual(self.data_sent(conn), [])

    def test_frames_follow_the_servers_max_frame_size(self) -> None:
        conn = self.open((H2_MAX_FRAME_SIZE, 20000), (H2_INITIAL_WINDOW_SIZE, 1 << 20))
        conn.receive(h2_frame(H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
        self.start(conn, "k", b"x" * 50000)
        self.assertEqual(self.data_sent(conn), [(1, 20000, 0), (1, 20000, 0),
                                                (1, 10000, H2_END_STREAM)])

    def test_data_over_half_our_window_is_given_back(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        conn.cancel(1)                              # DATA for it still counts, and is dropped
        self.sent(conn)
        chunk = h2_frame(H2_DATA, 0, 1, bytes(16384))
        frames = andpush._H2_WINDOW // 2 // 16384
        conn.receive(chunk * frames)                # exactly half: not yet
        self.assertEqual(self.sent(conn), [])
        conn.receive(chunk)
        self.assertEqual(self.sent(conn), [(H2_WINDOW_UPDATE, 0, 0, struct.pack(
            ">I", (frames + 1) * 16384))])
        self.assertEqual(conn.finished, [])


class H2ErrorTest(H2TestCase):
    """What breaks HTTP/2 ends the connection with the right code; what breaks one answer
    ends that stream only."""

    CONNECTION_ERRORS = [                    # (name, frames, code)
        ("a frame over 16,384 bytes", h2_frame(H2_DATA, 0, 1, bytes(16385))[:9],
         H2_FRAME_SIZE_ERROR),
        ("PUSH_PROMISE", h2_frame(H2_PUSH_PROMISE, H2_END_HEADERS, 1,
                                  struct.pack(">I", 2) + _hpack_encode([(":method", "GET")])),
         H2_PROTOCOL_ERROR),
        ("CONTINUATION with no header block",
         h2_frame(H2_CONTINUATION, H2_END_HEADERS, 1, b"\x88"), H2_PROTOCOL_ERROR),
        ("CONTINUATION on another stream",
         h2_frame(H2_HEADERS, 0, 1, b"\x88") + h2_frame(H2_CONTINUATION, H2_END_HEADERS, 3),
         H2_PROTOCOL_ERROR),
        ("a header block interrupted",
         h2_frame(H2_HEADERS, 0, 1, b"\x88") + h2_frame(H2_PING, payload=bytes(8)),
         H2_PROTOCOL_ERROR),
        ("a bad HPACK block", h2_frame(H2_HEADERS, H2_END_HEADERS, 1, b"\xbe"),
         H2_COMPRESSION_ERROR),
        ("a bad HPACK block on a stream not ours",
         h2_frame(H2_HEADERS, H2_END_HEADERS, 99, b"\x80"), H2_COMPRESSION_ERROR),
        ("a SETTINGS frame of 5 bytes", h2_frame(H2_SETTINGS, payload=bytes(5)),
         H2_FRAME_SIZE_ERROR),
        ("a window over 2^31-1", h2_settings((H2_INITIAL_WINDOW_SIZE, 2 ** 31)),
         H2_FLOW_CONTROL_ERROR),
        ("a frame size under 16,384", h2_settings((H2_MAX_FRAME_SIZE, 16383)),
         H2_PROTOCOL_ERROR),
        ("a short GOAWAY", h2_frame(H2_GOAWAY, payload=bytes(7)), H2_FRAME_SIZE_ERROR),
        ("a short WINDOW_UPDATE", h2_frame(H2_WINDOW_UPDATE, 0, 1, bytes(3)),
         H2_FRAME_SIZE_ERROR),
        ("a header block over the limit",
         h2_frame(H2_HEADERS, 0, 1, b"\x00" * 16384)
         + h2_frame(H2_CONTINUATION, 0, 1, b"\x00" * 16384) * 4, H2_PROTOCOL_ERROR),
    ]

    def test_connection_errors(self) -> None:
        for name, data, code in self.CONNECTION_ERRORS:
            conn = self.open()
            self.start(conn, "k")
            with self.subTest(name):
                with self.assertRaises(andpush._H2Error) as caught:
                    conn.receive(data)
                self.assertEqual(caught.exception.code, code)

    def test_bad_status_ends_the_stream_only(self) -> None:
        for status in [None, "", "20", "2000", "abc", "2\u00b2\u00b2", " 200"]:
            conn = self.open()
            self.start(conn, "bad")
            self.start(conn, "good")
            self.sent(conn)
            fields = [("content-type", "application/json")]
            if status is not None:
                fields.insert(0, (":status", status))
            conn.receive(h2_frame(H2_HEADERS, H2_END_HEADERS, 1, _hpack_encode(fields))
                         + h2_frame(H2_DATA, H2_END_STREAM, 1, b"{}"))
            with self.subTest(status=status):
                key, outcome = self.outcome(conn)
                self.assertEqual(key, "bad")
                self.assertIsInstance(outcome, andpush.NetworkError)
                self.assertTrue(outcome.may_have_been_delivered)
                self.assertEqual(self.sent(conn), [(H2_RST_STREAM, 0, 1, struct.pack(
                    ">I", H2_CANCEL))])
                conn.receive(h2_answer(3))
                self.assertEqual(self.outcome(conn)[1].status_code, 200)
                self.assertEqual(conn.state, "OPEN")

    def test_stream_ended_without_a_final_status(self) -> None:
        for name, data in [
            ("DATA before any HEADERS", h2_frame(H2_DATA, H2_END_STREAM, 1, b"{}")),
            ("an informational status only", h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM,
                                                       1, _hpack_encode([(":status", "103")]))),
        ]:
            conn = self.open()
            self.start(conn, "k")
            conn.receive(data)
            with self.subTest(name):
                _, outcome = self.outcome(conn)
                self.assertIsInstance(outcome, andpush.NetworkError)
                self.assertTrue(outcome.may_have_been_delivered)
                self.assertEqual(conn.state, "OPEN")

    def test_header_with_an_empty_name_is_kept(self) -> None:
        # HPACK can carry an empty name; HTTP forbids it, but it is no reason to fail here.
        conn = self.open()
        self.start(conn, "k")
        conn.receive(h2_answer(1, headers=(("", "x"),)))
        self.assertEqual(dict(self.outcome(conn)[1].headers), {"": "x"})

    def test_body_over_the_limit_ends_the_stream_only(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        self.sent(conn)
        conn.receive(h2_frame(H2_HEADERS, H2_END_HEADERS, 1, b"\x88"))
        chunk = h2_frame(H2_DATA, 0, 1, bytes(16384))
        conn.receive(chunk * (andpush._MAX_BODY // 16384) + h2_frame(H2_DATA, 0, 1, b"x"))
        _, outcome = self.outcome(conn)
        self.assertIsInstance(outcome, andpush.NetworkError)
        self.assertIn("exceeds", str(outcome))
        self.assertIn((H2_RST_STREAM, 0, 1, struct.pack(">I", H2_CANCEL)), self.sent(conn))


class H2HeaderTableTest(H2TestCase):
    """The server's dynamic table is decoded whatever size we asked for, across responses."""

    def test_an_entry_indexed_by_one_response_is_used_by_the_next(self) -> None:
        conn = self.open()
        self.start(conn, "first")
        self.start(conn, "second")
        literal = b"\x40\x0bx-served-by\x06edge-1"      # with incremental indexing: index 62
        conn.receive(h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 1, b"\x88" + literal)
                     + h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 3, b"\x88\xbe"))
        self.assertEqual([(key, dict(response.headers)) for key, response in conn.finished],
                         [("first", {"x-served-by": "edge-1"}),
                          ("second", {"x-served-by": "edge-1"})])

    def test_blocks_on_streams_not_ours_still_change_the_table(self) -> None:
        conn = self.open()
        self.start(conn, "k")
        conn.receive(h2_frame(H2_HEADERS, H2_END_HEADERS, 7, b"\x88\x40\x01a\x01b")
                     + h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 1, b"\x88\xbe"))
        self.assertEqual(dict(self.outcome(conn)[1].headers), {"a": "b"})


# What the fuzz test inserts into valid input: line ends, NUL, superscript two in UTF-8 and
# Latin-1, bytes that are not UTF-8, and the separators the parsers look for.
FUZZ_INSERTIONS = [b"\r", b"\n", b"\r\n", b"\r\n\r\n", b"\0", "\u00b2".encode(), b"\xb2",
                   b"\xff\xfe", b":", b";", b" ", b","]
FUZZ_NUMBERS = [b"9" * 12, b"f" * 20, b"0" * 5000 + b"1", b"9" * 5000, b"-1", b"+1"]


class ParserFuzzTest(unittest.TestCase):
    """Random and mutated input into every parser: only andpush's own errors come out.

    Fixed seeds, so a failure repeats; half a second in all. Anything else raised (an
    IndexError, a TypeError, a UnicodeDecodeError...) is a bug in the parser.
    """

    def setUp(self) -> None:
        self.rng = random.Random(20261130)

    def check_each(self, inputs: Iterable[Any], check: Callable[[Any], None]) -> None:
        """``check`` each input; a failure names the input that caused it (its first 300
        bytes or characters). Cheaper than a subTest per input, which builds a TestCase and
        was a fifth of the fuzz's time; the first failure is enough, the seeds being fixed."""
        for data in inputs:
            try:
                check(data)
            except Exception as exc:
                self.fail("%s: %s\n  for input %r" % (type(exc).__name__, exc, data[:300]))

    def random_bytes(self, most: int = 64) -> bytes:
        size = self.rng.randrange(most)
        return self.rng.getrandbits(8 * size).to_bytes(size, "big") if size else b""

    def mutations(self, valid: bytes, count: int) -> Iterator[bytes]:
        """``count`` variants of ``valid``, each with one to four changes of these kinds."""
        rng = self.rng
        for _ in range(count):
            data = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                where = rng.randrange(len(data) + 1)
                change = rng.randrange(6)
                if change == 0 and data:                                    # a bit flipped
                    data[min(where, len(data) - 1)] ^= 1 << rng.randrange(8)
                elif change == 1:                                           # cut short
                    del data[where:]
                elif change == 2:                                           # a piece lost
                    del data[where:where + rng.randint(1, 9)]
                elif change == 3:
                    data[where:where] = rng.choice(FUZZ_INSERTIONS)
                elif change == 4:
                    data[where:where] = rng.choice(FUZZ_NUMBERS)
                else:
                    data[where:where] = self.random_bytes(9)
            yield bytes(data)

    def pieces(self, data: bytes) -> List[bytes]:
        """``data`` cut at a few random places."""
        cuts = sorted(self.rng.randrange(len(data) + 1) for _ in range(self.rng.randrange(4)))
        return [data[start:end] for start, end in zip([0, *cuts], [*cuts, len(data)])]

    def test_h1_reader(self) -> None:
        answers = [data for _, data, _ in H1ReaderTest.ANSWERS]
        inputs = [self.random_bytes() for _ in range(200)]
        inputs += [b"HTTP/1.1 200 OK\r\n" + self.random_bytes() for _ in range(200)]
        for answer in answers:
            inputs.extend(self.mutations(answer, 500))
        def check(data: bytes) -> None:
            reader = andpush._H1Reader()
            try:
                for piece in self.pieces(data):
                    result = reader.feed(piece)
                if result is None:
                    result = reader.eof()
            except andpush._ProtocolError:
                return
            response, keep_alive = result
            self.assertIsInstance(response.status_code, int)
            self.assertIsInstance(response.body, bytes)
            self.assertIsInstance(keep_alive, bool)
        self.check_each(inputs, check)

    def test_retry_after(self) -> None:
        words = ["0", "1", "7", "9", "60", "99999999999", "\u00b2", "\u0663", "\uff11", " ", "\t",
                 "\n", ",", ":", "-", ".", "e", "GMT", "Sun", "Sunday", "Nov", "Feb", "1994",
                 "94", "00", "29", "31", "08:49:37", "23:59:60", "inf", "nan", "1e999", "0x10",
                 "9" * 400]
        values = ["".join(self.rng.choice(words) for _ in range(self.rng.randrange(8)))
                  for _ in range(3000)]
        for valid in ["Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
                      "Sun Nov  6 08:49:37 1994", "120"]:
            values.extend(data.decode("latin-1") for data in self.mutations(valid.encode(), 600))
        def check(value: str) -> None:
            seconds = andpush._retry_after(value)
            if seconds is not None:
                self.assertIsInstance(seconds, float)
                self.assertGreaterEqual(seconds, 0.0)            # not NaN either
                self.assertLess(seconds, float("inf"))
        self.check_each(values, check)

    def test_hpack_decoder(self) -> None:
        valid = [bytes.fromhex(block) for block in [
            "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",                       # C.3.1
            "8286 84be 5808 6e6f 2d63 6163 6865",                                      # C.3.2
            "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
            "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",                              # C.4.1
            "3fe11f 88 4003616263036465662003",
        ]]
        valid.append(_hpack_encode(ROUND_TRIP_HEADERS))
        valid.append(b"\x04" + bytes((0x80 | 12,)) + huffman_encode(b"/v1/projects/x"))
        blocks = [self.random_bytes() for _ in range(300)]
        for block in valid:
            blocks.extend(self.mutations(block, 600))
        self.rng.shuffle(blocks)
        decoder = _HPACKDecoder(4096)           # one table through it all, as on a connection
        def check(block: bytes) -> None:
            try:
                fields = decoder.decode(block)
            except _HPACKError:
                return
            for name, value in fields:
                self.assertIsInstance(name, str)
                self.assertIsInstance(value, str)
            self.assertLessEqual(decoder.size, decoder.capacity)
        self.check_each(blocks, check)

    def h2_conversation(self) -> bytes:
        """A server's side of a busy connection, after its SETTINGS: answers to streams 1 to 7."""
        block = _hpack_encode([(":status", "200"), ("content-type", "application/json")])
        return b"".join([
            h2_settings((H2_MAX_CONCURRENT_STREAMS, 100), (H2_INITIAL_WINDOW_SIZE, 1 << 16)),
            h2_frame(H2_HEADERS, H2_END_HEADERS, 1, b"\x88\x40\x01a\x01b"),
            h2_frame(H2_DATA, H2_PADDED, 1, b"\x02{}\0\0"),
            h2_frame(H2_DATA, H2_END_STREAM, 1, b""),
            h2_frame(H2_HEADERS, H2_PRIORITY_FLAG, 3, bytes(5) + block[:2]),
            h2_frame(H2_CONTINUATION, H2_END_HEADERS, 3, block[2:]),
            h2_frame(H2_PING, 0, 0, b"12345678"),
            h2_frame(H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000)),
            h2_frame(H2_WINDOW_UPDATE, 0, 3, struct.pack(">I", 1000)),
            h2_frame(H2_DATA, H2_END_STREAM, 3, b'{"name": "x"}'),
            h2_frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 5, b"\x8d\xbe"),
            h2_frame(H2_RST_STREAM, 0, 7, struct.pack(">I", H2_REFUSED_STREAM)),
            h2_frame(H2_GOAWAY, 0, 0, struct.pack(">II", 9, 0) + b"bye"),
        ])

    def frame_mutations(self, frames: List[Frame], count: int) -> Iterator[bytes]:
        """``count`` variants of ``frames``, well framed but with types, flags, streams or
        payloads changed, or frames lost, repeated or swapped: so that they reach past
        the frame headers into each frame's handling."""
        rng = self.rng
        for _ in range(count):
            variant = list(frames)
            for _ in range(rng.randint(1, 3)):
                where = rng.randrange(len(variant))
                kind, flags, stream_id, payload = variant[where]
                change = rng.randrange(7)
                if change == 0:
                    kind = rng.randrange(11)                  # 10: a type we do not know
                elif change == 1:
                    flags = rng.randrange(256)
                elif change == 2:
                    stream_id = rng.choice([0, 1, 2, 3, 5, 7, 9, 11, 2 ** 31 - 1, 2 ** 31 + 1])
                elif change == 3:
                    payload = next(self.mutations(payload, 1))[:16384]
                elif change == 4:
                    del variant[where]
                    continue
                elif change == 5:
                    variant.insert(where, variant[where])
                else:
                    other = rng.randrange(len(variant))
                    variant[where], variant[other] = variant[other], variant[where]
                    continue
                variant[where] = (kind, flags, stream_id, payload)
            yield b"".join(h2_frame(*frame) for frame in variant)

    def test_h2_connection(self) -> None:
        conversation = self.h2_conversation()
        inputs = [self.random_bytes(200) for _ in range(100)]
        inputs += list(self.mutations(conversation, 500))
        inputs += list(self.frame_mutations(h2_frames(conversation), 1000))
        keys = ["stream %d" % n for n in range(5)]
        body = b"x" * 100000  # more than a window: DATA waits for WINDOW_UPDATEs

        def check(data: bytes) -> None:
            conn = andpush._H2Connection("fcm.googleapis.com", "https")
            conn.receive(h2_settings())
            for key in keys:
                conn.start("POST", "/v1/projects/p/messages:send", {}, body, key, 1e9)
            conn.wrote(len(conn.outgoing) // 2)
            try:
                for piece in self.pieces(data):
                    conn.receive(piece)
            except andpush._H2Error as exc:
                conn.abort(exc)
            conn.lost("the end of the test")
            self.assertEqual(sorted(key for key, _ in conn.finished), keys)   # once each
            for _, outcome in conn.finished:
                self.assertIsInstance(outcome, (andpush.Response, andpush.NetworkError,
                                                andpush._NotProcessed))
        self.check_each(inputs, check)

    def random_json(self, depth: int = 0) -> Any:
        """A JSON value with the names an error envelope has, of any type at any depth."""
        rng = self.rng
        kind = rng.randrange(8 if depth < 4 else 5)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.choice([0, -1, 404, 2 ** 70, 1.5, -0.0])
        if kind == 2:
            return rng.choice(["", "UNREGISTERED", "NOT_FOUND", "INTERNAL", "\u00b2", "x" * 500,
                               andpush._FCM_ERROR_TYPE, "\ud800"])
        if kind == 3:
            return [rng.randrange(1000) for _ in range(rng.randrange(4))]
        if kind == 4:
            return {}
        if kind == 5:
            return [self.random_json(depth + 1) for _ in range(rng.randrange(4))]
        names = ["error", "code", "message", "status", "details", "@type", "errorCode",
                 "results", "x"]
        return {rng.choice(names): self.random_json(depth + 1) for _ in range(rng.randrange(6))}

    def error_bodies(self) -> Iterator[bytes]:
        rng = self.rng
        for _ in range(1000):
            envelope = {name: self.random_json(1) for name in
                        rng.sample(["code", "message", "status", "details"], rng.randrange(5))}
            if rng.random() < 0.5:
                envelope["details"] = rng.choice([
                    {"@type": andpush._FCM_ERROR_TYPE, "errorCode": "UNREGISTERED"},
                    [1, 2, 3], [{"@type": andpush._FCM_ERROR_TYPE,
                                 "errorCode": self.random_json(3)}], "details"])
            body = rng.choice([{"error": envelope}, {"error": self.random_json(1)},
                               self.random_json()])
            yield json.dumps(body).encode("utf-8", "surrogatepass")
        yield from [b"", b"null", b"\xff\xfe{}", b'"\\ud800"', b"NaN", b"1" * 5000,
                    b"[" * 100000, b'{"error": ' * 50000]
        yield from self.mutations(b'{"error": {"code": 404, "message": "x", "status": '
                                  b'"NOT_FOUND", "details": [{"@type": "%s", "errorCode": '
                                  b'"UNREGISTERED"}]}}' % andpush._FCM_ERROR_TYPE.encode(), 800)

    def test_json_nested_too_deep_is_not_json(self) -> None:
        # The json module recurses once per level: a server's body must not exhaust the stack.
        for body in [b"[" * 100000, b'{"error": ' * 50000]:
            response = andpush.Response(500, "", andpush.Headers({}), body)
            with self.assertRaisesRegex(ValueError, "not JSON"):
                response.json()
            self.assertIsInstance(andpush._http_error(response), andpush.InternalError)

    def test_json_bodies_and_http_errors(self) -> None:
        def check(body: bytes) -> None:
            status = self.rng.choice([0, 200, 400, 401, 403, 404, 429, 500, 503, 600, 999])
            headers = {"content-type": "application/json",
                       "retry-after": self.rng.choice(["", "1", "x", "\u00b2", "9" * 400])}
            response = andpush.Response(status, "Reason", andpush.Headers(headers), body)
            try:
                response.json()
            except ValueError:
                pass
            error = andpush._http_error(
                andpush.Response(status, "Reason", andpush.Headers(headers), body))
            self.assertIsInstance(error, andpush.HTTPError)
            self.assertTrue(str(error).startswith("HTTP %d Reason" % status), status)
            self.assertIsInstance(error.error_code, (str, type(None)))
        self.check_each(self.error_bodies(), check)


# The HTTP v1 API: credentials, tokens, errors, topics #######################################

class _NoLoop:
    """An I/O loop for credentials that are never asked for a token."""

    def route(self, url: str) -> None:
        return None


#: The access token of V1TestCase.fixed_token_client()'s clients.
FIXED_ACCESS_TOKEN = "ya29.fixed-test-token"


class V1TestCase(ServerTestCase):
    server_class = FakeFCM

    def fixed_token_client(self, **options: Any) -> andpush.Client:
        """A v1 client with a fixed access token that the server takes, for the tests not
        about tokens: they pay for no token request (an RSA signature, 8 ms, and a
        connection of its own)."""
        self.server.valid_tokens.add(FIXED_ACCESS_TOKEN)
        options.setdefault("credentials", None)
        options.setdefault("access_token", FIXED_ACCESS_TOKEN)
        options.setdefault("project_id", TEST_PROJECT)
        return self.v1_client(**options)

    def v1_client(self, **options: Any) -> andpush.Client:
        options.setdefault("credentials", service_account_info(self.server))
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        client = andpush.new(**options)
        self.addCleanup(client.close)
        return client


class V1SendTest(V1TestCase):
    def test_push_posts_the_message_with_a_bearer_token(self) -> None:
        answer = self.v1_client().push(V1_MESSAGE)
        self.assertEqual(answer.json()["name"], "projects/%s/messages/0:1" % TEST_PROJECT)
        token_request, send = self.server.requests
        self.assertEqual(token_request.path, "/token")
        self.assertEqual(send.path, "/v1/projects/%s/messages:send" % TEST_PROJECT)
        self.assertEqual(send.headers["authorization"], "Bearer " + self.server.issued[0])
        self.assertEqual(send.json, {"message": V1_MESSAGE, "validate_only": False})

    def test_a_key_file_without_private_key_id_sends_no_kid(self) -> None:
        info = service_account_info(self.server)
        del info["private_key_id"]
        assertion = andpush._ServiceAccount(info, _NoLoop()).assertion(1000)  # type: ignore[arg-type]
        header = json.loads(b64url_decode(assertion.split(".")[0]))
        self.assertEqual(header, {"alg": "RS256", "typ": "JWT"})
        info["private_key_id"] = "abc123"
        assertion = andpush._ServiceAccount(info, _NoLoop()).assertion(1000)  # type: ignore[arg-type]
        header = json.loads(b64url_decode(assertion.split(".")[0]))
        self.assertEqual(header, {"alg": "RS256", "typ": "JWT", "kid": "abc123"})

    def test_the_jwt_carries_the_claims_google_checks(self) -> None:
        self.v1_client().push(V1_MESSAGE)
        claims = self.server.jwt_claims[0]
        self.assertEqual(claims["iss"], TEST_CLIENT_EMAIL)
        self.assertEqual(claims["scope"], FCM_SCOPE)
        self.assertEqual(claims["exp"] - claims["iat"], 3600)

    def test_validate_only(self) -> None:
        answer = self.v1_client().push(V1_MESSAGE, validate_only=True)
        self.assertTrue(answer.json()["name"].endswith("fake_message_id"))
        self.assertIs(self.server.requests[-1].json["validate_only"], True)

    def test_credentials_as_a_path_a_dict_or_a_json_string(self) -> None:
        info = service_account_info(self.server)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "key.json")
            with open(path, "w") as file:
                json.dump(info, file)
            for credentials in (path, pathlib.Path(path), info, json.dumps(info)):
                with self.subTest(type(credentials).__name__):
                    self.v1_client(credentials=credentials).push(V1_MESSAGE)

    def test_pkcs1_keys_work_too(self) -> None:
        info = service_account_info(self.server, TEST_RSA_KEY_PKCS1_PEM)
        self.v1_client(credentials=info).push(V1_MESSAGE)

    def test_project_id_overrides_the_key_files(self) -> None:
        self.v1_client(project_id="other").push(V1_MESSAGE)
        self.assertEqual(self.server.requests[-1].path, "/v1/projects/other/messages:send")

    def test_a_fixed_access_token_or_a_callable(self) -> None:
        self.server.valid_tokens.add("fixed")
        self.v1_client(credentials=None, access_token="fixed", project_id="p").push(V1_MESSAGE)
        calls = []

        def fresh() -> str:
            calls.append(1)
            return "fixed"

        client = self.v1_client(credentials=None, access_token=fresh, project_id="p")
        client.push(V1_MESSAGE)
        client.push(V1_MESSAGE)
        self.assertEqual(len(calls), 2)
        self.assertEqual([r.headers["authorization"] for r in self.server.requests],
                         ["Bearer fixed"] * 3)

    def test_an_access_token_that_cannot_go_in_a_header_is_refused(self) -> None:
        for bad in ["", "a\nb", "a\rb", "a\x00b", "a b", "caf\u00e9", "a\tb"]:
            with self.subTest(bad=bad):
                client = self.v1_client(credentials=None, access_token=bad, project_id="p")
                with self.assertRaisesRegex(andpush.AuthError, "visible ASCII"):
                    client.push(V1_MESSAGE)
        self.assertEqual(self.server.processed, 0)

    def test_repr_names_the_api_only(self) -> None:
        client = self.v1_client()
        self.assertEqual(repr(client), "<andpush.Client v1 %s>" % self.server.endpoint)


class MessageValidationTest(unittest.TestCase):
    def test_bad_v1_messages(self) -> None:
        table: List[Tuple[Any, type, str]] = [
            ("text", TypeError, "must be a dict"),
            ({"notification": {}}, ValueError, "exactly one target.*none"),
            ({"token": "a", "topic": "b"}, ValueError, "exactly one target.*token, topic"),
            ({"token": ""}, ValueError, "a device token is empty"),
            ({"topic": "/topics/bad topic"}, ValueError, "'bad topic' is not a valid topic"),
            ({"topic": "bad topic!"}, ValueError, "not a valid topic"),
            ({"token": "a", "data": {"n": 1}}, TypeError, r"data\['n'\] must be a str"),
            ({"token": "a", "data": {"from": "x"}}, ValueError, "reserved"),
            ({"token": "a", "data": {"google.x": "x"}}, ValueError, "reserved"),
            ({"token": "a", "android": {"data": {"ok": True}}}, TypeError, "android.data"),
            ({"token": "a", "apns": {"headers": {1, 2}}}, TypeError, "apns.headers must be a dict"),
        ]
        api = andpush._V1API(andpush._StaticToken("t", "p"), "p", andpush._Clock())
        for message, error, pattern in table:
            with self.subTest(message=message):
                with self.assertRaisesRegex(error, pattern):
                    api.prepare(message, False)

    def test_fields_fcm_would_refuse_are_refused_with_what_to_fix(self) -> None:
        big = {"k%d" % i: "v" * 100 for i in range(40)}  # 40 * (2 or 3 + 100) = 4,110 bytes
        table: List[Tuple[Dict[str, Any], type, str]] = [
            ({"notification": "hi"}, TypeError, "notification must be a dict"),
            ({"notification": {"title": 5}}, TypeError, "notification.title must be a str"),
            ({"notification": {"body": ["x"]}}, TypeError, "notification.body must be a str"),
            ({"notification": {"image": b"x"}}, TypeError, "notification.image must be a str"),
            ({"android": []}, TypeError, "android must be a dict"),
            ({"android": {"priority": "urgent"}}, ValueError,
             'android.priority must be "normal" or "high", got \'urgent\''),
            ({"android": {"priority": 10}}, ValueError, "android.priority"),
            ({"android": {"ttl": 3600}}, ValueError, 'android.ttl must be a duration.*"3600s"'),
            ({"android": {"ttl": "3600"}}, ValueError, "android.ttl"),
            ({"android": {"ttl": "-1s"}}, ValueError, "android.ttl"),
            ({"android": {"ttl": "2419201s"}}, ValueError, "0 to 2419200 seconds"),
            ({"android": {"ttl": "2419200.5s"}}, ValueError, "android.ttl"),
            ({"android": {"ttl": "\u0663s"}}, ValueError, "android.ttl"),
            ({"android": {"ttl": "1.1234567890s"}}, ValueError, "android.ttl"),
            ({"android": {"notification": {"color": "red"}}}, ValueError,
             "android.notification.color must be #rrggbb"),
            ({"android": {"notification": {"color": "#ff00"}}}, ValueError, "#rrggbb"),
            ({"fcm_options": {"analytics_label": "has space"}}, ValueError,
             "fcm_options.analytics_label must be 1 to 50"),
            ({"fcm_options": {"analytics_label": "x" * 51}}, ValueError, "analytics_label"),
            ({"fcmOptions": {"analyticsLabel": "a/b"}}, ValueError, "analytics_label"),
            ({"android": {"fcm_options": {"analytics_label": ""}}}, ValueError,
             "android.fcm_options.analytics_label"),
            ({"apns": {"fcm_options": {"analytics_label": "\u00e9"}}}, ValueError,
             "apns.fcm_options.analytics_label"),
            ({"webpush": {"fcm_options": {"analytics_label": 7}}}, ValueError,
             "webpush.fcm_options.analytics_label"),
            ({"apns": {"headers": {"apns-priority": 10}}}, TypeError,
             r"apns.headers\['apns-priority'\] must be a str, got int"),
            ({"webpush": {"headers": {"TTL": 60}}}, TypeError, r"webpush.headers\['TTL'\]"),
            ({"webpush": {"fcm_options": {"link": "http://example.com"}}}, ValueError,
             "webpush.fcm_options.link must be an https:// URL"),
            ({"webpush": {"fcm_options": {"link": "/relative"}}}, ValueError, "https://"),
            ({"data": big}, ValueError,
             "message data is 41.. bytes .its keys and values in UTF-8., but FCM takes at most "
             "4096"),
            ({"data": {"k": "\u20ac" * 1366}}, ValueError, "data is 4099 bytes"),
            ({"android": {"data": big}}, ValueError, "android.data is"),
            ({"webpush": {"data": big}}, ValueError, "webpush.data is"),
        ]
        api = andpush._V1API(andpush._StaticToken("t", "p"), "p", andpush._Clock())
        for fields, error, pattern in table:
            with self.subTest(fields=str(fields)[:60]):
                with self.assertRaisesRegex(error, pattern) as caught:
                    api.prepare(dict(fields, token=TOKEN), False)
                self.assertNotIn(TOKEN, str(caught.exception))

    def test_what_fcm_takes_is_let_through(self) -> None:
        full = {"k%d" % i: "v" * 100 for i in range(39)}  # 39 * 103 + 1 = 4,018 bytes
        full["k"] = "v" * (4096 - andpush._data_size(full) - 1)
        self.assertEqual(andpush._data_size(full), 4096)
        api = andpush._V1API(andpush._StaticToken("t", "p"), "p", andpush._Clock())
        for fields in [
            {"notification": {"title": "T", "body": "B", "image": "https://x/i.png"}},
            {"notification": {"title": None}},
            {"android": {"priority": "high", "ttl": "0s"}},
            {"android": {"priority": "NORMAL", "ttl": "2419200s"}},
            {"android": {"priority": "High", "ttl": "0.5s"}},
            {"android": {"ttl": "3.123456789s", "notification": {"color": "#A0b1C2"}}},
            {"fcm_options": {"analytics_label": "a-Z_0.9~%" + "x" * 41}},
            {"fcmOptions": {"analyticsLabel": "campaign"}},
            {"apns": {"headers": {"apns-priority": "10"}, "payload": {"aps": {"badge": 1}}}},
            {"webpush": {"headers": {"TTL": "60"}, "fcm_options": {"link": "HTTPS://x.org/"}}},
            {"data": full},
        ]:
            with self.subTest(fields=str(fields)[:60]):
                api.prepare(dict(fields, token=TOKEN), False)

    def test_legacy_messages_get_the_checks_of_the_fields_they_share(self) -> None:
        api = andpush._LegacyAPI(SERVER_KEY)
        big = {"k%d" % i: "v" * 100 for i in range(40)}
        table: List[Tuple[Dict[str, Any], type, str]] = [
            ({"priority": "urgent"}, ValueError, 'priority must be "normal" or "high"'),
            ({"time_to_live": "3600"}, ValueError, "time_to_live must be an int of 0 to 2419200"),
            ({"time_to_live": 2419201}, ValueError, "time_to_live"),
            ({"time_to_live": -1}, ValueError, "time_to_live"),
            ({"time_to_live": True}, ValueError, "time_to_live"),
            ({"notification": {"title": 1}}, TypeError, "notification.title must be a str"),
            ({"notification": {"color": "blue"}}, ValueError, "notification.color must be"),
            ({"data": big}, ValueError, "data is 41.. bytes"),
            ({"data": {"n": "x" * 4000, "list": list(range(40))}}, ValueError, "data is 4116 "),
        ]
        for fields, error, pattern in table:
            with self.subTest(fields=str(fields)[:60]):
                with self.assertRaisesRegex(error, pattern) as caught:
                    api.prepare(dict(fields, to=TOKEN), False)
                self.assertNotIn(TOKEN, str(caught.exception))
        for fields in [{"priority": "high", "time_to_live": 0}, {"time_to_live": 2419200},
                       {"priority": "normal", "notification": {"color": "#ffffff"}},
                       {"data": {"n": 1, "ok": True}}]:
            with self.subTest(fields=fields):
                api.prepare(dict(fields, to=TOKEN), False)

    def test_many_tokens_in_one_message_point_to_push_multicast(self) -> None:
        api = andpush._V1API(andpush._StaticToken("t", "p"), "p", andpush._Clock())
        for field in ("tokens", "registration_ids"):
            with self.subTest(field):
                with self.assertRaisesRegex(ValueError, r"leave '%s' out and call "
                                            r"client\.push_multicast\(message, tokens\)" % field):
                    api.prepare({field: ["a", "b"], "notification": {"title": "Hi"}}, False)

    def test_good_targets(self) -> None:
        api = andpush._V1API(andpush._StaticToken("t", "p"), "p", andpush._Clock())
        for message in ({"topic": "news-1_a.b~c%d"}, {"condition": "'a' in topics"},
                        {"fid": "f"}, {"token": "t", "data": {"k": "v"}}):
            api.prepare(message, False)


def camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def snake_case(name: str) -> str:
    return re.sub(r"[A-Z]", lambda upper: "_" + upper.group().lower(), name)


def every_field(snake: bool) -> Dict[str, Any]:
    """A v1 message that sets every field andpush knows, with values FCM takes, under the
    snake_case names (or, with ``snake`` False, the lowerCamelCase ones)."""
    def named(section: Dict[str, Any]) -> Dict[str, Any]:
        return {(key if snake else camel_case(key)): value for key, value in section.items()}
    color = {"red": 0.1, "green": 0.2, "blue": 0.3, "alpha": 1.0}
    lights = named({"color": color, "light_on_duration": "0.5s", "light_off_duration": "1s"})
    android_notification = named({
        "title": "T", "body": "B", "icon": "ic", "color": "#ff8800", "sound": "default",
        "tag": "t", "image": "https://x/i.png", "click_action": "OPEN", "body_loc_key": "k",
        "body_loc_args": ["a"], "title_loc_key": "k", "title_loc_args": ["a"],
        "channel_id": "c", "ticker": "t", "sticky": True, "event_time": "2024-01-01T00:00:00Z",
        "local_only": True, "notification_priority": "PRIORITY_HIGH", "default_sound": True,
        "default_vibrate_timings": True, "default_light_settings": True,
        "vibrate_timings": ["0.5s"], "visibility": "PUBLIC", "notification_count": 3,
        "light_settings": lights, "bypass_proxy_notification": True, "proxy": "ALLOW",
    })
    android = named({
        "collapse_key": "c", "priority": "high", "ttl": "60s",
        "restricted_package_name": "com.example", "data": {"titel": "free-form"},
        "notification": android_notification, "fcm_options": named({"analytics_label": "a"}),
        "direct_boot_ok": True, "bandwidth_constrained_ok": True,
        "restricted_satellite_ok": True,
    })
    apns = named({
        "headers": {"apns-priority": "10", "apns-push-type": "alert"},
        "payload": {"aps": {"alert": {"title": "T"}, "badge": 1}, "anything": [1, {"x": 2}]},
        "fcm_options": named({"analytics_label": "a", "image": "https://x/i.png"}),
        "live_activity_token": "lat",
    })
    webpush = named({
        "headers": {"Urgency": "high", "TTL": "60"}, "data": {"notificaton": "free-form"},
        "notification": {"title": "T", "requireInteraction": True, "actions": [{"action": "a"}]},
        "fcm_options": named({"link": "https://example.com", "analytics_label": "a"}),
    })
    return named({
        "token": TOKEN, "data": {"andriod": "keys here are free-form"},
        "notification": {"title": "T", "body": "B", "image": "https://x/i.png"},
        "android": android, "apns": apns, "webpush": webpush,
        "fcm_options": named({"analytics_label": "a"}),
        "android_v2": {"remote_notification": {"anything": "FCM's preview, passed on"}},
    })


class JSONEncodingTest(unittest.TestCase):
    """Messages are encoded as json.JSONEncoder encodes them (compact, UTF-8 unescaped),
    with the C encoder made once, or without it where json has none."""

    VALUES: List[Any] = [
        {"message": {"token": "t\u00e9\"\\\n", "data": {"k": "\U0001f600"}}},
        {"n": [1, -2.5, 1e300, True, False, None], "": {}}, "a\x00b", [], 7,
    ]

    def encoders(self) -> Dict[str, Callable[[Any], str]]:
        with unittest.mock.patch.dict(sys.modules, {"_json": None}):  # no C accelerator
            plain = andpush._json_encoder()
        return {"made once": andpush._json_encoder(), "without _json": plain}

    def test_each_value_is_encoded_as_json_encodes_it(self) -> None:
        expected = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
        for name, encode in self.encoders().items():
            for value in self.VALUES:
                with self.subTest(name, value=value):
                    self.assertEqual(encode(value), expected.encode(value))

    def test_on_cpython_the_c_encoder_is_called_directly(self) -> None:
        encoders = self.encoders()
        self.assertIsInstance(getattr(encoders["without _json"], "__self__", None),
                              json.JSONEncoder)
        self.assertIsNone(getattr(encoders["made once"], "__self__", None))

    def test_what_json_refuses_is_refused_alike(self) -> None:
        for name, encode in self.encoders().items():
            with self.subTest(name):
                with self.assertRaisesRegex(TypeError, "not JSON serializable"):
                    encode({"when": datetime.datetime.now()})
                with self.assertRaisesRegex(ValueError, "Out of range float"):
                    encode({"x": float("nan")})


class MessageFieldsTest(unittest.TestCase):
    """A field FCM does not know is refused before sending when it is a slip (a typo, the
    request body around the message, a legacy field, a field of another place), with what
    to write instead; what FCM takes, in either spelling, goes out as it is."""

    def setUp(self) -> None:
        self.api = andpush._V1API(andpush._StaticToken("t", "p"), "p", andpush._Clock())

    def test_slips_are_refused_with_the_field_meant(self) -> None:
        table: List[Tuple[Dict[str, Any], str]] = [
            ({"notificaton": {"title": "Hi"}},
             "message 'notificaton' is not a field FCM knows: did you mean 'notification'?"),
            ({"Notification": {}}, "did you mean 'notification'"),
            ({"andriod": {}}, "did you mean 'android'"),
            ({"fcm_option": {}}, "did you mean 'fcm_options'"),
            ({"notification": {"titel": "x"}},
             "message notification.titel is not a field FCM knows: did you mean 'title'?"),
            ({"android": {"priorty": "high"}}, "android.priorty .* did you mean 'priority'"),
            ({"android": {"notification": {"chanel_id": "c"}}},
             "android.notification.chanel_id .* did you mean 'channel_id'"),
            ({"android": {"notification": {"ChannelId": "c"}}}, "did you mean 'channelId'"),
            ({"android": {"notification": {"light_settings": {"colour": {}}}}},
             r"android.notification.light_settings.colour .* did you mean 'color'"),
            ({"android": {"notification": {"light_settings": {"color": {"reed": 1}}}}},
             r"light_settings.color.reed .* did you mean 'red'"),
            ({"apns": {"header": {}}}, "apns.header .* did you mean 'headers'"),
            ({"webpush": {"fcm_options": {"links": "https://x"}}},
             "webpush.fcm_options.links .* did you mean 'link'"),
            ({"fcmOptions": {"analyticLabel": "a"}}, "did you mean 'analyticsLabel'"),
            ({"title": "Hi"}, "message 'title' is not a field FCM knows there: it goes in "
             "android.notification.title or notification.title"),
            ({"notification": {"sound": "default"}},
             "message notification.sound .* it goes in android.notification.sound"),
            ({"notification": {"click_action": "OPEN"}}, "android.notification.click_action"),
            ({"android": {"sound": "default"}}, "it goes in android.notification.sound"),
            ({"android": {"headers": {}}}, "it goes in apns.headers or webpush.headers"),
            ({"priority": "high"}, "message 'priority' is a field of the legacy API; in a v1 "
             "message it is android.priority, and apns.headers 'apns-priority'"),
            ({"time_to_live": 60}, r"android.ttl \(a string, such as \"3600s\"\)"),
            ({"collapse_key": "c"}, "android.collapse_key"),
            ({"content_available": True}, "content-available"),
            ({"mutable_content": True}, "mutable-content"),
            ({"dry_run": True}, "pass validate_only=True to push"),
            ({"restricted_package_name": "x"}, "android.restricted_package_name"),
        ]
        for fields, pattern in table:
            with self.subTest(fields=str(fields)[:60]):
                with self.assertRaisesRegex(ValueError, pattern) as caught:
                    self.api.prepare(dict(fields, token=TOKEN), False)
                self.assertNotIn(TOKEN, str(caught.exception))

    def test_the_request_body_and_the_legacy_shape_say_what_to_pass(self) -> None:
        table: List[Tuple[Dict[str, Any], str]] = [
            ({"message": {"token": TOKEN}},
             r'the body of a v1 request, \{"message": \{...\}\}: pass the message inside it, '
             r'as in client.push\(body\["message"\]\)'),
            ({"message": {"token": TOKEN}, "validate_only": True}, "validate_only=True"),
            ({"to": TOKEN, "notification": {"title": "Hi"}},
             "message 'to' is a field of the legacy API; in a v1 message the target is "
             "'token' .a device., 'topic' .a name, without /topics/. or 'condition'"),
            ({"registration_ids": [TOKEN]}, r"call client.push_multicast\(message, tokens\)"),
        ]
        for message, pattern in table:
            with self.subTest(message=str(message)[:60]):
                with self.assertRaisesRegex(ValueError, pattern) as caught:
                    self.api.prepare(message, False)
                self.assertNotIn(TOKEN, str(caught.exception))

    def test_every_field_fcm_knows_goes_out_under_either_name(self) -> None:
        for snake in (True, False):
            with self.subTest("snake_case" if snake else "lowerCamelCase"):
                message = every_field(snake)
                path, body, _ = self.api.prepare(message, False)
                self.assertEqual(json.loads(body)["message"], message)

    def test_every_known_field_has_both_names_and_is_tried_above(self) -> None:
        def walk(value: Any, where: str) -> Set[Tuple[str, str]]:
            tried = set()
            if where in andpush._KNOWN_FIELDS and isinstance(value, dict):
                for key, item in value.items():
                    tried.add((where, key))
                    tried |= walk(item, (where + "." if where else "") + snake_case(key))
            return tried

        known = {(where, name) for where, names in andpush._KNOWN_FIELDS.items()
                 for name in names}
        for where, name in known:
            with self.subTest(where=where, name=name):
                self.assertIn(camel_case(name) if "_" in name else snake_case(name),
                              andpush._KNOWN_FIELDS[where])
        tried = walk(every_field(True), "") | walk(every_field(False), "")
        self.assertEqual(tried - known, set())
        self.assertEqual(known - tried, {("", name) for name in ("name", "topic", "condition",
                                                                 "fid")})

    def test_maps_are_free_form_and_an_unlike_name_is_left_to_fcm(self) -> None:
        for fields in [
            {"data": {"notificaton": "a key like a field", "title": "x"}},
            {"apns": {"headers": {"titel": "x"}, "payload": {"notificaton": {"a": 1}}}},
            {"webpush": {"notification": {"silent": True, "badge": "/b.png"}}},
            {"a_field_fcm_may_add_one_day": {"x": 1}},
            {"android": {"bandwidth_constrained_ok": True, "zz_future": 1}},
            {"name": "projects/p/messages/1"},
        ]:
            with self.subTest(fields=str(fields)[:60]):
                path, body, _ = self.api.prepare(dict(fields, token=TOKEN), False)
                self.assertEqual(json.loads(body)["message"], dict(fields, token=TOKEN))

    def test_a_typical_message_is_checked_without_looking_for_slips(self) -> None:
        with unittest.mock.patch.object(andpush, "_check_fields") as slips:
            self.api.prepare(dict(V1_MESSAGE, data={"k": "v"}), False)
        slips.assert_not_called()

    def test_a_legacy_client_checks_the_target(self) -> None:
        api = andpush._LegacyAPI(SERVER_KEY)
        table: List[Tuple[Dict[str, Any], type, str]] = [
            ({"token": TOKEN}, ValueError, "this is a v1 message .its target is 'token'.; the "
             "legacy API's target is 'to'.*make the client with credentials="),
            ({"topic": "news"}, ValueError, "its target is 'topic'"),
            ({"notification": {"title": "Hi"}}, ValueError,
             "needs exactly one target of to, registration_ids or condition; got none"),
            ({"to": TOKEN, "condition": "'a' in topics"}, ValueError, "got to, condition"),
            ({"to": ""}, ValueError, "a device token is empty"),
            ({"to": 5}, TypeError, "a device token must be a str, got int"),
            ({"registration_ids": TOKEN}, TypeError, "registration_ids must be a non-empty list"),
            ({"registration_ids": [TOKEN, ""]}, ValueError, "a device token is empty"),
        ]
        for message, error, pattern in table:
            with self.subTest(message=str(message)[:60]):
                with self.assertRaisesRegex(error, pattern) as caught:
                    api.prepare(message, False)
                self.assertNotIn(TOKEN, str(caught.exception))
        for message in ({"to": "/topics/news"}, {"condition": "'a' in topics"},
                        {"registration_ids": [TOKEN, "b"]}, {"to": TOKEN}):
            api.prepare(message, False)

    def test_push_many_of_one_dict_is_one_type_error(self) -> None:
        client = andpush.new(SERVER_KEY, ssl_context=client_context())
        self.addCleanup(client.close)
        with self.assertRaisesRegex(TypeError, r"push_many takes many messages, not one dict: "
                                    r"push\(message\) sends one"):
            client.push_many(V1_MESSAGE)  # type: ignore[call-overload]

    def test_google_services_json_is_named_for_what_it_is(self) -> None:
        config = {"project_info": {"project_id": "p", "project_number": "1"},
                  "client": [{"api_key": [{"current_key": "AIza-not-a-secret-here"}]}],
                  "configuration_version": "1"}
        with self.assertRaisesRegex(andpush.AuthError, "google-services.json, the Android "
                                    "app's Firebase config.*Service accounts, Generate new "
                                    "private key"):
            andpush.new(credentials=config, ssl_context=client_context())


class DeviceTokenTest(V1TestCase):
    """An empty or non-str device token gets the same error from push, push_multicast and
    subscribe; a topic's /topics/ prefix is dropped, as firebase-admin drops it."""

    def test_an_empty_token_is_one_value_error_everywhere(self) -> None:
        client = self.fixed_token_client()
        with self.assertRaisesRegex(ValueError, "^a device token is empty"):
            client.push({"token": "", "data": {"k": "v"}})
        with self.assertRaisesRegex(TypeError, "^a device token must be a str, got int"):
            client.push({"token": 5, "data": {"k": "v"}})  # type: ignore[typeddict-item]
        pairs = list(client.push_multicast({"data": {"k": "v"}}, ["", 5, "ok"]))  # type: ignore[list-item]
        self.assertRegex(str(pairs[0][1]), "^a device token is empty")
        self.assertIsInstance(pairs[0][1], ValueError)
        self.assertRegex(str(pairs[1][1]), "^a device token must be a str, got int")
        self.assertIsInstance(pairs[1][1], TypeError)
        self.assertIsInstance(pairs[2][1], andpush.Response)
        with self.assertRaisesRegex(ValueError, "^a device token is empty"):
            client.subscribe(["ok", ""], "news")
        self.assertEqual(tokens_sent(self.server), ["ok"])

    def test_the_topics_prefix_is_dropped_in_push_and_subscribe(self) -> None:
        client = self.fixed_token_client()
        message = {"topic": "/topics/news", "data": {"k": "v"}}
        client.push(message)
        self.assertEqual(self.server.requests[-1].json["message"]["topic"], "news")
        self.assertEqual(message["topic"], "/topics/news")  # the caller's dict is left as it is
        client.subscribe(["a"], "/topics/news")
        self.assertEqual(self.server.subscriptions, {("a", "news")})
        with self.assertRaisesRegex(ValueError, "'bad topic!' is not a valid topic name"):
            client.subscribe(["a"], "/topics/bad topic!")


class BulkCountsTest(V1TestCase):
    """What push_many and push_multicast return counts its successes and failures, as
    firebase-admin's BatchResponse does, and a Response names its message's id."""

    def test_push_many_counts_the_pairs_given_by_the_loop_and_by_close(self) -> None:
        self.server.by_token.update({"t1": [fcm_error(404, "UNREGISTERED")],
                                     "t3": [fcm_error(400, "INVALID_ARGUMENT")]})
        messages: List[andpush.Message] = [{"token": "t%d" % i, "data": {"k": "v"}}
                                           for i in range(6)]
        messages.insert(2, {"token": "", "data": {}})  # refused before sending: a failure
        client = self.fixed_token_client()
        outcomes = client.push_many(messages, concurrency=2)
        self.assertEqual((outcomes.success_count, outcomes.failure_count), (0, 0))
        self.assertEqual(len(list(outcomes)), 7)
        self.assertEqual((outcomes.success_count, outcomes.failure_count), (4, 3))
        self.assertEqual(outcomes.close(), [])
        self.assertEqual((outcomes.success_count, outcomes.failure_count), (4, 3))
        self.server.by_token["t1"] = [fcm_error(404, "UNREGISTERED")]
        stopped = client.push_many(messages, concurrency=2)
        for _ in range(3):
            next(stopped)
        self.assertEqual((stopped.success_count, stopped.failure_count), (1, 2))
        rest = stopped.close()  # the messages read by then, sent and answered
        failed = sum(isinstance(outcome, Exception) for _, outcome in rest)
        self.assertEqual((stopped.success_count, stopped.failure_count),
                         (1 + len(rest) - failed, 2 + failed))

    def test_push_multicast_counts_too(self) -> None:
        self.server.by_token["b"] = [fcm_error(404, "UNREGISTERED")]
        outcomes = self.fixed_token_client().push_multicast({"data": {"k": "v"}}, ["a", "b", "c"])
        self.assertEqual([token for token, _ in outcomes], ["a", "b", "c"])
        self.assertEqual((outcomes.success_count, outcomes.failure_count), (2, 1))

    def test_a_legacy_refusal_of_the_token_counts_as_a_failure(self) -> None:
        self.server.unregistered_tokens.add("gone")
        with andpush.new(SERVER_KEY, endpoint=self.server.endpoint,
                         ssl_context=client_context()) as legacy:
            outcomes = legacy.push_multicast({"data": {"k": "v"}}, ["ok", "gone"])
            pairs = list(outcomes)
        self.assertIsInstance(pairs[1][1], andpush.Response)  # a 200, as push() returns it
        self.assertEqual((outcomes.success_count, outcomes.failure_count), (1, 1))

    def test_the_message_id_of_a_v1_and_of_a_legacy_answer(self) -> None:
        answer = self.fixed_token_client().push(V1_MESSAGE)
        self.assertEqual(answer.message_id, answer.json()["name"])
        self.assertRegex(str(answer.message_id), r"^projects/%s/messages/0:\d+$" % TEST_PROJECT)
        table: List[Tuple[Any, Optional[str]]] = [
            ({"results": [{"message_id": "0:1%abc"}]}, "0:1%abc"),
            ({"message_id": 6123}, "6123"),  # a legacy topic message's answer
            ({"results": [{"message_id": "a"}, {"message_id": "b"}]}, None),  # one per token
            ({"results": [{"error": "NotRegistered"}]}, None),
            ({}, None), ([1], None),
        ]
        for body, expected in table:
            with self.subTest(body=body):
                self.assertEqual(response(200, body).message_id, expected)
        self.assertIsNone(andpush.Response(200, "OK", andpush.Headers({}), b"<html>").message_id)


class JwtAudienceTest(unittest.TestCase):
    """The JWT's aud is Google's fixed audience for Google's token endpoints (as google-auth
    signs it, whatever token_uri says), and token_uri itself for any other."""

    def audience(self, token_uri: Optional[str]) -> str:
        info = {"type": "service_account", "client_email": TEST_CLIENT_EMAIL,
                "private_key": TEST_RSA_KEY_PKCS8_PEM}
        if token_uri is not None:
            info["token_uri"] = token_uri
        assertion = andpush._ServiceAccount(info, _NoLoop()).assertion(1000)  # type: ignore[arg-type]
        return str(json.loads(b64url_decode(assertion.split(".")[1]))["aud"])

    def test_googles_endpoints_get_googles_audience(self) -> None:
        for token_uri in (None, "https://oauth2.googleapis.com/token",
                          "https://accounts.google.com/o/oauth2/token",
                          "https://www.googleapis.com/oauth2/v4/token",
                          "https://OAuth2.GoogleAPIs.com/token"):
            with self.subTest(token_uri=token_uri):
                self.assertEqual(self.audience(token_uri), "https://oauth2.googleapis.com/token")

    def test_any_other_endpoint_is_its_own_audience(self) -> None:
        for token_uri in ("https://127.0.0.1:8443/token", "https://auth.example.com/token",
                          "https://googleapis.com.example.net/token",
                          "http://oauth2.googleapis.com/token"):
            with self.subTest(token_uri=token_uri):
                self.assertEqual(self.audience(token_uri), token_uri)


class V1ErrorTest(V1TestCase):
    def test_each_fcm_error_raises_its_class_and_is_processed_once(self) -> None:
        table = [
            (fcm_error(400, "INVALID_ARGUMENT"), andpush.InvalidArgumentError),
            (fcm_error(404, "UNREGISTERED"), andpush.UnregisteredError),
            (fcm_error(403, "SENDER_ID_MISMATCH"), andpush.SenderIdMismatchError),
            (fcm_error(429, "QUOTA_EXCEEDED"), andpush.QuotaExceededError),
            (fcm_error(503, "UNAVAILABLE"), andpush.UnavailableError),
            (fcm_error(500, "INTERNAL"), andpush.InternalError),
            (fcm_error(401, "THIRD_PARTY_AUTH_ERROR"), andpush.ThirdPartyAuthError),
            (fcm_error(404, None), andpush.ClientError),
        ]
        client = self.v1_client()
        client.push(V1_MESSAGE)  # the access token first
        clock = FakeClock.install(client)
        for reply, cls in table:
            with self.subTest(cls.__name__):
                clock.time += andpush._MAX_RETRY_WAIT  # past the pause the 429 starts
                self.server.inject(reply)
                before = self.server.processed
                with self.assertRaises(cls) as caught:
                    client.push(V1_MESSAGE)
                self.assertIs(type(caught.exception), cls)
                self.assertEqual(self.server.processed, before + 1)

    def test_a_rejected_token_is_refreshed_and_the_push_sent_once_more(self) -> None:
        client = self.v1_client()
        client.push(V1_MESSAGE)
        self.server.revoke_tokens()
        client.push(V1_MESSAGE)
        self.assertEqual(len(self.server.issued), 2)
        sends = [r for r in self.server.requests if r.path.endswith(":send")]
        self.assertEqual(len(sends), 3)  # the rejected one, and the one that went through

    def test_a_token_rejected_twice_raises(self) -> None:
        client = self.v1_client()
        client.push(V1_MESSAGE)
        self.server.by_token[TOKEN] = [fcm_error(401, None), fcm_error(401, None)]
        with self.assertRaises(andpush.AuthError) as caught:
            client.push(V1_MESSAGE)
        self.assertIsInstance(caught.exception, andpush.UnauthenticatedError)
        self.assertEqual(caught.exception.status_code, 401)

    def test_permission_denied_is_caught_as_an_auth_error_and_not_retried(self) -> None:
        client = self.v1_client()
        client.push(V1_MESSAGE)
        self.server.inject(fcm_error(403, None, "Permission denied"))
        before = self.server.processed
        with self.assertRaises(andpush.AuthError) as caught:
            client.push(V1_MESSAGE)
        self.assertIsInstance(caught.exception, andpush.PermissionDeniedError)
        self.assertEqual(self.server.processed, before + 1)
        self.assertEqual(len(self.server.issued), 1)


class TokenTest(V1TestCase):
    def test_the_token_is_cached(self) -> None:
        client = self.v1_client()
        for _ in range(5):
            client.push(V1_MESSAGE)
        self.assertEqual(len(self.server.issued), 1)

    def test_a_token_near_expiry_is_refreshed_before_use(self) -> None:
        self.server.token_lifetime = 200  # inside the refresh margin: stale at once
        client = self.v1_client()
        client.push(V1_MESSAGE)
        client.push(V1_MESSAGE)
        self.assertEqual(len(self.server.issued), 2)
        self.assertEqual(self.server.processed, 4)

    def test_sixteen_threads_cause_one_token_request(self) -> None:
        self.server.slow_seconds = 0.05
        self.server.inject(SLOW)  # the first request: the token's, which all wait for
        client = self.v1_client(pool_size=16)
        barrier = threading.Barrier(16)

        def send() -> None:
            barrier.wait()
            client.push(V1_MESSAGE)

        threads = [threading.Thread(target=send) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(len(self.server.issued), 1)
        self.assertEqual(self.server.processed, 17)

    def test_a_failed_token_request_is_shared_by_the_waiting_threads(self) -> None:
        self.server.reply_delay = 0.05
        self.server.inject(Reply(400, json={"error": "invalid_grant",
                                             "error_description": "Invalid JWT Signature."}))
        client = self.v1_client(pool_size=8)
        errors: List[BaseException] = []
        barrier = threading.Barrier(8)

        def send() -> None:
            barrier.wait()
            try:
                client.push(V1_MESSAGE)
            except andpush.AuthError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Every thread that was waiting for the failed request got its error; one that came
        # later may have fetched a token of its own. Never one token request per thread.
        token_requests = [r for r in self.server.requests if r.path == "/token"]
        self.assertGreaterEqual(len(errors), 1)
        self.assertEqual(len(token_requests), 1 + len(self.server.issued))
        self.assertLessEqual(len(token_requests), 8 - len(errors) + 1)

    def test_a_failure_answers_for_the_next_second_without_asking_again(self) -> None:
        self.server.inject(Reply(400, json={"error": "invalid_grant"}))
        client = self.v1_client()
        outcomes = outcomes_of(client.push_many([V1_MESSAGE] * 20, concurrency=1))
        self.assertTrue(all(isinstance(o, andpush.AuthError) for o in outcomes))
        self.assertEqual(self.server.processed, 1)  # one token request, no send

    def test_token_endpoint_errors_say_what_the_server_said(self) -> None:
        self.server.inject(Reply(400, json={
            "error": "invalid_grant",
            "error_description": "Invalid JWT: Token must be a short-lived token (60 minutes)"
                                 " and in a reasonable timeframe. Check your iat and exp values",
        }))
        with self.assertRaises(andpush.AuthError) as caught:
            self.v1_client().push(V1_MESSAGE)
        self.assertIn("invalid_grant", str(caught.exception))
        self.assertIn("clock", str(caught.exception))
        self.assertEqual(self.server.processed, 1)

    def test_an_unusable_token_from_the_endpoint_is_refused_without_showing_it(self) -> None:
        for bad in ["ya29.a\r\nX-Evil: 1", "ya29.a\nb", "ya29\x00a", "ya29 a", "ya29.\u00e9",
                    "ya29.\u2028a", "ya29\x7fa"]:
            with self.subTest(bad=bad):
                self.server.inject(Reply(200, json={"access_token": bad, "expires_in": 3599}))
                before = self.server.processed
                with self.assertRaises(andpush.AuthError) as caught:
                    self.v1_client().push(V1_MESSAGE)
                message = str(caught.exception)
                self.assertIn("the token endpoint sent an unusable access token", message)
                self.assertNotIn(bad, message)
                self.assertNotIn("ya29", message)
                self.assertEqual(self.server.processed, before + 1)  # no send went out

    def test_token_endpoint_5xx_is_retried_briefly(self) -> None:
        self.server.inject(Reply(503, body=b""), Reply(500, body=b""))
        client = self.v1_client()
        clock = FakeClock.install(client)
        client.push(V1_MESSAGE)
        self.assertEqual(len(clock.sleeps), 2)
        self.assertEqual(len(self.server.issued), 1)
        self.assertEqual(self.server.processed, 4)

    def test_a_tampered_key_is_refused_by_the_server(self) -> None:
        # The fake server checks the signature against the real public key.
        wrong = TEST_OTHER_RSA_KEY_PEM
        with self.assertRaisesRegex(andpush.AuthError, "Invalid JWT Signature"):
            self.v1_client(credentials=service_account_info(self.server, wrong)).push(V1_MESSAGE)

    def test_secrets_stay_out_of_repr_and_logs(self) -> None:
        with self.assertLogs("andpush", "DEBUG") as logs:
            client = self.v1_client()
            client.push(V1_MESSAGE)
            credentials = client._requests.api._tokens.credentials
            text = " ".join([repr(client), repr(credentials)] + logs.output)
        key_body = TEST_RSA_KEY_PKCS8_PEM.splitlines()[1]
        for secret in [self.server.issued[0], key_body, TOKEN]:
            self.assertNotIn(secret, text)


class BrokenCredentialsTest(unittest.TestCase):
    def test_each_broken_key_file_gives_a_clear_auth_error(self) -> None:
        with FakeFCM() as server:
            good = service_account_info(server)
        table: List[Tuple[Any, str]] = [
            ("/no/such/key.json", "cannot read credentials file"),
            ("{not json", "not JSON"),
            ("[1, 2]", "not a JSON object"),
            ({"type": "external_account"}, "not supported"),
            (dict(good, client_email=""), "client_email"),
            (dict(good, private_key="-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----"),
             "private_key"),
            (dict(good, private_key=andpush._FAKE_CERT_KEY_PEM), "EC key"),
            (dict(good, private_key="not a key"), "not a PEM"),
        ]
        for credentials, fragment in table:
            with self.subTest(fragment):
                with self.assertRaisesRegex(andpush.AuthError, fragment) as caught:
                    andpush.new(credentials=credentials, ssl_context=client_context())
                self.assertNotIn("MII", str(caught.exception))


FRAGMENT = 16  # characters: a run this long of a secret's text is a leak (96 bits of base64)


def fragments(*secrets: str) -> Set[str]:
    """Every run of FRAGMENT characters of the secrets, as they are written and with their
    line breaks (and JSON's written-out ones) dropped, as a message might join them."""
    runs = set()
    for secret in secrets:
        for text in (secret, squeezed(secret)):
            runs.update(text[i:i + FRAGMENT] for i in range(len(text) - FRAGMENT + 1))
    return runs


def squeezed(text: str) -> str:
    return re.sub(r"\s+|\\n", "", text)


def leaks(text: str, secret_runs: Set[str]) -> List[str]:
    """The runs of secret text in ``text`` (as written, and squeezed)."""
    found = []
    for candidate in (text, squeezed(text)):
        found.extend(candidate[i:i + FRAGMENT] for i in range(len(candidate) - FRAGMENT + 1)
                     if candidate[i:i + FRAGMENT] in secret_runs)
    return found


def exception_texts(exc: BaseException) -> List[str]:
    """What an error tracker or a log can show of an exception: its message, repr, args and
    traceback, and the same of every exception chained to it, suppressed ones too."""
    texts = []
    seen: Set[int] = set()
    pending: List[Optional[BaseException]] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        texts += [str(current), repr(current), repr(current.args)]
        texts += traceback.format_exception(type(current), current, current.__traceback__)
        pending += [current.__cause__, current.__context__]
    return texts


def pem_body(pem: str) -> str:
    """The base64 of a PEM block, without its BEGIN and END lines (which are no secret)."""
    return "\n".join(pem.strip().splitlines()[1:-1])


def private_numbers() -> List[str]:
    key = andpush._parse_private_key(TEST_RSA_KEY_PKCS8_PEM)
    numbers = [key.d, key.p, key.q, key.dp, key.dq, key.qinv]
    return ["%d" % n for n in numbers] + ["%x" % n for n in numbers] + ["%X" % n for n in numbers]


class NoSecretInErrorsTest(unittest.TestCase):
    """Every error of credentials and token handling, given the real test key in the ways
    people get it wrong, shows no run of FRAGMENT characters of it: not of the PEM body (as
    PKCS#8 or PKCS#1; its BEGIN and END lines are no secret), of the base64 of the key file,
    of the key's private numbers, of the signed JWT, of an access token or of a refresh token
    and client secret. The client_email and private_key_id are not secret (the key id goes
    out in the clear in every JWT's header, and Google publishes the certificate under it),
    so they may be named."""

    def setUp(self) -> None:
        self.context = client_context()  # one for all the clients: loading it costs 20 ms
        self.server = FakeFCM().start()
        self.addCleanup(self.server.close)
        self.folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.folder)
        self.info = service_account_info(self.server)
        self.key_file = json.dumps(self.info, indent=2)
        self.encoded = base64.b64encode(self.key_file.encode()).decode()
        self.secrets = [pem_body(TEST_RSA_KEY_PKCS8_PEM), pem_body(TEST_RSA_KEY_PKCS1_PEM),
                        self.encoded,
                        base64.urlsafe_b64encode(self.key_file.encode()).decode(),
                        base64.b64encode(TEST_RSA_KEY_PKCS8_PEM.encode()).decode(),
                        "cs-0123456789abcdef", self.server.refresh_token] + private_numbers()

    def assert_no_secret(self, texts: Iterable[str], *more_secrets: str) -> None:
        if not hasattr(self, "secret_runs"):
            self.secret_runs = fragments(*self.secrets)
        secret_runs = self.secret_runs | fragments(*more_secrets)
        for text in texts:
            self.assertEqual(leaks(text, secret_runs), [], text)

    def bad_credentials(self) -> List[Tuple[str, Any]]:
        pem = TEST_RSA_KEY_PKCS8_PEM
        lines = pem.splitlines()
        body = lines[1:-1]
        half = "\n".join(lines[: len(lines) // 2] + lines[-1:]) + "\n"
        middle = len(pem) // 2
        der = base64.b64decode("".join(body))
        return [
            ("base64 of the key file", self.encoded),
            ("base64url of the key file", base64.urlsafe_b64encode(self.key_file.encode())
             .decode().rstrip("=")),
            ("base64 of the key file, in lines", base64.encodebytes(self.key_file.encode())
             .decode()),
            ("the bare PEM", pem),
            ("the bare PKCS#1 PEM", TEST_RSA_KEY_PKCS1_PEM),
            ("the PEM body on one line", "".join(body)),
            ("the PEM body in lines", "\n".join(body)),
            ("the key file cut short", self.key_file[: len(self.key_file) // 2]),
            ("the key file and more", self.key_file + "\n" + pem),
            ("the key file in a list", "[%s]" % self.key_file),
            ("the key file without a type", dict(self.info, type=None)),
            ("the key as the type", dict(self.info, type=pem)),
            ("the key as an unknown type", dict(self.info, type="".join(body)[:40])),
            ("a key on one line", dict(self.info, private_key=pem.replace("\n", " "))),
            ("a key whose BEGIN line runs on", dict(self.info, private_key=pem.replace(
                "-----\n", "-----", 1))),
            ("a key with written-out line breaks", dict(
                self.info, private_key=pem.replace("\n", "\\n"))),
            ("a key with written-out line breaks, none at the end", dict(
                self.info, private_key=pem.replace("\n", "\\n")[:-2])),
            ("a key cut short", dict(self.info, private_key=half)),
            ("a key with one character changed", dict(
                self.info, private_key=pem[:middle] + ("A" if pem[middle] != "A" else "B")
                + pem[middle + 1:])),
            ("a key with a character that is not base64", dict(
                self.info, private_key=pem[:middle] + "*" + pem[middle + 1:])),
            ("a key without its PEM lines", dict(self.info, private_key="\n".join(body))),
            ("a key as base64 of the PEM", dict(
                self.info, private_key=base64.b64encode(pem.encode()).decode())),
            ("a key with the wrong END line", dict(
                self.info, private_key=pem.replace("END PRIVATE", "END RSA PRIVATE"))),
            ("a PKCS#1 key under the PKCS#8 label", dict(
                self.info, private_key=TEST_RSA_KEY_PKCS1_PEM.replace("RSA PRIVATE", "PRIVATE"))),
            ("a key as bytes", dict(self.info, private_key=pem.encode())),
            ("a key without its email", dict(self.info, client_email="")),
            ("a file of base64 of the key file", self.write("b64.json", self.encoded)),
            ("a file of the PEM", self.write("key.pem", pem)),
            ("a file of the DER key", self.write("key.der", der)),
            ("a file of the key file cut short", self.write(
                "short.json", self.key_file[: len(self.key_file) // 2])),
            ("user credentials without the client secret", {
                "type": "authorized_user", "client_id": "cid", "client_secret": "",
                "refresh_token": self.server.refresh_token}),
            ("user credentials with a secret that is not a string", {
                "type": "authorized_user", "client_id": "cid", "client_secret": 12,
                "refresh_token": self.server.refresh_token}),
        ]

    def write(self, name: str, contents: Union[str, bytes]) -> str:
        path = os.path.join(self.folder, name)
        with open(path, "wb") as file:
            file.write(contents.encode() if isinstance(contents, str) else contents)
        return path

    def test_no_error_of_bad_credentials_shows_the_key(self) -> None:
        for what, credentials in self.bad_credentials():
            with self.subTest(what):
                with self.assertRaises(andpush.AuthError) as caught:
                    andpush.new(credentials=credentials, ssl_context=self.context)
                self.assert_no_secret(exception_texts(caught.exception))

    def test_a_wrong_string_is_described_by_its_shape_and_length(self) -> None:
        table = [
            (self.encoded, "a string of %s characters that is neither JSON nor the path of a "
             "file; it looks like base64 of a key file: decode it"
             % format(len(self.encoded), ",")),
            (TEST_RSA_KEY_PKCS8_PEM, "it holds a PEM block, which is only a part of a key file: "
             "pass the whole service account JSON key file"),
            ("".join(TEST_RSA_KEY_PKCS8_PEM.splitlines()[1:-1]),
             "it looks like base64 of a private key"),
            ("ya29.a0AfH6SMBx3b-not-a-path", "a string of 28 characters that is neither JSON "
             "nor the path"),
            ("1//0gLk-refresh-token_123", "a string of 25 characters"),
        ]
        for credentials, expected in table:
            with self.subTest(expected):
                with self.assertRaises(andpush.AuthError) as caught:
                    andpush.new(credentials=credentials, ssl_context=self.context)
                self.assertIn(expected, str(caught.exception))
                self.assertNotIn(credentials[:FRAGMENT], str(caught.exception))

    def test_what_has_the_shape_of_a_path_is_shown_as_one(self) -> None:
        for path in ["/no/such/folder/key.json", "key.json", os.path.join(self.folder, "fcm"),
                     pathlib.Path("/no/such/folder/fcm")]:
            with self.subTest(str(path)):
                with self.assertRaisesRegex(andpush.AuthError, "cannot read credentials file "
                                            + re.escape(repr(str(path)))):
                    andpush.new(credentials=path, ssl_context=self.context)

    def test_google_application_credentials_is_named_when_it_holds_a_key(self) -> None:
        with environment(GOOGLE_APPLICATION_CREDENTIALS=self.encoded):
            with self.assertRaises(andpush.AuthError) as caught:
                andpush.new(ssl_context=self.context)
        self.assertIn("GOOGLE_APPLICATION_CREDENTIALS is a string of", str(caught.exception))
        self.assert_no_secret(exception_texts(caught.exception))

    def test_the_command_line_shows_no_key_even_in_its_debug_log(self) -> None:
        stderr = io.StringIO()
        with self.assertLogs("andpush", "DEBUG") as logs, contextlib.redirect_stderr(stderr):
            status = andpush.main(["--credentials", self.encoded, "check"])
        self.assertEqual(status, 77)
        self.assertIn("--credentials is a string of", stderr.getvalue())
        self.assert_no_secret([stderr.getvalue()] + logs.output)

    def test_no_error_of_the_token_endpoint_shows_a_secret(self) -> None:
        unusable = "ya29.unusable-token \r\n-0123456789"
        answers: List[Tuple[str, List[Any]]] = [
            ("a refused key", [Reply(400, json={"error": "invalid_grant",
                                                "error_description": "Invalid JWT Signature."})]),
            ("an outage", [Reply(503, body=b"")] * 3),
            ("an answer that is not JSON", [Reply(200, body=b"<html>")]),
            ("an answer without a token", [Reply(200, json={"token_type": "Bearer"})]),
            ("an unusable token", [Reply(200, json={"access_token": unusable})]),
            ("a token FCM refuses", [Reply(200, json={"access_token": "ya29.refused-0123456789",
                                                      "expires_in": 3599}),
                                     fcm_error(401, None, "Request had invalid authentication "
                                               "credentials.")] * 2),
        ]
        for what, replies in answers:
            with self.subTest(what):
                self.server.inject(*replies)
                self.assert_push_shows_no_secret(service_account_info(self.server), unusable,
                                                 "ya29.refused-0123456789")

    def test_no_error_of_user_credentials_shows_a_secret(self) -> None:
        info = {"type": "authorized_user", "client_id": "cid",
                "client_secret": "cs-0123456789abcdef", "refresh_token": "wrong-0123456789abcdef",
                "token_uri": self.server.endpoint + "/token"}
        self.assert_push_shows_no_secret(info, "wrong-0123456789abcdef")

    def test_an_unreachable_token_endpoint_shows_no_secret(self) -> None:
        info = dict(self.info, token_uri="https://127.0.0.1:%d/token" % _closed_port())
        self.assert_push_shows_no_secret(info)

    def assert_push_shows_no_secret(self, credentials: Dict[str, Any], *secrets: str) -> None:
        """Push once and push_many twice with ``credentials``, and check that neither the
        errors, the log (DEBUG) nor the reprs show a secret, the JWTs and tokens sent included."""
        before = len(self.server.requests)
        with self.assertLogs("andpush", "DEBUG") as logs:
            logging.getLogger("andpush").debug("start")  # assertLogs needs one line
            client = andpush.new(credentials=credentials, endpoint=self.server.endpoint,
                                 ssl_context=self.context, max_retries=1)
            FakeClock.install(client)
            texts = [repr(client), repr(client._requests.api._tokens),
                     repr(client._requests.api._tokens.credentials)]
            try:
                client.push(V1_MESSAGE)
            except andpush.Error as exc:
                texts += exception_texts(exc)
            for _, outcome in client.push_many([V1_MESSAGE] * 2):
                if isinstance(outcome, BaseException):
                    texts += exception_texts(outcome)
            client.close()
        sent = [r.body.decode("ascii", "replace") for r in self.server.requests[before:]]
        sent_jwts = [value for body in sent for name, value in urllib.parse.parse_qsl(body)
                     if name == "assertion"]
        self.assertGreater(len(texts), 3)  # an error, at least
        self.assertEqual(self.server.pending, 0)
        self.assert_no_secret(texts + logs.output, *(sent_jwts + list(secrets)
                                                     + self.server.issued))


class ApplicationDefaultCredentialsTest(unittest.TestCase):
    def setUp(self) -> None:
        self.google = FakeFCM().start()
        self.addCleanup(self.google.close)
        self.metadata = FakeFCM(tls=False).start()
        self.addCleanup(self.metadata.close)
        self.home = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.home)
        keys = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GOOGLE_CLOUD_PROJECT",
                "GCLOUD_PROJECT", "GCE_METADATA_HOST", "HOME", "APPDATA")
        context = environment(**{key: "" for key in keys})
        context.__enter__()
        self.addCleanup(context.__exit__, None, None, None)
        os.environ["HOME"] = self.home
        os.environ["GCE_METADATA_HOST"] = "127.0.0.1:%d" % self.metadata.port

    def client(self, **options: Any) -> andpush.Client:
        client = andpush.new(endpoint=self.google.endpoint, ssl_context=client_context(),
                             max_retries=0, **options)
        self.addCleanup(client.close)
        return client

    def write(self, path: str, info: Dict[str, Any]) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            json.dump(info, file)
        return path

    def test_google_application_credentials_comes_first(self) -> None:
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = self.write(
            os.path.join(self.home, "key.json"), service_account_info(self.google))
        self.write(os.path.join(self.home, ".config", "gcloud",
                                "application_default_credentials.json"), {"type": "nonsense"})
        self.client().push(V1_MESSAGE)
        self.assertEqual(self.google.requests[-1].path,
                         "/v1/projects/%s/messages:send" % TEST_PROJECT)
        self.assertEqual(self.metadata.processed, 0)

    def test_then_gclouds_authorized_user_file(self) -> None:
        self.write(os.path.join(self.home, ".config", "gcloud",
                                "application_default_credentials.json"), {
            "type": "authorized_user", "client_id": "cid", "client_secret": "cs",
            "refresh_token": self.google.refresh_token,
            "token_uri": self.google.endpoint + "/token"})
        os.environ["GOOGLE_CLOUD_PROJECT"] = "env-project"
        self.client().push(V1_MESSAGE)
        token_request = self.google.requests[0]
        self.assertIn("grant_type=refresh_token", token_request.body.decode())
        self.assertEqual(self.google.requests[-1].path, "/v1/projects/env-project/messages:send")

    def test_cloudsdk_config_moves_gclouds_file(self) -> None:
        config = os.path.join(self.home, "elsewhere")
        os.environ["CLOUDSDK_CONFIG"] = config
        self.write(os.path.join(config, "application_default_credentials.json"),
                   service_account_info(self.google))
        self.client().push(V1_MESSAGE)
        self.assertEqual(self.metadata.processed, 0)

    def test_then_the_metadata_server(self) -> None:
        issued = self.metadata.issued
        self.google.valid_tokens = self.metadata.valid_tokens  # the same Google behind both
        self.client().push(V1_MESSAGE)
        self.assertEqual(len(issued), 1)
        self.assertEqual(self.metadata.requests[0].headers["metadata-flavor"], "Google")
        self.assertEqual(self.google.requests[-1].path,
                         "/v1/projects/metadata-project/messages:send")

    def test_an_unusable_token_from_the_metadata_server_is_refused(self) -> None:
        self.metadata.inject(Reply(200, json={"access_token": "ya29.a\r\nb", "expires_in": 60}))
        with self.assertRaises(andpush.AuthError) as caught:
            self.client(project_id="p").push(V1_MESSAGE)
        self.assertIn("the metadata server sent an unusable access token", str(caught.exception))
        self.assertNotIn("ya29", str(caught.exception))
        self.assertEqual(self.google.processed, 0)

    def test_a_project_id_that_is_not_text_is_an_auth_error(self) -> None:
        self.metadata.inject(Reply(200, body=b"\xff\xfe"))  # the project id is asked first
        with self.assertRaisesRegex(andpush.AuthError, "project id that is not UTF-8"):
            self.client().push(V1_MESSAGE)
        self.assertEqual(self.google.processed, 0)

    def test_nothing_found_says_what_was_tried(self) -> None:
        self.metadata.close()
        client = self.client(project_id="p")
        clock = FakeClock.install(client)
        with self.assertRaises(andpush.AuthError) as caught:
            client.push(V1_MESSAGE)
        backoffs = clock.sleeps[1::2]  # after each refused connect, the route holds off
        self.assertEqual(len(backoffs), andpush._TOKEN_RETRIES)  # connect refused, twice
        message = str(caught.exception)
        self.assertIn("GOOGLE_APPLICATION_CREDENTIALS", message)
        self.assertIn("application_default_credentials.json", message)
        self.assertIn("metadata server", message)
        self.assertEqual(self.google.processed, 0)


class ClosingTest(V1TestCase):
    def test_closing_while_a_token_is_fetched_ends_the_push_and_leaves_no_thread_failing(
            self) -> None:
        self.server.slow_seconds = 0.1
        self.server.inject(SLOW)  # the token request, the first
        earlier = set(threading.enumerate())
        client = self.v1_client()
        failures: List[Any] = []
        outcome: List[BaseException] = []
        original_hook = threading.excepthook
        threading.excepthook = failures.append  # type: ignore[assignment]
        self.addCleanup(setattr, threading, "excepthook", original_hook)

        def push() -> None:
            try:
                client.push(V1_MESSAGE)
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)

        pusher = threading.Thread(target=push)
        pusher.start()
        self.assertTrue(wait_until(lambda: self.server.processed == 1))  # the token request
        client.close()
        pusher.join(2)
        for thread in set(threading.enumerate()) - earlier:
            if thread.name.startswith("andpush"):  # the token's thread among them: it ends
                thread.join(2)
                self.assertFalse(thread.is_alive(), thread.name)
        self.assertFalse(pusher.is_alive())
        self.assertIsInstance(outcome[0], andpush.NetworkError)
        self.assertFalse(outcome[0].may_have_been_delivered)  # not sent: no token yet
        self.assertEqual(failures, [])


class TopicManagementTest(V1TestCase):
    def test_subscribe_and_unsubscribe_one_outcome_per_token(self) -> None:
        client = self.v1_client()
        self.server.subscribe(("b", "news"))
        outcomes = client.subscribe(["a", "b", "c"], "news")
        self.assertEqual([o.status_code for o in outcomes], [200, 409, 200])  # type: ignore
        self.assertEqual(self.server.subscriptions, {("a", "news"), ("b", "news"), ("c", "news")})
        outcomes = client.unsubscribe(["a", "c"], "news")
        self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes))
        self.assertEqual(self.server.subscriptions, {("b", "news")})

    def test_failures_come_back_in_place(self) -> None:
        client = self.v1_client()
        client.push(V1_MESSAGE)
        self.server.inject(fcm_error(400, "INVALID_ARGUMENT"))
        outcomes = client.subscribe(["bad"], "news")
        self.assertIsInstance(outcomes[0], andpush.InvalidArgumentError)

    def test_bad_arguments(self) -> None:
        client = self.v1_client()
        with self.assertRaisesRegex(TypeError, "list of str"):
            client.subscribe("a", "news")
        with self.assertRaisesRegex(ValueError, "topic"):
            client.subscribe(["a"], "news!")
        with self.assertRaisesRegex(ValueError, "v1"):
            self.client().subscribe(["a"], "news")


# Bulk sending: push_many, retries, pacing ###################################################

class FakeClock:
    """The client's clock seam, moved only by the waits the client asks for: each one is
    recorded and passes at once, so backoff, pauses and pacing run without sleeping."""

    def __init__(self, start: Optional[float] = None) -> None:
        self.time = time.monotonic() if start is None else start
        self.sleeps: List[float] = []

    def now(self) -> float:
        return self.time

    def delay(self, seconds: float) -> float:
        self.sleeps.append(seconds)
        self.time += seconds
        return 0.0

    @classmethod
    def install(cls, client: andpush.Client, start: Optional[float] = None) -> "FakeClock":
        clock = cls(start)
        client._driver.clock = clock
        return clock


class CountingMessages:
    """A generator-like input that counts how many messages were taken from it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.taken = 0

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for i in range(self.count):
            self.taken += 1
            yield {"token": "t%d" % i}


def outcomes_of(pairs: Iterable[Tuple[Any, Any]],
                messages: Optional[Sequence[Any]] = None) -> List[Any]:
    """The outcomes of push_many's (message, outcome) pairs; with ``messages``, after
    checking that the pairs hold those very objects, in input order."""
    pairs = list(pairs)
    if messages is not None:
        taken = [message for message, _ in pairs]
        if len(taken) != len(messages) or any(a is not b for a, b in zip(taken, messages)):
            raise AssertionError("the pairs' messages are not the input, in order")
    return [outcome for _, outcome in pairs]


def tokens_sent(server: FakeFCM) -> List[str]:
    """The device token of each send the server processed, in order."""
    return [r.json["message"]["token"] for r in server.requests if r.path.endswith(":send")]


class PushManySpec:
    """push_many's specification, run against each protocol by a subclass that also
    derives from V1TestCase and says, in its class attributes, what differs; its clients
    have a fixed access token. (What faults mean for each message is MisbehavingServerTest's,
    on the simulation.)"""

    server_class: Any
    # An action after which the server provably did not process the request, on a
    # connection the client had used before.
    NOT_READ: Action

    def test_a_message_waiting_for_a_retry_does_not_hold_up_the_others(self: Any) -> None:
        self.server.by_token["t0"] = [fcm_error(503, "UNAVAILABLE")]
        client = self.fixed_token_client(max_retries=1, backoff_factor=0.1)  # waits at least 0.05 s
        outcomes = outcomes_of(client.push_many(CountingMessages(100), concurrency=4))
        self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes))
        sent = tokens_sent(self.server)
        first = sent.index("t0")
        # The others went on meanwhile, past four outcomes per message in flight.
        self.assertGreater(sent.index("t0", first + 1) - first, 4 * 4)

    def test_a_request_the_server_did_not_read_is_sent_again_once(self: Any) -> None:
        client = self.fixed_token_client(max_retries=0)
        client.push({"token": "warm-up"})  # the token, and a connection to reuse
        self.server.inject(self.NOT_READ)
        outcomes = outcomes_of(client.push_many([{"token": "t%d" % i} for i in range(5)],
                                                concurrency=1))
        self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes))
        self.assertEqual(sorted(tokens_sent(self.server)),
                         sorted(["warm-up"] + ["t%d" % i for i in range(5)]))

    def test_a_long_run_of_bad_messages_holds_up_none_of_the_good_ones_after_it(
            self: Any) -> None:
        bad = 3 * andpush._RUN  # every run push_many makes at a time is bad
        messages: List[Any] = [{"token": "bad-%d" % i, "data": {"n": i}} for i in range(bad)]
        messages += [{"token": "t%d" % i} for i in range(10)]
        client = self.fixed_token_client()
        outcomes = outcomes_of(client.push_many(messages, concurrency=bad), messages)
        self.assertEqual([type(o) for o in outcomes[:bad]], [TypeError] * bad)
        self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes[bad:]))
        self.assertEqual(sorted(tokens_sent(self.server)), sorted("t%d" % i for i in range(10)))

    def test_works_on_the_legacy_api_too(self: Any) -> None:
        client = self.client()
        messages = [{"to": "t%d" % i} for i in range(30)]
        outcomes = outcomes_of(client.push_many(messages, concurrency=5), messages)
        self.assertEqual([o.status_code for o in outcomes], [200] * 30)  # type: ignore
        self.assertEqual(self.server.processed, 30)

    def test_generator_input_is_read_lazily_and_the_window_is_bounded(self: Any) -> None:
        messages = CountingMessages(200)
        outcomes = self.fixed_token_client().push_many(messages, concurrency=2)
        self.assertIsInstance(next(outcomes)[1], andpush.Response)
        time.sleep(0.05)  # a slow consumer: the workers must stop a window ahead
        window = 2 * andpush._WINDOW_PER_WORKER
        self.assertLessEqual(messages.taken, 1 + window)
        self.assertEqual(len(list(outcomes)), 199)
        self.assertEqual(messages.taken, 200)

    def assert_every_send_reported(self: Any, client: Any, pairs: List[Tuple[Any, Any]],
                                   messages: CountingMessages) -> None:
        """The pairs answer t0, t1, ... in order: first those that went out before the
        stop, each a Response, then those read but not sent, each "not sent"; once the
        client holds no request, the server processed exactly the first (at most one
        message taken as the reading stopped has no pair)."""
        self.assertEqual([m["token"] for m, _ in pairs], ["t%d" % i for i in range(len(pairs))])
        sent = [m["token"] for m, o in pairs if isinstance(o, andpush.Response)]
        self.assertEqual(sent, ["t%d" % i for i in range(len(sent))])  # a prefix
        for _, outcome in pairs[len(sent):]:
            self.assertIsInstance(outcome, andpush.NetworkError)
            self.assertFalse(outcome.may_have_been_delivered)
            self.assertIn("not sent", str(outcome))
        self.assertTrue(settles(client))
        self.assertEqual(sorted(tokens_sent(self.server)), sorted(sent))
        self.assertIn(messages.taken - len(pairs), (0, 1))

    def test_closing_returns_the_pairs_of_every_message_read(self: Any) -> None:
        messages = CountingMessages(1000)
        client = self.fixed_token_client()
        outcomes = client.push_many(messages, concurrency=4)
        first = [next(outcomes) for _ in range(3)]
        rest = outcomes.close()  # type: ignore[attr-defined]
        self.assert_every_send_reported(client, first + rest, messages)
        self.assertLessEqual(messages.taken, 3 + 4 * andpush._WINDOW_PER_WORKER)
        with self.assertRaises(StopIteration):
            next(outcomes)
        self.assertEqual(outcomes.close(), [])  # type: ignore[attr-defined]

    def test_stopping_sends_nothing_more_and_the_iteration_gives_every_pair(
            self: Any) -> None:
        messages = CountingMessages(1000)
        client = self.fixed_token_client()
        outcomes = client.push_many(messages, concurrency=4)
        first = next(outcomes)
        outcomes.stop()  # type: ignore[attr-defined]
        pairs = [first, *outcomes]
        self.assert_every_send_reported(client, pairs, messages)
        self.assertEqual(outcomes.close(), [])  # type: ignore[attr-defined]

    def test_close_after_an_exception_in_the_loop_still_gives_the_rest(self: Any) -> None:
        messages = CountingMessages(1000)
        client = self.fixed_token_client()
        outcomes = client.push_many(messages, concurrency=4)
        seen: List[Tuple[Any, Any]] = []
        with self.assertRaises(KeyError):
            for pair in outcomes:
                seen.append(pair)
                if len(seen) == 10:
                    raise KeyError("the consumer's own failure")
        self.assert_every_send_reported(client, seen + outcomes.close(), messages)  # type: ignore

    def test_dropping_the_iterator_stops_sending(self: Any) -> None:
        messages = CountingMessages(1000)
        client = self.fixed_token_client()
        outcomes = client.push_many(messages, concurrency=4)
        next(outcomes)
        del outcomes
        self.assertTrue(settles(client))  # what was in flight landed; nothing more goes out
        self.assertLessEqual(messages.taken, 1 + 4 * andpush._WINDOW_PER_WORKER)
        self.assertLessEqual(len(tokens_sent(self.server)), messages.taken)

    def test_progress_counts_done_and_failed(self: Any) -> None:
        self.server.by_token["gone"] = [fcm_error(404, "UNREGISTERED")]
        seen: List[Tuple[int, int]] = []
        lock = threading.Lock()

        def progress(done: int, failed: int) -> None:
            with lock:
                seen.append((done, failed))

        messages = [{"token": "a"}, {"token": "gone"}, {"token": "b"}]
        list(self.fixed_token_client().push_many(messages, concurrency=2, progress=progress))
        self.assertEqual(sorted(seen)[-1], (3, 1))
        self.assertEqual(len(seen), 3)

    def test_a_failing_input_generator_raises_after_the_outcomes_before_it(self: Any) -> None:
        def messages() -> Iterator[Dict[str, Any]]:
            yield {"token": "a"}
            raise RuntimeError("the database went away")

        outcomes = self.fixed_token_client().push_many(messages(), concurrency=2)
        self.assertIsInstance(next(outcomes)[1], andpush.Response)
        with self.assertRaisesRegex(RuntimeError, "database"):
            next(outcomes)

    def test_bad_concurrency(self: Any) -> None:
        with self.assertRaisesRegex(ValueError, "concurrency"):
            self.fixed_token_client().push_many([], concurrency=0)


class PushManyHTTP11Test(PushManySpec, V1TestCase):
    server_class = FakeFCM
    NOT_READ = RESET_BEFORE_READ


class RetryTest(V1TestCase):
    def test_retry_after_in_seconds_and_as_a_date_is_honoured(self) -> None:
        later = email.utils.formatdate(time.time() + 30, usegmt=True)
        self.server.by_token[TOKEN] = [fcm_error(503, "UNAVAILABLE", Retry_After="20"),
                                       fcm_error(503, "UNAVAILABLE", Retry_After=later)]
        client = self.fixed_token_client(max_retries=3, backoff_factor=0.001)
        clock = FakeClock.install(client)
        client.push(V1_MESSAGE)
        self.assertEqual(len(clock.sleeps), 2)
        self.assertEqual(clock.sleeps[0], 20.0)
        self.assertAlmostEqual(clock.sleeps[1], 30, delta=2)
        self.assertEqual(tokens_sent(self.server).count(TOKEN), 3)

    def test_a_429_pauses_the_whole_client(self) -> None:
        for start in (1000.0, 33.707046002738885):  # at the second, the pause comes out a hair
            # off 30 s (29.999999999999993), as it does for about one start in a hundred
            client = self.fixed_token_client(max_retries=1)
            client.push({"token": "warm-up"})
            self.server.inject(fcm_error(429, "QUOTA_EXCEEDED", Retry_After="30"),
                               fcm_error(429, "QUOTA_EXCEEDED", Retry_After="30"))
            clock = FakeClock.install(client, start)
            with self.assertRaises(andpush.QuotaExceededError):
                client.push(V1_MESSAGE)  # waits out its own pause once, then gives up
            clock.sleeps.clear()
            client.push({"token": "next"})  # a different message waits out the pause
            self.assertEqual(len(clock.sleeps), 1)
            self.assertAlmostEqual(clock.sleeps[0], 30.0)

    def test_with_max_retries_0_a_push_during_a_pause_fails_at_once_unsent(self) -> None:
        client = self.fixed_token_client()  # max_retries=0
        client.push({"token": "warm-up"})  # the access token first
        self.server.inject(fcm_error(429, "QUOTA_EXCEEDED", Retry_After="30"))
        clock = FakeClock.install(client)
        with self.assertLogs("andpush", "WARNING") as logs:
            with self.assertRaises(andpush.QuotaExceededError):
                client.push(V1_MESSAGE)
            clock.time += 10
            processed = self.server.processed
            with self.assertRaises(andpush.QuotaExceededError) as caught:
                client.push({"token": "next"})
        self.assertEqual(self.server.processed, processed)  # not sent
        self.assertAlmostEqual(caught.exception.retry_after, 20.0)
        self.assertIn("not sent", str(caught.exception))
        self.assertEqual(clock.sleeps, [])  # max_retries=0 never sleeps
        self.assertEqual(len(logs.records), 1)  # the pause is logged once, when it starts

    def test_the_pause_is_bounded_like_a_retry_wait(self) -> None:
        client = self.fixed_token_client()
        client.push({"token": "warm-up"})  # the access token first
        self.server.inject(fcm_error(429, "QUOTA_EXCEEDED", Retry_After="86400"))
        # A start where the pause read back from clock readings is 120.00000000000023 s.
        clock = FakeClock.install(client, start=2040.1090003485567)
        with self.assertRaises(andpush.QuotaExceededError):
            client.push(V1_MESSAGE)
        with self.assertRaises(andpush.QuotaExceededError) as caught:
            client.push({"token": "next"})
        self.assertLessEqual(caught.exception.retry_after, andpush._MAX_RETRY_WAIT)
        clock.time += andpush._MAX_RETRY_WAIT
        client.push({"token": "after"})

    def test_a_429_without_retry_after_waits_a_minute(self) -> None:
        self.server.by_token[TOKEN] = [fcm_error(429, None)]
        client = self.fixed_token_client(max_retries=1, backoff_factor=0.001)
        clock = FakeClock.install(client)
        client.push(V1_MESSAGE)
        self.assertEqual(clock.sleeps, [60.0])

    def test_not_delivered_network_failures_are_retried(self) -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        client = andpush.new(SERVER_KEY, endpoint="https://127.0.0.1:%d" % port,
                             max_retries=2, backoff_factor=0.001, ssl_context=client_context())
        clock = FakeClock.install(client)
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(LEGACY_MESSAGE)
        self.assertFalse(caught.exception.may_have_been_delivered)
        holds, backoffs = clock.sleeps[0::2], clock.sleeps[1::2]  # after each refused connect
        self.assertEqual(len(backoffs), 2)  # two retries
        for hold, expected in zip(holds, [0.5, 1.0, 2.0]):  # each refusal holds off longer
            self.assertAlmostEqual(hold, expected)

    def test_maybe_delivered_network_failures_are_not_retried(self) -> None:
        self.server.by_token[TOKEN] = [RESET_AFTER_READ]
        client = self.fixed_token_client(max_retries=3, backoff_factor=0.001, keep_alive_timeout=0)
        with self.assertRaises(andpush.NetworkError):
            client.push(V1_MESSAGE)
        self.assertEqual(tokens_sent(self.server).count(TOKEN), 1)

    def test_rate_limit_spaces_the_sends(self) -> None:
        client = self.fixed_token_client(rate_limit=5)
        clock = FakeClock.install(client)
        for _ in range(10):
            client.push(V1_MESSAGE)
        # Ten sends at five a second take 1.8 s of the (fake) clock: never six in one second.
        self.assertAlmostEqual(sum(clock.sleeps), 1.8, places=6)
        self.assertEqual(len(clock.sleeps), 9)


# The shipped fake FCM, as a user's tests use it ##############################################
# andpush.FakeFCM itself, not the subclass above: what FCM answers, what a test scripts, what
# it records, and HTTP as Google's front end speaks it.

def fake_post(fcm: andpush.FakeFCM, path: str, body: Any, token: Optional[str] = None,
              plain: bool = False, method: str = "POST") -> Tuple[int, Dict[str, str], Any]:
    """One HTTP/1.1 request to the fake, not through andpush: status, headers, JSON (or text)."""
    import http.client

    if plain:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", fcm.port,
                                                                      timeout=_WAIT_LIMIT)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", fcm.port, timeout=_WAIT_LIMIT,
                                           context=fcm.ssl_context())
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": "Bearer " + (token or fcm.access_token)}
    try:
        conn.request(method, path, data, headers)
        answer = conn.getresponse()
        text = answer.read().decode()
        fields = {name.lower(): value for name, value in answer.getheaders()}
    finally:
        conn.close()
    try:
        return answer.status, fields, json.loads(text)
    except ValueError:
        return answer.status, fields, text


class ShippedFakeTestCase(unittest.TestCase):
    """A test with an andpush.FakeFCM of its own, as in the README."""

    def setUp(self) -> None:
        self.fcm = andpush.FakeFCM().start()
        self.addCleanup(self.fcm.close)
        self.addCleanup(lambda: self.assertEqual(self.fcm._errors, []))

    def client(self, **options: Any) -> andpush.Client:
        options.setdefault("max_retries", 0)
        client = self.fcm.client(**options)
        self.addCleanup(client.close)
        return client

    def send(self, message: Any, **fields: Any) -> Tuple[int, Dict[str, str], Any]:
        path = "/v1/projects/%s/messages:send" % self.fcm.project_id
        return fake_post(self.fcm, path, dict({"message": message}, **fields))


class FakeSendTest(ShippedFakeTestCase):
    """Sends are checked as FCM checks them and answered as FCM answers."""

    def test_a_client_it_hands_out_sends_with_its_service_account(self) -> None:
        response = self.client().push({"token": "t1", "notification": {"title": "Hi"}})
        self.assertEqual(response.json(), {"name": "projects/fake-project/messages/0:1"})
        (message,) = self.fcm.messages
        self.assertEqual((message.token, message.tokens, message.api, message.protocol,
                          message.status, message.error, message.validate_only),
                         ("t1", ("t1",), "v1", "HTTP/2", 200, None, False))
        self.assertEqual(message.message, {"token": "t1", "notification": {"title": "Hi"}})
        self.assertTrue(message.headers["authorization"].startswith("Bearer ya29.fake-"))
        counts = self.fcm.counts
        self.assertEqual((counts["requests"], counts["messages"], counts["delivered"],
                          counts["access_tokens"]), (2, 1, 1, 1))

    def test_what_the_librarys_checks_refuse_is_invalid_argument_with_their_reason(self) -> None:
        table: List[Tuple[Any, str]] = [
            ({"token": "a", "data": {"n": 1}}, r"data\['n'\] must be a str"),
            ({"token": "a", "topic": "b"}, "exactly one target"),
            ({"topic": "/topics/news"}, "without the /topics/ prefix"),
            ({"token": "a", "data": {"from": "x"}}, "reserved"),
            ({"token": "a", "android": {"ttl": "soon"}}, "android.ttl"),
            ({"token": "a", "data": {"k": "x" * 5000}}, "at most 4096"),
            ({"condition": "'a' in topics &&"}, "condition ends"),
            ({"condition": "'a' in topics || news"}, "not a topic condition"),
            ({"condition": " || ".join("'t%d' in topics" % i for i in range(6))}, "more than 5"),
        ]
        for message, reason in table:
            with self.subTest(message=message):
                status, _, answer = self.send(message)
                self.assertEqual((status, answer["error"]["status"]), (400, "INVALID_ARGUMENT"))
                self.assertEqual(answer["error"]["details"][0]["errorCode"], "INVALID_ARGUMENT")
                self.assertRegex(answer["error"]["message"], reason)
        self.assertEqual([m.error for m in self.fcm.messages], ["INVALID_ARGUMENT"] * len(table))
        self.assertEqual(self.fcm.counts["delivered"], 0)

    def test_a_body_that_is_no_v1_request_is_invalid_argument(self) -> None:
        path = "/v1/projects/fake-project/messages:send"
        for body, reason in [
            (b"{not json", "Invalid JSON payload"),
            ({"message": "text"}, "a \"message\" object"),
            ({"message": {"token": "a"}, "dry_run": True}, 'Unknown name "dry_run"'),
            ({"message": {"token": "a"}, "validate_only": "yes"}, "true or false"),
        ]:
            with self.subTest(body=body):
                status, _, answer = fake_post(self.fcm, path, body)
                self.assertEqual(status, 400)
                self.assertIn(reason, answer["error"]["message"])

    def test_validate_only_answers_without_sending(self) -> None:
        response = self.client().push({"token": "t1"}, validate_only=True)
        self.assertEqual(response.json()["name"], "projects/fake-project/messages/fake_message_id")
        self.assertEqual((self.fcm.messages[0].tokens, self.fcm.counts["delivered"]), ((), 0))

    def test_unknown_bearer_tokens_and_other_projects_are_refused(self) -> None:
        status, _, answer = fake_post(self.fcm, "/v1/projects/fake-project/messages:send",
                                      {"message": {"token": "a"}}, token="ya29.forged")
        self.assertEqual((status, answer["error"]["status"]), (401, "UNAUTHENTICATED"))
        with self.assertRaises(andpush.PermissionDeniedError):
            self.client(project_id="another-project").push({"token": "a"})
        self.assertEqual(self.fcm.counts["messages"], 0)

    def test_the_legacy_api_takes_its_server_key(self) -> None:
        self.fcm.unregister("gone")
        self.fcm.move_to_other_project("foreign")
        client = self.client(server_key=self.fcm.server_key)
        answer = client.push({"registration_ids": ["ok", "gone", "foreign"], "data": {}})
        self.assertEqual(answer.errors, {"gone": "NotRegistered", "foreign": "MismatchSenderId"})
        self.assertEqual(self.fcm.messages[0].tokens, ("ok",))
        self.assertEqual(client.push({"to": "ok"}, validate_only=True).json()["multicast_id"], -1)
        with self.assertRaises(andpush.ClientError) as caught:
            self.client(server_key="not-the-fakes").push({"to": "ok"})
        self.assertEqual(caught.exception.status_code, 401)


class FakeScriptingTest(ShippedFakeTestCase):
    """A test scripts the fake's answers: errors, pauses, silences and dropped connections."""

    def test_marked_tokens_are_unregistered_or_another_projects(self) -> None:
        self.fcm.unregister("gone")
        self.fcm.move_to_other_project("foreign")
        client = self.client()
        with self.assertRaises(andpush.UnregisteredError):
            client.push({"token": "gone"})
        with self.assertRaises(andpush.SenderIdMismatchError):
            client.push({"token": "foreign"})
        self.assertEqual(client.push({"token": "other"}).status_code, 200)

    def test_the_next_sends_answer_the_errors_scripted_then_as_usual(self) -> None:
        self.fcm.answer("UNAVAILABLE", times=2)
        self.fcm.answer("QUOTA_EXCEEDED", retry_after=30)
        client = self.client()
        clock = FakeClock.install(client)
        for _ in range(2):
            with self.assertRaises(andpush.UnavailableError):
                client.push({"token": "a"})
        with self.assertRaises(andpush.QuotaExceededError) as caught:
            client.push({"token": "a"})
        self.assertEqual(caught.exception.retry_after, 30.0)
        clock.time += 60  # past the pause the 429 began
        self.assertEqual(client.push({"token": "a"}).status_code, 200)
        self.assertEqual([m.error for m in self.fcm.messages],
                         ["UNAVAILABLE", "UNAVAILABLE", "QUOTA_EXCEEDED", None])

    def test_a_tokens_script_answers_each_of_its_sends_and_comes_first(self) -> None:
        self.fcm.answer("UNAVAILABLE")
        self.fcm.answer("INTERNAL", token="flaky", times=None)
        client = self.client()
        outcomes = [outcome for _, outcome in client.push_many(
            [{"token": t} for t in ("flaky", "flaky", "fine", "flaky", "fine")], concurrency=1)]
        self.assertEqual([type(o).__name__ for o in outcomes], [
            "InternalError", "InternalError", "UnavailableError", "InternalError", "Response"])

    def test_late_never_and_dropped_answers(self) -> None:
        client = self.client(timeout=(2.0, 0.15))
        client.push({"token": "warm"})
        self.fcm.answer(delay=0.02)
        started = time.monotonic()
        self.assertEqual(client.push({"token": "late"}).status_code, 200)
        self.assertGreaterEqual(time.monotonic() - started, 0.02)
        self.fcm.answer(delay=math.inf)
        with self.assertRaises(andpush.NetworkError) as never:
            client.push({"token": "never"}, timeout=0.05)  # it must run out: not the 0.15
        self.fcm.answer(drop=True)
        with self.assertRaises(andpush.NetworkError) as dropped:
            client.push({"token": "dropped"})
        self.assertTrue(never.exception.may_have_been_delivered)
        self.assertTrue(dropped.exception.may_have_been_delivered)
        self.assertEqual([(m.token, m.status) for m in self.fcm.messages[1:]],
                         [("late", 200), ("never", None), ("dropped", None)])

    def test_over_the_quota_sends_get_429_with_a_retry_after(self) -> None:
        self.fcm.quota = 3
        client = self.client()
        FakeClock.install(client)  # the client's 429 pause passes at once, the fake's second not
        outcomes = [outcome for _, outcome in client.push_many(
            [{"token": "t%d" % i} for i in range(5)], concurrency=1)]
        self.assertEqual([type(o).__name__ for o in outcomes], ["Response"] * 3 + [
            "QuotaExceededError"] * 2)
        retry_after = outcomes[3].retry_after  # type: ignore[union-attr]
        self.assertTrue(retry_after is not None and 0 < retry_after <= 1, retry_after)

    def test_bad_scripts_are_refused(self) -> None:
        for arguments, error in [({"error": "NOPE"}, ValueError), ({"error": None}, TypeError),
                                 ({"times": 0}, ValueError),
                                 ({"delay": -1}, ValueError), ({"token": ""}, ValueError),
                                 ({"error": "INTERNAL", "drop": True}, ValueError)]:
            with self.subTest(arguments), self.assertRaises(error):
                self.fcm.answer(**arguments)

    def test_reset_forgets_all_but_the_connections_and_tokens(self) -> None:
        client = self.client()
        self.fcm.unregister("gone")
        self.fcm.answer("INTERNAL", times=None)
        self.fcm.quota = 1
        client.subscribe(["a"], "news")
        with self.assertRaises(andpush.InternalError):
            client.push({"token": "a"})
        self.fcm.reset()
        self.assertEqual((self.fcm.messages, self.fcm.members("news"), self.fcm.quota),
                         ([], set(), None))
        self.assertEqual(client.push({"token": "gone"}).status_code, 200)  # its token still good


class FakeRecordingTest(ShippedFakeTestCase):
    """What a test reads back: the messages, bounded, per token, and the counts."""

    def test_the_record_keeps_the_newest_messages_and_counts_them_all(self) -> None:
        fcm = andpush.FakeFCM(max_recorded=3).start()
        self.addCleanup(fcm.close)
        with fcm.client() as client:
            list(client.push_many([{"token": "t%d" % i} for i in range(5)], concurrency=1))
        self.assertEqual([m.token for m in fcm.messages], ["t2", "t3", "t4"])
        self.assertEqual((fcm.counts["messages"], fcm.counts["delivered"]), (5, 5))

    def test_messages_to_a_token_are_its_own_and_its_topics(self) -> None:
        client = self.client()
        client.subscribe(["a", "b"], "news")
        client.push({"token": "a", "data": {"n": "1"}})
        client.push({"topic": "news", "data": {"n": "2"}})
        client.push({"token": "b", "data": {"n": "3"}})
        self.assertEqual([m.message["data"]["n"] for m in self.fcm.messages_to("a")], ["1", "2"])
        self.assertEqual(self.fcm.messages[1].tokens, ("a", "b"))
        self.assertNotIn("'a'", repr(self.fcm.messages[0]))  # no device token in a repr


class FakeTopicsTest(ShippedFakeTestCase):
    """Topic management keeps memberships, which topic and condition sends reach."""

    def test_subscriptions_are_kept_and_sends_reach_the_members(self) -> None:
        client = self.client()
        self.assertTrue(all(isinstance(o, andpush.Response)
                            for o in client.subscribe(["a", "b", "c"], "news")))
        client.subscribe(["c"], "sport")
        client.subscribe(["a"], "news")  # already: a success, as FCM's 409 is to andpush
        client.unsubscribe(["b"], "news")
        self.assertEqual(self.fcm.members("news"), {"a", "c"})
        client.push({"condition": "'news' in topics && !('sport' in topics)"})
        client.push({"condition": "'sport' in topics || 'news' in topics"})
        self.assertEqual([m.tokens for m in self.fcm.messages], [("a",), ("a", "c")])

    def test_unsubscribing_a_token_that_is_not_subscribed_is_not_found(self) -> None:
        outcome = self.client().unsubscribe(["stranger"], "news")[0]
        self.assertIsInstance(outcome, andpush.ClientError)
        path = "/v1/projects/fake-project/registrations/stranger/topicSubscriptions/news"
        status, _, _ = fake_post(self.fcm, path + "?allow_missing=true", b"", method="DELETE")
        self.assertEqual(status, 200)  # as firebase-admin asks


class FakeTokenEndpointTest(unittest.TestCase):
    """The token endpoint refuses a JWT as Google's does: signature, iss, aud, scope, exp."""

    def test_what_is_wrong_with_a_jwt(self) -> None:
        key = _parse_private_key(andpush._FAKE_ACCOUNT_KEY_PEM)
        email = "fake-sender@fake-project.iam.gserviceaccount.com"
        audiences = ("https://127.0.0.1:1/token", andpush._GOOGLE_TOKEN_URI)
        now = 1_800_000_000
        good = {"iss": email, "aud": audiences[0], "scope": FCM_SCOPE, "iat": now,
                "exp": now + 3600}
        google_auth = dict(good, aud=andpush._GOOGLE_TOKEN_URI, scope=" ".join(
            ["https://www.googleapis.com/auth/cloud-platform",
             "https://www.googleapis.com/auth/userinfo.email"]))
        other_key = _parse_private_key(TEST_OTHER_RSA_KEY_PEM)
        table: List[Tuple[Dict[str, Any], Any, Optional[str]]] = [
            (good, key, None),
            (google_auth, key, None),
            (good, other_key, "Invalid JWT Signature."),
            (dict(good, iss="someone@else"), key, "account not found"),
            (dict(good, aud="https://example.com/token"), key, "Failed audience check"),
            (dict(good, scope="https://www.googleapis.com/auth/drive"), key, "Invalid OAuth scope"),
            (dict(good, exp=now - 1), key, "short-lived"),
            (dict(good, exp=now + 7200), key, "short-lived"),
            (dict(good, iat=now + 600, exp=now + 1200), key, "short-lived"),
        ]
        for claims, signer, problem in table:
            with self.subTest(claims=claims, problem=problem):
                assertion = _jwt({"alg": "RS256", "typ": "JWT"}, claims, signer)
                found = andpush._jwt_problem(assertion, key, email, audiences, now)
                if problem is None:
                    self.assertIsNone(found)
                else:
                    assert found is not None
                    self.assertIn(problem, found[1])
        self.assertEqual(andpush._jwt_problem("a.b", key, email, audiences, now)[0],  # type: ignore[index]
                         "invalid_grant")

    def test_a_refused_grant_is_an_auth_error_naming_googles_reason(self) -> None:
        with andpush.FakeFCM() as fcm:
            info = dict(fcm.service_account(), client_email="someone@else.example")
            with fcm.client(credentials=info, max_retries=0) as client, \
                    self.assertRaisesRegex(andpush.AuthError, "account not found"):
                client.push({"token": "a"})


class FakeConnectionsTest(ShippedFakeTestCase):
    """One port speaks HTTP/1.1 and HTTP/2, with TLS and without; only the fake's own
    context trusts its certificate."""

    def test_https_offers_h2_and_http11_by_alpn(self) -> None:
        self.client().push({"token": "a"})
        self.client(http2=False).push({"token": "b"})
        self.assertEqual([m.protocol for m in self.fcm.messages], ["HTTP/2", "HTTP/1.1"])

    def test_plain_http_takes_http11_and_http2_with_prior_knowledge(self) -> None:
        status, _, answer = fake_post(self.fcm, "/v1/projects/fake-project/messages:send",
                                      {"message": {"token": "a"}}, plain=True)
        self.assertEqual(status, 200)
        conn = andpush._H2Connection("127.0.0.1:%d" % self.fcm.port, "http")
        with socket.create_connection(("127.0.0.1", self.fcm.port), timeout=_WAIT_LIMIT) as sock:
            sock.sendall(bytes(conn.outgoing))
            conn.wrote(len(conn.outgoing))
            while conn.state != "OPEN":
                conn.receive(sock.recv(65536))
            conn.start("POST", "/v1/projects/fake-project/messages:send",
                       {"authorization": "Bearer " + self.fcm.access_token},
                       b'{"message": {"token": "b"}}', "b", math.inf)
            sock.sendall(bytes(conn.outgoing))
            while not conn.finished:
                conn.receive(sock.recv(65536))
        self.assertEqual(conn.finished[0][1].status_code, 200)  # type: ignore[union-attr]
        self.assertEqual([m.protocol for m in self.fcm.messages], ["HTTP/1.1", "HTTP/2"])

    def test_a_default_context_does_not_trust_the_fakes_certificate(self) -> None:
        client = andpush.new(access_token=self.fcm.access_token, project_id="fake-project",
                             endpoint=self.fcm.endpoint, max_retries=0)
        self.addCleanup(client.close)
        with self.assertRaisesRegex(andpush.NetworkError, "CERTIFICATE_VERIFY_FAILED"):
            client.push({"token": "a"})

    def test_its_files_are_for_other_programs_and_go_with_it(self) -> None:
        with open(self.fcm.ca_file) as file:
            self.assertEqual(file.read(), andpush._FAKE_CA_PEM)
        with open(self.fcm.service_account_file) as file:
            self.assertEqual(json.load(file), self.fcm.service_account())
        folder = os.path.dirname(self.fcm.ca_file)
        self.fcm.close()
        self.assertFalse(os.path.exists(folder))

    def test_an_asyncio_client_it_hands_out_sends_too(self) -> None:
        async def send() -> Any:
            async with self.fcm.async_client() as client:
                return (await client.push({"token": "a"})).json()

        self.assertEqual(asyncio.run(send())["name"], "projects/fake-project/messages/0:1")


# The README ##################################################################################

class FakeFastAPI:
    """The part of fastapi.FastAPI the README's example uses: a lifespan, a state, and a
    decorator that registers a route handler, so that the test can call them itself."""

    def __init__(self, lifespan: Callable[[Any], Any]) -> None:
        self.lifespan = lifespan
        self.state = types.SimpleNamespace()
        self.routes: Dict[str, Callable[..., Any]] = {}

    def post(self, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(handler: Callable[..., Any]) -> Callable[..., Any]:
            self.routes[path] = handler
            return handler
        return register

    async def serve(self, path: str, *calls: Tuple[Any, ...]) -> List[Any]:
        """Start the app, answer each call of the route at ``path``, and stop the app."""
        async with self.lifespan(self):
            return [await self.routes[path](*arguments) for arguments in calls]


def readme() -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")) as file:
        return file.read()


class FakePytest(types.ModuleType):
    """The part of pytest the README's example uses, so that the test can run its tests."""

    def __init__(self) -> None:
        super().__init__("pytest")
        self.fixtures: Dict[str, Callable[[], Iterator[Any]]] = {}

    def fixture(self, function: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
        self.fixtures[function.__name__] = function
        return function

    @staticmethod
    def raises(error: type) -> Any:
        return unittest.TestCase().assertRaises(error)

    def run(self, test: Callable[..., None]) -> None:
        """Call a test function with its fixtures, each set up and torn down around it."""
        with contextlib.ExitStack() as stack:
            arguments = [stack.enter_context(contextlib.contextmanager(self.fixtures[name])())
                         for name in inspect.signature(test).parameters]
            test(*arguments)


class ReadmeExamplesTest(unittest.TestCase):
    """Every Python example in README.md runs, in order, against the fake server, and the
    tests it shows pass; its ```py examples need packages (the interop tests run them)."""

    def test_every_python_example_runs(self) -> None:
        import asyncio  # only this test needs it, here: merges cleanly with other work
        from typing import AsyncIterator

        examples = re.findall(r"```python\n(.*?)```", readme(), re.DOTALL)
        self.assertGreater(len(examples), 5)
        with FakeFCM() as server, tempfile.TemporaryDirectory() as directory:
            server.valid_tokens.add("test-token")
            server.by_token["t2"] = [fcm_error(404, "UNREGISTERED")]  # the bulk example's
            server.by_token["gone"] = [fcm_error(404, "UNREGISTERED")]  # the FastAPI one's
            with open(os.path.join(directory, "service-account.json"), "w") as file:
                json.dump(service_account_info(server), file)
            real_new = andpush.new

            def new(*args: Any, **options: Any) -> andpush.Client:
                options.setdefault("endpoint", server.endpoint)
                options.setdefault("ssl_context", client_context())
                return real_new(*args, **options)

            real_new_async = andpush.new_async

            def new_async(*args: Any, **options: Any) -> andpush.AsyncClient:
                options.setdefault("endpoint", server.endpoint)
                options.setdefault("ssl_context", client_context())
                return real_new_async(*args, **options)

            async def fetch_tokens() -> AsyncIterator[str]:  # rows of an async database driver
                for token in ("a1", "a2"):
                    await asyncio.sleep(0)
                    yield token

            fastapi = types.ModuleType("fastapi")
            fastapi.FastAPI = FakeFastAPI  # type: ignore[attr-defined]
            pytest = FakePytest()
            forgotten: List[str] = []
            namespace: Dict[str, Any] = {
                "device_token": TOKEN, "other_token": "other-token", "server_key": SERVER_KEY,
                "all_tokens": iter(["t1", "t2", "t3"]),  # one pass only, as a cursor's rows
                "forget": forgotten.append,
                "app": types.SimpleNamespace(task=lambda function: function),
                "fetch_tokens": fetch_tokens,
            }
            cwd = os.getcwd()
            os.chdir(directory)
            try:
                with unittest.mock.patch.object(andpush, "new", new), \
                        unittest.mock.patch.object(andpush, "new_async", new_async), \
                        unittest.mock.patch.dict(sys.modules, fastapi=fastapi, pytest=pytest), \
                        contextlib.redirect_stdout(io.StringIO()):
                    for number, example in enumerate(examples, 1):
                        with self.subTest(example=number):
                            exec(compile(example, "README example %d" % number, "exec"), namespace)
                    tests = [value for value in namespace.values() if isinstance(value, type)
                             and issubclass(value, unittest.TestCase)]
                    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(
                        unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(test)
                                           for test in tests))
                    self.assertEqual((bool(tests), result.failures, result.errors),
                                     (True, [], []))
                    for name, test in list(namespace.items()):
                        if name.startswith("test_") and callable(test):
                            pytest.run(test)
                    namespace["notify"](TOKEN, "Hello")
                    answers = asyncio.run(namespace["app"].serve(
                        "/notify/{token}", (TOKEN, "Hello"), ("gone", "Hello")))
            finally:
                os.chdir(cwd)
                for value in namespace.values():
                    if isinstance(value, andpush.Client):
                        value.close()
            self.assertEqual(server.errors, [])
            self.assertGreater(server.processed, 10)
            self.assertEqual(forgotten, ["t2", "gone"])
            self.assertEqual(answers, [{"sent": True}, {"sent": False}])
            sent_to = [r.json["message"].get("token") for r in server.requests
                       if r.path.endswith(":send")]
            self.assertEqual(sent_to.count("a2"), 1)  # the asyncio push_many's

    def test_every_command_line_example_runs(self) -> None:
        # fake-fcm runs until Ctrl-C: CliFakeTest runs it.
        blocks = re.findall(r"```sh\n(.*?)```", readme(), re.DOTALL)
        commands = [line for block in blocks for line in block.splitlines()
                    if line.startswith("andpush ") and "fake-fcm" not in line]
        self.assertGreaterEqual(len(commands), 5)
        with FakeFCM() as server, tempfile.TemporaryDirectory() as directory:
            for name in ("key.json", "service-account.json"):
                with open(os.path.join(directory, name), "w") as file:
                    json.dump(service_account_info(server), file)
            with open(os.path.join(directory, "ca.pem"), "w") as file:
                file.write(andpush._FAKE_CA_PEM)
            with open(os.path.join(directory, "tokens.txt"), "w") as file:
                file.write("# test devices\ntoken-1\n\ntoken-2\n")
            with open(os.path.join(directory, "messages.jsonl"), "w") as file:
                file.write('{"token": "token-1", "notification": {"title": "Hi Ann"}}\n'
                           '{"topic": "news", "data": {"edition": "42"}}\n')
            cwd = os.getcwd()
            os.chdir(directory)  # the examples name their files relative to it
            try:
                for command in commands:
                    with self.subTest(command):
                        argv = shlex.split(command, comments=True)[1:]
                        if "--fake" not in argv:
                            argv += ["--endpoint", server.endpoint, "--cafile", "ca.pem"]
                        stderr = io.StringIO()
                        with contextlib.redirect_stdout(io.StringIO()), \
                                contextlib.redirect_stderr(stderr):
                            status = andpush.main(argv)
                        self.assertEqual(status, 0, stderr.getvalue())
            finally:
                os.chdir(cwd)
            self.assertEqual(server.errors, [])

    def test_the_command_to_try_it_sends_through_the_fake_with_progress_and_summary(self) -> None:
        section = readme().split("## Try it with nothing to configure")[1]
        command = re.search(r"```sh\n(.*?)\n```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
        make_tokens, _, send = command.partition(" && ")
        self.assertEqual(make_tokens, "seq -f device-%g 100000 > tokens.txt")
        argv = shlex.split(send)
        self.assertEqual(argv[:3], ["python", "-m", "andpush"])
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "tokens.txt"), "w") as file:
                file.writelines("device-%d\n" % number for number in range(1, 301))  # not 100,000
            cwd = os.getcwd()
            os.chdir(directory)
            try:
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):
                    status = andpush.main(argv[3:])
            finally:
                os.chdir(cwd)
        self.assertEqual(status, 0, stderr.getvalue())
        self.assertIn("sent 300 of 300 messages", stderr.getvalue())


class ManualTest(unittest.TestCase):
    """help(andpush) reads as a manual: the usage first, public names only, attributes told."""

    # About 2,150 lines today (2,300 under 3.13, whose pydoc writes a long signature a
    # parameter a line), most of it what pydoc shows of every Exception.
    MAX_LINES = 2400
    PRIVATE_NAME = re.compile(r"(?<![\w.])_[A-Za-z]\w*|andpush\._\w+")

    def manual(self) -> str:
        return pydoc.render_doc(andpush, renderer=pydoc.plaintext)

    def test_the_manual_stays_short_enough_to_read(self) -> None:
        self.assertLess(len(self.manual().splitlines()), self.MAX_LINES)

    def test_it_shows_no_private_names(self) -> None:
        # The constructors of the clients, of what push_many returns and of a fake's
        # ReceivedMessage are wiring that new(), new_async(), push_many and the fake do:
        # their parameters are internal types.
        wiring = set(self.PRIVATE_NAME.findall("".join(
            str(inspect.signature(cls.__init__)) for cls in (
                andpush.Client, andpush.AsyncClient, andpush.Outcomes, andpush.AsyncOutcomes,
                andpush.ReceivedMessage))))
        self.assertEqual(set(self.PRIVATE_NAME.findall(self.manual())) - wiring, set())

    def test_it_lists_only_the_public_names_once_each(self) -> None:
        manual = self.manual()
        self.assertNotIn("__annotations__", manual)
        self.assertNotIn("build = new", manual)
        for name in andpush.__all__:
            with self.subTest(name):
                self.assertRegex(manual, r"\n    (class )?%s\b" % name)

    def test_the_module_docstring_opens_with_the_usage_example(self) -> None:
        doc = andpush.__doc__ or ""
        self.assertLess(doc.index("import andpush"), doc.index("\n\n") + 10)

    def test_the_attributes_of_errors_and_responses_are_documented(self) -> None:
        error = andpush._http_error(response(404, fcm_error(404, "UNREGISTERED").json))
        documented = [
            (andpush.HTTPError, list(vars(error))),
            (andpush.NetworkError, ["may_have_been_delivered"]),
            (andpush.Response, [n for n in andpush.Response.__slots__ if not n.startswith("_")]
             + ["json", "text", "ok"]),
        ]
        for cls, attributes in documented:
            for attribute in attributes:
                with self.subTest("%s.%s" % (cls.__name__, attribute)):
                    self.assertRegex(cls.__doc__ or "", r"\b%s\b" % attribute)


class ImportCostTest(unittest.TestCase):
    """``import andpush`` loads only what every use needs; the rest comes when first used."""

    # Retry-After dates; opening a connection; the command line's parser.
    LAZY = ("email.utils", "http.client", "argparse")

    def test_import_loads_neither_date_parsing_nor_http_client_nor_argparse(self) -> None:
        probe = (
            "import sys; sys.path.insert(0, %r); before = set(sys.modules); import andpush; "
            "print(' '.join(sorted(set(%r) & (set(sys.modules) - before))))"
            % (os.path.dirname(os.path.abspath(andpush.__file__)), self.LAZY)
        )
        done = subprocess.run(python_command("-c", probe), env=child_environment(),
                              capture_output=True, text=True, timeout=30, check=True)
        self.assertEqual((done.stdout.strip(), done.stderr), ("", ""))

    def test_a_retry_after_date_still_parses(self) -> None:
        when = email.utils.format_datetime(
            datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=90),
            usegmt=True)
        wait = andpush._retry_after(when)
        self.assertIsNotNone(wait)
        assert wait is not None
        self.assertTrue(80 <= wait <= 90, wait)


# The command line, run as a user runs it ####################################################

_REPO = os.path.dirname(os.path.abspath(andpush.__file__))
_CLI_TIMEOUT = 30.0  # seconds one run of the command line may take before the test fails
# What the environment must not hold for the command-line runs to be predictable.
_CLI_UNSET = ("ANDPUSH_SERVER_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
              "GCLOUD_PROJECT", "https_proxy", "HTTPS_PROXY")


def _closed_port() -> int:
    """A local port with nothing listening: connecting to it is refused at once."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return int(unused.getsockname()[1])


class CliTestCase(unittest.TestCase):
    """Runs the command line against a FakeFCM, with a key file whose token_uri points at
    the fake and a CA file for its certificate, in a temporary folder.

    ``andpush()`` runs it in this process through ``andpush.main()``, as fast as a function
    call; ``andpush_process()`` runs ``python -m andpush`` in a subprocess, for what only a
    real process shows (the module's entry point, signals, pipes, the exit status itself).
    Both see the same stripped environment.
    """

    def setUp(self) -> None:
        self.server = FakeFCM()
        self.server.start()
        self.addCleanup(self.server.close)
        self.addCleanup(lambda: self.assertEqual(self.server.errors, []))
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.folder = folder.name
        self.key_file = self.write("key.json", json.dumps(service_account_info(self.server)))
        self.ca_file = self.write("ca.pem", andpush._FAKE_CA_PEM)

    def write(self, name: str, text: Union[str, bytes]) -> str:
        path = os.path.join(self.folder, name)
        with open(path, "wb") as file:
            file.write(text.encode() if isinstance(text, str) else text)
        return path

    def read(self, name: str) -> str:
        with open(os.path.join(self.folder, name)) as file:
            return file.read()

    def options(self, credentials: bool = True) -> List[str]:
        """The global options that point andpush at the fake server."""
        found = ["--cafile", self.ca_file, "--endpoint", self.server.endpoint]
        return (["--credentials", self.key_file] if credentials else []) + found

    def environment(self, **variables: str) -> Dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in _CLI_UNSET}
        env["CLOUDSDK_CONFIG"] = self.folder  # no gcloud credentials of the machine's
        env["GCE_METADATA_HOST"] = "127.0.0.1:%d" % _closed_port()
        env.update(variables)
        return env

    def argv(self, args: Tuple[str, ...], server_key: str,
             options: Optional[List[str]]) -> Tuple[List[str], Dict[str, str]]:
        """The arguments and environment of a run: ``args`` followed by ``options``
        (default: self.options(), or with ``server_key`` the legacy API's from
        ANDPUSH_SERVER_KEY)."""
        if options is None:
            options = self.options(credentials=not server_key)
        env = self.environment(ANDPUSH_SERVER_KEY=server_key) if server_key else self.environment()
        return [*args, *options], env

    def andpush(self, *args: str, stdin: str = "", server_key: str = "",
                options: Optional[List[str]] = None) -> "subprocess.CompletedProcess[str]":
        """Run ``andpush.main()`` here, with stdin, stdout, stderr and os.environ replaced."""
        argv, env = self.argv(args, server_key, options)
        stdout, stderr = io.StringIO(), io.StringIO()
        with unittest.mock.patch.dict(os.environ, env, clear=True), \
                unittest.mock.patch.object(sys, "stdin", io.StringIO(stdin)), \
                contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = andpush.main(argv)
        return subprocess.CompletedProcess(argv, status, stdout.getvalue(), stderr.getvalue())

    def andpush_process(self, *args: str, stdin: str = "", server_key: str = "",
                        options: Optional[List[str]] = None) -> "subprocess.CompletedProcess[str]":
        """Run ``python -S -m andpush`` in a subprocess, as a user runs it."""
        argv, env = self.argv(args, server_key, options)
        return subprocess.run(
            python_command("-m", "andpush", *argv), input=stdin, cwd=_REPO,
            env=child_environment(env), capture_output=True, text=True, timeout=_CLI_TIMEOUT,
        )

    def andpush_processes(self, *runs: List[str]) -> List["subprocess.CompletedProcess[str]"]:
        """Each of ``runs`` (whole argument lists) in a ``python -S -m andpush`` subprocess of
        its own, all at once, so that the test waits for the slowest only; the results in
        the order of ``runs``."""
        env = child_environment(self.environment())
        processes = []
        for argv in runs:
            process = subprocess.Popen(
                python_command("-m", "andpush", *argv), cwd=_REPO, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )
            self.addCleanup(process.kill)
            processes.append(process)
        results = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=_CLI_TIMEOUT)
            results.append(subprocess.CompletedProcess(process.args, process.returncode,
                                                       stdout, stderr))
        return results

    def assertExit(self, result: "subprocess.CompletedProcess[str]", status: int) -> None:
        self.assertEqual(result.returncode, status, "stderr:\n" + result.stderr)
        self.assertNotIn("Traceback", result.stderr)

    def assertErrorLine(
        self, result: "subprocess.CompletedProcess[str]", status: int, *fragments: str
    ) -> str:
        """The run ended with ``status`` and one error line on stderr, holding ``fragments``."""
        self.assertExit(result, status)
        lines = result.stderr.splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(lines[0].startswith("andpush: error: "), lines[0])
        for fragment in fragments:
            self.assertIn(fragment, lines[0])
        return lines[0]

    def route(self, method: str, prefix: str, reply: Reply) -> None:
        """Answer every request under ``prefix`` with ``reply`` (no credentials checked)."""
        self.server.routes[(method, prefix)] = lambda request: reply

    def retry_without_waiting(self) -> None:
        """For the rest of the test, in-process runs retry at once: no backoff between the
        attempts of a message or of a token request (their number is unchanged), and no
        hold-off between failed connects."""
        real_new = andpush.new

        def new(*args: Any, **options: Any) -> andpush.Client:
            return real_new(*args, backoff_factor=0.0, **options)

        for patcher in (unittest.mock.patch.object(andpush, "new", new),
                        unittest.mock.patch.object(andpush, "_TOKEN_BACKOFF", 0.0),
                        unittest.mock.patch.object(andpush, "_CONNECT_BACKOFF", 0.0)):
            patcher.start()
            self.addCleanup(patcher.stop)


class CliHelpTest(CliTestCase):
    def test_help_describes_the_tool_with_examples_and_exits_0(self) -> None:
        result = self.andpush_process("--help", options=[])  # python -m andpush, for real
        self.assertExit(result, 0)
        for text in ("Firebase Cloud Messaging", "examples:", "andpush send-many --tokens",
                     "send-many", "subscribe", "unsubscribe", "token", "check",
                     "ANDPUSH_SERVER_KEY", "shell history", "exit status"):
            self.assertIn(text, result.stdout)
        self.assertEqual(result.stderr, "")

    def test_every_command_has_a_help_of_its_own(self) -> None:
        for command in ("send", "send-many", "subscribe", "unsubscribe", "token", "check"):
            with self.subTest(command):
                result = self.andpush(command, "--help", options=[])
                self.assertExit(result, 0)
                self.assertIn("usage: andpush " + command, result.stdout)
                self.assertIn("--credentials", result.stdout)  # the global options too

    def test_no_command_shows_the_help_and_a_wrong_one_an_error_line(self) -> None:
        result = self.andpush(options=[])
        self.assertExit(result, 2)
        self.assertIn("usage: andpush", result.stderr)
        self.assertErrorLine(self.andpush("sendd", options=[]), 2, "invalid choice: 'sendd'")


class CliSendTest(CliTestCase):
    def test_sends_a_notification_with_data_and_prints_the_answer(self) -> None:
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi", "--body", "There",
                              "--image", "https://example.com/a.png",
                              "--data", "order=42", "--data", "query=a=b")
        self.assertExit(result, 0)
        self.assertEqual(json.loads(result.stdout),
                         {"name": "projects/%s/messages/0:1" % TEST_PROJECT})
        self.assertEqual(self.server.requests[-1].json, {"message": {
            "token": TOKEN,
            "notification": {"title": "Hi", "body": "There",
                             "image": "https://example.com/a.png"},
            "data": {"order": "42", "query": "a=b"},
        }, "validate_only": False})

    def test_global_options_may_come_before_the_command(self) -> None:
        result = self.andpush(*self.options(), "send", "--topic", "news", "--body", "Hi",
                              options=[])
        self.assertExit(result, 0)
        self.assertEqual(self.server.requests[-1].json["message"],
                         {"topic": "news", "notification": {"body": "Hi"}})

    def test_a_message_from_stdin_takes_the_flags_and_may_be_validated_only(self) -> None:
        request = {"message": {"topic": "old", "data": {"kept": "yes"}}}
        result = self.andpush("send", "--message", "-", "--condition", "'a' in topics",
                              "--data", "added=1", "--validate-only", stdin=json.dumps(request))
        self.assertExit(result, 0)
        self.assertEqual(json.loads(result.stdout)["name"],
                         "projects/%s/messages/fake_message_id" % TEST_PROJECT)
        self.assertEqual(self.server.requests[-1].json, {"message": {
            "condition": "'a' in topics", "data": {"kept": "yes", "added": "1"},
        }, "validate_only": True})

    def test_a_refused_message_exits_1_with_one_error_line_without_the_token(self) -> None:
        self.server.by_token[TOKEN] = [fcm_error(404, "UNREGISTERED")]
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi")
        line = self.assertErrorLine(result, 1, "UNREGISTERED", "delete it")
        self.assertNotIn(TOKEN, line)
        self.assertEqual(result.stdout, "")

    def test_the_legacy_api_takes_its_server_key_from_the_environment(self) -> None:
        result = self.andpush_process("send", "--token", TOKEN, "--title", "Hi",
                                      server_key=SERVER_KEY)
        self.assertExit(result, 0)
        self.assertEqual(json.loads(result.stdout)["success"], 1)
        request = self.server.requests[-1]
        self.assertEqual((request.path, request.headers["authorization"]),
                         ("/fcm/send", "key=" + SERVER_KEY))
        self.assertEqual(request.json, {"to": TOKEN, "notification": {"title": "Hi"}})
        self.server.unregistered_tokens.add(TOKEN)
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi", server_key=SERVER_KEY)
        self.assertErrorLine(result, 1, "NotRegistered")
        self.assertEqual(json.loads(result.stdout)["failure"], 1)
        self.assertNotIn(SERVER_KEY, result.stdout + result.stderr)

    def test_usage_errors_are_one_error_line_and_exit_2(self) -> None:
        missing = os.path.join(self.folder, "missing.json")
        table: List[Tuple[List[str], Optional[List[str]], str]] = [
            # arguments, options (None: the usual ones), what the error line says
            (["send", "--token", TOKEN, "--data", "order"], None, "expected KEY=VALUE"),
            (["send", "--title", "Hi"], None, "no target"),
            (["send", "--token", TOKEN, "--topic", "news"], None, "not allowed with"),
            (["send", "--token", TOKEN, "--message", missing], None, "cannot read --message"),
            (["send", "--token", TOKEN, "--title", "Hi", "--server-key", SERVER_KEY], None,
             "--credentials or --server-key"),
            (["send", "--token", TOKEN, "--title", "Hi", "--cafile", missing],
             ["--credentials", self.key_file, "--endpoint", self.server.endpoint],
             "cannot use --cafile"),
            (["send", "--token", TOKEN, "--timeout", "-1"], None, "expected a positive number"),
            (["send", "--token", TOKEN, "--data", "from=x"], None, "reserved"),
        ]
        for args, options, message in table:
            with self.subTest(args[2:]):
                self.assertErrorLine(self.andpush(*args, options=options), 2, message)
        self.assertFalse(tokens_sent(self.server))


class CliSendManyTest(CliTestCase):
    def test_sends_to_every_token_of_a_file_and_sums_up_without_a_progress_bar(self) -> None:
        tokens = self.write("tokens.txt", "# the test devices\nt1\n\n  t2  \nt3\n")
        result = self.andpush("send-many", "--tokens", tokens, "--title", "Update",
                              "--concurrency", "2", "--rate", "1000")
        self.assertExit(result, 0)
        self.assertEqual(sorted(tokens_sent(self.server)), ["t1", "t2", "t3"])
        self.assertEqual(self.server.requests[-1].json["message"]["notification"],
                         {"title": "Update"})
        self.assertRegex(result.stderr.splitlines()[-1],
                         r"^andpush: sent 3 of 3 messages in [0-9.]+s: [0-9,]+ messages/s$")
        self.assertNotIn("\r", result.stderr)  # stderr is not a terminal: no bar
        self.assertEqual(result.stdout, "")

    def test_failures_exit_1_and_go_to_the_results_and_unregistered_files(self) -> None:
        tokens = ["t%d" % i for i in range(20)]
        faults: Dict[str, List[Action]] = {
            "t3": [fcm_error(404, "UNREGISTERED")], "t9": [fcm_error(404, "UNREGISTERED")],
            "t5": [fcm_error(400, "INVALID_ARGUMENT")],
            "t7": [fcm_error(503, "UNAVAILABLE")],  # succeeds when retried
        }
        self.server.by_token.update(faults)
        self.retry_without_waiting()
        result = self.andpush("send-many", "--tokens", self.write("tokens.txt", "\n".join(tokens)),
                              "--body", "Hello", "--concurrency", "4",
                              "--results", os.path.join(self.folder, "results.jsonl"),
                              "--unregistered", os.path.join(self.folder, "dead.txt"))
        self.assertExit(result, 1)
        records = [json.loads(line) for line in self.read("results.jsonl").splitlines()]
        self.assertEqual([r["token"] for r in records], tokens)
        self.assertEqual([r["token"] for r in records if not r["ok"]], ["t3", "t5", "t9"])
        self.assertEqual(records[3]["status"], 404)
        self.assertEqual(records[3]["error"], "UNREGISTERED")
        self.assertEqual(records[5]["error"], "INVALID_ARGUMENT")
        self.assertTrue(records[7]["ok"])
        self.assertRegex(records[0]["message"], r"^projects/%s/messages/0:\d+$" % TEST_PROJECT)
        self.assertEqual(self.read("dead.txt"), "t3\nt9\n")
        self.assertIn("sent 17 of 20 messages, 3 failed (2 UNREGISTERED, 1 INVALID_ARGUMENT)",
                      result.stderr)
        self.assertIn("2 unregistered tokens written to", result.stderr)
        self.assertEqual(tokens_sent(self.server).count("t7"), 2)

    def test_tokens_from_stdin_and_results_to_stdout(self) -> None:
        result = self.andpush("send-many", "--tokens", "-", "--results", "-", "--quiet",
                              "--data", "k=v", stdin="a\nb\n")
        self.assertExit(result, 0)
        self.assertEqual([json.loads(line)["token"] for line in result.stdout.splitlines()],
                         ["a", "b"])
        self.assertIn("sent 2 of 2 messages", result.stderr)

    def test_the_legacy_api_reports_not_registered_tokens(self) -> None:
        self.server.unregistered_tokens.add("b")
        dead = os.path.join(self.folder, "dead.txt")
        result = self.andpush("send-many", "--tokens", "-", "--title", "Hi",
                              "--unregistered", dead, stdin="a\nb\nc\n", server_key=SERVER_KEY)
        self.assertExit(result, 1)
        self.assertEqual(self.read("dead.txt"), "b\n")
        self.assertIn("sent 2 of 3 messages, 1 failed (1 NotRegistered)", result.stderr)

    def test_a_missing_or_undecodable_tokens_file_is_an_error_line_and_exit_2(self) -> None:
        result = self.andpush("send-many", "--tokens", os.path.join(self.folder, "none.txt"),
                              "--title", "Hi")
        self.assertErrorLine(result, 2, "cannot read the tokens file", "No such file")
        result = self.andpush("send-many", "--tokens", self.write("bad.txt", b"\xff\xfe\n"),
                              "--title", "Hi")
        self.assertExit(result, 2)
        self.assertIn("cannot read the tokens file", result.stderr.splitlines()[-1])
        self.assertFalse(tokens_sent(self.server))

    def test_refused_credentials_stop_it_before_any_message(self) -> None:
        key = self.write("other.json", json.dumps(
            service_account_info(self.server, TEST_OTHER_RSA_KEY_PEM)))
        result = self.andpush("send-many", "--tokens", "-", "--title", "Hi", stdin="a\nb\n",
                              options=["--credentials", key] + self.options(False))
        self.assertErrorLine(result, 77, "credentials problem", "Invalid JWT Signature")
        self.assertFalse(tokens_sent(self.server))

    def test_a_wrong_project_stops_the_run_at_its_first_answer(self) -> None:
        self.route("POST", "/v1/projects/nope/", fcm_error(404, None, "Requested entity was "
                                                          "not found."))
        tokens = self.write("tokens.txt", "".join("t%d\n" % i for i in range(1000)))
        result = self.andpush("send-many", "--tokens", tokens, "--project-id", "nope",
                              "--concurrency", "2", "--title", "Hi")
        self.assertExit(result, 77)
        self.assertIn("check the project id", result.stderr.splitlines()[-1])
        # The messages already in flight are answered and counted.
        self.assertIn("sent 0 of %d messages" % len(tokens_sent(self.server)), result.stderr)
        self.assertLess(self.server.processed, 100)

    def test_a_message_file_with_a_target_is_refused(self) -> None:
        message = self.write("message.json", json.dumps({"topic": "news"}))
        result = self.andpush("send-many", "--tokens", "-", "--message", message, stdin="a\n")
        self.assertErrorLine(result, 2, "must have no target")

    def test_messages_from_a_json_lines_file_each_with_its_own_target(self) -> None:
        self.server.by_token["gone"] = [fcm_error(404, "UNREGISTERED")]
        lines = [
            {"token": "t1", "notification": {"title": "Hi Ann"}, "data": {"name": "Ann"}},
            {"message": {"token": "t2", "notification": {"title": "Hi Bob"}}},  # a body
            {"topic": "news", "notification": {"title": "To all"}},
            {"token": "gone", "data": {"k": "v"}},
            {"token": "t3", "notificaton": {"title": "a slip"}},
        ]
        text = "# one a line\n" + "\n".join(json.dumps(line) for line in lines) + "\n\n"
        result = self.andpush("send-many", "--messages", self.write("m.jsonl", text),
                              "--results", os.path.join(self.folder, "results.jsonl"),
                              "--unregistered", os.path.join(self.folder, "dead.txt"))
        self.assertExit(result, 1)
        sent = [r.json["message"] for r in self.server.requests if r.path.endswith(":send")]
        self.assertEqual(sorted(m.get("token", m.get("topic")) for m in sent),
                         ["gone", "news", "t1", "t2"])
        self.assertIn({"token": "t1", "notification": {"title": "Hi Ann"},
                       "data": {"name": "Ann"}}, sent)
        records = [json.loads(line) for line in self.read("results.jsonl").splitlines()]
        self.assertEqual([r["token"] for r in records], ["t1", "t2", None, "gone", "t3"])
        self.assertEqual([r["ok"] for r in records], [True, True, True, False, False])
        self.assertEqual(records[4]["error"], "INVALID_MESSAGE")
        self.assertIn("did you mean 'notification'", records[4]["detail"])
        self.assertEqual(self.read("dead.txt"), "gone\n")
        self.assertIn("sent 3 of 5 messages, 2 failed (1 INVALID_MESSAGE, 1 UNREGISTERED)",
                      result.stderr)

    def test_a_line_that_is_no_json_object_stops_the_run_there(self) -> None:
        text = '{"token": "t1", "data": {"k": "v"}}\n{"token": \n'
        result = self.andpush("send-many", "--messages", self.write("m.jsonl", text))
        self.assertExit(result, 2)
        self.assertIn("line 2 of --messages", result.stderr)
        self.assertIn("is not JSON", result.stderr)
        self.assertEqual(tokens_sent(self.server), ["t1"])
        result = self.andpush("send-many", "--messages", "-", stdin="[1, 2]\n")
        self.assertIn("line 1 of --messages '-' must hold a JSON object", result.stderr)

    def test_messages_take_no_content_options_nor_tokens(self) -> None:
        path = self.write("m.jsonl", '{"token": "t1", "data": {"k": "v"}}\n')
        result = self.andpush("send-many", "--messages", path, "--title", "Hi")
        self.assertErrorLine(result, 2, "--messages holds whole messages: give no --title")
        result = self.andpush("send-many", "--messages", path, "--tokens", path)
        self.assertErrorLine(result, 2, "not allowed with argument")
        self.assertFalse(tokens_sent(self.server))

    def test_a_repeated_data_key_is_a_usage_error(self) -> None:
        result = self.andpush("send-many", "--tokens", "-", "--data", "order=1",
                              "--data", "k=v", "--data", "order=2", stdin="a\n")
        self.assertErrorLine(result, 2, "--data gives 'order' more than once")
        result = self.andpush("send", "--token", "a", "--data", "k=1", "--data", "k=2")
        self.assertErrorLine(result, 2, "--data gives 'k' more than once")
        self.assertFalse(tokens_sent(self.server))

    def test_legacy_results_carry_the_canonical_token(self) -> None:
        self.server.canonical_tokens["old"] = "new"
        result = self.andpush("send-many", "--tokens", "-", "--title", "Hi", "--results", "-",
                              stdin="old\nsame\n", server_key=SERVER_KEY)
        self.assertExit(result, 0)
        records = [json.loads(line) for line in result.stdout.splitlines()]
        self.assertEqual([(r["token"], r["canonical_token"]) for r in records],
                         [("old", "new"), ("same", None)])



@unittest.skipIf(os.name != "posix", "sends signals")
class CliSignalTest(CliTestCase):
    """send-many stopped by Ctrl-C or SIGTERM (systemd, docker, Kubernetes): no more tokens
    are taken, every message sent is answered and recorded, and the summary is true."""

    def start(self, count: int, concurrency: int, prefix: str = "t") -> "subprocess.Popen[str]":
        """send-many of <prefix>0, <prefix>1, ... (every fifth unregistered) in a subprocess,
        which takes SIGINT as a terminal's Ctrl-C, with its results in <prefix>results.jsonl
        and its unregistered tokens in <prefix>dead.txt."""
        tokens = ["%s%d" % (prefix, i) for i in range(count)]
        for token in tokens[::5]:
            if not self.server.by_token.get(token):  # what the test set comes first
                self.server.by_token[token] = [fcm_error(404, "UNREGISTERED")]
        tokens_file = self.write(prefix + "tokens.txt", "".join(t + "\n" for t in tokens))
        process = subprocess.Popen(
            python_command("-m", "andpush", "send-many", "--tokens", tokens_file,
             "--results", os.path.join(self.folder, prefix + "results.jsonl"),
             "--unregistered", os.path.join(self.folder, prefix + "dead.txt"),
             "--concurrency", str(concurrency), "--title", "Hi", *self.options()),
            cwd=_REPO, env=child_environment(self.environment()), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            # Python turns SIGINT into KeyboardInterrupt only when it is not ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.addCleanup(process.kill)
        return process

    def sent(self, prefix: str = "t") -> List[str]:
        """The tokens of start(prefix=prefix) that the server processed a send of."""
        return [token for token in tokens_sent(self.server)
                if re.fullmatch(re.escape(prefix) + r"[0-9]+", token)]

    def recorded(self, prefix: str = "t") -> List[str]:
        results = self.read(prefix + "results.jsonl")
        return [json.loads(line)["token"] for line in results.splitlines()]

    def test_sigint_and_sigterm_record_every_message_sent_and_exit_130_and_143(self) -> None:
        self.server.reply_delay = 0.01
        runs = [(signal.SIGINT, "interrupted", 130, "int"),
                (signal.SIGTERM, "terminated", 143, "term")]
        # Both at once, each with tokens of its own, so that the test waits for one only.
        processes = [self.start(2000, concurrency=4, prefix=prefix) for *_, prefix in runs]
        for process, (signum, word, status, prefix) in zip(processes, runs):
            with self.subTest(word):
                self.assertTrue(wait_until(lambda: len(self.sent(prefix)) >= 10, _CLI_TIMEOUT))
                process.send_signal(signum)
                stderr = process.communicate(timeout=_CLI_TIMEOUT)[1]
                self.assertEqual(process.returncode, status, stderr)
                self.assertNotIn("Traceback", stderr)
                recorded = self.recorded(prefix)
                # Every message the server processed is recorded, in token order.
                self.assertEqual(recorded, ["%s%d" % (prefix, i) for i in range(len(recorded))])
                self.assertEqual(sorted(self.sent(prefix)), sorted(recorded))
                dead = [token for token in recorded if int(token[len(prefix):]) % 5 == 0]
                self.assertEqual(self.read(prefix + "dead.txt").split(), dead)
                self.assertIn("{}: {:,} sent, {:,} failed, {:,} not sent".format(
                    word, len(recorded) - len(dead), len(dead), 2000 - len(recorded)),
                    stderr.splitlines()[-1])

    def test_a_second_signal_ends_at_once_and_says_how_many_outcomes_are_unknown(
            self) -> None:
        self.server.slow_seconds = 10.0
        for i in range(10, 20):
            self.server.by_token["t%d" % i] = [SLOW]  # in flight until the server closes
        process = self.start(100, concurrency=2)
        self.assertTrue(wait_until(lambda: len(self.sent()) >= 12, _CLI_TIMEOUT))
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # the first one is handled: t10 and t11 still hold the drain
        process.send_signal(signal.SIGINT)
        stderr = process.communicate(timeout=_CLI_TIMEOUT)[1]
        self.assertLess(time.monotonic() - started, 2.0, "it waited for the answers")
        self.assertEqual(process.returncode, 130, stderr)
        self.assertNotIn("Traceback", stderr)
        self.assertEqual(self.recorded(), ["t%d" % i for i in range(10)])
        unknown = re.search(r"^andpush: interrupted again: 8 sent, 2 failed, (\d+) unknown "
                            r"\(in flight: they may have been delivered\), (\d+) not sent$",
                            stderr, re.MULTILINE)
        self.assertIsNotNone(unknown, stderr)
        assert unknown is not None
        self.assertGreaterEqual(int(unknown.group(1)), 2)  # t10 and t11, and any taken after
        self.assertEqual(int(unknown.group(1)) + int(unknown.group(2)), 90)


class CliTopicTest(CliTestCase):
    def test_subscribe_tokens_from_a_file_and_flags(self) -> None:
        tokens = self.write("tokens.txt", "a\n# not this one\nb\n")
        result = self.andpush("subscribe", "--topic", "news", "--tokens", tokens, "--token", "c")
        self.assertExit(result, 0)
        self.assertEqual(self.server.subscriptions, {("a", "news"), ("b", "news"), ("c", "news")})
        self.assertEqual(result.stderr, "andpush: subscribed 3 of 3 tokens to topic 'news'\n")

    def test_unsubscribe_tokens_from_stdin(self) -> None:
        self.server.subscribe(("a", "news"), ("b", "news"), ("b", "sport"))
        result = self.andpush("unsubscribe", "--topic", "news", "--tokens", "-", stdin="a\nb\n")
        self.assertExit(result, 0)
        self.assertEqual(self.server.subscriptions, {("b", "sport")})
        self.assertIn("unsubscribed 2 of 2 tokens from topic 'news'", result.stderr)

    def test_each_failed_token_gets_a_line_by_its_position_and_exit_1(self) -> None:
        secret = "refused-device-token"
        self.route("POST", "/v1/projects/%s/registrations/%s" % (TEST_PROJECT, secret),
                   fcm_error(400, "INVALID_ARGUMENT"))
        result = self.andpush("subscribe", "--topic", "news", "--token", "a", "--token", secret)
        self.assertExit(result, 1)
        self.assertEqual(result.stderr.splitlines(), [
            "andpush: token 2 of 2: HTTP 400 Bad Request (INVALID_ARGUMENT): error 400",
            "andpush: subscribed 1 of 2 tokens to topic 'news'; 1 failed",
        ])
        self.assertEqual(self.server.subscriptions, {("a", "news")})

    def test_no_tokens_or_the_legacy_api_are_usage_errors(self) -> None:
        self.assertErrorLine(self.andpush("subscribe", "--topic", "news"), 2, "no device tokens")
        result = self.andpush("subscribe", "--topic", "news", "--token", "a",
                              server_key=SERVER_KEY)
        self.assertErrorLine(result, 2, "needs the v1 API")


class CliTokenTest(CliTestCase):
    def test_prints_an_access_token_for_curl(self) -> None:
        result = self.andpush("token")
        self.assertExit(result, 0)
        self.assertEqual(result.stdout, self.server.issued[0] + "\n")
        self.assertEqual(result.stderr, "")

    def test_the_legacy_api_has_no_access_token_and_shows_no_key(self) -> None:
        result = self.andpush("token", server_key=SERVER_KEY)
        line = self.assertErrorLine(result, 2, "no access tokens")
        self.assertNotIn(SERVER_KEY, line)


class CliCheckTest(CliTestCase):
    def test_working_credentials_and_project_say_so(self) -> None:
        result = self.andpush("check")
        self.assertExit(result, 0)
        self.assertIn("project       %s\n" % TEST_PROJECT, result.stdout)
        self.assertIn("The credentials and project work.", result.stdout)
        self.assertEqual(self.server.requests[-1].json,
                         {"message": {"topic": "andpush-check"}, "validate_only": True})

    def test_with_a_token_it_validates_a_message_to_that_token(self) -> None:
        self.assertExit(self.andpush("check", "--token", TOKEN), 0)
        self.assertEqual(self.server.requests[-1].json["message"], {"token": TOKEN})
        self.server.by_token[TOKEN] = [fcm_error(404, "UNREGISTERED")]
        result = self.andpush("check", "--token", TOKEN)
        self.assertEqual(result.returncode, 1)
        self.assertIn("The credentials and project work; the device token does not.",
                      result.stdout)
        self.assertIn("no longer valid", result.stderr)

    def test_each_kind_of_problem_is_explained_with_its_exit_status(self) -> None:
        refused_key = self.write("refused.json", json.dumps(
            service_account_info(self.server, TEST_OTHER_RSA_KEY_PEM)))
        unreachable = dict(service_account_info(self.server),
                           token_uri="https://127.0.0.1:%d/token" % _closed_port())
        unreachable_key = self.write("unreachable.json", json.dumps(unreachable))
        self.retry_without_waiting()
        self.route("POST", "/v1/projects/nope/", fcm_error(404, None))
        self.route("POST", "/v1/projects/locked/", fcm_error(403, None, "Permission denied"))
        table = [
            # the options that cause the problem, the exit status, what the error line says
            (["--credentials", refused_key], 77, "credentials problem"),
            (["--credentials", unreachable_key], 75,
             "try again later: not sent: no access token: could not connect"),
            (["--project-id", "nope"], 77, "check the project id"),
            (["--project-id", "locked"], 77, "cloudmessaging.messages.create"),
        ]
        for options, status, explanation in table:
            with self.subTest(explanation):
                result = self.andpush("check", options=self.options() + options)
                self.assertErrorLine(result, status, explanation)
                self.assertNotIn("The credentials and project work", result.stdout)


class CliExitStatusTest(CliTestCase):
    """A script can tell "fix the command" (2) from "fix the credentials" (77) from "try
    later" (75) from "FCM refused some messages" (1)."""

    def test_real_processes_exit_2_for_usage_77_for_credentials_75_for_an_outage(self) -> None:
        refused_key = self.write("refused.json", json.dumps(
            service_account_info(self.server, TEST_OTHER_RSA_KEY_PEM)))
        closed = "https://127.0.0.1:%d" % _closed_port()
        table = [
            # the arguments, the exit status, what the error line says
            (["sendd", *self.options()], 2, "invalid choice"),
            (["send", "--token", TOKEN, "--title", "Hi", "--credentials", refused_key,
              *self.options(False)], 77, "credentials problem"),
            (["send", "--token", TOKEN, "--title", "Hi", "--max-retries", "0",
              *self.options(), "--endpoint", closed], 75, "try again later"),
        ]
        results = self.andpush_processes(*(args for args, _, _ in table))
        for (_, status, explanation), result in zip(table, results):
            with self.subTest(status=status):
                self.assertErrorLine(result, status, explanation)
        self.assertFalse(tokens_sent(self.server))

    def test_fcm_refusing_the_sender_itself_exits_77_the_apns_key_or_a_token_1(self) -> None:
        table = [
            # what FCM answers (twice: a refused access token is renewed once), exit status,
            # what the error line says
            (fcm_error(401, None, "Request had invalid authentication credentials."), 77,
             "FCM refused the credentials"),
            (fcm_error(403, None, "Permission 'cloudmessaging.messages.create' denied"), 77,
             "permission denied"),
            (fcm_error(401, "THIRD_PARTY_AUTH_ERROR"), 1, "APNs certificate"),
            (fcm_error(403, "SENDER_ID_MISMATCH"), 1, "another Firebase project"),
        ]
        for answer, status, explanation in table:
            with self.subTest(explanation):
                self.server.by_token[TOKEN] = [answer, answer]
                result = self.andpush("send", "--token", TOKEN, "--title", "Hi")
                self.assertErrorLine(result, status, explanation)

    def test_missing_or_unreadable_credentials_exit_77(self) -> None:
        self.retry_without_waiting()  # the metadata server's port is closed: no waits for it
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi",
                              options=self.options(False))
        self.assertErrorLine(result, 77, "no Google credentials found", "metadata server")
        missing = os.path.join(self.folder, "missing.json")
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi",
                              options=["--credentials", missing] + self.options(False))
        self.assertErrorLine(result, 77, "cannot read credentials file")

    def test_fcm_unavailable_exits_75_to_try_again_later(self) -> None:
        self.server.by_token[TOKEN] = [fcm_error(503, "UNAVAILABLE")]
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi", "--max-retries", "0")
        self.assertErrorLine(result, 75, "try again later", "UNAVAILABLE")

    def test_send_many_stops_with_75_when_its_first_answers_are_an_outage(self) -> None:
        self.server.by_token["t0"] = [fcm_error(503, "UNAVAILABLE")]
        tokens = self.write("tokens.txt", "".join("t%d\n" % i for i in range(1000)))
        result = self.andpush("send-many", "--tokens", tokens, "--title", "Hi",
                              "--concurrency", "2", "--max-retries", "0")
        self.assertExit(result, 75)
        self.assertIn("try again later", result.stderr.splitlines()[-1])
        # The messages already in flight are answered and counted.
        self.assertRegex(result.stderr, r"sent %d of %d messages, 1 failed \(1 UNAVAILABLE\)"
                         % (len(tokens_sent(self.server)) - 1, len(tokens_sent(self.server))))
        self.assertLess(self.server.processed, 100)


    def test_the_readme_and_help_list_the_same_exit_statuses_as_the_code(self) -> None:
        with open(os.path.join(_REPO, "README.md")) as file:
            readme = set(re.findall(r"^\| (\d+) \|", file.read(), re.MULTILINE))
        result = self.andpush("--help", options=[])
        epilog = set(re.findall(r"^  (\d+) ", result.stdout.partition("exit status:")[2],
                                re.MULTILINE))
        code = {str(value) for name, value in vars(andpush).items() if name.startswith("_EXIT_")}
        self.assertEqual((readme, epilog), (code, code))


class CliMaxRetriesTest(CliTestCase):
    def test_max_retries_is_how_often_a_send_that_may_work_later_is_sent_again(self) -> None:
        self.retry_without_waiting()
        for retries, outcome in ((0, 75), (1, 75), (2, 0)):
            with self.subTest(retries=retries):
                self.server.by_token[TOKEN] = [fcm_error(503, "UNAVAILABLE")] * 2
                before = len(tokens_sent(self.server))
                result = self.andpush("send", "--token", TOKEN, "--title", "Hi",
                                      "--max-retries", str(retries))
                self.assertExit(result, outcome)
                self.assertEqual(len(tokens_sent(self.server)) - before, min(retries + 1, 3))

    def test_zero_reports_a_refused_connection_at_once(self) -> None:
        options = self.options() + ["--endpoint", "https://127.0.0.1:%d" % _closed_port()]
        started = time.monotonic()
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi", "--max-retries", "0",
                              options=options)
        # The three default retries wait 1.75 s at the very least; a refusal takes a moment.
        self.assertLess(time.monotonic() - started, 1.5)
        self.assertErrorLine(result, 75, "could not connect")

    def test_a_negative_number_is_a_usage_error(self) -> None:
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi", "--max-retries", "-1")
        self.assertErrorLine(result, 2, "--max-retries", "expected a whole number")


class CliEmptyMessageTest(CliTestCase):
    def test_a_message_without_content_is_refused_naming_the_options_to_use(self) -> None:
        target_only = self.write("message.json", json.dumps({"topic": "news"}))
        tokens = self.write("tokens.txt", "a\nb\n")
        for args in (["send", "--token", TOKEN], ["send", "--message", target_only],
                     ["send-many", "--tokens", tokens]):
            with self.subTest(args[0]):
                self.assertErrorLine(self.andpush(*args), 2, "no content", "--title", "--body",
                                     "--data", "--message", "--allow-empty")
        self.assertEqual(self.server.requests, [])  # refused before any I/O: not even a token

    def test_allow_empty_sends_it(self) -> None:
        result = self.andpush("send", "--token", TOKEN, "--allow-empty")
        self.assertExit(result, 0)
        self.assertEqual(self.server.requests[-1].json["message"], {"token": TOKEN})
        result = self.andpush("send-many", "--tokens", "-", "--allow-empty", stdin="a\nb\n")
        self.assertExit(result, 0)
        self.assertEqual(sorted(tokens_sent(self.server)), sorted([TOKEN, "a", "b"]))
        self.assertEqual(self.server.requests[-1].json["message"].keys(), {"token"})


class CliClosedOutputTest(CliTestCase):
    @unittest.skipIf(os.name != "posix", "pipes and SIGPIPE are POSIX")
    def test_results_piped_into_a_reader_that_leaves_stop_quietly_with_141(self) -> None:
        tokens = self.write("tokens.txt", "".join("t%d\n" % i for i in range(3000)))
        argv, env = self.argv(("send-many", "--tokens", tokens, "--results", "-",
                               "--concurrency", "4", "--title", "Hi", "--quiet"), "", None)
        process = subprocess.Popen(
            python_command("-m", "andpush", *argv), cwd=_REPO, env=child_environment(env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.addCleanup(process.kill)
        assert process.stdout is not None and process.stderr is not None
        first = json.loads(process.stdout.readline())  # as `| head -n 1` reads, then leaves
        process.stdout.close()
        stderr = process.communicate(timeout=_CLI_TIMEOUT)[1]
        self.assertEqual(first["token"], "t0")
        self.assertEqual(process.returncode, 141, stderr)
        self.assertNotIn("Traceback", stderr)
        self.assertNotIn("Exception ignored", stderr)
        sent = len(tokens_sent(self.server))
        self.assertLess(sent, 3000)
        # The summary still counts every message sent, though its line could not be written.
        self.assertIn("the output was closed: {:,} sent, 0 failed, {:,} not sent".format(
            sent, 3000 - sent), stderr)


class CliOptionNamesTest(CliTestCase):
    """Errors name the command line's options and variables, not the library's arguments."""

    def test_no_credentials_says_to_pass_the_option(self) -> None:
        self.retry_without_waiting()
        result = self.andpush("token", options=self.options(False))
        line = self.assertErrorLine(result, 77, "Pass --credentials or set "
                                    "GOOGLE_APPLICATION_CREDENTIALS")
        self.assertNotIn("credentials=", line)

    def test_bad_option_values_are_named_by_their_option_or_variable(self) -> None:
        no_project = dict(service_account_info(self.server))
        del no_project["project_id"]
        no_project_key = self.write("no-project.json", json.dumps(no_project))
        table: List[Tuple[List[str], str, int, str]] = [
            # the options, ANDPUSH_SERVER_KEY, the exit status, what the error line says
            (["--endpoint", "http://127.0.0.1"], "", 2, "--endpoint must use https://"),
            (["--project-id", ""], "", 2, "--project-id must be"),
            (["--server-key", " "], "", 2, "--server-key is empty"),
            ([], "key\nmore", 2, "ANDPUSH_SERVER_KEY contains a line break"),
            (["--credentials", no_project_key], "", 77,
             "pass --project-id or set GOOGLE_CLOUD_PROJECT"),
        ]
        for options, server_key, status, message in table:
            with self.subTest(message):
                result = self.andpush("send", "--token", TOKEN, "--title", "Hi",
                                      server_key=server_key,
                                      options=["--cafile", self.ca_file, "--endpoint",
                                               self.server.endpoint, *options])
                line = self.assertErrorLine(result, status, message)
                self.assertNotRegex(line, r"\b[a-z_]+=")

    def test_topics_with_a_server_key_say_which_option_to_give(self) -> None:
        result = self.andpush("subscribe", "--topic", "news", "--token", "a",
                              server_key=SERVER_KEY)
        self.assertErrorLine(result, 2, "needs the v1 API: give --credentials")

    def test_a_library_argument_with_a_value_becomes_the_option_with_that_value(self) -> None:
        self.assertEqual(andpush._in_option_terms('set NO_PROXY, or pass proxy="" for none'),
                         'set NO_PROXY, or pass --proxy "" for none')
        self.assertEqual(andpush._in_option_terms("needs project_id="), "needs --project-id")


class CliProxyTest(CliTestCase):
    def test_proxy_tunnels_every_connection_through_it(self) -> None:
        with ConnectProxy() as proxy:
            result = self.andpush("send", "--token", TOKEN, "--title", "Hi",
                                  "--proxy", "http://127.0.0.1:%d" % proxy.port)
        self.assertExit(result, 0)
        self.assertEqual(set(proxy.targets), {"127.0.0.1:%d" % self.server.port})
        self.assertEqual(len(proxy.targets), 2)  # the token endpoint, then FCM

    def test_an_empty_proxy_asks_the_library_for_none_whatever_the_environment(self) -> None:
        # The library takes proxy="" as "no proxy: ignore HTTPS_PROXY"; this is the handover.
        real_new = andpush.new
        given: List[Optional[str]] = []

        def new(*args: Any, **options: Any) -> andpush.Client:
            given.append(options.get("proxy"))
            return real_new(*args, **options)

        with unittest.mock.patch.object(andpush, "new", new):
            self.assertExit(self.andpush("send", "--token", TOKEN, "--title", "Hi",
                                         "--proxy", ""), 0)
            self.assertExit(self.andpush("send", "--token", TOKEN, "--title", "Hi"), 0)
        self.assertEqual(given, ["", None])  # None: the environment's, if any

    def test_a_proxy_that_is_not_http_is_a_usage_error(self) -> None:
        result = self.andpush("send", "--token", TOKEN, "--title", "Hi",
                              "--proxy", "socks5://127.0.0.1:1080")
        self.assertErrorLine(result, 2, "--proxy must look like http://")


class CliFakeTest(CliTestCase):
    """fake-fcm runs the fake for tests in other languages; --fake sends to one of its own."""

    def lines(self, stream: Any) -> "queue.Queue[str]":
        """The lines of a child's pipe as they come, read by a thread of their own."""
        lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
        return lines

    def test_fake_fcm_says_where_it_is_prints_each_message_and_stops_on_ctrl_c(self) -> None:
        process = subprocess.Popen(
            python_command("-m", "andpush", "fake-fcm"), cwd=_REPO,
            env=child_environment(self.environment()), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.addCleanup(process.kill)
        errors, output = self.lines(process.stderr), self.lines(process.stdout)
        said = {}
        line = ""
        while "Ctrl-C stops" not in line:
            line = errors.get(timeout=_CLI_TIMEOUT)
            name, _, value = line.partition(": ")[2].strip().partition(": ")
            said[name] = value
        endpoint = re.search(r"https://127\.0\.0\.1:[0-9]+", line + str(said)).group(0)  # type: ignore[union-attr]
        result = self.andpush("send", "--token", "t1", "--title", "Hi", options=[
            "--credentials", said["service account key file"], "--cafile", said["CA file"],
            "--endpoint", endpoint])
        self.assertExit(result, 0)
        logged = json.loads(output.get(timeout=_CLI_TIMEOUT))
        self.assertEqual((logged["message"], logged["status"], logged["protocol"]),
                         ({"token": "t1", "notification": {"title": "Hi"}}, 200, "HTTP/2"))
        process.send_signal(signal.SIGINT)
        process.wait(timeout=_CLI_TIMEOUT)
        self.addCleanup(process.stderr.close)  # type: ignore[union-attr]
        self.addCleanup(process.stdout.close)  # type: ignore[union-attr]
        self.assertEqual(process.returncode, 0)
        self.assertIn("stopped: 1 messages received, 1 delivered", errors.get(timeout=_CLI_TIMEOUT))

    def test_fake_sends_every_command_to_a_fake_of_its_own(self) -> None:
        result = self.andpush("--fake", "send", "--token", "t1", "--title", "Hi", options=[])
        self.assertExit(result, 0)
        self.assertEqual(json.loads(result.stdout)["name"], "projects/fake-project/messages/0:1")
        result = self.andpush("--fake", "send-many", "--tokens", "-", "--title", "Hi",
                              stdin="a\nb\nc\n", options=[])
        self.assertExit(result, 0)
        self.assertIn("sent 3 of 3 messages", result.stderr)

    def test_options_that_say_where_fcm_is_mean_nothing_with_the_fake(self) -> None:
        result = self.andpush("--fake", "send", "--token", "t", "--title", "Hi",
                              options=["--endpoint", "https://127.0.0.1:1"])
        self.assertErrorLine(result, 2, "--fake sends to a fake FCM of its own",
                             "leave out --endpoint")
        result = self.andpush("fake-fcm", options=["--credentials", self.key_file])
        self.assertErrorLine(result, 2, "leave out --credentials")


class CliProgressTest(unittest.TestCase):
    """send-many's progress display, socket-free, on a fake clock and stream."""

    class Stream:
        def __init__(self, terminal: bool) -> None:
            self.terminal = terminal
            self.text = ""
            self.lock = threading.Lock()
            self.writers = 0  # how many threads are inside write() now
            self.most_writers = 0

        def write(self, text: str) -> int:
            with self.lock:
                self.writers += 1
                self.most_writers = max(self.most_writers, self.writers)
            self.text += text
            with self.lock:
                self.writers -= 1
            return len(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return self.terminal

        def fileno(self) -> int:
            raise OSError("no file descriptor")

    def progress(self, terminal: bool, total: Optional[int]) -> Tuple[Any, Any, List[float]]:
        stream = self.Stream(terminal)
        now = [1000.0]
        return andpush._Progress(stream, total, False, clock=lambda: now[0]), stream, now

    def test_on_a_terminal_a_bar_is_redrawn_in_place_ten_times_a_second_at_most(self) -> None:
        progress, stream, now = self.progress(terminal=True, total=1000)
        progress.update(1, 0)
        self.assertTrue(stream.text.startswith("\r[" + "-" * 20 + "] 1/1,000 (0%), 0 failed"))
        progress.update(2, 0)
        self.assertEqual(stream.text.count("\r"), 1)
        now[0] = 1005.0
        progress.update(500, 3)
        self.assertIn("\r[#########----------] 500/1,000 (50%), 3 failed, 100/s, 5.0s "
                      "elapsed, 5.0s left\x1b[K", stream.text)
        progress.finish(1000, 7)
        self.assertTrue(stream.text.endswith("1,000/1,000 (100%), 7 failed, 200/s, 5.0s "
                                             "elapsed\x1b[K\n"))
        progress.update(1000, 7)
        self.assertEqual(stream.text.count("\r"), 3)
        drawn = stream.text.replace("\x1b[K", "").replace("\n", "").split("\r")
        self.assertLessEqual(max(len(line) for line in drawn), 79)  # 80 columns: no wrapping

    def test_without_a_terminal_a_plain_line_every_two_seconds(self) -> None:
        progress, stream, now = self.progress(terminal=False, total=None)
        progress.update(1, 0)
        now[0] = 1001.9
        progress.update(2, 0)
        self.assertEqual(stream.text, "")
        now[0] = 1002.0
        progress.update(100, 1)
        self.assertEqual(stream.text, "andpush: 100 done, 1 failed, 50/s, 2.0s elapsed\n")
        progress.finish(200, 1)
        self.assertNotIn("\r", stream.text)
        self.assertEqual(stream.text.count("\n"), 1)

    def test_updates_from_many_threads_draw_one_at_a_time(self) -> None:
        stream = self.Stream(terminal=True)
        progress = andpush._Progress(stream, 8000, False)
        counter = iter(range(1, 8001))

        def send() -> None:
            for _ in range(1000):
                progress.update(next(counter), 0)

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        progress.finish(8000, 0)
        self.assertEqual(stream.most_writers, 1)
        self.assertIn("8,000/8,000 (100%)", stream.text.rpartition("\r")[2])
        self.assertTrue(stream.text.endswith("\n"))

    def test_summary_and_durations(self) -> None:
        self.assertEqual(
            andpush._summary(9600, {"INVALID_ARGUMENT": 100, "UNREGISTERED": 300}, 4.0),
            "sent 9,600 of 10,000 messages, 400 failed (300 UNREGISTERED, 100 INVALID_ARGUMENT) "
            "in 4.0s: 2,500 messages/s")
        self.assertEqual(andpush._summary(0, {}, 0.0), "sent 0 of 0 messages in 0.0s: - messages/s")
        for seconds, text in ((4.25, "4.2s"), (59.9, "59.9s"), (65, "1:05"), (3725, "1:02:05")):
            self.assertEqual(andpush._duration(seconds), text)



# HTTP/2 ######################################################################################
# push_many multiplexing over FakeFCM2; each fault checked against what the server processed.

H2_TOKEN = "test-token"


def sent_counts(server: FakeFCM) -> Dict[str, int]:
    """How many times the server processed each device token's send."""
    return collections.Counter(tokens_sent(server))


class HTTP2TestCase(ServerTestCase):
    """A test against its own FakeFCM2, with v1 clients that speak HTTP/2 to it."""

    server_class = FakeFCM2
    server: FakeFCM2

    def setUp(self) -> None:
        super().setUp()
        self.server.valid_tokens.add(H2_TOKEN)

    def h2_client(self, **options: Any) -> andpush.Client:
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        client = andpush.new(access_token=H2_TOKEN, project_id=TEST_PROJECT, **options)
        self.addCleanup(client.close)
        return client

    def push_many(self, count: int, concurrency: int = 20, **options: Any) -> List[Any]:
        messages = [{"token": "t%d" % i, "data": {"n": str(i)}} for i in range(count)]
        return outcomes_of(self.h2_client(**options).push_many(messages, concurrency=concurrency),
                           messages)

    def assert_all_sent_once(self, outcomes: List[Any], count: int) -> None:
        self.assertEqual(len(outcomes), count)
        for outcome in outcomes:
            self.assertIsInstance(outcome, andpush.Response)
        self.assertEqual(sent_counts(self.server), {"t%d" % i: 1 for i in range(count)})



@contextlib.contextmanager
def mute_server() -> Iterator[str]:
    """The endpoint of a server that takes connections (into its backlog) and never says a
    word, not even the TLS handshake's."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        yield "https://127.0.0.1:%d" % mute.getsockname()[1]


class CertificateFailureTest(unittest.TestCase):
    """A certificate that fails verification is a CertificateError (a NetworkError of the
    setup): not retried, and its message says how to trust the right CA. The clients trust
    no CA at all (loading the system's costs 20 ms a client)."""

    def test_an_untrusted_certificate_is_not_retried_and_says_how_to_fix_it(self) -> None:
        with FakeFCM() as server:
            client = andpush.new(SERVER_KEY, endpoint=server.endpoint, max_retries=3,
                                 ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
            self.addCleanup(client.close)
            clock = FakeClock.install(client)
            with self.assertRaises(andpush.CertificateError) as caught:
                client.push(LEGACY_MESSAGE)
            error = caught.exception
            self.assertIsInstance(error, andpush.NetworkError)
            self.assertFalse(error.may_have_been_delivered)
            for fragment in ("CERTIFICATE_VERIFY_FAILED", "ssl_context=", "--cafile",
                             "proxy", "Sending again cannot help", server.endpoint):
                self.assertIn(fragment, str(error))
            self.assertEqual(clock.sleeps[1::2], [])  # no backoff: not retried (the
            # route only holds off after the failed connect)
            self.assertTrue(wait_until(lambda: server.connections == 1))
            self.assertEqual((server.connections, server.processed), (1, 0))

    def test_a_certificate_for_another_host_points_at_the_endpoint(self) -> None:
        failure = ssl.SSLCertVerificationError(1, "certificate verify failed")
        failure.verify_code = 62  # X509_V_ERR_HOSTNAME_MISMATCH
        failure.verify_message = "Hostname mismatch, certificate is not valid for 'x'."
        error = andpush._connect_error(andpush._Origin("https://x", None), failure, 10.0, False)
        self.assertIsInstance(error, andpush.CertificateError)
        self.assertIn("check the endpoint, and the proxy if one answers for it", str(error))
        self.assertNotIn("--cafile", str(error))

    def test_the_token_endpoints_certificate_too(self) -> None:
        with FakeFCM() as server:
            client = andpush.new(credentials=service_account_info(server),
                                 endpoint=server.endpoint,
                                 ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
            self.addCleanup(client.close)
            clock = FakeClock.install(client)
            with self.assertRaises(andpush.CertificateError):
                client.push(V1_MESSAGE)
            self.assertEqual(clock.sleeps[1::2], [])  # not retried (a hold-off, no backoff)

    def test_the_asyncio_client_gives_the_same_error(self) -> None:
        async def push(server: FakeFCM) -> None:
            async with andpush.new_async(
                    SERVER_KEY, endpoint=server.endpoint, max_retries=3, backoff_factor=10.0,
                    ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)) as client:
                await client.push(LEGACY_MESSAGE)

        with FakeFCM() as server, self.assertRaises(andpush.CertificateError) as caught:
            asyncio.run(push(server))
        self.assertIn("--cafile", str(caught.exception))

    def test_the_command_line_exits_with_the_setup_status(self) -> None:
        with FakeFCM() as server, tempfile.TemporaryDirectory() as folder:
            key = os.path.join(folder, "key.json")
            with open(key, "w") as file:
                json.dump(service_account_info(server), file)
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                status = andpush.main(["--credentials", key, "--endpoint", server.endpoint,
                                       "check"])
        self.assertEqual(status, 77)
        self.assertIn("andpush: error: TLS problem, fix the setup: the TLS certificate of",
                      stderr.getvalue())
        self.assertIn("--cafile", stderr.getvalue())


class TimeoutErrorTest(HTTP2TestCase):
    """A timeout's error says which one ran out, after how long, for what URL, and how to
    raise it; over HTTP/2 as over HTTP/1.1, and for the connect timeout too."""

    HINT = "raise it with timeout=SECONDS"

    def test_the_read_timeout_over_http2(self) -> None:
        self.server.reply_delay = 0.3
        client = self.h2_client(timeout=(1.0, 0.01))
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(V1_MESSAGE)
        self.assertEqual(str(caught.exception), (
            "no answer from %s/v1/projects/%s/messages:send within the read timeout of 0.01 s "
            "(the request may have been processed); if the server is slow, %s"
            % (self.server.endpoint, TEST_PROJECT, self.HINT)))
        self.assertTrue(caught.exception.may_have_been_delivered)
        with self.assertRaisesRegex(andpush.NetworkError, "read timeout of 0.07 s"):
            client.push(V1_MESSAGE, timeout=0.07)

    def test_the_read_timeout_over_http1_hides_the_device_token_of_a_topic_change(
            self) -> None:
        self.server.reply_delay = 0.3
        client = self.h2_client(timeout=(1.0, 0.01), http2=False)
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(V1_MESSAGE)
        self.assertIn("no answer from %s/v1/projects/%s/messages:send within the read timeout "
                      "of 0.01 s" % (self.server.endpoint, TEST_PROJECT), str(caught.exception))
        self.assertIn(self.HINT, str(caught.exception))
        (outcome,) = client.subscribe([TOKEN], "news")
        self.assertIn("/v1/projects/%s/registrations/... within the read timeout"
                      % TEST_PROJECT, str(outcome))
        self.assertNotIn(TOKEN, str(outcome))

    def test_the_connect_timeout_of_a_server_that_never_shakes_hands(self) -> None:
        with mute_server() as endpoint:
            client = andpush.new(SERVER_KEY, endpoint=endpoint, timeout=(0.01, 1.0),
                                 max_retries=0, ssl_context=client_context())
            self.addCleanup(client.close)
            with self.assertRaises(andpush.NetworkError) as caught:
                client.push(LEGACY_MESSAGE)
        self.assertIn(  # (the try's own deadline may come first: "not sent: ...")
            "could not connect to %s within the connect timeout of 0.01 s; if the network is "
            "slow, %s" % (endpoint, self.HINT), str(caught.exception))
        self.assertFalse(caught.exception.may_have_been_delivered)

    def test_no_settings_within_the_connect_timeout(self) -> None:
        self.server.send_settings = False
        with self.assertRaises(andpush.NetworkError) as caught:
            self.h2_client(timeout=(0.05, 1.0)).push(V1_MESSAGE)
        self.assertIn("sent no HTTP/2 SETTINGS within the connect timeout of 0.05 s; if the "
                      "server is slow, " + self.HINT, str(caught.exception))

    def test_the_command_line_names_its_option(self) -> None:
        self.server.reply_delay = 0.3
        stderr = io.StringIO()
        with tempfile.TemporaryDirectory() as folder:
            ca_file = os.path.join(folder, "ca.pem")
            with open(ca_file, "w") as file:
                file.write(andpush._FAKE_CA_PEM)
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()), \
                    environment(ANDPUSH_SERVER_KEY=SERVER_KEY):
                status = andpush.main(["--endpoint", self.server.endpoint, "--cafile", ca_file,
                                       "--timeout", "0.05", "--max-retries", "0", "send",
                                       "--token", TOKEN, "--title", "Hi"])
        self.assertEqual(status, 75)
        self.assertIn("within the read timeout of 0.05 s", stderr.getvalue())
        self.assertIn("raise it with --timeout SECONDS", stderr.getvalue())


class EngineTest(HTTP2TestCase):
    """One I/O thread per client owns its connections, which outlive each call."""

    def test_connections_outlive_push_many_and_serve_the_next_call(self) -> None:
        client = self.h2_client()
        for _ in range(3):
            self.assertEqual(len(list(client.push_many(
                [{"token": "t%d" % i} for i in range(100)], concurrency=50))), 100)
        client.push(V1_MESSAGE)
        self.assertEqual(self.server.handshakes, 1)
        self.assertEqual(self.server.processed, 301)

    def test_over_http11_too_push_many_reuses_the_connections_of_the_last_call(self) -> None:
        client = self.h2_client(http2=False)
        for _ in range(2):
            list(client.push_many([{"token": "t%d" % i} for i in range(40)], concurrency=4))
        self.assertLessEqual(self.server.handshakes, 4)
        self.assertEqual(self.server.processed, 80)

    def test_connect_threads_that_cannot_start_are_counted_and_the_client_recovers(
            self) -> None:
        # A process out of threads: a connect thread whose own threads do not start reports
        # those connections failed, so that none is waited for (or counted) for ever. The
        # connections that came up carry every message meanwhile; then the client sends
        # again.
        client = self.h2_client(http2=False)
        client.push(V1_MESSAGE)  # the route speaks HTTP/1.1: the next opening asks for four
        start = threading.Thread.start
        refused: List[threading.Thread] = []

        def start_one(thread: threading.Thread) -> None:
            if threading.current_thread().name == "andpush-connect":  # a share of the others
                refused.append(thread)
                raise RuntimeError("can't start new thread")
            start(thread)

        with unittest.mock.patch.object(threading.Thread, "start", start_one):
            outcomes = [outcome for _, outcome in client.push_many(
                [{"token": "t%d" % i} for i in range(10)], concurrency=5)]
        self.assertTrue(refused)
        self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes))
        route = client._driver._routes[0]
        self.assertTrue(wait_until(lambda: route.connecting == 0))  # none counted for ever
        self.assertEqual(client.push(V1_MESSAGE).status_code, 200)
        self.assertEqual(len(list(client.push_many([V1_MESSAGE] * 4, concurrency=4))), 4)

    def test_threads_and_push_many_share_the_same_connection(self) -> None:
        self.server.reply_delay = 0.02
        client = self.h2_client()
        pushers = [threading.Thread(target=client.push, args=(V1_MESSAGE,)) for _ in range(20)]
        for pusher in pushers:
            pusher.start()
        outcomes = list(client.push_many([{"token": "t%d" % i} for i in range(50)]))
        for pusher in pushers:
            pusher.join(5)
        self.assertEqual(len(outcomes), 50)
        self.assertEqual(self.server.processed, 70)
        self.assertEqual(self.server.handshakes, 1)

    def test_ctrl_c_in_a_push_leaves_its_request_to_the_io_thread_and_the_client_usable(
            self) -> None:
        client = self.h2_client()
        client.push(V1_MESSAGE)  # connected: the next push waits only for its answer
        self.server.reply_delay = 0.1

        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt
        previous = signal.signal(signal.SIGALRM, interrupt)
        self.addCleanup(signal.signal, signal.SIGALRM, previous)
        errors: List[logging.LogRecord] = []
        handler = logging.Handler(logging.ERROR)
        handler.emit = errors.append  # type: ignore[method-assign]
        logging.getLogger("andpush").addHandler(handler)
        self.addCleanup(logging.getLogger("andpush").removeHandler, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.03)
        with self.assertRaises(KeyboardInterrupt):
            client.push(V1_MESSAGE)  # the caller runs the loop, and is waiting in select
        self.server.reply_delay = 0.0  # the next answer at once, the interrupted one's still late
        self.assertEqual(client.push(V1_MESSAGE).status_code, 200)
        self.assertEqual(self.server.processed, 3)  # the interrupted one too, once
        self.assertTrue(settles(client))  # its late answer taken too, before the errors are read
        self.assertEqual(errors, [])  # nothing failed: the loop went on on another thread

    def test_no_thread_waits_beside_idle_connections_and_one_idle_too_long_is_replaced(
            self) -> None:
        client = self.h2_client(keep_alive_timeout=0.02)
        client.push(V1_MESSAGE)
        self.assertIsNone(client._driver._thread)  # the caller ran the loop, and left it
        self.assertNotIn("andpush-io", [t.name for t in threading.enumerate()])
        client.push(V1_MESSAGE)  # within keep_alive_timeout: the same connection
        time.sleep(0.03)  # idle longer than that, whatever the load: a sleep is never shorter
        client.push(V1_MESSAGE)  # a new connection, without a failed send
        self.assertEqual((self.server.handshakes, self.server.processed), (2, 3))

    def test_a_timeout_for_one_push_bounds_that_push_only(self) -> None:
        self.server.slow_seconds = 1.0
        self.server.inject(SLOW)  # the first push's answer only
        client = self.h2_client()
        started = time.monotonic()
        with self.assertRaises(andpush.NetworkError) as caught:
            client.push(V1_MESSAGE, timeout=0.05)
        self.assertLess(time.monotonic() - started, 0.25)
        self.assertTrue(caught.exception.may_have_been_delivered)
        self.assertEqual(client.push(V1_MESSAGE).status_code, 200)  # the client's 30 s

    def test_a_failure_inside_the_io_loop_ends_each_held_message_and_the_client_recovers(
            self) -> None:
        self.server.reply_delay = 0.02
        self.server.by_token["t19"] = [SLOW]  # in flight still when the others are answered
        client = self.h2_client()
        client.push(V1_MESSAGE)
        fire_timers = andpush._Engine._fire_timers
        failed = []

        def fails_once(engine: andpush._Engine, now: float) -> None:
            holds = any(h2.conn.streams for route in engine._routes for h2 in route.h2)
            if holds and not failed:  # once, while the engine holds messages in flight
                failed.append(now)
                raise RuntimeError("a bug in the engine")
            fire_timers(engine, now)

        messages = CountingMessages(20)
        outcomes: List[Any] = []
        with unittest.mock.patch.object(andpush._Engine, "_fire_timers", fails_once), \
                self.assertLogs("andpush", "ERROR"):
            try:
                outcomes.extend(client.push_many(messages))
            except andpush.NetworkError as exc:  # the input the engine never read
                self.assertFalse(exc.may_have_been_delivered)
        # A pair for each message read, but the one being read as the engine went away.
        self.assertIn(len(outcomes), (messages.taken, messages.taken - 1))
        self.assertTrue(any(isinstance(o, andpush.NetworkError) for _, o in outcomes))
        sent = sent_counts(self.server)
        for i, (message, outcome) in enumerate(outcomes):
            self.assertEqual(message, {"token": "t%d" % i})
            if not isinstance(outcome, andpush.Response):
                self.assertIsInstance(outcome, andpush.NetworkError)
                if not outcome.may_have_been_delivered:
                    self.assertEqual(sent["t%d" % i], 0)
        self.assertEqual(client.push(V1_MESSAGE).status_code, 200)

    def test_the_callers_code_failing_on_andpush_threads_reaches_no_other_message(
            self) -> None:
        calls = []

        def token() -> str:
            calls.append(1)
            if len(calls) == 2:
                raise KeyError("the vault is down")
            return H2_TOKEN

        client = andpush.new(access_token=token, project_id=TEST_PROJECT, max_retries=0,
                             endpoint=self.server.endpoint, ssl_context=client_context())
        self.addCleanup(client.close)

        def progress(done: int, failed: int) -> None:
            raise RuntimeError("a bug in the caller's progress bar")

        with self.assertLogs("andpush", "ERROR"), \
                unittest.mock.patch.object(andpush, "_TOKEN_FAILURE_HOLD", 0.0):
            pairs = list(client.push_many([{"token": "t%d" % i} for i in range(5)],
                                          concurrency=1, progress=progress))
        outcomes = [outcome for _, outcome in pairs]
        self.assertIsInstance(outcomes[1], andpush.AuthError)  # the failed token: that one
        self.assertIn("the vault is down", str(outcomes[1]))
        self.assertEqual([type(o) for o in outcomes[2:]], [andpush.Response] * 3)

    def test_timeout_takes_a_connect_read_pair(self) -> None:
        client = self.h2_client(timeout=(0.5, 0.01))
        self.server.reply_delay = 0.3
        with self.assertRaises(andpush.NetworkError):
            client.push(V1_MESSAGE)
        for bad in [(1, 2, 3), (0, 1), (1, "2")]:
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "timeout"):
                andpush.new(SERVER_KEY, timeout=bad)  # type: ignore[arg-type]


class CountingSigner:
    """A signer whose access token is set by the test, counting the headers it gives."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.asked = 0

    def headers_now(self) -> Optional[Tuple[Dict[str, str], str]]:
        self.asked += 1
        return {"authorization": "Bearer " + self.token}, self.token

    def token_request(self) -> andpush._Exchange:
        raise AssertionError("the token is always there")

    def token_answered(self, outcome: Optional[andpush.Outcome]) -> Any:
        raise AssertionError("the token is always there")

    def invalidate(self, token: str) -> None:
        raise AssertionError("no request is refused")


class MemoryEngine(andpush._Engine):
    """The engine with no driver: one HTTP/2 connection that the test hands it, whose
    output it keeps, on a fake clock."""

    def __init__(self) -> None:
        super().__init__(10.0, 10.0, 60.0, "", andpush._Policy(None))
        self.clock = FakeClock()
        self.route_ = self.route("https://fcm.googleapis.com")

    def open_link(self) -> andpush._H2Link:
        """A connection up, its SETTINGS come: as a driver would hand it over."""
        self.route_.connecting += 1
        self._connected(self.route_, None, True, self.route_.generation)
        (link,) = self.route_.h2
        self._received(link, h2_settings())
        link.conn.wrote(len(link.conn.outgoing))
        return link

    def _open(self, route: andpush._Route, count: int) -> None:
        raise AssertionError("the test hands the engine its connection")

    def _watch(self, link: andpush._Link) -> None:
        pass

    def _send(self, link: andpush._Link) -> None:
        pass

    def _shut(self, link: andpush._Link) -> None:
        pass


class EngineSigningTest(unittest.TestCase):
    """Each attempt goes out with the access token its signer gives when it is placed;
    the requests placed together are signed once, as at one instant it gives the same."""

    def setUp(self) -> None:
        self.engine = MemoryEngine()
        self.link = self.engine.open_link()
        self.signer = CountingSigner("first")
        self.decoder = andpush._HPACKDecoder(4096)

    def exchanges(self, count: int) -> List[andpush._Exchange]:
        """Pushes the test's signer signs."""
        return [andpush._Exchange(self.engine.route_, "POST", "/send", b"{}",
                                  andpush._Retry(0, 0.0), self.signer, None, True)
                for _ in range(count)]

    def authorizations(self) -> List[str]:
        """The authorization of each request queued since last asked, now written."""
        conn = self.link.conn
        frames = h2_frames(bytes(conn.outgoing))
        conn.wrote(len(conn.outgoing))
        return [dict(self.decoder.decode(payload))["authorization"]
                for kind, _, _, payload in frames if kind == H2_HEADERS]

    def test_requests_placed_together_are_signed_once(self) -> None:
        burst = self.exchanges(5)
        self.engine._begin_all(burst)
        self.assertEqual(self.signer.asked, 1)
        self.assertEqual(self.authorizations(), ["Bearer first"] * 5)
        self.assertEqual([e.access_token for e in burst], ["first"] * 5)

    def test_the_next_placing_asks_again_and_takes_a_new_token(self) -> None:
        self.engine._begin_all(self.exchanges(2))
        self.signer.token = "second"
        later = self.exchanges(3)
        self.engine._begin_all(later)
        self.assertEqual(self.signer.asked, 2)
        self.assertEqual(self.authorizations(), ["Bearer first"] * 2 + ["Bearer second"] * 3)
        self.assertEqual([e.access_token for e in later], ["second"] * 3)

    def test_a_request_given_its_headers_by_a_refresh_keeps_them(self) -> None:
        refreshed, *rest = self.exchanges(3)
        refreshed.signed = ({"authorization": "Bearer refreshed"}, "refreshed")
        self.engine._begin_all([refreshed, *rest])
        self.assertEqual(self.authorizations()[0], "Bearer refreshed")
        self.assertEqual(refreshed.access_token, "refreshed")
        self.assertIsNone(refreshed.signed)

    def test_a_request_without_a_signer_goes_with_its_own_headers(self) -> None:
        fixed = andpush._Exchange(self.engine.route_, "POST", "/send", b"{}",
                                  andpush._Retry(0, 0.0), None, {"authorization": "key=fixed"},
                                  True)
        signed = self.exchanges(1)
        self.engine._begin_all([*signed, fixed, *self.exchanges(1)])
        self.assertEqual(self.authorizations(),
                         ["Bearer first", "key=fixed", "Bearer first"])
        self.assertEqual(self.signer.asked, 1)


class CountingWake:
    """The thread driver's wake-up socket, counting the wakes sent."""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, data: bytes) -> int:
        self.sent += 1
        return len(data)


class RecordingSelector:
    """A selector with nothing ever ready, keeping the timeout of each wait."""

    def __init__(self) -> None:
        self.timeouts: List[Optional[float]] = []

    def select(self, timeout: Optional[float]) -> List[Any]:
        self.timeouts.append(timeout)
        return []


class ThreadDriverHandoverTest(unittest.TestCase):
    """Work handed to the thread driver from another thread wakes its selector only if it
    waits there: mid-turn, it looks at what was handed over before it waits, and then
    does not wait."""

    def setUp(self) -> None:
        self.driver = andpush._ThreadDriver(ssl.create_default_context(), 10.0, 10.0, 60.0, "",
                                            andpush._Policy(None))
        self.driver._thread = threading.Thread()  # another thread runs the driver
        self.wake = CountingWake()
        self.selector = RecordingSelector()
        self.driver._wake_w = self.wake  # type: ignore[assignment]
        self.driver._selector = self.selector  # type: ignore[assignment]

    def test_work_handed_over_mid_turn_sends_no_wake(self) -> None:
        self.driver._post(lambda: None)
        self.driver._post(lambda: None)
        self.assertEqual(self.wake.sent, 0)
        self.assertEqual(len(self.driver._inbox), 2)

    def test_work_handed_over_while_the_driver_waits_sends_one_wake(self) -> None:
        self.driver._selecting = True
        self.driver._post(lambda: None)
        self.driver._post(lambda: None)
        self.assertEqual(self.wake.sent, 1)

    def turn_with(self, work: Callable[[], None]) -> Optional[float]:
        """The timeout of the wait that ends a turn of the driver which has ``work`` to do
        first, and something else due in 30 s."""
        self.driver._turn = lambda: 30.0  # type: ignore[method-assign]
        self.driver._has_work = lambda: True  # type: ignore[method-assign]
        self.driver._post(work)
        self.assertTrue(self.driver._step())
        (timeout,) = self.selector.timeouts
        return timeout

    def test_a_turn_handed_work_unwoken_does_not_wait(self) -> None:
        self.assertEqual(self.turn_with(lambda: self.driver._post(lambda: None)), 0.0)
        self.assertEqual(self.wake.sent, 0)

    def test_a_turn_handed_nothing_waits_for_what_is_due(self) -> None:
        self.assertEqual(self.turn_with(lambda: None), 30.0)


class MulticastTest(HTTP2TestCase):
    """One message to many tokens, as firebase-admin's send_each_for_multicast."""

    def test_each_token_gets_the_message_and_its_own_pair(self) -> None:
        self.server.by_token["t1"] = [fcm_error(404, "UNREGISTERED")]
        client = self.h2_client()
        message = {"notification": {"title": "Sale"}}
        pairs = list(client.push_multicast(message, (t for t in ["t0", "t1", "t2", 7])))
        self.assertEqual([token for token, _ in pairs], ["t0", "t1", "t2", 7])
        self.assertIsInstance(pairs[0][1], andpush.Response)
        self.assertIsInstance(pairs[1][1], andpush.UnregisteredError)
        self.assertIsInstance(pairs[3][1], TypeError)  # not a token: not sent
        self.assertEqual(sent_counts(self.server), {"t0": 1, "t1": 1, "t2": 1})
        sends = [r.json["message"] for r in self.server.requests if r.path.endswith(":send")]
        self.assertTrue(all(m["notification"] == {"title": "Sale"} for m in sends))
        self.assertEqual(message, {"notification": {"title": "Sale"}})  # left as it was

    def test_each_body_is_the_message_encoded_with_its_token(self) -> None:
        # The message is encoded once and each token placed into the bytes: a push to a
        # token carries what push() of the message with that token would, on both APIs,
        # even when a value of the message is the stand-in for the token.
        message = {"data": {"k": andpush._TOKEN_SLOT, "n": "\u00e9"},
                   "notification": {"title": '"quoted" \\ ' + andpush._TOKEN_SLOT}}
        tokens = ["t0", 'odd"token\\\u00e9\n', "back\\slash", "\x1f", "\x00", "\x7f", "\t",
                  "\u2028\U0001f600", andpush._TOKEN_SLOT]
        context = client_context()  # no connection is made: this spares the system's CAs
        for client in (andpush.new(access_token="t", project_id="p", ssl_context=context),
                       andpush.new(SERVER_KEY, ssl_context=context)):
            api = client._requests.api
            with self.subTest(api=api.name):
                each = andpush._Multicast(api, message, lambda *made: made)
                for token in tokens:
                    alone = api.prepare(dict(message, **{api.target: token}), False)
                    self.assertEqual(each.exchange(token), alone)
            client.close()

    def test_a_bad_message_is_each_tokens_error_as_push_would_give(self) -> None:
        client = self.h2_client()
        pairs = list(client.push_multicast({"data": {"k": 1}}, ["a", "b"]))  # type: ignore[dict-item]
        self.assertEqual([token for token, _ in pairs], ["a", "b"])
        for _, outcome in pairs:
            self.assertIsInstance(outcome, TypeError)
            self.assertRegex(str(outcome), r"data\['k'\] must be a str")
        self.assertEqual(self.server.processed, 0)

    def test_a_message_with_a_target_or_one_token_is_refused_before_any_io(self) -> None:
        client = self.h2_client()
        for message, tokens, error, pattern in [
            ({"token": "x"}, ["a"], ValueError, "leave 'token' out"),
            ({"topic": "news", "condition": "c"}, ["a"], ValueError, "'condition' and 'topic'"),
            ({"data": {}}, "abc", TypeError, "not one str"),
            ([], ["a"], TypeError, "message must be a dict"),
        ]:
            with self.subTest(message=message), self.assertRaisesRegex(error, pattern):
                client.push_multicast(message, tokens)  # type: ignore[arg-type]
        self.assertEqual(self.server.processed, 0)


class HTTP2Test(HTTP2TestCase):
    def test_push_many_multiplexes_streams_over_one_connection(self) -> None:
        outcomes = self.push_many(200, concurrency=50)
        self.assert_all_sent_once(outcomes, 200)
        self.assertEqual(outcomes[7].json()["name"], "projects/%s/messages/0:%d" % (
            TEST_PROJECT, int(outcomes[7].json()["name"].rsplit(":", 1)[1])))
        self.assertEqual(self.server.protocols, ["h2"])
        self.assertGreater(self.server.max_open_streams_seen, 1)
        self.assertEqual(self.server.settings_received[0][1], 0)  # HEADER_TABLE_SIZE 0
        self.assertEqual(self.server.requests[0].version, "HTTP/2")

    def test_push_works_over_http2_one_stream_at_a_time(self) -> None:
        client = self.h2_client()
        for _ in range(3):
            self.assertEqual(client.push(V1_MESSAGE).json()["name"].split("/")[1], TEST_PROJECT)
        self.assertEqual(self.server.connections, 1)

    def test_http2_false_keeps_to_http11(self) -> None:
        self.server.close()
        self.server = FakeFCM2(alpn=("h2", "http/1.1")).start()
        self.addCleanup(self.server.close)
        self.server.valid_tokens.add(H2_TOKEN)
        self.assertEqual(len(self.push_many(10, http2=False)), 10)
        self.assertNotIn("h2", self.server.protocols)
        self.assertEqual({r.version for r in self.server.requests}, {"HTTP/1.1"})

    def test_refused_streams_are_sent_again(self) -> None:
        self.server.inject(REFUSE_STREAM, REFUSE_STREAM, REFUSE_STREAM)
        self.assert_all_sent_once(self.push_many(30), 30)
        self.assertGreaterEqual(self.server.streams_refused, 3)

    def test_a_server_that_refuses_everything_gets_backoff_not_a_flood(self) -> None:
        self.server.inject(*[REFUSE_STREAM] * 50)
        outcomes = self.push_many(1, max_retries=1, backoff_factor=0.001)
        self.assertIsInstance(outcomes[0], andpush.NetworkError)
        self.assertFalse(outcomes[0].may_have_been_delivered)
        # The first send, the refusals sent again at once, then one retry after a backoff.
        self.assertEqual(self.server.streams_refused, 1 + andpush._RESENDS + 1)
        self.assertEqual(self.server.processed, 0)

    def test_goaway_mid_batch_moves_the_rest_to_a_new_connection(self) -> None:
        self.server.goaway_after = 7
        self.server.reply_delay = 0.01
        self.assert_all_sent_once(self.push_many(60, concurrency=20), 60)
        self.assertGreaterEqual(self.server.goaways_sent, 2)
        self.assertGreaterEqual(self.server.connections, 3)

    def test_goaway_with_streams_in_flight_finishes_them(self) -> None:
        self.server.reply_delay = 0.02
        self.server.by_token["t5"] = [GOAWAY_AFTER_READ]
        self.assert_all_sent_once(self.push_many(40, concurrency=20), 40)

    def test_a_stream_reset_after_the_server_read_it_is_maybe_delivered(self) -> None:
        self.server.by_token["t3"] = [RESET_STREAM_AFTER_READ]
        outcomes = self.push_many(10, max_retries=3)
        self.assertIsInstance(outcomes[3], andpush.NetworkError)
        self.assertTrue(outcomes[3].may_have_been_delivered)
        self.assertEqual(sent_counts(self.server)["t3"], 1)
        self.assertEqual(sum(isinstance(o, andpush.Response) for o in outcomes), 9)

    def test_more_concurrency_than_streams_opens_more_connections(self) -> None:
        self.server.close()
        self.server = FakeFCM2(max_concurrent_streams=5).start()
        self.addCleanup(self.server.close)
        self.server.valid_tokens.add(H2_TOKEN)
        self.server.reply_delay = 0.05
        self.assert_all_sent_once(self.push_many(40, concurrency=20), 40)
        self.assertGreaterEqual(self.server.connections, 4)
        self.assertLessEqual(self.server.max_open_streams_seen, 5)

    def test_a_server_that_uses_its_dynamic_table_still_decodes(self) -> None:
        self.server.use_dynamic_table = True
        outcomes = self.push_many(30)
        self.assert_all_sent_once(outcomes, 30)
        self.assertEqual(outcomes[-1].headers["x-fake"].isdigit(), True)

    def test_continuation_frames(self) -> None:
        self.server.continuation = True
        self.assert_all_sent_once(self.push_many(10), 10)

    def test_frames_split_across_tls_records(self) -> None:
        self.server.split_tls_records = True
        self.assert_all_sent_once(self.push_many(10), 10)

    def test_a_stalled_window_holds_the_data_until_the_server_opens_it(self) -> None:
        self.server.stall_window = True
        self.server.release_window_once(lambda: self.server.stalled_streams > 0)
        self.assert_all_sent_once(self.push_many(10), 10)
        self.assertEqual(self.server.flow_control_violations, 0)
        self.assertGreater(self.server.stalled_streams, 0)

    def test_a_stalled_connection_window_holds_the_data_until_the_server_opens_it(
            self) -> None:
        self.server.stall_window = True
        self.server.stall_window_size = andpush._H2_DEFAULT_WINDOW  # only the connection's binds
        self.server.release_window_once(lambda: self.server.stalled_connections > 0)
        padding = "x" * 8000  # ten of these are more than the 65535-byte connection window
        client = self.h2_client()
        outcomes = outcomes_of(client.push_many(
            [{"token": "t%d" % i, "data": {"n": str(i)}, "notification": {"body": padding}}
             for i in range(10)]))
        self.assert_all_sent_once(outcomes, 10)
        self.assertEqual(self.server.flow_control_violations, 0)
        self.assertGreater(self.server.frames_received["DATA"], 10)  # some waited for window

    def test_every_stream_has_a_deadline(self) -> None:
        self.server.slow_seconds = 2.0
        self.server.by_token["t2"] = [SLOW]
        outcomes = self.push_many(6, timeout=(2.0, 0.05))  # the connect not within the 0.05
        self.assertIsInstance(outcomes[2], andpush.NetworkError)
        self.assertTrue(outcomes[2].may_have_been_delivered)
        self.assertEqual(sum(isinstance(o, andpush.Response) for o in outcomes), 5)

    def test_errors_and_retries_as_over_http11(self) -> None:
        self.server.by_token.update({
            "t1": [fcm_error(404, "UNREGISTERED")],
            "t2": [fcm_error(503, "UNAVAILABLE")],
        })
        outcomes = self.push_many(5, max_retries=2, backoff_factor=0.001)
        self.assertIsInstance(outcomes[1], andpush.UnregisteredError)
        self.assertIsInstance(outcomes[2], andpush.Response)
        self.assertEqual(sent_counts(self.server)["t2"], 2)
        self.assertIsInstance(outcomes[0], andpush.Response)

    def test_rate_limit_holds_over_http2(self) -> None:
        client = self.h2_client(rate_limit=200)
        policy = client._driver.policy
        reserve = unittest.mock.Mock(wraps=policy.start_at)
        policy.start_at = reserve  # type: ignore[method-assign]
        started = time.monotonic()
        outcomes: List[Any] = []
        sender = threading.Thread(target=lambda: outcomes.extend(outcomes_of(
            client.push_many([{"token": "t%d" % i} for i in range(11)]))), daemon=True)
        sender.start()
        sender.join(20)
        self.assertFalse(sender.is_alive(), "push_many under rate_limit never finished")
        self.assert_all_sent_once(outcomes, 11)
        # Eleven sends at 200 a second take 0.05 s at least, each waiting for its own slot once.
        self.assertGreaterEqual(time.monotonic() - started, 0.05)
        self.assertEqual(reserve.call_count, 11)

    def test_bad_messages_are_outcomes_not_sends(self) -> None:
        client = self.h2_client()
        messages = [{"token": "a"}, {"token": "b", "data": {"n": 1}}]
        outcomes = outcomes_of(client.push_many(messages), messages)
        self.assertIsInstance(outcomes[0], andpush.Response)
        self.assertIsInstance(outcomes[1], TypeError)

    def test_http2_inside_a_connect_tunnel(self) -> None:
        with ConnectProxy() as proxy:
            outcomes = self.push_many(20, proxy="http://127.0.0.1:%d" % proxy.port)
        self.assert_all_sent_once(outcomes, 20)
        self.assertEqual(self.server.protocols, ["h2"])
        self.assertEqual(len(proxy.targets), 1)

    def test_closing_the_iterator_stops_the_sender(self) -> None:
        self.server.reply_delay = 0.01
        messages = CountingMessages(5000)
        client = self.h2_client()
        outcomes = client.push_many(messages, concurrency=10)
        first = next(outcomes)
        rest = outcomes.close()  # type: ignore[attr-defined]
        self.assertTrue(settles(client))
        pairs = [first, *rest]
        self.assertEqual([m["token"] for m, _ in pairs], ["t%d" % i for i in range(len(pairs))])
        sent = [m for m, o in pairs if isinstance(o, andpush.Response)]
        self.assertEqual(self.server.processed, len(sent))  # those in flight at the close
        self.assertTrue(all(isinstance(o, andpush.NetworkError) and not o.may_have_been_delivered
                            for _, o in pairs[len(sent):]))  # the read-ahead: not sent
        self.assertLessEqual(messages.taken, 1 + 10 * andpush._WINDOW_PER_WORKER)



class PushManyHTTP2Test(PushManySpec, V1TestCase):
    server_class = FakeFCM2
    NOT_READ = REFUSE_STREAM

    # Pairing is the batch's, whatever the protocol: HTTP/2, the faster, checks it at scale.
    def test_a_generator_of_tokens_pairs_each_outcome_with_its_own_token(self) -> None:
        tokens = ["t%d" % i for i in range(300)]  # six times the 50 in flight at once
        unregistered = set(tokens[::20])  # 5%
        for token in unregistered:
            self.server.by_token[token] = [fcm_error(404, "UNREGISTERED")]
        messages = ({"token": token} for token in tokens)  # one pass, as over a cursor
        deleted = [message["token"]
                   for message, outcome in self.fixed_token_client().push_many(messages)
                   if isinstance(outcome, andpush.UnregisteredError)]
        self.assertEqual(deleted, [token for token in tokens if token in unregistered])


class H2HeaderEncoderTest(unittest.TestCase):
    """The fake's own HPACK, decoded by andpush's decoder: what the tests rely on."""

    FIELDS = [(b":status", b"200"), (b"content-type", b"application/json"),
              (b"x-fake", b"1")]

    def decoded(self, block: bytes, decoder: _HPACKDecoder) -> List[Tuple[bytes, bytes]]:
        return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in decoder.decode(block)]

    def test_literals_without_indexing_leave_no_table(self) -> None:
        encoder, decoder = _H2HeaderEncoder(dynamic=False), _HPACKDecoder(0)
        for _ in range(2):
            self.assertEqual(self.decoded(encoder.encode(self.FIELDS), decoder), self.FIELDS)
        self.assertEqual(decoder.entries, [])

    def test_the_dynamic_table_is_announced_filled_and_reused(self) -> None:
        encoder, decoder = _H2HeaderEncoder(dynamic=True), _HPACKDecoder(_H2_TABLE_SIZE)
        first = encoder.encode(self.FIELDS)
        self.assertTrue(first.startswith(bytes.fromhex("203fe11f")))  # sizes 0, then 4096
        self.assertEqual(self.decoded(first, decoder), self.FIELDS)
        second = encoder.encode(self.FIELDS)
        self.assertEqual(second, bytes((0x80 | 64, 0x80 | 63, 0x80 | 62)))  # all indexed
        self.assertEqual(self.decoded(second, decoder), self.FIELDS)

    def test_old_entries_are_evicted_in_step_with_the_decoder(self) -> None:
        encoder, decoder = _H2HeaderEncoder(dynamic=True), _HPACKDecoder(_H2_TABLE_SIZE)
        for number in range(200):
            fields = [(b"x-fake", b"%d" % number), (b"x-fake", b"%d" % (number // 2))]
            self.assertEqual(self.decoded(encoder.encode(fields), decoder), fields)
        self.assertLessEqual(encoder.size, _H2_TABLE_SIZE)
        self.assertEqual(decoder.size, encoder.size)


#: Seconds a client call against a misbehaving server may take before the test fails.
_H2_DEADLINE = 3.0
#: Seconds a call with a timeout may take beyond it before the test fails.
_H2_TIMEOUT_SLACK = 0.3


class HTTP2MisbehaviourTest(HTTP2TestCase):
    """What the HTTP/2 engine must survive, each case bounded: a hang fails, quickly."""

    def bounded(self, call: Callable[[], Any], deadline: float = _H2_DEADLINE) -> Any:
        """call() in a daemon thread; the test fails if it takes longer than deadline."""
        result: List[Any] = []

        def run() -> None:
            try:
                result.append(call())
            except BaseException as error:  # noqa: BLE001 (handed to the test below)
                result.append(error)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(deadline)
        self.assertFalse(worker.is_alive(), "the client was still busy after %s s" % deadline)
        return result[0]

    def push_many(self, count: int, concurrency: int = 20, **options: Any) -> List[Any]:
        """push_many of count messages t0, t1, ...; bounded by the timeout option if given."""
        client = self.h2_client(**options)
        messages = [{"token": "t%d" % i} for i in range(count)]
        deadline = options.get("timeout", _H2_DEADLINE - _H2_TIMEOUT_SLACK) + _H2_TIMEOUT_SLACK
        outcomes = self.bounded(
            lambda: outcomes_of(client.push_many(messages, concurrency=concurrency), messages),
            deadline)
        if isinstance(outcomes, BaseException):
            raise outcomes
        self.assertEqual(len(outcomes), count)
        return outcomes  # type: ignore[no-any-return]

    def assert_outcomes_truthful(self, outcomes: List[Any]) -> None:
        """Nothing processed twice; a Response was processed; "not delivered" was not."""
        counts = sent_counts(self.server)
        for i, outcome in enumerate(outcomes):
            with self.subTest(i=i, outcome=outcome):
                self.assertLessEqual(counts["t%d" % i], 1)
                if isinstance(outcome, andpush.Response):
                    self.assertEqual(counts["t%d" % i], 1)
                else:
                    self.assertIsInstance(outcome, andpush.NetworkError)
                    if not outcome.may_have_been_delivered:
                        self.assertEqual(counts["t%d" % i], 0)

    def test_after_the_shutdown_notice_no_new_stream_opens_on_that_connection(self) -> None:
        self.server.reply_delay = 0.005
        self.server.by_token["t5"] = [SHUTDOWN_NOTICE_AFTER_READ]
        outcomes = self.push_many(80, concurrency=10)
        self.assert_outcomes_truthful(outcomes)
        self.assertEqual(self.server.streams_after_goaway, 0)

    def test_push_on_a_reused_connection_dropped_after_the_read_is_not_sent_again(
            self) -> None:
        client = self.h2_client(max_retries=3, backoff_factor=0.001)
        client.push({"token": "warm-up"})
        self.server.by_token[TOKEN] = [DROP_CONNECTION_AFTER_READ]
        outcome = self.bounded(lambda: client.push(V1_MESSAGE))
        self.assertIsInstance(outcome, andpush.NetworkError)
        self.assertTrue(outcome.may_have_been_delivered)
        self.assertEqual(tokens_sent(self.server).count(TOKEN), 1)

    def test_an_idle_connection_closed_by_the_server_is_replaced_without_a_failed_send(
            self) -> None:
        self.server.idle_timeout = 0.02
        client = self.h2_client()
        client.push({"token": "first"})
        # The GOAWAY and the close are sent.
        self.assertTrue(wait_until(lambda: self.server.open_connections == 0, _H2_DEADLINE))
        self.assertEqual(self.server.goaways_sent, 1)
        self.assertIsInstance(self.bounded(lambda: client.push({"token": "second"})),
                              andpush.Response)
        self.assertEqual(tokens_sent(self.server), ["first", "second"])
        self.assertEqual(self.server.connections, 2)

    def test_streams_flowing_never_trigger_too_many_pings(self) -> None:
        self.server.too_many_pings = 3
        self.server.reply_delay = 0.001
        self.assert_all_sent_once(self.push_many(200, concurrency=20), 200)
        self.assertEqual(self.server.goaways_sent, 0)

    def test_the_client_acknowledges_the_servers_pings(self) -> None:
        self.server.ping_before_answers = True
        self.server.reply_delay = 0.01
        self.assert_all_sent_once(self.push_many(20), 20)
        deadline = time.monotonic() + _H2_DEADLINE
        while self.server.pings_acked < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.server.pings_acked, 20)

    def test_a_hundred_threads_pushing_at_once_share_a_couple_of_connections(self) -> None:
        client = self.h2_client()
        self.server.reply_delay = 0.01
        outcomes: List[Any] = []

        def push(i: int) -> None:
            outcomes.append(client.push({"token": "t%d" % i}))

        def push_all() -> None:
            threads = [threading.Thread(target=push, args=(i,), daemon=True) for i in range(100)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        self.bounded(push_all)
        self.assertEqual(len(outcomes), 100)
        self.assert_all_sent_once(outcomes, 100)
        self.assertLessEqual(self.server.connections, 2)

    def test_each_frame_in_its_own_tls_record(self) -> None:
        self.server.record_per_frame = True
        self.assert_all_sent_once(self.push_many(20), 20)


class _RawH2Client:
    """A bare HTTP/2 client for checking FakeFCM2 itself: frames in, frames out, no policy."""

    def __init__(self, server: FakeFCM2, settings: Optional[Dict[int, int]] = None) -> None:
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=_H2_DEADLINE)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK stall
        self.sock = h2_client_context().wrap_socket(raw, server_hostname="127.0.0.1")
        self.inbuf = b""
        self.sock.sendall(H2_CLIENT_PREFACE + h2_settings(*(settings or {}).items()))
        self.decoder = _HPACKDecoder(_H2_TABLE_SIZE)

    def close(self) -> None:
        self.sock.close()

    def send(self, kind: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        self.sock.sendall(h2_frame(kind, flags, stream_id, payload))

    def request(self, stream_id: int, end_stream: bool = True) -> None:
        """HEADERS of a v1 send, with no body (the fake answers it 400: that is enough)."""
        block = _hpack_encode([(":method", "POST"), (":scheme", "https"), (":path", "/x"),
                               (":authority", "127.0.0.1")])
        flags = H2_END_HEADERS | (H2_END_STREAM if end_stream else 0)
        self.send(H2_HEADERS, flags, stream_id, block)

    def frame(self) -> Optional[Tuple[int, int, int, bytes]]:
        """The next frame (kind, flags, stream id, payload), or None at the end."""
        while len(self.inbuf) < 9 or len(self.inbuf) < 9 + int.from_bytes(self.inbuf[:3], "big"):
            data = self.sock.recv(65536)
            if not data:
                return None
            self.inbuf += data
        length = int.from_bytes(self.inbuf[:3], "big")
        kind, flags = self.inbuf[3], self.inbuf[4]
        stream_id = int.from_bytes(self.inbuf[5:9], "big")
        payload, self.inbuf = self.inbuf[9:9 + length], self.inbuf[9 + length:]
        return kind, flags, stream_id, payload

    def until(self, kind: int) -> Tuple[int, int, int, bytes]:
        """Frames up to the next one of kind; SETTINGS on the way are acknowledged, the
        kinds of the others passed over are in self.passed."""
        self.passed: List[int] = []
        while True:
            frame = self.frame()
            if frame is None:
                raise AssertionError("the connection ended before a %s" % _H2_FRAME_NAMES[kind])
            if frame[0] == H2_SETTINGS and not frame[1] & H2_ACK:
                self.send(H2_SETTINGS, H2_ACK, 0)
            if frame[0] == kind:
                return frame
            self.passed.append(frame[0])


class FakeFCM2Test(unittest.TestCase):
    """FakeFCM2's faults as a bare client sees them: the ones andpush must never trigger."""

    def setUp(self) -> None:
        self.server = FakeFCM2(max_concurrent_streams=2).start()
        self.addCleanup(self.server.close)
        self.addCleanup(lambda: self.assertEqual(self.server.errors, []))

    def client(self, settings: Optional[Dict[int, int]] = None) -> _RawH2Client:
        client = _RawH2Client(self.server, settings)
        self.addCleanup(client.close)
        client.until(H2_SETTINGS)  # the server's, acknowledged
        client.until(H2_SETTINGS)  # its ACK of ours: the limits bind from now on
        return client

    def test_one_stream_too_many_kills_the_connection(self) -> None:
        client = self.client()
        for stream_id in (1, 3, 5):
            client.request(stream_id, end_stream=False)
        payload = client.until(H2_GOAWAY)[3]
        self.assertEqual(int.from_bytes(payload[:4], "big"), 3)  # last stream id
        self.assertEqual(int.from_bytes(payload[4:8], "big"), H2_PROTOCOL_ERROR)
        while client.frame() is not None:
            pass  # then the connection ends
        self.assertEqual(self.server.processed, 0)

    def test_three_pings_with_no_request_between_get_goaway_too_many_pings(self) -> None:
        self.server.too_many_pings = 3
        client = self.client()
        for number in range(3):
            client.send(H2_PING, 0, 0, b"%8d" % number)
            client.until(H2_PING)
        payload = client.until(H2_GOAWAY)[3]
        self.assertEqual(int.from_bytes(payload[4:8], "big"), H2_ENHANCE_YOUR_CALM)
        self.assertEqual(payload[8:], b"too_many_pings")

    def test_answers_never_exceed_the_clients_stream_window(self) -> None:
        self.server.inject(Reply(200, body=b"x" * 100))
        client = self.client({H2_INITIAL_WINDOW_SIZE: 10})
        client.request(1)
        self.assertEqual(len(client.until(H2_DATA)[3]), 10)
        client.send(H2_PING, 0, 0, b"12345678")
        client.until(H2_PING)
        self.assertNotIn(H2_DATA, client.passed)  # nothing more came meanwhile
        client.send(H2_WINDOW_UPDATE, 0, 1, (90).to_bytes(4, "big"))
        kind, flags, _, payload = client.until(H2_DATA)
        self.assertEqual((len(payload), flags & H2_END_STREAM), (90, H2_END_STREAM))

    def test_the_shutdown_notice_comes_before_the_real_goaway(self) -> None:
        self.server.shutdown_grace = 0.02
        self.server.inject(SHUTDOWN_NOTICE_AFTER_READ)
        client = self.client()
        client.request(1)
        notice = client.until(H2_GOAWAY)[3]
        self.assertEqual(int.from_bytes(notice[:4], "big"), andpush._H2_LAST_STREAM)
        client.request(3)  # still taken: it is below the notice's last stream id
        last = client.until(H2_GOAWAY)[3]
        self.assertEqual(int.from_bytes(last[:4], "big"), 3)
        self.assertEqual(self.server.processed, 2)


# The asyncio client ##########################################################################
# AsyncClient against the same fake servers: first the specifications written for Client,
# through an adapter that drives an AsyncClient on an event loop of its own; then what only
# asyncio has (cancellation, event loops, tasks), natively.

_ADAPTER_WAIT = 10.0  # seconds one adapted call may take before the test fails instead


class AsyncClientInThread:
    """An AsyncClient behind the threaded Client's signatures, for the tests written for
    Client: an event loop runs on a thread of its own, and each call runs the AsyncClient's
    own coroutine (or method) there while the test's thread waits for it.

    ``_driver`` is the AsyncClient's engine, so that FakeClock.install works on it too."""

    def __init__(self, client: andpush.AsyncClient) -> None:
        self.client = client
        self._driver = client._driver
        self.event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.event_loop.run_forever,
                                        name="andpush-test-event-loop", daemon=True)
        self._thread.start()
        self._closed = False

    def run(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the event loop; its result, or its exception raised here."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.event_loop)
        return future.result(_ADAPTER_WAIT)

    def call(self, function: Callable[[], Any]) -> Any:
        """Run a plain function on the event loop's thread: the AsyncClient's methods that
        are not coroutines belong to its loop as well."""
        async def called() -> Any:
            return function()
        return self.run(called())

    def push(self, message: Any, **options: Any) -> andpush.Response:
        return self.run(self.client.push(message, **options))  # type: ignore[no-any-return]

    def push_many(self, messages: Any, **options: Any) -> "AsyncOutcomesInThread":
        return AsyncOutcomesInThread(self, self.call(
            lambda: self.client.push_many(messages, **options)))

    def push_multicast(self, message: Any, tokens: Any,
                       **options: Any) -> "AsyncOutcomesInThread":
        return AsyncOutcomesInThread(self, self.call(
            lambda: self.client.push_multicast(message, tokens, **options)))

    def subscribe(self, tokens: Any, topic: str) -> List[Any]:
        return self.run(self.client.subscribe(tokens, topic))  # type: ignore[no-any-return]

    def unsubscribe(self, tokens: Any, topic: str) -> List[Any]:
        return self.run(self.client.unsubscribe(tokens, topic))  # type: ignore[no-any-return]

    def close(self) -> None:
        """aclose() the client, let the tasks it ended finish, then end the event loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self._aclose_and_settle())
        finally:
            self.event_loop.call_soon_threadsafe(self.event_loop.stop)
            self._thread.join(_ADAPTER_WAIT)
            self.event_loop.close()

    async def _aclose_and_settle(self) -> None:
        await self.client.aclose()
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=_ADAPTER_WAIT)

    def __enter__(self) -> "AsyncClientInThread":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncOutcomesInThread(Iterator[Tuple[Any, Any]]):
    """AsyncClient.push_many's async iterator behind the threaded iterator's interface:
    next() awaits __anext__, close() awaits aclose(), stop() and taken as they are, and
    dropping it drops the async iterator on its event loop."""

    def __init__(self, adapter: AsyncClientInThread, outcomes: Any) -> None:
        self._adapter = adapter
        self._outcomes = outcomes

    def __next__(self) -> Tuple[Any, Any]:
        ended, pair = self._adapter.run(self._next_or_end())
        if ended:
            raise StopIteration
        return pair  # type: ignore[no-any-return]

    async def _next_or_end(self) -> Tuple[bool, Any]:
        try:
            return False, await self._outcomes.__anext__()
        except StopAsyncIteration:
            return True, None

    @property
    def taken(self) -> int:
        return self._adapter.call(lambda: self._outcomes.taken)  # type: ignore[no-any-return]

    def stop(self) -> None:
        self._adapter.call(self._outcomes.stop)

    def close(self) -> List[Tuple[Any, Any]]:
        return self._adapter.run(self._outcomes.aclose())  # type: ignore[no-any-return]

    def __del__(self) -> None:
        held = [self._outcomes]  # the last reference, let go of on the event loop's thread
        del self._outcomes
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs anyway
            self._adapter.event_loop.call_soon_threadsafe(held.clear)


class AsyncClients:
    """Mixed in before a TestCase written for Client (ServerTestCase, V1TestCase or
    HTTP2TestCase), it makes that TestCase's clients AsyncClients (AsyncClientInThread),
    so its tests run unchanged against the asyncio client."""

    def adapted(self: Any, client: andpush.AsyncClient) -> AsyncClientInThread:
        adapter = AsyncClientInThread(client)
        self.addCleanup(adapter.close)
        return adapter

    def client(self: Any, key: str = SERVER_KEY, **options: Any) -> AsyncClientInThread:
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        return self.adapted(andpush.new_async(key, **options))  # type: ignore[no-any-return]

    def v1_client(self: Any, **options: Any) -> AsyncClientInThread:
        options.setdefault("credentials", service_account_info(self.server))
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        return self.adapted(andpush.new_async(**options))  # type: ignore[no-any-return]

    def h2_client(self: Any, **options: Any) -> AsyncClientInThread:
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        return self.adapted(andpush.new_async(  # type: ignore[no-any-return]
            access_token=H2_TOKEN, project_id=TEST_PROJECT, **options))


class AsyncPushManyHTTP11Test(AsyncClients, PushManyHTTP11Test):
    """push_many's specification, unchanged, against AsyncClient over HTTP/1.1."""


class AsyncPushManyHTTP2Test(AsyncClients, PushManyHTTP2Test):
    """push_many's specification, unchanged, against AsyncClient over HTTP/2."""


class AsyncErrorAnswerTest(AsyncClients, ErrorAnswerTest):
    """The legacy API's error answers, unchanged, against AsyncClient."""


class AsyncMalformedAnswerTest(AsyncClients, MalformedAnswerTest):
    """What a broken HTTP/1.1 answer becomes, unchanged, against AsyncClient."""


class AsyncV1ErrorTest(AsyncClients, V1ErrorTest):
    """The v1 error table and the rejected-token refresh, unchanged, against AsyncClient."""



_EVENTUALLY = 3.0  # seconds a native asyncio test waits for what the server will see
_POLL = 0.002  # seconds between two looks


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Wait, without blocking the event loop, until ``condition()`` holds."""
    deadline = time.monotonic() + _EVENTUALLY
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("not within %.3g s: %s" % (_EVENTUALLY, what))
        await asyncio.sleep(_POLL)


class HeldClock(FakeClock):
    """A FakeClock whose waits do not pass by themselves: a timer the client sets stays
    pending until the test moves ``time`` on (and wakes the engine)."""

    def delay(self, seconds: float) -> float:
        self.sleeps.append(seconds)
        return seconds


class AsyncTestCase(unittest.IsolatedAsyncioTestCase):
    """A native asyncio test with its own FakeFCM2 (HTTP/2, or HTTP/1.1 when the client
    offers no h2), and AsyncClients closed at the end, before the server."""

    server_class: Any = FakeFCM2

    def setUp(self) -> None:
        self.server = self.server_class().start()
        self.addCleanup(self.server.close)
        self.addCleanup(lambda: self.assertEqual(self.server.errors, []))
        self.server.valid_tokens.add(H2_TOKEN)

    def h2_client(self, **options: Any) -> andpush.AsyncClient:
        """An AsyncClient with a fixed access token (no token request)."""
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        client = andpush.new_async(access_token=H2_TOKEN, project_id=TEST_PROJECT, **options)
        self.addAsyncCleanup(client.aclose)
        return client

    def v1_client(self, **options: Any) -> andpush.AsyncClient:
        """An AsyncClient with service account credentials (tokens from the server)."""
        options.setdefault("credentials", service_account_info(self.server))
        options.setdefault("endpoint", self.server.endpoint)
        options.setdefault("ssl_context", client_context())
        options.setdefault("max_retries", 0)
        client = andpush.new_async(**options)
        self.addAsyncCleanup(client.aclose)
        return client

    def sends(self) -> int:
        return len(tokens_sent(self.server))

    def hold_sends_to(self, token: str) -> threading.Event:
        """Have the server read each send to ``token`` and answer it only once the returned
        event is set (at the end of the test at the latest)."""
        released = self.server.hold(lambda request: request.path.endswith(":send") and
                                    request.json["message"]["token"] == token)
        self.addCleanup(released.set)
        return released

    async def asyncSetUp(self) -> None:
        # asyncio's debug mode, on in these tests, would log 1,000 coroutines started in one
        # callback as slow.
        asyncio.get_running_loop().slow_callback_duration = _EVENTUALLY


def engine_route(client: andpush.AsyncClient) -> Any:
    """The route to FCM of an AsyncClient's engine."""
    return client._requests.route


class AsyncCancellationTest(AsyncTestCase):
    """A cancelled push: unsent, nothing goes out; sent, its stream or connection ends."""

    async def test_cancelled_while_connecting_nothing_is_sent(self) -> None:
        client = self.h2_client()
        task = asyncio.ensure_future(client.push(V1_MESSAGE))
        for _ in range(2):
            await asyncio.sleep(0)  # the push's step, then the engine's turn that begins it
        self.assertEqual(engine_route(client).connecting, 1)  # the TLS handshake under way
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(list(engine_route(client).waiting), [])
        # The next push goes over the connection that came up: the cancelled one before it
        # would have been seen first.
        await client.push({"token": "after"})
        self.assertEqual(tokens_sent(self.server), ["after"])
        self.assertEqual(self.server.handshakes, 1)

    async def test_a_push_cancelled_before_the_engine_began_it_is_dropped(self) -> None:
        # A push begins at the engine's next turn, which asyncio runs before any later
        # cancellation; were it cancelled first, however, it would still not be sent.
        client = self.h2_client()
        await client.push({"token": "before"})
        exchange = client._requests.push({"token": "cancelled"}, False, None)
        client._driver._arrive(exchange)
        client._driver._cancel(exchange)
        await client.push({"token": "after"})
        self.assertEqual(tokens_sent(self.server), ["before", "after"])

    async def test_cancelled_while_waiting_for_a_token_nothing_is_sent(self) -> None:
        released = self.server.hold(lambda request: request.path == "/token")
        self.addCleanup(released.set)
        client = self.v1_client()
        task = asyncio.ensure_future(client.push({"token": "cancelled"}))
        await eventually(lambda: self.server.processed == 1, "the token request read")
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(client._driver._needs_token, [])
        released.set()
        await client.push({"token": "after"})
        self.assertEqual(tokens_sent(self.server), ["after"])
        self.assertEqual(len(self.server.issued), 1)

    async def test_cancelled_in_a_retrys_backoff_it_is_not_sent_again(self) -> None:
        client = self.h2_client(max_retries=1)
        clock = HeldClock.install(client)
        self.server.inject(fcm_error(503, "UNAVAILABLE"))
        task = asyncio.ensure_future(client.push({"token": "cancelled"}))
        await eventually(lambda: bool(clock.sleeps), "the retry's backoff begun")
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(client._driver._timers, [])
        clock.time += clock.sleeps[0] + 1  # the backoff is over
        client._driver.wake()
        await client.push({"token": "after"})
        self.assertEqual(tokens_sent(self.server), ["cancelled", "after"])

    async def test_cancelled_after_sending_over_http2_its_stream_is_reset(self) -> None:
        self.server.by_token["slow"] = [SLOW]
        client = self.h2_client()
        task = asyncio.ensure_future(client.push({"token": "slow"}))
        await eventually(lambda: self.server.processed == 1, "the request read")
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        await eventually(lambda: self.server.streams_reset_by_client == 1, "RST_STREAM")
        self.assertEqual((await client.push({"token": "after"})).status_code, 200)
        self.assertEqual((self.server.handshakes, self.server.processed), (1, 2))

    async def test_cancelled_after_sending_over_http11_its_connection_is_closed(self) -> None:
        answer = self.hold_sends_to("slow")
        client = self.h2_client(http2=False)
        task = asyncio.ensure_future(client.push({"token": "slow"}))
        await eventually(lambda: self.server.processed == 1, "the request read")
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(engine_route(client).links(), [])
        answer.set()  # into a closed connection
        await eventually(lambda: self.server.open_connections == 0, "the connection closed")
        self.assertEqual((await client.push({"token": "after"})).status_code, 200)
        self.assertEqual((self.server.handshakes, self.server.processed), (2, 2))

    async def test_cancelling_the_consumer_of_push_many_stops_new_sends(self) -> None:
        self.server.reply_delay = 0.002
        client = self.h2_client()
        messages = CountingMessages(1000)
        seen: List[Tuple[Any, Any]] = []
        ten = asyncio.Event()

        async def consume() -> None:
            async for pair in client.push_many(messages, concurrency=4):
                seen.append(pair)
                if len(seen) == 10:
                    ten.set()

        consumer = asyncio.ensure_future(consume())
        await ten.wait()
        consumer.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await consumer
        self.assertLessEqual(messages.taken, len(seen) + 4 * andpush._WINDOW_PER_WORKER)
        # Sent by now: those seen, those answered while the consumer had yet to take them (a
        # busy machine may let the sends run ahead of it, the window allows that), and at
        # most the four in flight; from now on, nothing more.
        sent = self.sends()
        await eventually(lambda: not client._driver._has_work(), "the client holds no request")
        self.assertLessEqual(self.sends(), sent + 4)  # what was in flight, no more


class AsyncClientLifeTest(AsyncTestCase):
    """A client belongs to one event loop, and closing it leaves nothing behind."""

    async def test_a_second_event_loop_gets_a_clear_runtime_error(self) -> None:
        client = self.h2_client()
        await client.push(V1_MESSAGE)
        caught: List[BaseException] = []

        def elsewhere() -> None:
            async def push() -> None:
                await client.push(V1_MESSAGE)
            try:
                asyncio.run(push())
            except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
                caught.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(_EVENTUALLY)
        self.assertEqual([type(e) for e in caught], [RuntimeError])
        self.assertIn("one client per event loop", str(caught[0]))
        self.assertEqual(self.server.processed, 1)
        self.assertEqual((await client.push(V1_MESSAGE)).status_code, 200)  # still its own

    async def test_a_closed_client_raises_value_error(self) -> None:
        client = self.h2_client()
        await client.aclose()
        with self.assertRaisesRegex(ValueError, "closed"):
            await client.push(V1_MESSAGE)
        with self.assertRaisesRegex(ValueError, "closed"):
            client.push_many([V1_MESSAGE])
        await client.aclose()  # again: nothing to do
        self.assertEqual(self.server.processed, 0)

    async def test_async_with_closes_the_client_and_its_connections(self) -> None:
        async with self.h2_client() as client:
            await client.push(V1_MESSAGE)
        await eventually(lambda: self.server.open_connections == 0, "the connection closed")
        self.assertEqual(self.server.goaways_received, 1)
        with self.assertRaises(ValueError):
            await client.push(V1_MESSAGE)

    async def test_after_aclose_no_task_is_left_and_the_server_sees_every_connection_closed(
            self) -> None:
        h2 = self.h2_client()
        h1 = self.h2_client(http2=False)
        self.server.by_token["slow"] = [SLOW]
        answer = self.hold_sends_to("held")
        await asyncio.gather(h2.push(V1_MESSAGE), h1.push(V1_MESSAGE))
        outcomes = h2.push_many(CountingMessages(1000), concurrency=2)
        await outcomes.__anext__()
        slow = [asyncio.ensure_future(h1.push({"token": "held"})),
                asyncio.ensure_future(h2.push({"token": "slow"}))]

        def read(token: str) -> bool:
            return any(b'"token":"%s"' % token.encode() in r.body for r in self.server.requests)
        await eventually(lambda: read("held") and read("slow"), "the slow requests read")
        closing = asyncio.gather(h1.aclose(), h2.aclose())
        await asyncio.sleep(0)  # each has ended its requests, and waits for its connections
        answer.set()  # into a closed connection, so the server reads on and sees it closed
        await closing
        for push in slow:
            with self.assertRaises(andpush.NetworkError) as caught:
                await push
            self.assertTrue(caught.exception.may_have_been_delivered)
        self.assertEqual(asyncio.all_tasks() - {asyncio.current_task()}, set())
        await eventually(lambda: self.server.open_connections == 0, "every connection closed")


class AsyncRunTest(unittest.TestCase):
    """A client used as asyncio.run's examples do: made, used and closed in one run."""

    def test_async_with_inside_asyncio_run_leaves_no_socket_open(self) -> None:
        async def main(server: FakeFCM, http2: bool) -> None:
            async with andpush.new_async(SERVER_KEY, endpoint=server.endpoint, http2=http2,
                                         ssl_context=client_context()) as client:
                await asyncio.gather(*[client.push(LEGACY_MESSAGE) for _ in range(5)])

        for http2 in (True, False):
            with self.subTest(http2=http2), FakeFCM2() as server, \
                    warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ResourceWarning)
                asyncio.run(main(server, http2))
                gc.collect()
                self.assertEqual([str(w.message) for w in caught
                                  if w.category is ResourceWarning], [])
                self.assertEqual(server.processed, 5)

    def test_a_push_many_dropped_after_its_event_loop_closed_is_dropped_quietly(self) -> None:
        kept: List[Any] = []

        async def main(server: FakeFCM) -> None:
            client = andpush.new_async(SERVER_KEY, endpoint=server.endpoint,
                                       ssl_context=client_context())
            kept.append(client.push_many({"to": "t%d" % i} for i in range(100)))
            await asyncio.sleep(0)  # and the client is never closed: the script forgot

        unraisable: List[Any] = []
        with FakeFCM2() as server, warnings.catch_warnings(), \
                unittest.mock.patch.object(sys, "unraisablehook", unraisable.append):
            warnings.simplefilter("ignore", ResourceWarning)  # the unclosed client's, rightly
            asyncio.run(main(server))
            kept.clear()
            gc.collect()
        self.assertEqual(unraisable, [])


class AsyncTimeoutErrorTest(AsyncTestCase):
    async def test_the_asyncio_client_says_the_same(self) -> None:
        self.server.reply_delay = 0.3
        client = self.h2_client(timeout=(1.0, 0.01))
        with self.assertRaisesRegex(andpush.NetworkError, "no answer from %s/v1/projects/.*"
                                    "read timeout of 0.01 s" % re.escape(self.server.endpoint)):
            await client.push(V1_MESSAGE)

    async def test_and_of_the_connect_timeout(self) -> None:
        with mute_server() as endpoint:
            client = andpush.new_async(SERVER_KEY, endpoint=endpoint, timeout=(0.01, 1.0),
                                       max_retries=0, ssl_context=client_context())
            self.addAsyncCleanup(client.aclose)
            with self.assertRaisesRegex(andpush.NetworkError, "could not connect to %s within "
                                        "the connect timeout of 0.01 s" % re.escape(endpoint)):
                await client.push(LEGACY_MESSAGE)


class AsyncBulkCountsTest(AsyncTestCase):
    async def test_the_async_outcomes_count_too(self) -> None:
        self.server.by_token["t1"] = [fcm_error(404, "UNREGISTERED")]
        outcomes = self.h2_client().push_many({"token": "t%d" % i, "data": {"k": "v"}}
                                              for i in range(4))
        first = await outcomes.__anext__()
        self.assertEqual(first[0]["token"], "t0")
        await outcomes.aclose()
        self.assertEqual((outcomes.success_count, outcomes.failure_count), (3, 1))
        multicast = self.h2_client().push_multicast({"data": {"k": "v"}}, ["a", ""])
        self.assertEqual([token async for token, _ in multicast], ["a", ""])
        self.assertEqual((multicast.success_count, multicast.failure_count), (1, 1))


class AsyncConcurrencyTest(AsyncTestCase):
    async def test_a_thousand_concurrent_pushes_over_http2_share_few_connections(self) -> None:
        asyncio.get_running_loop().set_debug(False)  # its bookkeeping would triple the time
        client = self.h2_client()
        answers = await asyncio.gather(*[client.push({"token": "t%d" % i})
                                         for i in range(1000)])
        self.assertEqual({a.status_code for a in answers}, {200})
        streams = self.server.max_concurrent_streams
        self.assertLessEqual(self.server.handshakes, math.ceil(1000 / streams) + 1)
        self.assertEqual(sent_counts(self.server), {"t%d" % i: 1 for i in range(1000)})

    async def test_pushes_arriving_together_begin_in_runs_before_the_turn(self) -> None:
        client = self.h2_client()
        await client.push(V1_MESSAGE)  # a connection up
        engine = client._driver
        waiting_at_turns: List[int] = []
        turn = engine._turn

        def counting_turn() -> Optional[float]:
            waiting_at_turns.append(len(engine._arrived))
            return turn()
        engine._turn = counting_turn  # type: ignore[method-assign]
        answers = await asyncio.gather(*[client.push(V1_MESSAGE)
                                         for _ in range(andpush._RUN + 1)])
        self.assertEqual({a.status_code for a in answers}, {200})
        # The first run began as its last push arrived; the one after it, at the turn.
        self.assertEqual(max(waiting_at_turns), 1)

    async def test_one_stream_a_connection_opens_the_connections_needed_at_once(
            self) -> None:
        self.server.max_concurrent_streams = 1  # read as each connection starts
        self.server.reply_delay = 0.05
        client = self.h2_client()
        await client.push(V1_MESSAGE)  # the route's connections allow one stream each
        openings: List[int] = []
        opened = client._driver._open
        client._driver._open = lambda route, count: (  # type: ignore[method-assign]
            openings.append(count), opened(route, count))
        outcomes = [o async for _, o in client.push_many([V1_MESSAGE] * 8, concurrency=4)]
        self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes))
        self.assertEqual(openings, [3])  # not one at a time, a round trip each


class AsyncTokenTest(AsyncTestCase):
    """Tokens and project ids are asked once, however many coroutines need them."""

    async def test_sixteen_coroutines_cause_one_token_request(self) -> None:
        client = self.v1_client()
        await asyncio.gather(*[client.push(V1_MESSAGE) for _ in range(16)])
        self.assertEqual(len(self.server.issued), 1)
        self.assertEqual(self.server.processed, 17)

    async def test_a_rejected_token_is_refreshed_once_for_every_push_it_failed(self) -> None:
        client = self.v1_client()
        await client.push(V1_MESSAGE)
        self.server.revoke_tokens()
        answers = await asyncio.gather(*[client.push({"token": "t%d" % i}) for i in range(8)])
        self.assertEqual({a.status_code for a in answers}, {200})
        self.assertEqual(len(self.server.issued), 2)
        self.assertEqual(sent_counts(self.server),
                         dict({"t%d" % i: 2 for i in range(8)}, **{TOKEN: 1}))


class AsyncMetadataServerTest(AsyncTestCase):
    server_class = FakeFCM

    def setUp(self) -> None:
        super().setUp()
        self.metadata = FakeFCM(tls=False).start()
        self.addCleanup(self.metadata.close)
        self.server.valid_tokens = self.metadata.valid_tokens  # the same Google behind both
        home = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, home)
        keys = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GOOGLE_CLOUD_PROJECT",
                "GCLOUD_PROJECT", "APPDATA")
        context = environment(HOME=home, GCE_METADATA_HOST="127.0.0.1:%d" % self.metadata.port,
                              **{key: "" for key in keys})
        context.__enter__()
        self.addCleanup(context.__exit__, None, None, None)

    async def test_the_project_id_and_the_token_are_asked_once_for_many_coroutines(
            self) -> None:
        client = andpush.new_async(endpoint=self.server.endpoint, ssl_context=client_context(),
                                   max_retries=0)
        self.addAsyncCleanup(client.aclose)
        await asyncio.gather(*[client.push(V1_MESSAGE) for _ in range(8)])
        paths = [r.path for r in self.metadata.requests]
        self.assertEqual(sorted(paths), sorted([
            "/computeMetadata/v1/project/project-id",
            "/computeMetadata/v1/instance/service-accounts/default/token"]))
        self.assertEqual({r.path for r in self.server.requests},
                         {"/v1/projects/metadata-project/messages:send"})
        self.assertEqual(self.server.processed, 8)


class AsyncPushManyInputTest(AsyncTestCase):
    """push_many over an async iterable: read lazily, and its failure handed over."""

    async def test_an_async_iterable_is_read_lazily_within_the_window(self) -> None:
        taken = []

        async def messages() -> Any:
            for i in range(200):
                taken.append(i)
                yield {"token": "t%d" % i}

        outcomes = self.h2_client().push_many(messages(), concurrency=2)
        self.assertIsInstance((await outcomes.__anext__())[1], andpush.Response)
        await asyncio.sleep(0.05)  # a slow consumer: the reading must stop a window ahead
        self.assertLessEqual(len(taken), 1 + 2 * andpush._WINDOW_PER_WORKER)
        rest = [pair async for pair in outcomes]
        self.assertEqual([m["token"] for m, _ in rest], ["t%d" % i for i in range(1, 200)])
        self.assertEqual(len(taken), 200)

    async def test_an_async_iterable_that_fails_ends_the_iteration_after_its_pairs(
            self) -> None:
        async def messages() -> Any:
            yield {"token": "a"}
            await asyncio.sleep(0)
            yield {"token": "b"}
            raise RuntimeError("the database went away")

        pairs = []
        with self.assertRaisesRegex(RuntimeError, "database"):
            async for pair in self.h2_client().push_many(messages(), concurrency=2):
                pairs.append(pair)
        self.assertEqual([m["token"] for m, _ in pairs], ["a", "b"])
        self.assertTrue(all(isinstance(o, andpush.Response) for _, o in pairs))


class AsyncProxyTest(AsyncTestCase):
    """CONNECT proxies carry both protocols; a refused tunnel leaves nothing behind."""

    async def test_a_connect_proxy_carries_http2_and_http11(self) -> None:
        with ConnectProxy() as proxy:
            for http2 in (True, False):
                async with self.h2_client(proxy="http://127.0.0.1:%d" % proxy.port,
                                          http2=http2) as client:
                    await client.push(V1_MESSAGE)
                    await client.push(V1_MESSAGE)
            await eventually(lambda: self.server.open_connections == 0, "the tunnels closed")
        self.assertEqual(self.server.protocols, ["h2", None])
        self.assertEqual(proxy.targets, ["127.0.0.1:%d" % self.server.port] * 2)
        self.assertEqual(self.server.processed, 4)

    async def test_a_refused_connect_is_a_network_error_and_leaves_no_socket(self) -> None:
        with ConnectProxy(status=407) as proxy:
            client = self.h2_client(proxy="http://127.0.0.1:%d" % proxy.port)
            with warnings.catch_warnings(record=True) as caught_warnings:
                warnings.simplefilter("always", ResourceWarning)
                try:  # not assertRaises: see the threaded client's test
                    await client.push(V1_MESSAGE)
                except andpush.NetworkError as error:
                    delivered, text = error.may_have_been_delivered, str(error)
                else:
                    self.fail("a push through a proxy that refused the tunnel succeeded")
                await client.aclose()
                gc.collect()
        self.assertFalse(delivered)
        self.assertIn("the proxy 127.0.0.1:%d" % proxy.port, text)
        self.assertEqual([str(w.message) for w in caught_warnings
                          if w.category is ResourceWarning], [])
        self.assertEqual(engine_route(client).connections(), 0)
        self.assertEqual(self.server.connections, 0)


class AsyncEngineFailureTest(AsyncClients, HTTP2TestCase):
    """EngineTest's failure inside the engine, against the asyncio client."""

    test_a_failure_inside_the_io_loop_ends_each_held_message_and_the_client_recovers = (
        EngineTest.test_a_failure_inside_the_io_loop_ends_each_held_message_and_the_client_recovers)


class AsyncFakeClockTest(AsyncTestCase):
    """The FakeClock drives the asyncio client's waits: none is really slept."""

    async def test_backoff_waits_on_the_clock_only(self) -> None:
        client = self.h2_client(max_retries=2, backoff_factor=10.0)
        clock = FakeClock.install(client)
        self.server.inject(fcm_error(503, "UNAVAILABLE"), fcm_error(500, "INTERNAL"))
        started = time.monotonic()
        self.assertEqual((await client.push(V1_MESSAGE)).status_code, 200)
        self.assertLess(time.monotonic() - started, 1.0)
        self.assertEqual(len(clock.sleeps), 2)
        self.assertGreaterEqual(sum(clock.sleeps), 5.0 + 10.0)
        self.assertEqual(self.server.processed, 3)

    async def test_the_429_pause_holds_every_send_until_the_clock_passes_it(self) -> None:
        client = self.h2_client()
        clock = FakeClock.install(client)
        self.server.inject(fcm_error(429, "QUOTA_EXCEEDED", Retry_After="30"))
        with self.assertRaises(andpush.QuotaExceededError):
            await client.push(V1_MESSAGE)
        with self.assertRaisesRegex(andpush.QuotaExceededError, "not sent"):
            await client.push(V1_MESSAGE)
        self.assertEqual(self.server.processed, 1)
        clock.time += 30
        self.assertEqual((await client.push(V1_MESSAGE)).status_code, 200)
        self.assertEqual(self.server.processed, 2)

    async def test_connects_failing_beside_a_working_one_hold_off_longer_each_round(
            self) -> None:
        client = self.h2_client(keep_alive_timeout=3600)  # idle the whole fake time
        await client.push(V1_MESSAGE)  # one connection up
        clock = FakeClock.install(client)
        engine, route = client._driver, engine_route(client)
        error = andpush.NetworkError("turned away", may_have_been_delivered=False)

        def fail_round(count: int) -> None:
            """``count`` connects fail, as the driver reports them; then a turn, in which
            the hold-off they started has passed (on the fake clock, at once)."""
            route.connecting += count
            for _ in range(count):
                engine._connect_failed(route, error, route.generation)
            engine._turn()

        for count in (1, 3, 1, 1, 1, 1, 1, 1):  # a round of three is one step
            fail_round(count)
        self.assertEqual(clock.sleeps, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0])
        self.assertEqual(len(route.h2), 1)  # it carried on meanwhile
        engine._drop(route.h2[0])
        await client.push(V1_MESSAGE)  # a connection that comes up starts afresh
        fail_round(1)
        self.assertEqual(clock.sleeps[-1], 0.5)


# Deterministic simulation ####################################################################
# The real engine, policy and protocol code, under each real driver (the thread driver with
# its sockets and selector simulated and its threads gone; the asyncio driver on an event
# loop whose clock and connections are simulated), against simulated servers and a network
# that misbehave as a seeded schedule says. One seed decides everything in a run, so a
# failure replays exactly:
#
#     python test_andpush.py --simulate 100000                 every driver, both protocols
#     python test_andpush.py --simulate 1 --seed 1234 --driver async --trace   one run, again
#
# The server keeps a ledger of what it processed; every run is checked for the invariants
# of SimRun._check (one outcome per message, in order; nothing processed twice; outcomes
# truthful about delivery; every call within the liveness bound; no storm, no busy loop, no
# stream over the server's limit; nothing left after the client closed).

SIM_START = 1_000_000.0      # the simulated clock at the start of a run
SIM_HORIZON = 5_000.0        # simulated seconds after which a run counts as hung
SIM_TURNS_AT_ONCE = 500      # engine turns at one simulated instant that count as a busy loop
SIM_TURNS_PER_SECOND = 100   # engine turns a run may take a simulated second, and 100 more
SIM_TURNS_PER_EVENT = 2      # ... and for each event of its network and callers
SIM_FCM = "fcm.sim"
SIM_OAUTH = "oauth.sim"
SIM_PROJECT = "sim-project"
SIM_DRIVERS = ("thread", "async")


class SimAbort(BaseException):
    """A run cannot go on: it hangs (nothing will happen and the engine waits for ever), or
    it busy-loops. A BaseException, so that no engine's ``except Exception`` contains it."""


class SimWorld:
    """One run's clock, events and randomness, all from its seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = SIM_START
        self._events: List[Tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.problems: List[str] = []
        self._instant = SIM_START
        self._turns_now = 0
        self.turns = 0  # engine turns in all
        self.events = 0  # events run in all
        self.aborted = False  # after a SimAbort: the event loop only winds down
        self.trace: Optional[List[str]] = None

    def after(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + max(0.0, delay), self._seq, action))
        self._seq += 1

    def next_event(self) -> float:
        return self._events[0][0] if self._events else math.inf

    def step(self) -> None:
        """Run the next event, moving the clock to it."""
        self.events += 1
        when, _, action = heapq.heappop(self._events)
        self.move_to(when)
        action()

    def wait(self, timeout: Optional[float], ready: Callable[[], bool]) -> None:
        """Run the events until ``ready()`` or ``timeout`` seconds passed (a driver's wait);
        SimAbort if it would wait for ever."""
        deadline = self.now + timeout if timeout is not None else math.inf
        while not ready():
            when = self.next_event()
            if when == math.inf == deadline:
                raise SimAbort("hang: the engine waits with no deadline, and nothing will "
                               "ever happen")
            if when > deadline:
                self.move_to(deadline)
                return
            self.step()

    def move_to(self, when: float) -> None:
        if when > self.now:
            self.now = when
            if when - SIM_START > SIM_HORIZON and not self.aborted:
                raise SimAbort("the run did not end within %d simulated seconds" % SIM_HORIZON)

    def turn(self) -> None:
        """The engine took a turn: too many at one instant is a busy loop."""
        self.turns += 1
        if self.now != self._instant:
            self._instant, self._turns_now = self.now, 0
        self._turns_now += 1
        if self._turns_now > SIM_TURNS_AT_ONCE and not self.aborted:
            raise SimAbort("busy loop: %d engine turns at one simulated instant" % self._turns_now)

    def note(self, text: str) -> None:
        if self.trace is not None:
            self.trace.append("t=%.4f %s" % (self.now - SIM_START, text))

    def problem(self, text: str) -> None:
        self.problems.append("t=%.3f: %s" % (self.now - SIM_START, text))


class SimClock(andpush._Clock):
    """The engine's clock is the world's."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world

    def now(self) -> float:
        return self.world.now


# The network ------------------------------------------------------------------------------

class SimPipe:
    """One TCP connection: bytes in order each way after a latency, the server's in pieces of
    any size; FIN or RST from either side. ``written`` keeps what the client wrote."""

    def __init__(self, world: SimWorld, latency: float, number: int) -> None:
        self.world = world
        self.latency = latency
        self.number = number               # its server's count of connections, from 1
        self.client: Any = None            # the client's end: a SimSocket or a SimTransport
        self.server: Any = None            # the server's end: a SimH1Conn or a SimH2Conn
        self.written: List[bytes] = []
        self.client_closed = False
        self.server_closed = False
        self.answered = False              # any answer reached the client's end
        self._to_client = 0.0              # when the last piece sent to the client arrives
        self._to_server = 0.0

    def _when(self, last: float) -> float:
        """When what is sent now arrives: after the latency (now and then up to twice it),
        and not before what was sent before it."""
        when = self.world.now + self.latency
        if self.world.rng.random() < 0.1:
            when += self.world.rng.random() * self.latency
        return max(when, last)

    def client_write(self, data: bytes) -> None:
        if self.client_closed or not data:
            return
        data = bytes(data)
        self.written.append(data)
        self._to_server = when = self._when(self._to_server)
        self.world.after(when - self.world.now, lambda: self._server_gets(data))

    def _server_gets(self, data: bytes) -> None:
        if not self.server_closed:
            self.server.received(data)

    def client_close(self) -> None:
        if not self.client_closed:
            self.client_closed = True
            self._to_server = when = self._when(self._to_server)
            self.world.after(when - self.world.now, self._server_eof)

    def _server_eof(self) -> None:
        if not self.server_closed:
            self.server.client_closed()

    def server_write(self, data: bytes) -> None:
        if self.server_closed or not data:
            return
        rng = self.world.rng
        pieces = [data]
        if len(data) > 1 and rng.random() < 0.3:  # frames split anywhere
            cut = rng.randrange(1, len(data))
            pieces = [data[:cut], data[cut:]]
        for piece in pieces:
            self._to_client = when = self._when(self._to_client)
            self.world.after(when - self.world.now, lambda p=piece: self._client_gets(p))

    def _client_gets(self, data: bytes) -> None:
        if not self.client_closed:
            self.client.deliver(data)

    def server_close(self, reset: bool = False) -> None:
        """FIN (after what was sent) or RST."""
        if self.server_closed:
            return
        self.server_closed = True
        self._to_client = when = self._when(self._to_client)
        self.world.after(when - self.world.now, lambda: self._client_ends(reset))

    def _client_ends(self, reset: bool) -> None:
        if not self.client_closed:
            self.client.deliver_end(reset)


class SimNetwork:
    """The hosts of a run, and the connections made to them."""

    def __init__(self, world: SimWorld, servers: Dict[str, "SimServer"]) -> None:
        self.world = world
        self.servers = servers
        self.pipes: List[SimPipe] = []

    def connect(self, host: str, on_up: Callable[[SimPipe, bool], None],
                on_fail: Callable[[Exception], None]) -> None:
        """Start a connect: ``on_up(pipe, h2)`` when it is up, ``on_fail(error)`` if it
        fails; a stalled one does neither (the driver's connect timeout ends it)."""
        server = self.servers[host]
        fate = server.connect_fate()
        latency = server.latency()
        if fate == "refused":
            self.world.after(latency * 2, lambda: on_fail(ConnectionRefusedError(
                "connection refused")))
        elif fate == "reset":
            self.world.after(latency * 3, lambda: on_fail(ConnectionResetError(
                "the server reset the connection during the TLS handshake")))
        elif fate == "ok":
            def up() -> None:
                pipe = SimPipe(self.world, latency, server.connections + 1)
                self.pipes.append(pipe)
                server.accept(pipe)
                on_up(pipe, server.h2)
            self.world.after(latency * 3, up)  # TCP, then TLS 1.3


# The servers ------------------------------------------------------------------------------

class SimRequest:
    __slots__ = ("method", "path", "headers", "body", "stream_id", "first")

    def __init__(self, method: str, path: str, headers: Dict[str, str], body: bytes,
                 stream_id: int = 0, first: bool = False) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.stream_id = stream_id
        self.first = first      # the first request of its HTTP/1.1 connection


def sim_request_key(request: SimRequest) -> Optional[str]:
    """The message a request carries (its device token), or None for a token request."""
    if request.path.endswith(":send"):
        try:
            return str(json.loads(request.body)["message"]["token"])
        except (ValueError, KeyError, TypeError):
            return "?"
    if "/registrations/" in request.path:
        return request.path.split("/registrations/")[1].split("/")[0]
    return None


class SimServerConnection:
    """What the server's side of a connection does at its end, on either protocol."""

    pipe: SimPipe
    closed: bool

    def drop(self, reset: bool) -> None:
        self.close(reset)

    def close(self, reset: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.pipe.server_close(reset)

    def client_closed(self) -> None:
        self.closed = True
        self.pipe.server_closed = True


class SimH1Conn(SimServerConnection):
    """The server's side of one HTTP/1.1 connection: one request at a time."""

    def __init__(self, server: "SimServer", pipe: SimPipe) -> None:
        self.server = server
        self.pipe = pipe
        self.buffer = bytearray()
        self.busy = False
        self.count = 0
        self.closed = False
        self.reading = True   # False once it decided to close: it takes no more requests
        self.close_every = 0  # close after every N answers (0: never)

    def received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buffer += data
        self._parse()

    def _parse(self) -> None:
        while not self.busy and not self.closed and self.reading:
            request = sim_parse_h1(self.buffer)
            if request is None:
                return
            request.first = self.count == 0
            self.count += 1
            self.busy = True
            self.server.handle(self, request)

    def answer(self, request: SimRequest, status: int, body: bytes,
               headers: Dict[str, str], close: bool = False, partial: bool = False) -> None:
        if self.closed:
            return
        lines = ["HTTP/1.1 %d X" % status, "Content-Length: %d" % len(body)]
        lines += ["%s: %s" % item for item in headers.items()]
        if close:
            lines.append("Connection: close")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        if partial:
            data = data[:self.server.world.rng.randrange(1, len(data))]
        self.pipe.server_write(data)
        self.busy = False
        if close or partial:
            self.close()
            return
        self.server.answered_on(self)
        self._parse()

    def reset(self, request: SimRequest, code: int) -> None:
        self.close(reset=True)



def sim_parse_h1(buffer: bytearray) -> Optional[SimRequest]:
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if len(buffer) < end + 4 + length:
        return None
    body = bytes(buffer[end + 4:end + 4 + length])
    del buffer[:end + 4 + length]
    return SimRequest(method, path, headers, body)


class SimH2Conn(SimServerConnection):
    """The server's side of one HTTP/2 connection, honest about what it processed: it
    processes a stream when the stream's request is whole, and never one above a GOAWAY's
    last stream id. It checks the client opens no stream over its limit."""

    def __init__(self, server: "SimServer", pipe: SimPipe) -> None:
        self.server = server
        self.pipe = pipe
        self.world = server.world
        self.buffer = bytearray()
        self.preface = False
        self.decoder = _HPACKDecoder(4096)
        self.bodies: Dict[int, bytearray] = {}
        self.heads: Dict[int, Dict[str, str]] = {}
        self.open: Set[int] = set()          # streams the client opened, not yet ended
        self.limits: List[int] = []          # each SETTINGS' MAX_CONCURRENT_STREAMS, sent
        self.acked = 0                       # of those, how many the client acknowledged
        self.goaway: Optional[int] = None    # the last stream id of our GOAWAY
        self.highest = 0                     # the highest stream id processed
        self.closed = False
        self.streams_seen = 0
        self.replenish = True                # WINDOW_UPDATE for the DATA received
        self.goaway_every = 0                # GOAWAY after every N streams (0: never)

    # Sending -----------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if not self.closed:
            self.pipe.server_write(data)

    def settings(self, limit: Optional[int]) -> None:
        payload = b"" if limit is None else (3).to_bytes(2, "big") + limit.to_bytes(4, "big")
        self.limits.append(andpush._H2_LAST_STREAM if limit is None else limit)
        self.send(h2_frame(H2_SETTINGS, 0, 0, payload))

    def send_goaway(self, last: int, code: int = 0) -> None:
        if self.closed:
            return
        self.goaway = last if self.goaway is None else min(self.goaway, last)
        self.server.goaways += 1
        self.send(h2_frame(H2_GOAWAY, 0, 0, last.to_bytes(4, "big") + code.to_bytes(4, "big")))
        self._close_when_done()

    def _close_when_done(self) -> None:
        if self.goaway is not None and not any(s <= self.goaway for s in self.open):
            self.world.after(self.world.rng.random() * 0.01, self.close)

    def answer(self, request: SimRequest, status: int, body: bytes,
               headers: Dict[str, str], close: bool = False, partial: bool = False) -> None:
        stream_id = request.stream_id
        if self.closed or stream_id not in self.open:
            return
        fields = [(":status", str(status))] + [(k.lower(), v) for k, v in headers.items()]
        block = andpush._hpack_encode(fields)
        data = (h2_frame(H2_HEADERS, H2_END_HEADERS, stream_id, block)
                + h2_frame(H2_DATA, H2_END_STREAM, stream_id, body))
        if partial:
            self.send(data[:self.world.rng.randrange(1, len(data))])
            self.close(reset=self.world.rng.random() < 0.5)
            return
        self.send(data)
        self.open.discard(stream_id)
        self.server.answered_on(self)
        self._close_when_done()

    def reset(self, request: SimRequest, code: int) -> None:
        if not self.closed and request.stream_id in self.open:
            self.open.discard(request.stream_id)
            self.send(h2_frame(H2_RST_STREAM, 0, request.stream_id, code.to_bytes(4, "big")))
            self._close_when_done()


    # Receiving -------------------------------------------------------------------------

    def received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buffer += data
        if not self.preface:
            if len(self.buffer) < len(H2_CLIENT_PREFACE):
                return
            if self.buffer[:len(H2_CLIENT_PREFACE)] != H2_CLIENT_PREFACE:
                self.world.problem("the client's HTTP/2 preface was wrong")
                self.close()
                return
            del self.buffer[:len(H2_CLIENT_PREFACE)]
            self.preface = True
        while len(self.buffer) >= 9 and not self.closed:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                return
            kind, flags = self.buffer[3], self.buffer[4]
            stream_id = int.from_bytes(self.buffer[5:9], "big") & andpush._H2_LAST_STREAM
            payload = bytes(self.buffer[9:9 + length])
            del self.buffer[:9 + length]
            self._on_frame(kind, flags, stream_id, payload)

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == H2_HEADERS:
            if not flags & 0x4:
                self.world.problem("a request header block in pieces (not expected)")
            fields = dict(self.decoder.decode(payload))
            self._opened(stream_id)
            self.heads[stream_id] = fields
            self.bodies[stream_id] = bytearray()
            if flags & 0x1:
                self._whole(stream_id)
        elif kind == H2_DATA:
            if self.replenish and payload:
                increment = len(payload).to_bytes(4, "big")
                self.send(h2_frame(H2_WINDOW_UPDATE, 0, 0, increment)
                          + h2_frame(H2_WINDOW_UPDATE, 0, stream_id, increment))
            if stream_id in self.bodies:
                self.bodies[stream_id] += payload
                if flags & 0x1:
                    self._whole(stream_id)
        elif kind == H2_SETTINGS:
            if flags & 0x1:
                self.acked += 1
            else:
                self.send(h2_frame(H2_SETTINGS, 0x1, 0))
        elif kind == H2_PING and not flags & 0x1:
            self.send(h2_frame(H2_PING, 0x1, 0, payload))
        elif kind == H2_RST_STREAM:
            self.open.discard(stream_id)
            self.bodies.pop(stream_id, None)
            self._close_when_done()

    def _opened(self, stream_id: int) -> None:
        self.open.add(stream_id)
        self.streams_seen += 1
        shrink = self.server.shrink
        if shrink is not None and self.streams_seen == shrink[0]:
            self.settings(shrink[1])
        allowed = max(self.limits[max(0, self.acked - 1):] or [0])
        if not self.limits:
            self.world.problem("a stream opened before the server's SETTINGS")
        elif len(self.open) > allowed:
            self.world.problem("%d streams open on a connection whose limit is %d"
                               % (len(self.open), allowed))

    def _whole(self, stream_id: int) -> None:
        fields = self.heads.pop(stream_id)
        body = bytes(self.bodies.pop(stream_id))
        if self.goaway is not None and stream_id > self.goaway:
            self.open.discard(stream_id)
            return  # above our GOAWAY: not processed
        headers = {k: v for k, v in fields.items() if not k.startswith(":")}
        request = SimRequest(fields.get(":method", ""), fields.get(":path", ""), headers, body,
                             stream_id)
        self.highest = max(self.highest, stream_id)
        self.server.handle(self, request)


def sim_requests_written(pipe: SimPipe) -> List[SimRequest]:
    """Every request whose first bytes the client wrote on ``pipe`` (parsed afresh)."""
    data = bytearray(b"".join(pipe.written))
    found: List[SimRequest] = []
    if data.startswith(H2_CLIENT_PREFACE):
        del data[:len(H2_CLIENT_PREFACE)]
        decoder = _HPACKDecoder(4096)
        heads: Dict[int, Dict[str, str]] = {}
        while len(data) >= 9:
            length = int.from_bytes(data[:3], "big")
            kind, stream_id = data[3], int.from_bytes(data[5:9], "big")
            payload = bytes(data[9:9 + length])
            del data[:9 + length]
            if kind == H2_HEADERS:
                heads[stream_id] = dict(decoder.decode(payload))
                found.append(SimRequest(heads[stream_id].get(":method", ""),
                                        heads[stream_id].get(":path", ""), {}, b"", stream_id))
            elif kind == H2_DATA and stream_id in heads:
                for request in found:
                    if request.stream_id == stream_id:
                        request.body += payload
        return found
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return found
        request = sim_parse_h1(data)
        if request is None:  # the body in part: enough to know the message
            lines = bytes(data[:end]).decode("latin-1").split("\r\n")
            found.append(SimRequest("POST", lines[0].split(" ")[1], {},
                                    bytes(data[end + 4:])))
            return found
        found.append(request)


#: Behaviours of the server for one request, with what each means for the message.
SIM_ANSWERS = ("ok", "late", "never", "error", "refuse", "reset_after", "drop_after",
               "drop_before", "partial")


class SimServer:
    """A simulated FCM (or OAuth2 token endpoint) whose behaviour is drawn from the run's
    randomness, per connection and per request, with a ledger of what it processed."""

    def __init__(self, world: SimWorld, kind: str, h2: bool, faults: float,
                 tokens: Dict[str, float], read_timeout: float) -> None:
        self.world = world
        self.kind = kind                      # "fcm" or "oauth"
        self.h2 = h2
        self.faults = faults                  # how often a connection or request misbehaves
        self.tokens = tokens                  # access tokens issued, and when each expires
        self.read_timeout = read_timeout
        self.delivered: Dict[str, int] = {}   # times each message was processed for delivery
        self.connections = 0
        self.answered_connections: Set[int] = set()
        self._base_latency = world.rng.choice((0.001, 0.01, 0.05))
        rng = world.rng
        # What it does for the whole run (a scripted run sets these): its HTTP/2 streams
        # limit (None: none said); what its connections send instead of SETTINGS, now and
        # then ("none", "garbage", "late"); what becomes of every connect ("" when drawn
        # for each); and the one way it is stuck, if it is.
        self.limit = rng.choice((None, 100, 100, 5, 2, 1, 0)) if h2 else None
        self.settings = rng.choice(("none", "garbage", "late")) if self.bad(0.3) else ""
        self.settings_share = 0.7         # of the connections that do it
        self.connect = ""
        self.stuck = rng.choice(("refuse_streams", "goaway_at_once", "max_connections",
                                 "no_answers", "drop_requests")) if self.bad(0.2) else ""
        self.close_every = 0              # HTTP/1.1: close after every N answers
        self.goaway_every = 0             # HTTP/2: GOAWAY after every N streams
        self.shrink: Optional[Tuple[int, int]] = None  # HTTP/2: after N streams, a new limit
        self.script: Dict[str, List[str]] = {}  # what it does for a message's tries, by key
        self.received: Dict[str, int] = {}  # requests it read of each message, by key
        self.goaways = 0                  # GOAWAYs sent
        self.open_connections: Set[Any] = set()
        self.issued = 0

    def latency(self) -> float:
        return self._base_latency * (0.5 + self.world.rng.random())

    def bad(self, scale: float = 1.0) -> bool:
        return self.world.rng.random() < self.faults * scale

    def connect_fate(self) -> str:
        """What becomes of a connect: "ok", "refused", "reset" or "stall"."""
        if self.connect:
            return self.connect
        if self.stuck == "max_connections" and any(not c.closed for c in self.open_connections):
            return "reset"  # a load balancer at its limit turns the others away
        if not self.bad(0.3):
            return "ok"
        return self.world.rng.choice(("refused", "reset", "stall"))

    def accept(self, pipe: SimPipe) -> None:
        self.connections += 1
        rng = self.world.rng
        if self.h2:
            conn: Any = SimH2Conn(self, pipe)
            pipe.server = conn
            if self.stuck == "goaway_at_once":
                conn.settings(self.limit)
                conn.send_goaway(0)
                return
            what = self.settings if rng.random() < self.settings_share else ""
            if what == "garbage":  # a proxy that took h2 by ALPN, and speaks HTTP/1.1
                conn.send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                self.world.after(0.001, conn.close)
            elif what == "late":
                self.world.after(rng.random() * 20, lambda: conn.settings(self.limit))
            elif what != "none":
                conn.settings(self.limit)
            conn.goaway_every = self.goaway_every
            if self.bad(0.2):
                conn.replenish = False
            if self.bad(0.3):
                self._schedule_connection_fault(conn)
        else:
            conn = SimH1Conn(self, pipe)
            pipe.server = conn
            conn.close_every = self.close_every
            if self.bad(0.3):
                self._schedule_connection_fault(conn)
        self._idle_close(conn, rng.choice((5.0, 30.0, 90.0, 1000.0)))
        self.open_connections = {c for c in self.open_connections if not c.closed}
        self.open_connections.add(conn)

    def _schedule_connection_fault(self, conn: Any) -> None:
        rng = self.world.rng
        when = rng.random() * rng.choice((0.1, 2.0, 30.0))
        what = rng.choice(("drop", "reset", "goaway", "notice", "limit", "goaway_each"))
        if isinstance(conn, SimH1Conn) and what not in ("drop", "reset"):
            what = "close_after"
        if what in ("drop", "reset"):
            self.world.after(when, lambda: self._drop_when_idle(conn, what == "reset"))
        elif what == "goaway":
            self.world.after(when, lambda: conn.send_goaway(conn.highest))
        elif what == "notice":
            def notice() -> None:
                conn.send_goaway(andpush._H2_LAST_STREAM)
                self.world.after(rng.random() * 2, lambda: conn.send_goaway(conn.highest))
            self.world.after(when, notice)
        elif what == "limit":
            self.world.after(when, lambda: conn.settings(rng.choice((0, 1, 3, 100))))
        elif what == "goaway_each":
            conn.goaway_every = rng.choice((1, 2, 10))
        elif what == "close_after":
            conn.close_every = rng.choice((1, 2, 3))

    def _drop_when_idle(self, conn: Any, reset: bool) -> None:
        """Drop the connection; an HTTP/1.1 one once the request it processes is answered:
        a server that closes a kept-alive connection without a byte of answer did not
        process the request on it (the premise on which every keep-alive client resends)."""
        if isinstance(conn, SimH1Conn) and conn.busy and not conn.closed:
            self.world.after(0.1, lambda: self._drop_when_idle(conn, reset))
        else:
            conn.drop(reset)

    def _idle_close(self, conn: Any, idle: float) -> None:
        """Close the connection once it sat idle ``idle`` seconds (HTTP/2: with a GOAWAY)."""
        def check(mark: int) -> None:
            if conn.closed:
                return
            busy = conn.open if isinstance(conn, SimH2Conn) else conn.busy
            if busy or self._activity(conn) != mark:
                self.world.after(idle, lambda: check(self._activity(conn)))
            elif isinstance(conn, SimH2Conn):
                conn.send_goaway(conn.highest)
            else:
                conn.close()
        self.world.after(idle, lambda: check(self._activity(conn)))

    @staticmethod
    def _activity(conn: Any) -> int:
        return conn.streams_seen if isinstance(conn, SimH2Conn) else conn.count

    def answered_on(self, conn: Any) -> None:
        self.answered_connections.add(id(conn))
        if isinstance(conn, SimH1Conn):
            if conn.close_every and conn.count % conn.close_every == 0:
                # without Connection: close, as some servers do: it reads no more, and its
                # FIN follows a little after
                conn.reading = False
                self.world.after(self.world.rng.random() * 0.002, conn.close)
        elif conn.goaway_every and conn.streams_seen % conn.goaway_every == 0:
            conn.send_goaway(conn.highest)

    # Requests --------------------------------------------------------------------------

    def handle(self, conn: Any, request: SimRequest) -> None:
        if self.kind == "oauth":
            self._token_request(conn, request)
            return
        key = sim_request_key(request) or "?"
        authorization = request.headers.get("authorization", "")
        token = authorization[7:] if authorization.startswith("Bearer ") else ""
        if self.tokens.get(token, 0.0) <= self.world.now:
            self._answer_later(conn, request, 401, _sim_error(401, "UNAUTHENTICATED"), {})
            return
        script = self.script.get(key)
        what = script.pop(0) if script else self._draw(conn, request)
        self.world.note("%s got %s on connection %d, stream %d: %s" % (
            self.kind, key, conn.pipe.number, request.stream_id, what))
        if what not in ("refuse", "drop_before", "above_goaway"):  # read
            self.received[key] = self.received.get(key, 0) + 1
            if not what.startswith("error"):  # processed, for delivery
                self.delivered[key] = self.delivered.get(key, 0) + 1
        self._act(conn, request, what, self._ok_body(key))

    def _draw(self, conn: Any, request: SimRequest) -> str:
        rng = self.world.rng
        if self.stuck == "refuse_streams":
            what = "refuse"
        elif self.stuck == "no_answers":
            what = "never"
        elif self.stuck == "drop_requests":
            what = "drop_before"
        elif not self.bad():
            return "ok"
        else:
            what = rng.choice(SIM_ANSWERS)
        if isinstance(conn, SimH1Conn):
            if what == "refuse":
                what = "error"
            elif what in ("reset_after", "drop_after", "partial") and not request.first:
                # A server that processed a request on a reused HTTP/1.1 connection answers
                # it: one that closes it without a byte of answer did not (the premise on
                # which every keep-alive client resends).
                what = "never" if rng.random() < 0.3 else "partial_sure"
        return what

    def _act(self, conn: Any, request: SimRequest, what: str, ok_body: bytes) -> None:
        rng = self.world.rng
        think = rng.random() * 0.02
        if what == "ok":
            self._answer_later(conn, request, 200, ok_body, {"content-type": "application/json"},
                               think)
        elif what == "late":
            self._answer_later(conn, request, 200, ok_body, {},
                               rng.random() * self.read_timeout * 2)
        elif what == "never":
            pass
        elif what.startswith("error"):  # "error", or "error:503" for that status
            status, headers = self._error() if what == "error" else (int(what[6:]), {})
            code = {400: "INVALID_ARGUMENT", 404: "UNREGISTERED", 429: "QUOTA_EXCEEDED",
                    500: "INTERNAL", 503: "UNAVAILABLE", 403: "SENDER_ID_MISMATCH"}[status]
            self._answer_later(conn, request, status, _sim_error(status, code), headers, think)
        elif what == "above_goaway":  # a GOAWAY whose last stream is below this one's
            conn.send_goaway(request.stream_id - 2)
        elif what == "refuse":
            self.world.after(think, lambda: conn.reset(request, 7))
        elif what == "reset_after":
            self.world.after(think, lambda: conn.reset(request, 2))
        elif what in ("drop_after", "drop_before"):
            self.world.after(think, lambda: conn.drop(rng.random() < 0.5))
        elif what in ("partial", "partial_sure"):
            self.world.after(think, lambda: conn.answer(request, 200, ok_body, {}, partial=True))
        elif what == "goaway_close":  # GOAWAY after this stream, and the connection closed
            conn.send_goaway(request.stream_id)
            conn.close()
        elif what == "go_down":  # processed; then every connection dropped, none taken
            self.connect = "refused"
            for other in list(self.open_connections):
                self._drop_when_idle(other, reset=False)

    def _error(self) -> Tuple[int, Dict[str, str]]:
        rng = self.world.rng
        status = rng.choice((400, 404, 403, 429, 429, 500, 503, 503))
        headers: Dict[str, str] = {}
        if status in (429, 503) and rng.random() < 0.7:
            headers["retry-after"] = rng.choice((
                "0", "1", "3", "30", "121", "86400", "abc", "\u00b2",
                "Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
                "Sun Nov  6 08:49:37 1994", "Fri, 01 Jan 2100 00:00:00 GMT"))
        return status, headers

    def _answer_later(self, conn: Any, request: SimRequest, status: int, body: bytes,
                      headers: Dict[str, str], delay: float = 0.0) -> None:
        self.world.after(delay, lambda: conn.answer(request, status, body, headers))

    def _ok_body(self, key: str) -> bytes:
        return b'{"name":"projects/%s/messages/%s"}' % (SIM_PROJECT.encode(), key.encode())

    def _token_request(self, conn: Any, request: SimRequest) -> None:
        rng = self.world.rng
        stuck = {"no_answers": "never", "drop_requests": "drop_before"}.get(self.stuck)
        what = stuck or "ok" if stuck or not self.bad() else rng.choice(
            ("late", "never", "error", "invalid_grant", "garbage", "drop_before", "partial",
             "refuse", "reset_after"))
        if isinstance(conn, SimH1Conn) and what in ("refuse", "reset_after"):
            what = "error"
        if what in ("ok", "late"):
            self.issued += 1
            token = "at-%d" % self.issued
            lifetime = rng.choice((3600, 3600, 310, 400))
            self.tokens[token] = self.world.now + lifetime
            body = json.dumps({"access_token": token, "expires_in": lifetime}).encode()
            delay = rng.random() * 0.02 if what == "ok" else rng.random() * self.read_timeout * 2
            self._answer_later(conn, request, 200, body, {}, delay)
        elif what == "invalid_grant":
            self._answer_later(conn, request, 400, b'{"error":"invalid_grant"}', {})
        elif what == "garbage":
            self._answer_later(conn, request, 200, b'{"token_type":"Bearer"}', {})
        else:
            self._act(conn, request, what, b"{}")


def _sim_error(status: int, code: str) -> bytes:
    return json.dumps({"error": {"code": status, "message": code, "status": code, "details": [
        {"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": code}]}}
    ).encode()


# The client's ends of a connection, for each driver ----------------------------------------

class SimSocket:
    """A connected non-blocking socket, as the thread driver sees one."""

    _numbers = iter(range(1000, 10 ** 9))

    def __init__(self, pipe: SimPipe) -> None:
        self.pipe = pipe
        pipe.client = self
        self.number = next(SimSocket._numbers)
        self.inbound = bytearray()
        self.ended = ""      # "eof" or "reset", once the server's end arrived
        self.closed = False

    def fileno(self) -> int:
        return self.number

    def setblocking(self, flag: bool) -> None:
        pass

    def readable(self) -> bool:
        return bool(self.inbound or self.ended)

    def deliver(self, data: bytes) -> None:
        self.inbound += data
        self.pipe.answered = True

    def deliver_end(self, reset: bool) -> None:
        self.ended = "reset" if reset else "eof"

    def recv(self, size: int) -> bytes:
        if self.closed:
            raise OSError(9, "Bad file descriptor")
        if self.inbound:
            data = bytes(self.inbound[:size])
            del self.inbound[:size]
            return data
        if self.ended == "reset":
            raise ConnectionResetError(104, "Connection reset by peer")
        if self.ended:
            return b""
        raise BlockingIOError

    def send(self, data: bytes) -> int:
        if self.closed:
            raise OSError(9, "Bad file descriptor")
        if self.ended == "reset" or self.pipe.server_closed and self.ended:
            raise BrokenPipeError(32, "Broken pipe")
        rng = self.pipe.world.rng
        count = len(data) if len(data) < 2 or rng.random() < 0.9 else rng.randrange(1, len(data))
        self.pipe.client_write(bytes(data[:count]))
        return count

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pipe.client_close()


class SimWake:
    """The thread driver's wake-up pair, in one: a send makes the selector return."""

    def __init__(self) -> None:
        self.woken = False

    def fileno(self) -> int:
        return 3

    def readable(self) -> bool:
        return self.woken

    def send(self, data: bytes) -> int:
        self.woken = True
        return len(data)

    def recv(self, size: int) -> bytes:
        self.woken = False
        return b"\0"

    def close(self) -> None:
        pass


class SimSelector:
    """The thread driver's selector: a wait in ``select`` moves the world on until a socket is
    ready or the timeout passes."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world
        self._keys: Dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        if fileobj not in self._keys:
            raise KeyError(fileobj)
        return self.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys[fileobj]

    def get_map(self) -> Dict[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys = {}

    def _ready(self) -> List[Tuple[selectors.SelectorKey, int]]:
        ready = []
        for fileobj, key in self._keys.items():
            events = 0
            if key.events & selectors.EVENT_READ and fileobj.readable():
                events |= selectors.EVENT_READ
            if key.events & selectors.EVENT_WRITE:
                events |= selectors.EVENT_WRITE
            if events:
                ready.append((key, events))
        return ready

    def select(self, timeout: Optional[float]) -> List[Tuple[selectors.SelectorKey, int]]:
        self.world.wait(timeout, lambda: bool(self._ready()))
        return self._ready()


class SimThreadDriver(andpush._ThreadDriver):
    """The real thread driver, its sockets and selector simulated and its threads gone: the
    run calls ``_run`` whenever the driver was handed work (``_take_over``)."""

    world: SimWorld
    network: SimNetwork

    def _take_over(self, lead: bool) -> None:
        if self._selector is None:
            self._selector = SimSelector(self.world)  # type: ignore[assignment]
            self._wake_r = self._wake_w = SimWake()  # type: ignore[assignment]
            self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.current_thread()

    def _turn(self) -> Optional[float]:
        self.world.turn()
        return super()._turn()

    def _crashed(self, exc: BaseException) -> None:
        if isinstance(exc, SimAbort):
            raise exc
        self.world.problem("the engine failed: %r" % exc)
        super()._crashed(exc)

    def _start_connecting(self, route: andpush._Route, count: int, generation: int) -> None:
        for _ in range(count):
            self._one_connect(route, generation)

    def _one_connect(self, route: andpush._Route, generation: int) -> None:
        """As _connect does on its thread: the socket (or the error) is posted to the driver;
        a connect that neither comes up nor fails times out."""
        settled = []

        def up(pipe: SimPipe, h2: bool) -> None:
            sock = SimSocket(pipe)
            if settled:
                sock.close()
                return
            settled.append(True)

            def take() -> None:
                if not self._connected(route, sock, h2, generation):
                    sock.close()
            self._post_or_close(take, sock)

        def failed(error: Exception) -> None:
            if not settled:
                settled.append(True)
                network_error = andpush.NetworkError(
                    "could not connect to %r: %s" % (route, error), may_have_been_delivered=False)
                self._connects_failed(route, network_error, generation, 1)

        self.network.connect(route.origin.host, up, failed)
        self.world.after(self._connect_timeout, lambda: failed(TimeoutError("timed out")))

    def _post_or_close(self, work: Callable[[], None], sock: SimSocket) -> None:
        try:
            self._post(work)
        except ValueError:  # closed meanwhile
            sock.close()


# The asyncio driver's world ----------------------------------------------------------------

class SimSSLObject:
    def __init__(self, h2: bool) -> None:
        self.h2 = h2

    def selected_alpn_protocol(self) -> Optional[str]:
        return "h2" if self.h2 else "http/1.1"


class SimTransport:
    """An asyncio transport over a simulated connection."""

    def __init__(self, loop: "SimEventLoop", pipe: SimPipe, protocol: Any, h2: bool) -> None:
        self.loop = loop
        self.pipe = pipe
        pipe.client = self
        self.protocol = protocol
        self.ssl_object = SimSSLObject(h2)
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.ssl_object if name == "ssl_object" else default

    def write(self, data: bytes) -> None:
        if not self.closing:
            self.pipe.client_write(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self._lose(None)

    def abort(self) -> None:
        self._lose(None)

    def _lose(self, exc: Optional[Exception]) -> None:
        if not self.closing:
            self.closing = True
            self.pipe.client_close()
            self.loop.call_soon(self.protocol.connection_lost, exc)

    def deliver(self, data: bytes) -> None:
        if not self.closing:
            self.pipe.answered = True
            self.protocol.data_received(data)

    def deliver_end(self, reset: bool) -> None:
        if self.closing:
            return
        if reset:
            self._lose(ConnectionResetError(104, "Connection reset by peer"))
        else:
            self.protocol.eof_received()
            self._lose(None)


class _SimLoopSelector:
    """What asyncio's loop waits on: a wait moves the world on until the loop has callbacks
    to run or the timeout passes."""

    def __init__(self, loop: "SimEventLoop") -> None:
        self.loop = loop

    def select(self, timeout: Optional[float]) -> List[Any]:
        world = self.loop.world
        world.wait(timeout, lambda: bool(self.loop._ready) or world.aborted)
        return []

    def close(self) -> None:
        pass


class SimEventLoop(asyncio.BaseEventLoop):
    """An asyncio event loop on the world's clock, whose connections are simulated."""

    def __init__(self, world: SimWorld, network: SimNetwork) -> None:
        super().__init__()
        self.world = world
        self.network = network
        self._selector = _SimLoopSelector(self)  # what BaseEventLoop._run_once waits on
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.world.now

    def _process_events(self, event_list: List[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    async def create_connection(self, protocol_factory: Callable[[], Any], host: Any = None,
                                port: Any = None, **kwargs: Any) -> Tuple[Any, Any]:
        future = self.create_future()

        def up(pipe: SimPipe, h2: bool) -> None:
            if future.done():  # timed out meanwhile
                pipe.client_close()
            else:
                future.set_result((pipe, h2))

        def failed(error: Exception) -> None:
            if not future.done():
                future.set_exception(error)
        self.network.connect(host, up, failed)
        pipe, h2 = await future
        protocol = protocol_factory()
        transport = SimTransport(self, pipe, protocol, h2)
        protocol.connection_made(transport)
        return transport, protocol


class SimAsyncDriver(andpush._AsyncDriver):
    world: SimWorld

    def _take_turn(self) -> None:
        self.world.turn()
        super()._take_turn()


# One run ------------------------------------------------------------------------------------

_SIM_SSL: List[ssl.SSLContext] = []


def sim_ssl_context() -> ssl.SSLContext:
    """One context for every run (making one costs milliseconds); no connection uses it."""
    if not _SIM_SSL:
        _SIM_SSL.append(ssl.create_default_context())
    return _SIM_SSL[0]


class SimCall:
    """One message's life as the simulated caller saw it."""

    __slots__ = ("key", "timeout", "begin", "end", "outcome", "outcomes")

    def __init__(self, key: str, timeout: Optional[float] = None) -> None:
        self.key = key
        self.timeout = timeout
        self.begin: Optional[float] = None  # when the engine was handed it (None: never)
        self.end: Optional[float] = None
        self.outcome: Any = None
        self.outcomes = 0


class SimBatchRecord:
    """One push_many as its simulated consumer saw it."""

    def __init__(self, items: List[Any], concurrency: int, how: str, stop_at: int) -> None:
        self.items = items
        self.concurrency = concurrency
        self.how = how            # "all", "stop" / "close" after stop_at pairs, or "drop"
        self.stop_at = stop_at
        self.pairs: List[Tuple[Any, Any]] = []
        self.batch: Any = None
        self.finished = False     # the consumer saw the end (or dropped the iterator)
        self.stopped_at: Optional[float] = None
        self.finished_at: Optional[float] = None


class _ProblemLog(logging.Handler):
    def __init__(self, world: SimWorld) -> None:
        super().__init__(logging.ERROR)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.world.problem("andpush logged an error: %s" % record.getMessage())
        else:
            self.world.note("andpush: " + record.getMessage())


class SimThreadBatch(andpush._Batch):
    """push_many's batch for the thread driver, its feeder and consumer simulated callers
    (the feeder reads when room is made; the consumer takes pairs as they are ready)."""

    def __init__(self, run: "SimRun", record: SimBatchRecord, make: Any, route: Any) -> None:
        super().__init__(make, route, record.concurrency, None)
        self.run = run
        self.record = record
        self._input = iter(record.items)
        self._feeding = self._consuming = False

    def _pair_ready(self) -> None:
        if not self._consuming:
            self._consuming = True
            self.run.world.after(0.0, self._consume)

    def _room_made(self) -> None:
        if not self._feeding:
            self._feeding = True
            self.run.world.after(0.0, self.feed)

    def _store(self, index: int, item: Any, outcome: Any) -> None:
        self.run.item_ended(item, outcome)
        super()._store(index, item, outcome)

    def feed(self) -> None:
        """_ThreadBatch.feed without the waiting: read what there is room for."""
        self._feeding = False
        with self._lock:
            room = 0 if self._must_wait() else self._room_left()
        for _ in range(room):
            try:
                item = next(self._input)
            except StopIteration:
                self._end_of_input(None)
                return
            if not self._prepare((item,)):
                return

    def _consume(self) -> None:
        self._consuming = False
        self.run.consume_ready(self.record, self._next_now)

    def _next_now(self) -> Optional[Tuple[Any, Any]]:
        """The next pair if it is there (None if not yet); StopIteration after the last."""
        if self._handed:
            return self._handed.popleft()
        with self._lock:
            return self._next_or_end()


class SimAsyncBatch(andpush._AsyncBatch):
    run: "SimRun"

    def _store(self, index: int, item: Any, outcome: Any) -> None:
        self.run.item_ended(item, outcome)
        super()._store(index, item, outcome)


class SimRun:
    """A run of one seed under one driver: draw the world and the calls, run them to the end,
    then check every invariant. ``run`` returns what broke (empty: nothing)."""

    def __init__(self, seed: int, driver: str, **fixed: Any) -> None:
        """Draw a run from ``seed``; ``fixed`` sets what a scripted run must have instead:
        ``faults`` (how often FCM misbehaves), ``h2``, ``fcm`` and ``oauth`` (attributes
        of those servers), ``options`` (of the client), ``pushes`` ((at, key, timeout)
        each), ``batches`` ((at, size, concurrency, how, stop_at) each), ``close_early``."""
        self.seed = seed
        self.driver_kind = driver
        world = self.world = SimWorld(seed * 2 + (driver == "async"))
        rng = world.rng
        faults = fixed.get("faults", rng.choice((0.0, 0.02, 0.1, 0.3, 0.6, 1.0)))
        options = dict(
            server_key=None, project_id=SIM_PROJECT, access_token=None,
            credentials={"type": "authorized_user", "client_id": "c", "client_secret": "s",
                         "refresh_token": "r", "token_uri": "https://%s/token" % SIM_OAUTH},
            endpoint="https://" + SIM_FCM, ssl_context=sim_ssl_context(),
            timeout=(rng.choice((1.0, 5.0, 10.0)), rng.choice((0.5, 5.0, 30.0))),
            max_retries=rng.choice((0, 1, 3)), pool_size=rng.choice((1, 2, 10)),
            keep_alive_timeout=rng.choice((5.0, 60.0)), proxy="",
            backoff_factor=rng.choice((0.1, 0.5, 2.0)), rate_limit=None, http2=True)
        options.update(fixed.get("options", {}))
        self.options = options
        self.connect_timeout, self.read_timeout = options["timeout"]
        self.max_retries = options["max_retries"]
        tokens: Dict[str, float] = {}
        self.fcm = SimServer(world, "fcm", fixed.get("h2", rng.random() < 0.7), faults,
                             tokens, self.read_timeout)
        self.oauth = SimServer(world, "oauth", rng.random() < 0.3,
                               faults * rng.choice((0.0, 0.3, 1.0)), tokens, self.read_timeout)
        for server, name in ((self.fcm, "fcm"), (self.oauth, "oauth")):
            for attribute, value in fixed.get(name, {}).items():
                setattr(server, attribute, copy.deepcopy(value))  # a script is used up
        self.network = SimNetwork(world, {SIM_FCM: self.fcm, SIM_OAUTH: self.oauth})
        if rng.random() < faults * 0.3:  # FCM forgets every access token it issued
            world.after(rng.random() * 30, tokens.clear)
        pushes = [(rng.random() * rng.choice((0.1, 5.0, 60.0)), "p%d" % number,
                   rng.choice((None, None, 0.5, 3.0)))
                  for number in range(rng.choice((0, 1, 2, 5)))]
        self.pushes: List[Tuple[float, str, Optional[float]]] = fixed.get("pushes", pushes)
        batches = []
        for number in range(rng.choice((0, 1, 1, 2))):
            concurrency = rng.choice((1, 2, 3, 10))
            size = max(0, rng.choice((concurrency - 1, concurrency, concurrency + 1,
                                      2 * concurrency + 1, 1, 12)))
            batches.append((rng.random() * rng.choice((0.1, 5.0)), size, concurrency,
                            rng.choice(("all", "all", "stop", "close", "drop")),
                            rng.randrange(0, size + 1)))
        self.batches: List[Tuple[float, SimBatchRecord]] = [  # (a size, or the items)
            (at, SimBatchRecord(list(size) if isinstance(size, list) else [
                {"token": "b%d-%d" % (number, i)} for i in range(size)],
                concurrency, how, stop_at))
            for number, (at, size, concurrency, how, stop_at)
            in enumerate(fixed.get("batches", batches))]
        close_early = rng.random() * 30 if rng.random() < 0.1 else None
        self.close_early: Optional[float] = fixed.get("close_early", close_early)
        self.stop_after: Optional[float] = fixed.get("stop_after")  # a batch's consumer
        # stops it this long after it began, whatever it has seen
        self.limit_peak = options["pool_size"] + sum(r.concurrency for _, r in self.batches)
        self.pending = len(self.pushes) + len(self.batches)
        self.calls: Dict[str, SimCall] = {}
        self.closed_at: Optional[float] = None
        self._close: Callable[[], None] = lambda: None

    # Running ---------------------------------------------------------------------------

    def run(self) -> List[str]:
        handler = _ProblemLog(self.world)
        logger = logging.getLogger("andpush")
        logger.addHandler(handler)
        level = logger.level
        if self.world.trace is not None:  # what the engine says, with the server's notes
            handler.setLevel(logging.DEBUG)
            logger.setLevel(logging.DEBUG)
        state = random.getstate()
        random.seed(self.seed)  # the retries' jitter
        try:
            if self.driver_kind == "thread":
                self._run_threads()
            else:
                self._run_asyncio()
            self._check()
        except SimAbort as abort:
            self.world.problem(str(abort))
        finally:
            random.setstate(state)
            logger.removeHandler(handler)
            logger.setLevel(level)
        return self.world.problems

    def _client_parts(self, driver_class: Any) -> Tuple[Any, Any, Any, Any]:
        parts = andpush._setup(driver_class, dict(self.options))
        driver = self.driver = parts[0]
        driver.world = self.world
        driver.network = self.network
        driver.clock = SimClock(self.world)
        return parts

    def _ended(self, call: SimCall, outcome: Any) -> None:
        self.world.note("%s ended: %r" % (call.key, outcome))
        call.outcomes += 1
        if call.outcomes == 1:
            call.end, call.outcome = self.world.now, outcome
        else:
            self.world.problem("%s got a second outcome: %r" % (call.key, outcome))

    def item_ended(self, item: Any, outcome: Any) -> None:
        call = self.calls.get(item["token"])
        if call is None:  # never begun: read, then stopped
            call = self.calls[item["token"]] = SimCall(item["token"])
        self._ended(call, outcome)

    def _made(self, make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``make``, noting when the engine begins each item."""
        def begin(item: Any) -> Any:
            exchange = make(item)
            call = self.calls[item["token"]] = SimCall(item["token"])
            call.begin = self.world.now
            return exchange
        return begin

    def _done(self) -> None:
        """A call ended, or a batch's consumer saw its end: after the last, the client closes."""
        self.pending -= 1
        if self.pending == 0:
            self.world.after(self.world.rng.random() * 2, self._close)

    def _closing(self) -> None:
        if self.closed_at is None:
            self.closed_at = self.world.now

    def _finished(self, record: SimBatchRecord) -> None:
        record.finished, record.finished_at = True, self.world.now
        if self.driver_kind == "thread":
            self._done()

    def consume_ready(self, record: SimBatchRecord, next_now: Callable[[], Any]) -> None:
        """Take the pairs that are there, as the record's consumer does."""
        while not record.finished:
            if record.how in ("stop", "close", "drop") and len(record.pairs) == record.stop_at:
                record.stopped_at = self.world.now
                if record.how == "drop":
                    record.batch.discard()
                    self._finished(record)
                    return
                record.batch.stop()
                record.how = "stopped"  # then it takes the rest, as close() would
            try:
                pair = next_now()
            except (StopIteration, andpush.NetworkError):  # the end, or the client's close
                self._finished(record)
                return
            if pair is None:
                return
            record.pairs.append(pair)

    def _run_threads(self) -> None:
        world = self.world
        driver, api, route, retry = self._client_parts(SimThreadDriver)
        client = andpush.Client(api, driver, route, retry)

        def close() -> None:
            self._closing()
            client.close()
        self._close = close
        for at, key, timeout in self.pushes:
            world.after(at, lambda k=key, t=timeout: self._thread_push(client, k, t))
        for at, record in self.batches:
            world.after(at, lambda r=record: self._thread_batch(client, r))
        if self.close_early is not None:
            world.after(self.close_early, close)
        if not self.pending:
            world.after(1.0, close)
        me = threading.current_thread()
        while True:
            if driver._thread is me:
                driver._run()
            elif world.next_event() == math.inf:
                break
            else:
                world.step()

    def _thread_push(self, client: Any, key: str, timeout: Optional[float]) -> None:
        call = self.calls[key] = SimCall(key, timeout)
        driver = client._driver
        exchange = client._requests.push({"token": key}, False, timeout)

        def ended(done: Any) -> None:
            self._ended(call, done.outcome)
            self._done()
        exchange.on_done = ended
        try:
            driver._post(lambda: driver._arrive(exchange))
        except ValueError:  # the client was closed: nothing begun
            ended(exchange)
            call.outcome = None
            return
        call.begin = self.world.now

    def _thread_batch(self, client: Any, record: SimBatchRecord) -> None:
        make = self._made(lambda m: client._requests.exchange(m, False))
        batch = record.batch = SimThreadBatch(self, record, make, client._requests.route)
        try:
            client._driver.add_batch(batch)
        except ValueError:  # the client was closed
            self._finished(record)
            return
        if self.stop_after is not None:
            self.world.after(self.stop_after, lambda: self._stop(record))
        batch.feed()

    def _stop(self, record: SimBatchRecord) -> None:
        """The consumer stops the batch (then takes the rest, as close() does)."""
        if record.stopped_at is None and not record.finished:
            record.stopped_at = self.world.now
            record.how = "stopped"
            record.batch.stop()

    # The asyncio driver -----------------------------------------------------------------

    def _run_asyncio(self) -> None:
        loop = self.loop = SimEventLoop(self.world, self.network)
        driver, api, route, retry = self._client_parts(SimAsyncDriver)
        client = andpush.AsyncClient(api, driver, route, retry)

        def close() -> None:
            self._closing()
            loop.create_task(client.aclose())
        self._close = close

        def caught(loop: Any, context: Dict[str, Any]) -> None:
            """What a callback raised: a SimAbort ends the run; anything else is a problem."""
            error = context.get("exception")
            if isinstance(error, SimAbort):
                aborts.append(error)
                self.world.aborted = True
                loop.stop()
            else:
                self.world.problem("the event loop caught: %s %r"
                                   % (context.get("message"), error))
        aborts: List[SimAbort] = []
        loop.set_exception_handler(caught)
        try:
            try:
                loop.run_until_complete(self._scenario(client))
            except RuntimeError:  # stopped: a callback aborted the run
                if not aborts:
                    raise
                raise aborts[0] from None
            if any(not task.done() for task in asyncio.all_tasks(loop)):
                self.world.problem("tasks left after the client closed: %r"
                                   % [t for t in asyncio.all_tasks(loop) if not t.done()])
        finally:
            self.world.aborted = True
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()

            async def wind_down() -> None:
                await asyncio.gather(*tasks, return_exceptions=True)
            if tasks:
                loop.run_until_complete(wind_down())
            loop.close()

    async def _scenario(self, client: Any) -> None:
        tasks = [asyncio.ensure_future(self._async_push(client, *push)) for push in self.pushes]
        tasks += [asyncio.ensure_future(self._async_batch(client, at, record))
                  for at, record in self.batches]
        if self.close_early is not None:
            self.loop.call_later(self.close_early, self._close)
        await asyncio.gather(*tasks)
        await asyncio.sleep(self.world.rng.random() * 2)
        self._closing()
        await client.aclose()

    async def _async_push(self, client: Any, at: float, key: str,
                          timeout: Optional[float]) -> None:
        await asyncio.sleep(at)
        call = self.calls[key] = SimCall(key, timeout)
        call.begin = self.world.now
        try:
            outcome: Any = await client.push({"token": key}, timeout=timeout)
        except ValueError:  # the client was closed: nothing begun
            call.begin = None
            outcome = None
        except andpush.Error as error:
            outcome = error
        self._ended(call, outcome)

    async def _async_batch(self, client: Any, at: float, record: SimBatchRecord) -> None:
        await asyncio.sleep(at)
        driver = client._driver
        try:
            event_loop = driver.bind()
        except ValueError:  # the client was closed
            self._finished(record)
            return
        make = self._made(lambda m: client._requests.exchange(m, False))
        batch = record.batch = SimAsyncBatch(record.items, make, client._requests.route,
                                             record.concurrency, None, client._find_project)
        batch.run = self
        driver.add_batch(batch)
        batch.start(event_loop)
        outcomes = andpush.AsyncOutcomes(batch)
        if self.stop_after is not None:
            self.loop.call_later(self.stop_after, self._stop, record)
        while True:
            if record.how in ("stop", "close", "drop") and len(record.pairs) == record.stop_at:
                record.stopped_at = self.world.now
                if record.how == "drop":
                    batch.discard()
                    break
                if record.how == "close":
                    record.pairs.extend(await outcomes.aclose())
                    break
                outcomes.stop()
                record.how = "stopped"
            try:
                record.pairs.append(await outcomes.__anext__())
            except StopAsyncIteration:
                break
            except andpush.NetworkError:  # reading ended by the client's close
                break
        self._finished(record)

    # Checking ----------------------------------------------------------------------------

    def bound(self, call: SimCall) -> float:
        """The most a call may take, by the liveness contract: per try, the wait to go out and
        the wait for the answer; a backoff before each retry and the 429 pause before each
        try, each at most _MAX_RETRY_WAIT; one more try after refreshing an access token."""
        send = self.connect_timeout if call.timeout is None else call.timeout
        answer = self.read_timeout if call.timeout is None else call.timeout
        tries = self.max_retries + 2
        return (tries * (send + answer + andpush._MAX_RETRY_WAIT)
                + self.max_retries * andpush._MAX_RETRY_WAIT + 1.0)

    def _written(self, key: str) -> bool:
        return any(sim_request_key(request) == key
                   for pipe in self.network.pipes if pipe.server is not None
                   and pipe.server.server is self.fcm for request in sim_requests_written(pipe))

    def _check(self) -> None:
        problem = self.world.problem
        for key, call in sorted(self.calls.items()):
            if call.outcomes != 1:
                problem("%s got %d outcomes" % (key, call.outcomes))
                continue
            outcome = call.outcome
            delivered = self.fcm.delivered.get(key, 0)
            if delivered > 1:
                problem("%s was processed %d times" % (key, delivered))
            if outcome is None:
                if delivered:
                    problem("%s was never begun, yet processed" % key)
                continue
            if isinstance(outcome, andpush.Response):
                if not delivered:
                    problem("%s succeeded without being processed" % key)
            elif isinstance(outcome, andpush.NetworkError):
                if not outcome.may_have_been_delivered and delivered:
                    problem("%s says it was not delivered, but it was processed: %s"
                            % (key, outcome))
                if outcome.may_have_been_delivered and not delivered and not self._written(key):
                    problem("%s never left the client, yet says it may have been delivered: %s"
                            % (key, outcome))
            elif delivered:
                problem("%s was processed, yet ended in %r" % (key, outcome))
            if call.begin is not None and call.end is not None:
                took = call.end - call.begin
                if took > self.bound(call) and not (
                        self.closed_at is not None and call.end <= self.closed_at + 1.0):
                    problem("%s took %.1f s, over its bound of %.1f s (%r)"
                            % (key, took, self.bound(call), outcome))
        for _, record in self.batches:
            taken = record.batch._read if record.batch is not None else 0
            for (item, _), original in zip(record.pairs, record.items):
                if item is not original:
                    problem("a pair of push_many holds another item than the input's, in order")
                    break
            if record.how != "drop" and record.batch is not None and len(record.pairs) != taken:
                problem("push_many read %d items and gave %d pairs" % (taken, len(record.pairs)))
            for item, outcome in record.pairs:
                call = self.calls.get(item["token"])
                if call is None or call.outcome is not outcome:
                    problem("the pair of %s holds another outcome than the one it ended with"
                            % item["token"])
        duration = self.world.now - SIM_START
        tries = len(self.calls) * (self.max_retries + 2)
        for server in (self.fcm, self.oauth):
            # No storm: a round of failed connects opens at most the route's limit, the
            # hold-off that follows doubles up to 30 s, and a try costs one connection more.
            wasted = server.connections - len(server.answered_connections)
            most = (self.limit_peak + 1) * (8 + duration / 30) + tries * (
                1 + (server is self.oauth) * andpush._TOKEN_RETRIES)
            if wasted > most:
                problem("%d connections to %s carried no answer (at most %d in %.0f s)"
                        % (wasted, server.kind, most, duration))
        most = SIM_TURNS_PER_SECOND * (1 + duration) + SIM_TURNS_PER_EVENT * self.world.events
        if self.world.turns > most:  # a busy loop spread over time
            problem("%d engine turns in %.1f s (at most %d)" % (self.world.turns, duration, most))
        self._check_nothing_left()

    def _check_nothing_left(self) -> None:
        driver = self.driver
        if driver._has_work():
            self.world.problem("the engine still holds work after the client closed")
        if self.driver_kind == "thread" and (driver._selector is not None
                                             or driver._thread is not None):
            self.world.problem("the thread driver did not park after the client closed")
        for pipe in self.network.pipes:
            if not pipe.client_closed:
                self.world.problem("a connection was left open after the client closed")
                break


def simulate(seeds: Iterable[int], drivers: Sequence[str] = SIM_DRIVERS,
             first: bool = False) -> List[str]:
    """Run each seed under each driver; a line per failed run, with its replay command
    (``first``: stop at the first)."""
    failures = []
    for seed in seeds:
        for driver in drivers:
            problems = SimRun(seed, driver).run()
            if problems:
                failures.append("seed %d, %s driver: %s\n    replay: python test_andpush.py "
                                "--simulate 1 --seed %d --driver %s --trace"
                                % (seed, driver, "; ".join(problems[:3]), seed, driver))
                if first:
                    return failures
    return failures


def simulate_main(argv: List[str]) -> int:
    """``python test_andpush.py --simulate N [--seed S] [--driver D] [--trace]``: run N seeds
    from S (each under each driver, or D's alone); with --trace, print what happened."""
    import argparse

    parser = argparse.ArgumentParser(prog="test_andpush.py", description=simulate_main.__doc__)
    parser.add_argument("--simulate", type=int, metavar="N", required=True)
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--driver", choices=SIM_DRIVERS)
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args(argv)
    drivers = (args.driver,) if args.driver else SIM_DRIVERS
    started = time.perf_counter()
    if args.trace:
        for seed in range(args.seed, args.seed + args.simulate):
            for driver in drivers:
                run = SimRun(seed, driver)
                run.world.trace = []
                problems = run.run()
                print("\n".join(run.world.trace + problems or ["seed %d: ok" % seed]))
        return 0
    failures = simulate(range(args.seed, args.seed + args.simulate), drivers)
    print("\n".join(failures[:20]))
    print("%d of %d runs broke an invariant, in %.1f s"
          % (len(failures), args.simulate * len(drivers), time.perf_counter() - started))
    return 1 if failures else 0


# Seeds the suite runs, each under both drivers: 200 schedules, 0.4 s. Each engine broken on
# purpose below breaks an invariant within its first 20 or so; .ci/run runs the next 5,000.
SIM_SUITE_SEEDS = 100


def scripted(driver: str, **fixed: Any) -> SimRun:
    """A scripted run (seed 1, under ``driver``), run to its end: its ``problems`` say
    which invariants it broke."""
    run = SimRun(1, driver, **fixed)
    run.problems = run.run()
    return run


class SimulationTest(unittest.TestCase):
    """The engine under seeded schedules of faults, on both drivers and both protocols:
    every invariant of SimRun._check holds in every run."""

    def test_every_invariant_holds_under_random_schedules(self) -> None:
        failures = simulate(range(SIM_SUITE_SEEDS))
        self.assertEqual(failures, [], "\n" + "\n".join(failures))

    def test_a_run_is_a_function_of_its_seed(self) -> None:
        for driver in SIM_DRIVERS:
            traces = []
            for _ in range(2):
                run = SimRun(12, driver, faults=0.3, pushes=[(0.0, "p0", None), (1.0, "p1", 3.0)],
                             batches=[(0.5, 10, 3, "all", 0)])
                run.world.trace = []
                run.run()
                traces.append(run.world.trace)
            self.assertGreater(len(traces[0]), 10)
            self.assertEqual(traces[0], traces[1])

    def test_an_engine_broken_on_purpose_is_found_within_a_few_seeds(self) -> None:
        """The harness looks: each of these faults of the engine breaks an invariant."""
        retryable = andpush._Retry._retryable
        timeout = andpush._Engine._timeout
        table = {
            "a request that may have been delivered is sent again": (
                andpush._Retry, "_retryable",
                lambda retry, error: isinstance(error, andpush.NetworkError)
                or retryable(retry, error)),
            "a lost stream counts as not processed": (
                andpush._H2Connection, "may_have_arrived", lambda conn, stream: False),
            "more streams than the server allows": (
                andpush._H2Connection, "free_streams",
                lambda conn: 100 - len(conn.streams) if conn.state == "OPEN" else 0),
            "a request waiting to go out has no deadline": (
                andpush._Engine, "_expire_waiting", lambda engine, route, now: None),
            "the driver is woken every 2 ms for nothing": (
                andpush._Engine, "_timeout", lambda engine, now: min(timeout(engine, now) or 1,
                                                                     0.002)),
        }
        for name, (owner, attribute, broken) in table.items():
            with self.subTest(name), unittest.mock.patch.object(owner, attribute, broken):
                self.assertTrue(simulate(range(SIM_SUITE_SEEDS), first=True),
                                "the simulation did not find it")


def outcomes_in(run: SimRun, prefix: str) -> List[Any]:
    """The outcomes of a run's calls whose keys start with ``prefix``, in key order."""
    return [call.outcome for key, call in sorted(run.calls.items(), key=lambda kv: (
        len(kv[0]), kv[0])) if key.startswith(prefix)]


def not_sent(outcome: object, saying: str = "") -> bool:
    return (isinstance(outcome, andpush.NetworkError) and not outcome.may_have_been_delivered
            and saying in str(outcome))


class LivenessTest(unittest.TestCase):
    """Every call ends within the bound its options give, whatever the server sends or
    withholds: the cases the liveness issue found, each a scripted simulation on both
    drivers (which checks every invariant of SimRun._check as well)."""

    SLOW = dict(timeout=(0.5, 0.5), max_retries=1)

    def runs(self, **fixed: Any) -> List[SimRun]:
        """The scripted run under each driver, each of which broke no invariant."""
        runs = []
        for driver in SIM_DRIVERS:
            run = scripted(driver, **fixed)
            self.assertEqual(run.problems, [], driver)
            runs.append(run)
        return runs

    def test_push_many_over_http2_ends_when_the_server_stops_answering(self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"stuck": "no_answers", "limit": 100},
                             options=self.SLOW, pushes=[], batches=[(0.0, 20, 10, "all", 0)]):
            outcomes = outcomes_in(run, "b0-")
            self.assertEqual(len(outcomes), 20)
            self.assertTrue(all(isinstance(o, andpush.NetworkError)
                                and o.may_have_been_delivered for o in outcomes))
            for outcome, call in zip(outcomes, [run.calls["b0-%d" % i] for i in range(20)]):
                assert call.end is not None and call.begin is not None
                self.assertLess(call.end - call.begin, 0.5 + 0.5 + 0.01)  # one try each
            record = run.batches[0][1]
            assert record.finished_at is not None
            self.assertLess(record.finished_at - SIM_START, 3.0)  # the ten after the first ten

    def test_a_server_that_never_sends_its_settings_fails_each_try_unsent(self) -> None:
        for run in self.runs(h2=True, faults=0.0,
                             fcm={"settings": "none", "settings_share": 1.0},
                             options=self.SLOW, pushes=[(0.0, "p0", None)],
                             batches=[(0.0, 30, 10, "all", 0)]):
            outcomes = outcomes_in(run, "")
            self.assertEqual(len(outcomes), 31)
            self.assertTrue(all(not_sent(o) for o in outcomes))

    def test_a_server_that_takes_h2_and_answers_http11_gets_a_few_connects(self) -> None:
        for run in self.runs(h2=True, faults=0.0,
                             fcm={"settings": "garbage", "settings_share": 1.0},
                             options=self.SLOW, pushes=[(0.0, "p0", None)],
                             batches=[(0.0, 20, 10, "all", 0)]):
            self.assertTrue(all(not_sent(o) for o in outcomes_in(run, "")))
            self.assertLessEqual(run.fcm.connections, 4)  # a try each, held off between

    def test_a_server_that_allows_no_stream_fails_each_try_unsent_on_one_connection(
            self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"limit": 0}, options=self.SLOW,
                             pushes=[(0.0, "p0", None)], batches=[(0.0, 20, 10, "all", 0)]):
            self.assertTrue(all(not_sent(o, "had room") for o in outcomes_in(run, "")))
            self.assertEqual(run.fcm.connections, 1)

    def test_a_429_asking_for_more_than_the_longest_wait_ends_the_retries_at_once(
            self) -> None:
        error = andpush.QuotaExceededError(response(429, {}, Retry_After="121"))
        self.assertIsNone(andpush._Retry(3, 0.5).after(error))
        error = andpush.QuotaExceededError(response(429, {}, Retry_After="120"))
        self.assertIsNotNone(andpush._Retry(3, 0.5).after(error))

    def test_a_token_endpoint_that_closes_the_connection_leaves_every_push_unsent(
            self) -> None:
        for run in self.runs(faults=0.0, oauth={"stuck": "drop_requests"},
                             options=self.SLOW, pushes=[(0.0, "p0", None)],
                             batches=[(0.0, 5, 2, "all", 0)]):
            outcomes = outcomes_in(run, "")
            self.assertEqual(len(outcomes), 6)
            self.assertTrue(all(not_sent(o, "access token") for o in outcomes), outcomes)

    def test_the_calls_timeout_bounds_its_wait_for_an_access_token(self) -> None:
        for run in self.runs(faults=0.0, oauth={"stuck": "no_answers"},
                             options=dict(timeout=(10.0, 30.0), max_retries=0),
                             pushes=[(0.0, "p0", 2.0)], batches=[]):
            call = run.calls["p0"]
            self.assertTrue(not_sent(call.outcome, "access token"), call.outcome)
            assert call.end is not None and call.begin is not None
            self.assertLess(call.end - call.begin, 2 + 2 + 0.01)  # one try: out, answer

    def test_stopping_a_push_many_writes_nothing_more(self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"stuck": "no_answers", "limit": 100},
                             options=dict(timeout=(1.0, 5.0), max_retries=1), pushes=[],
                             batches=[(0.0, 200, 50, "all", 0)], stop_after=1.0):
            record = run.batches[0][1]
            assert record.stopped_at is not None and record.finished_at is not None
            self.assertLessEqual(record.finished_at - record.stopped_at, 5.0 + 0.01)
            self.assertLessEqual(len(run.fcm.delivered), 50)  # those on the wire at the stop
            outcomes = [outcome for _, outcome in record.pairs]
            self.assertEqual(len(outcomes), record.batch._read)
            stopped = [o for o in outcomes if isinstance(o, andpush._Stopped)]
            self.assertEqual(len(stopped), len(outcomes) - len(run.fcm.delivered))

    def test_a_request_a_reused_connection_failed_goes_out_on_a_new_one(self) -> None:
        for run in self.runs(h2=False, faults=0.0, fcm={"close_every": 1},
                             options=dict(max_retries=0), pushes=[],
                             batches=[(0.0, 300, 10, "all", 0)]):
            outcomes = outcomes_in(run, "b0-")
            self.assertEqual(len(outcomes), 300)
            failed = [o for o in outcomes if not isinstance(o, andpush.Response)]
            self.assertEqual(failed, [])


class MisbehavingServerTest(unittest.TestCase):
    """What a server's misbehaviour means for each message, on both drivers and both
    protocols where both apply: scripted simulations (each also checks every invariant of
    SimRun._check: one truthful outcome per message, none processed twice)."""

    def runs(self, **fixed: Any) -> List[SimRun]:
        return LivenessTest.runs(self, **fixed)  # type: ignore[arg-type]

    #: A message's fault: the server's answers to its tries, the outcome's class, and how
    #: many of its requests the server reads.
    FAULTS: Dict[str, Tuple[List[str], Any, int]] = {
        "ok": ([], andpush.Response, 1),
        "unregistered": (["error:404"], andpush.UnregisteredError, 1),
        "invalid": (["error:400"], andpush.InvalidArgumentError, 1),
        "flaky": (["error:503"], andpush.Response, 2),
        "down": (["error:503"] * 3, andpush.UnavailableError, 3),
    }
    #: ... and those of each protocol: a request processed and then lost (never sent again),
    #: and those provably not processed (sent again, at once).
    PROTOCOL_FAULTS: Dict[bool, Dict[str, Tuple[List[str], Any, int]]] = {
        False: {"lost": (["partial"], andpush.NetworkError, 1)},  # an answer cut short
        True: {"lost": (["reset_after"], andpush.NetworkError, 1),  # its stream reset
               "refused": (["refuse"], andpush.Response, 1),
               "unread": (["above_goaway"], andpush.Response, 1)},
    }

    def test_push_many_gives_one_outcome_per_message_in_input_order_under_faults(
            self) -> None:
        for h2 in (True, False):
            faults = dict(self.FAULTS, **self.PROTOCOL_FAULTS[h2])
            items: List[Dict[str, Any]] = []
            expected = []
            script = {}
            for i in range(60):
                kind = list(faults)[i % len(faults)]
                token = "%s-%d" % (kind, i)
                actions, cls, reads = faults[kind]
                script[token] = list(actions)
                items.append({"token": token})
                expected.append((token, cls, reads))
            items.insert(7, {"token": "bad", "data": {"n": 1}})  # refused before it is sent
            expected.insert(7, ("bad", TypeError, 0))
            for run in self.runs(h2=h2, faults=0.0, fcm={"script": script, "limit": 100},
                                 options=dict(max_retries=2, backoff_factor=0.001), pushes=[],
                                 batches=[(0.0, items, 8, "all", 0)]):
                pairs = run.batches[0][1].pairs  # (their order and items: SimRun._check)
                self.assertEqual(len(pairs), len(expected))
                for (_, outcome), (token, cls, reads) in zip(pairs, expected):
                    self.assertIsInstance(outcome, cls, token)
                    self.assertEqual(run.fcm.received.get(token, 0), reads, token)
                    if isinstance(outcome, andpush.NetworkError):
                        self.assertTrue(outcome.may_have_been_delivered)

    def test_streams_follow_the_limit_of_the_servers_settings_as_it_shrinks(self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"limit": 8, "shrink": (10, 3)},
                             pushes=[], batches=[(0.0, 60, 50, "all", 0)]):
            self.assertTrue(all(isinstance(o, andpush.Response)
                                for o in outcomes_in(run, "b0-")))
            # (no stream over the limit in force, nor a message processed twice: _check)

    def test_a_dropped_connection_loses_nothing_silently(self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"script": {"b0-4": ["drop_after"]}},
                             options=dict(max_retries=3), pushes=[],
                             batches=[(0.0, 30, 10, "all", 0)]):
            outcome = run.calls["b0-4"].outcome
            self.assertIsInstance(outcome, andpush.NetworkError)
            self.assertTrue(outcome.may_have_been_delivered)

    def test_a_goaway_that_closes_at_once_loses_nothing_silently(self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"script": {"b0-4": ["goaway_close"]}},
                             options=dict(max_retries=2), pushes=[],
                             batches=[(0.0, 30, 10, "all", 0)]):
            self.assertTrue(run.calls["b0-4"].outcome.may_have_been_delivered)

    def test_a_goaway_every_ten_streams_starves_no_message(self) -> None:
        for run in self.runs(h2=True, faults=0.0, fcm={"goaway_every": 10, "limit": 100},
                             pushes=[], batches=[(0.0, 300, 50, "all", 0)]):
            outcomes = outcomes_in(run, "b0-")
            self.assertEqual(len(outcomes), 300)
            self.assertTrue(all(isinstance(o, andpush.Response) for o in outcomes))
            self.assertGreaterEqual(run.fcm.goaways, 300 // 10)

    def test_a_server_that_goes_away_mid_batch_gives_every_message_one_outcome(self) -> None:
        for h2 in (True, False):
            for run in self.runs(h2=h2, faults=0.0, fcm={"script": {"b0-10": ["go_down"]}},
                                 options=dict(timeout=(1.0, 0.2), max_retries=1), pushes=[],
                                 batches=[(0.0, 40, 10, "all", 0)]):
                self.assertTrue(run.calls["b0-10"].outcome.may_have_been_delivered)
                unsent = [call.outcome for key, call in run.calls.items()
                          if not run._written(key)]
                self.assertTrue(unsent)  # the connects after it are refused
                self.assertTrue(all(not_sent(o) for o in unsent), unsent)

    def test_a_server_that_turns_connections_away_gets_a_few_tries_not_a_storm(self) -> None:
        for h2 in (True, False):
            for run in self.runs(h2=h2, faults=0.0, fcm={"stuck": "max_connections", "limit": 1},
                                 pushes=[], batches=[(0.0, 20, 3, "all", 0)]):
                self.assertTrue(all(isinstance(o, andpush.Response)
                                    for o in outcomes_in(run, "b0-")))
                # The first connection carries them all; the others are turned away, and
                # tried again only once the hold-off after each round has passed.
                self.assertLessEqual(run.fcm.connections, 5)


if __name__ == "__main__":
    if "--simulate" in sys.argv:
        sys.exit(simulate_main(sys.argv[1:]))
    unittest.main()
