"""The cluster's certificate authority: who may speak llama.cpp's RPC between hosts.

llama.cpp's RPC server takes no credentials, so between hosts it is reached only through a
mutual-TLS channel (``services/worker/rpc/channel.py``) whose both ends present a certificate
this CA signed. ``tessera up --listen`` makes the CA (an EC P-256 key and a self-signed
certificate) beside its NATS config, which already holds the cluster's other secrets (every
user's password); it lives as long as that cluster. ``tessera join`` makes the device's key on
the device and sends only a certificate signing request with its join request: the join desk
signs a certificate that names the device (its id, as subject and DNS name, whatever the
request asked for) for client and server use, and answers with it and the CA's certificate.
The key never leaves its host, and nothing secret travels in the join answer. The head's own
workers get their key and certificate from the CA directly (``issue``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: How long a device's certificate is valid (days): a device that stays joined longer joins
#: again. The CA itself lives as long as the cluster that made it.
DEVICE_DAYS = 30
CA_DAYS = 365
CA_NAME = "Tessera cluster CA"
#: The CA signs certificates (and revocation lists), nothing else.
CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class Credentials:
    """PEM files of one device: the cluster's CA certificate, its own certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Credentials:
        return cls(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")

    def exist(self) -> bool:
        return self.ca.exists() and self.cert.exists() and self.key.exists()


def rpc_env(credentials: Credentials) -> dict[str, str]:
    """A llamacpp worker's settings for these credentials (``services/worker/settings.py``)."""
    return {
        "TESSERA_WORKER_RPC_CA": str(credentials.ca),
        "TESSERA_WORKER_RPC_CERT": str(credentials.cert),
        "TESSERA_WORKER_RPC_KEY": str(credentials.key),
    }


def _write_private(path: Path, data: bytes) -> None:
    """Write a key readable by this user only (created so: never world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class ClusterCA:
    """The CA's key and certificate, in ``folder`` (``ca.pem``, ``ca-key.pem``)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key, self.cert = key, cert

    @classmethod
    def create(cls, folder: Path) -> ClusterCA:
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(CA_USAGE, critical=True)
            .sign(key, hashes.SHA256())
        )
        _write_private(folder / "ca-key.pem", _key_pem(key))
        (folder / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(key, cert)

    @classmethod
    def kept_in(cls, folder: Path) -> ClusterCA:
        """The CA kept in ``folder`` (a cluster's home), made there the first time."""
        if (folder / "ca.pem").exists():
            return cls.load(folder)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls.create(folder)

    @classmethod
    def load(cls, folder: Path) -> ClusterCA:
        key = serialization.load_pem_private_key((folder / "ca-key.pem").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{folder}/ca-key.pem is not the cluster CA's EC key")
        return cls(key, x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes()))

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def sign(self, csr_pem: str, device_id: str) -> str:
        """A certificate (PEM) for the key of ``csr_pem``, naming ``device_id`` — never the
        name the request asks for. Raises ``ValueError`` on a request whose signature fails
        (it was not made with the key it carries) or that is not an EC P-256 key."""
        csr = x509.load_pem_x509_csr(csr_pem.encode())
        if not csr.is_signature_valid:
            raise ValueError("the certificate request's signature does not verify")
        public = csr.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != "secp256r1":
            raise ValueError("the certificate request must carry an EC P-256 key")
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)]))
            .issuer_name(self.cert.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=DEVICE_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(device_id)]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(self, folder: Path, device_id: str) -> Credentials:
        """Key, certificate and the CA's certificate for a device of this host (the head's
        own workers), written to ``folder`` once: a worker started again keeps its files."""
        if Credentials.in_folder(folder).exist():
            return Credentials.in_folder(folder)
        return accept(folder, self.sign(request(folder, device_id), device_id), self.cert_pem)


def request(folder: Path, device_id: str) -> str:
    """Make this device's key in ``folder`` (``key.pem``, this user's only) and return a
    certificate signing request for it (PEM), to send with the join request."""
    key = _new_key()
    _write_private(Credentials.in_folder(folder).key, _key_pem(key))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def accept(folder: Path, cert_pem: str, ca_pem: str) -> Credentials:
    """Store the certificate the cluster signed and its CA's, beside the key ``request`` made.
    Raises ``ValueError`` when the certificate is not for that key or not signed by that CA."""
    files = Credentials.in_folder(folder)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    key = serialization.load_pem_private_key(files.key.read_bytes(), None)
    if cert.public_key() != key.public_key():
        raise ValueError("the cluster's certificate is not for this device's key")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise ValueError(f"the certificate is not signed by the cluster's CA: {exc}") from exc
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files
