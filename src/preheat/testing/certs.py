"""A self-signed certificate for 127.0.0.1, for the doubles and tests that speak TLS (a Redis, an HTTPS origin, a
Kubernetes API server): made in-process with ``cryptography`` (a dependency of preheat), no ``openssl`` command."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def self_signed_certificate(directory: str) -> tuple[str, str]:
    """(certificate, key) PEM files for 127.0.0.1 in ``directory``: the certificate is its own CA, so a client
    trusts it by naming it as its CA file (``SSL_CERT_FILE``, ``ssl_ca_certs``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = Path(directory, "cert.pem"), Path(directory, "key.pem")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)
