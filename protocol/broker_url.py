"""MQTT broker URLs: ``mqtt://`` / ``mqtts://`` text to a :class:`BrokerAddress`.

Used by the agent (``fedfleet-agent --broker``) and the server alike; it needs nothing beyond the
standard library (no paho, no broker code).
"""

from __future__ import annotations

import dataclasses
from urllib.parse import unquote, urlsplit

__all__ = ["DEFAULT_PORTS", "BrokerAddress", "has_login", "login_placeholder_url", "parse_broker_url",
           "public_broker_url", "shown_broker_url", "typed_login", "without_login"]

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


def _raw_login(url: str) -> str | None:
    """The text of ``url`` between its ``://`` and its last ``@`` (its user name and password as
    typed, percent-encoded or not), or ``None`` when it has no ``@`` after a ``://``. Unlike
    :func:`urllib.parse.urlsplit`, a ``/``, ``?`` or ``#`` typed in a password does not end it
    there: the password is everything up to the last ``@``."""
    start = url.find("://")
    if start < 0:
        return None
    at = url.rfind("@", start + 3)
    return url[start + 3:at] if at >= 0 else None


def typed_login(url: str) -> bool:
    """Whether the text ``url`` has a login part, a user name or password typed before an ``@``
    after its ``scheme://`` (:func:`has_login` of a URL that parses; this also for one that does
    not, so that a message about it can leave the login out: :func:`without_login`). Never raises
    for a ``str``."""
    return bool(_raw_login(url))


def without_login(url: str) -> str:
    """The text ``url`` with its login part (everything between ``scheme://`` and the last ``@``,
    the ``@`` included) removed, the rest as typed: what a message may show of a URL that holds a
    login and may not parse (``mqtt://op:pw@host:99999`` → ``mqtt://host:99999``). Never raises for
    a ``str``."""
    login = _raw_login(url)
    if login is None:
        return url
    start = url.find("://") + 3
    return f"{url[:start]}{url[start + len(login) + 1:]}"


def _redact(url: str) -> str:
    """What a message shows of the text ``url``, which may hold a secret where it does not parse:
    its scheme, its user name (a password as ``***``: the text between the first ``:`` after
    ``scheme://`` and the last ``@``, :func:`_raw_login`, so that a password holding characters a
    URL must percent-encode, typed as they are, is hidden whole too), its host and port; never its
    path, query or fragment (``?password=...`` is a secret too), which are left out, nor a port
    that is not a number (``***``: ``mqtt://user:password`` with the ``@host`` forgotten)."""
    start = url.find("://")
    head, rest = (url[:start + 3], url[start + 3:]) if start >= 0 else ("", url)
    at = rest.rfind("@")
    login = ""
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        login = f"{user}:***@" if colon else f"{user}@"
        rest = rest[at + 1:]
    for c in "/?#":  # the address ends at its path, query or fragment: none is shown
        rest = rest.split(c, 1)[0]
    if rest.startswith("["):
        close = rest.find("]") + 1 or len(rest)
        host, port = rest[:close], rest[close:]
    else:
        host, colon, number = rest.partition(":")
        port = colon + number
    if port and not (port.startswith(":") and port[1:].isdigit()):
        port = ":***" if port.startswith(":") else "***"
    return f"{head}{login}{host}{port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://[user[:password]@]host[:port][/]`` or ``mqtts://...`` into a BrokerAddress.

    Any host is accepted (this is for real brokers too, not only the embedded one). The user name
    and password are percent-decoded. The scheme is case-insensitive.

    Raises:
        TypeError: ``url`` is not a ``str``.
        ValueError: the scheme is not ``mqtt`` or ``mqtts``; the host is missing; the port is not
            an integer in 1..65535; the URL has a path, query or fragment; or it has a password
            without a user name (MQTT 3.1.1 §3.1.2.9 forbids that); its user name or password
            holds a ``/``, ``?``, ``#``, ``[`` or ``]`` not percent-encoded (which would end the
            URL's host part there). The message never contains the password, nor the URL's path,
            query or fragment, nor a port that is not a number (any of them may hold a secret:
            ``?password=...``): it says that the URL has one, not what it is.
    """
    if not isinstance(url, str):
        raise TypeError(f"broker URL must be a str, got {type(url).__name__}")
    text = url.strip()
    shown = _redact(text)
    login = _raw_login(text)
    if login is not None and any(c in login for c in "/?#[]"):
        raise ValueError(f"broker URL {shown!r}: its user name or password holds '/', '?', '#', '[' or ']', which "
                         "a URL must percent-encode (%2F, %3F, %23, %5B, %5D; '@' %40, ':' %3A, '%' %25), e.g. "
                         "with urllib.parse.quote(password, safe='')")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        if "://" in text:
            got = f"got {parts.scheme!r}"
        else:  # what urlsplit reads as a scheme may be a user name or a host: not echoed
            got = "got none (did you forget the 'mqtt://' prefix?)"
        raise ValueError(f"unsupported broker URL {shown!r}: scheme must be 'mqtt' or 'mqtts', {got}")
    host = parts.hostname
    if not host:
        raise ValueError(f"broker URL {shown!r} has no host; expected {scheme}://HOST[:PORT]")
    try:
        port = parts.port
    except ValueError as exc:  # its text is not shown: 'user:password' with the '@host' forgotten reads as one
        why = str(exc) if "out of range" in str(exc) else "not a number"
        raise ValueError(
            f"broker URL {shown!r} has a bad port ({why}); expected an integer in 1..65535"
        ) from None
    if port is None:
        port = DEFAULT_PORTS[scheme]
    elif not 1 <= port <= 65535:
        raise ValueError(f"broker URL {shown!r} has port {port}; expected an integer in 1..65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"broker URL {shown!r} has a path, query or fragment (not shown here); an MQTT broker URL is "
            f"{scheme}://[USER[:PASSWORD]@]HOST[:PORT]"
        )
    username = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    if not username:
        if password is not None:
            raise ValueError(f"broker URL {shown!r} has a password but no user name")
        username = None
    return BrokerAddress(scheme=scheme, host=host, port=port, username=username, password=password)


def public_broker_url(url: str | BrokerAddress) -> str:
    """``url`` as ``scheme://host:port`` without its user name and password (an IPv6 host in
    brackets; the scheme's default port written out): the form every message, file and log of
    fedfleet names a broker by (``broker.json``, ``summary.json``, the printed agent command).

    Raises:
        TypeError: ``url`` is neither a ``str`` nor a :class:`BrokerAddress`.
        ValueError: ``url`` is not a broker URL (:func:`parse_broker_url`; the message never
            contains the password).
    """
    addr = url if isinstance(url, BrokerAddress) else parse_broker_url(url)
    host = f"[{addr.host}]" if ":" in addr.host else addr.host
    return f"{addr.scheme}://{host}:{addr.port}"


def shown_broker_url(url: str) -> str:
    """``url`` as a message may show it, never raising: :func:`public_broker_url` for a broker
    URL, and any other text as the errors of :func:`parse_broker_url` show it: its password
    replaced by ``***``, its path, query and fragment left out."""
    try:
        return public_broker_url(url)
    except (TypeError, ValueError):
        return _redact(str(url))


def has_login(url: str | BrokerAddress) -> bool:
    """Whether ``url`` carries a user name or a password (which :func:`public_broker_url` leaves out).

    Raises:
        TypeError, ValueError: as :func:`public_broker_url`.
    """
    addr = url if isinstance(url, BrokerAddress) else parse_broker_url(url)
    return addr.username is not None or addr.password is not None


def login_placeholder_url(url: str | BrokerAddress) -> str:
    """``url`` with ``USER:PASSWORD`` in place of its login, whatever it carries:
    ``mqtt://USER:PASSWORD@host:port``, the ``--broker`` a printed command line asks for where the
    broker's credentials are left out.

    Raises:
        TypeError, ValueError: as :func:`public_broker_url`.
    """
    scheme, address = public_broker_url(url).split("://", 1)
    return f"{scheme}://USER:PASSWORD@{address}"
