"""Users and their permissions (`broky serve --users FILE`).

A users file (TOML) names each user, its credential and what it may do:

    [users.alice]
    password = "pbkdf2-sha256$200000$<salt>$<hash>"   # `broky passwd` prints it
    publish = { allow = ["orders.>"], deny = ["orders.internal.>"] }
    subscribe = { allow = ["orders.>", "prices.*"] }
    groups = true       # may subscribe in a consumer group (default true)
    http = true         # may publish and subscribe through the HTTP gateway (default true)

    [users.reporting]
    cert_subject = "CN=reporting"   # under mutual TLS, the client certificate stands for the password
                                    # (a token sent beside it must be this user's, and right)

Theory of operation
-------------------
Credentials. A client names its user in Hello.auth_token as `name:password`
(the SDK writes it from user= and password=): the field already travels
inside TLS when the connection has it (schema/README.md 2.1), every client of
the SDK carries it on every connection it makes, and a server without
--users keeps reading it as the shared token. The password is stored as
PBKDF2-HMAC-SHA256 with a per-user random salt, `pbkdf2-sha256$ITER$SALT$HASH`
(salt and hash base64), and compared with hmac.compare_digest. PBKDF2 is slow
on purpose (about 0.1 s at the default iterations), which a handshake must not
pay each time: a password once verified is remembered as its SHA-256 (in
memory only, per user, dropped at a reload), so the next handshakes of that
client cost one SHA-256 and one constant-time compare; a wrong password pays
the whole PBKDF2, in a thread (hashlib releases the GIL) off the event loop:
one thread per process (`_slow_check`), so that clients sending wrong
passwords, which need no credential to do so, get their checks queued one
after the other and can take at most one core of a process, never the cores
its event loop and the other processes serve with.
--auth-token with --users: the token still admits, as the operator's key
with every permission (no user); without --auth-token the master makes a
random one that only its own HTTP gateway knows.

Permissions, in the style of NATS authorization: publish and subscribe each
have `allow` (absent: everything) and `deny` (absent: nothing) pattern lists,
in Broky's pattern syntax (broky.matching); deny wins. A publish's key is
allowed when an allow pattern matches it and no deny pattern does. A
Subscribe's pattern is allowed when an allow pattern covers it (matches every
key it matches) and no deny pattern meets it (matches a key it matches): a
subscription never receives a key its user may not read. The refusal names
the pattern: the deny pattern met, or the allow list that covers nothing.

The hot path. A connection of a user allowed everything is served exactly as
without --users (Connection.perms is None). For another user the worker's
read loop uses the user's own route cache (`Permissions.routes`, one per user
and worker) instead of the worker's: a cached route there is a key the user
may publish, so the compiled fast path serves it at the same cost; a key not
cached there is checked once (`publish_refusal`) and, allowed, its route is
copied in from the worker's cache; refused, it is remembered in `refused` (a
bounded dict) and answered PERMISSION_DENIED. Every change of the
subscriptions that empties the worker's cache empties the users' too.

Reload (SIGHUP): the master reads the file again and sends it to every worker
(broky.server.handoff USERS); a worker swaps the rules of each connection's
user, and ends each subscription the new rules refuse with a PERMISSION_DENIED
Error carrying its sid (the SDK ends that subscription and calls on_error).
A user removed from the file keeps its connections but may do nothing more
(all refused): reconnecting fails with AUTH_FAILED.
"""

from __future__ import annotations

import base64
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from broky.errors import BadPatternError
from broky.matching import GT, STAR, parse_pattern, pattern_matches

SCHEME = "pbkdf2-sha256"
DEFAULT_ITERATIONS = 200_000
SALT_BYTES = 16
REFUSED_CACHE_SIZE = 4096  # refused keys remembered per user and worker
REFUSED_CACHE_MAX_KEY = 256  # ... of at most this many bytes (as the route cache's keys)


def hash_password(password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """The stored form of a password: `pbkdf2-sha256$ITERATIONS$SALT$HASH` (base64)."""
    import hashlib  # here: a server without --users never loads OpenSSL's digests (0.7 MB)

    salt = os.urandom(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"{SCHEME}${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def parse_hash(stored: str) -> tuple[int, bytes, bytes]:
    """(iterations, salt, hash) of a stored password; ValueError when it is not one."""
    parts = stored.split("$")
    if len(parts) != 4 or parts[0] != SCHEME:
        raise ValueError(f"a password must be stored as {SCHEME}$ITERATIONS$SALT$HASH (broky passwd)")
    iterations = int(parts[1])
    if iterations < 1:
        raise ValueError("iterations must be positive")
    return iterations, base64.b64decode(parts[2], validate=True), base64.b64decode(parts[3], validate=True)


def verify_password(stored: str, password: str) -> bool:
    """Whether `password` is the one `stored` was made from (constant-time compare)."""
    import hashlib
    import hmac

    iterations, salt, digest = parse_hash(stored)
    given = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return hmac.compare_digest(given, digest)


def covers(allow: list[bytes], pattern: list[bytes]) -> bool:
    """Whether every key `pattern` matches is matched by `allow` (token lists)."""
    for i, a in enumerate(allow):
        if a == GT:
            return i < len(pattern)
        if i >= len(pattern):
            return False
        p = pattern[i]
        if p == GT or (a != STAR and (p == STAR or p != a)):
            return False
    return len(pattern) == len(allow)


def meets(deny: list[bytes], pattern: list[bytes]) -> bool:
    """Whether some key is matched by both patterns (token lists)."""
    for i, d in enumerate(deny):
        if d == GT:
            return i < len(pattern)
        if i >= len(pattern):
            return False
        p = pattern[i]
        if p == GT:
            return True
        if d != STAR and p != STAR and p != d:
            return False
    return len(pattern) == len(deny)


class Rules:
    """Allow and deny patterns for one direction (publish or subscribe)."""

    __slots__ = ("allow", "deny")

    def __init__(self, allow: list[bytes] | None, deny: list[bytes]) -> None:
        self.allow = None if allow is None else [(p, parse_pattern(p)) for p in allow]
        self.deny = [(p, parse_pattern(p)) for p in deny]

    @property
    def everything(self) -> bool:
        return self.allow is None and not self.deny

    def key_refusal(self, key: bytes) -> str | None:
        """None when a publish of `key` is allowed, else why not (naming the pattern)."""
        for p, tokens in self.deny:
            if pattern_matches(tokens, key):
                return f"denied by the pattern '{p.decode(errors='replace')}'"
        if self.allow is not None and not any(pattern_matches(t, key) for _, t in self.allow):
            return "matched by no allowed pattern (" + _listed(self.allow) + ")"
        return None

    def pattern_refusal(self, pattern: bytes) -> str | None:
        """None when a subscription to `pattern` is allowed, else why not."""
        tokens = parse_pattern(pattern)
        for p, d in self.deny:
            if meets(d, tokens):
                return f"it meets the denied pattern '{p.decode(errors='replace')}'"
        if self.allow is not None and not any(covers(a, tokens) for _, a in self.allow):
            return "covered by no allowed pattern (" + _listed(self.allow) + ")"
        return None


def _listed(patterns: list[tuple[bytes, list[bytes]]]) -> str:
    return ", ".join(f"'{p.decode(errors='replace')}'" for p, _ in patterns) or "none"


class User:
    """One user of the file: its credential and permissions."""

    __slots__ = ("name", "password", "cert_subject", "publish", "subscribe", "groups", "http", "source")

    def __init__(self, name: str, data: dict[str, Any]) -> None:
        known = {"password", "cert_subject", "publish", "subscribe", "groups", "http"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"user {name!r}: unknown setting(s) {', '.join(sorted(unknown))}")
        if ":" in name or not name:
            raise ValueError(f"user name {name!r}: must be non-empty and without ':'")
        self.name = name
        self.source = data
        self.password: str | None = data.get("password")
        if self.password is not None:
            parse_hash(self.password)
        self.cert_subject: str | None = data.get("cert_subject")
        if self.password is None and self.cert_subject is None:
            raise ValueError(f"user {name!r}: needs a password (a hash: broky passwd) or a cert_subject")
        self.publish = _rules(name, "publish", data.get("publish", {}))
        self.subscribe = _rules(name, "subscribe", data.get("subscribe", {}))
        self.groups = bool(data.get("groups", True))
        self.http = bool(data.get("http", True))

    @property
    def everything(self) -> bool:
        """Allowed everything: its connections are served as without --users."""
        return self.publish.everything and self.subscribe.everything and self.groups


def _rules(name: str, what: str, data: Any) -> Rules:
    if not isinstance(data, dict) or set(data) - {"allow", "deny"}:
        raise ValueError(f"user {name!r}: {what} must be a table of 'allow' and 'deny' lists")

    def patterns(key: str) -> list[bytes] | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"user {name!r}: {what}.{key} must be a list of patterns")
        return [p.encode() for p in value]

    try:
        return Rules(patterns("allow"), patterns("deny") or [])
    except BadPatternError as exc:
        raise ValueError(f"user {name!r}: {what}: {exc}") from exc


class Users:
    """The users of one users file."""

    def __init__(self, data: dict[str, Any]) -> None:
        table = data.get("users", {})
        if not isinstance(table, dict) or set(data) - {"users"}:
            raise ValueError("a users file holds [users.NAME] tables only")
        self.data = data
        self.by_name = {name: User(name, entry) for name, entry in table.items()}
        self.by_subject = {u.cert_subject: u for u in self.by_name.values() if u.cert_subject}
        self._verified: dict[str, bytes] = {}  # name -> SHA-256 of the password once verified

    @classmethod
    def load(cls, path: str) -> Users:
        """Read a users file; ValueError (naming the file) when it does not read."""
        import tomllib

        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            return cls(data)
        except (OSError, tomllib.TOMLDecodeError, ValueError, TypeError) as exc:
            raise ValueError(f"users file {path}: {exc}") from exc

    def split(self, token: str | None) -> tuple[User, str] | None:
        """The user a `name:password` token names, with the password; None when it names none."""
        name, sep, password = (token or "").partition(":")
        user = self.by_name.get(name) if sep else None
        if user is None or user.password is None:
            return None
        return user, password

    def remembered(self, user: User, password: str) -> bool:
        """Whether this password was verified before (cheap: no PBKDF2)."""
        import hashlib
        import hmac

        kept = self._verified.get(user.name)
        return kept is not None and hmac.compare_digest(hashlib.sha256(password.encode()).digest(), kept)

    def verify(self, user: User, password: str) -> bool:
        """The full check (PBKDF2: slow; run it off the event loop). Remembers a success."""
        import hashlib

        assert user.password is not None
        if verify_password(user.password, password):
            self._verified[user.name] = hashlib.sha256(password.encode()).digest()
            return True
        return False

    def check(self, token: str | None) -> User | None:
        """The user of a token, verified (blocking); None when it admits no one."""
        found = self.split(token)
        if found is None:
            return None
        user, password = found
        return user if self.remembered(user, password) or self.verify(user, password) else None


def subject_of(cert: dict[str, Any] | None) -> str | None:
    """'CN=x,O=y' from ssl's getpeercert() dict (its subject's attributes, in order)."""
    if not cert or "subject" not in cert:
        return None
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
             "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}  # fmt: skip
    parts = [f"{short.get(k, k)}={v}" for rdn in cert["subject"] for k, v in rdn]
    return ",".join(parts)


class Permissions:
    """What one user may do on one worker, with its own route cache (the hot path)."""

    __slots__ = ("user", "routes", "refused")

    def __init__(self, user: User | None) -> None:
        self.user = user  # None: a user gone from the file (everything refused)
        self.routes: dict[object, Any] = {}
        self.refused: dict[bytes, str] = {}  # keys it may not publish -> why (bounded)

    @property
    def name(self) -> str:
        return self.user.name if self.user is not None else "?"

    def publish_refusal(self, key: bytes) -> str | None:
        try:
            return self.refused[key]
        except KeyError:
            pass
        why = self.user.publish.key_refusal(key) if self.user is not None else "the user is gone"
        if why is not None and len(key) <= REFUSED_CACHE_MAX_KEY:  # (big keys are not kept)
            if len(self.refused) >= REFUSED_CACHE_SIZE:
                self.refused.clear()
            self.refused[key] = why
        return why

    def subscribe_refusal(self, pattern: bytes, group: bool) -> str | None:
        user = self.user
        if user is None:
            return "the user is gone from the users file"
        if group and not user.groups:
            return f"user {user.name!r} may not use groups"
        return user.subscribe.pattern_refusal(pattern)


class WorkerUsers:
    """A worker's users: the rules from the master, one Permissions per limited user."""

    def __init__(self, users: Users) -> None:
        self.users = users
        self.perms: dict[str, Permissions] = {}

    def identify(self, token: str | None, subject: str | None = None) -> str | None:
        """The user of a connection whose Hello carried `token` (checked already: by the
        master, or inside TLS), or whose client certificate had `subject`; None for the
        server's own token (or none, without --users)."""
        user = self.users.by_subject.get(subject) if subject else None
        if user is not None:
            return user.name
        found = self.users.split(token)
        return None if found is None else found[0].name

    def permissions(self, name: str) -> Permissions | None:
        """A user's Permissions on this worker; None when it may do everything."""
        perms = self.perms.get(name)
        if perms is not None:
            return perms
        user = self.users.by_name.get(name)
        if user is not None and user.everything:
            return None
        perms = self.perms[name] = Permissions(user)
        return perms

    def replace(self, users: Users) -> None:
        """A reload: every Permissions takes its user's new rules (or none: gone)."""
        self.users = users
        for name, perms in self.perms.items():
            perms.user = users.by_name.get(name)
            perms.routes.clear()
            perms.refused.clear()

    def forget_routes(self) -> None:
        for perms in self.perms.values():
            perms.routes.clear()


async def admits(
    server_token: str | None, users: Users | None, given: str | None, subject: str | None = None
) -> bool:
    """Whether a Hello's auth_token (or, under mutual TLS, the client certificate's
    subject) admits the client: the server's token, or a user's `name:password` (the
    PBKDF2 runs in a thread when that password was not verified before), or a
    certificate whose subject stands for a user, with no token. A token sent beside
    such a certificate must be right too, and name that user: a wrong password, or
    another user's, is refused (AUTH_FAILED) rather than overridden by the certificate
    without a word. (The server's own token beside it admits, as that user: the
    narrower of the two.)"""
    if server_token is None and users is None:
        return True
    import asyncio
    import hmac

    if server_token and hmac.compare_digest((given or "").encode(), server_token.encode()):
        return True
    if users is None:
        return False
    by_cert = users.by_subject.get(subject) if subject else None
    if by_cert is not None and not given:
        return True
    found = users.split(given)
    loop = asyncio.get_running_loop()
    if found is None:  # as slow as a wrong password: the time does not tell which names exist
        await loop.run_in_executor(_slow_check(), verify_password, _dummy(), given or "")
        return False
    user, password = found
    verified = users.remembered(user, password) or await loop.run_in_executor(
        _slow_check(), users.verify, user, password
    )
    return verified and (by_cert is None or user is by_cert)


_SLOW_CHECK: list[ThreadPoolExecutor] = []


def _slow_check() -> ThreadPoolExecutor:
    """The one thread of this process that runs PBKDF2 checks (made at the first)."""
    if not _SLOW_CHECK:
        _SLOW_CHECK.append(ThreadPoolExecutor(1, thread_name_prefix="broky-pbkdf2"))
    return _SLOW_CHECK[0]


_DUMMY: list[str] = []


def _dummy() -> str:
    """A hash no password matches, checked for an unknown user (made once)."""
    if not _DUMMY:
        _DUMMY.append(hash_password(base64.b64encode(os.urandom(16)).decode()))
    return _DUMMY[0]
