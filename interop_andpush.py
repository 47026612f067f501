"""The fake FCM against clients nobody here wrote: firebase-admin (its requests over HTTP/1.1
for ``send`` and ``send_each``, httpx over HTTP/2 for ``send_each_async``) and curl.

Not part of the suite (``python -m unittest`` finds only test*.py): these need packages and
a tool installed, which ``.ci/run`` does in a venv of its own (``pip install firebase-admin
httpx[http2]``, and curl with HTTP2 among its features). Run with
``python -m unittest -v interop_andpush`` there; each test fails rather than skips when what
it needs is missing. The README's ```py examples run here too.
"""

import asyncio
import itertools
import json
import os
import re
import subprocess
import unittest
import unittest.mock
from typing import Any, List

import andpush

_TIMEOUT = 30.0  # seconds a curl run may take
_APPS = itertools.count(1)  # firebase-admin apps are global: each test makes its own


def readme_examples(tag: str) -> List[str]:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")) as file:
        return re.findall(r"```%s\n(.*?)```" % tag, file.read(), re.DOTALL)


class FirebaseAdminTest(unittest.TestCase):
    """firebase-admin-python, its FCM URL pointed at the fake as the README says, gets the
    answers FCM would give."""

    def setUp(self) -> None:
        import firebase_admin
        from firebase_admin import credentials, messaging

        self.fcm = andpush.FakeFCM().start()
        self.addCleanup(self.fcm.close)
        self.addCleanup(lambda: self.assertEqual(self.fcm._errors, []))
        trust = unittest.mock.patch.dict(os.environ, REQUESTS_CA_BUNDLE=self.fcm.ca_file,
                                         SSL_CERT_FILE=self.fcm.ca_file)
        trust.start()
        self.addCleanup(trust.stop)
        self.app = firebase_admin.initialize_app(
            credentials.Certificate(self.fcm.service_account_file),
            name="interop-%d" % next(_APPS))
        self.addCleanup(firebase_admin.delete_app, self.app)
        service = messaging._get_messaging_service(self.app)
        service._fcm_url = self.fcm.endpoint + "/v1/projects/fake-project/messages:send"
        service._fcm_topic_url = self.fcm.endpoint + "/v1/projects/fake-project/registrations"

    def message(self, token: str) -> Any:
        """A message with what firebase-admin encodes for each platform."""
        from firebase_admin import messaging

        return messaging.Message(
            token=token, data={"order": "42"},
            notification=messaging.Notification(title="Hi", body="Ready"),
            android=messaging.AndroidConfig(
                ttl=3600.5, priority="high", collapse_key="orders",
                notification=messaging.AndroidNotification(color="#ff8800", tag="t")),
            apns=messaging.APNSConfig(
                headers={"apns-priority": "10"},
                payload=messaging.APNSPayload(aps=messaging.Aps(badge=1, sound="default"))),
            webpush=messaging.WebpushConfig(fcm_options=messaging.WebpushFCMOptions(
                link="https://example.com/orders")),
            fcm_options=messaging.FCMOptions(analytics_label="orders"))

    def test_send_goes_through_the_token_endpoint_and_is_accepted_over_http11(self) -> None:
        from firebase_admin import messaging

        name = messaging.send(self.message("t1"), app=self.app)
        self.assertEqual(name, "projects/fake-project/messages/0:1")
        (received,) = self.fcm.messages
        self.assertEqual((received.token, received.protocol, received.status),
                         ("t1", "HTTP/1.1", 200))
        self.assertEqual(received.message["android"]["ttl"], "3600.500000000s")
        self.assertEqual(self.fcm.counts["access_tokens"], 1)

    def test_send_dry_run_is_validate_only(self) -> None:
        from firebase_admin import messaging

        name = messaging.send(self.message("t1"), dry_run=True, app=self.app)
        self.assertTrue(name.endswith("/fake_message_id"))
        self.assertTrue(self.fcm.messages[0].validate_only)

    def test_fcms_errors_raise_firebase_admins_exceptions(self) -> None:
        from firebase_admin import exceptions, messaging

        self.fcm.unregister("gone")
        self.fcm.move_to_other_project("foreign")
        self.fcm.answer("QUOTA_EXCEEDED", token="busy", retry_after=0, times=None)
        self.fcm.answer("THIRD_PARTY_AUTH_ERROR", token="apns", times=None)
        for token, error in [("gone", messaging.UnregisteredError),
                             ("foreign", messaging.SenderIdMismatchError),
                             ("busy", messaging.QuotaExceededError),
                             ("apns", messaging.ThirdPartyAuthError)]:
            with self.subTest(error.__name__), self.assertRaises(error):
                messaging.send(self.message(token), app=self.app)
        self.fcm.answer("INVALID_ARGUMENT")
        with self.assertRaises(exceptions.InvalidArgumentError):
            messaging.send(self.message("t1"), app=self.app)

    def test_send_each_pairs_each_answer_with_its_message(self) -> None:
        from firebase_admin import messaging

        self.fcm.unregister("t3")
        batch = messaging.send_each([self.message("t%d" % i) for i in range(8)], app=self.app)
        self.assertEqual((batch.success_count, batch.failure_count), (7, 1))
        self.assertIsInstance(batch.responses[3].exception, messaging.UnregisteredError)
        self.assertEqual({m.protocol for m in self.fcm.messages}, {"HTTP/1.1"})
        self.assertEqual(sorted(m.token for m in self.fcm.messages), ["t%d" % i for i in range(8)])

    def test_send_each_async_speaks_http2_through_httpx(self) -> None:
        from firebase_admin import messaging

        self.fcm.unregister("t1")
        messages = [self.message("t%d" % i) for i in range(5)]

        async def send_each() -> Any:
            try:
                return await messaging.send_each_async(messages, dry_run=False, app=self.app)
            finally:  # in this event loop: delete_app() would close it in a new one, and fail
                await messaging._get_messaging_service(self.app)._async_client.aclose()

        batch = asyncio.run(send_each())
        self.assertEqual((batch.success_count, batch.failure_count), (4, 1))
        self.assertIsInstance(batch.responses[1].exception, messaging.UnregisteredError)
        self.assertEqual({m.protocol for m in self.fcm.messages}, {"HTTP/2"})

    def test_topic_management_keeps_the_memberships_a_topic_send_reaches(self) -> None:
        from firebase_admin import messaging

        answer = messaging.subscribe_to_topic(["a", "b", "c"], "news", app=self.app)
        self.assertEqual(answer.success_count, 3)
        messaging.unsubscribe_from_topic(["b", "stranger"], "news", app=self.app)
        self.assertEqual(self.fcm.members("news"), {"a", "c"})
        messaging.send(messaging.Message(topic="news", data={"k": "v"}), app=self.app)
        self.assertEqual(self.fcm.messages[0].tokens, ("a", "c"))

    def test_the_readmes_recipe_sends_through_the_fake(self) -> None:
        import firebase_admin

        (recipe,) = [e for e in readme_examples("py") if "firebase_admin" in e]
        namespace = {"fcm": self.fcm}
        exec(compile(recipe, "the README's firebase-admin example", "exec"), namespace)
        self.addCleanup(firebase_admin.delete_app, firebase_admin.get_app())
        self.assertEqual(self.fcm.messages[0].token, "t1")


class CurlTest(unittest.TestCase):
    """curl, over HTTP/2 with TLS and ALPN, and over plain HTTP, gets FCM's answers."""

    def setUp(self) -> None:
        version = subprocess.run(["curl", "--version"], capture_output=True, text=True,
                                 check=True).stdout
        self.assertIn("HTTP2", version, "this curl cannot speak HTTP/2")
        self.fcm = andpush.FakeFCM().start()
        self.addCleanup(self.fcm.close)
        self.addCleanup(lambda: self.assertEqual(self.fcm._errors, []))

    def curl(self, *options: str, message: Any, url: str) -> Any:
        """FCM's answer (JSON), with the HTTP status and version curl reports."""
        done = subprocess.run(
            ["curl", "--silent", "--show-error", "--cacert", self.fcm.ca_file, "--write-out",
             "\n%{http_code} %{http_version}", "-H", "Content-Type: application/json", *options,
             "--data", json.dumps(message), url],
            capture_output=True, text=True, timeout=_TIMEOUT, check=True)
        body, _, status_version = done.stdout.rpartition("\n")
        status, version = status_version.split()
        return int(status), version, json.loads(body)

    def send(self, *options: str, message: Any, plain: bool = False) -> Any:
        endpoint = self.fcm.endpoint.replace("https:", "http:") if plain else self.fcm.endpoint
        return self.curl("-H", "Authorization: Bearer " + self.fcm.access_token, *options,
                         message={"message": message},
                         url=endpoint + "/v1/projects/fake-project/messages:send")

    def test_a_send_over_http2_gets_its_name(self) -> None:
        status, version, answer = self.send("--http2", message={"token": "t1", "data": {"a": "b"}})
        self.assertEqual((status, version), (200, "2"))
        self.assertEqual(answer, {"name": "projects/fake-project/messages/0:1"})
        self.assertEqual(self.fcm.messages[0].protocol, "HTTP/2")

    def test_errors_come_in_fcms_envelope(self) -> None:
        self.fcm.unregister("gone")
        status, _, answer = self.send("--http2", message={"token": "gone"})
        self.assertEqual((status, answer["error"]["details"][0]["errorCode"]),
                         (404, "UNREGISTERED"))
        status, _, answer = self.send("--http2", message={"token": "t1", "data": {"n": 1}})
        self.assertEqual((status, answer["error"]["status"]), (400, "INVALID_ARGUMENT"))
        status, _, answer = self.curl("--http2", message={"message": {"token": "t1"}},
                                      url=self.fcm.endpoint + "/v1/projects/fake-project/"
                                      "messages:send")
        self.assertEqual((status, answer["error"]["status"]), (401, "UNAUTHENTICATED"))

    def test_plain_http_with_and_without_http2(self) -> None:
        for options, expected in [(["--http2-prior-knowledge"], "2"), (["--http1.1"], "1.1")]:
            with self.subTest(options):
                status, version, _ = self.send(*options, message={"token": "t1"}, plain=True)
                self.assertEqual((status, version), (200, expected))

    def test_the_legacy_api_over_http11(self) -> None:
        status, version, answer = self.curl(
            "--http1.1", "-H", "Authorization: key=" + self.fcm.server_key,
            message={"registration_ids": ["a", "b"], "data": {"k": "v"}},
            url=self.fcm.endpoint + "/fcm/send")
        self.assertEqual((status, version, answer["success"]), (200, "1.1", 2))


if __name__ == "__main__":
    unittest.main()
