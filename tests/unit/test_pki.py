"""The cluster's CA (``libs/runtime/pki.py``): what a joining device can and cannot get signed,
and the socat command lines of llama.cpp's RPC channel built from its files."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from libs.runtime.pki import ClusterCA, Credentials, accept, request
from services.worker.rpc.channel import (
    NOBODY,
    ChannelError,
    check_script,
    listener_command,
    tunnel_command,
)


def test_a_device_gets_a_certificate_naming_itself_whatever_it_asked_for(tmp_path: Path) -> None:
    ca = ClusterCA.create(tmp_path / "ca")
    csr = request(tmp_path / "dev", "worker-0")  # asks for a name of another device
    files = accept(tmp_path / "dev", ca.sign(csr, "laptop-b"), ca.cert_pem)
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "laptop-b"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["laptop-b"]
    cert.verify_directly_issued_by(ClusterCA.load(tmp_path / "ca").cert)
    # The keys are this user's only; the CA's key never leaves the head.
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ca" / "ca-key.pem").stat().st_mode) == 0o600
    assert not (tmp_path / "dev" / "ca-key.pem").exists()


def test_a_request_not_signed_by_its_key_or_of_another_kind_is_refused(tmp_path: Path) -> None:
    ca = ClusterCA.create(tmp_path / "ca")
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_csr = (
        x509.CertificateSigningRequestBuilder().subject_name(name).sign(rsa_key, hashes.SHA256())
    )
    with pytest.raises(ValueError, match="EC P-256"):
        ca.sign(rsa_csr.public_bytes(serialization.Encoding.PEM).decode(), "x")
    good = request(tmp_path / "dev", "x")
    tampered = good.replace(good.splitlines()[3], good.splitlines()[3][::-1])
    with pytest.raises(ValueError):
        ca.sign(tampered, "x")


def test_a_certificate_for_another_key_or_of_another_ca_is_not_accepted(tmp_path: Path) -> None:
    ca, other = ClusterCA.create(tmp_path / "ca"), ClusterCA.create(tmp_path / "other")
    request(tmp_path / "dev", "laptop-b")
    someone_else = ca.sign(request(tmp_path / "thief", "laptop-b"), "laptop-b")
    with pytest.raises(ValueError, match="not for this device's key"):
        accept(tmp_path / "dev", someone_else, ca.cert_pem)
    mine = ca.sign(ec_csr_of(tmp_path / "dev"), "laptop-b")
    with pytest.raises(ValueError, match="not signed by the cluster's CA"):
        accept(tmp_path / "dev", mine, other.cert_pem)


def test_both_ends_of_the_channel_verify_their_peer(tmp_path: Path) -> None:
    files = ClusterCA.create(tmp_path / "ca").issue(tmp_path / "dev", "laptop-b")
    server = " ".join(listener_command(files, "10.0.0.2", 50052, 40001))
    client = " ".join(tunnel_command(files, 40002, "10.0.0.2:50052", "laptop-b"))
    for command in (server, client):
        assert "verify=1" in command and f"cafile={files.ca}" in command
    assert "bind=10.0.0.2" in server and "TCP:127.0.0.1:40001" in server
    assert "bind=127.0.0.1" in client and "commonname=laptop-b" in client
    odd = Credentials(files.ca, files.cert, tmp_path / "a,b.pem")
    with pytest.raises(ChannelError):
        listener_command(odd, "10.0.0.2", 50052, 40001)


def test_the_listener_checks_the_name_of_the_head_it_lends_to(tmp_path: Path) -> None:
    """No head: a name no certificate of the cluster holds; one: socat checks it; several: a
    script run per connection checks them; a name that is no device id is refused."""
    files = ClusterCA.create(tmp_path / "ca").issue(tmp_path / "dev", "laptop-b")
    assert f"commonname={NOBODY}" in " ".join(listener_command(files, "10.0.0.2", 1, 2))
    one = " ".join(listener_command(files, "10.0.0.2", 1, 2, ["head-a"]))
    assert "commonname=head-a" in one and "TCP:127.0.0.1:2" in one
    check = tmp_path / "check"
    check.write_text(check_script(["head-a", "head-c"], 2))
    several = listener_command(files, "10.0.0.2", 1, 2, ["head-c", "head-a"], check)
    assert several[-1] == f"SYSTEM:sh {check}" and "commonname" not in " ".join(several)
    assert "head-a|head-c)" in check.read_text()
    with pytest.raises(ChannelError, match="not a device id"):
        listener_command(files, "10.0.0.2", 1, 2, ["a;rm -rf"])


def ec_csr_of(folder: Path) -> str:
    """A request signed with the key already in ``folder`` (as ``request`` makes it)."""
    key = serialization.load_pem_private_key(Credentials.in_folder(folder).key.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "laptop-b")])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode()
