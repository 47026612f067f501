"""andpush: fast, dependency-free Firebase Cloud Messaging (FCM) for Python::

    import andpush

    with andpush.new(credentials="service-account.json") as client:
        response = client.push({
            "token": device_token,
            "notification": {"title": "Update", "body": "Ready"},
        })
        print(response.json()["name"])
        for outcome in client.push_many(messages, concurrency=100):
            ...                           # a Response, or the error for that message

One module, standard library only, Python 3.8+. Pushes go over kept-alive HTTPS
connections from a thread-safe, fork-safe pool, so one TLS handshake serves any
number of messages; push_many multiplexes them over HTTP/2 when the server offers it;
the OAuth2 tokens of the HTTP v1 API are signed in pure Python.

``andpush.new(server_key)`` makes a client of the legacy API instead
(``andpush.build`` is another name for ``new``).

The life of a pooled connection (each edge is what moves it)::

    connect() --> IN_USE --response read, keep-alive--> IDLE
                   |  ^                                  |
                   |  +-------- get(): still alive ------+
                   |                                     |
      error, timeout, Connection: close    idle too long, closed by the server,
                   |                       or created before os.fork()
                   v                                     v
                 CLOSED <--------------------------------+

Errors form one tree; each says whose fault it is::

    Error
     +-- NetworkError      no answer: may_have_been_delivered says if it may have arrived
     +-- AuthError         no credentials, no access token, or FCM refused them
     +-- HTTPError         the server answered with a non-2xx status
          +-- ClientError  4xx: InvalidArgumentError, UnregisteredError, ...
          |    +-- UnauthenticatedError, PermissionDeniedError: AuthErrors too
          +-- ServerError  5xx: InternalError, UnavailableError
"""

import base64
import binascii
import collections
import contextlib
import heapq
import hashlib
import json
import logging
import math
import os
import random
import re
import select
import selectors
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from typing import (
    Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, NoReturn, Optional,
    TYPE_CHECKING, TextIO, Tuple, Type, Union,
)

__version__ = "0.1.0"
__all__ = [  # what help(andpush) shows: ``build``, an alias of ``new``, is left out
    "new", "Client", "Response", "Headers",
    "Error", "NetworkError", "AuthError", "HTTPError", "ClientError", "ServerError",
    "InvalidArgumentError", "UnregisteredError", "SenderIdMismatchError",
    "QuotaExceededError", "ThirdPartyAuthError", "UnauthenticatedError",
    "PermissionDeniedError", "InternalError", "UnavailableError",
]

log = logging.getLogger("andpush")

#: Where FCM lives; tests and gateways pass another ``endpoint``.
DEFAULT_ENDPOINT = "https://fcm.googleapis.com"
#: Seconds to wait for a TCP connection and TLS handshake.
DEFAULT_CONNECT_TIMEOUT = 10.0
#: Seconds to wait for each read of a response.
DEFAULT_READ_TIMEOUT = 30.0
#: Most connections open at once per client.
DEFAULT_POOL_SIZE = 10
#: Seconds a connection may sit idle before it is replaced rather than reused.
DEFAULT_KEEP_ALIVE_TIMEOUT = 60.0

_MAX_BODY = 4 * 1024 * 1024    # bytes of a response body we are willing to hold
_MAX_HEAD = 64 * 1024          # bytes of a status line plus headers
_RECV_SIZE = 64 * 1024
_USER_AGENT = "andpush/" + __version__


# Errors ######################################################################
# What can go wrong, as one tree of exceptions that carry what a caller needs.

class Error(Exception):
    """Base class of every error andpush raises on purpose.

    Every andpush error survives ``pickle`` and ``copy`` with its class, message and
    attributes (an HTTPError's ``response`` travels with it), so it can cross a process
    pool or be stored by a result backend.
    """

    def __reduce__(self) -> Tuple[Any, ...]:
        """Rebuild without calling ``__init__``, whose arguments are not kept in ``args``."""
        return _rebuild_error, (type(self), self.args, self.__dict__)


def _rebuild_error(cls: Type[Error], args: Tuple[Any, ...], state: Dict[str, Any]) -> Error:
    """The unpickled twin of an error: same class, args and attributes."""
    error = cls.__new__(cls, *args)
    error.args = args  # OSError.__new__ leaves args to an __init__ that is not called here
    error.__dict__.update(state)
    return error


class NetworkError(Error, OSError):
    """No complete answer: could not connect, TLS failed, timed out, or the connection broke.

    ``may_have_been_delivered`` is False only when the request provably never reached the
    server, so it is safe to send again; when True, sending again may deliver it twice.
    """

    def __init__(self, message: str, *, may_have_been_delivered: bool) -> None:
        super().__init__(message)
        self.may_have_been_delivered = may_have_been_delivered


class AuthError(Error):
    """Credentials could not be loaded, an access token could not be obtained, or FCM
    refused the sender's own credentials (UnauthenticatedError, PermissionDeniedError)."""


class HTTPError(Error):
    """The server answered with a status outside 2xx.

    Attributes:
        response: the Response, with the answer's ``headers`` and ``body``; plain data,
            pickled with the error.
        status_code: the HTTP status, e.g. 404.
        error_code: FCM's error code (e.g. ``"UNREGISTERED"``), else the v1 status
            (e.g. ``"NOT_FOUND"``), else None.
        retry_after: the seconds the server asked to wait (Retry-After), else None.
    """

    def __init__(self, response: "Response") -> None:
        self.response = response
        self.status_code = response.status_code
        self.error_code = _error_code(response)
        self.retry_after = _retry_after(response.headers.get("retry-after"))
        super().__init__(_describe(response, self.error_code))


class ClientError(HTTPError):
    """A 4xx answer: the request needs fixing; sending it again as is will not help."""


class ServerError(HTTPError):
    """A 5xx answer: the server failed; the request may succeed later."""


class InvalidArgumentError(ClientError):
    """INVALID_ARGUMENT (400): a bad token format, field, size or TTL. Fix the message."""


class UnregisteredError(ClientError):
    """UNREGISTERED (404): the token is no longer valid; delete it."""


class SenderIdMismatchError(ClientError):
    """SENDER_ID_MISMATCH (403): the token belongs to another Firebase project."""


class QuotaExceededError(ClientError):
    """QUOTA_EXCEEDED (429): a project, topic or device rate was exceeded; slow down."""


class ThirdPartyAuthError(ClientError):
    """THIRD_PARTY_AUTH_ERROR (401): the APNs certificate or web push key is invalid."""


class UnauthenticatedError(ClientError, AuthError):
    """UNAUTHENTICATED (401): FCM refused the sender's own credentials; also an AuthError.

    A v1 access token is refreshed and the push sent once more before this is raised.
    """


class PermissionDeniedError(ClientError, AuthError):
    """PERMISSION_DENIED (403): the credentials may not send for this project; also an AuthError.

    Grant the service account a role with cloudmessaging.messages.create and enable the
    Firebase Cloud Messaging API for the project.
    """


class InternalError(ServerError):
    """INTERNAL (500): an unknown server error; retry with backoff."""


class UnavailableError(ServerError):
    """UNAVAILABLE (503): the server is overloaded; retry with backoff."""


_ERRORS_BY_CODE = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "UNREGISTERED": UnregisteredError,
    "SENDER_ID_MISMATCH": SenderIdMismatchError,
    "QUOTA_EXCEEDED": QuotaExceededError,
    "THIRD_PARTY_AUTH_ERROR": ThirdPartyAuthError,
    "APNS_AUTH_ERROR": ThirdPartyAuthError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "INTERNAL": InternalError,
    "UNAVAILABLE": UnavailableError,
}

# A bare 404 is deliberately absent: a wrong project id answers 404 too.
_ERRORS_BY_STATUS = {
    400: InvalidArgumentError,
    429: QuotaExceededError,
    500: InternalError,
    503: UnavailableError,
}


_FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
# The google.rpc.Code names a v1 error's "status" may hold.
_CANONICAL_STATUSES = frozenset((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
    "UNAVAILABLE", "DATA_LOSS",
))


def _http_error(response: "Response") -> HTTPError:
    """Map a non-2xx response to the most specific exception class."""
    code = _error_code(response)
    cls = _ERRORS_BY_CODE.get(code or "") or _ERRORS_BY_STATUS.get(response.status_code)
    if cls is None:
        if 400 <= response.status_code < 500:
            cls = ClientError
        elif response.status_code >= 500:
            cls = ServerError
        else:
            cls = HTTPError
    return cls(response)


def _error_envelope(response: "Response") -> Dict[str, Any]:
    """The v1 ``{"error": {...}}`` object of a response, or {} when there is none."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _error_code(response: "Response") -> Optional[str]:
    """The FCM error code: the FcmError detail's ``errorCode``, else the v1 status.

    As firebase-admin does, a code counts only from a detail typed as an FcmError, and a
    status only when it is one of Google's canonical codes: a gateway's 404 carrying
    ``{"errorCode": "UNREGISTERED"}`` elsewhere must not make the caller delete the token.
    """
    envelope = _error_envelope(response)
    details = envelope.get("details")
    for detail in details if isinstance(details, list) else ():
        if isinstance(detail, dict) and detail.get("@type") == _FCM_ERROR_TYPE:
            code = detail.get("errorCode")
            if isinstance(code, str):
                return code
    status = envelope.get("status")
    return status if isinstance(status, str) and status in _CANONICAL_STATUSES else None


def _describe(response: "Response", error_code: Optional[str]) -> str:
    """A one-line message for an HTTPError: status, code and the server's explanation."""
    text = "HTTP %d %s" % (response.status_code, response.reason)
    if error_code:
        text += " (%s)" % error_code
    message = _error_envelope(response).get("message")
    if isinstance(message, str) and message:
        text += ": " + message[:300]
    return text


# RFC 9110 section 5.6.7: the three HTTP-date forms a recipient must accept.
_DAY_NAME = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_LONG_DAY_NAME = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = r"(?P<month>%s)" % "|".join(_MONTHS)
_CLOCK = r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
_HTTP_DATES = tuple(re.compile(pattern, re.ASCII) for pattern in (
    # IMF-fixdate: Sun, 06 Nov 1994 08:49:37 GMT
    r"%s, (?P<day>[0-9]{2}) %s (?P<year>[0-9]{4}) %s GMT\Z" % (_DAY_NAME, _MONTH, _CLOCK),
    # obsolete RFC 850: Sunday, 06-Nov-94 08:49:37 GMT
    r"%s, (?P<day>[0-9]{2})-%s-(?P<year>[0-9]{2}) %s GMT\Z" % (_LONG_DAY_NAME, _MONTH, _CLOCK),
    # asctime: Sun Nov  6 08:49:37 1994
    r"%s %s (?P<day>[ 0-9][0-9]) %s (?P<year>[0-9]{4})\Z" % (_DAY_NAME, _MONTH, _CLOCK),
))
_DELTA_SECONDS = re.compile(r"[0-9]+\Z", re.ASCII)
# RFC 9111 section 1.2.2: a delta-seconds too big to hold counts as 2^31.
_MAX_DELTA_SECONDS = 2 ** 31
_DAYS_BEFORE_MONTH = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)
_SECONDS_PER_DAY = 86400
_EPOCH_YEAR = 1970
# RFC 9110: a two-digit year more than 50 years ahead is taken as the latest past one.
_TWO_DIGIT_YEAR_HORIZON = 50


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds from a Retry-After header (delta-seconds or any HTTP-date form), or None.

    Only ASCII digits count as digits, and anything malformed is treated as absent, so
    no header value can raise. Dates are parsed here rather than with email.utils, which
    ignores the asctime form and costs milliseconds to import.
    """
    if not value:
        return None
    value = value.strip()
    if _DELTA_SECONDS.match(value):
        return float(min(float(value), _MAX_DELTA_SECONDS))
    when = _http_date(value)
    return None if when is None else max(0.0, when - time.time())


def _http_date(value: str) -> Optional[float]:
    """The Unix time an HTTP-date stands for, or None if it is not one or not a real date."""
    for form in _HTTP_DATES:
        match = form.match(value)
        if match:
            break
    else:
        return None
    year, day = int(match["year"]), int(match["day"])
    month = _MONTHS.index(match["month"]) + 1
    hour, minute, second = int(match["hour"]), int(match["minute"]), int(match["second"])
    if len(match["year"]) == 2:
        year = _full_year(year)
    if not (1 <= day <= _days_in_month(year, month) and hour < 24 and minute < 60
            and second < 61):  # 60: a leap second
        return None
    days = _days_since_epoch(year, month, day)
    return float(days * _SECONDS_PER_DAY + hour * 3600 + minute * 60 + second)


def _full_year(two_digits: int) -> int:
    """The year a two-digit RFC 850 year stands for, as RFC 9110 section 5.6.7 says."""
    this_year = time.gmtime().tm_year
    year = this_year - this_year % 100 + two_digits
    return year - 100 if year > this_year + _TWO_DIGIT_YEAR_HORIZON else year


def _is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def _days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if _is_leap(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _days_since_epoch(year: int, month: int, day: int) -> int:
    """Days from 1970-01-01 to a (proleptic Gregorian) date; negative before it."""
    def leap_days_through(y: int) -> int:
        return y // 4 - y // 100 + y // 400

    leap_days = leap_days_through(year - 1) - leap_days_through(_EPOCH_YEAR - 1)
    leap_day = 1 if month > 2 and _is_leap(year) else 0
    day_of_year = _DAYS_BEFORE_MONTH[month - 1] + leap_day + day - 1
    return (year - _EPOCH_YEAR) * 365 + leap_days + day_of_year


# Responses ###################################################################
# What a push returns: status, headers and body, with the JSON parsed on demand.

class Headers(Mapping[str, str]):
    """Response headers, looked up case-insensitively; repeated headers are joined by ", "."""

    __slots__ = ("_items",)

    def __init__(self, items: Dict[str, str]) -> None:
        self._items = items

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return "Headers(%r)" % (self._items,)

    def __reduce__(self) -> Tuple[Any, ...]:
        return Headers, (self._items,)


class Response:
    """A 2xx answer from FCM (error answers raise HTTPError and hang off it).

    Attributes:
        status_code: the HTTP status, e.g. 200.
        reason: the reason phrase, e.g. ``"OK"`` (over HTTP/2, the standard one for the status).
        headers: the Headers, looked up case-insensitively.
        body: the body, as bytes; ``text`` decodes it and ``json()`` parses it.

    ``ok`` is True for a 2xx status (requests counts 3xx too; andpush raises for those).
    """

    __slots__ = ("status_code", "reason", "headers", "body", "_json", "_tokens")

    def __init__(self, status_code: int, reason: str, headers: Headers, body: bytes) -> None:
        self.status_code = status_code
        self.reason = reason
        self.headers = headers
        self.body = body
        self._json: Any = _UNPARSED
        self._tokens: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True for a 2xx status: for every Response a push returns, never for an HTTPError's."""
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (what JSON must be), undecodable bytes replaced."""
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON, once; ValueError when the body is not JSON."""
        if self._json is _UNPARSED:
            try:
                self._json = json.loads(self.body)
            except ValueError:
                raise ValueError(
                    "the response body is not JSON (content-type %r); read .body instead"
                    % self.headers.get("content-type", "")
                ) from None
        return self._json

    @property
    def errors(self) -> Dict[str, str]:
        """Legacy API: each token whose result is an error, mapped to that error."""
        return {token: result["error"] for token, result in self._results() if "error" in result}

    @property
    def canonical_tokens(self) -> Dict[str, str]:
        """Legacy API: each token FCM replaced, mapped to the token to store instead."""
        return {
            token: result["registration_id"]
            for token, result in self._results() if "registration_id" in result
        }

    def _results(self) -> List[Tuple[str, Dict[str, str]]]:
        """Pairs of (request token, its legacy result), in request order."""
        answer = self.json()
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            return []
        return [(t, r) for t, r in zip(self._tokens, results) if isinstance(r, dict)]

    def __repr__(self) -> str:
        return "<Response [%d]>" % self.status_code

    def __getstate__(self) -> Dict[str, Any]:
        """Plain data for pickle and copy; the parsed JSON is left to be parsed again."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "_json"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._json = _UNPARSED


_UNPARSED = object()


# Credentials #################################################################
# OAuth2 access tokens for the v1 API: key files, RS256 in pure Python, caching.

#: The OAuth2 scope that FCM v1 requires.
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
_GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
_METADATA_HOST = "metadata.google.internal"
_JWT_LIFETIME = 3600           # seconds, the most Google accepts
_TOKEN_REFRESH_MARGIN = 300.0  # seconds before expiry at which a token is replaced
_TOKEN_RETRIES = 2             # extra attempts for a token endpoint answering 5xx/408/429
_TOKEN_BACKOFF = 0.5           # seconds before the first of those
_TOKEN_FAILURE_HOLD = 1.0      # seconds a failed token request answers for the next ones

# DER tags used by PKCS#1 / PKCS#8 private keys.
_DER_INTEGER = 0x02
_DER_OCTET_STRING = 0x04
_DER_NULL = 0x05
_DER_OBJECT_IDENTIFIER = 0x06
_DER_SEQUENCE = 0x30
_DER_CONTEXT_CLASS = 0x80  # [n] tagged optional fields, e.g. PKCS#8 attributes
_DER_MAX_LENGTH_BYTES = 3  # long-form lengths 0x81..0x83 (up to 16 MiB) suffice for keys

# rsaEncryption, 1.2.840.113549.1.1.1 (OBJECT IDENTIFIER content bytes).
_RSA_ENCRYPTION_OID = bytes.fromhex("2a864886f70d010101")
# Other key algorithms that may turn up in a PKCS#8 file, named in error messages.
_OTHER_KEY_ALGORITHMS = {
    bytes.fromhex("2a8648ce3d0201"): "an EC",
    bytes.fromhex("2b6570"): "an Ed25519",
    bytes.fromhex("2b6571"): "an Ed448",
    bytes.fromhex("2a864886f70d01010a"): "an RSASSA-PSS-only",
}
# DigestInfo prefix for SHA-256 (RFC 8017 section 9.2, note 1); the digest follows it.
_SHA256_DIGEST_INFO = bytes.fromhex("3031300d060960864801650304020105000420")
_SHA256_DIGEST_SIZE = 32
_MIN_RSA_BITS = 1024  # Google issues 2048-bit keys; anything smaller is broken or fake.

_PEM_BEGIN = "-----BEGIN "
_PEM_END = "-----END "
_PEM_DASHES = "-----"
_PKCS8_LABEL = "PRIVATE KEY"
_PKCS1_LABEL = "RSA PRIVATE KEY"
_FIX_HINT = "use the private_key value from the service account JSON file unchanged"
_CORRUPT_HINT = "check it was copied completely, or create a new service account key"
_WRONG_LABELS = {
    "ENCRYPTED PRIVATE KEY": "is an encrypted PKCS#8 key; export the service account key "
    "unencrypted (as Google issues it)",
    "EC PRIVATE KEY": "is an EC key, but service account keys are RSA; " + _FIX_HINT,
    "PUBLIC KEY": "is a public key, not a private key; " + _FIX_HINT,
    "RSA PUBLIC KEY": "is a public key, not a private key; " + _FIX_HINT,
    "CERTIFICATE": "is a certificate, not a private key; " + _FIX_HINT,
    "OPENSSH PRIVATE KEY": "is an OpenSSH key; convert it with "
    "'ssh-keygen -p -m PKCS8 -f FILE' or " + _FIX_HINT,
}


def _b64url(data: bytes) -> str:
    """Encode bytes as unpadded base64url, as JWS compact serialization requires."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _malformed(detail: str) -> ValueError:
    """Build the error for structurally broken key data (detail never holds key bytes)."""
    return ValueError(f"private_key is not a valid RSA private key ({detail}); {_CORRUPT_HINT}")


def _der_read(data: bytes, offset: int) -> Tuple[int, bytes, int]:
    """Read the DER element at offset; return (tag, value, offset just past it)."""
    if offset + 2 > len(data):
        raise _malformed("truncated DER element")
    tag, length = data[offset], data[offset + 1]
    offset += 2
    if length & 0x80:  # long form: the low bits count the length bytes that follow
        count = length & 0x7F
        if not 1 <= count <= _DER_MAX_LENGTH_BYTES:
            raise _malformed("unsupported DER length encoding")
        if offset + count > len(data):
            raise _malformed("truncated DER length")
        length = int.from_bytes(data[offset : offset + count], "big")
        offset += count
    end = offset + length
    if end > len(data):
        raise _malformed("truncated DER element")
    return tag, data[offset:end], end


def _der_elements(data: bytes) -> List[Tuple[int, bytes]]:
    """Split concatenated DER elements (such as a SEQUENCE body) into (tag, value) pairs."""
    elements = []
    offset = 0
    while offset < len(data):
        tag, value, offset = _der_read(data, offset)
        elements.append((tag, value))
    return elements


def _der_sequence_body(data: bytes, what: str) -> bytes:
    """Return the contents of the single SEQUENCE that must make up all of data."""
    tag, value, end = _der_read(data, 0)
    if tag != _DER_SEQUENCE:
        raise _malformed(f"{what} is not a DER SEQUENCE")
    if end != len(data):
        raise _malformed(f"{len(data) - end} bytes of trailing data after {what}")
    return value


def _der_integer(tag: int, value: bytes) -> int:
    """Decode a DER INTEGER that must be non-negative (all RSA key fields are)."""
    if tag != _DER_INTEGER or not value:
        raise _malformed("expected a DER INTEGER")
    if value[0] & 0x80:
        raise _malformed("unexpected negative INTEGER")
    return int.from_bytes(value, "big")


class _RSAPrivateKey:
    """An RSA private key with CRT parameters, plus precomputed signing constants."""

    __slots__ = ("d", "dp", "dq", "e", "em_prefix", "n", "p", "q", "qinv", "size")

    def __init__(self, n: int, e: int, d: int, p: int, q: int, dp: int, dq: int, qinv: int):
        """Store the key numbers and precompute the fixed part of every encoded message."""
        self.n, self.e, self.d = n, e, d
        self.p, self.q, self.dp, self.dq, self.qinv = p, q, dp, dq, qinv
        self.size = (n.bit_length() + 7) // 8  # k in RFC 8017: modulus length in bytes
        padding = self.size - len(_SHA256_DIGEST_INFO) - _SHA256_DIGEST_SIZE - 3
        # EM = 00 01 FF..FF 00 DigestInfo digest; all but the digest is fixed per key.
        self.em_prefix = b"\x00\x01" + b"\xff" * padding + b"\x00" + _SHA256_DIGEST_INFO

    def __repr__(self) -> str:
        """Describe the key by size only, so logs and tracebacks never leak key material."""
        return f"<RSA private key, {self.n.bit_length()} bits>"


def _check_rsa_key(key: _RSAPrivateKey) -> None:
    """Reject keys whose numbers are inconsistent, since CRT signing would emit bad signatures."""
    if key.n.bit_length() < _MIN_RSA_BITS:
        raise ValueError(
            f"private_key is a {key.n.bit_length()}-bit RSA key, but at least {_MIN_RSA_BITS} "
            f"bits are required; {_FIX_HINT}"
        )
    if key.e < 3 or key.e % 2 == 0 or min(key.p, key.q, key.d) < 2:
        raise _malformed("public or private exponent out of range")
    if key.p * key.q != key.n:
        raise _malformed("p*q != n")
    if key.dp != key.d % (key.p - 1) or key.dq != key.d % (key.q - 1):
        raise _malformed("CRT exponents do not match d")
    if (key.e * key.dp) % (key.p - 1) != 1 or (key.e * key.dq) % (key.q - 1) != 1:
        raise _malformed("private exponent does not match e")
    if (key.qinv * key.q) % key.p != 1:
        raise _malformed("CRT coefficient is not q^-1 mod p")


def _parse_pkcs1(der: bytes) -> _RSAPrivateKey:
    """Parse RSAPrivateKey ::= SEQUENCE {0, n, e, d, p, q, dP, dQ, qInv} (RFC 8017 A.1.2)."""
    elements = _der_elements(_der_sequence_body(der, "RSAPrivateKey"))
    if not elements or _der_integer(*elements[0]) != 0:
        raise _malformed("unsupported RSAPrivateKey version; multi-prime keys are unsupported")
    if len(elements) != 9:
        raise _malformed(f"RSAPrivateKey has {len(elements)} fields instead of 9")
    n, e, d, p, q, dp, dq, qinv = (_der_integer(tag, value) for tag, value in elements[1:])
    return _RSAPrivateKey(n, e, d, p, q, dp, dq, qinv)


def _check_rsa_algorithm(algorithm: bytes) -> None:
    """Require AlgorithmIdentifier {rsaEncryption, NULL}; name the algorithm otherwise."""
    fields = _der_elements(algorithm)
    if not fields or fields[0][0] != _DER_OBJECT_IDENTIFIER:
        raise _malformed("PrivateKeyInfo has no algorithm OBJECT IDENTIFIER")
    oid = fields[0][1]
    if oid != _RSA_ENCRYPTION_OID:
        kind = _OTHER_KEY_ALGORITHMS.get(oid, "a non-RSA")
        raise ValueError(
            f"private_key is {kind} key, but service account keys are RSA; {_FIX_HINT}"
        )
    if fields[1:] not in ([], [(_DER_NULL, b"")]):
        raise _malformed("unexpected rsaEncryption parameters")


def _parse_pkcs8(der: bytes) -> _RSAPrivateKey:
    """Parse PrivateKeyInfo ::= SEQUENCE {version, AlgorithmIdentifier, OCTET STRING key, ...}."""
    elements = _der_elements(_der_sequence_body(der, "PrivateKeyInfo"))
    if len(elements) < 3:
        raise _malformed("PrivateKeyInfo is missing fields")
    (version_tag, version), (algorithm_tag, algorithm), (key_tag, key) = elements[:3]
    if _der_integer(version_tag, version) not in (0, 1):  # 1 = OneAsymmetricKey (RFC 5958)
        raise _malformed("unsupported PrivateKeyInfo version")
    if algorithm_tag != _DER_SEQUENCE:
        raise _malformed("PrivateKeyInfo algorithm is not a SEQUENCE")
    _check_rsa_algorithm(algorithm)
    if key_tag != _DER_OCTET_STRING:
        raise _malformed("PrivateKeyInfo privateKey is not an OCTET STRING")
    if any(tag & 0xC0 != _DER_CONTEXT_CLASS for tag, _ in elements[3:]):
        raise _malformed("unexpected fields after PrivateKeyInfo privateKey")
    return _parse_pkcs1(key)


def _pem_decode(pem: str) -> Tuple[str, bytes]:
    """Split one PEM block into its label and DER bytes, explaining any problem found.

    Text before the BEGIN line and after the END line is skipped: RFC 7468 section 2 allows
    explanatory text outside the encapsulation boundaries. A second block is refused, so a
    certificate bundled with the key is not silently taken or left.
    """
    lines = [line.strip() for line in pem.splitlines()]
    begins = [index for index, line in enumerate(lines) if line.startswith(_PEM_BEGIN)]
    first = lines[begins[0]] if begins else ""
    if not first.endswith(_PEM_DASHES):
        hint = " (it has literal '\\n' sequences: decode the JSON string)" if "\\n" in pem else ""
        raise ValueError(f"private_key is not a PEM private key{hint}; {_FIX_HINT}")
    label = first[len(_PEM_BEGIN) : -len(_PEM_DASHES)]
    if label in _WRONG_LABELS:
        raise ValueError(f"private_key {_WRONG_LABELS[label]}")
    if label not in (_PKCS8_LABEL, _PKCS1_LABEL):
        raise ValueError(f"private_key has unsupported PEM type {label[:40]!r}; {_FIX_HINT}")
    if len(begins) > 1:
        raise ValueError("private_key holds more than one PEM block; pass only the private key")
    end_line = f"{_PEM_END}{label}{_PEM_DASHES}"
    rest = lines[begins[0] + 1 :]
    end = next((i for i, line in enumerate(rest) if line.startswith(_PEM_DASHES)), None)
    if end is None or rest[end] != end_line:
        raise ValueError(f"private_key has no '{end_line}' line; {_FIX_HINT}")
    body = rest[:end]
    if any(line.startswith("Proc-Type:") for line in body):
        raise ValueError(
            "private_key is an encrypted PEM key; export the service account key unencrypted "
            "(as Google issues it)"
        )
    try:
        return label, base64.b64decode("".join(body), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"private_key PEM body is not valid base64; {_CORRUPT_HINT}") from None


def _parse_private_key(pem: str) -> _RSAPrivateKey:
    """Parse a PKCS#8 or PKCS#1 PEM RSA private key and check that its numbers agree."""
    if not isinstance(pem, str):
        raise TypeError(f"private_key must be a PEM string, not {type(pem).__name__}")
    label, der = _pem_decode(pem)
    key = _parse_pkcs8(der) if label == _PKCS8_LABEL else _parse_pkcs1(der)
    _check_rsa_key(key)
    return key


def _rs256_sign(key: _RSAPrivateKey, message: bytes) -> bytes:
    """Sign with RSASSA-PKCS1-v1_5 over SHA-256 (JWS RS256), using the CRT for speed."""
    m = int.from_bytes(key.em_prefix + hashlib.sha256(message).digest(), "big")
    s1 = pow(m, key.dp, key.p)
    s2 = pow(m, key.dq, key.q)
    h = (key.qinv * (s1 - s2)) % key.p
    return (s2 + key.q * h).to_bytes(key.size, "big")


def _jwt(header: Dict[str, Any], claims: Dict[str, Any], key: _RSAPrivateKey) -> str:
    """Build a compact RS256-signed JWT, e.g. an OAuth2 service-account assertion."""
    parts = (json.dumps(part, separators=(",", ":")).encode("utf-8") for part in (header, claims))
    signing_input = ".".join(_b64url(part) for part in parts)
    return signing_input + "." + _b64url(_rs256_sign(key, signing_input.encode("ascii")))

class _Credentials:
    """A source of access tokens, with the project id it knows of (if any)."""

    project_id: Optional[str] = None
    refreshable = True

    def fetch(self) -> Tuple[str, Optional[float]]:
        """A new access token and its lifetime in seconds (None: unknown)."""
        raise NotImplementedError

    def find_project_id(self) -> Optional[str]:
        return self.project_id

    def close(self) -> None:
        """Release the connections used to fetch tokens."""

    def __repr__(self) -> str:
        return "<%s project_id=%r>" % (type(self).__name__, self.project_id)


class _TokenGrant(_Credentials):
    """Credentials that trade a form POST to an OAuth2 token endpoint for a token."""

    def __init__(self, token_uri: str, connect: "_Connector") -> None:
        origin, self._token_path = _split_url(token_uri, "token_uri")
        self._transport = connect(origin)

    def fetch(self) -> Tuple[str, Optional[float]]:
        body = urllib.parse.urlencode(self._grant()).encode("ascii")
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        answer = _request_token(self._transport, "POST", self._token_path, headers, body)
        return _token_from(answer, "the token endpoint")

    def _grant(self) -> Dict[str, str]:
        raise NotImplementedError

    def close(self) -> None:
        self._transport.close()


class _ServiceAccount(_TokenGrant):
    """A service account key file: sign a JWT with its private key (RFC 7523 grant)."""

    def __init__(self, info: Dict[str, Any], connect: "_Connector") -> None:
        self._email = _field(info, "client_email")
        self._key_id = info.get("private_key_id")
        try:
            self._key = _parse_private_key(_field(info, "private_key"))
        except ValueError as exc:
            raise AuthError("service account key: %s" % exc) from None
        self._token_uri = str(info.get("token_uri") or _GOOGLE_TOKEN_URI)
        self.project_id = info.get("project_id") or None
        super().__init__(self._token_uri, connect)

    def _grant(self) -> Dict[str, str]:
        return {
            "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
            "assertion": self.assertion(int(time.time())),
        }

    def assertion(self, now: int) -> str:
        """The signed JWT that asks for an FCM access token."""
        header = {"alg": "RS256", "typ": "JWT"}
        if self._key_id:  # left out when the key file has none, as google-auth does
            header["kid"] = str(self._key_id)
        claims = {
            "iss": self._email, "scope": FCM_SCOPE, "aud": self._token_uri,
            "iat": now, "exp": now + _JWT_LIFETIME,
        }
        return _jwt(header, claims, self._key)


class _AuthorizedUser(_TokenGrant):
    """gcloud's user credentials: trade the refresh token for an access token."""

    def __init__(self, info: Dict[str, Any], connect: "_Connector") -> None:
        self._grant_fields = {
            "grant_type": "refresh_token",
            "client_id": _field(info, "client_id"),
            "client_secret": _field(info, "client_secret"),
            "refresh_token": _field(info, "refresh_token"),
        }
        self.project_id = info.get("quota_project_id") or None
        super().__init__(str(info.get("token_uri") or _GOOGLE_TOKEN_URI), connect)

    def _grant(self) -> Dict[str, str]:
        return self._grant_fields


class _MetadataServer(_Credentials):
    """The metadata server of GCE, Cloud Run and GKE: the attached service account's token."""

    _HEADERS = {"Metadata-Flavor": "Google"}
    _TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
    _PROJECT_PATH = "/computeMetadata/v1/project/project-id"

    def __init__(self, host: str, tried: List[str], connect: "_Connector") -> None:
        self._tried = tried + ["the metadata server at %s" % host]
        self._transport = connect("http://" + host)

    def fetch(self) -> Tuple[str, Optional[float]]:
        return _token_from(self._get(self._TOKEN_PATH), "the metadata server")

    def find_project_id(self) -> Optional[str]:
        if self.project_id is None:
            body = self._get(self._PROJECT_PATH).body
            try:
                self.project_id = body.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise AuthError(
                    "the metadata server sent a project id that is not UTF-8 text; "
                    "pass project_id= or set GOOGLE_CLOUD_PROJECT"
                ) from None
        return self.project_id

    def _get(self, path: str) -> Response:
        try:
            return _request_token(self._transport, "GET", path, self._HEADERS, b"")
        except NetworkError as exc:
            raise AuthError(
                "no Google credentials found; tried %s (%s). Pass credentials= or set "
                "GOOGLE_APPLICATION_CREDENTIALS to a service account key file"
                % (", ".join(self._tried), exc)
            ) from None

    def close(self) -> None:
        self._transport.close()


class _StaticToken(_Credentials):
    """An access token obtained elsewhere: a fixed string, or a callable asked each time."""

    def __init__(self, token: Union[str, Callable[[], str]], project_id: str) -> None:
        self._token = token
        self.project_id = project_id
        self.refreshable = callable(token)

    def fetch(self) -> Tuple[str, Optional[float]]:
        token = self._token() if callable(self._token) else self._token
        if not isinstance(token, str) or not _is_header_token(token):
            raise AuthError(
                "access_token must be a non-empty str of visible ASCII characters "
                "(no spaces, line breaks or control characters)"
            )
        return token, 0.0 if callable(self._token) else None


# What may follow "Bearer " in a header: visible ASCII, as in RFC 6750's b64token and wider.
_HEADER_TOKEN = re.compile(r"[\x21-\x7e]+\Z")


def _is_header_token(token: str) -> bool:
    """Whether an access token can go into an Authorization header as it is."""
    return _HEADER_TOKEN.match(token) is not None


def _field(info: Dict[str, Any], name: str) -> str:
    value = info.get(name)
    if not isinstance(value, str) or not value:
        raise AuthError("credentials have no %r; use the JSON key file as downloaded" % name)
    return value


def _request_token(
    transport: "_Transport", method: str, path: str, headers: Dict[str, str], body: bytes
) -> Response:
    """Ask a token endpoint, retrying briefly what may succeed later (it is idempotent)."""
    retry = _Retry(_TOKEN_RETRIES, _TOKEN_BACKOFF, idempotent=True, may_refresh=False)
    while True:
        try:
            response = transport.request(method, path, headers, body)
            if 200 <= response.status_code < 300:
                return response
            error: Error = _http_error(response)
        except NetworkError as exc:
            error = exc
        step = retry.after(error)
        if step is None:
            raise _auth_error(error) from None
        retry, wait = step
        time.sleep(wait)


def _auth_error(error: Error) -> Error:
    """The AuthError for a failed token request, in the token endpoint's own words."""
    if not isinstance(error, HTTPError):
        return error
    try:
        answer = error.response.json()
        reason = "%s: %s" % (answer["error"], answer.get("error_description", ""))
    except (ValueError, KeyError, TypeError):
        reason = "HTTP %d %s" % (error.status_code, error.response.reason)
    if "invalid_grant" in reason and ("iat" in reason or "exp" in reason or "JWT" in reason):
        reason += " (is this machine's clock right?)"
    return AuthError("the token request failed: " + reason.strip().rstrip(":"))


def _token_from(response: Response, source: str) -> Tuple[str, Optional[float]]:
    """The access token and lifetime of a token endpoint's (or metadata server's) 200 answer.

    The token is checked like one passed in by hand, since it goes into every request's
    head; the error says what is wrong with it but never shows it.
    """
    try:
        answer = response.json()
        token, lifetime = answer["access_token"], answer.get("expires_in")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise AuthError("%s answered without an access_token" % source) from None
    if not isinstance(token, str) or not token:
        raise AuthError("%s answered without an access_token" % source)
    if not _is_header_token(token):
        raise AuthError(
            "%s sent an unusable access token (it holds a space, line break, control or "
            "non-ASCII character, so it cannot go in a header); check the endpoint is "
            "Google's or ask its operator" % source
        )
    return token, float(lifetime) if isinstance(lifetime, (int, float)) else None


class _TokenCache:
    """The current access token, refreshed shortly before it expires.

    However many threads find it stale at once, one of them fetches (single flight);
    the others wait and share its token or its error. A failure is given to every caller
    for a second before the next try, so that a push_many over broken credentials does
    not ask the token endpoint once per message.
    """

    def __init__(self, credentials: _Credentials) -> None:
        self.credentials = credentials
        self._lock = threading.Lock()
        self._token: Optional[str] = None
        self._expires = 0.0
        self._generation = 0
        self._error: Optional[Error] = None
        self._error_until = 0.0

    def get(self) -> str:
        token = self._token
        if token is not None and time.monotonic() < self._expires:
            return token
        generation = self._generation
        with self._lock:
            fresh = self._generation != generation or time.monotonic() < self._error_until
            if fresh and self._error is not None:
                raise self._error
            if self._generation != generation and self._token is not None:
                return self._token
            return self._refresh()

    def invalidate(self, token: str) -> None:
        """Forget ``token`` (the server rejected it) unless it was replaced already."""
        with self._lock:
            if self._token == token:
                self._token = None

    def _refresh(self) -> str:
        try:
            token, lifetime = self.credentials.fetch()
        except Error as exc:
            self._token, self._error = None, exc
            self._error_until = time.monotonic() + _TOKEN_FAILURE_HOLD
            raise
        finally:
            self._generation += 1
        self._error = None
        self._token = token
        self._expires = (
            math.inf if lifetime is None
            else time.monotonic() + max(0.0, lifetime - _TOKEN_REFRESH_MARGIN)
        )
        log.debug("got a new access token (lifetime %s s)", lifetime)
        return token


def _load_credentials(source: object, connect: "_Connector") -> _Credentials:
    """Credentials from a key file path, a dict, or a JSON string."""
    if isinstance(source, dict):
        info = source
    elif isinstance(source, (str, os.PathLike)):
        info = _read_json_credentials(source)
    else:
        raise TypeError(
            "credentials must be a path, a dict or a JSON string, got %s" % type(source).__name__
        )
    kind = info.get("type")
    if kind == "service_account":
        return _ServiceAccount(info, connect)
    if kind == "authorized_user":
        return _AuthorizedUser(info, connect)
    raise AuthError(
        "credentials of type %r are not supported; use a service account key file "
        "or gcloud's application default credentials" % (kind,)
    )


def _read_json_credentials(source: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    text = str(source)
    what = "credentials"
    if text.lstrip()[:1] not in ("{", "["):
        what = "credentials file %r" % text
        try:
            with open(source, encoding="utf-8") as file:
                text = file.read()
        except OSError as exc:
            raise AuthError("cannot read %s: %s" % (what, exc.strerror or exc)) from None
    try:
        info = json.loads(text)
    except ValueError:
        raise AuthError("%s is not JSON; use the key file as downloaded" % what) from None
    if not isinstance(info, dict):
        raise AuthError("%s is not a JSON object; use the key file as downloaded" % what)
    return info


def _application_default_credentials(connect: "_Connector") -> _Credentials:
    """Application Default Credentials, looked up in the order Google's libraries use."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path:
        return _load_credentials(path, connect)
    tried = ["GOOGLE_APPLICATION_CREDENTIALS (not set)"]
    gcloud = os.path.join(_gcloud_config_dir(), "application_default_credentials.json")
    if os.path.exists(gcloud):
        return _load_credentials(gcloud, connect)
    tried.append("%s (not found)" % gcloud)
    host = os.environ.get("GCE_METADATA_HOST") or _METADATA_HOST
    return _MetadataServer(host, tried, connect)


def _gcloud_config_dir() -> str:
    configured = os.environ.get("CLOUDSDK_CONFIG")
    if configured:
        return configured
    if os.name == "nt":
        return os.path.join(os.environ.get("APPDATA", ""), "gcloud")
    return os.path.join(os.path.expanduser("~"), ".config", "gcloud")


# Retries #####################################################################
# Whether a failed request is sent again, and after how long: decided here only.

#: Retries after a failed send, by default.
DEFAULT_MAX_RETRIES = 3
#: Seconds before the first retry; each later wait doubles, with random jitter.
DEFAULT_BACKOFF_FACTOR = 0.5
_MAX_RETRY_WAIT = 120.0  # seconds; a longer wait (Retry-After) ends the retries instead
_QUOTA_WAIT = 60.0       # seconds a 429 waits at least when it gives no Retry-After


class _Retry:
    """What is left of one request's retries: a value, replaced by the next at each attempt.

    Retried: network failures that provably never reached the server, 500, 503 and 429
    (any network failure, 5xx and 408 when the request is ``idempotent``), and a rejected
    access token once. A request's waits add up to at most ``retries * _MAX_RETRY_WAIT``.
    """

    __slots__ = ("retries", "backoff_factor", "idempotent", "attempt", "may_refresh")

    def __init__(
        self,
        retries: int,
        backoff_factor: float,
        *,
        idempotent: bool = False,
        attempt: int = 0,
        may_refresh: bool = True,
    ) -> None:
        self.retries = retries
        self.backoff_factor = backoff_factor
        self.idempotent = idempotent
        self.attempt = attempt
        self.may_refresh = may_refresh

    def after(self, error: Error) -> Optional[Tuple["_Retry", float]]:
        """The retry state and wait (seconds) for another attempt, or None to give up."""
        if self.may_refresh and _is_rejected_token(error):
            return self._next(retries=self.retries, may_refresh=False), 0.0
        if self.retries <= 0 or not self._retryable(error):
            return None
        wait = self.backoff_factor * 2 ** self.attempt * (0.5 + random.random())
        if isinstance(error, QuotaExceededError):
            wait = max(wait, _quota_wait(error))
        elif isinstance(error, HTTPError) and error.retry_after is not None:
            wait = max(wait, error.retry_after)
        if wait > _MAX_RETRY_WAIT:
            return None
        return self._next(retries=self.retries - 1, may_refresh=self.may_refresh), wait

    def _retryable(self, error: Error) -> bool:
        if isinstance(error, NetworkError):
            return self.idempotent or not error.may_have_been_delivered
        if self.idempotent and isinstance(error, HTTPError):
            return error.status_code in (408, 429) or error.status_code >= 500
        return isinstance(error, (UnavailableError, InternalError, QuotaExceededError))

    def _next(self, retries: int, may_refresh: bool) -> "_Retry":
        return _Retry(
            retries, self.backoff_factor, idempotent=self.idempotent,
            attempt=self.attempt + 1, may_refresh=may_refresh,
        )


def _quota_wait(error: QuotaExceededError) -> float:
    """How long a 429 stops all sending: its Retry-After, else a minute as Google asks."""
    return error.retry_after if error.retry_after is not None else _QUOTA_WAIT


def _is_rejected_token(error: Error) -> bool:
    """A 401 that blames the access token itself, not APNs or web push credentials."""
    return (
        isinstance(error, ClientError)
        and error.status_code == 401
        and not isinstance(error, ThirdPartyAuthError)
    )



# Transport ###################################################################
# Kept-alive connections to one origin: connect, send in one write, read, pool.

class _NoAnswer(Exception):
    """The request could not be written, or the connection was closed or reset before
    the first byte of an answer: what a connection the server had closed looks like."""

    def __init__(self, reason: object, *, sent: bool) -> None:
        super().__init__(reason)
        self.sent = sent


class _StaleConnection(Exception):
    """A reused connection had been closed by the server: the request was not processed."""


_CLOSED_BEFORE_ANSWER = (ConnectionResetError, ConnectionAbortedError, ssl.SSLEOFError)


class _ProtocolError(Exception):
    """The server's answer broke HTTP/1.1, or exceeded a limit."""


def _split_url(url: str, what: str) -> Tuple[str, str]:
    """The origin (``scheme://host:port``) and the path of an http(s) URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.username:
        raise ValueError("%s must look like https://host[:port][/path], got %r" % (what, url))
    path = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    return "%s://%s" % (parts.scheme, parts.netloc), path


class _Origin:
    """Where requests go: scheme, host and port, and the proxy (if any) to tunnel through."""

    __slots__ = ("scheme", "host", "port", "proxy")

    def __init__(self, url: str, proxy: Optional[str]) -> None:
        origin, path = _split_url(url, "endpoint")
        if path != "/":
            raise ValueError(
                "endpoint takes only scheme, host and port (the paths are FCM's), got %r" % url
            )
        parts = urllib.parse.urlsplit(origin)
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.proxy = _parse_proxy(proxy) if proxy else None

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = "[%s]" % self.host if ":" in self.host else self.host
        return host if self.port == default else "%s:%d" % (host, self.port)

    def __repr__(self) -> str:
        return "%s://%s" % (self.scheme, self.host_header)


_PROXY_VARIABLES = ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")  # curl's order


def _parse_proxy(url: str, source: str = "proxy") -> Tuple[str, int, Dict[str, str]]:
    """Host, port and CONNECT headers of an ``http://[user:pass@]host:port`` proxy URL.

    ``source`` names where the URL came from (the argument, or an environment variable),
    so that the ValueError for a proxy andpush cannot use says what to change. The URL
    itself is never quoted: it may hold a password.
    """
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme != "http" or not parts.hostname:
        raise _unusable_proxy(parts, source)
    headers = {}
    if parts.username is not None:
        credentials = "%s:%s" % (
            urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
        )
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
    return parts.hostname, parts.port or 8080, headers


def _unusable_proxy(parts: urllib.parse.SplitResult, source: str) -> ValueError:
    """The ValueError for a proxy URL that is not ``http://host[:port]``, saying what to do."""
    if parts.scheme != "http":
        problem = "is a %s:// proxy; andpush tunnels only through http:// ones" % parts.scheme
    else:
        problem = "has no host"
    if source == "proxy":
        return ValueError("proxy must look like http://[user:pass@]host:port: it " + problem)
    return ValueError(
        "%s %s: set it to http://[user:pass@]host:port, or have andpush connect directly "
        "with NO_PROXY or andpush.new(..., proxy=\"\")" % (source, problem)
    )


def _proxy_from_environment(host: str) -> Optional[str]:
    """The proxy the environment selects for HTTPS to ``host``, as curl and requests read it.

    HTTPS_PROXY, else ALL_PROXY (the lower-case spelling first), unless NO_PROXY names the
    host or one of its parent domains (``*`` for all). A proxy andpush cannot use is a
    ValueError naming its variable.
    """
    source = next((name for name in _PROXY_VARIABLES if os.environ.get(name)), None)
    if source is None:
        return None
    no_proxy = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        entry = entry.split(":")[0].lstrip(".") if not entry.startswith("[") else entry
        if entry == "*" or entry and (host == entry or host.endswith("." + entry)):
            return None
    proxy = os.environ[source]
    _parse_proxy(proxy, source)
    return proxy


class _Connection:
    """One kept-alive HTTP/1.1 connection: a request in one write, a response parsed by hand."""

    __slots__ = ("_sock", "_host", "_buffer", "_poll", "pid", "idle_since", "reused")

    def __init__(self, sock: socket.socket, origin: "_Origin") -> None:
        self._sock = sock
        self._host = origin.host_header
        self._buffer = bytearray()
        self._poll = select.poll() if hasattr(select, "poll") else None  # not on Windows
        if self._poll is not None:
            self._poll.register(sock, select.POLLIN)
        self.pid = os.getpid()
        self.idle_since = 0.0
        self.reused = False

    def exchange(self, method: str, path: str, headers: Dict[str, str],
                 body: bytes) -> Tuple[Response, bool]:
        """Send one request and read its response; also say whether the connection stays open.

        Raises _NoAnswer when the request could not be written or the connection was
        closed or reset before any byte of the answer, OSError for other I/O failures,
        and _ProtocolError for a malformed answer.
        """
        try:
            self._sock.sendall(self._encode(method, path, headers, body))
        except OSError as exc:
            raise _NoAnswer(exc, sent=False) from exc
        try:
            self._fill()
        except _CLOSED_BEFORE_ANSWER as exc:
            raise _NoAnswer(exc, sent=True) from exc
        return self._read_response()

    def _encode(self, method: str, path: str, headers: Dict[str, str], body: bytes) -> bytes:
        lines = [
            "%s %s HTTP/1.1" % (method, path),
            "Host: " + self._host,
            "User-Agent: " + _USER_AGENT,
            "Content-Length: %d" % len(body),
        ]
        lines.extend("%s: %s" % item for item in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def is_alive(self) -> bool:
        """Tell, without blocking, whether the server closed this idle connection.

        A readable socket is not a dead one: TLS 1.3 session tickets arrive after the
        handshake. Only EOF, close_notify, an error, or stray bytes count as dead.
        """
        if self._buffer:
            return False
        if not self._readable():
            return True
        timeout = self._sock.gettimeout()
        self._sock.setblocking(False)
        try:
            self._sock.recv(1)
        except (ssl.SSLWantReadError, BlockingIOError):
            return True
        except OSError:
            return False
        finally:
            self._sock.settimeout(timeout)
        return False

    def _readable(self) -> bool:
        """Whether bytes, EOF or an error wait on the socket (TLS-decrypted ones too)."""
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True
        if self._poll is None:
            return bool(select.select([self._sock], [], [], 0)[0])
        return bool(self._poll.poll(0))

    def close(self) -> None:
        self._sock.close()

    def _fill(self) -> None:
        """Append what the socket has to the buffer; EOF is an error here."""
        chunk = self._sock.recv(_RECV_SIZE)
        if not chunk:
            if self._buffer:
                raise _ProtocolError("the server closed the connection mid-response")
            raise _NoAnswer("the server closed the connection without answering", sent=True)
        self._buffer += chunk

    def _read_response(self) -> Tuple[Response, bool]:
        lines = self._read_until(b"\r\n\r\n", "the response head").decode("latin-1").split("\r\n")
        version, status, reason = _parse_status_line(lines[0])
        headers = Headers(_parse_header_lines(lines[1:]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._read_chunked()
            keep = True
        elif "content-length" in headers:
            body = self._read_exact(_content_length(headers["content-length"]))
            keep = True
        elif status in (204, 304) or 100 <= status < 200:
            body, keep = b"", True
        else:
            body, keep = self._read_to_eof(), False
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.0":
            keep = keep and "keep-alive" in connection
        keep = keep and "close" not in connection and not self._buffer
        return Response(status, reason, headers, body), keep

    def _fill_answer(self) -> None:
        """_fill, where EOF in the middle of an answer is a protocol error."""
        try:
            self._fill()
        except _NoAnswer:
            raise _ProtocolError("the server closed the connection mid-response") from None

    def _read_exact(self, size: int) -> bytes:
        if size > _MAX_BODY:
            raise _ProtocolError("response body of %d bytes exceeds %d" % (size, _MAX_BODY))
        while len(self._buffer) < size:
            self._fill_answer()
        body = bytes(self._buffer[:size])
        del self._buffer[:size]
        return body

    def _read_until(self, separator: bytes, what: str) -> bytes:
        """The bytes before ``separator``, which is consumed too; at most _MAX_HEAD of them."""
        end = self._buffer.find(separator)
        while end < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise _ProtocolError("%s exceeds %d bytes" % (what, _MAX_HEAD))
            self._fill_answer()
            end = self._buffer.find(separator)
        data = bytes(self._buffer[:end])
        del self._buffer[:end + len(separator)]
        return data

    def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_text = self._read_until(b"\r\n", "a chunk line").split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _ProtocolError("bad chunk size %r" % size_text[:20]) from None
            if size == 0:
                break
            if len(body) + size > _MAX_BODY:
                raise _ProtocolError("chunked response body exceeds %d bytes" % _MAX_BODY)
            body += self._read_exact(size)
            if self._read_until(b"\r\n", "a chunk line"):
                raise _ProtocolError("chunk data not followed by CRLF")
        while self._read_until(b"\r\n", "a chunk line"):
            pass  # trailers carry nothing FCM uses
        return bytes(body)

    def _read_to_eof(self) -> bytes:
        while True:
            if len(self._buffer) > _MAX_BODY:
                raise _ProtocolError("response body exceeds %d bytes" % _MAX_BODY)
            chunk = self._sock.recv(_RECV_SIZE)
            if not chunk:
                break
            self._buffer += chunk
        body = bytes(self._buffer)
        self._buffer.clear()
        return body


def _parse_status_line(line: str) -> Tuple[str, int, str]:
    version, _, rest = line.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise _ProtocolError("malformed status line %r" % line[:40])
    return version, int(code), reason.strip()


def _parse_header_lines(lines: List[str]) -> Dict[str, str]:
    headers: Dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise _ProtocolError("malformed header line %r" % line[:40])
        name = name.lower()
        value = value.strip()
        headers[name] = headers[name] + ", " + value if name in headers else value
    return headers


def _content_length(value: str) -> int:
    if not value.isdigit():
        raise _ProtocolError("bad Content-Length %r" % value[:20])
    return int(value)


class _Pool:
    """Idle connections to one origin, most recently used first, at most ``size`` open.

    The pool only opens, hands out, takes back and discards connections; what to do
    when a request fails is the transport's business.
    """

    def __init__(
        self,
        connect: Callable[[], "_AnyConnection"],
        size: int,
        keep_alive_timeout: float,
    ) -> None:
        self._connect = connect
        self._size = size
        self._keep_alive_timeout = keep_alive_timeout
        self._reset()

    def _reset(self) -> None:
        """Start empty: at creation, and in a child process that inherited the pool."""
        self._pid = os.getpid()
        self._condition = threading.Condition(threading.Lock())
        self._idle: List["_AnyConnection"] = []
        self._open = 0
        self._closed = False

    def get(self) -> "_AnyConnection":
        """The most recently used live idle connection, else a new one."""
        while True:
            connection = self._acquire(reuse=True)
            if connection is None:
                return self._open_in_slot()
            if time.monotonic() - connection.idle_since < self._keep_alive_timeout and (
                connection.is_alive()
            ):
                connection.reused = True
                return connection
            log.debug("replacing a connection that was idle too long or closed by the server")
            self.discard(connection)

    def new(self) -> "_AnyConnection":
        """A new connection, never a reused one."""
        self._acquire(reuse=False)
        return self._open_in_slot()

    def _acquire(self, reuse: bool) -> Optional["_AnyConnection"]:
        """Wait for an idle connection (when ``reuse``) or a free slot, whichever comes.

        Returns the idle connection, or None after counting a new one as open.
        """
        if self._pid != os.getpid():
            log.debug("process forked: closing this process's copies of the parent's sockets")
            for connection in self._idle:
                connection.close()  # only the fd: nothing is sent, the parent's stays open
            self._reset()
        with self._condition:
            while True:
                if self._closed:
                    raise ValueError("the client is closed; create a new one")
                if reuse and self._idle:
                    return self._idle.pop()
                if self._open < self._size:
                    self._open += 1
                    return None
                if not reuse and self._idle:
                    self._idle.pop(0).close()
                    self._open -= 1
                    continue
                self._condition.wait()

    def _open_in_slot(self) -> "_AnyConnection":
        try:
            return self._connect()
        except BaseException:
            self._release()
            raise

    def widen(self, connections: int) -> None:
        """Change how many connections may be open at once; extra idle ones are closed."""
        with self._condition:
            self._size += connections
            surplus = self._idle[:max(0, self._open - self._size)]
            del self._idle[:len(surplus)]
            self._condition.notify_all()
        for connection in surplus:
            self.discard(connection)

    def put(self, connection: "_AnyConnection") -> None:
        """Take back a connection that finished a response and may be reused."""
        connection.idle_since = time.monotonic()
        with self._condition:
            if not self._closed and connection.pid == self._pid and self._open <= self._size:
                self._idle.append(connection)
                self._condition.notify()
                return
        self.discard(connection)

    def discard(self, connection: "_AnyConnection") -> None:
        """Close a connection and free its slot."""
        connection.close()
        self._release()

    def close(self) -> None:
        """Close the idle connections; those in use are closed when they come back."""
        with self._condition:
            self._closed = True
            idle, self._idle = self._idle, []
            self._condition.notify_all()
        for connection in idle:
            self.discard(connection)

    def _release(self) -> None:
        with self._condition:
            self._open -= 1
            self._condition.notify()


class _Transport:
    """Sends requests to one origin over pooled connections: the one place a request is sent."""

    def __init__(
        self,
        origin: _Origin,
        ssl_context: ssl.SSLContext,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
        keep_alive_timeout: float,
    ) -> None:
        self.origin = origin
        self._ssl_context = ssl_context
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._pool = _Pool(self._connect, pool_size, keep_alive_timeout)
        self._speaks_h2: Optional[bool] = None

    def request(self, method: str, path: str, headers: Dict[str, str], body: bytes) -> Response:
        """Send one request and return its response, whatever the status.

        When a reused connection fails before any byte of the answer (broken pipe,
        reset, EOF) the request is sent once more on a new connection: the server had
        closed that connection and did not process the request. Every other failure
        raises NetworkError, saying whether the request may have been delivered.
        """
        request = method, path, headers, body
        try:
            return self._exchange(self._pool.get(), request)
        except _StaleConnection:
            log.debug("reused connection closed by the server; sending again on a new one")
            return self._exchange(self._pool.new(), request)

    def _exchange(
        self, connection: "_AnyConnection", request: Tuple[str, str, Dict[str, str], bytes]
    ) -> Response:
        """One request on one connection, which goes back to the pool or is discarded."""
        try:
            response, keep = connection.exchange(*request)
        except BaseException as exc:
            self._pool.discard(connection)
            if isinstance(exc, _NoAnswer) and connection.reused:
                raise _StaleConnection() from exc
            raise _network_error(exc, self.origin) from exc
        if keep:
            self._pool.put(connection)
        else:
            self._pool.discard(connection)
        return response

    def widen(self, connections: int) -> None:
        """Allow ``connections`` more (fewer, when negative) connections open at once."""
        self._pool.widen(connections)

    def close(self) -> None:
        self._pool.close()

    def connect_h2(self) -> Optional["_H2Connection"]:
        """A new HTTP/2 connection of its own for the caller, or None if the server
        does not speak HTTP/2 (remembered, so that it is asked once)."""
        if self._speaks_h2 is False:
            return None
        connection = self._connect()
        self._speaks_h2 = isinstance(connection, _H2Connection)
        if isinstance(connection, _H2Connection):
            return connection
        connection.close()
        return None

    def _connect(self) -> "_AnyConnection":
        """Open a connection (through the proxy, if any); NetworkError when that fails.

        It speaks HTTP/2 when the server picks h2 by ALPN, else HTTP/1.1.
        """
        import http.client  # only connecting needs it: loaded on first use, not on import

        origin = self.origin
        conn: http.client.HTTPConnection
        if origin.proxy:
            proxy_host, proxy_port, proxy_headers = origin.proxy
            address = (proxy_host, proxy_port)
        else:
            address = (origin.host, origin.port)
        if origin.scheme == "https":
            conn = http.client.HTTPSConnection(
                *address, timeout=self._connect_timeout, context=self._ssl_context
            )
        else:
            conn = http.client.HTTPConnection(*address, timeout=self._connect_timeout)
        if origin.proxy:
            conn.set_tunnel(origin.host, origin.port, headers=proxy_headers)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise NetworkError(
                "could not connect to %r: %s" % (origin, _reason(exc)),
                may_have_been_delivered=False,
            ) from exc
        sock = conn.sock
        conn.sock = None
        sock.settimeout(self._read_timeout)
        if isinstance(sock, ssl.SSLSocket) and sock.selected_alpn_protocol() == "h2":
            log.debug("connected to %r with HTTP/2", origin)
            return _H2Connection(sock, origin, self._read_timeout)
        log.debug("connected to %r", origin)
        return _Connection(sock, origin)


class _Connector:
    """Makes transports that share the client's TLS, timeout and proxy settings."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext,
        connect_timeout: float,
        read_timeout: float,
        keep_alive_timeout: float,
        proxy: Optional[str],
    ) -> None:
        self._ssl_context = ssl_context
        self._timeouts = connect_timeout, read_timeout
        self._keep_alive_timeout = keep_alive_timeout
        self._proxy = proxy

    def __call__(self, url: str, pool_size: int = 1) -> "_Transport":
        """A transport to ``url``'s origin; https goes through the proxy, if one applies."""
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        https = url.lower().startswith("https:")
        proxy = (self._proxy or _proxy_from_environment(host)) if https else None
        return _Transport(
            _Origin(url, proxy), self._ssl_context, *self._timeouts,
            pool_size, self._keep_alive_timeout,
        )


def _network_error(exc: BaseException, origin: _Origin) -> BaseException:
    """The NetworkError a failed exchange raises; other exceptions pass through unchanged."""
    if isinstance(exc, _NoAnswer) and not exc.sent:
        return NetworkError(
            "could not send the request to %r: %s" % (origin, _reason(exc)),
            may_have_been_delivered=False,
        )
    if isinstance(exc, _NoAnswer):
        message = "the connection to %r closed before an answer" % (origin,)
    elif isinstance(exc, socket.timeout):
        message = "no answer from %r within the read timeout" % (origin,)
    elif isinstance(exc, (OSError, _ProtocolError)):
        message = "the exchange with %r failed: %s" % (origin, _reason(exc))
    else:
        return exc
    return NetworkError(message, may_have_been_delivered=True)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# HPACK #######################################################################
# Header compression for HTTP/2 (RFC 7541): decode the server's, encode ours without state.

_HPACK_STATIC_TABLE = (  # RFC 7541 Appendix A, from index 1
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
    (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"), (":status", "200"),
    (":status", "204"), (":status", "206"), (":status", "304"), (":status", "400"),
    (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""),
    ("accept", ""), ("access-control-allow-origin", ""), ("age", ""), ("allow", ""),
    ("authorization", ""), ("cache-control", ""), ("content-disposition", ""),
    ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
    ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""),
    ("date", ""), ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""),
    ("if-match", ""), ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""),
    ("if-unmodified-since", ""), ("last-modified", ""), ("link", ""), ("location", ""),
    ("max-forwards", ""), ("proxy-authenticate", ""), ("proxy-authorization", ""),
    ("range", ""), ("referer", ""), ("refresh", ""), ("retry-after", ""), ("server", ""),
    ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
    ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
)
_HPACK_STATIC_SIZE = len(_HPACK_STATIC_TABLE)
# Lowest static index of each field, and of each name.
_HPACK_STATIC_FIELDS = {field: i for i, field in enumerate(_HPACK_STATIC_TABLE, 1)}
_HPACK_STATIC_NAMES = {
    name: i for i, (name, _) in reversed(list(enumerate(_HPACK_STATIC_TABLE, 1)))
}

_HPACK_ENTRY_OVERHEAD = 32        # octets a dynamic table entry costs beyond name and value
_HPACK_MAX_INT_OCTETS = 4         # continuation octets an integer may have: values to ~2**28
_HPACK_CACHE_ENTRIES = 128        # decoded header blocks remembered per decoder
_HPACK_CACHE_MAX_BLOCK = 1024     # octets of the largest header block worth remembering
_HPACK_ENCODER_CACHE_ENTRIES = 256  # encoded header fields remembered

# Huffman code (RFC 7541 Appendix B): (code, bit length) of octets 0 to 255, then of EOS.
_HUFFMAN_CODE = (
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28),  # 0-3
    (0xfffffe4, 28), (0xfffffe5, 28), (0xfffffe6, 28), (0xfffffe7, 28),  # 4-7
    (0xfffffe8, 28), (0xffffea, 24), (0x3ffffffc, 30), (0xfffffe9, 28),  # 8-11
    (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28), (0xfffffec, 28),  # 12-15
    (0xfffffed, 28), (0xfffffee, 28), (0xfffffef, 28), (0xffffff0, 28),  # 16-19
    (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28),  # 20-23
    (0xffffff4, 28), (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28),  # 24-27
    (0xffffff8, 28), (0xffffff9, 28), (0xffffffa, 28), (0xffffffb, 28),  # 28-31
    (0x14, 6), (0x3f8, 10), (0x3f9, 10), (0xffa, 12),  # 32-35
    (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11),  # 36-39
    (0x3fa, 10), (0x3fb, 10), (0xf9, 8), (0x7fb, 11),  # 40-43
    (0xfa, 8), (0x16, 6), (0x17, 6), (0x18, 6),  # 44-47
    (0x0, 5), (0x1, 5), (0x2, 5), (0x19, 6),  # 48-51
    (0x1a, 6), (0x1b, 6), (0x1c, 6), (0x1d, 6),  # 52-55
    (0x1e, 6), (0x1f, 6), (0x5c, 7), (0xfb, 8),  # 56-59
    (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10),  # 60-63
    (0x1ffa, 13), (0x21, 6), (0x5d, 7), (0x5e, 7),  # 64-67
    (0x5f, 7), (0x60, 7), (0x61, 7), (0x62, 7),  # 68-71
    (0x63, 7), (0x64, 7), (0x65, 7), (0x66, 7),  # 72-75
    (0x67, 7), (0x68, 7), (0x69, 7), (0x6a, 7),  # 76-79
    (0x6b, 7), (0x6c, 7), (0x6d, 7), (0x6e, 7),  # 80-83
    (0x6f, 7), (0x70, 7), (0x71, 7), (0x72, 7),  # 84-87
    (0xfc, 8), (0x73, 7), (0xfd, 8), (0x1ffb, 13),  # 88-91
    (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14), (0x22, 6),  # 92-95
    (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5),  # 96-99
    (0x24, 6), (0x5, 5), (0x25, 6), (0x26, 6),  # 100-103
    (0x27, 6), (0x6, 5), (0x74, 7), (0x75, 7),  # 104-107
    (0x28, 6), (0x29, 6), (0x2a, 6), (0x7, 5),  # 108-111
    (0x2b, 6), (0x76, 7), (0x2c, 6), (0x8, 5),  # 112-115
    (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),  # 116-119
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15),  # 120-123
    (0x7fc, 11), (0x3ffd, 14), (0x1ffd, 13), (0xffffffc, 28),  # 124-127
    (0xfffe6, 20), (0x3fffd2, 22), (0xfffe7, 20), (0xfffe8, 20),  # 128-131
    (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22), (0x7fffd9, 23),  # 132-135
    (0x3fffd6, 22), (0x7fffda, 23), (0x7fffdb, 23), (0x7fffdc, 23),  # 136-139
    (0x7fffdd, 23), (0x7fffde, 23), (0xffffeb, 24), (0x7fffdf, 23),  # 140-143
    (0xffffec, 24), (0xffffed, 24), (0x3fffd7, 22), (0x7fffe0, 23),  # 144-147
    (0xffffee, 24), (0x7fffe1, 23), (0x7fffe2, 23), (0x7fffe3, 23),  # 148-151
    (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22), (0x7fffe5, 23),  # 152-155
    (0x3fffd9, 22), (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24),  # 156-159
    (0x3fffda, 22), (0x1fffdd, 21), (0xfffe9, 20), (0x3fffdb, 22),  # 160-163
    (0x3fffdc, 22), (0x7fffe8, 23), (0x7fffe9, 23), (0x1fffde, 21),  # 164-167
    (0x7fffea, 23), (0x3fffdd, 22), (0x3fffde, 22), (0xfffff0, 24),  # 168-171
    (0x1fffdf, 21), (0x3fffdf, 22), (0x7fffeb, 23), (0x7fffec, 23),  # 172-175
    (0x1fffe0, 21), (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21),  # 176-179
    (0x7fffed, 23), (0x3fffe1, 22), (0x7fffee, 23), (0x7fffef, 23),  # 180-183
    (0xfffea, 20), (0x3fffe2, 22), (0x3fffe3, 22), (0x3fffe4, 22),  # 184-187
    (0x7ffff0, 23), (0x3fffe5, 22), (0x3fffe6, 22), (0x7ffff1, 23),  # 188-191
    (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20), (0x7fff1, 19),  # 192-195
    (0x3fffe7, 22), (0x7ffff2, 23), (0x3fffe8, 22), (0x1ffffec, 25),  # 196-199
    (0x3ffffe2, 26), (0x3ffffe3, 26), (0x3ffffe4, 26), (0x7ffffde, 27),  # 200-203
    (0x7ffffdf, 27), (0x3ffffe5, 26), (0xfffff1, 24), (0x1ffffed, 25),  # 204-207
    (0x7fff2, 19), (0x1fffe3, 21), (0x3ffffe6, 26), (0x7ffffe0, 27),  # 208-211
    (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27), (0xfffff2, 24),  # 212-215
    (0x1fffe4, 21), (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26),  # 216-219
    (0xffffffd, 28), (0x7ffffe3, 27), (0x7ffffe4, 27), (0x7ffffe5, 27),  # 220-223
    (0xfffec, 20), (0xfffff3, 24), (0xfffed, 20), (0x1fffe6, 21),  # 224-227
    (0x3fffe9, 22), (0x1fffe7, 21), (0x1fffe8, 21), (0x7ffff3, 23),  # 228-231
    (0x3fffea, 22), (0x3fffeb, 22), (0x1ffffee, 25), (0x1ffffef, 25),  # 232-235
    (0xfffff4, 24), (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23),  # 236-239
    (0x3ffffeb, 26), (0x7ffffe6, 27), (0x3ffffec, 26), (0x3ffffed, 26),  # 240-243
    (0x7ffffe7, 27), (0x7ffffe8, 27), (0x7ffffe9, 27), (0x7ffffea, 27),  # 244-247
    (0x7ffffeb, 27), (0xffffffe, 28), (0x7ffffec, 27), (0x7ffffed, 27),  # 248-251
    (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27), (0x3ffffee, 26),  # 252-255
    (0x3fffffff, 30),  # 256: EOS
)
_HUFFMAN_EOS = 256
# Symbol of each code, keyed by its bits behind a leading 1 bit (so "01" and "1" differ).
_HUFFMAN_SYMBOLS = {
    1 << length | code: symbol for symbol, (code, length) in enumerate(_HUFFMAN_CODE)
}
_HUFFMAN_START = 1 << 8                     # no bits pending, shifted as in _HuffmanSteps
# Where a string may end: 0 to 7 bits pending, all ones (the start of EOS), per RFC 7541 5.2.
_HUFFMAN_ENDS = frozenset(((2 << bits) - 1) << 8 for bits in range(8))
_HUFFMAN_MAX_STEPS = 16384        # steps remembered (of 65536): about 3 MB



class _HPACKError(Exception):
    """A header block broke HPACK: the server's fault, a COMPRESSION_ERROR for HTTP/2."""


class _HuffmanSteps(Dict[int, Tuple[int, bytes]]):
    """What one octet does to a Huffman decoder in each state, worked out on first need.

    A state is the bits pending since the last whole code, behind a leading 1 bit, shifted
    left 8 bits so that ``state | octet`` is the key; the value is the state after that
    octet and the symbols it completed. Real headers need a few thousand steps at most.
    """

    def __missing__(self, key: int) -> Tuple[int, bytes]:
        if len(self) >= _HUFFMAN_MAX_STEPS:
            self.clear()
        pending = key >> 8
        symbols = bytearray()
        for shift in range(7, -1, -1):
            pending = pending << 1 | key >> shift & 1
            symbol = _HUFFMAN_SYMBOLS.get(pending)
            if symbol is not None:
                if symbol == _HUFFMAN_EOS:
                    raise _HPACKError("Huffman-coded string contains EOS")
                symbols.append(symbol)
                pending = 1
        step = self[key] = (pending << 8, bytes(symbols))
        return step


_HUFFMAN_STEPS = _HuffmanSteps()


def _huffman_decode(data: bytes) -> bytes:
    """The octets a Huffman-coded string stands for; _HPACKError on EOS or bad padding."""
    steps = _HUFFMAN_STEPS
    state = _HUFFMAN_START
    decoded = bytearray()
    for octet in data:
        state, symbols = steps[state | octet]
        decoded += symbols
    if state not in _HUFFMAN_ENDS:
        raise _HPACKError("Huffman-coded string ends in padding that is not 0-7 one bits")
    return bytes(decoded)


def _hpack_decode_int(data: bytes, pos: int, prefix_bits: int) -> Tuple[int, int]:
    """The integer with a ``prefix_bits``-bit prefix at ``pos`` (RFC 7541 5.1), and its end."""
    if pos >= len(data):
        raise _HPACKError("header block ends before an integer")
    mask = (1 << prefix_bits) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    for shift in range(0, 7 * _HPACK_MAX_INT_OCTETS, 7):
        if pos >= len(data):
            raise _HPACKError("header block ends inside an integer")
        octet = data[pos]
        pos += 1
        value += (octet & 0x7F) << shift
        if octet < 0x80:
            return value, pos
    raise _HPACKError("integer longer than %d octets" % (_HPACK_MAX_INT_OCTETS + 1))


def _hpack_decode_string(data: bytes, pos: int) -> Tuple[str, int]:
    """The string literal at ``pos`` (RFC 7541 5.2), Huffman-coded or not, and its end."""
    length, start = _hpack_decode_int(data, pos, 7)
    end = start + length
    if end > len(data):
        raise _HPACKError("header block ends inside a string")
    raw = data[start:end]
    if data[pos] & 0x80:
        raw = _huffman_decode(raw)
    return raw.decode("latin-1"), end


class _HPACKDecoder:
    """Decodes the header blocks of one HTTP/2 connection, in the order they arrive.

    ``max_table_size`` is the SETTINGS_HEADER_TABLE_SIZE we advertise; the server may size
    its dynamic table (``entries``, newest first, taking ``size`` octets) up to it.
    """

    __slots__ = ("max_table_size", "capacity", "size", "entries", "_cache")

    def __init__(self, max_table_size: int) -> None:
        self.max_table_size = max_table_size
        self.capacity = max_table_size
        self.size = 0
        self.entries: List[Tuple[str, str]] = []
        self._cache: Dict[bytes, Tuple[Tuple[str, str], ...]] = {}

    def decode(self, block: bytes) -> Tuple[Tuple[str, str], ...]:
        """The (name, value) fields of a whole header block; _HPACKError when it is malformed.

        A block that neither reads nor changes the dynamic table means the same every time
        (as any block does while the table has size 0, which we ask for), so small ones
        are remembered: a server that repeats itself costs one dict lookup.
        Hence a tuple, which later calls may return again: it cannot be changed.
        """
        headers = self._cache.get(block)
        if headers is None:
            headers, stateless = self._decode(block)
            if stateless and len(block) <= _HPACK_CACHE_MAX_BLOCK:
                if len(self._cache) >= _HPACK_CACHE_ENTRIES:
                    self._cache.clear()
                self._cache[block] = headers
        return headers

    def _decode(self, block: bytes) -> Tuple[Tuple[Tuple[str, str], ...], bool]:
        """The fields of a block, and whether it left the dynamic table alone (RFC 7541 6)."""
        headers: List[Tuple[str, str]] = []
        stateless = True
        pos = 0
        while pos < len(block):
            first = block[pos]
            if first & 0x80:                            # indexed field
                index, pos = _hpack_decode_int(block, pos, 7)
                field = self._field(index)
            elif first & 0xE0 == 0x20:                  # dynamic table size update
                if headers:
                    raise _HPACKError("dynamic table size update after a header field")
                size, pos = _hpack_decode_int(block, pos, 5)
                if size != self.capacity:
                    self._resize(size)
                    stateless = False
                continue
            else:                                       # literal field, name indexed if index
                index, pos = _hpack_decode_int(block, pos, 6 if first & 0x40 else 4)
                if index:
                    name = self._field(index)[0]
                else:
                    name, pos = _hpack_decode_string(block, pos)
                value, pos = _hpack_decode_string(block, pos)
                field = (name, value)
                if first & 0x40 and self.capacity:      # with incremental indexing
                    self._insert(field)                 # (a table of size 0 keeps nothing)
                    stateless = False
            stateless = stateless and index <= _HPACK_STATIC_SIZE
            headers.append(field)
        return tuple(headers), stateless

    def _field(self, index: int) -> Tuple[str, str]:
        """The static or dynamic table entry at ``index`` (RFC 7541 2.3.3)."""
        if 0 < index <= _HPACK_STATIC_SIZE:
            return _HPACK_STATIC_TABLE[index - 1]
        position = index - _HPACK_STATIC_SIZE - 1
        if index == 0 or position >= len(self.entries):
            raise _HPACKError("index %d is not in the header tables" % index)
        return self.entries[position]

    def _insert(self, field: Tuple[str, str]) -> None:
        """Add a field to the dynamic table, evicting the oldest to make room (RFC 7541 4.4)."""
        cost = len(field[0]) + len(field[1]) + _HPACK_ENTRY_OVERHEAD
        self._evict(max(0, self.capacity - cost))
        if cost <= self.capacity:
            self.entries.insert(0, field)
            self.size += cost

    def _resize(self, capacity: int) -> None:
        """Apply a dynamic table size update, which may not exceed what we advertised."""
        if capacity > self.max_table_size:
            raise _HPACKError(
                "dynamic table size update to %d exceeds the %d we allow"
                % (capacity, self.max_table_size)
            )
        self.capacity = capacity
        self._evict(capacity)
        self._cache.clear()  # what it remembered may have inserted into a table of size 0

    def _evict(self, size: int) -> None:
        """Drop the oldest entries until the dynamic table takes at most ``size`` octets."""
        while self.size > size:
            name, value = self.entries.pop()
            self.size -= len(name) + len(value) + _HPACK_ENTRY_OVERHEAD


def _hpack_encode_int(value: int, prefix_bits: int, flags: int) -> bytes:
    """``value`` with a ``prefix_bits``-bit prefix (RFC 7541 5.1), ``flags`` in the first octet."""
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes((flags | value,))
    encoded = bytearray((flags | mask,))
    value -= mask
    while value >= 0x80:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def _hpack_encode_string(text: str) -> bytes:
    """``text`` as a string literal, without Huffman coding (RFC 7541 5.2)."""
    raw = text.encode("latin-1")
    return _hpack_encode_int(len(raw), 7, 0) + raw


def _hpack_encode_field(name: str, value: str) -> bytes:
    """One field: indexed if static, else a literal without indexing (RFC 7541 6.1, 6.2.2)."""
    if name != name.lower():
        raise ValueError("HTTP/2 header names must be lower-case, got %r" % name)
    index = _HPACK_STATIC_FIELDS.get((name, value))
    if index is not None:
        return bytes((0x80 | index,))
    index = _HPACK_STATIC_NAMES.get(name)
    if index is None:
        return b"\x00" + _hpack_encode_string(name) + _hpack_encode_string(value)
    return _hpack_encode_int(index, 4, 0) + _hpack_encode_string(value)


_HPACK_ENCODED_FIELDS = {}  # type: Dict[Tuple[str, str], bytes]


def _hpack_encode(headers: Iterable[Tuple[str, str]]) -> bytes:
    """A header block for ``headers`` that needs no connection state: no dynamic table.

    Fields seen before come from a small cache, so a request's constant headers cost a
    dict lookup each. ValueError for an upper-case name or a value that is not Latin-1.
    """
    encoded = _HPACK_ENCODED_FIELDS
    parts = []
    for field in headers:
        part = encoded.get(field)
        if part is None:
            part = _hpack_encode_field(*field)
            if len(encoded) >= _HPACK_ENCODER_CACHE_ENTRIES:
                encoded.clear()
            encoded[field] = part
        parts.append(part)
    return b"".join(parts)


# HTTP/2 ######################################################################
# Many requests at once over one TLS connection (RFC 9113), when the server picks h2.

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
(_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY,
 _WINDOW_UPDATE, _CONTINUATION) = range(10)
_END_STREAM = _ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY_FLAG = 0x20
_SETTINGS_HEADER_TABLE_SIZE = 0x1
_SETTINGS_ENABLE_PUSH = 0x2
_SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
_SETTINGS_INITIAL_WINDOW_SIZE = 0x4
_SETTINGS_MAX_FRAME_SIZE = 0x5
_PROTOCOL_ERROR = 0x1
_FLOW_CONTROL_ERROR = 0x3
_FRAME_SIZE_ERROR = 0x6
_REFUSED_STREAM = 0x7
_CANCEL = 0x8
_COMPRESSION_ERROR = 0x9
_H2_WINDOW = 1 << 24          # bytes we let the server send ahead, per stream and connection
_H2_DEFAULT_WINDOW = 65535    # what RFC 9113 starts every window at
_H2_FRAME = 16384             # the largest frame we accept (the default; we never raise it)
_H2_HEADER_TABLE = 4096       # the dynamic table we decode, whatever we advertise (we say 0)
_H2_PING_QUIET = 10.0         # seconds without a frame, streams open, before one PING
_H2_BLOCK_CACHE = 64          # request header blocks a connection remembers
_H2_REFUSALS = 5              # refused streams sent again at once; then the retry policy
_H2_WRITE_BATCH = 16384       # bytes of new streams queued before they are written
_H2_LAST_STREAM = (1 << 31) - 1
# What we tell the server first: no dynamic table, no server push, large stream windows.
_H2_SETTINGS = ((_SETTINGS_HEADER_TABLE_SIZE, 0), (_SETTINGS_ENABLE_PUSH, 0),
                (_SETTINGS_INITIAL_WINDOW_SIZE, _H2_WINDOW))


class _H2Error(Exception):
    """The server broke HTTP/2: the connection cannot go on (``code`` goes in our GOAWAY)."""

    def __init__(self, message: str, code: int = _PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class _Refused(Exception):
    """The server provably did not process the stream: send it again on another connection."""


class _H2Stream:
    """One request in flight: what is left to send, and what has come back."""

    __slots__ = ("id", "key", "pending", "send_window", "status", "headers", "body",
                 "deadline", "first_byte", "outcome")

    def __init__(self, stream_id: int, key: object, deadline: float) -> None:
        self.id = stream_id
        self.key = key
        self.pending = b""                 # DATA not yet sent for want of window
        self.send_window = 0
        self.status = 0
        self.headers: Dict[str, str] = {}
        self.body = bytearray()
        self.deadline = deadline
        self.first_byte = 0                # where the stream starts in the connection's output
        self.outcome: Union[None, Response, BaseException] = None


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


class _H2Connection:
    """An HTTP/2 connection: frames in and out, streams, flow control, HPACK.

    It never blocks on its own: ``receive`` takes bytes read from the socket, ``start``
    queues a request, ``flush`` writes what the socket takes. Finished streams (with a
    Response, an error, or _Refused) collect in ``finished``. ``exchange`` drives one
    request to its end with blocking I/O, for the pool that push() uses.
    """

    def __init__(self, sock: socket.socket, origin: "_Origin", read_timeout: float) -> None:
        self.sock = sock
        self._authority = origin.host_header
        self._scheme = origin.scheme
        self._read_timeout = read_timeout
        self._in = bytearray()
        settings = b"".join(name.to_bytes(2, "big") + value.to_bytes(4, "big")
                            for name, value in _H2_SETTINGS)
        self._out = bytearray(_H2_PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(
            _WINDOW_UPDATE, 0, 0, (_H2_WINDOW - _H2_DEFAULT_WINDOW).to_bytes(4, "big")))
        self._written = 0                  # bytes of output the socket has taken, ever
        self._decoder = _HPACKDecoder(_H2_HEADER_TABLE)
        self._blocks: Dict[Tuple[Any, ...], bytes] = {}
        self._header_block: Optional[Tuple[int, bool, bytearray]] = None
        self.streams: Dict[int, _H2Stream] = {}
        self.finished: List[_H2Stream] = []
        self._next_id = 1
        self._max_streams = 0              # none until the server's SETTINGS say how many
        self.settled = False               # the server's SETTINGS have come
        self._peer_window = _H2_DEFAULT_WINDOW
        self._peer_initial_window = _H2_DEFAULT_WINDOW
        self._peer_frame = _H2_FRAME
        self._received_unacknowledged = 0
        self.last_stream_id = _H2_LAST_STREAM   # lowered by GOAWAY
        self.closed = False
        self.last_frame = time.monotonic()
        self._pinged = False
        self.pid = os.getpid()
        self.idle_since = 0.0
        self.reused = False

    # Starting requests --------------------------------------------------------

    @property
    def free_streams(self) -> int:
        """How many more streams this connection may start now."""
        if self.closed or self.last_stream_id != _H2_LAST_STREAM:
            return 0
        return max(0, min(self._max_streams - len(self.streams),
                          (_H2_LAST_STREAM - self._next_id) // 2))

    def start(self, method: str, path: str, headers: Dict[str, str], body: bytes,
              key: object, now: float) -> _H2Stream:
        """Queue a request as a new stream; ``key`` tells its outcome apart later."""
        stream = _H2Stream(self._next_id, key, now + self._read_timeout)
        self._next_id += 2
        stream.first_byte = self._written + len(self._out)
        stream.send_window = self._peer_initial_window
        self._queue_headers(stream.id, self._header_block_for(method, path, headers, len(body)),
                            end_stream=not body)
        self.streams[stream.id] = stream
        stream.pending = body
        self._send_data(stream)
        return stream

    def _header_block_for(self, method: str, path: str, headers: Dict[str, str],
                          length: int) -> bytes:
        """The HPACK block of a request; the same few recur, so they are remembered."""
        key = (method, path, length, *headers.items())
        block = self._blocks.get(key)
        if block is None:
            fields = [(":method", method), (":scheme", self._scheme),
                      (":authority", self._authority), (":path", path),
                      ("user-agent", _USER_AGENT), ("content-length", str(length))]
            fields.extend((name.lower(), value) for name, value in headers.items())
            block = _hpack_encode(fields)
            if len(self._blocks) >= _H2_BLOCK_CACHE:
                self._blocks.clear()
            self._blocks[key] = block
        return block

    def _queue_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        first, rest = block[:self._peer_frame], block[self._peer_frame:]
        flags = (_END_STREAM if end_stream else 0) | (0 if rest else _END_HEADERS)
        self._out += _frame(_HEADERS, flags, stream_id, first)
        while rest:
            piece, rest = rest[:self._peer_frame], rest[self._peer_frame:]
            self._out += _frame(_CONTINUATION, 0 if rest else _END_HEADERS, stream_id, piece)

    def _send_data(self, stream: _H2Stream) -> None:
        """Queue as much of the stream's body as the flow-control windows allow."""
        while stream.pending:
            size = min(len(stream.pending), self._peer_frame, self._peer_window,
                       stream.send_window)
            if size <= 0:
                return
            piece, stream.pending = stream.pending[:size], stream.pending[size:]
            self._peer_window -= size
            stream.send_window -= size
            self._out += _frame(_DATA, 0 if stream.pending else _END_STREAM, stream.id, piece)

    # Reading and writing ------------------------------------------------------

    @property
    def pending_output(self) -> int:
        return len(self._out)

    def flush(self) -> None:
        """Write what the (non-blocking) socket takes now."""
        while self._out:
            try:
                sent = self.sock.send(self._out[:65536])
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                return
            del self._out[:sent]
            self._written += sent

    def read_available(self) -> bool:
        """Read and handle everything the (non-blocking) socket has; False at EOF."""
        while True:
            try:
                data = self.sock.recv(262144)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                return True
            if not data:
                return False
            self.receive(data)

    def receive(self, data: bytes) -> None:
        """Handle the frames in ``data`` (and any partial frame left from before)."""
        self.last_frame = time.monotonic()
        self._pinged = False
        buffer = self._in
        buffer += data
        offset = 0
        end = len(buffer)
        while end - offset >= 9:
            length = int.from_bytes(buffer[offset:offset + 3], "big")
            if length > _H2_FRAME:
                raise _H2Error("a frame of %d bytes" % length, _FRAME_SIZE_ERROR)
            if end - offset < 9 + length:
                break
            kind, flags = buffer[offset + 3], buffer[offset + 4]
            stream_id = int.from_bytes(buffer[offset + 5:offset + 9], "big") & _H2_LAST_STREAM
            payload = bytes(buffer[offset + 9:offset + 9 + length])
            offset += 9 + length
            self._on_frame(kind, flags, stream_id, payload)
        del buffer[:offset]

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is not None and kind != _CONTINUATION:
            raise _H2Error("a header block was interrupted")
        if kind == _DATA:
            self._on_data(flags, stream_id, payload)
        elif kind in (_HEADERS, _CONTINUATION):
            self._on_header_fragment(kind, flags, stream_id, payload)
        elif kind == _RST_STREAM:
            code = int.from_bytes(payload[:4], "big")
            self._finish(stream_id, _Refused() if code == _REFUSED_STREAM else NetworkError(
                "the server reset the stream (HTTP/2 error %d)" % code,
                may_have_been_delivered=True))
        elif kind == _SETTINGS and not flags & _ACK:
            self._on_settings(payload)
        elif kind == _PING and not flags & _ACK:
            self._out += _frame(_PING, _ACK, 0, payload)
        elif kind == _GOAWAY:
            self._on_goaway(payload)
        elif kind == _WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == _PUSH_PROMISE:
            raise _H2Error("server push, which we disabled")

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._received_unacknowledged += len(payload)
        if self._received_unacknowledged > _H2_WINDOW // 2:
            self._out += _frame(_WINDOW_UPDATE, 0, 0,
                                self._received_unacknowledged.to_bytes(4, "big"))
            self._received_unacknowledged = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream we reset or gave up on
        if flags & _PADDED:
            payload = payload[1:len(payload) - payload[0]]
        stream.body += payload
        if len(stream.body) > _MAX_BODY:
            self._reset(stream, NetworkError(
                "response body exceeds %d bytes" % _MAX_BODY, may_have_been_delivered=True))
        elif flags & _END_STREAM:
            self._complete(stream)

    def _on_header_fragment(self, kind: int, flags: int, stream_id: int,
                            payload: bytes) -> None:
        if kind == _HEADERS:
            if flags & _PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            self._header_block = (stream_id, bool(flags & _END_STREAM), bytearray())
        elif self._header_block is None or self._header_block[0] != stream_id:
            raise _H2Error("a CONTINUATION frame out of place")
        assert self._header_block is not None
        self._header_block[2].extend(payload)
        if len(self._header_block[2]) > _MAX_HEAD:
            raise _H2Error("a header block over %d bytes" % _MAX_HEAD)
        if flags & _END_HEADERS:
            stream_id, end_stream, block = self._header_block
            self._header_block = None
            self._on_headers(stream_id, end_stream, bytes(block))

    def _on_headers(self, stream_id: int, end_stream: bool, block: bytes) -> None:
        try:
            fields = self._decoder.decode(block)  # always: it may change the dynamic table
        except _HPACKError as exc:
            raise _H2Error("undecodable headers: %s" % exc, _COMPRESSION_ERROR) from None
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if not stream.status:
            status = dict(fields).get(":status", "")
            if not (len(status) == 3 and status.isdigit()):
                raise _H2Error("a response without a valid :status")
            if status[0] != "1":
                stream.status = int(status)
                for name, value in fields:
                    if name[0] != ":":
                        old = stream.headers.get(name)
                        stream.headers[name] = value if old is None else old + ", " + value
        if end_stream:
            self._complete(stream)

    def _on_settings(self, payload: bytes) -> None:
        if not self.settled:
            self.settled = True
            self._max_streams = _H2_LAST_STREAM  # unless it says otherwise, just below
        for offset in range(0, len(payload) - 5, 6):
            name = int.from_bytes(payload[offset:offset + 2], "big")
            value = int.from_bytes(payload[offset + 2:offset + 6], "big")
            if name == _SETTINGS_MAX_CONCURRENT_STREAMS:
                self._max_streams = value
            elif name == _SETTINGS_INITIAL_WINDOW_SIZE:
                if value > _H2_LAST_STREAM:
                    raise _H2Error("a window above 2^31-1", _FLOW_CONTROL_ERROR)
                for stream in self.streams.values():
                    stream.send_window += value - self._peer_initial_window
                self._peer_initial_window = value
            elif name == _SETTINGS_MAX_FRAME_SIZE:
                self._peer_frame = value
        self._out += _frame(_SETTINGS, _ACK, 0)
        self._unblock()

    def _on_goaway(self, payload: bytes) -> None:
        self.last_stream_id = int.from_bytes(payload[:4], "big") & _H2_LAST_STREAM
        for stream in list(self.streams.values()):
            if stream.id > self.last_stream_id:
                self._finish(stream.id, _Refused())

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        increment = int.from_bytes(payload[:4], "big") & _H2_LAST_STREAM
        if stream_id == 0:
            self._peer_window += increment
        elif stream_id in self.streams:
            self.streams[stream_id].send_window += increment
        self._unblock()

    def _unblock(self) -> None:
        """Send the DATA that was waiting for a larger window."""
        for stream in self.streams.values():
            if stream.pending:
                self._send_data(stream)

    # Ending streams -----------------------------------------------------------

    def _complete(self, stream: _H2Stream) -> None:
        import http.client  # loaded by _connect already: here it costs a dict lookup

        reason = http.client.responses.get(stream.status, "")
        response = Response(stream.status, reason, Headers(stream.headers), bytes(stream.body))
        self._finish(stream.id, response)

    def _finish(self, stream_id: int, outcome: Union[Response, BaseException]) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            stream.outcome = outcome
            self.finished.append(stream)

    def _reset(self, stream: _H2Stream, error: BaseException) -> None:
        """Give up on a stream: tell the server, and finish it with ``error``."""
        self._out += _frame(_RST_STREAM, 0, stream.id, _CANCEL.to_bytes(4, "big"))
        self._finish(stream.id, error)

    def expire(self, now: float) -> None:
        """End the streams past their deadline; PING a connection that went quiet."""
        while self.streams:
            oldest = next(iter(self.streams.values()))  # streams are kept in the order started
            if oldest.deadline > now:
                break
            self._reset(oldest, NetworkError(
                "no answer within the read timeout", may_have_been_delivered=True))
        if self.streams and not self._pinged and now - self.last_frame > _H2_PING_QUIET:
            self._out += _frame(_PING, 0, 0, b"andpush!")
            self._pinged = True

    def fail(self, reason: str) -> None:
        """The connection is gone: finish every stream, saying whether it may have arrived."""
        self.closed = True
        for stream in list(self.streams.values()):
            unsent = stream.first_byte >= self._written
            self._finish(stream.id, _Refused() if unsent or stream.id > self.last_stream_id
                         else NetworkError(reason, may_have_been_delivered=True))

    def abort(self, error: _H2Error) -> None:
        """Tell the server why we give up on the connection (best effort), then fail it."""
        self._out += _frame(_GOAWAY, 0, 0, bytes(4) + error.code.to_bytes(4, "big"))
        with contextlib.suppress(OSError):
            self.flush()
        self.fail("the server broke HTTP/2: %s" % error)

    def next_deadline(self) -> float:
        """When ``expire`` next has something to do."""
        if not self.streams:
            return math.inf
        quiet = math.inf if self._pinged else self.last_frame + _H2_PING_QUIET
        return min(quiet, next(iter(self.streams.values())).deadline)

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    # One request at a time, blocking, for the pool ----------------------------

    def exchange(self, method: str, path: str, headers: Dict[str, str],
                 body: bytes) -> Tuple[Response, bool]:
        """Send one request and wait for its answer, like _Connection.exchange."""
        stream = self.start(method, path, headers, body, None, time.monotonic())
        try:
            self.sock.sendall(self._out)
        except OSError as exc:
            raise _NoAnswer(exc, sent=False) from exc
        self._written += len(self._out)
        self._out.clear()
        while stream.outcome is None:
            try:
                data = self.sock.recv(262144)
            except _CLOSED_BEFORE_ANSWER as exc:
                data = b""
                reason: object = exc
            else:
                reason = "the server closed the connection"
            if not data:
                if stream.status:
                    raise _ProtocolError("the connection closed mid-response")
                raise _NoAnswer(reason, sent=True)
            try:
                self.receive(data)
            except _H2Error as exc:
                self.abort(exc)
                raise _ProtocolError(str(exc)) from None
            if self._out:
                self.sock.sendall(self._out)
                self._written += len(self._out)
                self._out.clear()
        self.finished.clear()
        if isinstance(stream.outcome, _Refused):
            raise _NoAnswer("the server refused the stream", sent=False)
        if isinstance(stream.outcome, BaseException):
            raise stream.outcome
        assert isinstance(stream.outcome, Response)
        return stream.outcome, self.free_streams > 0

    def is_alive(self) -> bool:
        """Handle what arrived while idle (SETTINGS, PING, GOAWAY); False if unusable."""
        self.sock.setblocking(False)
        try:
            alive = self.read_available()
            self.flush()
        except (OSError, _H2Error):
            alive = False
        finally:
            self.sock.settimeout(self._read_timeout)
        return alive and self.free_streams > 0 and not self._out


_AnyConnection = Union[_Connection, _H2Connection]


# Messages ####################################################################
# The two FCM APIs: where a message goes, how it is wrapped, and what is wrong with it.

_TARGETS = ("token", "topic", "condition", "fid")
_MULTICAST_FIELDS = ("tokens", "registration_ids")  # other clients' ways to name many targets
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9\-_.~%]{1,900}\Z")
_RESERVED_DATA_KEYS = ("from", "message_type")
_RESERVED_DATA_PREFIXES = ("google", "gcm")
#: Bytes of a data payload FCM takes, counting each key and value in UTF-8.
MAX_DATA_BYTES = 4096
#: Longest time to live FCM takes, in seconds (four weeks).
MAX_TTL_SECONDS = 2419200
# FCM takes the priority in either case: firebase-admin sends "high", the REST docs say "HIGH".
_PRIORITIES = ("normal", "high")
_TTL = re.compile(r"[0-9]+(?:\.[0-9]{1,9})?s\Z", re.ASCII)  # google.protobuf.Duration in JSON
_COLOR = re.compile(r"#[0-9a-fA-F]{6}\Z")
_ANALYTICS_LABEL = re.compile(r"[a-zA-Z0-9\-_.~%]{1,50}\Z")
_NOTIFICATION_TEXTS = ("title", "body", "image")
_PLATFORMS = ("android", "apns", "webpush")


def _check_dict(message: object) -> Dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError("message must be a dict, got %s" % type(message).__name__)
    return message


def _check_message(message: object) -> Dict[str, Any]:
    """Check a v1 Message before it is sent: raise TypeError/ValueError saying what to fix.

    Only what FCM is known to refuse is refused, and each check looks only at fields that
    are present, so a typical message costs a few dict lookups more.
    """
    message = _check_dict(message)
    for field in _MULTICAST_FIELDS:
        if field in message:
            raise ValueError(
                "a v1 message has one target, not %r: to send it to many devices, leave %r "
                "out and call client.push_multicast(message, tokens)" % (field, field)
            )
    targets = [name for name in _TARGETS if name in message]
    if len(targets) != 1:
        raise ValueError(
            "message needs exactly one target of token, topic, condition or fid; got %s"
            % (", ".join(targets) or "none")
        )
    target = message[targets[0]]
    if not isinstance(target, str) or not target:
        raise ValueError("message %r must be a non-empty str" % targets[0])
    if targets[0] == "topic":
        _check_topic(target)
    _check_data(message.get("data"), "data")
    notification = message.get("notification")
    if notification is not None:
        _check_texts(_check_section(notification, "notification"), "notification")
    _check_fcm_options(message, "")
    for platform in _PLATFORMS:
        config = message.get(platform)
        if config is not None:
            _check_platform(platform, _check_section(config, platform))
    return message


def _check_section(value: object, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("message %s must be a dict, got %s" % (where, type(value).__name__))
    return value


def _check_texts(notification: Dict[str, Any], where: str) -> None:
    """A notification's title, body and image are strings (FCM refuses numbers and the like)."""
    for name in _NOTIFICATION_TEXTS:
        value = notification.get(name)
        if value is not None and not isinstance(value, str):
            raise TypeError(
                "message %s.%s must be a str, got %s; convert it, e.g. with str()"
                % (where, name, type(value).__name__)
            )


def _check_platform(platform: str, config: Dict[str, Any]) -> None:
    """The checks of one of android, apns or webpush."""
    _check_fcm_options(config, platform + ".")
    if platform == "android":
        _check_android(config)
        return
    headers = config.get("headers")
    if headers is not None:
        _check_strings(headers, platform + ".headers")
    if platform == "webpush":
        _check_data(config.get("data"), "webpush.data")
        _check_link(_either(config, "fcm_options", "fcmOptions"))


def _check_android(android: Dict[str, Any]) -> None:
    _check_data(android.get("data"), "android.data")
    _check_priority(android.get("priority"), "android.priority")
    ttl = android.get("ttl")
    if ttl is not None:
        _check_ttl(ttl)
    notification = android.get("notification")
    if notification is not None:
        color = _check_section(notification, "android.notification").get("color")
        _check_color(color, "android.notification.color")


def _check_color(color: object, where: str) -> None:
    if color is not None and not (isinstance(color, str) and _COLOR.match(color)):
        raise ValueError(
            'message %s must be #rrggbb, such as "#ff8800"; got %s' % (where, _shown(color))
        )


def _check_priority(priority: object, where: str) -> None:
    if priority is not None and not (
        isinstance(priority, str) and priority.lower() in _PRIORITIES
    ):
        raise ValueError(
            'message %s must be "normal" or "high", got %s' % (where, _shown(priority))
        )


def _check_ttl(ttl: object) -> None:
    if not (isinstance(ttl, str) and _TTL.match(ttl) and float(ttl[:-1]) <= MAX_TTL_SECONDS):
        raise ValueError(
            'message android.ttl must be a duration string of 0 to %d seconds, such as "3600s" '
            'or "0.5s"; got %s' % (MAX_TTL_SECONDS, _shown(ttl))
        )


def _check_fcm_options(section: Dict[str, Any], where: str) -> None:
    """An ``fcm_options.analytics_label`` (either spelling) matches FCM's pattern."""
    options = _either(section, "fcm_options", "fcmOptions")
    if options is None:
        return
    options = _check_section(options, where + "fcm_options")
    label = _either(options, "analytics_label", "analyticsLabel")
    if label is not None and not (isinstance(label, str) and _ANALYTICS_LABEL.match(label)):
        raise ValueError(
            "message %sfcm_options.analytics_label must be 1 to 50 of a-z A-Z 0-9 - _ . ~ %%; "
            "got %s" % (where, _shown(label))
        )


def _check_link(options: object) -> None:
    link = options.get("link") if isinstance(options, dict) else None
    if link is not None and not (isinstance(link, str) and link[:8].lower() == "https://"):
        raise ValueError(
            "message webpush.fcm_options.link must be an https:// URL, got %s" % _shown(link)
        )


def _check_strings(values: object, where: str) -> None:
    """A map of str to str, such as apns.headers."""
    if not isinstance(values, dict):
        raise TypeError("message %s must be a dict of str to str" % where)
    for key, value in values.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                "message %s[%s] must be a str, got %s; convert it, e.g. with str()"
                % (where, _shown(key), type(value).__name__)
            )


def _either(section: Dict[str, Any], name: str, camel_case_name: str) -> Any:
    """A field FCM takes under either spelling (proto3 JSON accepts both)."""
    value = section.get(name)
    return section.get(camel_case_name) if value is None else value


def _shown(value: object) -> str:
    """A short repr of a bad field value for an error message (never used on device tokens)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_topic(topic: str) -> None:
    if topic.startswith("/topics/"):
        raise ValueError("topic names go without the /topics/ prefix: use %r" % topic[8:])
    if not _TOPIC_NAME.match(topic):
        raise ValueError(
            "topic %r is not a valid topic name: use 1 to 900 of a-z A-Z 0-9 - _ . ~ %%"
            % topic[:40]
        )


def _check_data(data: object, where: str) -> None:
    if data is None:
        return
    if not isinstance(data, dict):
        raise TypeError("message %s must be a dict of str to str" % where)
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError("message %s keys must be str, got %r" % (where, key))
        if not isinstance(value, str):
            raise TypeError(
                "message %s[%r] must be a str, got %s: FCM takes only strings; "
                "convert it, e.g. with str() or json.dumps()" % (where, key, type(value).__name__)
            )
        if key in _RESERVED_DATA_KEYS or key.startswith(_RESERVED_DATA_PREFIXES):
            raise ValueError("message %s key %r is reserved by FCM; rename it" % (where, key))


def _check_data_sizes(message: Dict[str, Any], body: bytes) -> None:
    """Each data payload of a message is at most MAX_DATA_BYTES: keys and values in UTF-8.

    That is what FCM counts for data; quotes, colons and the rest of the JSON are not
    counted, so this never refuses what FCM takes. The encoded body is longer than any
    payload in it, so only a body over the limit needs counting.
    """
    if len(body) <= MAX_DATA_BYTES:
        return
    sections = [(message, "data")]
    for platform in ("android", "webpush"):
        config = message.get(platform)
        if isinstance(config, dict):
            sections.append((config, platform + ".data"))
    for section, where in sections:
        data = section.get("data")
        if isinstance(data, dict) and _data_size(data) > MAX_DATA_BYTES:
            raise ValueError(
                "message %s is %d bytes (its keys and values in UTF-8), but FCM takes at most "
                "%d; send less, e.g. an id the app uses to fetch the rest"
                % (where, _data_size(data), MAX_DATA_BYTES)
            )


def _data_size(data: Dict[Any, Any]) -> int:
    """Bytes of a data payload's keys and values in UTF-8; a legacy non-str value as JSON."""
    size = 0
    for key, value in data.items():
        text = value if isinstance(value, str) else _JSON_ENCODE(value)
        size += len(str(key).encode("utf-8", "surrogatepass"))
        size += len(text.encode("utf-8", "surrogatepass"))
    return size


def _check_legacy_message(message: object) -> Dict[str, Any]:
    """Check a legacy message the way _check_message does, for the fields the two share."""
    message = _check_dict(message)
    _check_priority(message.get("priority"), "priority")
    ttl = message.get("time_to_live")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 <= ttl <= MAX_TTL_SECONDS
    ):
        raise ValueError(
            "message time_to_live must be an int of 0 to %d seconds, got %s"
            % (MAX_TTL_SECONDS, _shown(ttl))
        )
    notification = message.get("notification")
    if notification is not None:
        notification = _check_section(notification, "notification")
        _check_texts(notification, "notification")
        _check_color(notification.get("color"), "notification.color")
    return message


_JSON_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def _encode_json(message: Dict[str, Any], what: str = "message") -> bytes:
    """Serialise a message, with a clear TypeError/ValueError when it cannot be."""
    try:
        text = _JSON_ENCODE(message)
    except TypeError as exc:
        raise TypeError("%s is not JSON-serialisable: %s" % (what, exc)) from None
    except ValueError as exc:
        raise ValueError("%s is not JSON-serialisable: %s" % (what, exc)) from None
    return text.encode("utf-8")


def _legacy_tokens(message: Dict[str, Any]) -> Tuple[str, ...]:
    """The device tokens a legacy message goes to, in the order FCM answers for them."""
    ids = message.get("registration_ids")
    if isinstance(ids, list):
        return tuple(str(t) for t in ids)
    to = message.get("to")
    return (to,) if isinstance(to, str) and not to.startswith("/topics/") else ()


class _LegacyAPI:
    """The legacy HTTP API: ``POST /fcm/send`` with ``Authorization: key=...``."""

    name = "legacy"
    refreshable = False

    def __init__(self, server_key: str) -> None:
        self._headers = {"Authorization": "key=" + server_key, "Content-Type": "application/json"}

    def prepare(self, message: object, validate_only: bool) -> Tuple[str, bytes, Tuple[str, ...]]:
        """Path, body and target tokens of a push; TypeError/ValueError for a bad message."""
        message = _check_legacy_message(message)
        if validate_only:
            message = dict(message, dry_run=True)
        body = _encode_json(message)
        _check_data_sizes(message, body)
        return "/fcm/send", body, _legacy_tokens(message)

    def headers(self) -> Tuple[Dict[str, str], str]:
        return self._headers, ""

    def project_path(self) -> str:
        raise ValueError("topic management needs the v1 API: create the client with credentials")

    def invalidate(self, token: str) -> None:
        """Nothing to refresh: a server key does not expire."""

    def close(self) -> None:
        """Nothing to release."""


class _V1API:
    """The HTTP v1 API: ``POST /v1/projects/<p>/messages:send`` with an OAuth2 bearer token."""

    name = "v1"

    def __init__(self, credentials: _Credentials, project_id: Optional[str]) -> None:
        self._tokens = _TokenCache(credentials)
        self._project_id = project_id
        self._project_path = ""
        self.refreshable = credentials.refreshable

    def prepare(self, message: object, validate_only: bool) -> Tuple[str, bytes, Tuple[str, ...]]:
        checked = _check_message(message)
        body = _encode_json(checked)
        _check_data_sizes(checked, body)
        tail = b',"validate_only":true}' if validate_only else b',"validate_only":false}'
        return self.project_path() + "/messages:send", b'{"message":' + body + tail, ()

    def headers(self) -> Tuple[Dict[str, str], str]:
        token = self._tokens.get()
        return {"Authorization": "Bearer " + token, "Content-Type": "application/json"}, token

    def project_path(self) -> str:
        """``/v1/projects/<id>``, the project found once: given, in the key, environment, GCE."""
        if not self._project_path:
            credentials = self._tokens.credentials
            project = (
                self._project_id or credentials.project_id
                or os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT")
                or credentials.find_project_id()
            )
            if not project:
                raise AuthError(
                    "no Firebase project id: pass project_id= or set GOOGLE_CLOUD_PROJECT"
                )
            self._project_path = "/v1/projects/" + urllib.parse.quote(project, safe="")
        return self._project_path

    def invalidate(self, token: str) -> None:
        self._tokens.invalidate(token)

    def close(self) -> None:
        self._tokens.credentials.close()


# Client ######################################################################
# The public face: push one message, push many, manage topics.

#: Messages in flight at once in push_many, by default.
DEFAULT_CONCURRENCY = 50
# Outcomes push_many may hold per message in flight, sent or waiting to be consumed: room
# for the rest to go on while one waits out a retry's backoff, yet bounded.
_WINDOW_PER_WORKER = 64

Outcome = Union[Response, Exception]


class Client:
    """A thread-safe FCM client holding a pool of kept-alive connections.

    Make one with ``andpush.new(...)``, share it between threads, and close it (or use
    ``with``) when done. In a forked child it opens connections of its own.
    """

    def __init__(
        self,
        api: Union[_LegacyAPI, _V1API],
        transport: _Transport,
        retry: _Retry,
        rate_limit: Optional[float],
        http2: bool,
    ) -> None:
        self._api = api
        self._transport = transport
        self._retry = retry
        self._http2 = http2
        self._interval = 1.0 / rate_limit if rate_limit else 0.0
        self._pace_lock = threading.Lock()
        self._paused_until = 0.0
        self._next_slot = 0.0
        self._clock: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    def push(self, message: Dict[str, Any], *, validate_only: bool = False) -> Response:
        """Send one message; return the 2xx Response or raise an andpush.Error.

        ``validate_only`` asks FCM to check the message without delivering it. With the
        legacy API a 200 whose results hold per-token errors is a success: see
        ``Response.errors`` and ``Response.canonical_tokens``.
        """
        path, body, tokens = self._api.prepare(message, validate_only)
        response = self._send("POST", path, body)
        response._tokens = tokens
        return response

    def push_many(
        self,
        messages: Iterable[Dict[str, Any]],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> Iterator[Outcome]:
        """Send many messages at once; yield one outcome per message, in input order.

        An outcome is the Response, or the exception ``push()`` would have raised (an
        andpush.Error, or the TypeError/ValueError of a bad message, which is not sent).
        ``messages`` is read lazily; closing or dropping the iterator stops sending what
        has not started. ``progress(done, failed)`` is called from the sending threads.
        """
        _check_number("concurrency", concurrency, minimum=1, integer=True)
        first = self._h2_connection() if self._http2 else None
        if first is None:
            return self._map(self._outcome, messages, concurrency, progress)
        work = _Work(messages, concurrency * _WINDOW_PER_WORKER, progress)
        _H2Sender(self, work, first, concurrency)
        return _Outcomes(work, lambda: None)

    def subscribe(self, tokens: Iterable[str], topic: str) -> List[Outcome]:
        """Subscribe each token to ``topic``; one outcome per token, in order."""
        return self._manage_topic("POST", tokens, topic)

    def unsubscribe(self, tokens: Iterable[str], topic: str) -> List[Outcome]:
        """Unsubscribe each token from ``topic``; one outcome per token, in order."""
        return self._manage_topic("DELETE", tokens, topic)

    def close(self) -> None:
        """Close the idle connections; the client cannot send afterwards."""
        self._transport.close()
        self._api.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<andpush.Client %s %r>" % (self._api.name, self._transport.origin)

    def _send(self, method: str, path: str, body: bytes) -> Response:
        """Send a request, retrying as _Retry decides: the one loop every request goes through."""
        retry = self._retry
        while True:
            self._pace()
            headers, token = self._api.headers()
            try:
                response = self._transport.request(method, path, headers, body)
                if 200 <= response.status_code < 300:
                    return response
                error: Error = _http_error(response)
            except NetworkError as exc:
                error = exc
            step = self._after_failure(retry, error, token)
            if step is None:
                raise error
            retry, wait = step
            if wait:
                self._sleep(wait)

    def _after_failure(
        self, retry: _Retry, error: Error, token: str
    ) -> Optional[Tuple[_Retry, float]]:
        """Act on a failed attempt (pause on 429, forget a rejected token); say if to retry."""
        if isinstance(error, QuotaExceededError):
            self._pause(_quota_wait(error))
        step = retry.after(error)
        if step is not None:
            log.info("retrying in %.2f s after: %s", step[1], error)
            if _is_rejected_token(error):
                self._api.invalidate(token)
        return step

    def _pace(self) -> None:
        """Wait out a client-wide pause (after a 429), then for a slot under rate_limit."""
        wait = self._reserve_send() - self._clock()
        if wait > 0:
            self._sleep(wait)

    def _reserve_send(self) -> float:
        """Claim the next moment a send may start (``_clock`` time), for rate_limit and 429."""
        with self._pace_lock:
            start = max(self._clock(), self._paused_until, self._next_slot)
            if self._interval:
                self._next_slot = start + self._interval
        return start

    def _pause(self, seconds: float) -> None:
        """Hold every new send of this client for ``seconds``: the project is over quota."""
        with self._pace_lock:
            self._paused_until = max(self._paused_until, self._clock() + seconds)

    def _h2_connection(self) -> Optional[_H2Connection]:
        """An HTTP/2 connection for push_many, or None to send over HTTP/1.1."""
        try:
            return self._transport.connect_h2()
        except NetworkError:
            return None  # the HTTP/1.1 path reports the failure, message by message

    def _outcome(self, message: Dict[str, Any]) -> Outcome:
        try:
            return self.push(message)
        except (Error, TypeError, ValueError) as exc:
            return exc

    def _manage_topic(self, method: str, tokens: Iterable[str], topic: str) -> List[Outcome]:
        if not isinstance(topic, str):
            raise TypeError("topic must be a str, got %s" % type(topic).__name__)
        _check_topic(topic)
        if isinstance(tokens, str):
            raise TypeError("tokens must be a list of str, not one str")
        tokens = list(tokens)
        for token in tokens:
            if not isinstance(token, str) or not token:
                raise ValueError("every token must be a non-empty str")
        base = self._api.project_path() + "/registrations/"
        quoted_topic = urllib.parse.quote(topic, safe="")

        def manage(token: str) -> Outcome:
            path = base + urllib.parse.quote(token, safe="") + "/topicSubscriptions"
            if method == "POST":
                path += "?topic_name=" + quoted_topic
            else:
                path += "/" + quoted_topic
            try:
                return self._send(method, path, b"{}" if method == "POST" else b"")
            except HTTPError as exc:
                return exc.response if exc.error_code == "ALREADY_EXISTS" or (
                    exc.status_code == 409) else exc
            except Error as exc:
                return exc

        return list(self._map(manage, tokens, min(len(tokens), DEFAULT_CONCURRENCY) or 1, None))

    def _map(
        self,
        work: Callable[[Any], Outcome],
        items: Iterable[Any],
        threads: int,
        progress: Optional[Callable[[int, int], None]],
    ) -> "_Outcomes":
        """``work`` over ``items`` on ``threads`` threads, each with a connection of its own."""
        shared = _Work(items, threads * _WINDOW_PER_WORKER, progress)
        self._transport.widen(threads)
        for _ in range(threads):
            threading.Thread(target=shared.run, args=(work,), name="andpush-push_many",
                             daemon=True).start()
        return _Outcomes(shared, lambda: self._transport.widen(-threads))


class _Outcomes(Iterator[Outcome]):
    """What push_many returns: the outcomes in input order, from whoever sends them.

    Closing or dropping it stops the sending of what has not started.
    """

    def __init__(self, work: "_Work", on_close: Callable[[], None]) -> None:
        self._work = work
        self._on_close: Optional[Callable[[], None]] = on_close

    def __next__(self) -> Outcome:
        try:
            return self._work.next_outcome()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop sending what has not started; outcomes not yet yielded are dropped."""
        if self._on_close is not None:
            self._work.stop()
            self._on_close()
            self._on_close = None

    def __del__(self) -> None:
        self.close()


class _Work:
    """The input of a push_many and its outcomes, shared by the senders and the consumer.

    Senders take items lazily and at most ``window`` ahead of the consumer, so memory
    stays bounded however many items there are.
    """

    def __init__(
        self,
        items: Iterable[Any],
        window: int,
        progress: Optional[Callable[[int, int], None]],
    ) -> None:
        self._items = iter(items)
        self._window = window
        self._progress = progress
        self._condition = threading.Condition()
        self._outcomes: Dict[int, Outcome] = {}
        self._read = 0          # items taken from the input
        self._yielded = 0       # outcomes handed to the consumer
        self._done = 0
        self._failed = 0
        self.exhausted = False
        self.stopped = False
        self._error: Optional[BaseException] = None
        self.wake: Callable[[], None] = lambda: None  # a sender's "the window moved"
        self._sender_waits = False  # a sender found the window full and wants a wake

    def run(self, work: Callable[[Any], Outcome]) -> None:
        """A sending thread: work items, one at a time, until there are none."""
        while True:
            taken = self.take(1, block=True)
            if not taken:
                return
            index, item = taken[0]
            self.store([(index, work(item))])

    def take(self, most: int, block: bool) -> List[Tuple[int, Any]]:
        """Up to ``most`` items with their indexes; none when the input is done (or, not
        blocking, while the window is full)."""
        taken: List[Tuple[int, Any]] = []
        with self._condition:
            while not self.stopped and self._read - self._yielded >= self._window:
                if not block:
                    self._sender_waits = True
                    return taken
                self._condition.wait()
            room = min(most, self._window - (self._read - self._yielded))
            while len(taken) < room and not (self.stopped or self.exhausted):
                try:
                    taken.append((self._read, next(self._items)))
                except StopIteration:
                    self.exhausted = True
                    self._condition.notify_all()
                except BaseException as exc:  # the caller's generator failed: hand it over
                    self.exhausted, self._error = True, exc
                    self._condition.notify_all()
                else:
                    self._read += 1
            if not block and len(taken) < most and not self.exhausted:
                self._sender_waits = True
        return taken

    def store(self, outcomes: List[Tuple[int, Outcome]]) -> None:
        """Hand over finished outcomes (by their items' indexes); report progress."""
        with self._condition:
            for index, outcome in outcomes:
                self._outcomes[index] = outcome
                self._failed += isinstance(outcome, Exception)
            self._done += len(outcomes)
            counts = self._done, self._failed
            self._condition.notify_all()
        if self._progress is not None:
            self._progress(*counts)

    def crash(self, error: BaseException) -> None:
        """A sender died: the consumer gets ``error`` instead of the outcomes still due."""
        with self._condition:
            self._error, self.exhausted, self._read = error, True, self._yielded
            self._outcomes.clear()
            self._condition.notify_all()

    def next_outcome(self) -> Outcome:
        with self._condition:
            while self._yielded not in self._outcomes:
                if self.stopped:
                    raise StopIteration
                if self.exhausted and self._yielded == self._read:
                    if self._error is not None:
                        error, self._error = self._error, None
                        raise error
                    raise StopIteration
                self._condition.wait()
            if self.stopped:
                raise StopIteration
            outcome = self._outcomes.pop(self._yielded)
            self._yielded += 1
            self._condition.notify_all()
            wake, self._sender_waits = self._sender_waits, False
        if wake:
            self.wake()
        return outcome

    def stop(self) -> None:
        with self._condition:
            self.stopped = True
            self._condition.notify_all()
        self.wake()


class _H2Job:
    """One message of push_many on its way through the HTTP/2 sender."""

    __slots__ = ("index", "path", "body", "tokens", "retry", "token", "paced", "refusals")

    def __init__(self, index: int, path: str, body: bytes, tokens: Tuple[str, ...],
                 retry: _Retry) -> None:
        self.index = index
        self.path = path
        self.body = body
        self.tokens = tokens
        self.retry = retry
        self.token = ""            # the access token it was last sent with
        self.paced = False         # it waits for the moment rate_limit gave it
        self.refusals = 0          # times a server refused it unprocessed


class _H2Sender:
    """push_many over HTTP/2: one thread drives every connection with a selector.

    Each wake-up reads every ready socket until it would block, starts streams for the
    slots that freed up, and writes once per connection. Streams per connection follow
    the server's SETTINGS_MAX_CONCURRENT_STREAMS; more concurrency opens more connections.
    """

    def __init__(self, client: "Client", work: "_Work", first: _H2Connection,
                 concurrency: int) -> None:
        self._client = client
        self._work = work
        self._concurrency = concurrency
        self._connections: List[_H2Connection] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        work.wake = self._wake
        self._ready: Deque[_H2Job] = collections.deque()
        self._timers: List[Tuple[float, int, _H2Job]] = []
        self._timer_seq = 0
        self._jobs = 0                     # taken from the input and not finished
        self._outcomes: List[Tuple[int, Outcome]] = []  # finished, for _Work in one go
        self._add(first)
        threading.Thread(target=self._run, name="andpush-h2", daemon=True).start()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        try:
            while not self._work.stopped and not (self._work.exhausted and not self._jobs):
                self._take()
                self._start_streams()
                for connection in self._connections:
                    self._flush(connection)
                self._hand_over()
                self._wait()
                self._expire()
            self._hand_over()
        except BaseException as exc:  # a bug or a KeyboardInterrupt: hand it to the consumer
            self._work.crash(exc)
        finally:
            for connection in self._connections:
                connection.close()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _hand_over(self) -> None:
        """Give the consumer the outcomes finished since the last time, in one go."""
        if self._outcomes:
            self._work.store(self._outcomes)
            self._outcomes = []

    def _take(self) -> None:
        """Take messages from the input while fewer than ``concurrency`` are under way."""
        for index, message in self._work.take(self._concurrency - self._jobs, block=False):
            try:
                path, body, tokens = self._client._api.prepare(message, False)
            except (Error, TypeError, ValueError) as exc:
                self._outcomes.append((index, exc))
                continue
            self._jobs += 1
            self._ready.append(_H2Job(index, path, body, tokens, self._client._retry))

    def _start_streams(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            self._ready.append(heapq.heappop(self._timers)[2])
        connection: Optional[_H2Connection] = None
        while self._ready:
            if connection is None or not connection.free_streams:
                if connection is not None:
                    self._flush(connection)
                connection = self._connection_with_room()
                if connection is None:
                    return
            job = self._ready.popleft()
            if not job.paced:
                delay = self._client._reserve_send() - self._client._clock()
                if delay > 0:
                    job.paced = True
                    self._schedule(job, delay)
                    continue
            job.paced = False
            try:
                headers, job.token = self._client._api.headers()
            except Error as exc:
                self._finish(job, exc)
                continue
            connection.start("POST", job.path, headers, job.body, job, now)
            if connection.pending_output >= _H2_WRITE_BATCH:
                self._flush(connection)  # the first answers come sooner

    def _connection_with_room(self) -> Optional[_H2Connection]:
        """A connection that may start a stream, opening one when all are full."""
        for connection in self._connections:
            if connection.free_streams:
                return connection
        if any(not c.settled for c in self._connections):
            return None  # wait for its SETTINGS: it may have room
        if sum(len(c.streams) for c in self._connections) >= self._concurrency:
            return None
        try:
            opened = self._client._transport.connect_h2()
            if opened is None:
                raise NetworkError("the server stopped offering HTTP/2",
                                   may_have_been_delivered=False)
        except NetworkError as exc:
            if not self._connections:  # else the open ones carry on
                self._failed(self._ready.popleft(), exc)
            return None
        self._add(opened)
        return opened

    def _add(self, connection: _H2Connection) -> None:
        connection.sock.setblocking(False)
        self._connections.append(connection)
        self._selector.register(connection.sock, selectors.EVENT_READ, connection)

    def _flush(self, connection: _H2Connection) -> None:
        try:
            connection.flush()
        except OSError as exc:
            connection.fail("the connection broke: %s" % _reason(exc))
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.pending_output else 0)
        self._selector.modify(connection.sock, events, connection)

    def _wait(self) -> None:
        """Sleep until a socket, a timer or the consumer has something; handle it."""
        deadline = min([c.next_deadline() for c in self._connections]
                       + [self._timers[0][0] if self._timers else math.inf])
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._read(key.data)

    def _read(self, connection: _H2Connection) -> None:
        try:
            if not connection.read_available():
                connection.fail("the server closed the connection")
        except _H2Error as exc:
            connection.abort(exc)
        except OSError as exc:
            connection.fail("the connection broke: %s" % _reason(exc))
        self._settle(connection)

    def _expire(self) -> None:
        now = time.monotonic()
        for connection in list(self._connections):
            connection.expire(now)
            self._settle(connection)

    def _settle(self, connection: _H2Connection) -> None:
        """Hand out the outcomes of finished streams; drop a connection that is done."""
        for stream in connection.finished:
            job = stream.key
            assert isinstance(job, _H2Job)
            outcome = stream.outcome
            if isinstance(outcome, _Refused) and job.refusals < _H2_REFUSALS:
                job.refusals += 1
                self._ready.appendleft(job)  # not processed: send again, no retry spent
            elif isinstance(outcome, _Refused):
                self._failed(job, NetworkError(
                    "the server refused the stream %d times" % job.refusals,
                    may_have_been_delivered=False))
            elif isinstance(outcome, Response) and 200 <= outcome.status_code < 300:
                outcome._tokens = job.tokens
                self._finish(job, outcome)
            elif isinstance(outcome, Response):
                self._failed(job, _http_error(outcome))
            else:
                assert isinstance(outcome, Error)
                self._failed(job, outcome)
        connection.finished.clear()
        if connection.closed or (not connection.free_streams and not connection.streams
                                 and connection.last_stream_id != _H2_LAST_STREAM):
            self._selector.unregister(connection.sock)
            self._connections.remove(connection)
            connection.close()

    def _failed(self, job: _H2Job, error: Error) -> None:
        step = self._client._after_failure(job.retry, error, job.token)
        if step is None:
            self._finish(job, error)
        else:
            job.retry, wait = step
            self._schedule(job, wait)

    def _schedule(self, job: _H2Job, delay: float) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (time.monotonic() + delay, self._timer_seq, job))

    def _finish(self, job: _H2Job, outcome: Outcome) -> None:
        self._jobs -= 1
        self._outcomes.append((job.index, outcome))


def new(
    server_key: Optional[str] = None,
    *,
    credentials: Union[None, str, "os.PathLike[str]", Dict[str, Any]] = None,
    project_id: Optional[str] = None,
    access_token: Union[None, str, Callable[[], str]] = None,
    endpoint: str = DEFAULT_ENDPOINT,
    ssl_context: Optional[ssl.SSLContext] = None,
    timeout: Optional[float] = None,
    pool_size: int = DEFAULT_POOL_SIZE,
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
    proxy: Optional[str] = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
    rate_limit: Optional[float] = None,
    http2: bool = True,
) -> Client:
    """Create a client for the v1 API (``credentials``, ``access_token``, or Application
    Default Credentials when given nothing) or the legacy API (``server_key``).

    ``timeout`` (seconds) bounds connecting and each read; ``rate_limit`` is the most
    messages a second the client sends. With ``http2`` (the default) the client offers
    HTTP/2 by ALPN (on ``ssl_context`` too) and push_many multiplexes when the server
    accepts; ``http2=False`` keeps to HTTP/1.1.
    """
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise TypeError("ssl_context must be an ssl.SSLContext")
    connect_timeout, read_timeout = _timeouts(timeout)
    _check_number("pool_size", pool_size, minimum=1, integer=True)
    _check_number("keep_alive_timeout", keep_alive_timeout, minimum=0)
    _check_number("max_retries", max_retries, minimum=0, integer=True)
    _check_number("backoff_factor", backoff_factor, minimum=0)
    if rate_limit is not None:
        _check_number("rate_limit", rate_limit, minimum=0, exclusive=True)
    if _Origin(endpoint, None).scheme != "https":
        raise ValueError("endpoint must use https://, got %r" % endpoint)
    context = ssl_context or ssl.create_default_context()
    if http2:
        context.set_alpn_protocols(["h2", "http/1.1"])
    connect = _Connector(context, connect_timeout, read_timeout, keep_alive_timeout, proxy)
    api = _api(server_key, credentials, project_id, access_token, connect)
    retry = _Retry(max_retries, backoff_factor, may_refresh=api.refreshable)
    return Client(api, connect(endpoint, pool_size), retry, rate_limit, http2)


build = new


def _api(
    server_key: Optional[str],
    credentials: object,
    project_id: Optional[str],
    access_token: Union[None, str, Callable[[], str]],
    connect: "_Connector",
) -> Union[_LegacyAPI, _V1API]:
    """The API the options select, with its credentials loaded."""
    if project_id is not None and (not isinstance(project_id, str) or not project_id):
        raise ValueError("project_id must be a non-empty str")
    given = [n for n, v in (("server_key", server_key), ("credentials", credentials),
                            ("access_token", access_token)) if v is not None]
    if len(given) > 1:
        raise ValueError("pass only one of server_key, credentials and access_token")
    if server_key is not None:
        return _LegacyAPI(_check_server_key(server_key))
    if access_token is not None:
        if not isinstance(access_token, str) and not callable(access_token):
            raise TypeError("access_token must be a str or a callable returning one")
        if project_id is None:
            raise ValueError("access_token needs project_id= as well")
        return _V1API(_StaticToken(access_token, project_id), project_id)
    if credentials is not None:
        return _V1API(_load_credentials(credentials, connect), project_id)
    return _V1API(_application_default_credentials(connect), project_id)


def _check_server_key(server_key: object) -> str:
    if not isinstance(server_key, str):
        raise TypeError("server_key must be a str, got %s" % type(server_key).__name__)
    if not server_key.strip():
        raise ValueError("server_key is empty; pass the server key from the Firebase console")
    if any(c in server_key for c in "\r\n\0"):
        raise ValueError("server_key contains a line break or NUL; strip it from the key")
    return server_key.strip()


def _check_number(
    name: str, value: object, minimum: float, integer: bool = False, exclusive: bool = False
) -> None:
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
        or value < minimum or (exclusive and value == minimum)
    ):
        raise ValueError("%s must be %s %s %s, got %r" % (
            name, "an int" if integer else "a number", ">" if exclusive else ">=", minimum, value,
        ))


def _timeouts(timeout: Optional[float]) -> Tuple[float, float]:
    if timeout is None:
        return DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT
    _check_number("timeout", timeout, minimum=0, exclusive=True)
    return float(timeout), float(timeout)


# Command line ################################################################
# `andpush COMMAND` (or `python -m andpush`): send, send to many, topics, tokens, checks.
# argparse is imported by the functions that need it, so that `import andpush` does not
# pay for it: only the command line uses it.

if TYPE_CHECKING:
    import argparse

# Exit statuses: what a script calling andpush does next. Usage errors keep argparse's 2;
# the others are sysexits.h's, which cron wrappers and service managers know.
_EXIT_OK = 0             # everything was sent
_EXIT_FAILED = 1         # FCM refused some messages (or topic changes): see what it said
_EXIT_USAGE = 2          # a wrong option, file or message: fix the command
_EXIT_TEMPFAIL = 75      # EX_TEMPFAIL: the network or FCM is down: try again later
_EXIT_NOPERM = 77        # EX_NOPERM: no or refused credentials, no permission or project
_EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
_EXIT_CLOSED_OUTPUT = 141  # stdout's reader went away (| head): 128 + SIGPIPE, as shells

_SERVER_KEY_VARIABLE = "ANDPUSH_SERVER_KEY"
_CHECK_TOPIC = "andpush-check"  # the topic `andpush check` validates a message for
_TARGET_FIELDS = _TARGETS + ("to", "registration_ids")  # v1 and legacy targets
_UNREGISTERED_CODES = ("UNREGISTERED", "NotRegistered")  # v1 and legacy: delete the token
_BAR_INTERVAL = 0.1    # seconds between redraws of the progress bar on a terminal
_LINE_INTERVAL = 2.0   # seconds between progress lines when stderr is not a terminal
_BAR_WIDTH = 20        # characters between the brackets of the progress bar, at most
_BAR_MIN_WIDTH = 10    # ... and at least: on a narrower terminal, no bar
_DEFAULT_COLUMNS = 80  # the width of a terminal that does not say
# new()'s arguments that the library's messages name, and the options that set them here.
_OPTIONS_OF_ARGUMENTS = {
    "credentials": "--credentials", "server_key": "--server-key",
    "project_id": "--project-id", "endpoint": "--endpoint", "timeout": "--timeout",
    "proxy": "--proxy", "max_retries": "--max-retries",
}

_DESCRIPTION = """\
Send Firebase Cloud Messaging (FCM) messages from the shell: one message, one message
to a list of device tokens (with progress, results and a list of dead tokens), topic
subscriptions, and a check that the credentials and project work."""

_EPILOG = """\
examples:
  andpush --credentials key.json check
  andpush send --token "$TOKEN" --title Hello --body "It works" --data order=42
  andpush send-many --tokens tokens.txt --title Update --body "Version 2 is out" \\
      --results results.jsonl --unregistered dead-tokens.txt

credentials: --credentials FILE (a service account key file), else Application Default
Credentials (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`,
or the metadata server on Google Cloud). The legacy API takes a server key, best from
the ANDPUSH_SERVER_KEY environment variable.

proxy: --proxy URL, else HTTPS_PROXY and NO_PROXY from the environment; --proxy ''
connects directly whatever the environment says.

exit status:
  0    everything was sent
  1    FCM refused some messages or tokens (the others were sent)
  2    usage error: a wrong option, file or message; fix the command
  75   the network or FCM is down (after the retries): try again later
  77   credentials missing or refused, no permission, or no such project: fix the setup
  130  interrupted (Ctrl-C); what was not sent yet was not sent
  141  the output was closed (as by `| head`); sending stopped there
Run 'andpush COMMAND --help' for a command's options."""


class _Failure(Exception):
    """Ends a command with one error line and an exit status (by default: a usage error)."""

    def __init__(self, message: str, status: int = _EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def _parser() -> "argparse.ArgumentParser":
    import argparse

    class Parser(argparse.ArgumentParser):
        """An ArgumentParser whose errors are one line, printed (and exited on) by main()."""

        def error(self, message: str) -> NoReturn:
            raise _Failure(message)

    parser = Parser(
        prog="andpush", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version="andpush " + __version__)
    _add_global_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    every_command: List[argparse.ArgumentParser] = []  # get the global options last

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=description)
        every_command.append(sub)
        return sub

    send = command("send", "send one message", "Send one message to a device token, a topic "
                   "or a condition, and print FCM's answer (JSON) on stdout.")
    targets = send.add_argument_group("target (one of)").add_mutually_exclusive_group()
    targets.add_argument("--token", help="the device token to send to")
    targets.add_argument("--topic", metavar="NAME", help="the topic to send to (no /topics/)")
    targets.add_argument("--condition", metavar="EXPRESSION",
                         help="a topic condition, e.g. \"'news' in topics && 'eu' in topics\"")
    _add_content_options(send)
    send.add_argument("--validate-only", action="store_true",
                      help="ask FCM to check the message without delivering it (dry run)")
    send.set_defaults(run=_cmd_send)

    many = command("send-many", "send one message to many device tokens", "Send the same "
                   "message to every device token of a file, many at once. Progress and a "
                   "summary go to stderr. Ctrl-C stops cleanly: what was not sent yet is not "
                   "sent, the summary so far is printed, and the exit status is 130.")
    many.add_argument("--tokens", metavar="FILE", required=True,
                      help="the device tokens, one a line (- reads stdin); blank lines and "
                      "lines starting with # are skipped")
    _add_content_options(many)
    many.add_argument("--concurrency", metavar="N", type=_positive_int,
                      default=DEFAULT_CONCURRENCY,
                      help="messages in flight at once (default: %(default)s)")
    many.add_argument("--rate", metavar="N", type=_positive_float,
                      help="send at most N messages a second (default: no limit)")
    many.add_argument("--results", metavar="FILE",
                      help="write one JSON object a line per token (- for stdout): token, ok, "
                      "status, error (FCM's error code), message (its name or id), detail")
    many.add_argument("--unregistered", metavar="FILE",
                      help="write the tokens FCM no longer knows, one a line, to delete them")
    many.add_argument("-q", "--quiet", action="store_true",
                      help="show no progress (the summary is still printed)")
    many.set_defaults(run=_cmd_send_many)

    for name, verb in (("subscribe", "subscribe device tokens to"),
                       ("unsubscribe", "unsubscribe device tokens from")):
        topic = command(name, verb + " a topic", verb.capitalize() + " a topic; each failed "
                        "token gets a line on stderr (by its position, not its value).")
        topic.add_argument("--topic", metavar="NAME", required=True, help="the topic")
        topic.add_argument("--tokens", metavar="FILE",
                           help="device tokens, one a line (- reads stdin)")
        topic.add_argument("--token", action="append", help="a device token; repeat for more")
        topic.set_defaults(run=_cmd_topic, subscribe=name == "subscribe")

    token = command("token", "print an access token (e.g. for curl)", "Print an OAuth2 access "
                    "token for the FCM v1 API, made from the credentials, as in: curl -H "
                    "\"Authorization: Bearer $(andpush token)\" ... It is valid for an hour "
                    "and as secret as the key itself.")
    token.set_defaults(run=_cmd_token)

    check = command("check", "check that the credentials and project work", "Get an access "
                    "token and have FCM validate, not deliver, a test message to --token or to "
                    "the topic " + _CHECK_TOPIC + "; then say whether the credentials and "
                    "project work, and if not, why. Exit status 0: they work; 1: they do, but "
                    "FCM refused --token; 77: they do not; 75: FCM could not be reached.")
    check.add_argument("--token", help="a device token to validate the test message for")
    check.set_defaults(run=_cmd_check)
    for sub in every_command:
        _add_global_options(sub, defaults=False)
    return parser


def _add_global_options(parser: "argparse.ArgumentParser", defaults: bool) -> None:
    """The options every command takes, before or after its name.

    The subcommands' copies default to SUPPRESS, so that they leave a value given before
    the command alone and override it only when given after.
    """
    import argparse

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument("--credentials", metavar="FILE", default=default(None),
                       help="a service account key file (default: Application Default "
                       "Credentials)")
    group.add_argument("--server-key", metavar="KEY", default=default(None),
                       help="use the legacy API with this server key; better set "
                       + _SERVER_KEY_VARIABLE + ": a key on the command line ends up in "
                       "the shell history and in ps")
    group.add_argument("--project-id", metavar="ID", default=default(None),
                       help="the Firebase project (default: the key file's)")
    group.add_argument("--endpoint", metavar="URL", default=default(DEFAULT_ENDPOINT),
                       help="where FCM is, e.g. a local server or a gateway (default: "
                       + DEFAULT_ENDPOINT + ")")
    group.add_argument("--cafile", metavar="FILE", default=default(None),
                       help="trust the CA certificates in this PEM file instead of the "
                       "system's")
    group.add_argument("--timeout", metavar="SECONDS", type=_positive_float,
                       default=default(None), help="for connecting and for each answer")
    group.add_argument("--max-retries", metavar="N", type=_whole_number,
                       default=default(DEFAULT_MAX_RETRIES),
                       help="times a send that failed but may work later (no connection, "
                       "FCM unavailable) is retried, with growing pauses; 0 fails at once "
                       "(default: %d)" % DEFAULT_MAX_RETRIES)
    group.add_argument("--proxy", metavar="URL", default=default(None),
                       help="connect through this http://[user:pass@]host:port proxy "
                       "(default: HTTPS_PROXY and NO_PROXY; '' for none)")
    group.add_argument("-v", "--verbose", action="store_true", default=default(False),
                       help="log what andpush does, and show tracebacks, on stderr")


def _add_content_options(parser: "argparse.ArgumentParser") -> None:
    group = parser.add_argument_group("message content")
    group.add_argument("--title", help="the notification title")
    group.add_argument("--body", help="the notification body")
    group.add_argument("--image", metavar="URL", help="the notification image")
    group.add_argument("--data", metavar="KEY=VALUE", action="append", type=_key_value,
                       help="a data field; repeat for more")
    group.add_argument("--message", metavar="FILE",
                       help="the message as JSON (- reads stdin): a v1 Message, or a legacy "
                       "request body with a server key; the options above are merged into it")
    group.add_argument("--allow-empty", action="store_true",
                       help="send a message with no content (no title, body, image, data or "
                       "--message), which is refused otherwise")


def _key_value(text: str) -> Tuple[str, str]:
    import argparse

    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError("expected KEY=VALUE, got %r" % text)
    return key, value


def _positive_int(text: str) -> int:
    return _int_from(text, minimum=1, wanted="a positive whole number")


def _whole_number(text: str) -> int:
    return _int_from(text, minimum=0, wanted="a whole number, 0 or more")


def _int_from(text: str, minimum: int, wanted: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError("expected %s, got %r" % (wanted, text))
    return value


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError("expected a positive number, got %r" % text)
    return value


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.verbose:
            logging.basicConfig(
                stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
            )
            log.setLevel(logging.DEBUG)
        if args.command is None:
            parser.print_help(sys.stderr)
            return _EXIT_USAGE
        status = int(args.run(args))
        sys.stdout.flush()  # a closed pipe shows here, while it can still be handled
        return status
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else _EXIT_OK
    except KeyboardInterrupt:
        _say("interrupted")
        return _EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout is gone (| head): nothing to tell it
        _discard_stdout()
        return _EXIT_CLOSED_OUTPUT
    except _Failure as exc:
        return _fail(exc, str(exc), exc.status)
    except Error as exc:
        return _fail(exc, _explain(exc), _exit_status(exc))


def _fail(exc: BaseException, message: str, status: int) -> int:
    log.debug("the command failed:", exc_info=exc)  # the traceback, with --verbose
    _say("error: " + _in_option_terms(message))
    return status


def _in_option_terms(message: str) -> str:
    """A library message as the command line says it: ``pass credentials= or ...`` becomes
    ``pass --credentials or ...``, ``proxy=""`` becomes ``--proxy ""``."""
    def option(match: "re.Match[str]") -> str:
        more = match.end() < len(match.string)  # a value or words follow the name
        return _OPTIONS_OF_ARGUMENTS[match.group(1)] + (" " if more else "")

    return re.sub(r"(?<![-\w])(%s)= ?" % "|".join(_OPTIONS_OF_ARGUMENTS), option, message)


def _discard_stdout() -> None:
    """Point stdout at the null device: what is still buffered for a reader that is gone
    would fail again, noisily, when Python flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout: nothing at exit
        pass


def _say(text: str) -> None:
    print("andpush: " + text, file=sys.stderr, flush=True)


# What went wrong, in the user's terms: whose fault, what to do, and the exit status.

def _is_systemic(error: object) -> bool:
    """Whether an error would fail any message alike: credentials, permission, network."""
    return isinstance(error, NetworkError) or _is_refused_sender(error)


def _is_refused_sender(error: object) -> bool:
    """No or refused credentials, or FCM's own 401 or 403 (UNAUTHENTICATED,
    PERMISSION_DENIED): not the APNs credentials' 401, not a token's SENDER_ID_MISMATCH."""
    if isinstance(error, AuthError):
        return True
    return isinstance(error, HTTPError) and (
        error.status_code == 401 and not isinstance(error, ThirdPartyAuthError)
        or error.status_code == 403 and not isinstance(error, SenderIdMismatchError)
    )


def _is_missing_project(error: object) -> bool:
    """A 404 from messages:send that is not about a token: no such project (or endpoint)."""
    return (
        isinstance(error, HTTPError) and error.status_code == 404
        and not isinstance(error, UnregisteredError)
    )


def _is_outage(error: object) -> bool:
    """A failure that sending later may cure: no connection, FCM unavailable or over quota
    (after the retries)."""
    return isinstance(error, (NetworkError, ServerError, QuotaExceededError))


def _exit_status(error: Error) -> int:
    if _is_refused_sender(error) or _is_missing_project(error):
        return _EXIT_NOPERM
    return _EXIT_TEMPFAIL if _is_outage(error) else _EXIT_FAILED


def _explain(error: BaseException) -> str:
    """One line: what went wrong, what to do where that is clear, and the error itself."""
    if isinstance(error, NetworkError):
        return "network problem, try again later: %s" % error
    if isinstance(error, ThirdPartyAuthError):
        advice = "FCM refused the project's APNs certificate or web push key"
    elif isinstance(error, HTTPError) and error.status_code == 401:
        advice = "FCM refused the credentials; check the key file (--credentials) or the " \
            "server key (" + _SERVER_KEY_VARIABLE + ")"
    elif isinstance(error, SenderIdMismatchError):
        advice = "the device token belongs to another Firebase project"
    elif isinstance(error, HTTPError) and error.status_code == 403:
        advice = (
            "permission denied: the service account needs a role with the permission "
            "cloudmessaging.messages.create (e.g. Firebase Cloud Messaging API Admin), and "
            "the Firebase Cloud Messaging API must be enabled for the project"
        )
    elif isinstance(error, AuthError):  # after the 401 and 403, which may be AuthErrors too
        return "credentials problem: %s" % error
    elif isinstance(error, ServerError):
        advice = "FCM failed or is unavailable; try again later"
    elif isinstance(error, QuotaExceededError):
        advice = "over an FCM quota (the project's, a topic's or a device's); send more " \
            "slowly, or later"
    elif isinstance(error, UnregisteredError):
        advice = "the device token is no longer valid; delete it"
    elif _is_missing_project(error):
        advice = "not found: check the project id (--project-id, or project_id in the key " \
            "file) and --endpoint"
    else:
        return str(error)
    return "%s (%s)" % (advice, error)


# Building a client and messages from the options.

def _client(args: "argparse.Namespace", rate_limit: Optional[float] = None) -> Client:
    """The client the global options describe (legacy when given a server key)."""
    server_key = args.server_key
    if server_key is not None and args.credentials is not None:
        raise _Failure("give --credentials or --server-key, not both")
    if server_key is None and args.credentials is None:
        server_key = os.environ.get(_SERVER_KEY_VARIABLE) or None
    context = None
    if args.cafile:
        try:
            context = ssl.create_default_context(cafile=args.cafile)
        except OSError as exc:  # ssl.SSLError too: not PEM certificates
            raise _Failure(
                "cannot use --cafile %r: %s" % (args.cafile, exc.strerror or exc)) from None
    try:
        return new(
            server_key, credentials=args.credentials, project_id=args.project_id,
            endpoint=args.endpoint, ssl_context=context, timeout=args.timeout,
            proxy=args.proxy, max_retries=args.max_retries, rate_limit=rate_limit,
        )
    except (TypeError, ValueError) as exc:
        raise _Failure(_about_option(str(exc), args)) from None


def _about_option(message: str, args: "argparse.Namespace") -> str:
    """new()'s message about one of its arguments (``endpoint must use https://...``), about
    the option or variable that set it instead (``--endpoint must use https://...``)."""
    name, space, rest = message.partition(" ")
    if name == "server_key" and args.server_key is None:
        return _SERVER_KEY_VARIABLE + space + rest
    return _OPTIONS_OF_ARGUMENTS.get(name, name) + space + rest


def _is_legacy(client: Client) -> bool:
    return isinstance(client._api, _LegacyAPI)


def _check_ready(client: Client, message: Optional[Dict[str, Any]] = None) -> None:
    """Fail before the first send when no access token comes, or the message is wrong."""
    api = client._api
    if isinstance(api, _V1API):
        api.headers()
    if message is not None:
        try:
            api.prepare(message, False)  # finds the project too
        except (TypeError, ValueError) as exc:
            raise _Failure("bad message: %s" % exc) from None


def _message(args: "argparse.Namespace") -> Dict[str, Any]:
    """The content options as a message: --message's JSON with the other options merged in."""
    message = _read_message(args.message) if args.message else {}
    notification = {
        name: getattr(args, name) for name in ("title", "body", "image")
        if getattr(args, name) is not None
    }
    if notification:
        message["notification"] = dict(_object_field(message, "notification"), **notification)
    if args.data:
        message["data"] = dict(_object_field(message, "data"), **dict(args.data))
    return message


def _check_content(message: Dict[str, Any], args: "argparse.Namespace") -> None:
    """Refuse a message with nothing but a target, a slip more often than a wish, unless
    --allow-empty asks for one (send-many would push it to every token)."""
    if not args.allow_empty and all(name in _TARGET_FIELDS for name in message):
        raise _Failure("the message has no content: give --title, --body, --image, --data or "
                       "--message, or --allow-empty to send it without any")


def _read_message(path: str) -> Dict[str, Any]:
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        message = json.loads(text)
    except OSError as exc:
        raise _Failure("cannot read --message %r: %s" % (path, exc.strerror or exc)) from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError
        raise _Failure("--message %r is not JSON: %s" % (path, exc)) from None
    if isinstance(message, dict) and list(message) == ["message"]:
        message = message["message"]  # a whole v1 request body: {"message": {...}}
    if not isinstance(message, dict):
        raise _Failure("--message %r must hold a JSON object" % path)
    return message


def _object_field(message: Dict[str, Any], name: str) -> Dict[str, Any]:
    value = message.get(name, {})
    if not isinstance(value, dict):
        raise _Failure("%r in the --message file must be a JSON object" % name)
    return value


def _with_target(
    message: Dict[str, Any], args: "argparse.Namespace", legacy: bool
) -> Dict[str, Any]:
    """The message sent to the target the options name (instead of the file's, if any)."""
    if args.token:
        field, value = ("to" if legacy else "token"), args.token
    elif args.topic:
        field, value = ("to", "/topics/" + args.topic) if legacy else ("topic", args.topic)
    elif args.condition:
        field, value = "condition", args.condition
    elif any(name in message for name in _TARGET_FIELDS):
        return message
    else:
        raise _Failure("no target: give --token, --topic or --condition")
    message = {name: value for name, value in message.items() if name not in _TARGET_FIELDS}
    message[field] = value
    return message


def _open(path: str, what: str, stack: contextlib.ExitStack, write: bool = False) -> TextIO:
    """The file at ``path`` (``-``: stdin, or stdout when writing), closed with ``stack``."""
    if path == "-":
        return sys.stdout if write else sys.stdin
    try:
        file = open(path, "w" if write else "r", encoding="utf-8")
    except OSError as exc:
        raise _Failure("cannot %s %s %r: %s" % (
            "write" if write else "read", what, path, exc.strerror or exc)) from None
    return stack.enter_context(file)


def _tokens_in(lines: Iterable[str], path: str) -> Iterator[str]:
    """The device tokens of a file's lines, lazily: blank lines and # comments skipped."""
    try:
        for line in lines:
            token = line.strip()
            if token and not token.startswith("#"):
                yield token
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise _Failure("cannot read the tokens file %r: %s" % (path, exc)) from None


def _count_tokens(path: str) -> Optional[int]:
    """How many tokens a regular file holds (one quick pass), or None for stdin, pipes..."""
    if path == "-" or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return sum(1 for _ in _tokens_in(file, path))
    except (OSError, _Failure):
        return None


def _answer(response: Response) -> Tuple[Optional[str], Optional[str]]:
    """A 2xx answer's message name (v1) or id (legacy), and the legacy error if it has one."""
    try:
        answer, errors = response.json(), response.errors
    except ValueError:  # not JSON
        return None, None
    refused = next(iter(errors.values()), None)
    if not isinstance(answer, dict):
        return None, refused
    name = answer.get("name")  # v1: {"name": "projects/p/messages/1"}
    results = answer.get("results")  # legacy: {"results": [{"message_id": "0:1..."}]}
    if name is None and isinstance(results, list) and results and isinstance(results[0], dict):
        name = results[0].get("message_id")
    return (None if name is None else str(name)), refused


def _failure_code(error: BaseException) -> str:
    """FCM's error code for a failed message, or what kind of failure it was."""
    if isinstance(error, HTTPError):
        return error.error_code or "HTTP_%d" % error.status_code
    if isinstance(error, NetworkError):
        return "NETWORK_ERROR"
    if isinstance(error, AuthError):
        return "AUTH_ERROR"
    return "INVALID_MESSAGE"  # TypeError/ValueError: refused before it was sent


def _record(token: str, outcome: Outcome) -> Dict[str, Any]:
    """One line of --results: what became of the message to ``token``."""
    record: Dict[str, Any] = {
        "token": token, "ok": False, "status": None, "error": None, "message": None,
        "detail": None,
    }
    if isinstance(outcome, Response):
        record["message"], refused = _answer(outcome)
        record.update(ok=refused is None, status=outcome.status_code, error=refused)
    else:
        record.update(error=_failure_code(outcome), detail=str(outcome))
        if isinstance(outcome, HTTPError):
            record["status"] = outcome.status_code
    return record


# Commands: each takes the parsed options and returns the exit status.

def _cmd_send(args: "argparse.Namespace") -> int:
    content = _message(args)
    _check_content(content, args)
    with _client(args) as client:
        message = _with_target(content, args, _is_legacy(client))
        try:
            response = client.push(message, validate_only=args.validate_only)
        except (TypeError, ValueError) as exc:
            raise _Failure("bad message: %s" % exc) from None
    try:
        print(json.dumps(response.json(), indent=2))
    except ValueError:  # not JSON
        print(response.body.decode("utf-8", "replace"))
    refused = _answer(response)[1]
    if refused is not None:
        raise _Failure("FCM refused the message: %s" % refused, _EXIT_FAILED)
    return _EXIT_OK


def _cmd_send_many(args: "argparse.Namespace") -> int:
    if args.tokens == "-" and args.message == "-":
        raise _Failure("--tokens and --message cannot both read stdin")
    template = _message(args)
    if any(name in template for name in _TARGET_FIELDS):
        raise _Failure("the --message file must have no target: the tokens come from --tokens")
    _check_content(template, args)
    with contextlib.ExitStack() as stack:
        lines = _open(args.tokens, "the tokens file", stack)
        results = _open(args.results, "--results", stack, write=True) if args.results else None
        dead = _open(args.unregistered, "--unregistered", stack, write=True) \
            if args.unregistered else None
        client = stack.enter_context(_client(args, rate_limit=args.rate))
        field = "to" if _is_legacy(client) else "token"
        _check_ready(client, dict(template, **{field: "token"}))
        progress = _Progress(sys.stderr, None if args.quiet else _count_tokens(args.tokens),
                             args.quiet)
        tally = _Tally(results, dead)
        pending: Deque[str] = collections.deque()  # tokens taken, their outcomes not yet seen

        def messages() -> Iterator[Dict[str, Any]]:
            for token in _tokens_in(lines, args.tokens):
                pending.append(token)
                yield dict(template, **{field: token})

        outcomes = client.push_many(messages(), concurrency=args.concurrency,
                                    progress=progress.update)
        try:
            for outcome in outcomes:
                tally.add(pending.popleft(), outcome)
                if isinstance(outcome, Exception) and _stops_the_run(outcome, tally.sent):
                    raise outcome
        except KeyboardInterrupt:
            tally.stopped = "interrupted"
        except BrokenPipeError:  # --results - or --unregistered - into a reader that left
            tally.stopped = "the output was closed"
            raise  # main() exits quietly
        finally:
            if isinstance(outcomes, _Outcomes):  # push_many's iterator: stop the sending
                outcomes.close()
            progress.finish(tally.sent + tally.failed, tally.failed)
            tally.report(args.unregistered)
    if tally.stopped:  # by Ctrl-C: a closed output raised BrokenPipeError on to main()
        return _EXIT_INTERRUPTED
    return _EXIT_FAILED if tally.failed else _EXIT_OK


def _stops_the_run(outcome: Exception, sent: int) -> bool:
    """Whether a failure would fail every message after it too (credentials, project...).

    An outage counts only when nothing was sent yet: then FCM cannot be reached, or is
    down, and the run is better tried again later than spent on failures.
    """
    if isinstance(outcome, NetworkError):
        return sent == 0 and not outcome.may_have_been_delivered
    if _is_outage(outcome):
        return sent == 0
    return _is_systemic(outcome) or _is_missing_project(outcome)


def _cmd_topic(args: "argparse.Namespace") -> int:
    tokens = list(args.token or [])
    if args.tokens:
        with contextlib.ExitStack() as stack:
            tokens.extend(_tokens_in(_open(args.tokens, "the tokens file", stack), args.tokens))
    if not tokens:
        raise _Failure("no device tokens: give --tokens FILE or --token TOKEN")
    with _client(args) as client:
        if _is_legacy(client):
            raise _Failure("topic management needs the v1 API: give --credentials (or use "
                           "Application Default Credentials) instead of a server key")
        _check_ready(client)
        manage = client.subscribe if args.subscribe else client.unsubscribe
        try:
            outcomes = manage(tokens, args.topic)
        except (TypeError, ValueError) as exc:
            raise _Failure(str(exc)) from None
    failed = 0
    for number, outcome in enumerate(outcomes, 1):
        if isinstance(outcome, Exception):
            if _is_systemic(outcome):
                raise outcome
            failed += 1
            _say("token %d of %d: %s" % (number, len(tokens), _explain(outcome)))
    _say("%s %s of %s tokens %s topic %r%s" % (
        "subscribed" if args.subscribe else "unsubscribed", _number(len(tokens) - failed),
        _number(len(tokens)), "to" if args.subscribe else "from", args.topic,
        "; %s failed" % _number(failed) if failed else "",
    ))
    return _EXIT_FAILED if failed else _EXIT_OK


def _cmd_token(args: "argparse.Namespace") -> int:
    with _client(args) as client:
        api = client._api
        if not isinstance(api, _V1API):
            raise _Failure("the legacy API has no access tokens, only the server key; give "
                           "--credentials (or use Application Default Credentials)")
        print(api.headers()[1])
    return _EXIT_OK


def _cmd_check(args: "argparse.Namespace") -> int:
    with _client(args) as client:
        api = client._api
        if isinstance(api, _V1API):
            api.headers()
            print("credentials   ok: got an access token")
            print("project       %s" % urllib.parse.unquote(api.project_path().split("/")[-1]))
            message = {"token": args.token} if args.token else {"topic": _CHECK_TOPIC}
        else:
            print("credentials   a legacy server key")
            message = {"to": args.token or "/topics/" + _CHECK_TOPIC}
        try:
            refused = _answer(client.push(message, validate_only=True))[1]
        except HTTPError as exc:
            if _exit_status(exc) != _EXIT_FAILED:  # about the setup, not the token
                raise
            refused = _explain(exc)
    if refused is not None:
        print("test message  refused for the device token given")
        print("The credentials and project work; the device token does not.")
        raise _Failure("FCM refused the test message: %s" % refused, _EXIT_FAILED)
    print("test message  ok: FCM validated it (validate_only: nothing was delivered)")
    print("The credentials and project work.")
    return _EXIT_OK


# send-many's progress display and summary.

class _Progress:
    """push_many's progress on a stream: a bar redrawn in place on a terminal, a plain line
    every few seconds otherwise, nothing when quiet.

    ``update`` is push_many's progress callback, called from the sending threads: it draws
    at most once an interval and never waits for another thread that is drawing.
    """

    def __init__(
        self,
        stream: TextIO,
        total: Optional[int],
        quiet: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._total = total or None
        self._bar = stream.isatty()
        self._interval = _BAR_INTERVAL if self._bar else _LINE_INTERVAL
        self._clock = clock
        self._lock = threading.Lock()
        self._started = self._clock()
        self._next_draw = self._started + (0.0 if self._bar else self._interval)
        self._finished = quiet

    def update(self, done: int, failed: int) -> None:
        # Reading _next_draw unlocked is a cheap first filter; it is checked again locked.
        if self._clock() < self._next_draw or not self._lock.acquire(blocking=False):
            return
        try:
            now = self._clock()
            if not self._finished and now >= self._next_draw:
                self._next_draw = now + self._interval
                self._draw(done, failed, now)
        finally:
            self._lock.release()

    def finish(self, done: int, failed: int) -> None:
        """Draw no more; on a terminal, leave the bar at these counts and end its line."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            if self._bar:
                self._draw(done, failed, self._clock())
                self._stream.write("\n")
                self._stream.flush()

    def _draw(self, done: int, failed: int, now: float) -> None:
        text = _progress_text(done, failed, self._total, now - self._started)
        if self._bar:
            room = _terminal_width(self._stream) - 1  # the last column would wrap the line
            bar_width = min(_BAR_WIDTH, room - len(text) - 3)
            if self._total and bar_width >= _BAR_MIN_WIDTH:
                text = _bar(done, self._total, bar_width) + " " + text
            self._stream.write("\r" + text[:room] + "\x1b[K")  # K: clear to the line's end
        else:
            self._stream.write("andpush: " + text + "\n")
        self._stream.flush()


def _progress_text(done: int, failed: int, total: Optional[int], elapsed: float) -> str:
    rate = done / elapsed if elapsed > 0 else 0.0
    parts = ["%s/%s (%d%%)" % (_number(done), _number(total), min(100, 100 * done // total))
             if total else "%s done" % _number(done)]
    parts += ["%s failed" % _number(failed), "%s/s" % _number(round(rate)),
              "%s elapsed" % _duration(elapsed)]
    if total and rate > 0 and done < total:
        parts.append("%s left" % _duration((total - done) / rate))
    return ", ".join(parts)


def _bar(done: int, total: int, width: int) -> str:
    filled = width * min(done, total) // total
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _terminal_width(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):  # not a terminal after all, or no file descriptor
        columns = 0
    return columns or _DEFAULT_COLUMNS  # 0: a terminal that does not know its size


def _number(count: int) -> str:
    return "{:,}".format(count)


def _duration(seconds: float) -> str:
    """4.2s under a minute, else m:ss or h:mm:ss."""
    if seconds < 60:
        return "%.1fs" % seconds
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return "%d:%02d:%02d" % (hours, minutes, seconds) if hours else "%d:%02d" % (minutes, seconds)


class _Tally:
    """What send-many has done: messages sent, failures by error code, dead tokens; each
    outcome also written to the --results and --unregistered files, when given."""

    def __init__(self, results: Optional[TextIO], unregistered: Optional[TextIO]) -> None:
        self.sent = 0
        self.failures: Dict[str, int] = {}
        self.unregistered = 0
        self.stopped: Optional[str] = None  # why the run stopped early, if it did
        self._results = results
        self._unregistered_file = unregistered
        self._started = time.monotonic()

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def add(self, token: str, outcome: Outcome) -> None:
        """Count the outcome, then write it: a write that fails (a closed pipe) leaves the
        summary still true."""
        record = _record(token, outcome)
        code = record["error"]
        if record["ok"]:
            self.sent += 1
        else:
            self.failures[code] = self.failures.get(code, 0) + 1
        if code in _UNREGISTERED_CODES:
            self.unregistered += 1
        if self._results is not None:
            self._results.write(json.dumps(record) + "\n")
        if code in _UNREGISTERED_CODES and self._unregistered_file is not None:
            self._unregistered_file.write(token + "\n")

    def report(self, unregistered_path: Optional[str]) -> None:
        """The summary, on stderr."""
        _say(_summary(self.sent, self.failures, time.monotonic() - self._started))
        if unregistered_path:
            _say("%s unregistered tokens written to %s" % (
                _number(self.unregistered), "stdout" if unregistered_path == "-"
                else repr(unregistered_path)))
        if self.stopped:
            _say("%s: the remaining tokens were not sent" % self.stopped)


def _summary(sent: int, failures: Dict[str, int], elapsed: float) -> str:
    """E.g. sent 9,600 of 10,000 messages, 400 failed (400 UNREGISTERED) in 4.2s: 2,381/s."""
    done = sent + sum(failures.values())
    text = "sent %s of %s messages" % (_number(sent), _number(done))
    if failures:
        by_count = sorted(failures.items(), key=lambda item: (-item[1], item[0]))
        text += ", %s failed (%s)" % (_number(done - sent), ", ".join(
            "%s %s" % (_number(count), code) for code, count in by_count))
    rate = _number(round(done / elapsed)) if elapsed > 0 else "-"
    return text + " in %s: %s messages/s" % (_duration(elapsed), rate)


if __name__ == "__main__":
    sys.exit(main())
