"""A throwaway CA and a server certificate it signed, written as PEM files (``trustme``)."""

from __future__ import annotations

from pathlib import Path

import trustme


def write_certificates(folder: Path, *hosts: str) -> dict[str, Path]:
    """``ca``, ``cert`` (the chain, server certificate first) and ``key`` for ``hosts``."""
    ca = trustme.CA()
    cert = ca.issue_cert(*hosts)
    files = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(files["cert"]), append=i > 0)
    return files
