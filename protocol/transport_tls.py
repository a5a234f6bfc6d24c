"""TLS client contexts for ``mqtts://``, with the CA, client certificate and key checked at
start-up (files, PEM, key match, validity periods against the clock). Needs no paho.
"""

from __future__ import annotations

import ssl
import time

from .errors import SecurityConfigError

_NO_CHECK_TIME = 0x200000
"""OpenSSL's ``X509_V_FLAG_NO_CHECK_TIME``: verify certificate chains without validity periods."""


def tls_context(*, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                check_time: bool = True, clock_skew_s: float = 300.0, now: float | None = None) -> ssl.SSLContext:
    """A TLS client context for ``mqtts://``, with every file checked now rather than mid-round.

    The broker's certificate chain must lead to ``ca_file`` (``None``: the system's CAs) and name
    the broker's host (hostname checking on). ``cert_file`` + ``key_file`` (PEM) are the client
    certificate for brokers that require one.

    Clock: the start-up check compares the validity periods of the client certificate and of the
    CA certificates with this machine's clock, allowing ``clock_skew_s`` seconds either way. A
    device without a real-time clock (a Raspberry Pi boots with a wrong one) passes
    ``check_time=False``: the periods are then checked neither here nor in the TLS handshake
    (OpenSSL ``X509_V_FLAG_NO_CHECK_TIME``); the chain and the host name still are.

    Raises:
        SecurityConfigError: a missing or unreadable file, a file without a PEM certificate, a
            client certificate that does not match its key, or a certificate outside its
            validity period (by more than ``clock_skew_s``).
    """
    from cryptography import x509

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    files = [("CA file", ca_file)] if ca_file else []
    if cert_file:
        files.append(("client certificate", cert_file))
    for what, path in files + ([("client key", key_file)] if key_file else []):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise SecurityConfigError(f"{what} {path}: {exc.strerror or exc}", path=path) from None
    if (cert_file is None) != (key_file is None):
        raise SecurityConfigError("a client certificate needs both its certificate file and its key file")
    t = time.time() if now is None else now
    for what, path in files:
        with open(path, "rb") as f:
            data = f.read()
        try:
            certs = x509.load_pem_x509_certificates(data)
        except ValueError:
            raise SecurityConfigError(f"{what} {path} holds no PEM certificate", path=path) from None
        for cert in certs if what == "CA file" else certs[:1]:
            if not check_time:
                break
            nb, na = cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()
            name = cert.subject.rfc4514_string() or "(no subject)"
            if t > na + clock_skew_s:
                raise SecurityConfigError(
                    f"{what} {path}: certificate {name} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC "
                    f"(this machine's clock: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))} UTC, "
                    f"{clock_skew_s:g} s of skew allowed). Renew it, or fix the clock", path=path)
            if t < nb - clock_skew_s:
                raise SecurityConfigError(
                    f"{what} {path}: certificate {name} is not valid before "
                    f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC (this machine's clock: "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))} UTC, {clock_skew_s:g} s of skew "
                    f"allowed). Fix the clock, or start without time checks on a device with no clock", path=path)
    try:
        if ca_file:
            ctx.load_verify_locations(cafile=ca_file)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    except ssl.SSLError as exc:
        raise SecurityConfigError(f"CA file {ca_file}: {exc.reason or exc}", path=ca_file) from None
    if cert_file:
        try:
            ctx.load_cert_chain(certfile=cert_file, keyfile=key_file)
        except ssl.SSLError as exc:
            reason = exc.reason or str(exc)
            if "KEY_VALUES_MISMATCH" in reason.upper():
                reason = "the key does not belong to the certificate"
            raise SecurityConfigError(f"client certificate {cert_file} with key {key_file}: {reason}",
                                      path=cert_file) from None
    if not check_time:
        ctx.verify_flags |= _NO_CHECK_TIME
    return ctx
