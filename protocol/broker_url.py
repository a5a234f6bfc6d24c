"""MQTT broker URLs: ``mqtt://`` / ``mqtts://`` text to a :class:`BrokerAddress`.

Used by the agent (``fedfleet-agent --broker``) and the server alike; it needs nothing beyond the
standard library (no paho, no broker code).
"""

from __future__ import annotations

import dataclasses
from urllib.parse import unquote, urlsplit

__all__ = ["DEFAULT_PORTS", "BrokerAddress", "parse_broker_url"]

#: Default TCP port per URL scheme (IANA: 1883 plain MQTT, 8883 MQTT over TLS).
DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


@dataclasses.dataclass(frozen=True, slots=True)
class BrokerAddress:
    """Where an MQTT broker listens, parsed from a URL by ``parse_broker_url``.

    Attributes:
        scheme: ``"mqtt"`` (plain TCP) or ``"mqtts"`` (TLS).
        host: host name or IP address, without IPv6 brackets (``"::1"``), lower case.
        port: TCP port, 1..65535 (1883 for ``mqtt``, 8883 for ``mqtts`` when the URL has none).
        username: MQTT user name (percent-decoded), or None when the URL has none.
        password: MQTT password (percent-decoded), or None when the URL has none. Not shown in
            ``repr()``.
    """

    scheme: str
    host: str
    port: int
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        """True for ``mqtts`` (connect with TLS)."""
        return self.scheme == "mqtts"


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for error messages)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if password:
        return url.replace(f":{password}@", ":***@", 1)
    return url


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://[user[:password]@]host[:port][/]`` or ``mqtts://...`` into a BrokerAddress.

    Any host is accepted (this is for real brokers too, not only the embedded one). The user name
    and password are percent-decoded. The scheme is case-insensitive.

    Raises:
        TypeError: ``url`` is not a ``str``.
        ValueError: the scheme is not ``mqtt`` or ``mqtts``; the host is missing; the port is not
            an integer in 1..65535; the URL has a path, query or fragment; or it has a password
            without a user name (MQTT 3.1.1 §3.1.2.9 forbids that). The message never contains
            the password.
    """
    if not isinstance(url, str):
        raise TypeError(f"broker URL must be a str, got {type(url).__name__}")
    text = url.strip()
    shown = _redact(text)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        hint = "" if "://" in text else " (did you forget the 'mqtt://' prefix?)"
        raise ValueError(
            f"unsupported broker URL {shown!r}: scheme must be 'mqtt' or 'mqtts', "
            f"got {parts.scheme!r}{hint}"
        )
    host = parts.hostname
    if not host:
        raise ValueError(f"broker URL {shown!r} has no host; expected {scheme}://HOST[:PORT]")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"broker URL {shown!r} has a bad port ({exc}); expected an integer in 1..65535"
        ) from exc
    if port is None:
        port = DEFAULT_PORTS[scheme]
    elif not 1 <= port <= 65535:
        raise ValueError(f"broker URL {shown!r} has port {port}; expected an integer in 1..65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"broker URL {shown!r} has a path, query or fragment; an MQTT broker URL is "
            f"{scheme}://[USER[:PASSWORD]@]HOST[:PORT]"
        )
    username = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    if not username:
        if password is not None:
            raise ValueError(f"broker URL {shown!r} has a password but no user name")
        username = None
    return BrokerAddress(scheme=scheme, host=host, port=port, username=username, password=password)
