"""mypy --strict on code that uses andpush as its users write it, against the andpush that
mypy finds (in CI: the installed wheel, with its py.typed marker):

- every Python example of the README, each as a module of its own, given the few names
  the README leaves to its surroundings (a device token, a Celery app, ``forget``, ...);
- code that must pass: messages typed by literals and by annotations, the pairs of
  push_many and push_multicast typed as their input, the Outcomes' methods and counts;
- code that must fail: each line of it must have an error that says what is wrong, and no
  other line may have one.

Usage: python check_types.py README.md FOLDER (the files are written to FOLDER); it exits
non-zero, saying why, when mypy's report is not what it must be.
"""

import ast
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Set, Tuple

# The names the README's examples take from their surroundings, as a stub module.
CONTEXT = '''\
from typing import AsyncIterator, Callable, List, TypeVar

import andpush

_Function = TypeVar("_Function", bound=Callable[..., object])

class _CeleryApp:
    def task(self, function: _Function) -> _Function: ...

device_token: str
other_token: str
server_key: str
all_tokens: List[str]
client: andpush.Client
app: _CeleryApp

def forget(token: str) -> None: ...
def fetch_tokens() -> AsyncIterator[str]: ...
def clean(message: andpush.Message, outcome: andpush.Outcome) -> None: ...
'''

# What the FastAPI example needs of fastapi, which is not installed.
FASTAPI = '''\
from typing import Any, Callable, TypeVar

_Function = TypeVar("_Function", bound=Callable[..., object])

class FastAPI:
    state: Any
    def __init__(self, lifespan: Callable[..., Any]) -> None: ...
    def post(self, path: str) -> Callable[[_Function], _Function]: ...
'''

# What the pytest example needs of pytest, which is not installed.
PYTEST = '''\
from typing import Any, Callable, ContextManager, Type, TypeVar

_Function = TypeVar("_Function", bound=Callable[..., object])

def fixture(function: _Function) -> _Function: ...
def raises(expected: Type[BaseException]) -> ContextManager[Any]: ...
'''

MUST_PASS = '''\
from typing import AsyncIterator, Dict, Iterator, List, Optional, Tuple

import andpush


class Personal(andpush.Message, total=False):
    """A user's own message type, a Message with more."""


def bulk(client: andpush.Client, tokens: List[str]) -> int:
    outcomes = client.push_many(
        {"token": t, "android": {"priority": "high", "ttl": "60s",
                                 "notification": {"channelId": "c", "click_action": "OPEN"}},
         "fcmOptions": {"analyticsLabel": "a"}, "data": {"k": "v"}} for t in tokens)
    for message, outcome in outcomes:
        same: andpush.Message = message
        if isinstance(outcome, andpush.Response):
            name: Optional[str] = outcome.message_id
    rest: List[Tuple[andpush.Message, andpush.Outcome]] = outcomes.close()
    outcomes.stop()
    mine: List[Personal] = [{"token": "t"}]
    for personal, _ in client.push_many(mine):
        kept: Personal = personal
    for token, outcome in client.push_multicast({"notification": {"title": "Hi"}}, tokens):
        text: str = token
    return outcomes.success_count + outcomes.failure_count + len(rest)


def built_up(client: andpush.Client) -> None:
    message: andpush.Message = {"token": "t"}
    message["data"] = {"k": "v"}
    message["apns"] = {"headers": {"apns-priority": "10"}, "payload": {"aps": {"badge": 1}}}
    message["webpush"] = {"notification": {"requireInteraction": True}}
    client.push(message, validate_only=True)
    legacy: andpush.LegacyMessage = {"to": "t", "time_to_live": 60, "data": {"n": 1}}
    client.push(legacy)
    client.push({"registration_ids": ["a", "b"], "notification": {"icon": "i"}})
    outcomes: Iterator[Tuple[andpush.Message, andpush.Outcome]] = client.push_many([message])
    print(list(outcomes))


async def asynchronous(client: andpush.AsyncClient, rows: AsyncIterator[str]) -> Dict[str, int]:
    outcomes = client.push_many({"topic": row, "notification": {"body": "b"}} async for row in rows)
    async for message, outcome in outcomes:
        same: andpush.Message = message
    rest: List[Tuple[andpush.Message, andpush.Outcome]] = await outcomes.aclose()
    outcomes.stop()
    multicast = client.push_multicast({"data": {"k": "v"}}, ["a", "b"])
    async for token, outcome in multicast:
        text: str = token
    response = await client.push({"condition": "'a' in topics", "data": {"k": "v"}})
    return {"sent": outcomes.success_count, "failed": outcomes.failure_count + len(rest),
            "status": response.status_code}
'''

# Each line must fail, for the reason given (a fragment of mypy's message).
MUST_FAIL = [
    ('client.push({"token": "t", "notificaton": {"title": "Hi"}})', "incompatible type"),
    ('client.push({"token": "t", "notification": {"titel": "Hi"}})', '"titel"'),
    ('client.push({"token": "t", "data": {"count": 1}})', '"str": "int"'),
    ('client.push({"token": "t", "android": {"priority": 10}})', '"priority"'),
    ('client.push({"token": "t", "apns": {"headers": {"apns-priority": 10}}})', '"int"'),
    ('typo: andpush.Message = {"token": "t", "fcm_option": {}}', '"fcm_option"'),
    ('client.push_many([{"token": "t", "notificaton": {}}])', "push_many"),
    ('number: int = [m for m, _ in client.push_many(messages)][0]', '"Message"'),
    ('number = [t for t, _ in client.push_multicast({}, ["a"])][0] + 1', '"str"'),
    ('text: str = client.push_many(messages).success_count', '"int"'),
    ('client.push_many(messages).aclose()', '"aclose"'),
    ('client.push_many(messages).nothing', '"nothing"'),
    ('client.push(42)', "incompatible type"),
]
MUST_FAIL_HEAD = '''\
from typing import List

import andpush

client = andpush.new(access_token="t", project_id="p")
messages: List[andpush.Message] = []
'''


def examples(readme: str) -> List[str]:
    with open(readme, encoding="utf-8") as file:
        return re.findall(r"```python\n(.*?)```", file.read(), re.DOTALL)


def defined(code: str) -> Set[str]:
    """The names a module's code binds at its top level (not in its functions or
    comprehensions, which have scopes of their own)."""
    names: Set[str] = set()

    class Binder(ast.NodeVisitor):
        def visit_FunctionDef(self, node: Any) -> None:  # and classes: their names only
            names.add(node.name)

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_Lambda(self, node: ast.AST) -> None:  # and comprehensions: scopes of their own
            pass

        visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda

        def visit_Name(self, node: ast.Name) -> None:
            if isinstance(node.ctx, ast.Store):
                names.add(node.id)

        def visit_alias(self, node: ast.alias) -> None:
            names.add((node.asname or node.name).split(".")[0])

    Binder().visit(ast.parse(code))
    return names


def write(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
    return path


def main(readme: str, folder: str) -> int:
    os.makedirs(folder, exist_ok=True)
    write(folder, "readme_context.pyi", CONTEXT)
    write(folder, "fastapi.pyi", FASTAPI)
    write(folder, "pytest.pyi", PYTEST)
    context = set(defined(CONTEXT)) - {"AsyncIterator", "Callable", "List", "TypeVar",
                                       "andpush", "_Function", "_CeleryApp"}
    files: List[str] = []
    for number, code in enumerate(examples(readme), 1):
        names = defined(code)
        taken = sorted(context - names)
        head = "" if "andpush" in names else "import andpush\n"  # an earlier example's
        head += "from readme_context import %s\n" % ", ".join(taken) if taken else ""
        files.append(write(folder, "readme_%d.py" % number, head + code))
    files.append(write(folder, "must_pass.py", MUST_PASS))
    bad_lines: Dict[int, Tuple[str, str]] = {}
    lines = MUST_FAIL_HEAD.splitlines()
    for code, reason in MUST_FAIL:
        lines.append(code)
        bad_lines[len(lines)] = (code, reason)
    files.append(write(folder, "must_fail.py", "\n".join(lines) + "\n"))
    if len(files) < 8:
        print("ERROR: the README has %d Python examples; expected more" % (len(files) - 2))
        return 1

    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-version",
         "3.8", "--show-error-codes", *[os.path.basename(f) for f in files]],
        cwd=folder, capture_output=True, text=True)
    report = done.stdout + done.stderr
    print(report.rstrip())
    errors: Dict[Tuple[str, int], List[str]] = {}
    for file, line, message in re.findall(r"^(\S+?):(\d+): error: (.*)$", report, re.M):
        errors.setdefault((file, int(line)), []).append(message)
    problems = ["%s:%d: %s" % (file, line, "; ".join(messages))
                for (file, line), messages in sorted(errors.items()) if file != "must_fail.py"]
    for line, (code, reason) in sorted(bad_lines.items()):
        messages = errors.pop(("must_fail.py", line), [])
        if not any(reason in message for message in messages):
            problems.append("must_fail.py:%d: no error saying %s: %s" % (line, reason, code))
    problems += ["must_fail.py:%d: an error where none was meant: %s" % (line, messages)
                 for (file, line), messages in sorted(errors.items()) if file == "must_fail.py"]
    if "error:" not in report and done.returncode != 0:
        problems.append("mypy failed: exit status %d" % done.returncode)
    for problem in problems:
        print("ERROR:", problem)
    if not problems:
        print("OK: %d README examples and the typed code pass mypy --strict; the %d lines that "
              "must fail do" % (len(files) - 2, len(MUST_FAIL)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
