"""andpush: fast, dependency-free Firebase Cloud Messaging (FCM) for Python::

    import andpush

    with andpush.new(credentials="service-account.json") as client:
        response = client.push({
            "token": device_token,
            "notification": {"title": "Update", "body": "Ready"},
        })
        print(response.message_id)
        for message, outcome in client.push_many(messages, concurrency=100):
            ...                           # a Response, or the error for that message

One module, standard library only, Python 3.8+. Every request of a client goes
through its one engine, which keeps the connections alive for the client's life:
over HTTP/2 (what FCM picks) every thread's pushes and push_many share a few
multiplexed connections, up to the server's stream limit; over HTTP/1.1 each request
takes a kept-alive connection of its own. ``andpush.new_async`` makes the same client
for asyncio, with no thread. The OAuth2 tokens of the HTTP v1 API are signed in pure
Python.

Every call ends within a bound its options give, whatever the server does: each try goes
out within the connect timeout and ends within the connect and read timeouts together;
there are at most ``max_retries + 1`` of them (one more after a refreshed access token),
with a backoff and the 429 pause, each at most 120 s, between them. A connection that
fails holds off new ones to its server, doubling up to 30 s.

``andpush.new(server_key)`` makes a client of the legacy API instead
(``andpush.build`` is another name for ``new``). ``andpush.FakeFCM()`` is a local FCM
for tests, and ``python -m andpush fake-fcm`` the same for tests in other languages.

A message is a plain dict, as FCM's JSON has it. For type checkers, ``andpush.Message``
and its parts (Notification, AndroidConfig, AndroidNotification, ApnsConfig,
WebpushConfig, FcmOptions, ...), and ``andpush.LegacyMessage``, describe them as
TypedDicts.

The life of a connection (each edge is what moves it)::

    connect (on a thread of its own: TCP, CONNECT tunnel, TLS with ALPN)
      |
      +-- h2 --> WAITING_FOR_SETTINGS --SETTINGS--> OPEN --any GOAWAY--> GOING_AWAY
      |            | none in time                     | broken, idle too  | last stream
      |            v                                  v long, os.fork()   v ends
      |          CLOSED <-----------------------------+-------------------+
      |
      +-- http/1.1 --> IDLE --request--> BUSY --answer, kept alive--> IDLE
                         | idle too long, | error, timeout,
                         | closed by the  | Connection: close
                         v server, fork   v
                       CLOSED           CLOSED

Errors form one tree; each says whose fault it is::

    Error
     +-- NetworkError      no answer: may_have_been_delivered says if it may have arrived
     |    +-- CertificateError  the server's certificate failed verification: fix the setup
     +-- AuthError         no credentials, no access token, or FCM refused them
     +-- HTTPError         the server answered with a non-2xx status
          +-- ClientError  4xx: InvalidArgumentError, UnregisteredError, ...
          |    +-- UnauthenticatedError, PermissionDeniedError: AuthErrors too
          +-- ServerError  5xx: InternalError, UnavailableError
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import heapq
import json
import logging
import math
import os
import random
import re
import selectors
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.parse
import weakref
from typing import (
    Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Deque, Dict, FrozenSet, Generic,
    Iterable, Iterator, List, Mapping, NoReturn, Optional, Set, TYPE_CHECKING, Protocol,
    TextIO, Tuple, Type, TypedDict, TypeVar, Union, cast, overload,
)

if TYPE_CHECKING:
    import asyncio

__version__ = "0.1.0"
# What help(andpush) shows. Left out: ``build``, an alias of ``new``, and the message
# types (Message, Notification, AndroidConfig, ...: public all the same), each of which
# would bring the 190 lines pydoc shows of a dict's methods.
__all__ = [
    "new", "new_async", "Client", "AsyncClient", "Response", "Headers", "Outcome",
    "Outcomes", "AsyncOutcomes",
    "Error", "NetworkError", "CertificateError", "AuthError", "HTTPError", "ClientError",
    "ServerError", "InvalidArgumentError", "UnregisteredError", "SenderIdMismatchError",
    "QuotaExceededError", "ThirdPartyAuthError", "UnauthenticatedError",
    "PermissionDeniedError", "InternalError", "UnavailableError",
    "FakeFCM", "ReceivedMessage",
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
_USER_AGENT = "andpush/" + __version__


# Errors ######################################################################
# What can go wrong, as one tree of exceptions that carry what a caller needs.

class Error(Exception):
    """Base class of every error andpush raises on purpose.

    Every andpush error survives ``pickle`` and ``copy`` with its class, message and
    attributes (an HTTPError's ``response`` travels with it), so it can cross a process
    pool or be stored by a result backend. Its ``args`` are plain data (str, int, bool,
    None) that rebuild it: ``type(error)(*error.args)``, as Celery's json result backend
    does, gives the same class, message, status code and error code.
    """

    def __str__(self) -> str:
        """The message, which is the first of the args (the others rebuild the error)."""
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> Tuple[Any, ...]:
        """Rebuild without calling ``__init__``, with every attribute as it was (an
        HTTPError's whole response, which its ``args`` do not hold)."""
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

    def __init__(self, message: str, may_have_been_delivered: bool) -> None:
        super().__init__(message)
        self.args = (message, may_have_been_delivered)  # OSError's init keeps one arg
        self.may_have_been_delivered = may_have_been_delivered


class CertificateError(NetworkError):
    """The server's TLS certificate failed verification, so nothing was sent.

    A configuration error, not an outage: a CA this machine does not trust (a test
    server's, a private gateway's), or a proxy that intercepts TLS (a corporate one),
    whose CA is to be trusted with ``ssl_context=`` (``--cafile``). It is never retried:
    trying again cannot help.
    """


class _Stopped(NetworkError):
    """The outcome of a message a push_many took and did not send because it was stopped
    (its caller sees a NetworkError; the command line counts these as not sent)."""

    def __init__(self, message: str = "not sent: push_many was stopped",
                 may_have_been_delivered: bool = False) -> None:
        super().__init__(message, may_have_been_delivered)


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

    def __init__(self, response: Union["Response", str], status_code: Optional[int] = None,
                 error_code: Optional[str] = None, retry_after: Optional[float] = None) -> None:
        """Made from the server's Response; or, as ``type(error)(*error.args)`` rebuilds it,
        from its message, status code, error code and Retry-After seconds, with a Response
        of that status and no headers or body."""
        if isinstance(response, Response):
            status_code = response.status_code
            error_code = _error_code(response)
            retry_after = _retry_after(response.headers.get("retry-after"))
            message = _describe(response, error_code)
        elif isinstance(status_code, int):
            message, response = response, Response(status_code, "", _NO_HEADERS, b"")
        else:
            raise TypeError("an HTTPError is made from a Response, or from a message and the "
                            "status code")
        self.response = response
        self.status_code = status_code
        self.error_code = error_code
        self.retry_after = retry_after
        super().__init__(message, status_code, error_code, retry_after)


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


def _phrase(status: int) -> str:
    """The standard reason phrase of ``status`` (HTTP/2 answers carry none)."""
    import http  # only an error message needs it: loaded on first use, not on import

    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _describe(response: "Response", error_code: Optional[str]) -> str:
    """A one-line message for an HTTPError: status, code and the server's explanation."""
    text = "HTTP %d %s" % (response.status_code, response.reason or _phrase(response.status_code))
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
# Compiled when first used (by the re module's cache): few answers carry a date.
_HTTP_DATES = (
    # IMF-fixdate: Sun, 06 Nov 1994 08:49:37 GMT
    r"(?a)%s, (?P<day>[0-9]{2}) %s (?P<year>[0-9]{4}) %s GMT\Z" % (_DAY_NAME, _MONTH, _CLOCK),
    # obsolete RFC 850: Sunday, 06-Nov-94 08:49:37 GMT
    r"(?a)%s, (?P<day>[0-9]{2})-%s-(?P<year>[0-9]{2}) %s GMT\Z"
    % (_LONG_DAY_NAME, _MONTH, _CLOCK),
    # asctime: Sun Nov  6 08:49:37 1994
    r"(?a)%s %s (?P<day>[ 0-9][0-9]) %s (?P<year>[0-9]{4})\Z" % (_DAY_NAME, _MONTH, _CLOCK),
)
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
    if value.isascii() and value.isdigit():  # delta-seconds
        return float(min(float(value), _MAX_DELTA_SECONDS))
    when = _http_date(value)
    return None if when is None else max(0.0, when - time.time())


def _http_date(value: str) -> Optional[float]:
    """The Unix time an HTTP-date stands for, or None if it is not one or not a real date."""
    for form in _HTTP_DATES:
        match = re.match(form, value)
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


_NO_HEADERS = Headers({})  # of a response before its headers came


class Response:
    """A 2xx answer from FCM (error answers raise HTTPError and hang off it).

    Attributes:
        status_code: the HTTP status, e.g. 200.
        reason: the reason phrase, e.g. ``"OK"`` (empty over HTTP/2, which has none).
        headers: the Headers, looked up case-insensitively.
        body: the body, as bytes; ``text`` decodes it and ``json()`` parses it.

    ``ok`` is True for a 2xx status (requests counts 3xx too; andpush raises for those).
    """

    __slots__ = ("status_code", "reason", "headers", "body", "_json", "_device_tokens")

    def __init__(self, status_code: int, reason: str, headers: Headers, body: bytes) -> None:
        self.status_code = status_code
        self.reason = reason
        self.headers = headers
        self.body = body
        self._json: Any = _UNPARSED
        self._device_tokens: Tuple[str, ...] = ()  # a legacy push's, in request order

    @property
    def ok(self) -> bool:
        """True for a 2xx status: for every Response a push returns, never for an HTTPError's."""
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (what JSON must be), undecodable bytes replaced."""
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON, once; ValueError when the body is not JSON.

        A body nested too deeply for the json module (RecursionError) counts as not JSON.
        """
        if self._json is _UNPARSED:
            try:
                self._json = json.loads(self.body)
            except (ValueError, RecursionError):
                raise ValueError(
                    "the response body is not JSON (content-type %r); read .body instead"
                    % self.headers.get("content-type", "")
                ) from None
        return self._json

    @property
    def message_id(self) -> Optional[str]:
        """The id FCM gave the message: a v1 answer's ``name``
        (``projects/<project>/messages/<id>``, what firebase-admin's ``send`` returns), or
        a legacy answer's ``message_id`` (to a topic, or the one token's); else None."""
        try:
            answer = self.json()
        except ValueError:
            return None
        if not isinstance(answer, dict):
            return None
        found = answer.get("name", answer.get("message_id"))
        results = answer.get("results")
        if found is None and isinstance(results, list) and len(results) == 1 \
                and isinstance(results[0], dict):
            found = results[0].get("message_id")
        return None if found is None or isinstance(found, (dict, list)) else str(found)

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
        return [(t, r) for t, r in zip(self._device_tokens, results) if isinstance(r, dict)]

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


#: What one message of a push_many ends in: its Response, or the error push() would raise.
Outcome = Union[Response, Exception]


def _is_failure(outcome: Outcome) -> bool:
    """Whether an outcome counts as a failure: an error, or a legacy 200 whose results hold
    an error for the token (push returns it, but the token was refused)."""
    return isinstance(outcome, Exception) or bool(outcome._device_tokens and outcome.errors)


# Policy ######################################################################
# When a request may start, and what each finished attempt means: decided here only.

#: Retries after a failed send, by default.
DEFAULT_MAX_RETRIES = 3
#: Seconds before the first retry; each later wait doubles, with random jitter.
DEFAULT_BACKOFF_FACTOR = 0.5
_MAX_RETRY_WAIT = 120.0  # seconds; a longer wait (Retry-After) ends the retries instead
_QUOTA_WAIT = 60.0       # seconds a 429 waits at least when it gives no Retry-After
_RESENDS = 5             # times an unprocessed request is sent again at once; then it is a retry


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
        if isinstance(error, HTTPError) and error.retry_after is not None:
            wait = max(wait, error.retry_after)
        elif isinstance(error, QuotaExceededError):
            wait = max(wait, _QUOTA_WAIT)
        if wait > _MAX_RETRY_WAIT:
            return None
        return self._next(retries=self.retries - 1, may_refresh=self.may_refresh), wait

    def _retryable(self, error: Error) -> bool:
        if isinstance(error, CertificateError):  # the setup is wrong: it will fail again
            return False
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
    wait = error.retry_after if error.retry_after is not None else _QUOTA_WAIT
    return min(wait, _MAX_RETRY_WAIT)


def _is_rejected_token(error: Error) -> bool:
    """A 401 that blames the access token itself, not APNs or web push credentials."""
    return (
        isinstance(error, ClientError)
        and error.status_code == 401
        and not isinstance(error, ThirdPartyAuthError)
    )


class _NotProcessed(Exception):
    """The server provably did not process the request, so it may be sent again as it is.

    A refused HTTP/2 stream, a stream above a GOAWAY's last stream id, a request none of
    whose bytes were written, or a reused HTTP/1.1 connection the server had closed: then
    it is ``fresh``, to go out on a new connection (it was the first request of none).
    """

    def __init__(self, message: str, fresh: bool = False) -> None:
        super().__init__(message)
        self.fresh = fresh


class _Clock:
    """The one seam for time: every deadline, pause, pace and backoff goes through it.

    ``now`` is what they are measured in (the monotonic clock itself, called directly);
    ``delay`` turns a wait the policy asks for into the seconds the driver really waits.
    Each engine has one (``clock``), which the token cache reads too; tests replace it to
    run without sleeping.
    """

    now = staticmethod(time.monotonic)

    def delay(self, seconds: float) -> float:
        return seconds


class _Signer(Protocol):
    """Who signs each attempt of a request with the current access token: the headers
    and the token, or None until the engine has run ``token_request`` and handed its
    outcome to ``token_answered`` (the headers then, or the error every waiting
    request ends with)."""

    def headers_now(self) -> Optional[Tuple[Dict[str, str], str]]: ...

    def token_request(self) -> "_Exchange": ...

    def token_answered(
        self, outcome: Optional["Outcome"]
    ) -> Union[Tuple[Dict[str, str], str], "Error"]: ...

    def invalidate(self, token: str) -> None: ...


class _Exchange:
    """One request through its whole life: every attempt, until its one outcome.

    ``signer`` gives the headers of each attempt (None: ``headers`` are fixed); ``paced``
    requests obey rate_limit and the 429 pause; ``on_done`` is called once, from the
    engine's thread, when ``outcome`` is set.

    Each try has its deadlines, set when it begins (see _Engine._try): it goes out by
    ``send_by`` (else it ends unsent), and ends by ``ends_by``, its answer included; a
    request the server did not process goes out again within the same try.
    """

    __slots__ = ("route", "method", "path", "headers", "body", "signer", "retry", "paced",
                 "signed", "access_token", "resends", "outcome", "on_done", "index",
                 "device_tokens", "timeout", "deadline", "send_by", "ends_by", "last_error",
                 "halted", "fresh")

    def __init__(self, route: "_Route", method: str, path: str, body: bytes, retry: _Retry,
                 signer: Optional[_Signer] = None, headers: Optional[Dict[str, str]] = None,
                 paced: bool = False, device_tokens: Tuple[str, ...] = ()) -> None:
        self.route = route
        self.method = method
        self.path = path
        self.headers = headers or {}
        self.body = body
        self.signer = signer
        self.retry = retry
        self.paced = paced
        self.signed: Optional[Tuple[Dict[str, str], str]] = None  # headers fetched for it
        self.access_token = ""               # the access token of the last attempt
        self.resends = 0                     # attempts the server provably did not process
        self.outcome: Optional[Outcome] = None
        self.on_done: Callable[["_Exchange"], None] = _ignore
        self.index = 0                       # its place in a push_many
        self.device_tokens = device_tokens   # the device tokens of a legacy push
        self.timeout = 0.0                   # seconds a try may wait (0: the client's)
        self.deadline = 0.0                  # for the answer of the attempt on the wire
        self.send_by = 0.0                   # for this try's request to go out
        self.ends_by = 0.0                   # for this try to end
        self.last_error: Optional[Error] = None  # what the last try ended in, if retried
        self.halted = False                  # no further attempt: its push_many stopped
        self.fresh = False                   # it must go out on a new connection


def _ignore(exchange: _Exchange) -> None:
    """The ``on_done`` of an exchange whose sender does not wait for it."""


class _Policy:
    """The lifecycle every request of one client goes through, on either protocol.

    ``start_at`` says when an attempt may begin (the 429 pause and rate_limit); ``decide``
    says what a finished attempt means: the outcome, or the same request again after a
    wait (retries, the rejected-token refresh, resending what was not processed). Only the
    engine's thread calls it, so it needs no lock.
    """

    def __init__(self, rate_limit: Optional[float]) -> None:
        self._interval = 1.0 / rate_limit if rate_limit else 0.0
        self._paused_until = 0.0
        self._pause_cause: Optional[Response] = None  # the 429 that started the pause
        self._next_slot = 0.0

    def start_at(self, exchange: _Exchange, now: float) -> Optional[float]:
        """The clock time at which ``exchange`` may be sent; it claims a rate_limit slot.

        None when it ends unsent instead: the client is paused after a 429 and the
        exchange has no retry left to wait with (``max_retries=0`` never sleeps).
        """
        if not exchange.paced:
            return now
        if self._paused_until > now and exchange.retry.retries == 0:
            assert self._pause_cause is not None
            # At most the longest wait, which a difference of clock readings can exceed
            # by a rounding (a pause of 120 s read back as 120.00000000000091).
            exchange.outcome = _paused(self._pause_cause,
                                       min(self._paused_until - now, _MAX_RETRY_WAIT))
            return None
        start = max(now, self._paused_until, self._next_slot)
        if self._interval:
            self._next_slot = start + self._interval
        return start

    def decide(self, exchange: _Exchange, result: Union[Response, Exception],
               now: float) -> Optional[float]:
        """Act on one attempt's result, at clock time ``now``: None once
        ``exchange.outcome`` is set, else the seconds to wait before sending it again."""
        error: Error
        if isinstance(result, Response):
            if 200 <= result.status_code < 300:
                result._device_tokens = exchange.device_tokens
                exchange.outcome = result
                return None
            error = _http_error(result)
        elif isinstance(result, _NotProcessed):
            if exchange.halted:
                error = _Stopped("not sent: push_many was stopped before it went out again "
                                 "(%s)" % result)
            elif exchange.resends < _RESENDS:
                exchange.resends += 1
                log.debug("sending again a request the server did not process: %s", result)
                return 0.0
            else:
                error = NetworkError("the server did not process the request in %d tries: %s"
                                     % (exchange.resends + 1, result),
                                     may_have_been_delivered=False)
        elif isinstance(result, Error):
            error = result
        else:
            error = NetworkError("the exchange failed: %s" % _reason(result),
                                 may_have_been_delivered=True)
        if isinstance(error, QuotaExceededError) and exchange.paced:
            self._pause(_quota_wait(error), error.response, now)
        step = None if exchange.halted else exchange.retry.after(error)
        if step is None:
            exchange.outcome = error
            return None
        exchange.retry, wait = step
        exchange.last_error = error
        if _is_rejected_token(error) and exchange.signer is not None:
            exchange.signer.invalidate(exchange.access_token)
        log.info("retrying in %.2f s after: %s", wait, error)
        return wait

    def _pause(self, seconds: float, cause: Response, now: float) -> None:
        """Hold every paced send of this client for ``seconds`` from ``now``: the project
        is over quota."""
        until = now + seconds
        if until > self._paused_until:
            log.warning("FCM answered 429 (over quota): every send waits %.3g s", seconds)
            self._paused_until, self._pause_cause = until, cause


def _paused(cause: Response, remaining: float) -> QuotaExceededError:
    """The error of a send not made because the client is paused after ``cause``, a 429."""
    error = QuotaExceededError(cause)
    error.retry_after = remaining
    error.args = ("not sent: the client waits %.3g s more after FCM's 429 (%s)"
                  % (remaining, error), error.status_code, error.error_code, remaining)
    return error


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# HTTP/1.1 wire ###############################################################
# Requests as bytes, and a response reader that is fed bytes: no sockets here.

class _ProtocolError(Exception):
    """The server's answer broke HTTP, or exceeded a limit."""


def _is_digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts "²", which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def _encode_request(host: str, method: str, path: str, headers: Dict[str, str],
                    body: bytes) -> bytes:
    """The bytes of one HTTP/1.1 request, head and body, to be written in one go (the head
    joined from its pieces: cheaper than formatting each line)."""
    parts = [method, " ", path, " HTTP/1.1\r\nHost: ", host, "\r\nUser-Agent: ", _USER_AGENT,
             "\r\nContent-Length: ", str(len(body))]
    for name, value in headers.items():
        parts += ("\r\n", name, ": ", value)
    parts.append("\r\n\r\n")
    return "".join(parts).encode("latin-1") + body


# A response head as _H1Reader reads it: status, reason, headers, whether the connection
# may be kept, the state that follows and the length of the body, if given.
_H1Head = Tuple[int, str, Headers, bool, str, int]
_H1_HEAD_CACHE = 64  # response heads a route remembers, parsed (they differ by the Date)


class _H1Reader:
    """One HTTP/1.1 response, parsed from the bytes fed to it as they arrive.

    ``feed`` returns the Response and whether the connection may carry another request,
    once the response is whole, else None; ``eof`` says the server closed the connection.
    Both raise _ProtocolError for a malformed or oversized answer. A server sends the same
    head again and again (bar its Date, once a second), so ``heads`` keeps the parsed
    heads of earlier responses, by their bytes. States::

        HEAD --> BODY ------------------------------------> DONE
          |  --> CHUNK_SIZE <--> CHUNK_DATA --> TRAILERS --^
          +----> UNTIL_EOF (no length given) --eof()------^
    """

    __slots__ = ("state", "_heads", "_buffer", "_status", "_reason", "_headers", "_keep",
                 "_body", "_remaining")

    def __init__(self, heads: Optional[Dict[bytes, _H1Head]] = None) -> None:
        self.state = "HEAD"
        self._heads = {} if heads is None else heads
        self._buffer = bytearray()
        self._status = 0
        self._reason = ""
        self._headers = _NO_HEADERS
        self._keep = True
        self._body = bytearray()
        self._remaining = 0

    @property
    def started(self) -> bool:
        """Whether any byte of the answer has arrived."""
        return bool(self._buffer) or self.state != "HEAD"

    def feed(self, data: bytes) -> Optional[Tuple[Response, bool]]:
        self._buffer += data
        steps = _H1_STEPS
        while steps[self.state](self):
            pass
        return self._response() if self.state == "DONE" else None

    def eof(self) -> Tuple[Response, bool]:
        """The response the end of the connection completes; _ProtocolError if none."""
        if self.state == "UNTIL_EOF":
            self._body += self._buffer
            self._buffer.clear()
            self.state, self._keep = "DONE", False
            return self._response()
        raise _ProtocolError("the server closed the connection mid-response")

    def _response(self) -> Tuple[Response, bool]:
        response = Response(self._status, self._reason, self._headers, bytes(self._body))
        return response, self._keep and not self._buffer

    def _line(self, what: str) -> Optional[bytes]:
        """The next CRLF-terminated line (consumed), or None until it is whole.

        The line with its CRLF may take _MAX_HEAD bytes, however the bytes arrived.
        """
        end = self._buffer.find(b"\r\n", 0, _MAX_HEAD)
        if end < 0:
            if len(self._buffer) >= _MAX_HEAD:
                raise _ProtocolError("%s exceeds %d bytes" % (what, _MAX_HEAD))
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 2]
        return line

    def _read_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n", 0, _MAX_HEAD)  # the blank line within the limit
        if end < 0:
            if len(self._buffer) >= _MAX_HEAD:
                raise _ProtocolError("the response head exceeds %d bytes" % _MAX_HEAD)
            return False
        block = bytes(self._buffer[:end])
        del self._buffer[:end + 4]
        head = self._heads.get(block)
        if head is None:
            head = _parse_head(block)
            if len(self._heads) >= _H1_HEAD_CACHE:
                self._heads.clear()
            self._heads[block] = head
        self._status, self._reason, self._headers, self._keep, self.state, self._remaining = head
        return True

    def _read_body(self) -> bool:
        """The body of the length given, taken at once when it is all there."""
        if len(self._buffer) < self._remaining:
            return False
        self._body = self._buffer[:self._remaining]
        del self._buffer[:self._remaining]
        self.state = "DONE"
        return True

    def _read_chunk_size(self) -> bool:
        line = self._line("a chunk line")
        if line is None:
            return False
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
            raise _ProtocolError("bad chunk size %r" % size_text[:20])
        self._remaining = int(size_text, 16)
        if len(self._body) + self._remaining > _MAX_BODY:
            raise _ProtocolError("chunked response body exceeds %d bytes" % _MAX_BODY)
        self.state = "CHUNK_DATA" if self._remaining else "TRAILERS"
        return True

    def _read_chunk_data(self) -> bool:
        self._take(self._remaining)
        if self._remaining or len(self._buffer) < 2:
            return False
        if self._buffer[:2] != b"\r\n":
            raise _ProtocolError("chunk data not followed by CRLF")
        del self._buffer[:2]
        self.state = "CHUNK_SIZE"
        return True

    def _read_trailers(self) -> bool:
        line = self._line("a trailer line")
        if line is None:
            return False
        if not line:
            self.state = "DONE"  # trailers carry nothing FCM uses
        return True

    def _read_until_eof(self) -> bool:
        self._body += self._buffer
        self._buffer.clear()
        if len(self._body) > _MAX_BODY:
            raise _ProtocolError("response body exceeds %d bytes" % _MAX_BODY)
        return False

    def _read_done(self) -> bool:
        return False

    def _take(self, most: int) -> None:
        """Move up to ``most`` body bytes (of ``_remaining``) from the buffer to the body."""
        piece = self._buffer[:most]
        del self._buffer[:len(piece)]
        self._body += piece
        self._remaining -= len(piece)


# What _H1Reader does in each state: True if it moved on, False if it needs more bytes.
_H1_STEPS = {
    "HEAD": _H1Reader._read_head, "BODY": _H1Reader._read_body,
    "CHUNK_SIZE": _H1Reader._read_chunk_size, "CHUNK_DATA": _H1Reader._read_chunk_data,
    "TRAILERS": _H1Reader._read_trailers, "UNTIL_EOF": _H1Reader._read_until_eof,
    "DONE": _H1Reader._read_done,
}


def _parse_head(block: bytes) -> _H1Head:
    """What a response head (without its blank line) says; _ProtocolError if malformed."""
    lines = block.decode("latin-1").split("\r\n")
    version, status, reason = _parse_status_line(lines[0])
    headers = _parse_header_lines(lines[1:])
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return status, reason, Headers(headers), keep, "CHUNK_SIZE", 0
    if "content-length" in headers:
        return (status, reason, Headers(headers), keep, "BODY",
                _content_length(headers["content-length"]))
    if status in (204, 304) or 100 <= status < 200:
        return status, reason, Headers(headers), keep, "DONE", 0
    return status, reason, Headers(headers), keep, "UNTIL_EOF", 0


def _parse_status_line(line: str) -> Tuple[str, int, str]:
    version, _, rest = line.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not _is_digits(code):
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
    if not _is_digits(value):
        raise _ProtocolError("bad Content-Length %r" % value[:20])
    digits = value.lstrip("0") or "0"
    # Checked before int(), which refuses thousands of digits (Python 3.11+).
    if len(digits) > len(str(_MAX_BODY)) or int(digits) > _MAX_BODY:
        raise _ProtocolError("Content-Length %.20s exceeds %d bytes" % (digits, _MAX_BODY))
    return int(digits)


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


# HTTP/2 wire #################################################################
# Many requests at once over one connection (RFC 9113): bytes in, outcomes and bytes out.

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
_NO_ERROR = 0x0
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
_H2_BLOCK_CACHE = 64          # request header blocks a connection remembers
_H2_LENGTH_CACHE = 1024       # content-length fields remembered, by length
_H2_ANSWER_CACHE = 64         # response header blocks a connection remembers, interpreted
_H2_LAST_STREAM = (1 << 31) - 1
# What we tell the server first: no dynamic table, no server push, large stream windows.
_H2_SETTINGS = ((_SETTINGS_HEADER_TABLE_SIZE, 0), (_SETTINGS_ENABLE_PUSH, 0),
                (_SETTINGS_INITIAL_WINDOW_SIZE, _H2_WINDOW))


class _H2Error(Exception):
    """The server broke HTTP/2: the connection cannot go on (``code`` goes in our GOAWAY)."""

    def __init__(self, message: str, code: int = _PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class _H2Stream:
    """One request in flight: what is left to send, and what has come back."""

    __slots__ = ("id", "key", "pending", "send_window", "status", "headers", "body",
                 "deadline", "first_byte", "end_byte", "data_queued")

    def __init__(self, stream_id: int, key: object, deadline: float, send_window: int,
                 first_byte: int) -> None:
        self.id = stream_id
        self.key = key
        self.pending = b""                 # DATA not yet queued for want of window
        self.send_window = send_window
        self.status = 0
        self.headers = _NO_HEADERS         # those of the final answer, once it came
        self.body: Union[bytes, bytearray] = b""
        self.deadline = deadline
        self.first_byte = first_byte       # where the stream starts in the connection's output
        self.end_byte = first_byte         # where it ends, while its bytes are one run; else 0
        self.data_queued = 0               # bytes of DATA queued, counted against the window


_CONTENT_LENGTH_FIELDS = {}  # type: Dict[int, bytes]


def _content_length_field(length: int) -> bytes:
    """The HPACK field ``content-length: <length>``, remembered for the next request."""
    field = _hpack_encode_field("content-length", str(length))
    if len(_CONTENT_LENGTH_FIELDS) >= _H2_LENGTH_CACHE:
        _CONTENT_LENGTH_FIELDS.clear()
    _CONTENT_LENGTH_FIELDS[length] = field
    return field


# A frame's 9-octet header: length (24 bits) and type in one word, flags, stream id.
_FRAME_HEAD = struct.Struct(">IBI")


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME_HEAD.pack(len(payload) << 8 | kind, flags, stream_id) + payload


class _Windowed(Protocol):
    """A stream as _H2Endpoint sees it: how much DATA the peer lets us send on it."""

    send_window: int


class _H2Endpoint:
    """What both ends of an HTTP/2 connection do alike (the client's _H2Connection, the
    fake FCM's _FakeH2): keep to the peer's SETTINGS and flow-control windows, and frame
    a header block. Each end sends the DATA that waited for a window its own way."""

    outgoing: bytearray
    streams: Mapping[int, _Windowed]
    _in: bytearray                     # the start of a frame not yet whole
    _peer_window: int                  # DATA bytes the peer lets us send, all streams together
    _peer_initial_window: int          # a new stream's window, as the peer's SETTINGS say
    _peer_frame: int                   # the largest frame the peer takes

    def _unblock(self) -> None:
        """Queue the DATA that was waiting for a larger window."""
        raise NotImplementedError

    def _joined(self, data: bytes) -> bytes:
        """``data`` after the start of a frame kept from before, as bytes (so that each
        payload is one copy, and a header block hashable)."""
        kept = self._in
        if kept:
            kept += data
            data = bytes(kept)
            kept.clear()
        elif type(data) is not bytes:
            data = bytes(data)
        return data

    def _frames(self, data: bytes, offset: int = 0) -> Iterator[Tuple[int, int, int, bytes]]:
        """The whole frames of ``data`` from ``offset``, as (type, flags, stream id,
        payload); the start of one not yet whole is kept for the next bytes."""
        end = len(data)
        unpack = _FRAME_HEAD.unpack_from
        while end - offset >= 9:
            head, flags, stream_id = unpack(data, offset)
            length = head >> 8
            if length > _H2_FRAME:
                raise _H2Error("a frame of %d bytes" % length, _FRAME_SIZE_ERROR)
            stop = offset + 9 + length
            if stop > end:
                break
            payload = data[offset + 9:stop]
            offset = stop
            yield head & 0xFF, flags, stream_id & _H2_LAST_STREAM, payload
        if offset < end:
            self._in[:] = data[offset:]

    def _peer_settings(self, payload: bytes) -> Dict[int, int]:
        """Take a SETTINGS frame of the peer: keep to its windows and frame size, ACK it,
        send what a larger window lets go; the values it sets, for what else they bind."""
        if len(payload) % 6:
            raise _H2Error("a SETTINGS frame of %d bytes" % len(payload), _FRAME_SIZE_ERROR)
        values = {}
        for offset in range(0, len(payload), 6):
            name = int.from_bytes(payload[offset:offset + 2], "big")
            value = values[name] = int.from_bytes(payload[offset + 2:offset + 6], "big")
            if name == _SETTINGS_INITIAL_WINDOW_SIZE:
                if value > _H2_LAST_STREAM:
                    raise _H2Error("a window above 2^31-1", _FLOW_CONTROL_ERROR)
                for stream in self.streams.values():
                    stream.send_window += value - self._peer_initial_window
                self._peer_initial_window = value
            elif name == _SETTINGS_MAX_FRAME_SIZE:
                if not _H2_FRAME <= value <= 16777215:
                    raise _H2Error("a frame size of %d" % value)
                self._peer_frame = value
        self.outgoing += _frame(_SETTINGS, _ACK, 0)
        self._unblock()
        return values

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _H2Error("a WINDOW_UPDATE frame of %d bytes" % len(payload), _FRAME_SIZE_ERROR)
        increment = int.from_bytes(payload, "big") & _H2_LAST_STREAM
        if stream_id == 0:
            self._peer_window += increment
        elif stream_id in self.streams:
            self.streams[stream_id].send_window += increment
        self._unblock()

    def _queue_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        """HEADERS, then CONTINUATION frames if the block is larger than a frame."""
        first, rest = block[:self._peer_frame], block[self._peer_frame:]
        flags = (_END_STREAM if end_stream else 0) | (0 if rest else _END_HEADERS)
        self.outgoing += _frame(_HEADERS, flags, stream_id, first)
        while rest:
            piece, rest = rest[:self._peer_frame], rest[self._peer_frame:]
            self.outgoing += _frame(_CONTINUATION, 0 if rest else _END_HEADERS, stream_id, piece)

    @staticmethod
    def _unpadded(payload: bytes) -> bytes:
        """A padded frame's payload without its pad length and padding."""
        if not payload or payload[0] >= len(payload):
            raise _H2Error("bad padding")
        return payload[1:len(payload) - payload[0]]


class _H2Connection(_H2Endpoint):
    """The client side of one HTTP/2 connection, without a socket or a clock.

    ``receive`` takes the bytes read, ``outgoing`` holds the bytes to write (the driver
    reports what it wrote with ``wrote``), ``start`` queues a request, and every ended
    stream lands in ``finished`` as (key, outcome): a Response, a NetworkError, or
    _NotProcessed when the server provably did not process it. States::

        WAITING_FOR_SETTINGS --SETTINGS--> OPEN --GOAWAY--> GOING_AWAY
                 |                          |                   |
                 +--------- lost(), a protocol error -----------+--> CLOSED

    Streams start only when OPEN; a GOAWAY (the shutdown notice with last stream id
    2^31-1 too) ends new streams, and those above its last stream id are not processed.
    """

    def __init__(self, authority: str, scheme: str) -> None:
        self.state = "WAITING_FOR_SETTINGS"
        self._authority = authority
        self._scheme = scheme
        self._in = bytearray()
        settings = b"".join(name.to_bytes(2, "big") + value.to_bytes(4, "big")
                            for name, value in _H2_SETTINGS)
        self.outgoing = bytearray(_H2_PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(
            _WINDOW_UPDATE, 0, 0, (_H2_WINDOW - _H2_DEFAULT_WINDOW).to_bytes(4, "big")))
        self._written = 0                  # bytes of output written, ever
        self._decoder = _HPACKDecoder(_H2_HEADER_TABLE)
        self._blocks: Dict[Tuple[Any, ...], Tuple[bytes, bytes]] = {}
        # The headers, path and method of the last request started, its block's parts
        # before and after the content-length, its body's length and its whole block.
        self._last_block: Tuple[Any, ...] = (None, "", "", b"", b"", -1, b"")
        self._header_block: Optional[Tuple[int, bool, bytearray]] = None
        self._awaited: Optional[int] = _SETTINGS  # the one kind of frame that may come next
        self._answers: Dict[Tuple[Tuple[str, str], ...], Tuple[int, Headers]] = {}
        self._last_answer: Tuple[Any, Tuple[int, Headers]] = (None, (-1, _NO_HEADERS))
        self.streams: Dict[int, _H2Stream] = {}   # in the order started
        self._blocked: List[_H2Stream] = []       # those whose DATA waits for a window
        self.finished: List[Tuple[object, Union[Response, Exception]]] = []
        self._next_id = 1
        self.max_streams = 0               # none until the server's SETTINGS say how many
        self._peer_window = _H2_DEFAULT_WINDOW
        self._peer_initial_window = _H2_DEFAULT_WINDOW
        self._peer_frame = _H2_FRAME
        self._received_unacknowledged = 0
        self.last_stream_id = _H2_LAST_STREAM   # lowered by GOAWAY
        self._earliest = math.inf               # no stream's deadline is before this

    def free_streams(self) -> int:
        """How many more streams may start now."""
        if self.state != "OPEN":
            return 0
        free = self.max_streams - len(self.streams)
        if self._next_id + 2 * free > _H2_LAST_STREAM:  # fewer ids are left (small ints first)
            free = (_H2_LAST_STREAM - self._next_id) // 2
        return free if free > 0 else 0

    # Starting and cancelling requests ------------------------------------------

    def start(self, method: str, path: str, headers: Dict[str, str], body: bytes,
              key: object, deadline: float) -> int:
        """Queue a request as a new stream and return its id; ``key`` names its outcome.

        ``headers`` are never changed once made, so the dict of the request before, given
        again, is known to hold the same: a burst of requests encodes them once, and its
        header block again only for a body of another length."""
        if not self.free_streams():
            raise RuntimeError("no stream may start on this connection (%s)" % self.state)
        length = len(body)
        last = self._last_block
        if last[0] is headers and last[1] == path and last[2] == method:
            head, tail = last[3], last[4]
            block = last[6] if last[5] == length else b""
        else:
            head, tail = self._header_parts(method, path, headers)
            block = b""
        if not block:
            block = head + (_CONTENT_LENGTH_FIELDS.get(length)
                            or _content_length_field(length)) + tail
            self._last_block = (headers, path, method, head, tail, length, block)
        stream_id = self._next_id
        self._next_id = stream_id + 2
        out = self.outgoing
        first_byte = self._written + len(out)
        stream = _H2Stream(stream_id, key, deadline, self._peer_initial_window, first_byte)
        self.streams[stream_id] = stream
        if deadline < self._earliest:
            self._earliest = deadline
        block_size = len(block)
        if block_size <= self._peer_frame and length <= self._peer_frame \
                and length <= self._peer_window and length <= stream.send_window:
            # The usual request: one HEADERS frame and at most one DATA frame, joined once.
            if body:
                frames = b"".join((
                    _FRAME_HEAD.pack(block_size << 8 | _HEADERS, _END_HEADERS, stream_id), block,
                    _FRAME_HEAD.pack(length << 8 | _DATA, _END_STREAM, stream_id), body))
                self._peer_window -= length
                stream.send_window -= length
                stream.data_queued = length
            else:
                frames = b"".join((_FRAME_HEAD.pack(
                    block_size << 8 | _HEADERS, _END_HEADERS | _END_STREAM, stream_id), block))
            out += frames
            stream.end_byte = first_byte + len(frames)
        else:
            self._queue_headers(stream_id, block, end_stream=not body)
            stream.end_byte = self._written + len(out)
            stream.pending = body
            self._send_data(stream)
        return stream_id

    def cancel(self, stream_id: int) -> None:
        """Give up on a stream without an outcome (its sender no longer waits)."""
        stream = self.streams.get(stream_id)
        if stream is not None and not self._withdraw(stream):
            self.outgoing += _frame(_RST_STREAM, 0, stream_id, _CANCEL.to_bytes(4, "big"))
        self.streams.pop(stream_id, None)

    def _withdraw(self, stream: _H2Stream) -> bool:
        """Take a stream's bytes back out of ``outgoing`` if none was written and they are
        still one run: the server never hears of it (an id skipped is a stream closed, RFC
        9113 section 5.1.1), so no RST_STREAM is due and it was provably not processed.
        False if it cannot be taken back (queued bytes are written, a RST_STREAM after
        them: the server may process it)."""
        if stream.first_byte < self._written or not stream.end_byte:
            return False
        size = stream.end_byte - stream.first_byte
        start = stream.first_byte - self._written
        del self.outgoing[start:start + size]
        self._peer_window += stream.data_queued
        for other in self.streams.values():
            if other.first_byte >= stream.end_byte:  # queued after it: now earlier
                other.first_byte -= size
                if other.end_byte:
                    other.end_byte -= size
        return True

    def _header_parts(self, method: str, path: str,
                      headers: Dict[str, str]) -> Tuple[bytes, bytes]:
        """A request's HPACK block before and after its content-length field.

        The same few recur whatever the body's length, so they are remembered.
        """
        key = (method, path, *headers.items())
        parts = self._blocks.get(key)
        if parts is None:
            parts = (_hpack_encode([(":method", method), (":scheme", self._scheme),
                                    (":authority", self._authority), (":path", path),
                                    ("user-agent", _USER_AGENT)]),
                     _hpack_encode([(name.lower(), value) for name, value in headers.items()]))
            if len(self._blocks) >= _H2_BLOCK_CACHE:
                self._blocks.clear()
            self._blocks[key] = parts
        return parts

    def _send_data(self, stream: _H2Stream) -> None:
        """Queue as much of the stream's body as the flow-control windows allow."""
        joined = stream.end_byte == self._written + len(self.outgoing)  # it ends the output
        while stream.pending:
            size = min(len(stream.pending), self._peer_frame, self._peer_window,
                       stream.send_window)
            if size <= 0:
                self._blocked.append(stream)
                break
            piece, stream.pending = stream.pending[:size], stream.pending[size:]
            self._peer_window -= size
            stream.send_window -= size
            stream.data_queued += size
            self.outgoing += _frame(_DATA, 0 if stream.pending else _END_STREAM, stream.id,
                                    piece)
        stream.end_byte = self._written + len(self.outgoing) if joined else 0

    # Bytes in and out -----------------------------------------------------------

    def wrote(self, count: int) -> None:
        """The driver wrote the first ``count`` bytes of ``outgoing``."""
        del self.outgoing[:count]
        self._written += count

    def receive(self, data: bytes) -> None:
        """Handle the frames in ``data`` (and any partial frame left from before).

        Those of answers, HEADERS and DATA, are handled in this one pass over the frames,
        as is the RST_STREAM nginx sends after each stream it answered (ended already,
        nothing to do); the rest in _on_frame.
        Raises _H2Error when the server broke the protocol; call ``abort`` then.
        """
        streams = self.streams
        for kind, flags, stream_id, payload in self._frames(self._joined(data)):
            if self._awaited is not None and kind != self._awaited:
                raise _H2Error("a header block was interrupted" if self._header_block
                               else "the server's first frame was not SETTINGS")
            if kind == _DATA:
                self._on_data(flags, stream_id, payload)
            elif kind == _HEADERS and flags & (_END_HEADERS | _PADDED | _PRIORITY_FLAG) \
                    == _END_HEADERS:  # the usual block, whole in one frame
                self._on_headers(stream_id, bool(flags & _END_STREAM), payload)
            elif kind != _RST_STREAM or stream_id in streams:
                self._on_frame(kind, flags, stream_id, payload)

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        """Handle a frame other than the usual ones of an answer."""
        if kind in (_HEADERS, _CONTINUATION):
            self._on_header_fragment(kind, flags, stream_id, payload)
        elif kind == _RST_STREAM:
            self._on_reset(stream_id, payload)
        elif kind == _SETTINGS and not flags & _ACK:
            self._on_settings(payload)
        elif kind == _PING and not flags & _ACK:
            self.outgoing += _frame(_PING, _ACK, 0, payload)
        elif kind == _GOAWAY:
            self._on_goaway(payload)
        elif kind == _WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == _PUSH_PROMISE:
            raise _H2Error("server push, which we disabled")

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._received_unacknowledged += len(payload)
        if self._received_unacknowledged > _H2_WINDOW // 2:
            self.outgoing += _frame(_WINDOW_UPDATE, 0, 0,
                                    self._received_unacknowledged.to_bytes(4, "big"))
            self._received_unacknowledged = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream we cancelled or gave up on
        if flags & _PADDED:
            payload = self._unpadded(payload)
        if not stream.body:
            stream.body = payload  # the whole body, usually: kept without a copy
        else:
            if not isinstance(stream.body, bytearray):
                stream.body = bytearray(stream.body)
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
                payload = self._unpadded(payload)
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            self._header_block = (stream_id, bool(flags & _END_STREAM), bytearray())
            self._awaited = _CONTINUATION
        elif self._header_block is None or self._header_block[0] != stream_id:
            raise _H2Error("a CONTINUATION frame out of place")
        assert self._header_block is not None
        self._header_block[2].extend(payload)
        if len(self._header_block[2]) > _MAX_HEAD:
            raise _H2Error("a header block over %d bytes" % _MAX_HEAD)
        if flags & _END_HEADERS:
            stream_id, end_stream, block = self._header_block
            self._header_block = self._awaited = None
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
            last = self._last_answer  # the decoder gives a block it remembers as the same tuple
            status, headers = last[1] if last[0] is fields else self._answer(fields)
            if status < 0:
                self._reset(stream, NetworkError("the server answered without a valid :status",
                                                 may_have_been_delivered=True))
                return
            if status // 100 != 1:
                stream.status = status
                stream.headers = headers
        if end_stream:
            self._complete(stream)

    def _answer(self, fields: Tuple[Tuple[str, str], ...]) -> Tuple[int, Headers]:
        """The status (-1 if none is valid) and Headers a block's fields stand for.

        Servers repeat themselves, so these are remembered, and answers alike share one
        Headers: it cannot be changed. The last one is kept apart too, for _on_headers to
        find by identity, as hashing the fields costs more than the rest of a lookup.
        """
        answer = self._answers.get(fields)
        if answer is None:
            answer = self._interpret(fields)
            if len(self._answers) >= _H2_ANSWER_CACHE:
                self._answers.clear()
            self._answers[fields] = answer
        self._last_answer = (fields, answer)
        return answer

    @staticmethod
    def _interpret(fields: Tuple[Tuple[str, str], ...]) -> Tuple[int, Headers]:
        """The status (-1 if none is valid) and Headers of a block's fields."""
        status = dict(fields).get(":status", "")
        items: Dict[str, str] = {}
        if not (len(status) == 3 and _is_digits(status)):
            return -1, _NO_HEADERS
        for name, value in fields:
            if not name.startswith(":"):  # a name may be empty
                old = items.get(name)
                items[name] = value if old is None else old + ", " + value
        return int(status), Headers(items)

    def _on_reset(self, stream_id: int, payload: bytes) -> None:
        """The server reset a stream still open (receive passes over those ended)."""
        code = int.from_bytes(payload[:4], "big")
        stream = self.streams[stream_id]
        if code == _REFUSED_STREAM:
            self._finish(stream, _NotProcessed("the server refused the stream"))
        else:
            self._finish(stream, NetworkError(
                "the server reset the stream (HTTP/2 error %d)" % code,
                may_have_been_delivered=True))

    def _on_settings(self, payload: bytes) -> None:
        values = self._peer_settings(payload)
        if self.state == "WAITING_FOR_SETTINGS":
            self.state = "OPEN"
            self._awaited = None
            self.max_streams = _H2_LAST_STREAM  # unless it says otherwise
        self.max_streams = values.get(_SETTINGS_MAX_CONCURRENT_STREAMS, self.max_streams)

    def _on_goaway(self, payload: bytes) -> None:
        if len(payload) < 8:
            raise _H2Error("a GOAWAY frame of %d bytes" % len(payload), _FRAME_SIZE_ERROR)
        last = int.from_bytes(payload[:4], "big") & _H2_LAST_STREAM
        self.last_stream_id = min(self.last_stream_id, last)
        if self.state != "CLOSED":
            self.state = "GOING_AWAY"
        for stream in list(self.streams.values()):
            if stream.id > self.last_stream_id:
                self._finish(stream, _NotProcessed(
                    "the server's GOAWAY left the stream unprocessed"))

    def _unblock(self) -> None:
        """Queue the DATA that was waiting for a larger window, oldest stream first (only
        those: a WINDOW_UPDATE comes for most streams, while most have sent all)."""
        blocked, self._blocked = self._blocked, []
        for stream in blocked:
            if self.streams.get(stream.id) is stream:  # not ended meanwhile
                self._send_data(stream)

    # Ending streams -------------------------------------------------------------

    def _complete(self, stream: _H2Stream) -> None:
        """The server ended the stream: finish it with its answer."""
        if not stream.status:  # DATA before HEADERS, or only a 1xx: no answer at all
            self._reset(stream, NetworkError("the server ended the stream without a :status",
                                             may_have_been_delivered=True))
            return
        self._finish(stream, Response(stream.status, "", stream.headers, bytes(stream.body)))

    def _finish(self, stream: _H2Stream, outcome: Union[Response, Exception]) -> None:
        """End an open stream (every caller found it in ``streams``) with ``outcome``."""
        del self.streams[stream.id]
        self.finished.append((stream.key, outcome))

    def _reset(self, stream: _H2Stream, error: Exception) -> None:
        """Give up on a stream: tell the server, and finish it with ``error``."""
        self.outgoing += _frame(_RST_STREAM, 0, stream.id, _CANCEL.to_bytes(4, "big"))
        self._finish(stream, error)

    def expire(self, now: float, no_answer: Callable[[Any, bool], Exception]) -> None:
        """End the streams whose deadline (driver time, as given to ``start``) has passed,
        each with the error ``no_answer(key, sent)`` makes for its key (``sent``: whether
        the server may have processed it). One none of whose bytes was written is taken
        back; one partly written, or queued and not taken back, may still arrive."""
        if now < self._earliest:
            return
        for stream in [s for s in self.streams.values() if s.deadline <= now]:
            if self._withdraw(stream):
                self._finish(stream, no_answer(stream.key, False))
            else:
                self._reset(stream, no_answer(stream.key, stream.id <= self.last_stream_id))
        self._earliest = min([s.deadline for s in self.streams.values()] + [math.inf])

    def next_deadline(self) -> float:
        """When ``expire`` may next have something to do (perhaps earlier)."""
        return self._earliest

    def ping(self) -> None:
        """Ask the server for a sign of life (the driver decides when, sparingly)."""
        self.outgoing += _frame(_PING, 0, 0, b"andpush!")

    def close(self) -> None:
        """Say goodbye (best effort: queued, the driver may write it) and end every stream."""
        if self.state != "CLOSED":
            self.outgoing += _frame(_GOAWAY, 0, 0, bytes(4) + _NO_ERROR.to_bytes(4, "big"))
        self.lost("the client closed the connection")

    def abort(self, error: _H2Error) -> None:
        """Tell the server why we give up on the connection (queued), and end every stream."""
        self.outgoing += _frame(_GOAWAY, 0, 0, bytes(4) + error.code.to_bytes(4, "big"))
        self.lost("the server broke HTTP/2: %s" % error)

    def lost(self, reason: str) -> None:
        """The connection is gone: end every stream, saying whether it may have arrived."""
        self.state = "CLOSED"
        for stream in list(self.streams.values()):
            if self.may_have_arrived(stream):
                self._finish(stream, NetworkError(reason, may_have_been_delivered=True))
            else:
                self._finish(stream, _NotProcessed(reason))

    def may_have_arrived(self, stream: _H2Stream) -> bool:
        """Whether the server may have processed ``stream`` once the connection is gone
        (what was queued is never written): some of it was written, and no GOAWAY left it
        above the last stream id."""
        return stream.first_byte < self._written and stream.id <= self.last_stream_id


# Transport ###################################################################
# One engine per client: it owns every connection and runs every request; drivers do the I/O.

_RECV_SIZE = 256 * 1024
_WRITE_SIZE = 64 * 1024
_TLS_RECORD = 16 * 1024  # the most data a TLS record holds: all one SSLObject.read gives
_H2_PING_QUIET = 10.0      # seconds without a frame, streams open, before one PING
_H2_STREAMS_EXPECTED = 100  # streams a new HTTP/2 connection is counted for, before its SETTINGS
_WOULD_BLOCK = (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError)


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


def _connect(origin: _Origin, ssl_context: ssl.SSLContext,
             timeout: float) -> Union[socket.socket, "_TLSSocket"]:
    """A connected socket to ``origin``: TCP, the CONNECT tunnel if any, then for https
    the TLS handshake (certificate and host name checked as ``ssl_context`` says).

    It blocks (for at most ``timeout`` per step), so the thread driver runs it on a thread of
    its own; raises NetworkError when it fails, with the socket closed.
    """
    address = origin.proxy[:2] if origin.proxy else (origin.host, origin.port)
    sock = None
    try:
        sock = socket.create_connection(address, timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if origin.proxy:
            sock.sendall(_tunnel_request(origin, origin.proxy[2]))
            head = b""
            while not _tunnel_answered(head):
                data = sock.recv(_MAX_HEAD)
                if not data:
                    raise ConnectionResetError("the proxy closed the connection")
                head += data
        return _TLSSocket(sock, ssl_context, origin.host) if origin.scheme == "https" else sock
    except (OSError, _ProtocolError) as exc:
        if sock is not None:
            sock.close()
        raise _connect_error(origin, exc, timeout, isinstance(exc, socket.timeout)) from exc


def _tunnel_request(origin: _Origin, headers: Dict[str, str]) -> bytes:
    """The CONNECT request that asks a proxy for a tunnel to ``origin``."""
    lines = ["CONNECT %s:%d HTTP/1.1" % (origin.host, origin.port),
             "Host: %s:%d" % (origin.host, origin.port)]
    lines += ["%s: %s" % item for item in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _tunnel_answered(head: bytes) -> bool:
    """Whether ``head``, what the proxy sent so far, is its whole answer: True if it opened
    the tunnel, False if more is to come; _ProtocolError if it refused (or broke HTTP)."""
    end = head.find(b"\r\n\r\n")
    if end < 0:
        if len(head) > _MAX_HEAD:
            raise _ProtocolError("the proxy's answer is too long")
        return False
    if end + 4 != len(head):  # the server speaks only after our TLS ClientHello
        raise _ProtocolError("the proxy sent more than its answer")
    _, status, reason = _parse_status_line(head.split(b"\r\n", 1)[0].decode("latin-1"))
    if status != 200:
        raise _ProtocolError("the proxy refused the tunnel: %d %s" % (status, reason))
    return True


# How to change the timeouts, for the errors that say one ran out.
_TIMEOUT_HINT = "raise it with timeout=SECONDS"
_X509_HOSTNAME_MISMATCH = 62  # OpenSSL's verify code: the certificate is for another host


def _connect_error(origin: _Origin, exc: BaseException, timeout: float,
                   timed_out: bool) -> NetworkError:
    """The error of a connection to ``origin`` that did not come up (nothing was sent)."""
    where = "the proxy %s:%d for %r" % (origin.proxy[:2] + (origin,)) if origin.proxy \
        else repr(origin)
    if isinstance(exc, ssl.SSLCertVerificationError):
        if exc.verify_code == _X509_HOSTNAME_MISMATCH:
            fix = "check the endpoint, and the proxy if one answers for it"
        else:
            fix = ("trust the CA that issued it with ssl_context=ssl.create_default_context("
                   "cafile=...) (--cafile on the command line); behind a proxy that inspects "
                   "TLS, that is the proxy's CA")
        return CertificateError(
            "the TLS certificate of %r failed verification (%s): %s. Sending again cannot "
            "help" % (origin, _reason(exc), fix), may_have_been_delivered=False)
    if timed_out:
        return NetworkError("could not connect to %s within the connect timeout of %.3g s; "
                            "if the network is slow, %s" % (where, timeout, _TIMEOUT_HINT),
                            may_have_been_delivered=False)
    return NetworkError("could not connect to %s: %s" % (where, _reason(exc)),
                        may_have_been_delivered=False)


class _TLSSocket:
    """A socket that speaks TLS through memory BIOs, for the thread driver: one recv takes
    every record the kernel holds (up to _RECV_SIZE raw bytes) and decrypts them in memory,
    where an ssl.SSLSocket makes a call (and often a system call) per record.

    Made over a connected blocking socket, it does the handshake at once, each step within
    the socket's timeout; the driver then makes it non-blocking and selects on it as on a
    socket (``fileno``)."""

    __slots__ = ("sock", "tls", "incoming", "outgoing", "unsent", "early", "drained", "ended",
                 "failure")

    def __init__(self, sock: socket.socket, ssl_context: ssl.SSLContext, host: str) -> None:
        self.sock = sock
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = ssl_context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)
        self.unsent = b""      # raw bytes encrypted but not yet taken by the socket
        self.early = b""       # data that came with the handshake's last bytes
        self.drained = False   # the last recv emptied the kernel's buffer
        self.ended = False     # the server's close_notify (or EOF) came
        self.failure: Optional[ssl.SSLError] = None  # a TLS error found after data
        try:
            self._handshake()
            with contextlib.suppress(ssl.SSLWantReadError):
                self.early = self._decrypt()
        except BaseException:
            sock.close()
            raise

    def _handshake(self) -> None:
        """Exchange handshake messages until TLS is up, each socket call within its timeout.
        A failed check's alert goes to the server too, as an ssl.SSLSocket sends it."""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                data = self.sock.recv(_RECV_SIZE)
                if not data:
                    raise ConnectionResetError("the server closed the connection during "
                                               "the TLS handshake") from None
                self.incoming.write(data)
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    self.sock.sendall(self.outgoing.read())
                raise
        self.sock.sendall(self.outgoing.read())

    @property
    def alpn(self) -> Optional[str]:
        return self.tls.selected_alpn_protocol()

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def close(self) -> None:
        self.sock.close()

    def recv(self, size: int) -> bytes:
        """The data that one recv of at most ``size`` raw bytes (with what came before)
        decrypts to; b"" once the server ended the connection (its close_notify, or EOF).
        SSLWantReadError if the bytes held no data (part of a record, session tickets);
        another ssl.SSLError if the connection is broken."""
        if self.early:
            data, self.early = self.early, b""
            return data
        if self.failure is not None:
            raise self.failure
        if self.ended:
            return b""
        self.drained = True
        raw = self.sock.recv(size)
        self.drained = len(raw) < size
        if not raw:
            self.ended = True
            self.incoming.write_eof()  # all before was decrypted: at most part of a record
            return b""
        self.incoming.write(raw)
        return self._decrypt()

    def _decrypt(self) -> bytes:
        """The data the incoming BIO holds; SSLWantReadError if none. A TLS error after
        data waits for the next recv, so that the data before it is handed over."""
        parts = []
        read = self.tls.read
        try:
            while True:
                part = read(_TLS_RECORD)
                if not part:  # close_notify
                    self.ended = True
                    break
                parts.append(part)
                if not self.incoming.pending:
                    break  # (a read now would only say it wants more)
        except ssl.SSLZeroReturnError:
            self.ended = True
        except ssl.SSLError as exc:
            if not parts:
                raise
            if not isinstance(exc, ssl.SSLWantReadError):
                self.failure = exc
        if self.outgoing.pending:  # a TLS 1.3 KeyUpdate answer: it goes out with the next
            self.unsent += self.outgoing.read()
        return b"".join(parts)

    def send(self, data: bytes) -> int:
        """Encrypt ``data`` and send it, once the raw bytes of what came before have all
        gone (BlockingIOError until then); what the socket does not take waits in
        ``unsent``. Returns len(data): all of it is taken."""
        if self.unsent:
            self.flush()
        self.tls.write(data)
        raw = self.outgoing.read()
        try:
            sent = self.sock.send(raw)
        except BlockingIOError:
            sent = 0
        self.unsent = raw[sent:]
        return len(data)

    def flush(self) -> None:
        """Send the raw bytes waiting; BlockingIOError if the socket does not take them all."""
        if self.unsent:
            sent = self.sock.send(self.unsent)
            self.unsent = self.unsent[sent:]
            if self.unsent:
                raise BlockingIOError


class _Link:
    """One connection as the engine sees it: its protocol state and the driver's carrier
    (a non-blocking socket, or an asyncio transport), which only the driver touches."""

    __slots__ = ("carrier", "route", "closed", "idle_since", "last_read", "usable", "carried",
                 "answered", "blocked")

    def __init__(self, carrier: Any, route: "_Route", now: float) -> None:
        self.carrier = carrier
        self.route = route
        self.closed = False
        self.idle_since = now
        self.last_read = now
        self.usable = True      # it may carry requests (an HTTP/2 one once its SETTINGS came)
        self.carried = False    # a request was started on it
        self.answered = False   # an answer came on it: the server works
        self.blocked = False    # the thread driver waits for room to write on it

    def pending(self) -> bytearray:
        """The bytes waiting to be written."""
        raise NotImplementedError

    def wrote(self, count: int) -> None:
        raise NotImplementedError


class _H1Link(_Link):
    """An HTTP/1.1 connection: one exchange at a time, kept alive between them."""

    __slots__ = ("out", "reader", "exchange", "reused")

    def __init__(self, carrier: Any, route: "_Route", now: float) -> None:
        super().__init__(carrier, route, now)
        self.out = bytearray()
        self.reader = _H1Reader()
        self.exchange: Optional[_Exchange] = None
        self.reused = False

    def pending(self) -> bytearray:
        return self.out

    def wrote(self, count: int) -> None:
        del self.out[:count]


class _H2Link(_Link):
    """An HTTP/2 connection: the sans-I/O _H2Connection and what carries its bytes."""

    __slots__ = ("conn", "opened", "pinged")

    def __init__(self, carrier: Any, route: "_Route", now: float) -> None:
        super().__init__(carrier, route, now)
        self.conn = _H2Connection(route.origin.host_header, route.origin.scheme)
        self.opened = now
        self.pinged = False
        self.usable = False

    def pending(self) -> bytearray:
        return self.conn.outgoing

    def wrote(self, count: int) -> None:
        self.conn.wrote(count)


# Seconds no connection is added to a route after one failed (did not come up, or ended
# before it ever answered); doubled by each later round of failures, up to the most, and
# started afresh once a connection answers. A server that fails every connection, or turns
# away those beyond a limit, so gets a few tries, not a storm of them.
_CONNECT_BACKOFF = 0.5
_MAX_CONNECT_BACKOFF = 30.0


class _Route:
    """The requests to one origin, and the connections that carry them (the engine's own).

    ``limit`` bounds the connections open at once: the pool size, widened while a
    push_many runs. HTTP/2 connections carry as many streams as each server allows.
    """

    def __init__(self, engine: "_Engine", origin: _Origin, limit: int) -> None:
        self.engine = engine
        self.origin = origin
        self.host = origin.host_header
        self.limit = limit
        self.speaks_h2: Optional[bool] = None    # known from the first connection's ALPN
        self.h2: List[_H2Link] = []
        self.idle: List[_H1Link] = []            # most recently used last
        self.busy: Dict[_H1Link, None] = {}      # a dict: any one leaves at O(1)
        self.connecting = 0
        self.failed_connects = 0                 # rounds of them since a connection answered
        self.hold_until = 0.0                    # no connection is added before (0: none)
        self.connect_error: Optional[NetworkError] = None  # why the last one failed
        self.generation = 0                      # counts resets: a connect from before is stale
        self.waiting: Deque[_Exchange] = collections.deque()
        self.heads: Dict[bytes, _H1Head] = {}    # HTTP/1.1 response heads seen, parsed

    def links(self) -> List[_Link]:
        return [*self.h2, *self.idle, *self.busy]

    def connections(self) -> int:
        return len(self.h2) + len(self.idle) + len(self.busy) + self.connecting

    def reset(self) -> None:
        """Forget every connection and request: in a forked child, or after a crash."""
        self.h2, self.idle, self.busy = [], [], {}
        self.connecting = self.failed_connects = 0
        self.hold_until = 0.0
        self.connect_error = None
        self.generation += 1
        self.waiting.clear()

    def __repr__(self) -> str:
        return repr(self.origin)


# Bytes of requests waiting on a connection that are written at once, not at the end of the
# turn: the first requests of a burst go out while the rest are being made and placed.
_EARLY_WRITE = 8 * 1024
# Exchanges begun at a time: push_many makes and starts its own in runs of this many, and
# the asyncio client begins its callers' pushes in runs as well, so that the first of a
# burst go out (see _EARLY_WRITE) while the rest are being made.
_RUN = 32


def _no_answer(exchange: _Exchange, read_timeout: float, sent: bool = True) -> NetworkError:
    """The error of a request whose answer did not come within its read timeout (its own
    ``timeout``, else the client's): which, how long, where, and how to change it.
    ``sent``: whether any of it went out (else it was not processed)."""
    path = exchange.path.partition("?")[0]
    if "/registrations/" in path:  # a topic change: its path holds a device token
        path = path.partition("/registrations/")[0] + "/registrations/..."
    return NetworkError(
        "no answer from %r%s within the read timeout of %.3g s (%s); if the server is slow, %s"
        % (exchange.route, path, exchange.timeout or read_timeout,
           "the request may have been processed" if sent else "the request did not go out",
           _TIMEOUT_HINT),
        may_have_been_delivered=sent)


class _Engine:
    """Every request of one client, through the connections that carry them: when each
    attempt starts (the _Policy says), on which connection, and what its result means.

    It does no I/O and never blocks. A driver (_ThreadDriver: a thread around a selector;
    _AsyncDriver: an asyncio event loop) opens the connections, moves their bytes and
    keeps the time, calling it from one thread only: ``_received`` and ``_lost`` for what
    a connection did, ``_connected`` for a connection made, ``_turn`` when time passed.
    The engine asks the driver back through ``_open``, ``_watch``, ``_send`` and ``_shut``.
    """

    def __init__(self, connect_timeout: float, read_timeout: float,
                 keep_alive_timeout: float, proxy: Optional[str], policy: _Policy) -> None:
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._keep_alive_timeout = keep_alive_timeout
        self._proxy = proxy
        self.policy = policy
        self.clock = _Clock()  # the one seam for time: everything timed reads this
        self._routes: List[_Route] = []
        self._batches: List["_Batch"] = []
        self._timers: List[Tuple[float, int, Callable[[_Exchange], None], _Exchange]] = []
        self._timer_seq = 0
        self._needs_token: List[_Exchange] = []
        self._refreshing: List[_Signer] = []
        self._dirty: List[_Link] = []
        self._arrived: List[_Exchange] = []  # callers' exchanges, begun at the next turn
        self._due = 0.0  # no deadline of a connection or exchange is before this

    def route(self, url: str, pool_size: int = 1) -> _Route:
        """The route to ``url``'s origin; https goes through the proxy, if one applies."""
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        https = url.lower().startswith("https:")
        proxy = None
        if https:  # proxy="" means none, whatever the environment says
            proxy = self._proxy if self._proxy is not None else _proxy_from_environment(host)
        route = _Route(self, _Origin(url, proxy), pool_size)
        self._routes.append(route)
        return route

    # What the driver provides -------------------------------------------------------

    def _open(self, route: _Route, count: int) -> None:
        """Start opening ``count`` connections to ``route``, all at once; the driver calls
        ``_connected`` with each (or ``_connect_failed``) when it is done."""
        raise NotImplementedError

    def _watch(self, link: _Link) -> None:
        """Start handing what a connection just made receives to ``_received``."""
        raise NotImplementedError

    def _send(self, link: _Link) -> None:
        """Write what ``link`` has pending, as much as its connection takes now."""
        raise NotImplementedError

    def _shut(self, link: _Link) -> None:
        """Close the connection, after what ``link`` has pending if it fits at once."""
        raise NotImplementedError

    def wake(self) -> None:
        """Have the driver take a turn soon: a push_many prepared what can start."""
        raise NotImplementedError

    # What the driver calls -----------------------------------------------------------

    def _turn(self) -> Optional[float]:
        """Do what is due: begin what callers sent meanwhile, then timers, deadlines,
        prepared batches (the outcomes of those that ended stored, and more started);
        then write what waits.

        Returns the seconds the driver may wait before the next turn (None: until a
        connection or a caller has something): 0 when outcomes stored at its end made
        room for a batch's prepared messages."""
        if self._arrived:
            self._begin_arrived()
        now = self.clock.now()
        self._fire_timers(now)
        expired = now >= self._due
        if expired:
            self._expire(now)
        self._feed_batches()
        dirty, self._dirty = self._dirty, []
        for link in dirty:
            if not link.closed:
                self._send(link)
        again = False
        for batch in self._batches:  # what ended after they were fed, in this turn
            again = batch.store_ended() or again
        if expired:
            self._due = self._earliest_deadline()
        return 0.0 if again else self._timeout(now)

    def _has_work(self) -> bool:
        """Whether anything but idle connections is left: requests, batches, timers."""
        if self._timers or self._batches or self._needs_token or self._dirty or self._arrived:
            return True
        for route in self._routes:
            if route.waiting or route.connecting or route.busy:
                return True
            for h2 in route.h2:
                if h2.conn.streams:
                    return True
        return False

    def _connected(self, route: _Route, carrier: Any, h2: bool, generation: int) -> bool:
        """Take a connection ``_open`` asked for (``carrier``: the driver's own); False if
        it was asked for before a reset (a crash), and the driver is to close it."""
        if generation != route.generation:
            return False
        route.connecting -= 1
        now = self.clock.now()
        link: _Link
        if h2:
            log.debug("connected to %r with HTTP/2", route)
            route.speaks_h2 = True
            link = _H2Link(carrier, route, now)
            route.h2.append(link)
            self._soon(now + self._connect_timeout)  # for its SETTINGS
            self._wants_write(link)  # the preface and our SETTINGS
        else:
            log.debug("connected to %r", route)
            route.speaks_h2 = False
            link = _H1Link(carrier, route, now)
            route.idle.append(link)
            self._soon(now + self._keep_alive_timeout)
        self._watch(link)
        self._place(route)
        return True

    def _connect_failed(self, route: _Route, error: NetworkError, generation: int) -> None:
        """A connection did not come up: the route holds off (see _hold_off), and if no
        other connection can carry them, the waiting fail."""
        if generation != route.generation:
            return
        route.connecting -= 1
        self._hold_off(route, error)
        self._fail_unless_connected(route)

    def _received(self, link: _Link, data: bytes) -> bool:
        """Handle bytes from the server; False once the link wants no more for now
        (closed, or an HTTP/1.1 answer complete)."""
        link.last_read = self.clock.now()
        if isinstance(link, _H1Link):
            return self._h1_received(link, data)
        assert isinstance(link, _H2Link)
        link.pinged = False
        self._soon(link.last_read + _H2_PING_QUIET)
        try:
            link.conn.receive(data)
        except _H2Error as exc:
            failed = self._ended_by_server(link, "the server broke HTTP/2: %s" % exc)
            link.conn.abort(exc)
            self._send(link)
            self._collect(link)
            if failed:
                self._fail_unless_connected(link.route)
            return False
        if not link.usable and link.conn.state != "WAITING_FOR_SETTINGS":
            link.usable = True
        self._collect(link)
        if link.conn.outgoing and not link.closed:
            self._wants_write(link)  # ACKs and WINDOW_UPDATEs go out this turn
        return not link.closed

    def _lost(self, link: _Link, reason: str) -> None:
        """The connection ended under us: every exchange on it gets its result."""
        if link.closed:
            return
        if isinstance(link, _H2Link):
            failed = self._ended_by_server(link, reason)
            link.conn.lost(reason)
            self._collect(link)
            if failed:
                self._fail_unless_connected(link.route)
            return
        assert isinstance(link, _H1Link)
        exchange = link.exchange
        if exchange is None:
            self._drop(link)
            return
        try:
            response, _ = link.reader.eof()
        except _ProtocolError as exc:
            self._drop(link)
            self._settle(exchange, self._h1_failure(link, reason, exc))
        else:
            self._h1_finished(link, response, False)
        self._place(link.route)

    def _cancel(self, exchange: _Exchange) -> None:
        """Give up on an exchange whose caller no longer waits: unsent, it is dropped;
        on a connection, its HTTP/2 stream is reset or its HTTP/1.1 connection closed."""
        route = exchange.route
        if exchange in self._arrived:
            self._arrived.remove(exchange)
        elif exchange in route.waiting:
            route.waiting.remove(exchange)
        elif exchange in self._needs_token:
            self._needs_token.remove(exchange)
        elif any(entry[3] is exchange for entry in self._timers):
            self._timers = [entry for entry in self._timers if entry[3] is not exchange]
            heapq.heapify(self._timers)
        for h2 in route.h2:
            stream = next((s for s in h2.conn.streams.values() if s.key is exchange), None)
            if stream is not None:
                h2.conn.cancel(stream.id)
                self._wants_write(h2)
                return
        for h1 in route.busy:
            if h1.exchange is exchange:
                h1.exchange = None
                self._drop(h1)
                self._place(route)
                return

    # Starting requests ------------------------------------------------------------

    def _add_batch(self, batch: "_Batch") -> None:
        self._batches.append(batch)
        batch.route.limit += batch.concurrency

    def _feed_batches(self) -> None:
        """Start what the push_many batches have prepared, each within its concurrency;
        end what a stopped batch still holds unsent (see _halt)."""
        for batch in list(self._batches):
            halted = batch.halted()
            if halted:
                self._halt(halted)
            ready = batch.ready()
            while ready:  # a run at a time, until none is left or there is no more room
                self._begin_all(ready)
                ready = batch.ready()
            if batch.ended():
                self._batches.remove(batch)
                batch.route.limit -= batch.concurrency

    def _arrive(self, exchange: _Exchange) -> None:
        """A caller's exchange: it begins at the next turn, with all that came meanwhile
        (placed together, as a burst)."""
        self._arrived.append(exchange)

    def _begin_arrived(self) -> None:
        """Begin the callers' exchanges that arrived since the last turn."""
        arrived, self._arrived = self._arrived, []
        self._begin_all(arrived)

    def _begin(self, exchange: _Exchange) -> None:
        """Start ``exchange`` at the moment the policy gives it (now, or a timer)."""
        self._begin_all([exchange])

    def _begin_all(self, exchanges: List[_Exchange]) -> None:
        """Start each exchange at the moment the policy gives it (now, or a timer). Those
        that may start now are placed together: one clock reading, one placing per route."""
        clock = self.clock
        now = clock.now()
        start_at = self.policy.start_at
        routes: List[_Route] = []
        for exchange in exchanges:
            start = start_at(exchange, now)
            if start is None:
                exchange.on_done(exchange)
            elif start > now:
                self._after(clock.delay(start - now), self._enqueue, exchange)
            else:
                self._try(exchange, now)
                route = exchange.route
                if route not in routes:
                    routes.append(route)
        for route in routes:
            self._place(route)

    def _try(self, exchange: _Exchange, now: float) -> None:
        """Begin a try of ``exchange``: it waits for a connection or a free stream until
        ``send_by``, the connect timeout (or the call's own) from now; the try ends, its
        answer included, by ``ends_by``, the read timeout (or the call's own) after that.
        One that must wait for an access token, or go out again, may wait until then."""
        exchange.send_by = now + (exchange.timeout or self._connect_timeout)
        exchange.ends_by = exchange.send_by + (exchange.timeout or self._read_timeout)
        self._soon(exchange.send_by)
        exchange.route.waiting.append(exchange)

    def _after(self, seconds: float, then: Callable[[_Exchange], None],
               exchange: _Exchange) -> None:
        self._timer_seq += 1
        due = self.clock.now() + seconds
        heapq.heappush(self._timers, (due, self._timer_seq, then, exchange))

    def _fire_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, then, exchange = heapq.heappop(self._timers)
            then(exchange)

    def _enqueue(self, exchange: _Exchange) -> None:
        """Begin a try of an exchange whose start the policy put off (pause, rate_limit)."""
        self._try(exchange, self.clock.now())
        self._place(exchange.route)

    def _halt(self, exchanges: List[_Exchange]) -> None:
        """A push_many stopped: of its exchanges, those not on a connection end now (with
        their last try's error, else "not sent"), and those on one are tried no more."""
        stopped = set(exchanges)
        on_wire: Set[object] = set()
        for exchange in exchanges:
            exchange.halted = True
        for route in self._routes:
            on_wire.update(link.exchange for link in route.busy)
            for h2 in route.h2:
                on_wire.update(stream.key for stream in h2.conn.streams.values())
            if not stopped.isdisjoint(route.waiting):
                route.waiting = collections.deque(e for e in route.waiting if e not in stopped)
        self._needs_token = [e for e in self._needs_token if e not in stopped]
        if any(entry[3] in stopped for entry in self._timers):
            self._timers = [entry for entry in self._timers if entry[3] not in stopped]
            heapq.heapify(self._timers)
        for exchange in exchanges:
            if exchange.outcome is None and exchange not in on_wire:
                exchange.outcome = exchange.last_error or _Stopped()
                exchange.on_done(exchange)

    def _place(self, route: _Route) -> None:
        """Start waiting exchanges on connections with room, as many on each as it takes
        at once; open more when needed."""
        waiting = route.waiting
        if not waiting:
            return
        now = self.clock.now()
        # What the signer of the exchange before gave: at one instant, it gives the same.
        signer: Optional[_Signer] = None
        signed: Tuple[Dict[str, str], str] = ({}, "")
        while waiting:
            link, room = self._link_for(route, now, waiting[0].fresh)
            if link is None:
                self._open_more(route)
                return
            started = False
            while room and waiting:
                exchange = waiting.popleft()
                if exchange.signer is None:
                    headers = exchange.headers
                else:
                    if exchange.signer is not signer or exchange.signed is not None:
                        got = self._sign(exchange)
                        if got is None:
                            break  # it waits for a token, or ended: the link may have changed
                        signer, signed = exchange.signer, got
                    headers, exchange.access_token = signed
                self._start(link, exchange, headers, now)
                room -= 1
                started = True
            if started:
                if isinstance(link, _H2Link) and not link.pinged:
                    self._soon(link.last_read + _H2_PING_QUIET)  # a PING if it goes quiet
                if len(link.pending()) >= _EARLY_WRITE:
                    self._send(link)  # (if the connection breaks, _link_for skips it)
                else:
                    self._wants_write(link)

    def _link_for(self, route: _Route, now: float,
                  fresh: bool) -> Tuple[Optional[_Link], int]:
        """A connection with room for more requests, and how many it takes now (None and
        0 if there is none); those idle too long are replaced rather than reused. A
        ``fresh`` request (one a reused HTTP/1.1 connection failed) takes a new one."""
        for h2 in list(route.h2):
            conn = h2.conn
            if conn.streams:
                if len(conn.streams) < conn.max_streams:  # a full one costs just this compare
                    room = conn.free_streams()
                    if room:
                        return h2, room
            elif now - h2.idle_since > self._keep_alive_timeout:
                self._drop(h2)
            else:
                room = conn.free_streams()
                if room:
                    return h2, room
        idle = route.idle
        while idle:
            link = idle[-1]
            if link.reused and now - link.idle_since >= self._keep_alive_timeout:
                self._drop(link)
            elif not fresh or not link.reused:
                return link, 1
            else:
                new = next((link for link in idle if not link.reused), None)
                if new is not None:
                    return new, 1
                if route.connections() >= route.limit:
                    self._drop(idle[0])  # the least recently used makes room for a new one
                break
        return None, 0

    def _open_more(self, route: _Route) -> None:
        """Open as many connections as the waiting exchanges need, within the limit; none
        while the route holds off after a failed connect (see _hold_off)."""
        if route.hold_until:
            return
        if route.speaks_h2:
            known = max([link.conn.max_streams for link in route.h2
                         if link.conn.state == "OPEN"], default=0)
            per = min(known, _H2_STREAMS_EXPECTED) if known > 0 else _H2_STREAMS_EXPECTED
            coming = route.connecting + sum(  # those a server allows no stream yet too
                link.conn.state == "WAITING_FOR_SETTINGS" or not link.conn.max_streams
                for link in route.h2)
            wanted = -(-len(route.waiting) // per) - coming
        elif route.speaks_h2 is False:
            wanted = len(route.waiting) - route.connecting
        else:  # the first connections: as many as HTTP/2 would need, all at once
            wanted = -(-len(route.waiting) // _H2_STREAMS_EXPECTED) - route.connecting
        count = min(wanted, route.limit - route.connections())
        if count > 0:
            route.connecting += count
            self._open(route, count)

    def _hold_off(self, route: _Route, error: NetworkError) -> None:
        """A connection failed (did not come up, or ended before it ever answered): the
        route adds none for a while, whether or not others carry its requests."""
        route.connect_error = error
        if not route.hold_until:  # one round of failures, however many connects
            route.failed_connects += 1
            clock = self.clock
            seconds = clock.delay(min(_CONNECT_BACKOFF * 2 ** (route.failed_connects - 1),
                                      _MAX_CONNECT_BACKOFF))
            route.hold_until = clock.now() + seconds
            self._soon(route.hold_until)

    def _ended_by_server(self, link: _Link, reason: str) -> bool:
        """The server ended (or broke) ``link``: an HTTP/2 connection that never answered,
        though it carried requests, was still coming up or had just come up, counts as a
        failed connect. (Its requests were not processed, and go out again without a try
        counted; an HTTP/1.1 connection that breaks ends its request's try, and needs no
        more.)"""
        if isinstance(link, _H2Link) and not link.answered and (
                link.carried or not link.usable
                or self.clock.now() - link.opened < self._connect_timeout):
            self._hold_off(link.route, NetworkError(
                "could not use the connection to %r: %s" % (link.route, reason),
                may_have_been_delivered=False))
            return True
        return False

    def _fail_unless_connected(self, route: _Route) -> None:
        """After a failed connection: with no other up or coming, this try of each waiting
        exchange ends unsent, saying why (their retries decide what next); else the others
        carry them."""
        if route.connections():
            self._place(route)
            return
        error = route.connect_error or NetworkError("no connection to %r" % (route,), False)
        waiting, route.waiting = route.waiting, collections.deque()
        for exchange in waiting:  # each its own copy, of the same class
            self._settle(exchange, type(error)(*error.args))

    def _answered(self, link: _Link) -> None:
        """An answer came on ``link``: the server works, and a later failed connect starts
        the hold-off afresh."""
        link.answered = True
        link.route.failed_connects = 0

    def _sign(self, exchange: _Exchange) -> Optional[Tuple[Dict[str, str], str]]:
        """The headers and access token of this attempt of an exchange with a signer; None
        if it waits for a token or ended."""
        signer = exchange.signer
        assert signer is not None
        try:
            signed = exchange.signed or signer.headers_now()
        except Error as exc:
            self._settle(exchange, exc)
            return None
        exchange.signed = None
        if signed is None:
            exchange.send_by = exchange.ends_by  # the token's own request may take a try
            self._soon(exchange.send_by)
            self._needs_token.append(exchange)
            if signer not in self._refreshing:
                self._refreshing.append(signer)
                self._fetch_token(signer)
            return None
        return signed

    def _fetch_token(self, signer: _Signer) -> None:
        """Ask for a new access token, as one more exchange through this engine."""
        request = signer.token_request()
        request.on_done = lambda done: self._refreshed(signer, signer.token_answered(done.outcome))
        self._begin(request)

    def _refreshed(self, signer: _Signer,
                   result: Union[Tuple[Dict[str, str], str], Error]) -> None:
        """Start, with the token just fetched, every exchange that waited for it."""
        self._refreshing = [s for s in self._refreshing if s is not signer]
        ready = [e for e in self._needs_token if e.signer is signer]
        self._needs_token = [e for e in self._needs_token if e.signer is not signer]
        for exchange in ready:
            if isinstance(result, Error):
                self._settle(exchange, result)
            else:
                exchange.signed = result  # its try goes on, with the deadlines it had
                exchange.route.waiting.append(exchange)
                self._place(exchange.route)

    def _start(self, link: _Link, exchange: _Exchange, headers: Dict[str, str],
               now: float) -> None:
        """Queue the request on ``link`` (the caller has it written). Its answer is due
        within the read timeout (or the call's own), and before its try ends."""
        deadline = now + (exchange.timeout or self._read_timeout)
        if deadline > exchange.ends_by:
            deadline = exchange.ends_by
        exchange.deadline = deadline
        exchange.fresh = False
        link.carried = True
        self._soon(deadline)
        if isinstance(link, _H2Link):
            link.conn.start(exchange.method, exchange.path, headers, exchange.body, exchange,
                            deadline)
        else:
            assert isinstance(link, _H1Link)
            idle = link.route.idle
            if idle[-1] is link:  # as _link_for takes them: the most recently used
                idle.pop()
            else:
                idle.remove(link)
            link.route.busy[link] = None
            link.exchange = exchange
            link.reader = _H1Reader(link.route.heads)
            link.out += _encode_request(link.route.host, exchange.method, exchange.path,
                                        headers, exchange.body)

    def _wants_write(self, link: _Link) -> None:
        if link not in self._dirty:
            self._dirty.append(link)

    # Answers ----------------------------------------------------------------------

    def _h1_received(self, link: _H1Link, data: bytes) -> bool:
        """Feed an HTTP/1.1 answer; False once the link is closed or back in the pool."""
        exchange = link.exchange
        if exchange is None:
            self._drop(link)  # bytes on an idle connection: nothing can follow them
            return False
        try:
            done = link.reader.feed(data)
        except _ProtocolError as exc:
            self._ended_by_server(link, str(exc))
            self._drop(link)
            self._settle(exchange, NetworkError(
                "the exchange with %r failed: %s" % (link.route, exc),
                may_have_been_delivered=True))
            return False
        if done is None:
            return True
        response, keep = done
        self._h1_finished(link, response, keep)
        return False

    def _h1_finished(self, link: _H1Link, result: Union[Response, Exception], keep: bool) -> None:
        exchange = link.exchange
        assert exchange is not None
        link.exchange = None
        if isinstance(result, Response) and not link.answered:
            self._answered(link)
        if keep:
            del link.route.busy[link]
            link.route.idle.append(link)
            link.reused = True
            link.idle_since = link.last_read  # (its answer's end was just read)
            self._soon(link.idle_since + self._keep_alive_timeout)
        else:
            self._drop(link)
        self._settle(exchange, result)
        self._place(link.route)

    def _h1_failure(self, link: _H1Link, reason: str, exc: _ProtocolError) -> Exception:
        """What an HTTP/1.1 connection that ended mid-exchange means for its request."""
        if link.out:
            return _NotProcessed("could not send the request to %r: %s" % (link.route, reason))
        if link.reader.started:
            return NetworkError("the exchange with %r failed: %s" % (link.route, exc),
                                may_have_been_delivered=True)
        if link.reused:  # a kept-alive connection the server had closed: not processed
            return _NotProcessed("the reused connection to %r was closed" % (link.route,),
                                 fresh=True)
        return NetworkError("the connection to %r closed before an answer (%s)"
                            % (link.route, reason), may_have_been_delivered=True)

    def _collect(self, link: _H2Link) -> None:
        """Settle the streams that ended; close the connection once it is done."""
        conn = link.conn
        finished, conn.finished = conn.finished, []
        if not link.answered and any(isinstance(result, Response) for _, result in finished):
            self._answered(link)
        for key, result in reversed(finished):  # resends go to the front in their order
            assert isinstance(key, _Exchange)
            self._settle(key, result)
        if conn.state == "GOING_AWAY" and not conn.streams:
            failed = self._ended_by_server(link, "the server went away (GOAWAY)")
            self._drop(link)
            if failed:
                self._fail_unless_connected(link.route)
        elif conn.state == "CLOSED":
            self._drop(link)
        elif not conn.streams:
            link.idle_since = self.clock.now()
            self._soon(link.idle_since + self._keep_alive_timeout)
        self._place(link.route)

    def _drop(self, link: _Link) -> None:
        """Close a connection and forget it; streams it still held get their results."""
        if link.closed:
            return
        if isinstance(link, _H2Link) and link.conn.state != "CLOSED":
            link.conn.close()  # our GOAWAY goes out if it fits
        link.closed = True
        self._shut(link)
        route = link.route
        if isinstance(link, _H1Link):
            if link in route.busy:
                del route.busy[link]
            else:
                route.idle.remove(link)
        else:
            assert isinstance(link, _H2Link)
            route.h2.remove(link)
            finished, link.conn.finished = link.conn.finished, []
            for key, result in reversed(finished):
                assert isinstance(key, _Exchange)
                self._settle(key, result)

    # Outcomes ---------------------------------------------------------------------

    def _settle(self, exchange: _Exchange, result: Union[Response, Exception]) -> None:
        """Hand an attempt's result to the policy, and do what it says."""
        wait = self.policy.decide(exchange, result, self.clock.now())
        if wait is None:
            exchange.on_done(exchange)
        elif isinstance(result, _NotProcessed):
            exchange.fresh = result.fresh
            exchange.send_by = exchange.ends_by  # it goes out again within the same try
            self._soon(exchange.send_by)
            exchange.route.waiting.appendleft(exchange)  # its turn again, before the rest
        else:
            self._after(self.clock.delay(wait), self._begin, exchange)

    # Deadlines ----------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """End what waited too long: answers, SETTINGS, idle connections, requests not sent
        in time; PING the quiet; let routes that held off after a failed connect add
        connections again."""
        for route in self._routes:
            if route.hold_until and route.hold_until <= now:
                route.hold_until = 0.0
                self._place(route)
            for h2 in list(route.h2):
                conn = h2.conn
                if conn.state == "WAITING_FOR_SETTINGS":
                    if now - h2.opened > self._connect_timeout:
                        self._hold_off(route, NetworkError(
                            "%r sent no HTTP/2 SETTINGS within the connect timeout of %.3g s;"
                            " if the server is slow, %s"
                            % (route, self._connect_timeout, _TIMEOUT_HINT),
                            may_have_been_delivered=False))
                        self._drop(h2)
                        self._fail_unless_connected(route)
                    continue
                conn.expire(now, lambda key, sent: _no_answer(key, self._read_timeout, sent))
                if conn.finished:
                    self._collect(h2)
                if not conn.streams and now - h2.idle_since > self._keep_alive_timeout:
                    self._drop(h2)
                elif conn.streams and not h2.pinged and now - h2.last_read > _H2_PING_QUIET:
                    conn.ping()
                    h2.pinged = True
                    self._wants_write(h2)
            for h1 in list(route.busy):
                exchange = h1.exchange
                if exchange is not None and exchange.deadline <= now:
                    self._drop(h1)
                    h1.exchange = None
                    self._settle(exchange, _no_answer(exchange, self._read_timeout))
            for h1 in list(route.idle):
                if now - h1.idle_since > self._keep_alive_timeout:
                    self._drop(h1)
            if route.waiting:
                self._place(route)
                self._expire_waiting(route, now)
        if self._needs_token and any(e.send_by <= now for e in self._needs_token):
            late = [e for e in self._needs_token if e.send_by <= now]
            self._needs_token = [e for e in self._needs_token if e.send_by > now]
            for exchange in late:
                self._settle(exchange, NetworkError(
                    "not sent: no access token came within %.3g s (the token request is "
                    "still under way)" % ((exchange.timeout or self._connect_timeout)
                                          + (exchange.timeout or self._read_timeout)),
                    may_have_been_delivered=False))

    def _expire_waiting(self, route: _Route, now: float) -> None:
        """End, unsent, the tries whose request could not go out in time."""
        if all(e.send_by > now for e in route.waiting):
            return
        late = [e for e in route.waiting if e.send_by <= now]
        route.waiting = collections.deque(e for e in route.waiting if e.send_by > now)
        for exchange in late:
            self._settle(exchange, NetworkError(
                "not sent: %s" % self._why_not_sent(route, exchange.timeout),
                may_have_been_delivered=False))

    def _why_not_sent(self, route: _Route, timeout: float) -> str:
        """Why a try on ``route`` with the call's ``timeout`` (0: none) did not go out."""
        wait = ("the call's timeout of %.3g s" % timeout if timeout
                else "the connect timeout of %.3g s" % self._connect_timeout)
        if any(link.conn.state == "WAITING_FOR_SETTINGS" for link in route.h2):
            return "%r sent no HTTP/2 SETTINGS within %s; if the server is slow, %s" % (
                route, wait, _TIMEOUT_HINT)
        if any(link.usable for link in route.links()):
            return "no connection to %r had room for it within %s" % (route, wait)
        if route.connecting:
            return "could not connect to %r within %s; if the network is slow, %s" % (
                route, wait, _TIMEOUT_HINT)
        reason = "no connection to %r came up within %s" % (route, wait)
        if route.connect_error is not None:
            reason += " (the last failed: %s)" % route.connect_error
        return reason

    def _soon(self, deadline: float) -> None:
        """Something new is due at ``deadline``: a request's answer, a connection's
        SETTINGS, PING or keep-alive, a route's hold-off (the next ``_turn`` after it
        calls ``_expire``)."""
        if deadline < self._due:
            self._due = deadline

    def _timeout(self, now: float) -> Optional[float]:
        """How long the driver may wait: until the next timer or deadline (see _turn)."""
        due = min(self._timers[0][0], self._due) if self._timers else self._due
        return None if due == math.inf else max(0.0, due - now + 0.001)

    def _earliest_deadline(self) -> float:
        """The first deadline of any connection or exchange (the timers aside), found
        after ``_expire``; ``_soon`` lowers it as new ones come."""
        due = []
        for route in self._routes:
            if route.hold_until:
                due.append(route.hold_until)
            for h2 in route.h2:
                if h2.conn.state == "WAITING_FOR_SETTINGS":
                    due.append(h2.opened + self._connect_timeout)
                elif h2.conn.streams:
                    due.append(h2.conn.next_deadline())
                    if not h2.pinged:
                        due.append(h2.last_read + _H2_PING_QUIET)
                else:
                    due.append(h2.idle_since + self._keep_alive_timeout)
            due.extend(h1.exchange.deadline for h1 in route.busy if h1.exchange)
            due.extend(h1.idle_since + self._keep_alive_timeout for h1 in route.idle)
            due.extend(exchange.send_by for exchange in route.waiting)
        due.extend(exchange.send_by for exchange in self._needs_token)
        return min(due) if due else math.inf

    # Ending -------------------------------------------------------------------------

    def _abandon(self, reason: str) -> None:
        """End everything: each exchange still held gets a NetworkError saying whether it
        may have been delivered; every connection is closed."""
        held: List[Tuple[_Exchange, bool]] = []
        for route in self._routes:
            held.extend((e, False) for e in route.waiting)
            for h2 in route.h2:
                held.extend((s.key, h2.conn.may_have_arrived(s))
                            for s in h2.conn.streams.values() if isinstance(s.key, _Exchange))
            held.extend((h1.exchange, not h1.out) for h1 in route.busy if h1.exchange)
        held.extend((entry[3], False) for entry in self._timers)
        held.extend((e, False) for e in self._needs_token)
        held.extend((e, False) for e in self._arrived)
        self._arrived = []
        for batch in self._batches:
            batch.abandon(reason)
        self._close_all()
        for exchange, sent in held:
            exchange.outcome = NetworkError(reason, may_have_been_delivered=sent)
            with contextlib.suppress(Exception):
                exchange.on_done(exchange)

    def _close_all(self) -> None:
        """Close every connection at once, and forget every request (their outcomes are
        the caller's to give)."""
        for route in self._routes:
            for link in route.links():
                if isinstance(link, _H2Link) and link.conn.state != "CLOSED":
                    link.conn.close()
                link.closed = True
                with contextlib.suppress(OSError):
                    self._shut(link)
            route.reset()
        self._timers, self._needs_token, self._refreshing = [], [], []
        self._batches, self._dirty = [], []


# Every thread driver of this process: a fork marks each one's copy in the child, which
# starts afresh when next used (a mark, not a check of the process id at each push).
_THREAD_DRIVERS = weakref.WeakSet()  # type: weakref.WeakSet[_ThreadDriver]


def _mark_forked_drivers() -> None:
    for driver in _THREAD_DRIVERS:
        driver.forked = True


if hasattr(os, "register_at_fork"):  # (no fork where it is not)
    os.register_at_fork(after_in_child=_mark_forked_drivers)


class _ThreadDriver(_Engine):
    """The engine's thread driver: a selector over non-blocking sockets, run by one
    thread at a time, and only while there is work.

    A thread waiting in ``run`` runs the driver itself when no other thread does (so a push
    made alone crosses no thread), until its own exchange ends; other threads hand their
    exchanges to whoever runs it. If work is left when that caller's exchange ends (others'
    requests, a push_many), a background I/O thread takes over until none is left. Idle
    connections wait for the next request, which first reads what they received (a GOAWAY,
    a close) and replaces those idle too long. Each new connection is set up on a
    short-lived thread of its own, several at once, so no handshake stalls the others. A
    forked child starts afresh.
    """

    def __init__(self, ssl_context: ssl.SSLContext, connect_timeout: float,
                 read_timeout: float, keep_alive_timeout: float, proxy: Optional[str],
                 policy: _Policy) -> None:
        super().__init__(connect_timeout, read_timeout, keep_alive_timeout, proxy, policy)
        self._ssl_context = ssl_context
        self._lock = threading.Lock()
        self._runner_left = threading.Condition(self._lock)
        self._inbox: List[Callable[[], None]] = []
        self._thread: Optional[threading.Thread] = None  # the thread running the driver now
        self.forked = False  # this is a forked child's copy, not yet started afresh
        self._closed = False
        self._selector: Optional[selectors.BaseSelector] = None  # while connections are open
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        # The running thread waits in select (or will, having found no work handed over:
        # set under the lock): the state is whole, and work handed over must wake it.
        self._selecting = False
        _THREAD_DRIVERS.add(self)

    # Any thread -------------------------------------------------------------------

    def run(self, exchange: _Exchange) -> Outcome:
        """Start ``exchange`` and wait for its outcome, running the driver meanwhile if no
        other thread does (every wait in the driver has a deadline)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("andpush's I/O thread cannot wait for itself")
        done = threading.Lock()
        done.acquire()
        exchange.on_done = lambda _: done.release()  # once, with the outcome
        if self._post(lambda: self._arrive(exchange), lead=True):
            self._lead(exchange)
        done.acquire()
        assert exchange.outcome is not None
        return exchange.outcome

    def add_batch(self, batch: "_Batch") -> None:
        """Feed a push_many's exchanges in as it prepares them."""
        self._post(lambda: self._add_batch(batch))

    def wake(self) -> None:
        """Wake the selector, from any thread (a no-op once it is closed)."""
        wake_w = self._wake_w
        if wake_w is not None:
            with contextlib.suppress(OSError):
                wake_w.send(b"\0")

    def close(self) -> None:
        """End every connection; requests still under way end with a NetworkError."""
        if self.forked:
            self._new_lock()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.forked:
                self._forked()
            runner = self._thread
            if runner is None:
                self._thread = threading.current_thread()  # ends it all itself, at once
            else:
                self.wake()  # the runner ends it all at its next step (this thread's too)
            if runner is not None and runner is not threading.current_thread():
                deadline = time.monotonic() + self._connect_timeout
                while self._thread is not None and time.monotonic() < deadline:
                    self._runner_left.wait(deadline - time.monotonic())
        if runner is None:
            self._abandon("the client was closed")
            with self._lock:
                self._park()

    def _post(self, work: Callable[[], None], lead: bool = False) -> bool:
        """Hand ``work`` to the thread running the driver; with none running, the caller
        becomes it if it may ``lead`` (and True is returned), else a new thread does."""
        if self.forked:
            self._new_lock()
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed; create a new one")
            if self.forked:
                self._forked()
            # The driver sees it unwoken when it is not waiting in select (it looks before it
            # waits), or was woken already for what waits there.
            woken = not self._selecting or bool(self._inbox)
            self._inbox.append(work)
            if self._thread is None:
                self._take_over(lead)
                return lead
        if not woken:
            self.wake()  # outside the lock, which a thread waiting in send would hold
        return False

    def _new_lock(self) -> None:
        """In a forked child: a lock of its own (the parent's thread may have held the lock
        at the fork); _forked is due."""
        self._lock = threading.Lock()
        self._runner_left = threading.Condition(self._lock)

    def _take_over(self, lead: bool) -> None:
        """Make the caller (``lead``) or a new thread the one running the driver (the lock
        is held); the selector and its wake pair are made if they are not there."""
        if self._selector is None:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._wake_r, selectors.EVENT_READ)
        if lead:
            self._thread = threading.current_thread()
        else:
            self._thread = threading.Thread(target=self._run, name="andpush-io", daemon=True)
            self._thread.start()

    def _park(self) -> None:
        """The running thread leaves the driver (the lock is held): idle connections stay
        open for the next request; with none open, the selector goes too."""
        self._thread = None
        if self._closed:  # close() may be waiting for this (no other call waits)
            self._runner_left.notify_all()
        if self._selector is not None and (
                self._closed or not any(map(_Route.connections, self._routes))):
            assert self._wake_r is not None and self._wake_w is not None
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
            self._selector = self._wake_r = self._wake_w = None

    def _forked(self) -> None:
        """In a child process: drop the parent's connections (the fds only: nothing is
        sent, the parent's stay open) and its thread, which did not survive the fork."""
        log.debug("process forked: closing this process's copies of the parent's sockets")
        if self._selector is not None:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            assert self._wake_w is not None  # (not registered: it only writes)
            self._wake_w.close()
            self._selector = self._wake_r = self._wake_w = None
        for route in self._routes:
            route.reset()
        self._batches, self._timers, self._needs_token, self._refreshing = [], [], [], []
        self._dirty, self._inbox, self._arrived = [], [], []
        self._thread = None
        self.forked = False

    # The thread running the driver ----------------------------------------------------

    def _lead(self, exchange: _Exchange) -> None:
        """Run the driver on the caller's thread until its exchange ends; then hand what
        is left to a background thread, or leave the driver parked."""
        try:
            self._poll()
            while exchange.outcome is None and self._step(exchange):
                pass
        except BaseException as exc:
            if self._selecting and not isinstance(exc, Exception):
                self._selecting = False  # Ctrl-C while waiting: all is in order, go on
                self._leave()
            else:  # a bug, or Ctrl-C mid-turn: no exchange held may lose its outcome
                self._crashed(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._leave()

    def _leave(self) -> None:
        """The caller stops running the driver: a background thread takes over what is left
        (the push that stopped waiting included), or the driver parks."""
        with self._lock:
            if self._thread is not threading.current_thread():
                return  # the driver parked in its last step (closed)
            if self._inbox or self._has_work():
                self._thread = threading.Thread(target=self._run, name="andpush-io",
                                                daemon=True)
                self._thread.start()
            else:
                self._park()

    def _run(self) -> None:
        try:
            self._poll()
            while self._step():
                pass
        except BaseException as exc:  # a bug: no exchange it held may go without an outcome
            self._crashed(exc)

    def _crashed(self, exc: BaseException) -> None:
        log.exception("andpush's engine failed; its requests end with NetworkError")
        self._abandon("andpush's engine failed: %s" % _reason(exc))
        with self._lock:
            self._park()
            if self._inbox and not self._closed:
                self._take_over(lead=False)  # what came meanwhile goes to a new thread

    def _poll(self) -> None:
        """Handle what the connections received while no thread ran the driver."""
        assert self._selector is not None
        self._dispatch(self._selector.select(0))

    def _step(self, mine: Optional[_Exchange] = None) -> bool:
        """One turn: take new work, do what is due, wait for the sockets, read and write.
        False when the driver parks (closed, or nothing left but idle connections). A
        caller running the driver for ``mine`` does not wait once it has ended (until then,
        there is work: ``mine``)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            closed = self._closed
            if not closed and not inbox and not self._has_work():
                self._park()
                return False
        for work in inbox:  # on close too: a socket just connected is in there
            work()
        if closed:
            self._abandon("the client was closed")
            with self._lock:
                self._park()
            return False
        timeout = self._turn()
        if mine is not None:
            if mine.outcome is not None:
                return True
        elif not self._has_work():
            timeout = 0.0  # the next step parks, unless work came meanwhile
        with self._lock:
            if self._inbox:
                timeout = 0.0  # handed over during the turn, unwoken (see _post)
            self._selecting = True
        ready = self._sel().select(timeout)
        self._selecting = False
        self._dispatch(ready)
        return True

    def _dispatch(self, ready: List[Tuple[selectors.SelectorKey, int]]) -> None:
        for key, events in ready:
            if key.data is None:
                with contextlib.suppress(OSError):
                    key.fileobj.recv(4096)  # type: ignore[union-attr]
                continue
            link = key.data
            if events & selectors.EVENT_WRITE:
                self._write(link)
            if events & selectors.EVENT_READ:
                self._read(link)

    def _open(self, route: _Route, count: int) -> None:
        self._start_connecting(route, count, route.generation)

    def _start_connecting(self, route: _Route, count: int, generation: int) -> None:
        threading.Thread(target=self._connect, args=(route, count, generation),
                         name="andpush-connect", daemon=True).start()

    def _connects_failed(self, route: _Route, error: NetworkError, generation: int,
                         count: int) -> None:
        """Tell the driver, from a connect thread, that ``count`` connections failed."""
        def failed() -> None:
            for _ in range(count):
                self._connect_failed(route, error, generation)
        with contextlib.suppress(ValueError):  # the client was closed meanwhile
            self._post(failed)

    def _connect(self, route: _Route, count: int, generation: int) -> None:
        """On a thread of its own: connect, then hand the socket (or the error) to the driver.

        Of the ``count`` connections asked for, the others go to at most two threads this
        one starts first, each with half of them: starting a thread takes its starter a
        millisecond or more while others hold the GIL, so the driver starts one, and the
        last of 200 connections begins after eight starts, not 200."""
        rest = count - 1
        for share in (rest - rest // 2, rest // 2):
            if not share:
                continue
            try:
                self._start_connecting(route, share, generation)
            except RuntimeError as exc:  # the process has no thread to spare
                self._connects_failed(route, NetworkError(
                    "could not connect to %r: %s" % (route, exc),
                    may_have_been_delivered=False), generation, share)
        try:
            sock = _connect(route.origin, self._ssl_context, self._connect_timeout)
        except NetworkError as exc:
            self._connects_failed(route, exc, generation, 1)
            return
        h2 = isinstance(sock, _TLSSocket) and sock.alpn == "h2"

        def take() -> None:
            if not self._connected(route, sock, h2, generation):
                sock.close()
        try:
            self._post(take)
        except ValueError:  # the client was closed meanwhile
            sock.close()

    def _sel(self) -> selectors.BaseSelector:
        """The selector, which is there while a thread runs the driver."""
        assert self._selector is not None
        return self._selector

    def _watch(self, link: _Link) -> None:
        carrier = link.carrier
        carrier.setblocking(False)
        self._sel().register(carrier, selectors.EVENT_READ, link)
        if isinstance(carrier, _TLSSocket) and carrier.early:
            self._read(link)  # the kernel has none of it: the selector would not say so

    def _send(self, link: _Link) -> None:
        self._write(link)

    def _shut(self, link: _Link) -> None:
        sock = link.carrier
        with contextlib.suppress(OSError, *_WOULD_BLOCK):
            out = link.pending()
            if out:
                sock.send(out[:_WRITE_SIZE])
            if isinstance(sock, _TLSSocket):
                sock.flush()
        with contextlib.suppress(KeyError, ValueError):
            self._sel().unregister(sock)
        sock.close()

    def _write(self, link: _Link) -> None:
        """Write what the socket takes now; watch for writability while bytes remain.

        Over TLS, bytes count as written once encrypted, before the socket took them all:
        at most one chunk ahead, since none is encrypted before those ahead of it are
        sent. That errs on the safe side: a request counted as written that the server
        never saw ends as may_have_been_delivered=True, and none is resent silently."""
        if link.closed:
            return
        out = link.pending()
        sock = link.carrier
        tls = isinstance(sock, _TLSSocket)
        try:
            while out:
                link.wrote(sock.send(out[:_WRITE_SIZE]))
            if tls:
                sock.flush()
        except _WOULD_BLOCK:
            pass
        except OSError as exc:
            self._lost(link, "the connection broke: %s" % _reason(exc))
            return
        blocked = bool(out or tls and sock.unsent)
        if blocked != link.blocked:
            link.blocked = blocked
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if blocked else 0)
            self._sel().modify(sock, events, link)

    def _read(self, link: _Link) -> None:
        """Read all the socket has, and hand it over: an HTTP/1.1 answer as it comes, an
        HTTP/2 connection's bytes at once. Over TLS, one recv that leaves the kernel's
        buffer empty is enough (the rest of a record waits in the incoming BIO)."""
        carrier = link.carrier
        recv = carrier.recv
        tls = isinstance(carrier, _TLSSocket)
        h2 = isinstance(link, _H2Link)
        chunks: List[bytes] = []
        ended = ""
        while not link.closed:
            try:
                data = recv(_RECV_SIZE)
            except _WOULD_BLOCK:  # over TLS also: only session tickets, or part of a record
                break
            except OSError as exc:
                ended = "the connection broke: %s" % _reason(exc)
                break
            if not data:
                ended = "the server closed the connection"
                break
            if h2:
                chunks.append(data)
            elif not self._received(link, data):
                break
            if tls and carrier.drained:
                break
        if chunks and not self._received(link, b"".join(chunks)):
            return
        if tls and not link.closed:
            if carrier.ended:
                ended = "the server closed the connection"
            elif carrier.unsent:
                self._write(link)
        if ended:
            self._lost(link, ended)


def _new_future() -> "asyncio.Future[None]":
    """A future of the running event loop, for one waiter of the asyncio driver."""
    import asyncio

    return asyncio.get_running_loop().create_future()


def _resolve(waiter: Optional["asyncio.Future[None]"]) -> None:
    """Wake whoever awaits ``waiter``, if anyone still does."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


_CLOSE_GRACE = 0.25  # seconds aclose() waits for the connections it cut to be gone


class _AsyncDriver(_Engine):
    """The engine's asyncio driver: no threads, every connection an asyncio transport.

    It belongs to the event loop it is first used on. Each callback (bytes, a
    connection made or lost) is handled at once, and one turn is then scheduled to write
    what waits and to arm the timer of the next deadline. A failure inside the engine
    ends, truthfully, every request it held, as in the thread driver.
    """

    def __init__(self, ssl_context: ssl.SSLContext, connect_timeout: float,
                 read_timeout: float, keep_alive_timeout: float, proxy: Optional[str],
                 policy: _Policy) -> None:
        super().__init__(connect_timeout, read_timeout, keep_alive_timeout, proxy, policy)
        self._ssl_context = ssl_context
        self._event_loop: Optional["asyncio.AbstractEventLoop"] = None
        self._turn_due = False
        self._timer: Optional["asyncio.TimerHandle"] = None
        self._connecting: Set["asyncio.Task[None]"] = set()
        self._carriers: Set["_Carrier"] = set()  # connections not yet lost
        self._closed = False

    def bind(self) -> "asyncio.AbstractEventLoop":
        """The running event loop, which must be the one this client was first used on."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._closed:
            raise ValueError("the client is closed; create a new one")
        if self._event_loop is None:
            self._event_loop = loop
        elif loop is not self._event_loop:
            raise RuntimeError(
                "this andpush.AsyncClient belongs to the event loop it was first used on; "
                "create one client per event loop"
            )
        return loop

    async def run(self, exchange: _Exchange) -> Outcome:
        """Start ``exchange`` and wait for its outcome. It begins at the next turn with the
        others that arrive meanwhile, or at once with a run of them (the turn comes only
        after every task ready before it). Cancelled, it is dropped if unsent; sent, its
        HTTP/2 stream is reset or its HTTP/1.1 connection closed."""
        done = self.bind().create_future()

        def finished(_: _Exchange) -> None:
            if not done.done():
                done.set_result(None)
        exchange.on_done = finished
        self._arrive(exchange)
        if len(self._arrived) >= _RUN:  # the turn comes after every task ready before it
            self._guarded(self._begin_arrived)
        else:
            self.wake()
        try:
            await done
        except BaseException:
            if exchange.outcome is None:
                self._guarded(self._cancel, exchange)
            raise
        assert exchange.outcome is not None
        return exchange.outcome

    def add_batch(self, batch: "_Batch") -> None:
        self._guarded(self._add_batch, batch)

    def wake(self) -> None:
        loop = self._event_loop
        if not (self._turn_due or loop is None or self._closed or loop.is_closed()):
            self._turn_due = True
            loop.call_soon(self._take_turn)

    async def close(self) -> None:
        """End every connection and request; wait until the connects under way are gone
        and every connection is closed, so that none outlives the event loop."""
        import asyncio

        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for task in self._connecting:
            task.cancel()
        self._abandon("the client was closed")
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
        if self._carriers:
            await asyncio.wait([c.lost for c in self._carriers], timeout=_CLOSE_GRACE)

    def _guarded(self, work: Callable[..., object], *args: Any) -> None:
        """Run engine code from a callback; if it fails (a bug), end what it held."""
        try:
            work(*args)
        except Exception as exc:
            log.exception("andpush's engine failed; its requests end with NetworkError")
            self._abandon("andpush's engine failed: %s" % _reason(exc))
        self.wake()

    def _take_turn(self) -> None:
        self._turn_due = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            timeout = self._turn()
        except Exception as exc:
            log.exception("andpush's engine failed; its requests end with NetworkError")
            self._abandon("andpush's engine failed: %s" % _reason(exc))
            return
        if timeout is not None and self._event_loop is not None:
            self._timer = self._event_loop.call_later(timeout, self.wake)

    # Connections ------------------------------------------------------------------

    def _open(self, route: _Route, count: int) -> None:
        assert self._event_loop is not None
        for _ in range(count):
            task = self._event_loop.create_task(self._connect(route, route.generation))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, route: _Route, generation: int) -> None:
        import asyncio

        origin = route.origin
        try:
            carrier = await asyncio.wait_for(self._open_carrier(origin), self._connect_timeout)
        except (OSError, asyncio.TimeoutError, _ProtocolError) as exc:
            error = _connect_error(origin, exc, self._connect_timeout,
                                   isinstance(exc, asyncio.TimeoutError))
            self._guarded(self._connect_failed, route, error, generation)
            return
        ssl_object = carrier.transport.get_extra_info("ssl_object")
        h2 = ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2"

        def take() -> None:
            if not self._connected(route, carrier, h2, generation):
                carrier.transport.close()
        self._guarded(take)

    async def _open_carrier(self, origin: _Origin) -> "_Carrier":
        """A connection to ``origin``: TCP, the CONNECT tunnel if any, TLS for https."""
        assert self._event_loop is not None
        carrier = _Carrier(self)
        protocol = cast("asyncio.Protocol", carrier)  # a protocol by its methods
        context = self._ssl_context if origin.scheme == "https" else None
        try:
            if origin.proxy is None:
                await self._event_loop.create_connection(
                    lambda: protocol, origin.host, origin.port, ssl=context,
                    server_hostname=origin.host if context else None)
                return carrier
            proxy_host, proxy_port, proxy_headers = origin.proxy
            await self._event_loop.create_connection(lambda: protocol, proxy_host, proxy_port)
            await carrier.tunnel(origin, proxy_headers)
            if context is not None:
                carrier.transport = await self._event_loop.start_tls(
                    carrier.transport, protocol, context, server_hostname=origin.host)
            return carrier
        except BaseException:
            if carrier.transport is not None:
                carrier.transport.abort()
            raise

    def _watch(self, link: _Link) -> None:
        link.carrier.attach(link)

    def _send(self, link: _Link) -> None:
        out = link.pending()
        if out:
            link.carrier.transport.write(bytes(out))
            link.wrote(len(out))

    def _shut(self, link: _Link) -> None:
        """Write what is pending (our GOAWAY), then cut the connection, as the thread
        driver does: a TLS close_notify exchange could wait for the server for long."""
        self._send(link)
        link.carrier.transport.abort()


class _Carrier:
    """One asyncio connection's protocol: it hands what arrives to the engine. (asyncio
    takes any object with a protocol's methods, so this one needs no import of it.)"""

    def __init__(self, engine: _AsyncDriver) -> None:
        self._engine = engine
        self.transport: Any = None
        self._link: Optional[_Link] = None
        self._early: List[bytes] = []         # what came before the engine took the link
        self._lost: Optional[str] = None
        self._head: Optional["asyncio.Future[bytes]"] = None  # a CONNECT's answer came
        self.lost = _new_future()  # resolved by connection_lost

    def attach(self, link: _Link) -> None:
        """Hand everything from now on (and what came already) to the engine for ``link``."""
        self._link = link
        for data in self._early:
            if not link.closed:
                self._engine._received(link, data)
        self._early = []
        if self._lost is not None:
            self._engine._lost(link, self._lost)

    async def tunnel(self, origin: _Origin, headers: Dict[str, str]) -> None:
        """Ask the proxy for a tunnel to ``origin``; _ProtocolError if it refuses."""
        assert self._engine._event_loop is not None
        self._head = self._engine._event_loop.create_future()
        self.transport.write(_tunnel_request(origin, headers))
        await self._head

    # asyncio's protocol methods ------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self._engine._carriers.add(self)

    def data_received(self, data: bytes) -> None:
        if self._head is not None and not self._head.done():
            self._early.append(data)
            try:
                if _tunnel_answered(b"".join(self._early)):
                    self._early = []
                    self._head.set_result(b"")
            except _ProtocolError as exc:
                self._head.set_exception(exc)
            return
        link = self._link
        if link is None:
            self._early.append(data)
        elif not link.closed:
            self._engine._guarded(self._engine._received, link, data)

    def eof_received(self) -> bool:
        return False  # the transport closes itself, and connection_lost follows

    def connection_lost(self, exc: Optional[Exception]) -> None:
        reason = ("the connection broke: %s" % _reason(exc) if exc is not None
                  else "the server closed the connection")
        self._engine._carriers.discard(self)
        _resolve(self.lost)
        if self._head is not None and not self._head.done():
            self._head.set_exception(ConnectionError(reason))
        link = self._link
        if link is None:
            self._lost = reason
        elif not link.closed:
            self._engine._guarded(self._engine._lost, link, reason)

    def pause_writing(self) -> None:
        """Nothing to pause: what is written is bounded by the requests in flight."""

    def resume_writing(self) -> None:
        """See pause_writing."""


# Outcomes push_many may hold per message in flight, sent or waiting to be consumed: room
# for the rest to go on while one waits out a retry's backoff, yet bounded.
_WINDOW_PER_WORKER = 64


class _Batch:
    """One push_many: the items of its input, their exchanges, and their outcomes in order.

    A feeder reads the input, at most ``window`` items ahead of the consumer, so memory
    stays bounded however many there are. The engine makes each item's exchange when it
    can start it, ``concurrency`` in flight at most, and hands back their outcomes; each
    is kept with its item until the consumer takes the pair. The waiting (for room, for
    the next pair) is the subclass's: threads (_ThreadBatch) or asyncio (_AsyncBatch).

    Reading ends with the input, or early: ``stop`` ends it, and nothing more is sent:
    each item read and not yet sent ends "not sent", one waiting to be sent again ends
    with its last try's error, and those on the wire end as the server answers (each
    within the read timeout); their pairs still come. ``discard`` does the same for a
    consumer who is gone.
    """

    def __init__(
        self,
        make: Callable[[Any], _Exchange],
        route: _Route,
        concurrency: int,
        progress: Optional[Callable[[int, int], None]],
    ) -> None:
        self._make = make
        self.route = route
        self.concurrency = concurrency
        self._window = concurrency * _WINDOW_PER_WORKER
        self._progress = progress
        self._lock = threading.Lock()
        # The (index, item) of each item read and not yet started.
        self._prepared: Deque[Tuple[int, Any]] = collections.deque()
        self._outcomes: Dict[int, Tuple[Any, Outcome]] = {}
        self._handed: Deque[Tuple[Any, Outcome]] = collections.deque()  # taken, not yet given
        self._read = 0          # items taken from the input
        self._yielded = 0       # pairs handed to the consumer
        self._in_flight = 0     # exchanges the engine has started and not ended
        self._done = 0
        self._failed = 0
        self._reading = True    # the feeder may take more items
        self._halting = False   # stopped: nothing more is sent
        self._halt_due = False  # the engine is yet to end what the batch holds unsent
        # The item and exchange of each exchange begun and not ended, by item index: the
        # engine's thread alone touches it.
        self._begun: Dict[int, Tuple[Any, _Exchange]] = {}
        self._engine_waits = False  # the engine found nothing prepared and wants a wake
        self._error: Optional[BaseException] = None  # raised after the last pair
        # Exchanges the engine ended and has not stored yet: its thread alone touches this
        # list, and stores a burst of them with one lock round trip (in ``ready``, or at
        # the end of its turn: ``store_ended``).
        self._ended: List[_Exchange] = []
        self._fed = True  # the engine still calls ``ready``; after ``abandon`` it does not

    # What the subclass provides (each called with the lock held) -----------------------

    def _pair_ready(self) -> None:
        """Wake the consumer: the pair it waits for (or the end) may be there."""
        raise NotImplementedError

    def _room_made(self) -> None:
        """Wake the feeder: it may read more."""
        raise NotImplementedError

    # The feeder -----------------------------------------------------------------------

    def _half_free(self) -> None:
        """Wake the feeder once half its room is free, not at every message, so that it
        prepares many at each wake (the lock is held)."""
        half = self.concurrency // 2
        if len(self._prepared) <= half and self._ahead() <= self._window - half:
            self._room_made()

    def _must_wait(self) -> bool:
        """Whether the feeder waits for room before reading another item (lock held)."""
        return self._reading and (len(self._prepared) >= self.concurrency
                                  or self._ahead() >= self._window)

    def _ahead(self) -> int:
        """Items read whose pair the consumer has not been given yet."""
        return self._read - self._yielded + len(self._handed)

    def _room_left(self) -> int:
        """How many items the feeder may read before it must wait for room (the lock is
        held); 0 once reading has stopped."""
        if not self._reading:
            return 0
        return max(0, min(self.concurrency - len(self._prepared), self._window - self._ahead()))

    def _prepare(self, items: Iterable[Any]) -> bool:
        """Keep items just read for the engine, which makes their exchanges when it can
        start them (one thread doing all the work is cheaper than two sharing it).
        False when reading stopped while they were read: they are not sent."""
        with self._lock:
            if not self._reading:
                return False
            for item in items:
                self._prepared.append((self._read, item))
                self._read += 1
            wake, self._engine_waits = self._engine_waits, False
        if wake:
            self.route.engine.wake()
        return True

    def _end_of_input(self, error: Optional[BaseException]) -> None:
        with self._lock:
            if self._reading:
                self._reading, self._error = False, error
                self._pair_ready()
                self._room_made()
        self.route.engine.wake()

    # The engine -----------------------------------------------------------------------

    def ready(self) -> List[_Exchange]:
        """The exchanges of the items that may start now, within ``concurrency`` and at
        most _RUN of them: a bad message (TypeError, ValueError) gets its outcome instead,
        and the next run is taken while a whole run was bad. The outcomes of the exchanges
        that ended since the last call are stored first, making room."""
        exchanges: List[_Exchange] = []
        while not exchanges:
            run = self._take_run()
            if not run:
                break
            exchanges = self._make_all(run)
        return exchanges

    def _take_run(self) -> List[Tuple[int, Any]]:
        """The (index, item) of the next run that may start, counted in flight."""
        with self._lock:
            self._store_ended()
            if self._halting:  # taken from the input, never to be sent
                for index, item in self._prepared:
                    self._store(index, item, _Stopped())
                self._prepared.clear()
                return []
            room = min(self.concurrency - self._in_flight, _RUN)
            taken = [self._prepared.popleft() for _ in range(min(room, len(self._prepared)))]
            self._in_flight += len(taken)
            if taken:
                self._half_free()
            self._note_room()
            return taken

    def _make_all(self, run: List[Tuple[int, Any]]) -> List[_Exchange]:
        """The exchanges of a run's items; a bad message gets its outcome instead."""
        exchanges = []
        finished = self._finished
        begun = self._begun
        for index, item in run:
            try:
                exchange = self._make(item)
            except Exception as exc:  # a bad message, or worse: its outcome
                with self._lock:
                    self._in_flight -= 1
                    self._store(index, item, exc)
                    self._note_room()
                continue
            exchange.index = index
            exchange.on_done = finished
            exchanges.append(exchange)
            begun[index] = item, exchange
        return exchanges

    def halted(self) -> List[_Exchange]:
        """Once the batch stopped: the exchanges it began that have not ended, for the
        engine to end those not on the wire and to try the others no more; else []."""
        if not self._halt_due:
            return []
        with self._lock:
            self._halt_due = False
            return [exchange for _, exchange in self._begun.values()]

    def ended(self) -> bool:
        """Whether the engine may forget the batch: nothing left to read, start or end."""
        with self._lock:
            return not self._reading and not self._prepared and not self._in_flight

    def _finished(self, exchange: _Exchange) -> None:
        """An exchange ended (on the engine's thread): its outcome is stored with the rest of
        its burst, at the engine's next ``ready`` or at the end of its turn."""
        assert exchange.outcome is not None
        if self._fed:
            self._ended.append(exchange)
            return
        with self._lock:
            self._ended.append(exchange)
            self._store_ended()
            self._note_room()

    def store_ended(self) -> bool:
        """Store the outcomes of the exchanges that ended, if any (the engine's thread);
        True if that made room for prepared items, which the engine may start at once."""
        if not self._ended:
            return False
        with self._lock:
            self._store_ended()
            self._note_room()
            return bool(self._prepared) and self._in_flight < self.concurrency

    def _store_ended(self) -> None:
        """Store the outcomes of the exchanges that ended (the lock is held)."""
        ended, self._ended = self._ended, []
        self._in_flight -= len(ended)
        for exchange in ended:
            assert exchange.outcome is not None
            item, _ = self._begun.pop(exchange.index)
            self._store(exchange.index, item, exchange.outcome)

    def _note_room(self) -> None:
        """Whether the engine, with room and nothing prepared, waits for the feeder's wake
        (the lock is held)."""
        self._engine_waits = (not self._prepared and self._in_flight < self.concurrency
                              and self._reading)

    def abandon(self, reason: str) -> None:
        """The engine is gone: the items waiting to start end unsent, and so does the reading
        (the exchanges in flight get their outcomes from the engine)."""
        with self._lock:
            self._fed = False
            self._store_ended()
            for index, item in self._prepared:
                self._store(index, item, NetworkError(reason, may_have_been_delivered=False))
            self._prepared.clear()
            if self._reading:
                self._reading = False
                self._error = NetworkError(reason, may_have_been_delivered=False)
            self._pair_ready()
            self._room_made()

    def _store(self, index: int, item: Any, outcome: Outcome) -> None:
        """Keep an item's outcome for the consumer (the lock is held)."""
        self._outcomes[index] = (item, outcome)
        self._done += 1
        self._failed += isinstance(outcome, Exception)
        if index == self._yielded or not self._reading:  # what the consumer waits for
            self._pair_ready()
        if self._progress is not None:
            try:
                self._progress(self._done, self._failed)
            except Exception:  # the caller's code, run on andpush's threads: contain it
                log.exception("the progress callback of push_many failed")

    # The consumer -----------------------------------------------------------------------

    def _next_or_end(self) -> Optional[Tuple[Any, Outcome]]:
        """The next pair if it is there, else None to wait (the lock is held); raises
        StopIteration after the last item read, or the input's error if it failed.

        The pairs that follow it, if there, are taken with it (into ``_handed``, which
        the consumer alone reads), so that a consumer keeping up takes the lock, and
        wakes, once per run of answers rather than once per message."""
        self._half_free()  # the pairs given since the last call made room
        pairs = self._take()
        if pairs:
            self._handed.extend(pairs)
            return self._handed.popleft()
        if not self._reading and self._yielded == self._read:
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise StopIteration
        return None

    def _all_there(self) -> bool:
        return len(self._outcomes) >= self._read - self._yielded

    def taken(self) -> int:
        with self._lock:
            return self._read

    def _take(self) -> List[Tuple[Any, Outcome]]:
        """Hand out the pairs there in order, from the next one on (the lock is held)."""
        outcomes, index, pairs = self._outcomes, self._yielded, []
        pair = outcomes.pop(index, None)
        while pair is not None:
            pairs.append(pair)
            index += 1
            pair = outcomes.pop(index, None)
        if pairs:
            self._yielded = index
            self._half_free()  # the window moved
        return pairs

    def _rest(self) -> List[Tuple[Any, Outcome]]:
        pairs = [*self._handed, *self._take()]
        self._handed.clear()
        return pairs

    def stop(self) -> None:
        """Read no more and send nothing more (see the class); the pairs of what was read
        are the last. The input's error, if it failed meanwhile, is not raised (the
        consumer stopped first)."""
        with self._lock:
            self._reading, self._error = False, None
            self._halt()
        self._wake_engine()

    def discard(self) -> None:
        """The consumer is gone: read no more, and send nothing more."""
        with self._lock:
            self._reading = False
            self._halt()
        self._wake_engine()

    def _halt(self) -> None:
        """Have the engine end what is not sent (the lock is held)."""
        if not self._halting:
            self._halting = self._halt_due = True
        self._pair_ready()
        self._room_made()

    def _wake_engine(self) -> None:
        with contextlib.suppress(ValueError):  # (a closed client: nothing to wake)
            self.route.engine.wake()


class _ThreadBatch(_Batch):
    """A push_many of the threaded client: a feeder thread reads the input (which may
    block: a generator over a database cursor); the consumer's thread waits for pairs."""

    def __init__(self, items: Iterable[Any], make: Callable[[Any], _Exchange], route: _Route,
                 concurrency: int, progress: Optional[Callable[[int, int], None]]) -> None:
        super().__init__(make, route, concurrency, progress)
        self._items = iter(items)
        self._condition = threading.Condition(self._lock)  # the consumer waits on it
        self._room = threading.Condition(self._lock)       # the feeder waits on it

    def _pair_ready(self) -> None:
        self._condition.notify_all()

    def _room_made(self) -> None:
        self._room.notify()

    def feed(self) -> None:
        """On the feeder thread: read and prepare until the input ends or reading stops.
        Each item is prepared as soon as it is read (the input may be slow to give the
        next); the room is looked at once per run of items that fit."""
        while True:
            with self._lock:
                while self._must_wait():
                    self._room.wait()
                room = self._room_left()
            if not room:
                return
            for _ in range(room):
                try:
                    item = next(self._items)
                except StopIteration:
                    self._end_of_input(None)
                    return
                except BaseException as exc:  # the caller's generator failed: hand it over
                    self._end_of_input(exc)
                    return
                if not self._prepare((item,)):
                    return

    def next_pair(self) -> Tuple[Any, Outcome]:
        """The next (item, outcome) in input order, once it has ended; StopIteration
        after the last item read, or the input's error if it failed."""
        if self._handed:
            return self._handed.popleft()
        with self._lock:
            while True:
                pair = self._next_or_end()
                if pair is not None:
                    return pair
                self._condition.wait()

    def rest(self) -> List[Tuple[Any, Outcome]]:
        """Every pair not yet handed out, once all have ended (reading must be stopped).

        Nothing is taken until all are there, so an interruption of the wait (Ctrl-C)
        loses none: they are still there for the next call."""
        with self._lock:
            while not self._all_there():
                self._condition.wait()
            return self._rest()


class _AsyncBatch(_Batch):
    """A push_many of the asyncio client: a task reads the input (an iterable, read in
    the event loop, or an async iterable); the consumer awaits pairs."""

    def __init__(self, items: Union[Iterable[Any], AsyncIterable[Any]],
                 make: Callable[[Any], _Exchange], route: _Route, concurrency: int,
                 progress: Optional[Callable[[int, int], None]],
                 before: Callable[[], Awaitable[None]]) -> None:
        super().__init__(make, route, concurrency, progress)
        self._items = items
        self._before = before
        self._pair_waiter: Optional["asyncio.Future[None]"] = None
        self._room_waiter: Optional["asyncio.Future[None]"] = None
        self._feeder: Optional["asyncio.Task[None]"] = None

    def start(self, loop: "asyncio.AbstractEventLoop") -> None:
        self._feeder = loop.create_task(self._feed())

    def _pair_ready(self) -> None:
        _resolve(self._pair_waiter)

    def _room_made(self) -> None:
        _resolve(self._room_waiter)

    async def _feed(self) -> None:
        """Read and prepare until the input ends or reading stops; room is awaited before
        items are taken, so no item waits outside the window. An async iterable's items
        are prepared one by one, as they come; a plain iterable's (read without awaiting)
        a run at a time."""
        try:
            await self._before()
            if isinstance(self._items, AsyncIterable):
                items = self._items.__aiter__()
                while await self._async_run(items, await self._room_for_more()):
                    pass
            else:
                iterator = iter(self._items)
                while self._run(iterator, await self._room_for_more()):
                    pass
        except Exception as exc:  # the caller's iterable failed: hand it over
            self._end_of_input(exc)
        else:
            self._end_of_input(None)

    async def _async_run(self, items: AsyncIterator[Any], room: int) -> bool:
        """Read and prepare up to ``room`` items; False when no more are to be read."""
        for _ in range(room):
            try:
                item = await items.__anext__()
            except StopAsyncIteration:
                return False
            if not self._prepare((item,)):
                return False
        return room > 0

    def _run(self, iterator: Iterator[Any], room: int) -> bool:
        """Read up to ``room`` items and prepare them together (those read before the input
        failed too); False when no more are to be read."""
        run: List[Any] = []
        try:
            for _ in range(room):
                run.append(next(iterator))
        except StopIteration:
            self._prepare(run)
            return False
        except BaseException:
            self._prepare(run)
            raise
        return self._prepare(run) and room > 0

    async def _room_for_more(self) -> int:
        """Wait while the window is full; then how many items may be read (0 once reading
        has stopped)."""
        while True:
            with self._lock:
                if not self._must_wait():
                    return self._room_left()
            self._room_waiter = _new_future()
            await self._room_waiter

    async def next_pair(self) -> Tuple[Any, Outcome]:
        """The next (item, outcome) in input order; StopAsyncIteration after the last
        item read, or the input's error if it failed. Cancelled, reading stops and nothing
        more is sent."""
        if self._handed:
            return self._handed.popleft()
        while True:
            with self._lock:
                try:
                    pair = self._next_or_end()
                except StopIteration:
                    raise StopAsyncIteration from None
                if pair is not None:
                    return pair
            self._pair_waiter = _new_future()
            try:
                await self._pair_waiter
            except BaseException:
                self.discard()
                raise

    async def rest(self) -> List[Tuple[Any, Outcome]]:
        """Every pair not yet handed out, once all have ended (reading must be stopped)."""
        while True:
            with self._lock:
                if self._all_there():
                    return self._rest()
            self._pair_waiter = _new_future()
            await self._pair_waiter

    def discard(self) -> None:
        super().discard()
        if self._feeder is not None and not self._feeder.get_loop().is_closed():
            self._feeder.cancel()  # it may wait on the caller's async iterable


# Credentials #################################################################
# OAuth2 access tokens for the v1 API: key files, RS256 in pure Python, caching.

#: The OAuth2 scope that FCM v1 requires.
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
_GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"  # also every Google JWT's audience
_GOOGLE_TOKEN_HOSTS = ("accounts.google.com", "googleapis.com")  # and *.googleapis.com
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
_PEM_LABEL = r"(?=.{1,40}\Z)[A-Z0-9]+(?:[ -][A-Z0-9]+)*\Z"  # "RSA PRIVATE KEY": RFC 7468
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
    label = first[len(_PEM_BEGIN) : -len(_PEM_DASHES)]
    if not first.endswith(_PEM_DASHES) or not re.match(_PEM_LABEL, label):
        if "\\n" in pem:
            hint = " (it has literal '\\n' sequences: decode the JSON string)"
        elif first:  # the key runs on after the BEGIN line: never shown, as the label
            hint = " (its BEGIN line runs on into the key: are its line breaks missing?)"
        else:
            hint = ""
        raise ValueError(f"private_key is not a PEM private key{hint}; {_FIX_HINT}")
    if label in _WRONG_LABELS:
        raise ValueError(f"private_key {_WRONG_LABELS[label]}")
    if label not in (_PKCS8_LABEL, _PKCS1_LABEL):
        raise ValueError(f"private_key has unsupported PEM type {label!r}; {_FIX_HINT}")
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
    import hashlib  # here, not above: it loads OpenSSL's digests, 3 ms that most never use

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

def _wait_for(exchange: _Exchange) -> Outcome:
    """Run ``exchange`` on the threaded client's I/O thread, and wait for its outcome.

    Only the threaded client's blocking calls need it (the command line's ``token``, a
    project id from the metadata server); the engine runs token requests itself.
    """
    driver = exchange.route.engine
    assert isinstance(driver, _ThreadDriver), "the asyncio client never waits"
    return driver.run(exchange)


class _Credentials:
    """A source of access tokens, with the project id it knows of (if any).

    A new token is one request through the engine (``token_request``) and what its
    outcome says (``token_from``), so that either driver can run it without blocking.
    """

    project_id: Optional[str] = None
    refreshable = True
    fetch_blocks = True  # a token needs token_request's answer: the engine never waits for it

    def token_request(self) -> Optional[_Exchange]:
        """The request that asks for a new token (None: ``token_from`` needs none)."""
        raise NotImplementedError

    def token_from(self, outcome: Optional[Outcome]) -> Tuple[str, Optional[float]]:
        """The access token and its lifetime in seconds (None: unknown) that the token
        request's outcome holds; AuthError if it holds none."""
        raise NotImplementedError

    def project_request(self) -> Optional[_Exchange]:
        """The request that finds the project id (None: these credentials cannot)."""
        return None

    def project_from(self, outcome: Outcome) -> str:
        raise NotImplementedError

    def find_project_id(self) -> Optional[str]:
        """The project id these credentials name or can find (threads only: it may wait)."""
        request = self.project_request()
        if self.project_id is None and request is not None:
            self.project_id = self.project_from(_wait_for(request))
        return self.project_id

    def __repr__(self) -> str:
        return "<%s project_id=%r>" % (type(self).__name__, self.project_id)


class _TokenGrant(_Credentials):
    """Credentials that trade a form POST to an OAuth2 token endpoint for a token."""

    def __init__(self, token_uri: str, engine: _Engine) -> None:
        origin, self._token_path = _split_url(token_uri, "token_uri")
        self._route = engine.route(origin)

    def token_request(self) -> _Exchange:
        body = urllib.parse.urlencode(self._grant()).encode("ascii")
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        return _token_exchange(self._route, "POST", self._token_path, headers, body)

    def token_from(self, outcome: Optional[Outcome]) -> Tuple[str, Optional[float]]:
        return _token_from(_token_answer(outcome), "the token endpoint")

    def _grant(self) -> Dict[str, str]:
        raise NotImplementedError


class _ServiceAccount(_TokenGrant):
    """A service account key file: sign a JWT with its private key (RFC 7523 grant)."""

    def __init__(self, info: Dict[str, Any], engine: _Engine) -> None:
        self._email = _field(info, "client_email")
        self._key_id = info.get("private_key_id")
        try:
            self._key = _parse_private_key(_field(info, "private_key"))
        except ValueError as exc:
            raise AuthError("service account key: %s" % exc) from None
        token_uri = str(info.get("token_uri") or _GOOGLE_TOKEN_URI)
        self._audience = _GOOGLE_TOKEN_URI if _is_google(token_uri) else token_uri
        self.project_id = info.get("project_id") or None
        super().__init__(token_uri, engine)

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
            "iss": self._email, "scope": FCM_SCOPE, "aud": self._audience,
            "iat": now, "exp": now + _JWT_LIFETIME,
        }
        return _jwt(header, claims, self._key)


def _is_google(token_uri: str) -> bool:
    """Whether a key file's token_uri is one of Google's token endpoints (older key files
    name https://accounts.google.com/o/oauth2/token), for which Google defines the JWT's
    audience as _GOOGLE_TOKEN_URI whatever the endpoint, as google-auth signs it; any
    other (a gateway, a test double) is the audience itself."""
    parts = urllib.parse.urlsplit(token_uri)
    host = (parts.hostname or "").lower()
    return parts.scheme == "https" and (
        host in _GOOGLE_TOKEN_HOSTS or host.endswith(".googleapis.com"))


class _AuthorizedUser(_TokenGrant):
    """gcloud's user credentials: trade the refresh token for an access token."""

    def __init__(self, info: Dict[str, Any], engine: _Engine) -> None:
        self._grant_fields = {
            "grant_type": "refresh_token",
            "client_id": _field(info, "client_id"),
            "client_secret": _field(info, "client_secret"),
            "refresh_token": _field(info, "refresh_token"),
        }
        self.project_id = info.get("quota_project_id") or None
        super().__init__(str(info.get("token_uri") or _GOOGLE_TOKEN_URI), engine)

    def _grant(self) -> Dict[str, str]:
        return self._grant_fields


class _MetadataServer(_Credentials):
    """The metadata server of GCE, Cloud Run and GKE: the attached service account's token."""

    _HEADERS = {"Metadata-Flavor": "Google"}
    _TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
    _PROJECT_PATH = "/computeMetadata/v1/project/project-id"

    def __init__(self, host: str, tried: List[str], engine: _Engine) -> None:
        self._tried = tried + ["the metadata server at %s" % host]
        self._route = engine.route("http://" + host)

    def token_request(self) -> _Exchange:
        return _token_exchange(self._route, "GET", self._TOKEN_PATH, self._HEADERS, b"")

    def token_from(self, outcome: Optional[Outcome]) -> Tuple[str, Optional[float]]:
        return _token_from(self._answer(outcome), "the metadata server")

    def project_request(self) -> _Exchange:
        return _token_exchange(self._route, "GET", self._PROJECT_PATH, self._HEADERS, b"")

    def project_from(self, outcome: Outcome) -> str:
        try:
            return self._answer(outcome).body.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise AuthError(
                "the metadata server sent a project id that is not UTF-8 text; "
                "pass project_id= or set GOOGLE_CLOUD_PROJECT"
            ) from None

    def _answer(self, outcome: Optional[Outcome]) -> Response:
        if isinstance(outcome, NetworkError):
            raise AuthError(
                "no Google credentials found; tried %s (%s). Pass credentials= or set "
                "GOOGLE_APPLICATION_CREDENTIALS to a service account key file"
                % (", ".join(self._tried), outcome)
            ) from None
        return _token_answer(outcome)


class _StaticToken(_Credentials):
    """An access token obtained elsewhere: a fixed string, or a callable asked each time."""

    fetch_blocks = False

    def __init__(self, token: Union[str, Callable[[], str]], project_id: str) -> None:
        self._token = token
        self.project_id = project_id
        self.refreshable = callable(token)

    def token_request(self) -> None:
        return None

    def token_from(self, outcome: Optional[Outcome]) -> Tuple[str, Optional[float]]:
        try:
            token = self._token() if callable(self._token) else self._token
        except Exception as exc:  # the caller's code, run on the I/O thread: contain it
            raise AuthError("the access_token callable failed: %s" % _reason(exc)) from exc
        if not isinstance(token, str) or not _is_header_token(token):
            raise AuthError(
                "access_token must be a non-empty str of visible ASCII characters "
                "(no spaces, line breaks or control characters)"
            )
        return token, 0.0 if callable(self._token) else None


# What may follow "Bearer " in a header: visible ASCII, as in RFC 6750's b64token and wider.
_HEADER_TOKEN = r"[\x21-\x7e]+\Z"  # compiled when first used, as the message patterns


def _is_header_token(token: str) -> bool:
    """Whether an access token can go into an Authorization header as it is."""
    return re.match(_HEADER_TOKEN, token) is not None


def _field(info: Dict[str, Any], name: str) -> str:
    value = info.get(name)
    if value is None or value == "":
        raise AuthError("credentials have no %r; use the JSON key file as downloaded" % name)
    if not isinstance(value, str):
        raise AuthError("the %r of the credentials is %s, not a string; use the JSON key file "
                        "as downloaded" % (name, type(value).__name__))
    return value


def _token_exchange(
    route: _Route, method: str, path: str, headers: Dict[str, str], body: bytes
) -> _Exchange:
    """A request to a token endpoint, retried briefly when it may succeed later (it is
    idempotent)."""
    retry = _Retry(_TOKEN_RETRIES, _TOKEN_BACKOFF, idempotent=True, may_refresh=False)
    return _Exchange(route, method, path, body, retry, headers=headers)


def _token_answer(outcome: Optional[Outcome]) -> Response:
    """The 2xx answer of a token endpoint, or the error its failure means for the
    requests that waited for the token: an AuthError, or a NetworkError saying they
    were not sent (whatever became of the token request, none of them left the client)."""
    if isinstance(outcome, Response):
        return outcome
    assert isinstance(outcome, Error)
    if isinstance(outcome, CertificateError):  # says it was not sent, and what to fix
        raise outcome
    if isinstance(outcome, NetworkError):
        raise NetworkError("not sent: no access token: %s" % outcome,
                           may_have_been_delivered=False) from None
    raise _auth_error(outcome) from None


def _auth_error(error: Error) -> Error:
    """The AuthError for a failed token request, in the token endpoint's own words."""
    if not isinstance(error, HTTPError):
        return error
    try:
        answer = error.response.json()
        reason = "%s: %s" % (answer["error"], answer.get("error_description", ""))
    except (ValueError, KeyError, TypeError):
        reason = "HTTP %d %s" % (error.status_code,
                                 error.response.reason or _phrase(error.status_code))
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

    The engine fetches it (``answered`` takes what its token request got); a thread
    that must have it at once (``get``) fetches it itself, and however many find it
    stale together, one of them fetches (single flight) and the others share its token
    or its error. A failure is given to every caller for a second before the next try,
    so that a push_many over broken credentials does not ask once per message.
    """

    def __init__(self, credentials: _Credentials, engine: _Engine) -> None:
        self.credentials = credentials
        self._engine = engine  # whose clock times the token's life
        self._lock = threading.Lock()
        self._token: Optional[str] = None
        self._expires = 0.0
        self._generation = 0
        self._error: Optional[Error] = None
        self._error_until = 0.0

    def get(self) -> str:
        token = self._token
        if token is not None and self._engine.clock.now() < self._expires:
            return token
        generation = self._generation
        with self._lock:
            fresh = self._generation != generation or self._engine.clock.now() < self._error_until
            if fresh and self._error is not None:
                raise self._error
            if self._generation != generation and self._token is not None:
                return self._token
            request = self.credentials.token_request()
            return self.answered(None if request is None else _wait_for(request))

    def current(self) -> Optional[str]:
        """The token, if it can be had without waiting: valid, or fetched without I/O.

        None when it must be fetched (``get``); the failure of the last second is raised.
        """
        token = self._token
        if token is not None and self._engine.clock.now() < self._expires:
            return token
        if self._error is not None and self._engine.clock.now() < self._error_until:
            raise self._error
        return None if self.credentials.fetch_blocks else self.get()

    def invalidate(self, token: str) -> None:
        """Forget ``token`` (the server rejected it) unless it was replaced already."""
        with self._lock:
            if self._token == token:
                self._token = None

    def answered(self, outcome: Optional[Outcome]) -> str:
        """Keep and return the token a token request's outcome holds (None: the
        credentials need no request); keep and raise the error if it holds none."""
        try:
            token, lifetime = self.credentials.token_from(outcome)
        except Error as exc:
            self._token, self._error = None, exc
            self._error_until = self._engine.clock.now() + _TOKEN_FAILURE_HOLD
            raise
        finally:
            self._generation += 1
        self._error = None
        self._token = token
        self._expires = (
            math.inf if lifetime is None
            else self._engine.clock.now() + max(0.0, lifetime - _TOKEN_REFRESH_MARGIN)
        )
        log.debug("got a new access token (lifetime %s s)", lifetime)
        return token


_CREDENTIALS_TYPE = r"[a-z][a-z_]{0,39}\Z"  # what Google's key files say: service_account
_NAME_MAX = 255   # characters in the longest file name of the common file systems
_PATH_MAX = 4096  # characters in the longest path Linux takes
_EXTENSION = r"\.[A-Za-z0-9]{1,5}\Z"  # .json, .key: what ends the name of a file
_CONTROL_CHARACTER = r"[\x00-\x1f\x7f]"
_BASE64_TEXT = r"(?:[A-Za-z0-9+/]+|[A-Za-z0-9_-]+)=*\Z"  # base64 or base64url, line breaks gone
_MIN_BASE64_BLOB = 64  # characters of base64 from which a string is not taken for a path
_TAKE_FULL_KEY_FILE = "pass the whole service account JSON key file (its path, its text or " \
    "a dict), which holds the key with the client_email it belongs to"


def _load_credentials(source: object, engine: _Engine, name: str = "credentials=") -> _Credentials:
    """Credentials from a key file path, a dict, or a JSON string (``name`` says where
    they came from, for the errors)."""
    if isinstance(source, dict):
        info = source
    elif isinstance(source, (str, os.PathLike)):
        info = _read_json_credentials(source, name)
    else:
        raise TypeError(
            "credentials must be a path, a dict or a JSON string, got %s" % type(source).__name__
        )
    kind = info.get("type")
    if kind == "service_account":
        return _ServiceAccount(info, engine)
    if kind == "authorized_user":
        return _AuthorizedUser(info, engine)
    if kind is None and "project_info" in info and "client" in info:
        raise AuthError(
            "credentials are google-services.json, the Android app's Firebase config, which "
            "holds no key: andpush needs a service account key file (Firebase console, "
            "Project settings, Service accounts, Generate new private key)"
        )
    if kind is None:
        problem = "credentials have no 'type'"
    elif isinstance(kind, str) and re.match(_CREDENTIALS_TYPE, kind):
        problem = "credentials of type %r are not supported" % kind
    else:  # not shown: it may be anything, a key included
        problem = "credentials of an unknown type are not supported"
    raise AuthError(problem + "; use a service account key file or gcloud's application "
                    "default credentials")


def _read_json_credentials(source: Union[str, "os.PathLike[str]"], name: str) -> Dict[str, Any]:
    """The JSON object that ``source`` is, or that the file it names holds.

    A string that names no readable file is shown back only when it has the shape of a
    path (``_looks_like_path``); otherwise it is described by its shape and length, since
    it may be key material: a pasted key, base64 of a key file, a token. The errors are
    raised outside the ``except`` blocks, so that no exception chained to them (an
    OSError's filename, a JSONDecodeError's document) holds the string either.
    """
    text = str(source)
    if text.lstrip()[:1] in ("{", "["):
        return _parse_json_credentials(text, name.rstrip("="))
    problem, is_path = None, True
    try:
        with open(source, encoding="utf-8") as file:
            contents = file.read()
    except UnicodeDecodeError:  # a file, but not text: a .p12 key?
        problem = "it is not UTF-8 text, as a JSON key file is"
    except (OSError, ValueError) as exc:  # ValueError: a NUL character, which no path holds
        problem = getattr(exc, "strerror", None) or "it cannot be opened"
        is_path = isinstance(source, os.PathLike) or _looks_like_path(text)
    if problem is None:
        return _parse_json_credentials(contents, "credentials file %r" % text)
    if is_path:
        raise AuthError("cannot read credentials file %r: %s" % (text, problem))
    hint = _shape_hint(text)
    if not hint:
        hint = ("it holds line breaks, as no path does: " if "\n" in text else "") \
            + _TAKE_FULL_KEY_FILE
    raise AuthError("%s is a string of %s characters that is neither JSON nor the path of a "
                    "file; %s" % (name, format(len(text), ","), hint))


def _parse_json_credentials(text: str, what: str) -> Dict[str, Any]:
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    if info is None:
        raise AuthError("%s is not JSON; %s" % (what, _shape_hint(text) or
                                                 "use the key file as downloaded"))
    if not isinstance(info, dict):
        raise AuthError("%s is not a JSON object; use the key file as downloaded" % what)
    return info


def _looks_like_path(text: str) -> bool:
    """Whether a string may be shown back as the path it was meant to be: no control
    character or line break, no part longer than a file name can be, not PEM or base64
    text, and either a name with an extension (``key.json``) or a path whose folder
    exists (``/run/secrets/fcm``). A token or key pasted by mistake is none of these."""
    parts = re.split(r"[/\\]", text)
    if (len(text) > _PATH_MAX or re.search(_CONTROL_CHARACTER, text)
            or max(len(part) for part in parts) > _NAME_MAX
            or _PEM_BEGIN in text or _base64_payload(text) is not None):
        return False
    if re.search(_EXTENSION, parts[-1]):
        return True
    return len(parts) > 1 and os.path.isdir(os.path.dirname(text))


def _base64_payload(text: str) -> Optional[bytes]:
    """What a string decodes to if it is base64 (or base64url) text, perhaps with line
    breaks as ``base64`` writes them; None if it is not, or is too short to tell."""
    compact = "".join(text.split())
    if len(compact) < 16 or not re.match(_BASE64_TEXT, compact):
        return None
    digits = compact.rstrip("=").replace("+", "-").replace("/", "_")
    try:
        payload = base64.urlsafe_b64decode(digits + "=" * (-len(digits) % 4))
    except (binascii.Error, ValueError):
        return None
    known = payload.lstrip()[:1] == b"{" or payload.startswith((b"-----BEGIN", b"\x30\x82"))
    return payload if known or len(compact) >= _MIN_BASE64_BLOB else None


def _shape_hint(text: str) -> str:
    """What credentials text that is no key file looks like, and what to pass instead
    (empty: nothing to tell); it says nothing of the text but its shape."""
    payload = _base64_payload(text)
    if _PEM_BEGIN in text:
        return "it holds a PEM block, which is only a part of a key file: " + _TAKE_FULL_KEY_FILE
    if payload is not None and payload.lstrip()[:1] == b"{":
        return "it looks like base64 of a key file: decode it (base64.b64decode) and pass " \
            "the JSON, or pass the file's path"
    if payload is not None and payload.startswith((b"-----BEGIN", b"\x30\x82")):
        return "it looks like base64 of a private key, which is only a part of a key file: " \
            + _TAKE_FULL_KEY_FILE
    if payload is not None:
        return "it looks like base64 of something else than a key file: " + _TAKE_FULL_KEY_FILE
    return ""


def _application_default_credentials(engine: _Engine) -> _Credentials:
    """Application Default Credentials, looked up in the order Google's libraries use."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path:
        return _load_credentials(path, engine, "GOOGLE_APPLICATION_CREDENTIALS")
    tried = ["GOOGLE_APPLICATION_CREDENTIALS (not set)"]
    gcloud = os.path.join(_gcloud_config_dir(), "application_default_credentials.json")
    if os.path.exists(gcloud):
        return _load_credentials(gcloud, engine)
    tried.append("%s (not found)" % gcloud)
    host = os.environ.get("GCE_METADATA_HOST") or _METADATA_HOST
    return _MetadataServer(host, tried, engine)


def _gcloud_config_dir() -> str:
    configured = os.environ.get("CLOUDSDK_CONFIG")
    if configured:
        return configured
    if os.name == "nt":
        return os.path.join(os.environ.get("APPDATA", ""), "gcloud")
    return os.path.join(os.path.expanduser("~"), ".config", "gcloud")


# Messages ####################################################################
# The two FCM APIs: where a message goes, how it is wrapped, and what is wrong with it.

# The messages as types: TypedDicts (total=False: any field may be left out) of the v1
# message and its parts, with each field under both of the names FCM takes (proto3 JSON:
# ``fcm_options`` and ``fcmOptions``), and of the legacy message. A type checker then
# catches a misspelt field in a literal; at run time they are plain dicts. What is
# free-form for FCM (data, headers, the APNs payload, the web notification) is a Dict.

# The notification every platform shows: message["notification"].
Notification = TypedDict("Notification", {"title": str, "body": str, "image": str}, total=False)

# message["fcm_options"], and android["fcm_options"].
FcmOptions = TypedDict("FcmOptions", {"analytics_label": str, "analyticsLabel": str}, total=False)

# An RGBA colour, each part from 0 to 1: light_settings["color"].
Color = TypedDict("Color", {
    "red": float, "green": float, "blue": float, "alpha": float,
}, total=False)

# The LED of an Android notification: android["notification"]["light_settings"].
LightSettings = TypedDict("LightSettings", {
    "color": Color, "light_on_duration": str, "lightOnDuration": str,
    "light_off_duration": str, "lightOffDuration": str,
}, total=False)

# android["notification"]: what an Android device shows.
AndroidNotification = TypedDict("AndroidNotification", {
    "title": str, "body": str, "icon": str, "color": str, "sound": str, "tag": str, "image": str,
    "click_action": str, "clickAction": str, "body_loc_key": str, "bodyLocKey": str,
    "body_loc_args": List[str], "bodyLocArgs": List[str], "title_loc_key": str, "titleLocKey": str,
    "title_loc_args": List[str], "titleLocArgs": List[str], "channel_id": str, "channelId": str,
    "ticker": str, "sticky": bool, "event_time": str, "eventTime": str,
    "local_only": bool, "localOnly": bool,
    "notification_priority": str, "notificationPriority": str,
    "default_sound": bool, "defaultSound": bool,
    "default_vibrate_timings": bool, "defaultVibrateTimings": bool,
    "default_light_settings": bool, "defaultLightSettings": bool,
    "vibrate_timings": List[str], "vibrateTimings": List[str], "visibility": str,
    "notification_count": int, "notificationCount": int,
    "light_settings": LightSettings, "lightSettings": LightSettings,
    "bypass_proxy_notification": bool, "bypassProxyNotification": bool, "proxy": str,
}, total=False)

# message["android"]: Android's options.
AndroidConfig = TypedDict("AndroidConfig", {
    "collapse_key": str, "collapseKey": str, "priority": str, "ttl": str,
    "restricted_package_name": str, "restrictedPackageName": str, "data": Dict[str, str],
    "notification": AndroidNotification, "fcm_options": FcmOptions, "fcmOptions": FcmOptions,
    "direct_boot_ok": bool, "directBootOk": bool,
    "bandwidth_constrained_ok": bool, "bandwidthConstrainedOk": bool,
    "restricted_satellite_ok": bool, "restrictedSatelliteOk": bool,
}, total=False)

# apns["fcm_options"].
ApnsFcmOptions = TypedDict("ApnsFcmOptions", {
    "analytics_label": str, "analyticsLabel": str, "image": str,
}, total=False)

# message["apns"]: Apple's options; the payload is APNs' JSON (aps and yours).
ApnsConfig = TypedDict("ApnsConfig", {
    "headers": Dict[str, str], "payload": Dict[str, Any],
    "fcm_options": ApnsFcmOptions, "fcmOptions": ApnsFcmOptions,
    "live_activity_token": str, "liveActivityToken": str,
}, total=False)

# webpush["fcm_options"].
WebpushFcmOptions = TypedDict("WebpushFcmOptions", {
    "analytics_label": str, "analyticsLabel": str, "link": str,
}, total=False)

# message["webpush"]: the notification is the Web Notification API's options.
WebpushConfig = TypedDict("WebpushConfig", {
    "headers": Dict[str, str], "data": Dict[str, str], "notification": Dict[str, Any],
    "fcm_options": WebpushFcmOptions, "fcmOptions": WebpushFcmOptions,
}, total=False)

# A v1 message, the message of FCM's messages:send: one target (token, topic, condition or fid)
# and any of the rest. android_v2 (FCM's preview) is passed on unchecked.
Message = TypedDict("Message", {
    "token": str, "topic": str, "condition": str, "fid": str, "data": Dict[str, str],
    "notification": Notification, "android": AndroidConfig,
    "android_v2": Dict[str, Any], "androidV2": Dict[str, Any], "apns": ApnsConfig,
    "webpush": WebpushConfig, "fcm_options": FcmOptions, "fcmOptions": FcmOptions,
}, total=False)

# The notification of a legacy message.
LegacyNotification = TypedDict("LegacyNotification", {
    "title": str, "body": str, "subtitle": str, "image": str, "icon": str, "sound": str,
    "badge": str, "tag": str, "color": str, "click_action": str, "android_channel_id": str,
    "body_loc_key": str, "body_loc_args": Union[str, List[str]], "title_loc_key": str,
    "title_loc_args": Union[str, List[str]],
}, total=False)

# A message of the legacy API (andpush.new(server_key)): one of to, registration_ids or condition,
# and any of the rest; its data values may be any JSON.
LegacyMessage = TypedDict("LegacyMessage", {
    "to": str, "registration_ids": List[str], "condition": str, "collapse_key": str,
    "priority": str, "content_available": bool, "mutable_content": bool, "time_to_live": int,
    "restricted_package_name": str, "direct_boot_ok": bool, "dry_run": bool,
    "data": Dict[str, Any], "notification": LegacyNotification,
}, total=False)

_TARGETS = ("token", "topic", "condition", "fid")
_TARGET_SET = frozenset(_TARGETS)
_LEGACY_TARGETS = ("to", "registration_ids", "condition")
_MULTICAST_FIELDS = ("tokens", "registration_ids")  # other clients' ways to name many targets
# Patterns are compiled when first used (the re module keeps them): most never are.
_TOPIC_NAME = r"[a-zA-Z0-9\-_.~%]{1,900}\Z"
_TOPIC_PREFIX = "/topics/"  # the legacy API's way to name a topic, dropped as firebase-admin does
_RESERVED_DATA_KEYS = ("from", "message_type")
_RESERVED_DATA_PREFIXES = ("google", "gcm")
#: Bytes of a data payload FCM takes, counting each key and value in UTF-8.
MAX_DATA_BYTES = 4096
#: Longest time to live FCM takes, in seconds (four weeks).
MAX_TTL_SECONDS = 2419200
# FCM takes the priority in either case: firebase-admin sends "high", the REST docs say "HIGH".
_PRIORITIES = ("normal", "high")
_TTL = r"(?a)[0-9]+(?:\.[0-9]{1,9})?s\Z"  # google.protobuf.Duration in JSON
_COLOR = r"#[0-9a-fA-F]{6}\Z"
_ANALYTICS_LABEL = r"[a-zA-Z0-9\-_.~%]{1,50}\Z"
_NOTIFICATION_TEXTS = ("title", "body", "image")
_PLATFORMS = ("android", "apns", "webpush")
_SECTIONS = frozenset(("fcm_options", "fcmOptions") + _PLATFORMS)  # checked when present

# The fields FCM knows in each object of a v1 message, by where it lies (proto3 JSON takes
# both names of each); a name it does not know is refused (INVALID_ARGUMENT), and so is
# one here when it is a slip: near a known name, or a field of another place.
_KNOWN_FIELDS = {
    where: frozenset(kind.__annotations__) for where, kind in (
        ("", Message), ("notification", Notification), ("fcm_options", FcmOptions),
        ("android", AndroidConfig), ("android.notification", AndroidNotification),
        ("android.fcm_options", FcmOptions), ("android.notification.light_settings",
                                              LightSettings),
        ("android.notification.light_settings.color", Color), ("apns", ApnsConfig),
        ("apns.fcm_options", ApnsFcmOptions), ("webpush", WebpushConfig),
        ("webpush.fcm_options", WebpushFcmOptions),
    )
}
_KNOWN_FIELDS[""] |= {"name"}  # the message's id: FCM's answer has it, and FCM takes it back
_MESSAGE_FIELDS = _KNOWN_FIELDS[""]
_NOTIFICATION_FIELDS = _KNOWN_FIELDS["notification"]
_NEAR = 0.8  # how alike (difflib's ratio) an unknown name and a known one are for a slip
# The legacy API's fields, given to a v1 client: where each went.
_LEGACY_FIELDS = {
    "to": "the target is 'token' (a device), 'topic' (a name, without /topics/) or "
          "'condition'",
    "priority": "it is android.priority, and apns.headers 'apns-priority' ('10' or '5')",
    "time_to_live": "it is android.ttl (a string, such as \"3600s\"), and apns.headers "
                    "'apns-expiration'",
    "collapse_key": "it is android.collapse_key, and apns.headers 'apns-collapse-id'",
    "content_available": "it is apns.payload {\"aps\": {\"content-available\": 1}}",
    "mutable_content": "it is apns.payload {\"aps\": {\"mutable-content\": 1}}",
    "restricted_package_name": "it is android.restricted_package_name",
    "dry_run": "pass validate_only=True to push() instead",
}


def _check_dict(message: object) -> Dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError("message must be a dict, got %s" % type(message).__name__)
    return message


def _check_message(message: object) -> Dict[str, Any]:
    """Check a v1 Message before it is sent: raise TypeError/ValueError saying what to fix;
    return the message to send (a copy when a topic had a /topics/ prefix, dropped).

    Only what FCM is known to refuse is refused, and each check looks only at fields that
    are present, so a typical message costs a few dict lookups and set tests more.
    """
    message = _check_dict(message)
    fields = message.keys()
    if not fields <= _MESSAGE_FIELDS:
        _check_fields(message, "")
    targets = fields & _TARGET_SET
    if len(targets) != 1:
        raise ValueError(
            "message needs exactly one target of token, topic, condition or fid; got %s"
            % (", ".join(name for name in _TARGETS if name in targets) or "none")
        )
    (name,) = targets
    target = message[name]
    if name == "token":
        _check_device_token(target)
    elif name == "topic":
        topic = _topic_name(target, "message 'topic'")
        if topic is not target:
            message = dict(message, topic=topic)
    elif not isinstance(target, str):
        raise TypeError("message %r must be a str, got %s" % (name, type(target).__name__))
    elif not target:
        raise ValueError("message %r is empty" % name)
    data = message.get("data")
    if data is not None:
        _check_data(data, "data")
    notification = message.get("notification")
    if notification is not None:
        notification = _check_section(notification, "notification")
        if not notification.keys() <= _NOTIFICATION_FIELDS:
            _check_fields(notification, "notification")
        _check_texts(notification, "notification")
    if fields.isdisjoint(_SECTIONS):
        return message  # the usual message: no options, no platform's config
    _check_fcm_options(message, "")
    for platform in _PLATFORMS:
        config = message.get(platform)
        if config is not None:
            _check_platform(platform, _check_section(config, platform))
    return message


def _check_fields(section: Dict[str, Any], where: str) -> None:
    """Refuse a field FCM does not know in the object at ``where`` ("" for the message)
    when it is a slip: the message's request body around it, a legacy field, a name near a
    known one (a typo, another case), or a field of another place; each says what to do.
    A name like none of these is left to FCM, which may know a field newer than this list."""
    known = _KNOWN_FIELDS[where]
    for name in section:
        if name in known or not isinstance(name, str):
            continue
        problem = _slip(name, section, where, known)
        if problem:
            raise ValueError(problem)


def _slip(name: str, section: Dict[str, Any], where: str, known: FrozenSet[str]) -> str:
    """What is wrong with an unknown field name, and how to fix it; "" when it looks like
    no slip andpush knows."""
    field = "message %s.%s" % (where, name) if where else "message %r" % name
    if not where and name in _MULTICAST_FIELDS:
        return (
            "a v1 message has one target, not %r: to send it to many devices, leave %r "
            "out and call client.push_multicast(message, tokens)" % (name, name)
        )
    if not where and name == "message" and isinstance(section[name], dict):
        return (
            "this is the body of a v1 request, {\"message\": {...}}: pass the message inside "
            "it, as in client.push(body[\"message\"]) (and validate_only=True for its "
            "\"validate_only\")"
        )
    if not where and name in _LEGACY_FIELDS:
        return "%s is a field of the legacy API; in a v1 message %s" % (field, _LEGACY_FIELDS[name])
    near = _nearest(name, known)
    if near:
        return "%s is not a field FCM knows: did you mean %r?" % (field, near)
    places = [place + "." + name if place else name
              for place, fields in _KNOWN_FIELDS.items() if name in fields]
    if places:
        return "%s is not a field FCM knows there: it goes in %s" % (
            field, " or ".join(sorted(places)))
    return ""


def _nearest(name: str, known: FrozenSet[str]) -> str:
    """The known field ``name`` was most likely meant as (another case, a typo), or ""."""
    import difflib  # only a refused field needs it

    folded = name.lower().replace("_", "")
    same = [field for field in known if field.lower().replace("_", "") == folded]
    if same:
        return sorted(same)[0]
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=_NEAR)
    return close[0] if close else ""


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
    if not config.keys() <= _KNOWN_FIELDS[platform]:
        _check_fields(config, platform)
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
    if notification is None:
        return
    notification = _check_section(notification, "android.notification")
    _check_nested(notification, "android.notification")
    _check_color(notification.get("color"), "android.notification.color")
    lights = _either(notification, "light_settings", "lightSettings")
    if lights is not None:
        where = "android.notification.light_settings"
        lights = _check_section(lights, where)
        _check_nested(lights, where)
        color = lights.get("color")
        if color is not None:
            _check_nested(_check_section(color, where + ".color"), where + ".color")


def _check_nested(section: Dict[str, Any], where: str) -> None:
    if not section.keys() <= _KNOWN_FIELDS[where]:
        _check_fields(section, where)


def _check_color(color: object, where: str) -> None:
    if color is not None and not (isinstance(color, str) and re.match(_COLOR, color)):
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
    if not (isinstance(ttl, str) and re.match(_TTL, ttl) and float(ttl[:-1]) <= MAX_TTL_SECONDS):
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
    _check_nested(options, where + "fcm_options")
    label = _either(options, "analytics_label", "analyticsLabel")
    if label is not None and not (isinstance(label, str) and re.match(_ANALYTICS_LABEL, label)):
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


def _topic_name(topic: object, what: str) -> str:
    """A topic name as FCM takes it: a /topics/ prefix (the legacy API's) is dropped, as
    firebase-admin drops it; TypeError/ValueError for what is no topic name."""
    if not isinstance(topic, str):
        raise TypeError("%s must be a str, got %s" % (what, type(topic).__name__))
    name = topic[len(_TOPIC_PREFIX):] if topic.startswith(_TOPIC_PREFIX) else topic
    if not re.match(_TOPIC_NAME, name):
        raise ValueError(
            "%s %r is not a valid topic name: use 1 to 900 of a-z A-Z 0-9 - _ . ~ %%"
            % (what, name[:40])
        )
    return name


def _check_device_token(token: object) -> str:
    """A device token as push, push_multicast and subscribe all take it: a str (TypeError
    otherwise) that is not empty (ValueError); what it holds is never shown."""
    if not isinstance(token, str):
        raise TypeError("a device token must be a str, got %s" % type(token).__name__)
    if not token:
        raise ValueError("a device token is empty: leave it out, or pass the app's token")
    return token


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
    targets = [name for name in _LEGACY_TARGETS if name in message]
    if len(targets) != 1:
        if not targets and any(name in message for name in _TARGETS):
            raise ValueError(
                "this is a v1 message (its target is %r); the legacy API's target is 'to' (a "
                "token, or /topics/name), 'registration_ids' or 'condition'. For the v1 API "
                "make the client with credentials=" % next(n for n in _TARGETS if n in message)
            )
        raise ValueError("a legacy message needs exactly one target of to, registration_ids "
                         "or condition; got %s" % (", ".join(targets) or "none"))
    target = message[targets[0]]
    if targets[0] == "registration_ids":
        if not isinstance(target, list) or not target:
            raise TypeError("message registration_ids must be a non-empty list of tokens")
        for token in target:
            _check_device_token(token)
    elif targets[0] == "to" and not (isinstance(target, str) and target.startswith(_TOPIC_PREFIX)):
        _check_device_token(target)  # a device's token, or a device group's key
    elif not isinstance(target, str) or not target:
        raise ValueError("message %r must be a non-empty str" % targets[0])
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


def _json_encoder() -> Callable[[Any], str]:
    """The JSON text of a value, as json.JSONEncoder(...).encode gives it. On CPython, the
    C encoder that encode makes anew at every call (a fifth of its cost for a message)
    is made once here, and called directly.

    No check for circular references: a message that holds itself nests too deeply
    instead."""
    encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                               check_circular=False)
    try:
        from _json import make_encoder
    except ImportError:  # (an interpreter without json's C accelerator)
        return encoder.encode
    chunks = make_encoder(None, encoder.default, json.encoder.encode_basestring, None, ":",
                          ",", False, False, False)
    return lambda value: "".join(chunks(value, 0))


_JSON_ENCODE = _json_encoder()


def _encode_json(message: Dict[str, Any], what: str = "message") -> bytes:
    """Serialise a message, with a clear TypeError/ValueError when it cannot be."""
    try:
        text = _JSON_ENCODE(message)
    except TypeError as exc:
        raise TypeError("%s is not JSON-serialisable: %s" % (what, exc)) from None
    except ValueError as exc:
        raise ValueError("%s is not JSON-serialisable: %s" % (what, exc)) from None
    except RecursionError:
        raise ValueError("%s is not JSON-serialisable: it nests too deeply, or holds itself"
                         % what) from None
    return text.encode("utf-8")


# Each octet of UTF-8 as itself, but those a JSON string escapes (as json does without
# ensure_ascii: '"', '\\' and the controls), which become a space.
_JSON_PLAIN = bytes(0x20 if octet < 0x20 or octet in b'"\\' else octet for octet in range(256))


def _json_string(text: str) -> bytes:
    """The JSON of a str, in UTF-8, as json encodes it. A device token needs no escape,
    as a rule, and is then quoted as it is, for a fraction of what json costs."""
    raw = text.encode("utf-8")
    if raw.translate(_JSON_PLAIN) == raw:  # (CPython gives back raw itself then)
        return b'"' + raw + b'"'
    return _JSON_ENCODE(text).encode("utf-8")


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
    target = "to"  # where one device token goes in a message
    refreshable = False
    signer: Optional[_Signer] = None  # every request has the same headers

    def __init__(self, server_key: str) -> None:
        self.fixed_headers = {"Authorization": "key=" + server_key,
                              "Content-Type": "application/json"}

    def prepare(self, message: object, validate_only: bool) -> Tuple[str, bytes, Tuple[str, ...]]:
        """Path, body and target tokens of a push; TypeError/ValueError for a bad message."""
        message = _check_legacy_message(message)
        if validate_only:
            message = dict(message, dry_run=True)
        body = _encode_json(message)
        _check_data_sizes(message, body)
        return "/fcm/send", body, _legacy_tokens(message)

    def headers(self) -> Tuple[Dict[str, str], str]:
        return self.fixed_headers, ""

    def project_path(self) -> str:
        raise ValueError("topic management needs the v1 API: create the client with credentials")


class _V1API:
    """The HTTP v1 API: ``POST /v1/projects/<p>/messages:send`` with an OAuth2 bearer token."""

    name = "v1"
    target = "token"

    fixed_headers: Dict[str, str] = {}  # the access token's come from the signer

    def __init__(self, credentials: _Credentials, project_id: Optional[str],
                 engine: _Engine) -> None:
        self._tokens = _TokenCache(credentials, engine)
        self._project_id = project_id
        self._project_path = ""
        self._send_path = ""  # the project path's messages:send
        self.refreshable = credentials.refreshable
        self.signer: Optional[_Signer] = self
        self._last_signed = self._signed("")  # what headers_now gave last, for its token

    def prepare(self, message: object, validate_only: bool) -> Tuple[str, bytes, Tuple[str, ...]]:
        checked = _check_message(message)
        body = _encode_json(checked)
        _check_data_sizes(checked, body)
        tail = b',"validate_only":true}' if validate_only else b',"validate_only":false}'
        if not self._send_path:
            self.project_path()  # finds the project, once (the threaded client may ask GCE)
        return self._send_path, b'{"message":' + body + tail, ()

    def headers(self) -> Tuple[Dict[str, str], str]:
        """The headers of a send, with the access token (fetched if need be: it may block)."""
        return self._signed(self._tokens.get())

    def headers_now(self) -> Optional[Tuple[Dict[str, str], str]]:
        """The headers of a send, or None while the access token must be fetched first.
        The same token gives the same headers (read only), made once."""
        token = self._tokens.current()
        if token is None:
            return None
        signed = self._last_signed
        if signed[1] != token:
            signed = self._last_signed = self._signed(token)
        return signed

    def token_request(self) -> _Exchange:
        request = self._tokens.credentials.token_request()
        assert request is not None, "headers_now gets a token that needs no request itself"
        return request

    def token_answered(
        self, outcome: Optional[Outcome]
    ) -> Union[Tuple[Dict[str, str], str], Error]:
        try:
            return self._signed(self._tokens.answered(outcome))
        except Error as exc:
            return exc

    @staticmethod
    def _signed(token: str) -> Tuple[Dict[str, str], str]:
        return {"Authorization": "Bearer " + token, "Content-Type": "application/json"}, token

    def project_path(self) -> str:
        """``/v1/projects/<id>``, the project found once: given, in the key, environment, GCE
        (the threaded client asks the metadata server here; the asyncio one before)."""
        if not self._project_path:
            self._found_project(self._known_project()
                                or self._tokens.credentials.find_project_id())
        return self._project_path

    def project_request(self) -> Optional[_Exchange]:
        """The request that finds the project id, when nothing given names it."""
        if self._project_path or self._known_project():
            return None
        return self._tokens.credentials.project_request()

    def project_answered(self, outcome: Outcome) -> None:
        self._found_project(self._tokens.credentials.project_from(outcome))

    def _known_project(self) -> Optional[str]:
        return (self._project_id or self._tokens.credentials.project_id
                or os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT"))

    def _found_project(self, project: Optional[str]) -> None:
        if not project:
            raise AuthError("no Firebase project id: pass project_id= or set GOOGLE_CLOUD_PROJECT")
        self._project_path = "/v1/projects/" + urllib.parse.quote(project, safe="")
        self._send_path = self._project_path + "/messages:send"

    def invalidate(self, token: str) -> None:
        self._tokens.invalidate(token)


# Client ######################################################################
# The public face: push one message, push many, manage topics; with threads or asyncio.

#: Messages in flight at once in push_many, by default.
DEFAULT_CONCURRENCY = 50

Item = TypeVar("Item")  # what the pairs of Outcomes hold with each outcome: a message, a token
_M = TypeVar("_M", bound=Union[Message, LegacyMessage])  # the messages of a push_many


# What stands for the device token in a push_multicast's message, encoded once.
_TOKEN_SLOT = "andpush-device-token"
_TOKEN_SLOT_JSON = b'"andpush-device-token"'


class _Multicast:
    """One push_multicast's message, checked and encoded once, with each device token
    placed into the bytes: the push to a token costs the JSON of the token, not of the
    message.

    The message goes through the API's ``prepare`` with a stand-in for the token: the
    token is the message's last field (push_multicast refuses a message with a target),
    so its JSON is the last string of the body, and what comes before and after it is
    the same for every token. That is done at the first push made (the project may be
    known only then); a message ``prepare`` refuses is refused again for each token, as
    a push of it would be. Whether the answer is per token (the legacy API's) is known
    then too: ``prepare`` gives the stand-in as a target token, or none (v1).
    """

    __slots__ = ("_api", "_message", "_exchange_of", "_path", "_head", "_tail", "_per_token")

    def __init__(self, api: Union[_LegacyAPI, _V1API], message: Dict[str, Any],
                 exchange_of: Callable[[str, bytes, Tuple[str, ...]], _Exchange]) -> None:
        self._api = api
        self._message = message
        self._exchange_of = exchange_of
        self._path = ""
        self._head = self._tail = b""
        self._per_token = False

    def exchange(self, token: object) -> _Exchange:
        """The exchange of the push to ``token`` (TypeError/ValueError for a bad one), as
        ``exchange_of`` makes it from the path, body and target tokens that ``prepare``
        gives for the message with that token."""
        token = _check_device_token(token)
        if not self._path:
            self._encode()
        body = self._head + _json_string(token) + self._tail
        # The legacy API answers for a device's token, not for a /topics/ name; v1 for none.
        tokens = _legacy_tokens({self._api.target: token}) if self._per_token else ()
        return self._exchange_of(self._path, body, tokens)

    def _encode(self) -> None:
        path, body, tokens = self._api.prepare(
            dict(self._message, **{self._api.target: _TOKEN_SLOT}), False)
        at = body.rindex(_TOKEN_SLOT_JSON)
        self._head, self._tail = body[:at], body[at + len(_TOKEN_SLOT_JSON):]
        self._per_token = bool(tokens)
        self._path = path


class _Requests:
    """What both clients share: the API, the route to FCM, and how each request is made
    and checked (TypeError/ValueError before any I/O)."""

    def __init__(self, api: Union[_LegacyAPI, _V1API], route: _Route, retry: _Retry) -> None:
        self.api = api
        self.route = route
        self._retry = retry

    def describe(self, client: object) -> str:
        return "<andpush.%s %s %r>" % (type(client).__name__, self.api.name, self.route)

    def exchange(self, message: object, validate_only: bool = False) -> _Exchange:
        """A push, checked and encoded (TypeError/ValueError for a bad message)."""
        return self._exchange_of(*self.api.prepare(message, validate_only))

    def _exchange_of(self, path: str, body: bytes,
                     device_tokens: Tuple[str, ...]) -> _Exchange:
        """The exchange of a push whose path and body are made (by ``prepare``): paced,
        signed by the API's signer or with its fixed headers. The arguments go by place,
        not by name, as a call by name costs a dict per push."""
        api = self.api
        return _Exchange(self.route, "POST", path, body, self._retry, api.signer,
                         api.fixed_headers, True, device_tokens)

    def push(self, message: object, validate_only: bool, timeout: Optional[float]) -> _Exchange:
        exchange = self.exchange(message, validate_only)
        if timeout is not None:
            _check_number("timeout", timeout, minimum=0, exclusive=True)
            exchange.timeout = float(timeout)
        return exchange

    def for_each(self, messages: object, concurrency: int) -> Callable[[Any], _Exchange]:
        """How push_many makes the push of one message (the arguments checked first)."""
        if isinstance(messages, dict):
            raise TypeError("push_many takes many messages, not one dict: push(message) sends "
                            "one, push_many([message]) a list of one")
        _check_number("concurrency", concurrency, minimum=1, integer=True)
        return self.exchange

    def to_each(self, message: Mapping[str, Any], tokens: object,
                concurrency: int) -> Callable[[Any], _Exchange]:
        """How push_multicast makes the push to one token (the arguments checked first)."""
        message = _check_dict(message)
        targets = sorted(set(message) & {"token", "topic", "condition", "to",
                                         "registration_ids", "tokens"})
        if targets:
            raise ValueError("push_multicast sends message to each token itself; leave %s out"
                             " of message" % " and ".join(repr(t) for t in targets))
        if isinstance(tokens, (str, bytes)):
            raise TypeError("tokens must be an iterable of str, not one %s"
                            % type(tokens).__name__)
        _check_number("concurrency", concurrency, minimum=1, integer=True)
        return _Multicast(self.api, message, self._exchange_of).exchange

    def topic_changes(self, method: str, tokens: Iterable[str],
                      topic: str) -> Tuple[List[str], Callable[[str], _Exchange]]:
        """The tokens (checked) and how to make the request that changes one's topics."""
        topic = _topic_name(topic, "topic")
        if isinstance(tokens, str):
            raise TypeError("tokens must be a list of str, not one str")
        tokens = [_check_device_token(token) for token in tokens]
        base = self.api.project_path() + "/registrations/"
        quoted_topic = urllib.parse.quote(topic, safe="")

        def manage(token: str) -> _Exchange:
            path = base + urllib.parse.quote(token, safe="") + "/topicSubscriptions"
            if method == "POST":
                path += "?topic_name=" + quoted_topic
            else:
                path += "/" + quoted_topic
            return _Exchange(self.route, method, path, b"{}" if method == "POST" else b"",
                             self._retry, signer=self.api.signer, paced=True)
        return tokens, manage


class Client:
    """A thread-safe FCM client: every request goes through one engine that keeps the
    connections alive for the client's life (HTTP/2 ones shared by all callers).

    Make one with ``andpush.new(...)``, share it between threads, and close it (or use
    ``with``) when done. In a forked child it opens connections of its own.
    """

    def __init__(self, api: Union[_LegacyAPI, _V1API], driver: _ThreadDriver, route: _Route,
                 retry: _Retry) -> None:
        self._requests = _Requests(api, route, retry)
        self._driver = driver

    def push(self, message: Union[Message, LegacyMessage], *, validate_only: bool = False,
             timeout: Optional[float] = None) -> Response:
        """Send one message; return the 2xx Response or raise an andpush.Error.

        ``validate_only`` asks FCM to check the message without delivering it;
        ``timeout`` replaces the client's read timeout (seconds to wait for each answer)
        for this call. With the legacy API a 200 whose results hold per-token errors is a
        success: see ``Response.errors`` and ``Response.canonical_tokens``.
        """
        outcome = self._driver.run(self._requests.push(message, validate_only, timeout))
        if isinstance(outcome, Response):
            return outcome
        raise outcome

    # The overloads give the pairs the type of the messages (a list of Message gives
    # Outcomes[Message]); the second and third give a literal in the call its type (mypy
    # takes no context from a TypeVar), which mypy thinks they never do.
    @overload
    def push_many(self, messages: Iterable[_M], *, concurrency: int = ...,
                  progress: Optional[Callable[[int, int], None]] = ...) -> "Outcomes[_M]": ...

    @overload
    def push_many(  # type: ignore[overload-overlap, overload-cannot-match]
            self, messages: Iterable[Message], *, concurrency: int = ...,
            progress: Optional[Callable[[int, int], None]] = ...) -> "Outcomes[Message]": ...

    @overload
    def push_many(  # type: ignore[overload-cannot-match]
            self, messages: Iterable[LegacyMessage], *, concurrency: int = ...,
            progress: Optional[Callable[[int, int], None]] = ...,
    ) -> "Outcomes[LegacyMessage]": ...

    def push_many(
        self,
        messages: Iterable[Any],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> "Outcomes[Any]":
        """Send many messages at once; yield a ``(message, outcome)`` pair per message, in
        input order: ``message`` is the very object taken from ``messages``.

        An outcome is the Response, or the exception ``push()`` would have raised (an
        andpush.Error, or the TypeError/ValueError of a bad message, which is not sent).
        ``messages`` is read lazily, on a thread of its own, so the pairs always cover the
        messages read so far, a prefix of the input.

        Stopping early sends nothing more and keeps the record of what was sent.
        ``close()`` on the Outcomes stops reading and returns the pairs not yet yielded,
        once the messages on the wire are answered (each within the read timeout);
        ``stop()`` stops reading and lets the iteration go on to the last of them. Either
        way a message read and not yet sent ends "not sent" (a NetworkError with
        ``may_have_been_delivered`` False), and one waiting for a retry with its last
        error. After an exception in the caller's for loop (Ctrl-C too), either still
        gives the rest. Dropping the Outcomes does the same, without waiting; its
        ``success_count`` and ``failure_count`` count the pairs given so far.

        Over HTTP/2 the messages share the client's connections, up to each server's
        stream limit. ``progress(done, failed)`` is called from the thread running
        andpush's I/O (its own, or one waiting in ``push()``).
        """
        make = self._requests.for_each(messages, concurrency)
        return self._batch(messages, make, concurrency, progress)

    def push_multicast(
        self,
        message: Union[Message, LegacyMessage],
        tokens: Iterable[str],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> "Outcomes[str]":
        """Send ``message`` (without a target) to each of ``tokens``, one request each
        through push_many: firebase-admin's ``send_each_for_multicast``. Yields a
        ``(token, outcome)`` pair per token, in order, with push_many's ``close()`` and
        ``stop()``; a token that is not a str, or is empty, gets push()'s TypeError or
        ValueError, not sent.
        """
        make = self._requests.to_each(message, tokens, concurrency)
        return self._batch(tokens, make, concurrency, progress)

    def subscribe(self, tokens: Iterable[str], topic: str) -> List[Outcome]:
        """Subscribe each token to ``topic``; one outcome per token, in order."""
        return self._manage_topic("POST", tokens, topic)

    def unsubscribe(self, tokens: Iterable[str], topic: str) -> List[Outcome]:
        """Unsubscribe each token from ``topic``; one outcome per token, in order."""
        return self._manage_topic("DELETE", tokens, topic)

    def close(self) -> None:
        """Close the connections; the client cannot send afterwards."""
        self._driver.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return self._requests.describe(self)

    def _manage_topic(self, method: str, tokens: Iterable[str], topic: str) -> List[Outcome]:
        checked, manage = self._requests.topic_changes(method, tokens, topic)
        concurrency = min(len(checked), DEFAULT_CONCURRENCY) or 1
        return [_already_subscribed(outcome)
                for _, outcome in self._batch(checked, manage, concurrency, None)]

    def _batch(
        self,
        items: Iterable[Any],
        make: Callable[[Any], _Exchange],
        concurrency: int,
        progress: Optional[Callable[[int, int], None]],
    ) -> "Outcomes[Any]":
        batch = _ThreadBatch(items, make, self._requests.route, concurrency, progress)
        self._driver.add_batch(batch)
        threading.Thread(target=batch.feed, name="andpush-push_many", daemon=True).start()
        return Outcomes(batch)


def _already_subscribed(outcome: Outcome) -> Outcome:
    """A topic change that was already in place is a success, not an error."""
    if isinstance(outcome, HTTPError) and (
            outcome.error_code == "ALREADY_EXISTS" or outcome.status_code == 409):
        return outcome.response
    return outcome


class Outcomes(Generic[Item]):
    """What push_many and push_multicast return: a ``(message, outcome)`` pair per message
    (``(token, outcome)`` for push_multicast), in input order, as the engine ends them.

    ``close()`` stops reading the input and returns the pairs not yet yielded, once those
    on the wire are answered; ``stop()`` stops reading and lets the iteration go on to the
    last of them; neither sends anything more (what was read and not sent ends "not
    sent"). Dropping it does the same, without waiting: nobody is left to receive those
    outcomes. ``success_count`` and
    ``failure_count`` count the pairs given so far, by the loop and by ``close()``: once
    both are done, every message's.
    """

    __slots__ = ("_batch", "_counts")

    def __init__(self, batch: _ThreadBatch) -> None:
        self._batch = batch
        self._counts = [0, 0]  # the successes and the failures among the pairs given

    def __iter__(self) -> "Outcomes[Item]":
        return self

    def __next__(self) -> Tuple[Item, Outcome]:
        pair = self._batch.next_pair()
        self._counts[_is_failure(pair[1])] += 1
        return pair

    @property
    def success_count(self) -> int:
        """Pairs given whose outcome is a Response that refused no token."""
        return self._counts[0]

    @property
    def failure_count(self) -> int:
        """Pairs given whose outcome is an exception, or a legacy refusal of the token."""
        return self._counts[1]

    @property
    def taken(self) -> int:
        """How many messages were read from the input: each has, or will have, a pair."""
        return self._batch.taken()

    def stop(self) -> None:
        """Read and send no more messages; the iteration ends after the last one read."""
        self._batch.stop()

    def close(self) -> List[Tuple[Item, Outcome]]:
        """Read and send no more messages, and return the pairs not yet yielded, one per
        message read: those on the wire once answered (within the read timeout), the
        others "not sent"."""
        self._batch.stop()
        return _counted(self._batch.rest(), self._counts)

    def __del__(self) -> None:
        self._batch.discard()


def _counted(pairs: List[Tuple[Any, Outcome]], counts: List[int]) -> List[Tuple[Any, Outcome]]:
    """``pairs``, counted into an Outcomes' ``counts`` (successes, failures)."""
    for _, outcome in pairs:
        counts[_is_failure(outcome)] += 1
    return pairs


class AsyncClient:
    """An FCM client for asyncio: the same requests, retries and outcomes as Client,
    over asyncio connections kept alive for the client's life (HTTP/2 ones shared by
    every task), with no thread.

    Make one with ``andpush.new_async(...)``; it belongs to the event loop it is first
    used on. Close it with ``await client.aclose()`` or ``async with``. A cancelled push
    that was already sent may have been delivered.
    """

    def __init__(self, api: Union[_LegacyAPI, _V1API], driver: _AsyncDriver, route: _Route,
                 retry: _Retry) -> None:
        self._requests = _Requests(api, route, retry)
        self._driver = driver
        self._project_lock: Optional["asyncio.Lock"] = None

    async def push(self, message: Union[Message, LegacyMessage], *, validate_only: bool = False,
                   timeout: Optional[float] = None) -> Response:
        """Send one message; return the 2xx Response or raise an andpush.Error, as
        ``Client.push``. Cancelled before it was sent, nothing is sent; after, its
        request is abandoned (the message may have been delivered)."""
        if not self._knows_project():
            await self._find_project()
        exchange = self._requests.push(message, validate_only, timeout)
        outcome = await self._driver.run(exchange)
        if isinstance(outcome, Response):
            return outcome
        raise outcome

    # The overloads of Client.push_many, for the same reasons.
    @overload
    def push_many(
            self, messages: Union[Iterable[_M], AsyncIterable[_M]], *, concurrency: int = ...,
            progress: Optional[Callable[[int, int], None]] = ...) -> "AsyncOutcomes[_M]": ...

    @overload
    def push_many(  # type: ignore[overload-overlap, overload-cannot-match]
            self, messages: Union[Iterable[Message], AsyncIterable[Message]], *,
            concurrency: int = ..., progress: Optional[Callable[[int, int], None]] = ...,
    ) -> "AsyncOutcomes[Message]": ...

    @overload
    def push_many(  # type: ignore[overload-cannot-match]
            self, messages: Union[Iterable[LegacyMessage], AsyncIterable[LegacyMessage]], *,
            concurrency: int = ..., progress: Optional[Callable[[int, int], None]] = ...,
    ) -> "AsyncOutcomes[LegacyMessage]": ...

    def push_many(
        self,
        messages: Union[Iterable[Any], AsyncIterable[Any]],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> "AsyncOutcomes[Any]":
        """Send many messages at once; an async iterator of ``(message, outcome)`` pairs,
        one per message in input order, as ``Client.push_many``.

        ``messages`` is an iterable (read in the event loop, so it must not block) or an
        async iterable. ``await outcomes.aclose()`` stops reading and returns the pairs
        not yet yielded, once those on the wire are answered; ``stop()`` stops reading
        and lets the iteration go on to the last of them; neither sends anything more.
        Cancelling the task that iterates, or dropping the iterator, does the same.
        """
        make = self._requests.for_each(messages, concurrency)
        return self._batch(messages, make, concurrency, progress)

    def push_multicast(
        self,
        message: Union[Message, LegacyMessage],
        tokens: Union[Iterable[str], AsyncIterable[str]],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> "AsyncOutcomes[str]":
        """Send ``message`` to each of ``tokens``, as ``Client.push_multicast``: an async
        iterator of ``(token, outcome)`` pairs with push_many's ``aclose()`` and ``stop()``."""
        make = self._requests.to_each(message, tokens, concurrency)
        return self._batch(tokens, make, concurrency, progress)

    async def subscribe(self, tokens: Iterable[str], topic: str) -> List[Outcome]:
        """Subscribe each token to ``topic``; one outcome per token, in order."""
        return await self._manage_topic("POST", tokens, topic)

    async def unsubscribe(self, tokens: Iterable[str], topic: str) -> List[Outcome]:
        """Unsubscribe each token from ``topic``; one outcome per token, in order."""
        return await self._manage_topic("DELETE", tokens, topic)

    async def aclose(self) -> None:
        """Close the connections; requests under way end with a NetworkError, and the
        client cannot send afterwards."""
        await self._driver.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return self._requests.describe(self)

    def _knows_project(self) -> bool:
        api = self._requests.api
        return isinstance(api, _LegacyAPI) or api.project_request() is None

    async def _find_project(self) -> None:
        """Ask the metadata server for the project id, once however many tasks need it,
        when nothing given names it (the threaded client asks it in project_path)."""
        import asyncio

        self._driver.bind()
        if self._project_lock is None:
            self._project_lock = asyncio.Lock()
        async with self._project_lock:
            api = self._requests.api
            request = api.project_request() if isinstance(api, _V1API) else None
            if request is not None:
                assert isinstance(api, _V1API)
                api.project_answered(await self._driver.run(request))

    async def _manage_topic(self, method: str, tokens: Iterable[str],
                            topic: str) -> List[Outcome]:
        if not self._knows_project():
            await self._find_project()
        checked, manage = self._requests.topic_changes(method, tokens, topic)
        concurrency = min(len(checked), DEFAULT_CONCURRENCY) or 1
        return [_already_subscribed(outcome)
                async for _, outcome in self._batch(checked, manage, concurrency, None)]

    def _batch(
        self,
        items: Union[Iterable[Any], AsyncIterable[Any]],
        make: Callable[[Any], _Exchange],
        concurrency: int,
        progress: Optional[Callable[[int, int], None]],
    ) -> "AsyncOutcomes[Any]":
        event_loop = self._driver.bind()
        batch = _AsyncBatch(items, make, self._requests.route, concurrency, progress,
                            self._find_project)
        self._driver.add_batch(batch)
        batch.start(event_loop)
        return AsyncOutcomes(batch)


class AsyncOutcomes(Generic[Item]):
    """What AsyncClient.push_many and push_multicast return: ``(message, outcome)`` pairs in
    input order, with the counts of Outcomes.

    ``await aclose()`` stops reading the input and returns the pairs not yet yielded,
    once those on the wire are answered; ``stop()`` stops reading and lets the iteration
    go on to the last of them; neither sends anything more (what was read and not sent
    ends "not sent"). Cancelling the consumer, or dropping the iterator, does the same.
    """

    __slots__ = ("_batch", "_counts")

    def __init__(self, batch: _AsyncBatch) -> None:
        self._batch = batch
        self._counts = [0, 0]  # the successes and the failures among the pairs given

    def __aiter__(self) -> "AsyncOutcomes[Item]":
        return self

    async def __anext__(self) -> Tuple[Item, Outcome]:
        pair = await self._batch.next_pair()
        self._counts[_is_failure(pair[1])] += 1
        return pair

    @property
    def success_count(self) -> int:
        """Pairs given whose outcome is a Response that refused no token."""
        return self._counts[0]

    @property
    def failure_count(self) -> int:
        """Pairs given whose outcome is an exception, or a legacy refusal of the token."""
        return self._counts[1]

    @property
    def taken(self) -> int:
        """How many messages were read from the input: each has, or will have, a pair."""
        return self._batch.taken()

    def stop(self) -> None:
        """Read and send no more messages; the iteration ends after the last one read."""
        self._batch.stop()

    async def aclose(self) -> List[Tuple[Item, Outcome]]:
        """Read and send no more messages, and return the pairs not yet yielded, one per
        message read: those on the wire once answered (within the read timeout), the
        others "not sent"."""
        self._batch.stop()
        return _counted(await self._batch.rest(), self._counts)

    def __del__(self) -> None:
        self._batch.discard()


def new(
    server_key: Optional[str] = None,
    *,
    credentials: Union[None, str, "os.PathLike[str]", Dict[str, Any]] = None,
    project_id: Optional[str] = None,
    access_token: Union[None, str, Callable[[], str]] = None,
    endpoint: str = DEFAULT_ENDPOINT,
    ssl_context: Optional[ssl.SSLContext] = None,
    timeout: Union[None, float, Tuple[float, float]] = None,
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

    ``timeout`` (seconds) bounds connecting and waiting for each answer, or is a
    ``(connect, read)`` pair as in requests; ``proxy`` is an ``http://host:port`` to
    tunnel through (``""``: none, whatever HTTPS_PROXY says); ``rate_limit`` is the most
    messages a second the client sends. With ``http2`` (the default) the
    client offers HTTP/2 by ALPN (on ``ssl_context`` too) and multiplexes every request
    over few connections when the server accepts; ``http2=False`` keeps to HTTP/1.1.
    """
    driver, api, route, retry = _setup(_ThreadDriver, dict(locals()))
    return Client(api, driver, route, retry)

build = new


def new_async(
    server_key: Optional[str] = None,
    *,
    credentials: Union[None, str, "os.PathLike[str]", Dict[str, Any]] = None,
    project_id: Optional[str] = None,
    access_token: Union[None, str, Callable[[], str]] = None,
    endpoint: str = DEFAULT_ENDPOINT,
    ssl_context: Optional[ssl.SSLContext] = None,
    timeout: Union[None, float, Tuple[float, float]] = None,
    pool_size: int = DEFAULT_POOL_SIZE,
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
    proxy: Optional[str] = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
    rate_limit: Optional[float] = None,
    http2: bool = True,
) -> AsyncClient:
    """Create an asyncio client, with exactly the options of ``new``. It may be made
    outside the event loop; it belongs to the loop it is first used on."""
    driver, api, route, retry = _setup(_AsyncDriver, dict(locals()))
    return AsyncClient(api, driver, route, retry)


_Driver = TypeVar("_Driver", _ThreadDriver, _AsyncDriver)


def _setup(
    driver: Type[_Driver], options: Dict[str, Any]
) -> Tuple[_Driver, Union[_LegacyAPI, _V1API], _Route, _Retry]:
    """The engine, API, route and retry of a client made with ``new``'s ``options``."""
    ssl_context = options["ssl_context"]
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise TypeError("ssl_context must be an ssl.SSLContext")
    connect_timeout, read_timeout = _timeouts(options["timeout"])
    _check_number("pool_size", options["pool_size"], minimum=1, integer=True)
    _check_number("keep_alive_timeout", options["keep_alive_timeout"], minimum=0)
    _check_number("max_retries", options["max_retries"], minimum=0, integer=True)
    _check_number("backoff_factor", options["backoff_factor"], minimum=0)
    if options["rate_limit"] is not None:
        _check_number("rate_limit", options["rate_limit"], minimum=0, exclusive=True)
    endpoint = options["endpoint"]
    if _Origin(endpoint, None).scheme != "https":
        raise ValueError("endpoint must use https://, got %r" % endpoint)
    context = ssl_context or ssl.create_default_context()
    if options["http2"]:
        context.set_alpn_protocols(["h2", "http/1.1"])
    engine = driver(context, connect_timeout, read_timeout, options["keep_alive_timeout"],
                  options["proxy"], _Policy(options["rate_limit"]))
    api = _api(options["server_key"], options["credentials"], options["project_id"],
               options["access_token"], engine)
    retry = _Retry(options["max_retries"], options["backoff_factor"],
                   may_refresh=api.refreshable)
    return engine, api, engine.route(endpoint, options["pool_size"]), retry


def _api(
    server_key: Optional[str],
    credentials: object,
    project_id: Optional[str],
    access_token: Union[None, str, Callable[[], str]],
    engine: _Engine,
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
        return _V1API(_StaticToken(access_token, project_id), project_id, engine)
    if credentials is not None:
        return _V1API(_load_credentials(credentials, engine), project_id, engine)
    return _V1API(_application_default_credentials(engine), project_id, engine)


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


def _timeouts(timeout: Union[None, float, Tuple[float, float]]) -> Tuple[float, float]:
    """Seconds to connect and to wait for an answer: one number for both, or a pair."""
    if timeout is None:
        return DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT
    if isinstance(timeout, tuple):
        if len(timeout) != 2:
            raise ValueError("timeout must be a number or a (connect, read) pair, got %r"
                             % (timeout,))
        _check_number("timeout's connect", timeout[0], minimum=0, exclusive=True)
        _check_number("timeout's read", timeout[1], minimum=0, exclusive=True)
        return float(timeout[0]), float(timeout[1])
    _check_number("timeout", timeout, minimum=0, exclusive=True)
    return float(timeout), float(timeout)


# Fake FCM ####################################################################
# A local FCM for tests, started in one line: v1 and legacy sends checked as FCM checks them,
# topic management, and Google's token endpoint, over HTTP/1.1 and HTTP/2 on one port (TLS
# with ALPN, or plain HTTP), with failures a test scripts and a bounded record of what came.
# The protocol code takes bytes and gives requests and bytes; the fake's one thread moves
# them, with a selector over every connection and a heap of timers for late answers.

# The fake's certificate for 127.0.0.1 and localhost, signed by its own CA, made once with
# openssl (ECDSA P-256, valid 2000 to 2125) in the shape Python 3.13's strict checks accept.
# The keys are public: anyone can pose as the fake with them, which is why only the context
# FakeFCM.ssl_context() makes (and FakeFCM.ca_file, for other programs) trusts that CA.
_FAKE_CA_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBbzCCARWgAwIBAgIBATAKBggqhkjOPQQDAjAeMRwwGgYDVQQDDBNhbmRwdXNo
IGZha2UgRkNNIENBMCAXDTAwMDEwMTAwMDAwMFoYDzIxMjUxMjMxMjM1OTU5WjAe
MRwwGgYDVQQDDBNhbmRwdXNoIGZha2UgRkNNIENBMFkwEwYHKoZIzj0CAQYIKoZI
zj0DAQcDQgAEBASdZ+v6vTnRcU4JjBnHPl7Vw9SCd06wjUXRju7Jur68HToB2bIH
I9K/WgX17BmrvvtTlGg5Jk621INioPuKJaNCMEAwDwYDVR0TAQH/BAUwAwEB/zAO
BgNVHQ8BAf8EBAMCAQYwHQYDVR0OBBYEFBx5l7GTTzA4lxF8tpFpPTUBpa5KMAoG
CCqGSM49BAMCA0gAMEUCICojMHT5kAFy2zZeNGIOyIPT7GVBL1pkM2E65XKjN3Xo
AiEAxbpV7gWk3YScS43n4w9BfAJdhJVpr/AYLrzJmV2t/vU=
-----END CERTIFICATE-----
"""
_FAKE_CERT_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBtDCCAVmgAwIBAgIBAjAKBggqhkjOPQQDAjAeMRwwGgYDVQQDDBNhbmRwdXNo
IGZha2UgRkNNIENBMCAXDTAwMDEwMTAwMDAwMFoYDzIxMjUxMjMxMjM1OTU5WjAU
MRIwEAYDVQQDDAlsb2NhbGhvc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAQf
nk003Q1JrNv74oDZHQHMTLCMZt4v3ZH/eiXhmL20No1qWgpbkS/uljWWUlgvOPEm
Suk6Wles0GgFz6BmQfjZo4GPMIGMMBoGA1UdEQQTMBGCCWxvY2FsaG9zdIcEfwAA
ATAJBgNVHRMEAjAAMA4GA1UdDwEB/wQEAwIHgDATBgNVHSUEDDAKBggrBgEFBQcD
ATAdBgNVHQ4EFgQU06gzJk+bIKrkz+BQqYhI/8sExR8wHwYDVR0jBBgwFoAUHHmX
sZNPMDiXEXy2kWk9NQGlrkowCgYIKoZIzj0EAwIDSQAwRgIhANpW+N5SIwUR/quc
r+sf/3Eq0+FKfuxNJ/1nAvjRNfbSAiEAweJuwQSkc2kvIeDVysV3CQyvK0J0XOhK
U7xGB4I6Kd4=
-----END CERTIFICATE-----
"""
_FAKE_CERT_KEY_PEM = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgYMUU8qkpqEb1Mu/x
QHj8OPV8lvD/FhlMqOCA0TPxzP+hRANCAAQfnk003Q1JrNv74oDZHQHMTLCMZt4v
3ZH/eiXhmL20No1qWgpbkS/uljWWUlgvOPEmSuk6Wles0GgFz6BmQfjZ
-----END PRIVATE KEY-----
"""
# The private key of the fake's service account (2048-bit RSA, made once with openssl): as
# public as the one above. Its token endpoint checks JWT signatures with the public half.
_FAKE_ACCOUNT_KEY_PEM = """\
-----BEGIN PRIVATE KEY-----
MIIEvwIBADANBgkqhkiG9w0BAQEFAASCBKkwggSlAgEAAoIBAQCqIUkx+KJh/6dP
Euoj/HcNw1OQLxJWf7Po95awzCuvUFzGq7o56K9q8qHvtMvC8p6y3bvMODx/KQu0
m2ZgQh+kSHahzWWqpAAxMtjA49ngxZUtiQHA672MaSrl/mC8NFVJtVT2LqntNlAc
qbKaFToCOL+pILbt+zz9R1/4gAkVo6h6ow79V0+5Ww/iDcYQyFZE/HqB5+DdYVZE
LiTzl1M+0/n7lpszxmBxOLcw4FANycFy2xtj1dRJLzg8T6mUwMGPTuODNj0pDcaI
n70RYtqaizuPhzunxnD6raHP/thqE2Ml+r6RDWE7rrWxah5mLu6oUwRu91oWYYW9
KzFy/msfAgMBAAECggEAEIYgHLux7EPChWJO0UT1otjfiZSdoT7qnSXjAg2Q8Dul
by4BurS+lbjpzb7cWMIFp1WOJm7Cpw64ONTF5wzoRtjU6n015fkWan2uSMafBEvp
SjcEfEji3zuqgEeQyYBpu9MVZL3LU/AfbGrdBazD6bBT75wIuGkoMM9yyYK7nyX4
Erry3WPhVBKRfv40hDj7T3LkQj3L9hnIoSPVrWC384kc0am6c9shu2u1U2URyCIM
KNINS6hMWwDHtIg8dTP8BfjhO91lzmhd0xWQea3duCHt5RCuNETSLnhYzwFmmEUT
WJfpxyNAgEtUrGp7cv3nrr9FCAwA0tutdHAJkgkMkQKBgQDVCia1fHdkqoBS4KUN
9ZWeigKpo+djqO4HXAPbUjYbbj/QJAmH4jSYfytHbl1Nkx3dpUegfKmzIYShT4TQ
qfSw6Y/+O8JbHxMLRF8V4VJbwuW5kuizzY2JVTDCcKLmEb6wVU/U5WjKk5pMkWeR
TT48DoDT/RJ0E6r3zLVqyXgRDwKBgQDMb/18aT+wTzQWh0dhzRtWbfpxZ39Gwf32
eXdnsWDweUp7VTLMIBDQdBum2roseIO7gHYnBhu9eXTWeRhtqX5NZw/LQ6eh+K2/
s1wByxNCLnio1WljRKJc1YwWgFVlJxbMWc4HP7JLEqoSRbM48jppDEiXkT4ir2Oo
Dmknv+vk8QKBgQCHwg9Gyck/ohNiPPuReLVesS3fMq6KaKU+lVlz0uDd/BS4K67T
I8hGgYtv2pmkjKKUkvWhBLATkcF2FjlZy2Q9tKjo5uYEsTmujWRWih60kO9ZoY+e
vNd784i9748vM5Gjxsm3rnVn2kWSk3o/Msz88nUQIg43YC0r+gyFv1s+6wKBgQDK
ID+jbfwGOYjqbT3qOHw66+mdjhKMxuhtdJLV9s49c+5sGkRrBZkaQHHGeqNvrIey
LsSiuKtcnmUiWAALDHVP2gIHmhB3WAORcagaLcoQuRma88WK3CUbXBdxd9j2dbtY
t8G38QY6q21zO26DcxrFGdv73yJr8LS7R+Q35M06QQKBgQCeV8CDT3R1zWIWpjLn
T/zpRGc9itxv6TfC361UKhCTTZC1WCTiMc9xT1SKvJisfhNq5LEnquqK8xL8dE0K
OfyHHq+a2cvXxwx67PT9iBVh6iTyt9ybN1ylyFgqmcdki5KUzFyvkPpboafLGy5q
E0BcxHSEo2itmcKr7LPD7yJlIQ==
-----END PRIVATE KEY-----
"""
_FAKE_KEY_ID = "fake-key-1"
_FAKE_PROJECT = "fake-project"
_FAKE_ACCESS_TOKEN = "fake-access-token"  # taken without an OAuth2 round trip (curl)
_FAKE_SERVER_KEY = "fake-server-key"
_FAKE_PROJECT_ID = r"[a-z][a-z0-9\-]{2,61}[a-z0-9]\Z"  # Google's rule, a little looser
_FAKE_RECORDED = 10000       # messages a FakeFCM remembers by default: the newest ones
_FAKE_STREAMS = 100          # HTTP/2 streams at once per connection, as Google's front end
_FAKE_IDLE_TIMEOUT = 240.0   # seconds an idle connection is kept, as Google's (about 4 min)
_FAKE_TOKEN_LIFETIME = 3600  # seconds an access token the fake issues is good for
_FAKE_CLOCK_SKEW = 60        # seconds a JWT's iat may be ahead of the fake's clock
_FAKE_MAX_BODY = 1 << 20     # bytes of a request body it reads (FCM takes far less)
_FAKE_WINDOW = 1 << 20       # bytes an HTTP/2 client may send ahead, per stream and in all
_FAKE_LINGER = 1.0           # seconds a closed connection is read from (so no RST cuts the
                             # last answer) or waits for its answer to be taken
_FAKE_SCAN = 1.0             # seconds between two looks for idle connections, at most
_SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
_FAKE_MESSAGE_SUFFIX = "31bd1c9631bd1c96"  # legacy message ids look like "0:<number>%<hex>"
_FAKE_MULTICAST_BASE = 6000000000000000000  # legacy multicast ids are large positive ints
_JOIN_WAIT = 5.0             # seconds close() waits for the fake's thread
_SCOPE_CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"  # google-auth's
_JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
_JSON_TYPE = "application/json; charset=UTF-8"
_TEXT_TYPE = "text/plain; charset=UTF-8"
_MAX_CONDITION_TOPICS = 5
_CONDITION_PART = r"\s*(?:(&&|\|\||!|\(|\))|(['\"])([a-zA-Z0-9\-_.~%]{1,900})\2\s+in\s+topics\b)"
_REGISTRATION = r"/v1/projects/([^/]+)/registrations/([^/]+)/topicSubscriptions(?:/([^/]+))?\Z"
_V1_REQUEST_FIELDS = frozenset(("message", "validate_only", "validateOnly"))

# FCM's answers for each error a test scripts: HTTP status, canonical status, whether the
# FcmError detail carries the code, and FCM's message.
_FAKE_ERRORS = {
    "INVALID_ARGUMENT": (400, "INVALID_ARGUMENT", True, "Request contains an invalid argument."),
    "UNREGISTERED": (404, "NOT_FOUND", True, "Requested entity was not found."),
    "SENDER_ID_MISMATCH": (403, "PERMISSION_DENIED", True, "SenderId mismatch"),
    "QUOTA_EXCEEDED": (429, "RESOURCE_EXHAUSTED", True, "Quota exceeded for sending messages."),
    "UNAVAILABLE": (503, "UNAVAILABLE", True, "The service is currently unavailable."),
    "INTERNAL": (500, "INTERNAL", True, "Internal error encountered."),
    "THIRD_PARTY_AUTH_ERROR": (401, "UNAUTHENTICATED", True,
                               "Auth error from APNS or Web Push Service"),
    "UNAUTHENTICATED": (401, "UNAUTHENTICATED", False,
                        "Request had invalid authentication credentials. Expected OAuth 2 "
                        "access token, login cookie or other valid authentication credential."),
    "PERMISSION_DENIED": (403, "PERMISSION_DENIED", False,
                          "Permission 'cloudmessaging.messages.create' denied on resource."),
    "NOT_FOUND": (404, "NOT_FOUND", False, "Requested entity was not found."),
    "ALREADY_EXISTS": (409, "ALREADY_EXISTS", False, "Requested entity already exists"),
}


class _FakeRequest:
    """One request as a FakeFCM read it: ``headers`` with lower-case names (repeats joined
    with ", "), ``stream`` its HTTP/2 stream (0 over HTTP/1.1)."""

    __slots__ = ("method", "path", "headers", "body", "protocol", "connection", "stream")

    def __init__(self, method: str, path: str, headers: Dict[str, str], body: bytes,
                 protocol: str, connection: int, stream: int = 0) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.protocol = protocol
        self.connection = connection
        self.stream = stream

    def __repr__(self) -> str:
        return "<request %s %s over %s, connection %d>" % (
            self.method, self.path.partition("?")[0], self.protocol, self.connection)


class _FakeAnswer:
    """What the fake answers a request: status, headers, body, and when: ``delay``
    seconds later (inf: never), or not at all with the connection ``dropped``."""

    __slots__ = ("status", "headers", "body", "delay", "dropped")

    def __init__(self, status: int, headers: Tuple[Tuple[str, str], ...], body: bytes,
                 delay: float = 0.0, dropped: bool = False) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.delay = delay
        self.dropped = dropped


_JSON_HEADERS = (("content-type", _JSON_TYPE),)
_TEXT_HEADERS = (("content-type", _TEXT_TYPE),)


def _json_answer(status: int, value: object, headers: Tuple[Tuple[str, str], ...] = ()
                 ) -> _FakeAnswer:
    return _FakeAnswer(status, _JSON_HEADERS + headers, _JSON_ENCODE(value).encode("utf-8"))


def _text_answer(status: int, text: str) -> _FakeAnswer:
    return _FakeAnswer(status, _TEXT_HEADERS, text.encode("utf-8"))


def _fcm_error(code: str, message: str = "", retry_after: Optional[float] = None
               ) -> _FakeAnswer:
    """FCM's error envelope for ``code`` (a key of _FAKE_ERRORS), as the v1 API sends it."""
    status, state, detailed, default = _FAKE_ERRORS[code]
    error: Dict[str, Any] = {"code": status, "message": message or default, "status": state}
    if detailed:
        error["details"] = [{"@type": _FCM_ERROR_TYPE, "errorCode": code}]
    headers = () if retry_after is None else (("retry-after", "%g" % retry_after),)
    return _json_answer(status, {"error": error}, headers)


# HTTP/1.1, the server's side ---------------------------------------------------------

class _FakeH1:
    """The server side of one HTTP/1.1 connection, without a socket.

    ``receive`` takes the bytes read and returns the request they complete, if any;
    ``answer`` queues an answer in ``outgoing`` and returns the next request, if the bytes
    already read hold one: requests are read one at a time, and each is answered before
    the next is read, as a client that pipelines expects. ``ended``: close once
    ``outgoing`` is written (the client asked, or its request was malformed).
    """

    protocol = "HTTP/1.1"

    def __init__(self, connection: int) -> None:
        self.connection = connection
        self.outgoing = bytearray()
        self.ended = False
        self.waiting = False       # a request was read and is not answered yet
        self._buffer = bytearray()
        self._keep = True          # the request being answered lets the connection stay
        self._continued = False    # "100 Continue" sent for the request being read

    @property
    def idle(self) -> bool:
        """Whether no request is under way: none waits for its answer, none is half read."""
        return not self.waiting and not self._buffer

    def receive(self, data: bytes) -> List[_FakeRequest]:
        self._buffer += data
        return self._next()

    def answer(self, request: _FakeRequest, status: int, headers: Iterable[Tuple[str, str]],
               body: bytes) -> List[_FakeRequest]:
        if not self.waiting or self.ended:
            return []
        self.waiting = False
        lines = ["HTTP/1.1 %d %s" % (status, _phrase(status))]
        lines.extend("%s: %s" % field for field in headers)
        lines.append("Content-Length: %d" % len(body))
        if not self._keep:
            lines.append("Connection: close")
            self.ended = True
        self.outgoing += ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        return self._next()

    def _next(self) -> List[_FakeRequest]:
        if self.waiting or self.ended:
            return []
        try:
            request = self._parse()
        except _ProtocolError as exc:
            self.waiting, self._keep = True, False
            self.answer(_FakeRequest("", "", {}, b"", self.protocol, self.connection),
                        400, _TEXT_HEADERS, ("fake FCM: %s\n" % exc).encode("utf-8"))
            return []
        if request is not None:
            self.waiting = True
            return [request]
        return []

    def _parse(self) -> Optional[_FakeRequest]:
        """The request at the start of the buffer, once whole (it is then consumed)."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n", 0, _MAX_HEAD)
        if end < 0:
            if len(buffer) >= _MAX_HEAD:
                raise _ProtocolError("the request head exceeds %d bytes" % _MAX_HEAD)
            return None
        lines = buffer[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
            raise _ProtocolError("a malformed request line")
        headers = _parse_header_lines(lines[1:])
        if "transfer-encoding" in headers:
            raise _ProtocolError("a chunked request: send Content-Length instead")
        length = headers.get("content-length", "0")
        if not _is_digits(length) or len(length) > 9 or int(length) > _FAKE_MAX_BODY:
            raise _ProtocolError("a Content-Length that is not 0 to %d" % _FAKE_MAX_BODY)
        start = end + 4
        if len(buffer) < start + int(length):
            if headers.get("expect", "").lower() == "100-continue" and not self._continued:
                self._continued = True
                self.outgoing += b"HTTP/1.1 100 Continue\r\n\r\n"
            return None
        body = bytes(buffer[start:start + int(length)])
        del buffer[:start + int(length)]
        self._continued = False
        connection = headers.get("connection", "").lower()
        self._keep = "close" not in connection and (
            parts[2] == "HTTP/1.1" or "keep-alive" in connection)
        return _FakeRequest(parts[0], parts[1], headers, body, self.protocol, self.connection)


# HTTP/2, the server's side -----------------------------------------------------------

class _FakeStream:
    """One request stream of a _FakeH2: what came of it, and the answer's DATA to send."""

    __slots__ = ("id", "fields", "body", "window", "send_window", "pending", "read")

    def __init__(self, stream_id: int, fields: Tuple[Tuple[str, str], ...],
                 send_window: int) -> None:
        self.id = stream_id
        self.fields = fields
        self.body = bytearray()
        self.window = _FAKE_WINDOW       # DATA bytes the client may still send on it
        self.send_window = send_window   # DATA bytes of the answer the client lets us send
        self.pending = b""               # the answer's DATA waiting for window
        self.read = False                # the request is whole and was handed over


class _FakeH2(_H2Endpoint):
    """The server side of one HTTP/2 connection, as Google's front end speaks it, without
    a socket or a clock.

    ``receive`` takes the bytes read and returns the requests they complete (_H2Error
    when the client broke HTTP/2: then ``abort``); ``answer`` queues one; ``outgoing``
    holds the bytes to write. Once the client has acknowledged the SETTINGS, a stream
    beyond their MAX_CONCURRENT_STREAMS ends the whole connection with a GOAWAY, as
    Google's does. After ``go_away`` the streams up to its last stream id are still
    answered, the later ones are not processed, and ``ended`` comes once all are answered.
    """

    protocol = "HTTP/2"

    def __init__(self, connection: int, max_streams: int = _FAKE_STREAMS) -> None:
        self.connection = connection
        self.outgoing = bytearray()
        self.ended = False
        self.streams: Dict[int, _FakeStream] = {}  # opened, not yet answered in full
        self.last_stream_id: Optional[int] = None  # of the GOAWAY sent, once one is
        self._in = bytearray()
        self._preface = False
        self._decoder = _HPACKDecoder(_H2_HEADER_TABLE)
        self._block: Optional[Tuple[int, bool, bytearray]] = None
        self._highest = 0                          # the highest stream id opened
        self._limit = _H2_LAST_STREAM              # binds once our SETTINGS are acknowledged
        self._unacked: Deque[Dict[int, int]] = collections.deque()
        self._window = _FAKE_WINDOW                # DATA bytes the client may still send
        self._peer_window = _H2_DEFAULT_WINDOW
        self._peer_initial_window = _H2_DEFAULT_WINDOW
        self._peer_frame = _H2_FRAME
        self._blocked: Dict[int, _FakeStream] = {}  # answers whose DATA waits for window
        self._heads: Dict[Tuple[Tuple[str, str], ...], Tuple[str, str, Dict[str, str]]] = {}
        self._answers: Dict[Tuple[Any, ...], bytes] = {}  # header blocks of answers
        self.settings({_SETTINGS_MAX_CONCURRENT_STREAMS: max_streams,
                       _SETTINGS_INITIAL_WINDOW_SIZE: _FAKE_WINDOW,
                       _SETTINGS_MAX_HEADER_LIST_SIZE: _MAX_HEAD})
        self.outgoing += _frame(_WINDOW_UPDATE, 0, 0,
                                (_FAKE_WINDOW - _H2_DEFAULT_WINDOW).to_bytes(4, "big"))

    @property
    def idle(self) -> bool:
        """Whether no stream is open."""
        return not self.streams

    def settings(self, values: Dict[int, int]) -> None:
        """Queue a SETTINGS frame; its limits bind once the client acknowledges it."""
        self._unacked.append(values)
        self.outgoing += _frame(_SETTINGS, 0, 0, b"".join(
            name.to_bytes(2, "big") + value.to_bytes(4, "big") for name, value in values.items()))

    def receive(self, data: bytes) -> List[_FakeRequest]:
        data = self._joined(data)
        offset = 0
        if not self._preface:
            if len(data) < len(_H2_PREFACE):
                if not _H2_PREFACE.startswith(data):
                    raise _H2Error("no HTTP/2 client preface")
                self._in[:] = data
                return []
            if not data.startswith(_H2_PREFACE):
                raise _H2Error("no HTTP/2 client preface")
            self._preface = True
            offset = len(_H2_PREFACE)
        done: List[_FakeRequest] = []
        for kind, flags, stream_id, payload in self._frames(data, offset):
            self._on_frame(kind, flags, stream_id, payload, done)
        return done

    def answer(self, request: _FakeRequest, status: int, headers: Iterable[Tuple[str, str]],
               body: bytes) -> List[_FakeRequest]:
        """Queue the answer of ``request``'s stream, if it is still open; the DATA goes as
        far as the client's windows allow, the rest when they grow."""
        stream = self.streams.get(request.stream)
        if stream is None or stream.pending:
            return []  # gone (reset by the client, beyond a GOAWAY), or answered already
        key = (status, len(body), *headers)
        block = self._answers.get(key)
        if block is None:
            block = _hpack_encode([(":status", str(status)), *headers,
                                   ("content-length", str(len(body)))])
            if len(self._answers) >= _H2_ANSWER_CACHE:
                self._answers.clear()
            self._answers[key] = block
        self._queue_headers(stream.id, block, not body)
        if body:
            stream.pending = body
            self._send_data(stream)
        else:
            self._done(stream)
        return []

    def go_away(self, code: int = _NO_ERROR, last: Optional[int] = None,
                debug: bytes = b"") -> None:
        """Queue a GOAWAY: the streams opened up to ``last`` (by default all) are still
        answered; those above it were not processed, and are forgotten."""
        last = self._highest if last is None else last
        if self.last_stream_id is not None:
            last = min(last, self.last_stream_id)
        self.last_stream_id = last
        self.outgoing += _frame(_GOAWAY, 0, 0, last.to_bytes(4, "big") + code.to_bytes(4, "big")
                                + debug)
        for stream_id in [s for s in self.streams if s > last]:
            self._forget(stream_id)
        self.ended = not self.streams

    def abort(self, error: _H2Error, debug: bytes = b"") -> None:
        """End the connection at once: a GOAWAY with the error's code, no stream answered."""
        self.go_away(error.code, self._highest, debug)
        self.streams.clear()
        self._blocked.clear()
        self.ended = True

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes,
                  done: List[_FakeRequest]) -> None:
        if self._block is not None and kind != _CONTINUATION:
            raise _H2Error("a header block was interrupted")
        if kind == _DATA:
            self._on_data(flags, stream_id, payload, done)
        elif kind == _HEADERS:
            if flags & _PADDED:
                payload = self._unpadded(payload)
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            if flags & _END_HEADERS:
                self._on_headers(stream_id, bool(flags & _END_STREAM), payload, done)
            else:
                self._block = (stream_id, bool(flags & _END_STREAM), bytearray(payload))
        elif kind == _CONTINUATION:
            if self._block is None or self._block[0] != stream_id:
                raise _H2Error("a CONTINUATION frame out of place")
            self._block[2].extend(payload)
            if len(self._block[2]) > _MAX_HEAD:
                raise _H2Error("a header block over %d bytes" % _MAX_HEAD)
            if flags & _END_HEADERS:
                stream_id, end_stream, block = self._block
                self._block = None
                self._on_headers(stream_id, end_stream, bytes(block), done)
        elif kind == _RST_STREAM:
            self._forget(stream_id)
        elif kind == _SETTINGS:
            self._on_settings(flags, payload)
        elif kind == _PING:
            if len(payload) != 8:
                raise _H2Error("a PING frame of %d bytes" % len(payload), _FRAME_SIZE_ERROR)
            if not flags & _ACK:
                self.outgoing += _frame(_PING, _ACK, 0, payload)
        elif kind == _GOAWAY:
            self.go_away()  # the client opens no more: answer what it sent, then end
        elif kind == _WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == _PUSH_PROMISE:
            raise _H2Error("PUSH_PROMISE from a client")

    def _on_headers(self, stream_id: int, end_stream: bool, block: bytes,
                    done: List[_FakeRequest]) -> None:
        try:
            fields = self._decoder.decode(block)  # always: it may change the dynamic table
        except _HPACKError as exc:
            raise _H2Error("undecodable headers: %s" % exc, _COMPRESSION_ERROR) from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if end_stream and not stream.read:
                self._read(stream, done)
            return
        if not stream_id % 2:
            raise _H2Error("a stream with an even id from a client")
        if stream_id <= self._highest:
            return  # the trailers of a stream already answered, or one beyond our GOAWAY
        if self.last_stream_id is None and len(self.streams) >= self._limit:
            self.abort(_H2Error("a stream too many", _PROTOCOL_ERROR),
                       b"exceeded_max_concurrent_streams")
        self._highest = stream_id
        if self.last_stream_id is not None and stream_id > self.last_stream_id:
            return  # opened after a GOAWAY: not processed, as the client knows
        stream = self.streams[stream_id] = _FakeStream(stream_id, fields,
                                                       self._peer_initial_window)
        if end_stream:
            self._read(stream, done)

    def _on_data(self, flags: int, stream_id: int, payload: bytes,
                 done: List[_FakeRequest]) -> None:
        size = len(payload)
        self._window -= size
        if self._window < 0:
            raise _H2Error("DATA beyond the connection's window", _FLOW_CONTROL_ERROR)
        stream = self.streams.get(stream_id)
        if stream is None or stream.read:
            if stream_id == 0 or stream_id > self._highest:
                raise _H2Error("DATA on a stream that was never opened")
            self._replenish(None)
            return  # a stream answered early, reset, or beyond our GOAWAY
        stream.window -= size
        if stream.window < 0:
            raise _H2Error("DATA beyond a stream's window", _FLOW_CONTROL_ERROR)
        if flags & _PADDED:
            payload = self._unpadded(payload)
        stream.body += payload
        if len(stream.body) > _FAKE_MAX_BODY:  # answered at once; the rest is dropped
            self.answer(_FakeRequest("", "", {}, b"", self.protocol, self.connection, stream_id),
                        413, _TEXT_HEADERS, b"fake FCM: the request body is too large\n")
            self._replenish(None)
        elif flags & _END_STREAM:
            self._read(stream, done)
            self._replenish(None)
        else:
            self._replenish(stream)

    def _replenish(self, stream: Optional[_FakeStream]) -> None:
        """Give the client its windows back once it has used half of one: the connection's,
        and that of ``stream``, which goes on sending."""
        if self._window <= _FAKE_WINDOW // 2:
            self.outgoing += _frame(_WINDOW_UPDATE, 0, 0,
                                    (_FAKE_WINDOW - self._window).to_bytes(4, "big"))
            self._window = _FAKE_WINDOW
        if stream is not None and stream.window <= _FAKE_WINDOW // 2:
            self.outgoing += _frame(_WINDOW_UPDATE, 0, stream.id,
                                    (_FAKE_WINDOW - stream.window).to_bytes(4, "big"))
            stream.window = _FAKE_WINDOW

    def _read(self, stream: _FakeStream, done: List[_FakeRequest]) -> None:
        """The stream's request is whole: hand it over."""
        stream.read = True
        head = self._heads.get(stream.fields)
        if head is None:
            head = self._head(stream.fields)
        method, path, headers = head
        done.append(_FakeRequest(method, path, dict(headers), bytes(stream.body), self.protocol,
                                 self.connection, stream.id))

    def _head(self, fields: Tuple[Tuple[str, str], ...]) -> Tuple[str, str, Dict[str, str]]:
        """The method, path and headers of a request's fields, remembered: a client sends
        the same few again and again (the decoder gives each the same tuple)."""
        method = path = ""
        headers: Dict[str, str] = {}
        for name, value in fields:
            if name[:1] == ":":
                if name == ":method":
                    method = value
                elif name == ":path":
                    path = value
            elif name in headers:
                headers[name] += ", " + value
            else:
                headers[name] = value
        if len(self._heads) >= _H2_BLOCK_CACHE:
            self._heads.clear()
        head = self._heads[fields] = (method, path, headers)
        return head

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & _ACK:
            if self._unacked:
                self._limit = self._unacked.popleft().get(_SETTINGS_MAX_CONCURRENT_STREAMS,
                                                          self._limit)
            return
        self._peer_settings(payload)

    def _send_data(self, stream: _FakeStream) -> None:
        while stream.pending:
            size = min(len(stream.pending), self._peer_frame, self._peer_window,
                       stream.send_window)
            if size <= 0:
                self._blocked[stream.id] = stream
                return
            piece, stream.pending = stream.pending[:size], stream.pending[size:]
            self._peer_window -= size
            stream.send_window -= size
            self.outgoing += _frame(_DATA, 0 if stream.pending else _END_STREAM, stream.id, piece)
        self._blocked.pop(stream.id, None)
        self._done(stream)

    def _unblock(self) -> None:
        for stream in list(self._blocked.values()):
            self._send_data(stream)

    def _done(self, stream: _FakeStream) -> None:
        """The stream is answered in full."""
        if self.streams.pop(stream.id, None) is not None and not stream.read:
            self.outgoing += _frame(_RST_STREAM, 0, stream.id, _NO_ERROR.to_bytes(4, "big"))
        if self.last_stream_id is not None and not self.streams:
            self.ended = True

    def _forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self._blocked.pop(stream_id, None)
        if self.last_stream_id is not None and not self.streams:
            self.ended = True


# What FCM checks besides the messages ------------------------------------------------

def _parse_condition(condition: str) -> Tuple[Any, ...]:
    """An FCM topic condition such as ``"'a' in topics && !('b' in topics || 'c' in
    topics)"`` as a tree of ("topic", name), ("not", x), ("and", x, y), ("or", x, y):
    ``!`` binds tightest, then ``&&``, then ``||``. ValueError if it is not one, or names
    more than five topics, as FCM allows."""
    pattern = re.compile(_CONDITION_PART)
    items: List[Any] = []
    position, end = 0, len(condition.rstrip())
    while position < end:
        match = pattern.match(condition, position)
        if match is None:
            raise ValueError("message condition is not a topic condition at %r (write "
                             "\"'a' in topics && ('b' in topics || 'c' in topics)\")"
                             % condition[position:position + 20])
        items.append(match.group(1) or ("topic", match.group(3)))
        position = match.end()
    if sum(1 for item in items if isinstance(item, tuple)) > _MAX_CONDITION_TOPICS:
        raise ValueError("message condition names more than %d topics" % _MAX_CONDITION_TOPICS)
    tree, rest = _condition_or(items)
    if rest:
        raise ValueError("message condition has %r where it should end" % (rest[0],))
    return tree


def _condition_or(items: List[Any]) -> Tuple[Tuple[Any, ...], List[Any]]:
    tree, items = _condition_and(items)
    while items[:1] == ["||"]:
        right, items = _condition_and(items[1:])
        tree = ("or", tree, right)
    return tree, items


def _condition_and(items: List[Any]) -> Tuple[Tuple[Any, ...], List[Any]]:
    tree, items = _condition_not(items)
    while items[:1] == ["&&"]:
        right, items = _condition_not(items[1:])
        tree = ("and", tree, right)
    return tree, items


def _condition_not(items: List[Any]) -> Tuple[Tuple[Any, ...], List[Any]]:
    if not items:
        raise ValueError("message condition ends where a topic should come")
    first, rest = items[0], items[1:]
    if first == "!":
        tree, rest = _condition_not(rest)
        return ("not", tree), rest
    if first == "(":
        tree, rest = _condition_or(rest)
        if rest[:1] != [")"]:
            raise ValueError("message condition has a ( without its )")
        return tree, rest[1:]
    if isinstance(first, tuple):
        return first, rest
    raise ValueError("message condition has %r where a topic should come" % first)


def _condition_reach(tree: Tuple[Any, ...], topics: Dict[str, Set[str]],
                     everyone: Set[str]) -> Set[str]:
    """The tokens a condition's tree reaches, of ``everyone`` subscribed to some topic."""
    kind = tree[0]
    if kind == "topic":
        return topics.get(tree[1], set())
    if kind == "not":
        return everyone - _condition_reach(tree[1], topics, everyone)
    left = _condition_reach(tree[1], topics, everyone)
    right = _condition_reach(tree[2], topics, everyone)
    return left & right if kind == "and" else left | right


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _jwt_problem(assertion: str, key: _RSAPrivateKey, email: str,
                 audiences: Tuple[str, ...], now: float) -> Optional[Tuple[str, str]]:
    """What Google's token endpoint says (error, description) of a service account's JWT
    that it refuses: a bad signature, issuer, audience, scope or lifetime; None when the
    JWT is good. google-auth asks for the cloud-platform scope among others, which covers
    FCM; andpush asks for FCM's alone."""
    import hashlib  # as for signing: most processes never need it

    try:
        header_b64, claims_b64, signature_b64 = assertion.split(".")
        header = json.loads(_b64url_decode(header_b64))
        claims = json.loads(_b64url_decode(claims_b64))
        signature = int.from_bytes(_b64url_decode(signature_b64), "big")
    except ValueError:  # binascii.Error, UnicodeDecodeError and JSON's errors too
        return "invalid_grant", "Invalid JWT: it is not three base64url parts of JSON."
    if not isinstance(header, dict) or not isinstance(claims, dict):
        return "invalid_grant", "Invalid JWT: its header and claims must be JSON objects."
    if header.get("alg") != "RS256":
        return "invalid_grant", "Invalid JWT: the algorithm must be RS256."
    digest = hashlib.sha256((header_b64 + "." + claims_b64).encode("ascii")).digest()
    if pow(signature, key.e, key.n) != int.from_bytes(key.em_prefix + digest, "big"):
        return "invalid_grant", "Invalid JWT Signature."
    if claims.get("iss") != email:
        return "invalid_grant", "Invalid grant: account not found"
    if claims.get("aud") not in audiences:
        return "invalid_grant", ("Invalid JWT: Failed audience check. The right audience is "
                                 + audiences[0])
    scopes = claims.get("scope")
    if not isinstance(scopes, str) or not {FCM_SCOPE, _SCOPE_CLOUD_PLATFORM} & set(scopes.split()):
        return "invalid_scope", "Invalid OAuth scope or ID token audience provided."
    issued, expires = claims.get("iat"), claims.get("exp")
    if not (isinstance(issued, (int, float)) and isinstance(expires, (int, float))
            and issued <= now + _FAKE_CLOCK_SKEW and expires > now
            and expires - issued <= _JWT_LIFETIME):
        return "invalid_grant", ("Invalid JWT: Token must be a short-lived token (60 minutes) "
                                 "and in a reasonable timeframe. Check your iat and exp values "
                                 "in the JWT claim.")
    return None


def _fake_server_context(alpn: Tuple[str, ...]) -> ssl.SSLContext:
    """The fake's TLS context offering ``alpn`` (none: no ALPN), made once per process: the
    certificate is loaded from files (all that Python 3.8 takes), which costs more than
    most tests' own work."""
    context = _FAKE_CONTEXTS.get(alpn)
    if context is None:
        import tempfile  # only the fake writes files

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory(prefix="fake-fcm-") as folder:
            cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
            for path, text in ((cert, _FAKE_CERT_PEM), (key, _FAKE_CERT_KEY_PEM)):
                with open(path, "w") as file:
                    file.write(text)
            context.load_cert_chain(cert, key)
        if alpn:
            context.set_alpn_protocols(list(alpn))
        context = _FAKE_CONTEXTS.setdefault(alpn, context)
    return context


_FAKE_CONTEXTS = {}  # type: Dict[Tuple[str, ...], ssl.SSLContext]


class ReceivedMessage:
    """A message a FakeFCM received, and how it answered it.

    ``message`` is the message as sent (the v1 ``message``, or the legacy request body;
    None when the body held none); ``token``, ``topic`` and ``condition`` its target (None
    but for the one it has); ``tokens`` the device tokens it reached: its token, or the
    members of its topic or condition; none when it was refused, not answered, or sent
    ``validate_only``. ``api`` is "v1" or "legacy"; ``status`` the HTTP status of the
    answer (None when there is none: never answered, or the connection dropped);
    ``error`` FCM's error code, if it answered one; ``name`` the message name (v1) or id
    (legacy) it gave. ``headers`` are the request's (lower-case names), ``protocol``
    "HTTP/1.1" or "HTTP/2", ``connection`` the connection's number (1, 2, ... in the order
    they came), and ``time`` when it came (``time.time()``).
    """

    __slots__ = ("message", "token", "topic", "condition", "tokens", "validate_only", "api",
                 "status", "error", "name", "headers", "protocol", "connection", "time")

    def __init__(self, request: _FakeRequest, api: str, message: Optional[Dict[str, Any]],
                 validate_only: bool, answer: _FakeAnswer, error: Optional[str],
                 name: Optional[str], tokens: Tuple[str, ...]) -> None:
        self.message = message
        target = message or {}
        token, topic, condition = target.get("token"), target.get("topic"), target.get("condition")
        if api == "legacy":
            to = target.get("to")
            token, topic = (None, to[8:]) if isinstance(to, str) and to.startswith(
                "/topics/") else (to, None)
        self.token: Optional[str] = token if isinstance(token, str) else None
        self.topic: Optional[str] = topic if isinstance(topic, str) else None
        self.condition: Optional[str] = condition if isinstance(condition, str) else None
        self.tokens = tokens
        self.validate_only = validate_only
        self.api = api
        unanswered = answer.dropped or answer.delay == math.inf
        self.status: Optional[int] = None if unanswered else answer.status
        self.error = None if unanswered else error
        self.name = None if unanswered else name
        self.headers = request.headers
        self.protocol = request.protocol
        self.connection = request.connection
        self.time = time.time()

    def __repr__(self) -> str:  # no device token: a test's may be a real one
        target = "token" if self.token else "topic %r" % self.topic if self.topic else \
            "condition" if self.condition else "no target"
        return "<andpush.ReceivedMessage %s to %s over %s: %s>" % (
            self.api, target, self.protocol, self.error or self.status)


class _FakeScript:
    """How the next sends (``left`` of them; None: all) are answered, by FakeFCM.answer."""

    __slots__ = ("error", "retry_after", "delay", "drop", "left")

    def __init__(self, error: str, retry_after: Optional[float], delay: float, drop: bool,
                 left: Optional[int]) -> None:
        self.error = error
        self.retry_after = retry_after
        self.delay = delay
        self.drop = drop
        self.left = left


def _take_script(scripts: Deque[_FakeScript]) -> _FakeScript:
    script = scripts[0]
    if script.left is not None:
        script.left -= 1
        if not script.left:
            scripts.popleft()
    return script


class _FakeLink:
    """One connection a FakeFCM accepted: the socket, TLS in memory (if its first byte
    starts a TLS handshake), and the protocol ALPN or its first bytes chose. Only the
    fake's thread touches it."""

    __slots__ = ("sock", "number", "tls", "incoming", "encrypted", "secure", "handshaken",
                 "protocol", "out", "writing", "sniffed", "since", "closing", "lingering",
                 "closed", "deadline")

    def __init__(self, sock: socket.socket, number: int, now: float) -> None:
        self.sock = sock
        self.number = number
        self.tls: Optional[ssl.SSLObject] = None
        self.incoming = ssl.MemoryBIO()
        self.encrypted = ssl.MemoryBIO()
        self.secure: Optional[bool] = None   # TLS or not: known from the first byte
        self.handshaken = False
        self.protocol: Union[None, _FakeH1, _FakeH2] = None
        self.out = bytearray()               # raw bytes the socket has not taken yet
        self.writing = False                 # the selector waits for it to take more
        self.sniffed = b""                   # the first bytes, while they could be HTTP/2's
        self.since = now                     # when it last read or answered a request
        self.closing = ""                    # how it closes once ``out`` is written
        self.lingering = False               # FIN sent: reading until the client's
        self.closed = False
        self.deadline = 0.0                  # when closing or lingering gives up


class FakeFCM:
    """A local FCM for tests: FCM's sends, topics and Google's token endpoint, with failures
    a test scripts and a record of every message it received::

        with andpush.FakeFCM() as fcm:
            client = fcm.client()  # or fcm.async_client(): already pointed at the fake
            client.push({"token": "t1", "notification": {"title": "Hi"}})
            fcm.unregister("t2")
            fcm.answer("QUOTA_EXCEEDED", retry_after=30)  # the next send: a 429
            assert fcm.messages[0].token == "t1"

    It listens on 127.0.0.1 (``port``: 0 for a free one) from a thread of its own, and
    speaks HTTP/1.1 and HTTP/2 on that one port, with TLS (ALPN h2) or without:
    ``endpoint`` is https://, and http:// works too. It checks a v1 message as FCM does
    (andpush's own checks, the ones ``push()`` makes before sending) and answers FCM's
    error envelope for what they refuse; bearer tokens must come from its token endpoint
    (which checks the JWT of its service account, as Google does) or be ``access_token``;
    the legacy API takes ``server_key``. Over HTTP/2 it allows 100 streams at once per
    connection and ends the connection on one more, and idle connections are closed after
    ``idle_timeout`` seconds (with a GOAWAY over HTTP/2), as Google's front end does.

    It keeps the last ``max_recorded`` messages (``messages``), so that a load test of a
    million pushes stays within bounds; ``counts`` counts everything.
    """

    def __init__(self, project_id: str = _FAKE_PROJECT, *, port: int = 0,
                 max_recorded: int = _FAKE_RECORDED) -> None:
        if not isinstance(project_id, str) or not re.match(_FAKE_PROJECT_ID, project_id):
            raise ValueError("project_id must be a Firebase project id such as %r, got %r"
                             % (_FAKE_PROJECT, project_id))
        _check_number("port", port, minimum=0, integer=True)
        _check_number("max_recorded", max_recorded, minimum=1, integer=True)
        self.project_id = project_id
        #: An access token the fake takes without the OAuth2 round trip, as for curl.
        self.access_token = _FAKE_ACCESS_TOKEN
        #: The legacy API's server key the fake takes.
        self.server_key = _FAKE_SERVER_KEY
        #: Messages a second above which sends are answered 429 QUOTA_EXCEEDED (None: no
        #: limit), as FCM's project quota does.
        self.quota: Optional[int] = None
        self._idle_timeout = _FAKE_IDLE_TIMEOUT
        self._port = port
        self._send_path = "/v1/projects/%s/messages:send" % project_id
        self._name_prefix = "projects/%s/messages/" % project_id  # (safe in JSON as it is)
        self._client_email = "fake-sender@%s.iam.gserviceaccount.com" % project_id
        self._account_key = _parse_private_key(_FAKE_ACCOUNT_KEY_PEM)
        self._lock = threading.Lock()
        self._recorded: Deque[ReceivedMessage] = collections.deque(maxlen=max_recorded)
        self._counts = dict.fromkeys(("connections", "requests", "messages", "delivered",
                                      "access_tokens"), 0)
        self._scripts: Deque[_FakeScript] = collections.deque()
        self._token_scripts: Dict[str, Deque[_FakeScript]] = {}
        self._unregistered: Set[str] = set()
        self._other_project: Set[str] = set()
        self._topics: Dict[str, Set[str]] = {}
        self._access_tokens: Dict[str, float] = {}  # issued, and when each expires
        self._message_number = 0
        self._quota_window = (0.0, 0)  # when the second began, and the sends in it
        self._on_message: Optional[Callable[[ReceivedMessage], None]] = None
        self._errors: List[str] = []  # the fake's own failures: tracebacks
        self._folder = ""
        # The thread's.
        self._alpn: Tuple[str, ...] = ("h2", "http/1.1")
        self._context: Optional[ssl.SSLContext] = None
        self._listener: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._selector = selectors.DefaultSelector()
        self._wake: Tuple[socket.socket, ...] = ()  # a pair that wakes the thread: start()'s
        self._calls: Deque[Callable[[], None]] = collections.deque()
        self._links: Set[_FakeLink] = set()
        self._unflushed: Set[_FakeLink] = set()  # given answers by timers, not yet written
        self._timers: List[Tuple[float, int, Callable[[], None]]] = []
        self._timer_number = 0
        self._next_scan = 0.0
        self._stopping = False

    @property
    def idle_timeout(self) -> float:
        """Seconds an idle connection stays open (240, as Google's front end)."""
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        _check_number("idle_timeout", seconds, minimum=0, exclusive=True)
        self._idle_timeout = float(seconds)
        if self._wake:
            self._call_soon(self._scan_soon)  # the connections idle already count from now

    # Where it is, and clients for it ----------------------------------------------------

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("the fake FCM is not started: use it in a with statement, or "
                               "call start()")
        return self._port

    @property
    def endpoint(self) -> str:
        """``https://127.0.0.1:<port>``: what ``endpoint=`` takes."""
        return "https://127.0.0.1:%d" % self.port

    def ssl_context(self) -> ssl.SSLContext:
        """A new client SSL context that trusts the fake's certificate, and nothing else."""
        return ssl.create_default_context(cadata=_FAKE_CA_PEM)

    @property
    def ca_file(self) -> str:
        """A PEM file with the CA of the fake's certificate, for other programs: curl's
        --cacert, REQUESTS_CA_BUNDLE, SSL_CERT_FILE. Removed by ``close()``."""
        return self._file("ca.pem", _FAKE_CA_PEM)

    def service_account(self) -> Dict[str, Any]:
        """The key file of a service account of the fake's project whose ``token_uri`` is
        the fake's token endpoint, as a dict (for ``credentials=``)."""
        return {
            "type": "service_account", "project_id": self.project_id,
            "private_key_id": _FAKE_KEY_ID, "private_key": _FAKE_ACCOUNT_KEY_PEM,
            "client_email": self._client_email, "client_id": "100000000000000000000",
            "token_uri": self.endpoint + "/token",
        }

    @property
    def service_account_file(self) -> str:
        """``service_account()`` as a file, for GOOGLE_APPLICATION_CREDENTIALS and
        firebase-admin. Removed by ``close()``."""
        return self._file("service-account.json", json.dumps(self.service_account(), indent=2))

    def client(self, **options: Any) -> Client:
        """``andpush.new(**options)``, by default with the fake's service account (unless
        ``access_token`` or ``server_key`` is given), endpoint and SSL context."""
        return new(**self._client_options(options))

    def async_client(self, **options: Any) -> AsyncClient:
        """``andpush.new_async(**options)`` with the defaults of ``client()``."""
        return new_async(**self._client_options(options))

    def _client_options(self, options: Dict[str, Any]) -> Dict[str, Any]:
        options.setdefault("endpoint", self.endpoint)
        if options.get("ssl_context") is None:
            options["ssl_context"] = self.ssl_context()
        if not {"credentials", "access_token", "server_key"} & set(options):
            options["credentials"] = self.service_account()
        return options

    def _file(self, name: str, text: str) -> str:
        if not self._folder:
            import tempfile

            self._folder = tempfile.mkdtemp(prefix="fake-fcm-")
        path = os.path.join(self._folder, name)
        if not os.path.exists(path):
            with open(path, "w") as file:
                file.write(text)
        return path

    # Scripting ------------------------------------------------------------------------

    def answer(self, error: str = "", *, times: Optional[int] = 1, token: Optional[str] = None,
               retry_after: Optional[float] = None, delay: float = 0.0,
               drop: bool = False) -> None:
        """Script the answers to the next ``times`` sends (None: all that follow), or to
        those for device ``token`` only: FCM's ``error`` (such as "UNAVAILABLE",
        "QUOTA_EXCEEDED", "INTERNAL", "UNREGISTERED"; "" for the usual answer), with a
        Retry-After of ``retry_after`` seconds; ``delay`` seconds late (``math.inf``:
        never); or no answer, the connection dropped (``drop``). Scripts for a token come
        before the others; each takes its sends in the order they come."""
        if not isinstance(error, str):
            raise TypeError("error must be a str, got %s" % type(error).__name__)
        if error and (error not in _FAKE_ERRORS or error == "ALREADY_EXISTS"):
            raise ValueError("error must be one of %s, or \"\" for the usual answer; got %r"
                             % (", ".join(sorted(set(_FAKE_ERRORS) - {"ALREADY_EXISTS"})), error))
        if times is not None:
            _check_number("times", times, minimum=1, integer=True)
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty str or None")
        if retry_after is not None:
            _check_number("retry_after", retry_after, minimum=0)
        _check_number("delay", delay, minimum=0)
        if drop and (error or delay or retry_after is not None):
            raise ValueError("drop answers nothing: give it no error, delay or retry_after")
        script = _FakeScript(error, retry_after, float(delay), bool(drop), times)
        with self._lock:
            if token is None:
                self._scripts.append(script)
            else:
                self._token_scripts.setdefault(token, collections.deque()).append(script)

    def unregister(self, *tokens: str) -> None:
        """Make FCM answer UNREGISTERED for these device tokens (NotRegistered over the
        legacy API), as for an app that was uninstalled."""
        with self._lock:
            self._unregistered.update(tokens)

    def move_to_other_project(self, *tokens: str) -> None:
        """Make FCM answer SENDER_ID_MISMATCH for these device tokens (MismatchSenderId
        over the legacy API): they belong to another Firebase project."""
        with self._lock:
            self._other_project.update(tokens)

    def reset(self) -> None:
        """Forget the messages, counts, scripts, tokens marked and topic memberships, and
        the quota: as new, but for the connections and access tokens given out."""
        with self._lock:
            self._recorded.clear()
            for name in self._counts:
                self._counts[name] = 0
            self._scripts.clear()
            self._token_scripts.clear()
            self._unregistered.clear()
            self._other_project.clear()
            self._topics.clear()
            self.quota = None

    # Reading ---------------------------------------------------------------------------

    @property
    def messages(self) -> List[ReceivedMessage]:
        """The messages received (the last ``max_recorded``), in the order they came."""
        with self._lock:
            return list(self._recorded)

    def messages_to(self, token: str) -> List[ReceivedMessage]:
        """The messages received for device ``token``: sent to it, or reaching it through a
        topic or condition."""
        return [m for m in self.messages if m.token == token or token in m.tokens]

    def members(self, topic: str) -> Set[str]:
        """The device tokens subscribed to ``topic``."""
        with self._lock:
            return set(self._topics.get(topic, ()))

    @property
    def counts(self) -> Dict[str, int]:
        """What it has had, ever (or since ``reset()``): "connections", "requests" (any),
        "messages" (sends), "delivered" (sends it accepted, not validate_only) and
        "access_tokens" (issued)."""
        with self._lock:
            return dict(self._counts)

    # Life cycle ------------------------------------------------------------------------

    def start(self) -> "FakeFCM":
        """Start listening and serving, from a thread of the fake's own."""
        if self._listener is not None:
            raise RuntimeError("the fake FCM is already started")
        context = _fake_server_context(self._alpn)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self._port:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self._port))
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._context = context
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake[0], selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="fake-fcm", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop: close every connection and the listener, and remove the fake's files."""
        if self._thread is None or self._stopping:
            return
        self._call_soon(self._stop)
        self._thread.join(_JOIN_WAIT)
        if self._folder:
            import shutil

            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""

    def __enter__(self) -> "FakeFCM":
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "https://127.0.0.1:%d" % self._port if self._listener else "not started"
        return "<andpush.FakeFCM %s %s>" % (self.project_id, where)

    # FCM: what it answers ---------------------------------------------------------------

    def _answer(self, request: _FakeRequest) -> _FakeAnswer:
        """What FCM, or Google's token endpoint, answers ``request``."""
        with self._lock:
            self._counts["requests"] += 1
        path, _, query = request.path.partition("?")
        if request.method == "POST":
            if path == self._send_path or path.startswith("/v1/projects/") and path.endswith(
                    "/messages:send"):
                return self._send(request, path)
            if path == "/token":
                return self._token(request)
            if path == "/fcm/send":
                return self._legacy_send(request)
        if request.method in ("POST", "DELETE") and path.startswith("/v1/projects/"):
            match = re.match(_REGISTRATION, path)
            if match is not None:
                return self._topic_change(request, match, query)
        return _fcm_error("NOT_FOUND", "The requested URL %s was not found on this server."
                          % path[:100])

    def _refused(self, request: _FakeRequest) -> Optional[_FakeAnswer]:
        """UNAUTHENTICATED for a request without an access token the fake gave out."""
        authorization = request.headers.get("authorization", "")
        token = authorization[7:] if authorization[:7].lower() == "bearer " else ""
        if token == self.access_token:
            return None
        with self._lock:
            expires = self._access_tokens.get(token)
        if expires is None or expires <= time.monotonic():
            return _fcm_error("UNAUTHENTICATED")
        return None

    def _send(self, request: _FakeRequest, path: str) -> _FakeAnswer:
        """A v1 send: the message checked as FCM checks it, and answered."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if path != self._send_path:
            return _fcm_error("PERMISSION_DENIED")
        try:
            body = json.loads(request.body.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError too
            body = None
        message = body.get("message") if isinstance(body, dict) else None
        if not isinstance(message, dict):
            message = None
            problem = ("Invalid JSON payload received: the body must be a JSON object with a "
                       "\"message\" object.")
        else:
            assert isinstance(body, dict)
            validate_only: object = body.get("validate_only", body.get("validateOnly", False))
            unknown = [name for name in body if name not in _V1_REQUEST_FIELDS]
            if unknown:
                problem = ("Invalid JSON payload received. Unknown name %s: Cannot find field."
                           % json.dumps(unknown[0]))
            elif not isinstance(validate_only, bool):
                problem = "Invalid value for validate_only: it must be true or false."
            else:
                return self._deliver_message(request, "v1", message, validate_only)
        return self._received(request, "v1", message, False,
                              _fcm_error("INVALID_ARGUMENT", problem), "INVALID_ARGUMENT", None,
                              ())

    def _deliver_message(self, request: _FakeRequest, api: str, message: Dict[str, Any],
                         validate_only: bool) -> _FakeAnswer:
        """The answer to a message well-formed enough to be scripted, checked or sent."""
        script = None
        if self._scripts or self._token_scripts:  # (read unlocked: set before the send came)
            token = message.get("token" if api == "v1" else "to")
            with self._lock:
                script = self._script_for(token if isinstance(token, str) else None)
        if script is not None and script.error:
            answer = _fcm_error(script.error, retry_after=script.retry_after)
            answer.delay = script.delay
            return self._received(request, api, message, validate_only, answer, script.error,
                                  None, ())
        if script is not None and script.drop:
            return self._received(request, api, message, validate_only,
                                  _FakeAnswer(0, (), b"", dropped=True), None, None, ())
        if api == "v1":
            answer, error, name, reached = self._v1_outcome(request, message, validate_only)
        else:
            answer, error, name, reached = self._legacy_outcome(request, message, validate_only)
        if script is not None:
            answer.delay = script.delay
            if script.delay == math.inf:
                reached = ()
        return self._received(request, api, message, validate_only, answer, error, name, reached)

    def _script_for(self, token: Optional[str]) -> Optional[_FakeScript]:
        """The script that answers the next send (for ``token``), taken; called locked."""
        if token is not None:
            scripts = self._token_scripts.get(token)
            if scripts:
                script = _take_script(scripts)
                if not scripts:
                    del self._token_scripts[token]
                return script
        return _take_script(self._scripts) if self._scripts else None

    def _v1_outcome(self, request: _FakeRequest, message: Dict[str, Any], validate_only: bool
                    ) -> Tuple[_FakeAnswer, Optional[str], Optional[str], Tuple[str, ...]]:
        """FCM's answer to a v1 message, its error code, the message's name, and the tokens
        it reached."""
        try:
            if _check_message(message) is not message:  # the client drops a /topics/ prefix
                raise ValueError("topic names go without the /topics/ prefix")
            _check_data_sizes(message, request.body)
            condition = message.get("condition")
            tree = _parse_condition(condition) if isinstance(condition, str) else None
        except (TypeError, ValueError) as exc:
            return _fcm_error("INVALID_ARGUMENT", str(exc)), "INVALID_ARGUMENT", None, ()
        with self._lock:
            refusal = self._over_quota() or self._token_refusal(message.get("token"))
            if refusal is not None:
                return _fcm_error(refusal[0], retry_after=refusal[1]), refusal[0], None, ()
            reached = self._reach(message.get("token"), message.get("topic"), tree)
            self._message_number += 1
            number = self._message_number
        name = self._name_prefix + ("fake_message_id" if validate_only else "0:%d" % number)
        answer = _FakeAnswer(200, _JSON_HEADERS, ('{"name":"%s"}' % name).encode("ascii"))
        return answer, None, name, () if validate_only else reached

    def _over_quota(self) -> Optional[Tuple[str, Optional[float]]]:
        """QUOTA_EXCEEDED and its Retry-After for a send beyond ``quota`` this second;
        called locked."""
        if self.quota is None:
            return None
        now = time.monotonic()
        started, sends = self._quota_window
        if now - started >= 1.0:
            started, sends = now, 0
        self._quota_window = (started, sends + 1)
        if sends < self.quota:
            return None
        return "QUOTA_EXCEEDED", math.ceil(started + 1.0 - now)

    def _token_refusal(self, token: object) -> Optional[Tuple[str, Optional[float]]]:
        if token in self._unregistered:
            return "UNREGISTERED", None
        if token in self._other_project:
            return "SENDER_ID_MISMATCH", None
        return None

    def _reach(self, token: object, topic: object, tree: Optional[Tuple[Any, ...]]
               ) -> Tuple[str, ...]:
        """The device tokens a message to token, topic or condition reaches; called locked."""
        if isinstance(token, str):
            return (token,)
        if isinstance(topic, str):
            members = self._topics.get(topic, set())
        elif tree is not None:
            everyone = set().union(*self._topics.values())
            members = _condition_reach(tree, self._topics, everyone)
        else:
            return ()
        return tuple(sorted(members - self._unregistered - self._other_project))

    def _received(self, request: _FakeRequest, api: str, message: Optional[Dict[str, Any]],
                  validate_only: bool, answer: _FakeAnswer, error: Optional[str],
                  name: Optional[str], reached: Tuple[str, ...]) -> _FakeAnswer:
        """Record a send and what it is answered; return the answer."""
        received = ReceivedMessage(request, api, message, validate_only, answer, error, name,
                                   reached)
        with self._lock:
            self._recorded.append(received)
            self._counts["messages"] += 1
            if received.status == 200 and not validate_only:
                self._counts["delivered"] += 1
        if self._on_message is not None:
            self._on_message(received)
        return answer

    # The legacy API.

    def _legacy_send(self, request: _FakeRequest) -> _FakeAnswer:
        if request.headers.get("authorization", "") != "key=" + self.server_key:
            return _text_answer(401, "Unauthorized: the server key is not the fake's\n")
        try:
            message = json.loads(request.body)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            return self._received(request, "legacy", None, False,
                                  _text_answer(400, "JSON_PARSING_ERROR: the body is not a JSON "
                                               "object\n"), "INVALID_ARGUMENT", None, ())
        return self._deliver_message(request, "legacy", message, message.get("dry_run") is True)

    def _legacy_outcome(self, request: _FakeRequest, message: Dict[str, Any], dry_run: bool
                        ) -> Tuple[_FakeAnswer, Optional[str], Optional[str], Tuple[str, ...]]:
        to, ids, condition = (message.get(name) for name in ("to", "registration_ids",
                                                              "condition"))
        try:
            _check_legacy_message(message)
            _check_data_sizes(message, request.body)
            tree = _parse_condition(condition) if isinstance(condition, str) else None
            topic = to[8:] if isinstance(to, str) and to.startswith("/topics/") else None
            if topic is not None:
                _topic_name(topic, "topic")
            tokens = ids if isinstance(ids, list) else [to] if isinstance(to, str) else []
            if topic is None and tree is None and not (
                    0 < len(tokens) <= 1000 and all(isinstance(t, str) and t for t in tokens)):
                raise ValueError('give "to", "condition" or 1 to 1000 "registration_ids"')
        except (TypeError, ValueError) as exc:
            return _text_answer(400, "InvalidParameters: %s\n" % exc), "INVALID_ARGUMENT", None, ()
        with self._lock:
            self._message_number += 1
            number = self._message_number
            if topic is not None or tree is not None:
                reached = self._reach(None, topic, tree)
                answer = _json_answer(200, {"message_id": number})
                return answer, None, str(number), () if dry_run else reached
            results = [self._legacy_result(token, dry_run) for token in tokens]
        reached = tuple(t for t, r in zip(tokens, results) if "message_id" in r)
        failure = sum(1 for result in results if "error" in result)
        answer = _json_answer(200, {
            "multicast_id": -1 if dry_run else _FAKE_MULTICAST_BASE + number,
            "success": len(results) - failure, "failure": failure,
            "canonical_ids": sum(1 for result in results if "registration_id" in result),
            "results": results,
        })
        first = results[0].get("message_id")
        return answer, results[0].get("error"), first, () if dry_run else reached

    def _legacy_result(self, token: str, dry_run: bool) -> Dict[str, Any]:
        """One token's result of a legacy send; called locked."""
        if token in self._unregistered:
            return {"error": "NotRegistered"}
        if token in self._other_project:
            return {"error": "MismatchSenderId"}
        if dry_run:
            return {"message_id": "fake_message_id"}
        return {"message_id": "0:%d%%%s" % (self._message_number, _FAKE_MESSAGE_SUFFIX)}

    # Topic management and the token endpoint.

    def _topic_change(self, request: _FakeRequest, match: "re.Match[str]", query: str
                      ) -> _FakeAnswer:
        """POST .../registrations/<token>/topicSubscriptions?topic_name=<topic> subscribes,
        DELETE .../topicSubscriptions/<topic> unsubscribes (allow_missing=true: even a
        token that is not subscribed)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if urllib.parse.unquote(match.group(1)) != self.project_id:
            return _fcm_error("PERMISSION_DENIED")
        parameters = dict(urllib.parse.parse_qsl(query))
        token = urllib.parse.unquote(match.group(2))
        subscribe = request.method == "POST" and match.group(3) is None
        topic = parameters.get("topic_name", "") if subscribe else urllib.parse.unquote(
            match.group(3) or "")
        try:
            topic = _topic_name(topic, "topic")
        except ValueError as exc:
            return _fcm_error("INVALID_ARGUMENT", str(exc))
        with self._lock:
            if token in self._unregistered:
                return _fcm_error("NOT_FOUND")
            members = self._topics.setdefault(topic, set())
            if subscribe and token in members:
                return _fcm_error("ALREADY_EXISTS")
            if not subscribe and token not in members and parameters.get(
                    "allow_missing") != "true":
                return _fcm_error("NOT_FOUND")
            if subscribe:
                members.add(token)
            else:
                members.discard(token)
            if not members:
                del self._topics[topic]
        return _json_answer(200, {})

    def _token(self, request: _FakeRequest) -> _FakeAnswer:
        """Google's OAuth2 token endpoint, for the fake's service account."""
        form = dict(urllib.parse.parse_qsl(request.body.decode("latin-1")))
        problem = self._grant_problem(form)
        if problem is not None:
            return _json_answer(400, {"error": problem[0], "error_description": problem[1]})
        return _json_answer(200, {"access_token": self._issue(), "token_type": "Bearer",
                                  "expires_in": _FAKE_TOKEN_LIFETIME - 1})

    def _grant_problem(self, form: Dict[str, str]) -> Optional[Tuple[str, str]]:
        if form.get("grant_type") != _JWT_BEARER:
            return "unsupported_grant_type", "Invalid grant_type: %s" % form.get("grant_type")
        audiences = (self.endpoint + "/token", _GOOGLE_TOKEN_URI)
        return _jwt_problem(form.get("assertion", ""), self._account_key, self._client_email,
                            audiences, time.time())

    def _issue(self) -> str:
        """A new access token, good for an hour."""
        with self._lock:
            self._counts["access_tokens"] += 1
            token = "ya29.fake-%d" % len(self._access_tokens)
            self._access_tokens[token] = time.monotonic() + _FAKE_TOKEN_LIFETIME
        return token

    # The thread: connections, bytes and timers ------------------------------------------

    def _call_soon(self, call: Callable[[], None]) -> None:
        """Have the fake's thread run ``call``; from any thread."""
        self._calls.append(call)
        with contextlib.suppress(OSError):  # full: the thread has a wake-up waiting anyway
            self._wake[1].send(b"\0")

    def _later(self, delay: float, call: Callable[[], None]) -> None:
        """Have the fake's thread run ``call`` ``delay`` seconds from now."""
        self._timer_number += 1
        heapq.heappush(self._timers, (time.monotonic() + delay, self._timer_number, call))

    def _serve(self) -> None:
        """The fake's thread: accept, read, answer, write and time out, until close()."""
        selector = self._selector
        try:
            while not self._stopping:
                due = self._timers[0][0] if self._timers else math.inf
                timeout = max(0.0, min(due, self._next_scan) - time.monotonic())
                for key, mask in selector.select(timeout):
                    link = key.data
                    if isinstance(link, _FakeLink):
                        self._on_ready(link, mask)
                    elif link == "accept":
                        self._accept()
                    else:
                        with contextlib.suppress(OSError):
                            self._wake[0].recv(4096)
                while self._calls:
                    self._calls.popleft()()
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    heapq.heappop(self._timers)[2]()
                while self._unflushed:  # what the timers queued: one write per connection
                    link = self._unflushed.pop()
                    if not link.closed:
                        self._flush(link)
                if now >= self._next_scan:
                    self._scan(now)
        except Exception:  # noqa: BLE001 (a bug of the fake's: kept and logged)
            self._fail()
        finally:
            for link in list(self._links):
                self._shut(link)
            if self._listener is not None:
                self._listener.close()
            selector.close()
            for sock in self._wake:
                sock.close()

    def _stop(self) -> None:
        self._stopping = True

    def _scan_soon(self) -> None:
        self._next_scan = 0.0

    def _fail(self) -> None:
        import traceback

        self._errors.append(traceback.format_exc())
        log.error("the fake FCM failed", exc_info=True)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors: the client waits in the backlog
                log.warning("the fake FCM cannot accept a connection", exc_info=True)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._counts["connections"] += 1
                number = self._counts["connections"]
            link = _FakeLink(sock, number, time.monotonic())
            self._links.add(link)
            self._selector.register(sock, selectors.EVENT_READ, link)

    def _on_ready(self, link: _FakeLink, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(link)
            if mask & selectors.EVENT_READ and not link.closed:
                self._read(link)
        except Exception:  # noqa: BLE001 (a bug of the fake's: kept, and the connection cut)
            self._fail()
            self._shut(link)

    def _read(self, link: _FakeLink) -> None:
        try:
            raw = link.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._shut(link)
            return
        if not raw:
            self._shut(link)  # the client left: what it was waiting for is lost
            return
        if link.lingering:
            return
        link.since = time.monotonic()
        if link.secure is None:
            link.secure = raw[0] == 0x16  # a TLS handshake record: a ClientHello
            if link.secure:
                assert self._context is not None
                link.tls = self._context.wrap_bio(link.incoming, link.encrypted,
                                                  server_side=True)
        data: Optional[bytes] = raw
        if link.tls is not None:
            data = self._decrypt(link, raw)
        if data:
            self._take(link, data)
        if not link.closed:
            self._flush(link)

    def _decrypt(self, link: _FakeLink, raw: bytes) -> Optional[bytes]:
        """The data ``raw`` completes, after the handshake; None if TLS failed."""
        tls = link.tls
        assert tls is not None
        link.incoming.write(raw)
        if not link.handshaken:
            try:
                tls.do_handshake()
            except ssl.SSLWantReadError:
                link.out += link.encrypted.read()
                return b""
            except (ssl.SSLError, OSError):
                with contextlib.suppress(OSError):  # the alert: the client learns why
                    link.sock.send(link.encrypted.read())
                self._shut(link)
                return None
            link.handshaken = True
            link.out += link.encrypted.read()
            self._secured(link)
        parts = []
        try:
            while True:
                part = tls.read(_RECV_SIZE)
                if not part:
                    break
                parts.append(part)
        except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
            pass  # all there is; or the client's close_notify, before its FIN
        except ssl.SSLError:
            self._shut(link)
            return None
        if link.encrypted.pending:  # a TLS 1.3 KeyUpdate's answer
            link.out += link.encrypted.read()
        return b"".join(parts)

    def _secured(self, link: _FakeLink) -> None:
        """TLS is up: ALPN chose the protocol, if the client offered any."""
        assert link.tls is not None
        alpn = link.tls.selected_alpn_protocol()
        if alpn is not None:
            link.protocol = self._protocol(alpn, link.number)

    def _protocol(self, name: str, number: int) -> Union[_FakeH1, _FakeH2]:
        """The protocol of connection ``number``: "h2", or else HTTP/1.1."""
        return _FakeH2(number) if name == "h2" else _FakeH1(number)

    def _take(self, link: _FakeLink, data: bytes) -> None:
        """Hand the data read to the connection's protocol, chosen by the first bytes if
        ALPN did not, and answer the requests it completes."""
        protocol = link.protocol
        if protocol is None:
            data = link.sniffed + data
            if len(data) < len(_H2_PREFACE) and _H2_PREFACE.startswith(data):
                link.sniffed = data
                return
            link.sniffed = b""
            protocol = link.protocol = self._protocol(
                "h2" if data.startswith(_H2_PREFACE) else "http/1.1", link.number)
        try:
            requests = protocol.receive(data)
        except _H2Error as exc:
            assert isinstance(protocol, _FakeH2)
            protocol.abort(exc)
            return
        for request in requests:
            self._dispatch(link, request)

    def _dispatch(self, link: _FakeLink, request: _FakeRequest) -> None:
        """Answer a request that was read whole: now, later, never, or by dropping the
        connection, as FCM's answer (or a script) says."""
        protocol = link.protocol
        if isinstance(protocol, _FakeH2) and request.stream not in protocol.streams:
            return  # read with others, then beyond a GOAWAY: not processed
        try:
            answer = self._answer(request)
        except Exception:  # noqa: BLE001 (a bug of the fake's: kept, and a 500)
            self._fail()
            answer = _text_answer(500, "fake FCM: a bug in the fake; see its log\n")
        if answer.dropped:
            self._reset(link)
        elif not answer.delay:
            self._deliver(link, request, answer)
        elif answer.delay < math.inf:
            self._later(answer.delay, lambda: self._deliver_late(link, request, answer))

    def _deliver(self, link: _FakeLink, request: _FakeRequest, answer: _FakeAnswer) -> None:
        protocol = link.protocol
        if protocol is None or link.closing or link.closed:
            return
        link.since = time.monotonic()
        for following in protocol.answer(request, answer.status, answer.headers, answer.body):
            self._dispatch(link, following)

    def _deliver_late(self, link: _FakeLink, request: _FakeRequest, answer: _FakeAnswer
                      ) -> None:
        self._deliver(link, request, answer)
        self._unflushed.add(link)

    def _write(self, link: _FakeLink, data: bytes) -> None:
        """Queue bytes of the protocol's to be sent, encrypted if the connection is TLS."""
        if link.tls is not None:
            link.tls.write(data)
            link.out += link.encrypted.read()
        else:
            link.out += data

    def _flush(self, link: _FakeLink) -> None:
        """Send what the protocol has to say, as far as the socket takes it; close the
        connection once the protocol has ended and everything is sent."""
        protocol = link.protocol
        if protocol is not None and protocol.outgoing:
            data = bytes(protocol.outgoing)
            protocol.outgoing.clear()
            self._write(link, data)
        if link.out:
            try:
                del link.out[:link.sock.send(link.out)]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._shut(link)
                return
        if protocol is not None and protocol.ended and not link.closing:
            self._close(link, "notify")
            return
        if link.closing and not link.out and not link.lingering:
            self._end(link)
        writing = bool(link.out)
        if writing != link.writing and not link.closed:
            link.writing = writing
            self._selector.modify(link.sock, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if writing else 0), link)

    def _close(self, link: _FakeLink, how: str) -> None:
        """Close the connection once what is queued is sent: "notify" with TLS's
        close_notify, "drop" without; either way with a FIN, then reading until the
        client's (for at most _FAKE_LINGER seconds)."""
        if not link.closing:
            link.closing = how
            link.deadline = time.monotonic() + _FAKE_LINGER
            self._next_scan = min(self._next_scan, link.deadline)
        self._flush(link)

    def _end(self, link: _FakeLink) -> None:
        if link.closing == "notify" and link.tls is not None and link.handshaken:
            with contextlib.suppress(ssl.SSLError, ValueError):
                link.tls.unwrap()  # queues close_notify; it then wants the client's
            with contextlib.suppress(OSError):
                link.sock.send(link.encrypted.read())
        with contextlib.suppress(OSError):
            link.sock.shutdown(socket.SHUT_WR)
        link.lingering = True
        link.deadline = time.monotonic() + _FAKE_LINGER

    def _reset(self, link: _FakeLink) -> None:
        """Cut the connection at once: TCP RST, nothing more sent."""
        with contextlib.suppress(OSError):
            link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._shut(link)

    def _shut(self, link: _FakeLink) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(link.sock)
        link.sock.close()

    def _scan(self, now: float) -> None:
        """Close the connections idle for idle_timeout seconds (a GOAWAY first over
        HTTP/2), and those that have lingered long enough."""
        timeout = self.idle_timeout
        next_scan = now + min(timeout, _FAKE_SCAN)
        for link in list(self._links):
            if link.closing:
                due = link.deadline
                if now >= due:
                    if link.out:
                        self._reset(link)  # the client takes nothing: it gets nothing more
                    else:
                        self._shut(link)
                    continue
            elif link.protocol is None or link.protocol.idle:
                due = link.since + timeout
                if now >= due:
                    self._idle(link)
                    continue
            else:
                continue
            next_scan = min(next_scan, due)
        self._next_scan = next_scan

    def _idle(self, link: _FakeLink) -> None:
        if isinstance(link.protocol, _FakeH2):
            link.protocol.go_away()
            self._flush(link)
        else:
            self._close(link, "notify")


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
_EXIT_NOPERM = 77        # EX_NOPERM: no or refused credentials, no permission or project,
#                          or a certificate that fails verification: fix the setup
_EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
_EXIT_CLOSED_OUTPUT = 141  # stdout's reader went away (| head): 128 + SIGPIPE, as shells
_EXIT_TERMINATED = 143   # SIGTERM (systemd, docker, Kubernetes stopping it): 128 + SIGTERM

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
  andpush send-many --messages messages.jsonl --results results.jsonl

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
  77   credentials missing or refused, no permission, no such project, or a server
       certificate that fails verification (--cafile): fix the setup
  130  interrupted (Ctrl-C): every message sent is recorded, the rest was not sent
  141  the output was closed (as by `| head`); sending stopped there
  143  terminated (SIGTERM): as for 130
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

    many = command("send-many", "send one message to many device tokens, or many messages",
                   "Send the same message to every device token of a file (--tokens), or "
                   "every message of a file (--messages), many at once. Progress and a "
                   "summary go to stderr. Ctrl-C or SIGTERM stops cleanly: nothing more is "
                   "sent, every message already sent is answered and recorded, the summary "
                   "says how many were sent, failed and not sent, and the exit status is 130 "
                   "(143 for SIGTERM). A second one ends at once, saying how many outcomes "
                   "are unknown.")
    sources = many.add_argument_group("what to send (one of)").add_mutually_exclusive_group(
        required=True)
    sources.add_argument("--tokens", metavar="FILE",
                         help="the device tokens, one a line (- reads stdin); blank lines and "
                         "lines starting with # are skipped")
    sources.add_argument("--messages", metavar="FILE",
                         help="the messages, one JSON object a line (JSON Lines; - reads "
                         "stdin), each with its own target and content; blank lines and "
                         "lines starting with # are skipped")
    _add_content_options(many)
    many.add_argument("--concurrency", metavar="N", type=_positive_int,
                      default=DEFAULT_CONCURRENCY,
                      help="messages in flight at once (default: %(default)s)")
    many.add_argument("--rate", metavar="N", type=_positive_float,
                      help="send at most N messages a second (default: no limit)")
    many.add_argument("--results", metavar="FILE",
                      help="write one JSON object a line per message (- for stdout): token, "
                      "ok, status, error (FCM's error code), message (its name or id), "
                      "detail, canonical_token (legacy: the token to store instead)")
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

    fake = command("fake-fcm", "run a fake FCM here, for tests in any language", "Run "
                   "andpush's fake FCM in the foreground until Ctrl-C or SIGTERM: FCM's v1 and "
                   "legacy sends, topic management and Google's token endpoint, over HTTP/1.1 "
                   "and HTTP/2, on 127.0.0.1 with TLS (https://, its own CA) or without "
                   "(http://). It says where it is on stderr (the endpoint, its CA file, a "
                   "service account key file whose token_uri it serves, an access token it "
                   "takes), then prints one JSON line per message it receives on stdout. "
                   "--project-id names its project (default: " + _FAKE_PROJECT + ").")
    fake.add_argument("--port", metavar="N", type=_whole_number, default=0,
                      help="the port to listen on (default: a free one)")
    fake.add_argument("-q", "--quiet", action="store_true",
                      help="print no line per message")
    fake.set_defaults(run=_cmd_fake_fcm)
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
    group.add_argument("--fake", action="store_true", default=default(False),
                       help="send to a fake FCM started inside this command: no credentials, "
                       "nothing leaves the machine (see the fake-fcm command)")
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
        with contextlib.ExitStack() as stack:
            if args.fake:
                _refuse_options(args, "--fake sends to a fake FCM of its own", "fake")
                args.fake_fcm = stack.enter_context(FakeFCM(args.project_id or _FAKE_PROJECT))
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
    if _is_refused_sender(error) or _is_missing_project(error) \
            or isinstance(error, CertificateError):
        return _EXIT_NOPERM
    return _EXIT_TEMPFAIL if _is_outage(error) else _EXIT_FAILED


def _explain(error: BaseException) -> str:
    """One line: what went wrong, what to do where that is clear, and the error itself."""
    if isinstance(error, CertificateError):
        return "TLS problem, fix the setup: %s" % error
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
    if args.fake:
        return cast(FakeFCM, args.fake_fcm).client(
            timeout=args.timeout, max_retries=args.max_retries, rate_limit=rate_limit)
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


# The options that say where FCM is and how to reach it, and how to tell they were given.
_WHERE_OPTIONS = (
    ("--credentials", lambda args: args.credentials is not None),
    ("--server-key", lambda args: args.server_key is not None),
    ("--endpoint", lambda args: args.endpoint != DEFAULT_ENDPOINT),
    ("--cafile", lambda args: args.cafile is not None),
    ("--proxy", lambda args: args.proxy is not None),
    ("--fake", lambda args: args.fake),
)


def _refuse_options(args: "argparse.Namespace", reason: str, *allowed: str) -> None:
    """Fail when an option saying where FCM is was given where it means nothing."""
    given = [name for name, present in _WHERE_OPTIONS
             if present(args) and name.lstrip("-") not in allowed]
    if given:
        raise _Failure("%s: leave out %s" % (reason, " and ".join(given)))


def _about_option(message: str, args: "argparse.Namespace") -> str:
    """new()'s message about one of its arguments (``endpoint must use https://...``), about
    the option or variable that set it instead (``--endpoint must use https://...``)."""
    name, space, rest = message.partition(" ")
    if name == "server_key" and args.server_key is None:
        return _SERVER_KEY_VARIABLE + space + rest
    return _OPTIONS_OF_ARGUMENTS.get(name, name) + space + rest


def _is_legacy(client: Client) -> bool:
    return isinstance(client._requests.api, _LegacyAPI)


def _check_ready(client: Client, message: Optional[Dict[str, Any]] = None) -> None:
    """Fail before the first send when no access token comes, or the message is wrong."""
    api = client._requests.api
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
        keys = [key for key, _ in args.data]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:
            raise _Failure("--data gives %r more than once; give each key once" % twice)
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
    except OSError as exc:
        raise _Failure("cannot read --message %r: %s" % (path, exc.strerror or exc)) from None
    except ValueError as exc:  # UnicodeDecodeError
        raise _Failure("--message %r is not JSON: %s" % (path, exc)) from None
    return _message_from(text, "--message %r" % path)


def _message_from(text: str, what: str) -> Dict[str, Any]:
    """The message a JSON text holds: a message, or a whole v1 request body of one
    ({"message": {...}}, as Google's examples show it), which the command line unwraps."""
    try:
        message = json.loads(text)
    except ValueError as exc:  # JSONDecodeError: where, not what
        raise _Failure("%s is not JSON: %s" % (what, exc)) from None
    if isinstance(message, dict) and list(message) == ["message"]:
        message = message["message"]
    if not isinstance(message, dict):
        raise _Failure("%s must hold a JSON object" % what)
    return message


def _messages_in(lines: Iterable[str], path: str) -> Iterator[Dict[str, Any]]:
    """The messages of a JSON Lines file, lazily: blank lines and # comments skipped; a
    line that is not a JSON object stops the run there (what was read is still sent)."""
    try:
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if text and not text.startswith("#"):
                yield _message_from(text, "line %d of --messages %r" % (number, path))
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise _Failure("cannot read --messages %r: %s" % (path, exc)) from None


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
        errors = response.errors
    except ValueError:  # not JSON
        return None, None
    return response.message_id, next(iter(errors.values()), None)


def _failure_code(error: BaseException) -> str:
    """FCM's error code for a failed message, or what kind of failure it was."""
    if isinstance(error, HTTPError):
        return error.error_code or "HTTP_%d" % error.status_code
    if isinstance(error, NetworkError):
        return "NETWORK_ERROR"
    if isinstance(error, AuthError):
        return "AUTH_ERROR"
    return "INVALID_MESSAGE"  # TypeError/ValueError: refused before it was sent


def _record(token: Optional[str], outcome: Outcome) -> Dict[str, Any]:
    """One line of --results: what became of the message to ``token`` (None: a message to
    a topic or condition)."""
    record: Dict[str, Any] = {
        "token": token, "ok": False, "status": None, "error": None, "message": None,
        "detail": None, "canonical_token": None,
    }
    if isinstance(outcome, Response):
        record["message"], refused = _answer(outcome)
        record.update(ok=refused is None, status=outcome.status_code, error=refused)
        if token is not None:
            with contextlib.suppress(ValueError):  # not JSON
                record["canonical_token"] = outcome.canonical_tokens.get(token)
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
        message: Any = _with_target(content, args, _is_legacy(client))  # JSON, checked by push
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
    source = args.messages or args.tokens
    if source == "-" and args.message == "-":
        raise _Failure("--%s and --message cannot both read stdin"
                       % ("messages" if args.messages else "tokens"))
    if args.messages:
        given = [name for name in ("title", "body", "image", "data", "message", "allow_empty")
                 if getattr(args, name)]
        if given:
            raise _Failure("--messages holds whole messages: give no --%s with it"
                           % given[0].replace("_", "-"))
        template = None
    else:
        template = _message(args)
        if any(name in template for name in _TARGET_FIELDS):
            raise _Failure("the --message file must have no target: the tokens come from "
                           "--tokens")
        _check_content(template, args)
    with contextlib.ExitStack() as stack:
        lines = _open(source, "--messages" if args.messages else "the tokens file", stack)
        results = _open(args.results, "--results", stack, write=True) if args.results else None
        dead = _open(args.unregistered, "--unregistered", stack, write=True) \
            if args.unregistered else None
        client = stack.enter_context(_client(args, rate_limit=args.rate))
        field = "to" if _is_legacy(client) else "token"
        messages: Iterator[Any]  # JSON, checked by push_many
        if template is None:
            _check_ready(client)
            messages = _messages_in(lines, source)
        else:
            _check_ready(client, dict(template, **{field: "token"}))
            messages = (dict(template, **{field: token}) for token in _tokens_in(lines, source))
        progress = _Progress(sys.stderr, None if args.quiet else _count_tokens(source),
                             args.quiet)
        tally = _Tally(results, dead)
        outcomes = client.push_many(messages, concurrency=args.concurrency,
                                    progress=progress.update)
        assert isinstance(outcomes, Outcomes)
        signals = _StopOnSignals(outcomes)
        unknown = 0
        try:
            with signals:
                failure = _record_all(outcomes, tally, field)
        except _SecondSignal as second:
            tally.stopped = _SIGNAL_WORDS[second.signum] + " again"
            unknown = outcomes.taken - outcomes.success_count - outcomes.failure_count
            return _SIGNAL_STATUS[second.signum]
        finally:
            progress.finish(outcomes.success_count + tally.failed(outcomes),
                            tally.failed(outcomes))
            if signals.received is not None and not tally.stopped:
                tally.stopped = _SIGNAL_WORDS[signals.received]
            tally.report(outcomes, args.unregistered, unknown,
                         _count_tokens(source) if tally.stopped else None)
    if failure is not None:
        raise failure
    if signals.received is not None:
        return _SIGNAL_STATUS[signals.received]
    if tally.output_closed:
        _discard_stdout()
        return _EXIT_CLOSED_OUTPUT
    return _EXIT_FAILED if tally.failed(outcomes) else _EXIT_OK


def _record_all(outcomes: "Outcomes[Any]", tally: "_Tally", field: str) -> Optional[Exception]:
    """Record every message's outcome. A failure that would fail all the rest, or an
    output that was closed, stops the taking of tokens; what was taken is still recorded.
    Returns the failure that stopped the run, if one did."""
    failure = None
    for message, outcome in outcomes:
        tally.add(message.get(field), outcome)
        if isinstance(outcome, Exception) and _stops_the_run(outcome, outcomes.success_count):
            failure = outcome
            break
        if tally.output_closed:
            break
    for message, outcome in outcomes.close():
        tally.add(message.get(field), outcome)
    return failure


def _stops_the_run(outcome: Exception, sent: int) -> bool:
    """Whether a failure would fail every message after it too (credentials, project...).

    An outage counts only when nothing was sent yet: then FCM cannot be reached, or is
    down, and the run is better tried again later than spent on failures.
    """
    if isinstance(outcome, NetworkError):
        return isinstance(outcome, CertificateError) \
            or sent == 0 and not outcome.may_have_been_delivered
    if _is_outage(outcome):
        return sent == 0
    return _is_systemic(outcome) or _is_missing_project(outcome)


# What send-many calls the signals that stop it, and the exit status each one gives.
_SIGNAL_WORDS = {2: "interrupted", 15: "terminated"}  # SIGINT, SIGTERM
_SIGNAL_STATUS = {2: _EXIT_INTERRUPTED, 15: _EXIT_TERMINATED}


class _SecondSignal(BaseException):
    """A second SIGINT or SIGTERM: send-many ends at once (a BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` on the way stops it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopOnSignals:
    """While send-many records outcomes, SIGINT and SIGTERM alike stop the run: the first
    one stops push_many (nothing more is sent; what was sent is answered and recorded); a
    second one raises _SecondSignal. Signals ignored when the command started
    (nohup, a background job) stay ignored; off the main thread nothing is changed."""

    def __init__(self, outcomes: "Outcomes[Any]") -> None:
        self._outcomes = outcomes
        self.received: Optional[int] = None  # the first signal's number
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "_StopOnSignals":
        import signal

        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNAL_WORDS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        import signal

        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            raise _SecondSignal(signum)
        self.received = signum
        # The signal may have landed where this thread holds push_many's lock: stopping
        # takes that lock, so another thread does it.
        threading.Thread(target=self._outcomes.stop, name="andpush-stop", daemon=True).start()


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
        api = client._requests.api
        if not isinstance(api, _V1API):
            raise _Failure("the legacy API has no access tokens, only the server key; give "
                           "--credentials (or use Application Default Credentials)")
        print(api.headers()[1])
    return _EXIT_OK


def _cmd_check(args: "argparse.Namespace") -> int:
    with _client(args) as client:
        api = client._requests.api
        if isinstance(api, _V1API):
            api.headers()
            print("credentials   ok: got an access token")
            print("project       %s" % urllib.parse.unquote(api.project_path().split("/")[-1]))
            message: Union[Message, LegacyMessage] = (
                {"token": args.token} if args.token else {"topic": _CHECK_TOPIC})
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


def _cmd_fake_fcm(args: "argparse.Namespace") -> int:
    import signal

    _refuse_options(args, "fake-fcm is the fake FCM itself")
    fcm = FakeFCM(args.project_id or _FAKE_PROJECT, port=args.port)
    stopped: List[int] = []  # the signal that stops it, or 0 when stdout's reader left
    done = threading.Event()

    def log_message(received: ReceivedMessage) -> None:
        try:
            print(_message_line(received), flush=True)
        except (OSError, ValueError):  # stdout's reader went away (| head)
            fcm._on_message = None
            stopped.append(0)
            done.set()

    def stop(signum: int, frame: object) -> None:
        stopped.append(signum)
        done.set()

    if not args.quiet:
        fcm._on_message = log_message
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, stop) for signum in _SIGNAL_WORDS}
    try:
        with fcm:
            _say("fake FCM for project %s at %s (plain HTTP: %s)" % (
                fcm.project_id, fcm.endpoint, "http://127.0.0.1:%d" % fcm.port))
            _say("CA file: %s" % fcm.ca_file)
            _say("service account key file: %s" % fcm.service_account_file)
            _say("access token: %s, legacy server key: %s" % (fcm.access_token, fcm.server_key))
            _say("one JSON line per message on stdout; Ctrl-C stops" if not args.quiet
                 else "Ctrl-C stops")
            while not done.wait(3600):
                pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    counts = fcm.counts
    _say("stopped: %s messages received, %s delivered, %s connections" % (
        _number(counts["messages"]), _number(counts["delivered"]),
        _number(counts["connections"])))
    if stopped and stopped[0] == 0:
        _discard_stdout()
        return _EXIT_CLOSED_OUTPUT
    return _EXIT_OK


def _message_line(received: ReceivedMessage) -> str:
    """fake-fcm's line for a message it received: when, how, what it answered, the message."""
    return json.dumps({
        "time": round(received.time, 6), "api": received.api, "protocol": received.protocol,
        "connection": received.connection, "validate_only": received.validate_only,
        "status": received.status, "error": received.error, "name": received.name,
        "tokens": list(received.tokens), "message": received.message,
    }, ensure_ascii=False)


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
    """What send-many has recorded: failures by error code, dead tokens; each outcome also
    written to the --results and --unregistered files, when given. The counts of sent and
    failed messages are the Outcomes'."""

    def __init__(self, results: Optional[TextIO], unregistered: Optional[TextIO]) -> None:
        self.failures: Dict[str, int] = {}
        self.unregistered = 0
        self.not_sent = 0  # messages taken and not sent, as the run stopped
        self.stopped: Optional[str] = None  # why the run stopped early, if it did
        self.output_closed = False  # a file's reader went away (a closed pipe)
        self._results = results
        self._unregistered_file = unregistered
        self._started = time.monotonic()

    def add(self, token: Optional[str], outcome: Outcome) -> None:
        """Count a failure by its code, then write the outcome: a file whose reader went
        away (a closed pipe) is written no more, and the summary still counts it. A message
        the run took and did not send, as it stopped, is neither: it counts as not sent."""
        if isinstance(outcome, _Stopped):
            self.not_sent += 1
            return
        record = _record(token, outcome)
        code = record["error"]
        if not record["ok"]:
            self.failures[code] = self.failures.get(code, 0) + 1
        if code in _UNREGISTERED_CODES:
            self.unregistered += 1
        self._results = self._write(self._results, json.dumps(record))
        if code in _UNREGISTERED_CODES and token is not None:
            self._unregistered_file = self._write(self._unregistered_file, token)

    def failed(self, outcomes: "Outcomes[Any]") -> int:
        """The messages that failed: the Outcomes' failures but for those not sent."""
        return outcomes.failure_count - self.not_sent

    def _write(self, file: Optional[TextIO], line: str) -> Optional[TextIO]:
        """Write a line to ``file``; the file, or None if its reader went away."""
        if file is None:
            return None
        try:
            file.write(line + "\n")
        except BrokenPipeError:
            self.output_closed = True
            self.stopped = self.stopped or "the output was closed"
            return None
        return file

    def report(self, outcomes: "Outcomes[Any]", unregistered_path: Optional[str], unknown: int,
               total: Optional[int]) -> None:
        """The summary, on stderr; for a run stopped early, what became of every message
        (``total``: how many the file holds, if known; ``unknown``: outcomes never seen)."""
        sent, failed = outcomes.success_count, self.failed(outcomes)
        _say(_summary(sent, self.failures, time.monotonic() - self._started))
        if unregistered_path:
            _say("%s unregistered tokens written to %s" % (
                _number(self.unregistered), "stdout" if unregistered_path == "-"
                else repr(unregistered_path)))
        if self.stopped:
            taken = sent + failed + unknown  # the not sent come after these
            parts = ["%s sent" % _number(sent), "%s failed" % _number(failed)]
            if unknown:
                parts.append("%s unknown (in flight: they may have been delivered)"
                             % _number(unknown))
            parts.append("%s not sent" % _number(max(0, total - taken)) if total is not None
                         else "the messages after the first %s not sent" % _number(taken))
            _say("%s: %s" % (self.stopped, ", ".join(parts)))


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
