"""Remote model URLs: ``SCHEME://HOST[:PORT]/MODEL[/VERSION]``."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from neuropod.storage.urls import redact

#: Scheme -> (protocol, TLS by default, default port). 8000 and 8001 are what
#: ``neuropod serve`` and Triton listen on; https without a port is 443, as
#: behind a load balancer.
SCHEMES: dict[str, tuple[str, bool, int]] = {
    "grpc": ("grpc", False, 8001),
    "grpcs": ("grpc", True, 8001),
    "http": ("http", False, 8000),
    "https": ("http", True, 443),
}

_FORM = "SCHEME://HOST[:PORT]/MODEL[/VERSION] (SCHEME one of grpc, grpcs, http, https)"
_VERSION = re.compile(r"[0-9A-Za-z._-]+")


@dataclass(frozen=True)
class Target:
    """One server and the model on it."""

    #: The URL as given (for messages).
    url: str
    #: "grpc" or "http".
    protocol: str
    tls: bool
    host: str
    port: int
    model: str
    version: str | None

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts in brackets), as grpcio and messages write it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def server(self) -> str:
        """The URL without the model: ``grpc://host:port``."""
        return f"{self.url.split('://', 1)[0].lower()}://{self.address}"


def parse_url(url: str, *, tls: bool | None = None) -> Target:
    """Parse a remote model URL.

    :param tls: force TLS on or off whatever the scheme says (None: the
        scheme decides: grpcs and https are TLS).
    :raises ValueError: the URL is not of the form above, naming what is wrong.
    """
    if not isinstance(url, str):
        raise TypeError(f"a remote model URL is a str, not {type(url).__name__} {url!r:.60}")
    # Shown redacted (no user, password, query or fragment): a URL refused for holding them may hold a secret.
    where = f"Remote model URL {redact(url)!r:.200}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{where} is not a valid URL ({e}); expected {_FORM}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{where}: scheme {parts.scheme!r} is not one of {', '.join(SCHEMES)}; expected {_FORM}")
    protocol, scheme_tls, default_port = SCHEMES[scheme]
    if not parts.hostname:
        raise ValueError(f"{where} names no host; expected {_FORM}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{where} holds user information; pass a token as auth_token= instead")
    if parts.query or parts.fragment:
        raise ValueError(
            f"{where} has a query or fragment (not shown); options are keyword arguments of load_neuropod"
        )
    segments = [unquote(s) for s in parts.path.split("/")[1:]]
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    if not segments or not all(segments) or len(segments) > 2:
        raise ValueError(f"{where} must name one model, and optionally its version, after the address; expected {_FORM}")
    version = segments[1] if len(segments) == 2 else None
    if version is not None and not _VERSION.fullmatch(version):
        raise ValueError(f"{where}: version {version!r} must be letters, digits, '.', '_' or '-'")
    return Target(
        url=url,
        protocol=protocol,
        tls=scheme_tls if tls is None else tls,
        host=parts.hostname,
        port=default_port if port is None else port,
        model=segments[0],
        version=version,
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine by name or address: ``localhost`` (and names under
    ``.localhost``), 127.0.0.0/8, ``::1``, and IPv4-mapped loopback (``::ffff:127.0.0.1``).
    A name is not resolved: any other name counts as remote."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
