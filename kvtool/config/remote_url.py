"""Remote-tier URLs: parse and check them, mask their secrets, build the redis-py client.

The remote tier (`kvtool.tiers.remote_store`) talks to a server its users already run: Redis OSS >= 6.2
or Valkey, over RESP, one node or a Redis Cluster. A URL names it:

    redis://[[user]:password@]host[:port][/db]      plain TCP (port 6379 by default)
    rediss://...                                    TLS; options in the query string (below)
    unix:///path/to/redis.sock[?db=N]               a Unix socket
    redis+cluster://[[user]:password@]host[:port]   a Redis Cluster (any node: the others are found)
    rediss+cluster://...                            a Redis Cluster over TLS

Query options: `db` (not for a cluster), `username` / `password` (where the URL has no user
info, e.g. `unix://`), and for TLS `ssl_ca_certs` (CA bundle file), `ssl_certfile` /
`ssl_keyfile` (client certificate), `ssl_cert_reqs` (`required` (default), `optional`, `none`),
`ssl_check_hostname` (`true` / `false`). Anything else is refused, so a typo is an error and not
an option silently ignored.

Secrets: the password comes from the URL (user info or `password=`), else from the environment
variable `KVTOOL_REMOTE_PASSWORD`. It is never logged nor printed: every message and JSON
document shows `mask_url(url)` (`redis://user:***@host:6379`), and `describe_error` removes the
password from any server or library message it quotes.

This module imports only the standard library at import time (the config validates URLs with
it); redis-py is imported when a client is built.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtool.errors import KVToolError

if TYPE_CHECKING:
    import redis

PASSWORD_ENV = "KVTOOL_REMOTE_PASSWORD"
URL_ENV = "KVTOOL_REMOTE_URL"
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
MAX_URL_CHARS = 4096
URL_EXAMPLES = "e.g. redis://host:6379/0, rediss://:PASSWORD@host:6380, unix:///run/redis.sock, redis+cluster://host:7000"
_QUERY_KEYS = ("db", "username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
               "ssl_check_hostname")  # fmt: skip
_CERT_REQS = ("required", "optional", "none")
_MASK = "***"
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^@/?#]*)@")
_SECRET_PARAM = re.compile(r"([?&](?:password|pass|pwd|auth)=)[^&#]*", re.IGNORECASE)


class RemoteURLError(KVToolError):
    """A malformed remote URL (exit 2). The message shows the URL masked, never its password."""


class RemoteConnectError(KVToolError):
    """The remote server could not be used: unreachable, refused, timed out, wrong password, TLS
    failure, not a cluster (exit 2). One line, URL masked."""


def mask_url(url: object) -> str:
    """`url` with its password replaced by `***`: user info (`redis://user:***@host`, a user info
    without `:` entirely: `redis://***@host`) and `password=` query values. Works on any text,
    a malformed URL included; never raises."""
    text = str(url)

    def userinfo(m: re.Match[str]) -> str:
        user, sep, _ = m.group(2).partition(":")
        return f"{m.group(1)}{user}:{_MASK}@" if sep else f"{m.group(1)}{_MASK}@"

    return _SECRET_PARAM.sub(lambda m: m.group(1) + _MASK, _USERINFO.sub(userinfo, text, count=1))


@dataclass(frozen=True)
class RemoteURL:
    """A checked remote URL.

    Attributes:
        url: the URL as given (holds the password: show `masked` instead).
        scheme: one of `SCHEMES`.
        cluster: a Redis Cluster (`redis+cluster` / `rediss+cluster`, or asked by the caller).
        tls: TLS (`rediss`, `rediss+cluster`).
        host, port: TCP endpoint (None for a Unix socket).
        path: the Unix socket path (None for TCP).
        db: database number (0 for a cluster).
        username: ACL user, or None (the server's `default` user).
        password: from the URL, else `$KVTOOL_REMOTE_PASSWORD`, else None.
        ssl: TLS options for redis-py (`ssl_ca_certs`, ...).
    """

    url: str = field(repr=False)
    scheme: str
    cluster: bool
    tls: bool
    host: str | None
    port: int | None
    path: str | None
    db: int
    username: str | None
    password: str | None = field(repr=False)
    ssl: dict[str, Any] = field(default_factory=dict)

    @property
    def masked(self) -> str:
        """The URL with its password masked (for messages, logs and JSON)."""
        return mask_url(self.url)

    @property
    def endpoint(self) -> str:
        """`host:port` or the socket path (no secrets)."""
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    def client_kwargs(self, timeout_s: float) -> dict[str, Any]:
        """Keyword arguments for `redis.Redis` / `redis.cluster.RedisCluster` (no pool): socket
        timeouts of `timeout_s` seconds for connect and every read, no retries (a failure is a
        miss at once; the caller's breaker decides when to try again)."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                              "retry": Retry(NoBackoff(), 0), "username": self.username, "password": self.password}  # fmt: skip
        if self.path is not None:
            kw["unix_socket_path"] = self.path
        else:
            kw["host"], kw["port"] = self.host, self.port
        if not self.cluster:
            kw["db"] = self.db
        if self.tls:
            kw["ssl"] = True
            kw.update(self.ssl)
        return kw


def parse_remote_url(url: object, *, cluster: bool | None = None, env: dict[str, str] | None = None) -> RemoteURL:
    """Check a remote URL (see the module docstring) and split it into its parts.

    Args:
        url: the URL text.
        cluster: True / False to force (or refuse) cluster mode; None: the scheme decides.
        env: environment to read `KVTOOL_REMOTE_PASSWORD` from (default `os.environ`).

    Raises:
        RemoteURLError: not a string, empty, spaces or control characters, unknown scheme, no
            host, bad port or db, a path where none belongs, an unknown or repeated query option,
            a cluster URL with a db other than 0, or `cluster=False` with a cluster scheme.
    """
    if not isinstance(url, str):
        raise RemoteURLError(f"remote URL must be a string ({URL_EXAMPLES})")
    shown = mask_url(url)[:200]
    if not url.strip():
        raise RemoteURLError(f"remote URL is empty ({URL_EXAMPLES})")
    if len(url) > MAX_URL_CHARS or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise RemoteURLError(f"remote URL {shown!r}: too long, or holds spaces or control characters")

    def bad(reason: str) -> RemoteURLError:
        return RemoteURLError(f"remote URL {shown!r}: {reason} ({URL_EXAMPLES})")

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise bad(f"malformed: {mask_url(exc)}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or "://" not in url:
        raise bad(f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if parts.fragment:
        raise bad("a '#fragment' has no meaning here")
    is_cluster = scheme.endswith("+cluster")
    if cluster is False and is_cluster:
        raise bad("a cluster URL, but cluster mode is off")
    is_cluster = is_cluster or bool(cluster)
    query = _query(parts.query, bad)
    username = unquote(parts.username) if parts.username else query.get("username")
    password = unquote(parts.password) if parts.password is not None and parts.password != "" else query.get("password")
    if password is None:
        password = (os.environ if env is None else env).get(PASSWORD_ENV) or None
    db = _db(query.get("db"), parts.path if scheme != "unix" else "", bad)
    if is_cluster and db != 0:
        raise bad("a Redis Cluster has database 0 only")
    host, port, path = _address(parts, port, is_cluster, bad)
    tls = scheme.startswith("rediss")
    ssl = _ssl_options(query, bad) if tls else {}
    if not tls and any(k.startswith("ssl_") for k in query):
        raise bad("ssl_* options need rediss:// (TLS)")
    return RemoteURL(url, scheme, is_cluster, tls, host, port, path, db, username, password, ssl)


def _address(parts: Any, port: int | None, is_cluster: bool, bad: Any) -> tuple[str | None, int | None, str | None]:
    """`(host, port, socket path)` of a split URL: a Unix socket's path, else a host and its port
    (`DEFAULT_PORT` when none is given). Raises `bad(reason)`."""
    if parts.scheme.lower() == "unix":
        if is_cluster:
            raise bad("a cluster is reached over TCP, not a Unix socket")
        if parts.netloc.rpartition("@")[2] or not parts.path.startswith("/"):
            raise bad("write unix:///absolute/path/to/redis.sock")
        return None, None, unquote(parts.path)
    if not parts.hostname:
        raise bad("no host")
    if port is not None and port <= 0:
        raise bad("port must be 1..65535")
    return parts.hostname, port or DEFAULT_PORT, None


def _query(text: str, bad: Any) -> dict[str, str]:
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text), max_num_fields=len(_QUERY_KEYS))
    except ValueError as exc:
        raise bad(f"malformed query: {mask_url(exc)}") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key not in _QUERY_KEYS:
            raise bad(f"unknown option {key[:40]!r} (known: {', '.join(_QUERY_KEYS)})")
        if key in out:
            raise bad(f"option {key!r} given twice")
        if not value:
            raise bad(f"option {key!r} is empty")
        out[key] = value
    return out


def _db(query_db: str | None, path: str, bad: Any) -> int:
    text = path.strip("/") if path not in ("", "/") else None
    if text is not None and query_db is not None:
        raise bad("db given twice (path and ?db=)")
    text = text if text is not None else query_db
    if text is None:
        return 0
    if not text.isdigit() or len(text) > 5 or int(text) > 65535:
        raise bad(f"db must be a number 0..65535, got {text[:20]!r}")
    return int(text)


def _ssl_options(query: dict[str, str], bad: Any) -> dict[str, Any]:
    out: dict[str, Any] = {key: query[key] for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if key in query}
    if "ssl_cert_reqs" in query:
        if query["ssl_cert_reqs"] not in _CERT_REQS:
            raise bad(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
        out["ssl_cert_reqs"] = query["ssl_cert_reqs"]
    if "ssl_check_hostname" in query:
        flag = query["ssl_check_hostname"].lower()
        if flag not in ("true", "false"):
            raise bad("ssl_check_hostname must be true or false")
        out["ssl_check_hostname"] = flag == "true"
    return out


def make_client(remote: RemoteURL, timeout_s: float) -> redis.Redis | redis.cluster.RedisCluster:
    """A redis-py client for `remote`: `redis.Redis` over its own connection pool (thread-safe;
    nothing is sent before the first command), or `RedisCluster`, which reads the cluster's slot
    map from a node now.

    Args:
        remote: the parsed URL.
        timeout_s: connect and read timeout of every socket operation (seconds).

    Raises:
        redis.exceptions.RedisError: a cluster whose slot map cannot be read (unreachable,
            refused, wrong password, not a cluster). `describe_error` words it.
    """
    import redis
    import redis.cluster

    kw = remote.client_kwargs(timeout_s)
    if remote.cluster:
        return redis.cluster.RedisCluster(require_full_coverage=False, dynamic_startup_nodes=True, **kw)
    return redis.Redis(**kw)


def describe_error(exc: BaseException, remote: RemoteURL | str, timeout_s: float | None = None) -> str:
    """One line saying why talking to `remote` failed: unreachable, timed out, authentication,
    TLS, cluster, or the server's own error; the URL masked and the password removed from any
    quoted text."""
    masked = remote.masked if isinstance(remote, RemoteURL) else mask_url(remote)
    password = remote.password if isinstance(remote, RemoteURL) else None
    text = " ".join(str(exc).split()) or type(exc).__name__
    if password:
        text = text.replace(password, _MASK)
    text = mask_url(text)[:300]
    kind = type(exc).__name__
    low = text.lower()
    if kind in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError") or "wrongpass" in low or "noauth" in low \
            or "invalid password" in low or "invalid username-password" in low:
        reason = f"authentication failed (wrong user or password?): {text}"
    elif "ssl" in low or "tls" in low or "certificate" in low:
        reason = f"TLS failed: {text}"
    elif isinstance(remote, RemoteURL) and remote.tls and "connecting" in low:
        reason = f"TLS handshake did not complete (does this port speak TLS?): {text}"
    elif kind == "TimeoutError" or "timed out" in low or "timeout" in low:
        after = f" after {timeout_s * 1000:.0f} ms" if timeout_s else ""
        reason = f"timed out{after} (server down, stopped or overloaded?): {text}"
    elif kind in ("ConnectionError", "ConnectionRefusedError", "OSError", "gaierror"):
        reason = f"cannot connect: {text}"
    elif "cluster" in kind.lower() or "cluster" in low:
        reason = f"cluster: {text}"
    else:
        reason = f"{kind}: {text}"
    return f"remote {masked}: {reason}"
