"""Finding a cluster on the LAN over mDNS (``zeroconf``).

``tessera up --listen ADDRESS`` announces ``_tessera._tcp.local.`` with its NATS URL;
``tessera join --token TOKEN`` without a URL browses for it. Only the URL travels: the token
still has to be given, so finding a cluster does not let anyone in.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from zeroconf import ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from libs.runtime.nats_client import server_list

SERVICE = "_tessera._tcp.local."


class Announcement:
    """The cluster's NATS URL (every server of a NATS cluster, comma-separated) announced on
    the LAN until ``close()``, at the first server's address."""

    def __init__(self, url: str, name: str | None = None) -> None:
        parts = urlsplit(server_list(url)[0])
        address = parts.hostname or "127.0.0.1"
        label = (name or f"tessera-{socket.gethostname()}")[:60]
        self.info = ServiceInfo(
            SERVICE,
            f"{label}.{SERVICE}",
            addresses=[socket.inet_aton(address)],
            port=parts.port or 4222,
            properties={"url": url},
        )
        self.zeroconf = Zeroconf(interfaces=[address])
        self.zeroconf.register_service(self.info)

    def close(self) -> None:
        self.zeroconf.unregister_service(self.info)
        self.zeroconf.close()


class _Found(ServiceListener):
    def __init__(self) -> None:
        self.urls: list[str] = []

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        info = zc.get_service_info(type_, name, timeout=2000)
        url = info.properties.get(b"url") if info is not None else None
        if url and url.decode() not in self.urls:
            self.urls.append(url.decode())

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.add_service(zc, type_, name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        """A cluster that leaves while we look is still reported; joining it then fails."""


def find_clusters(timeout_s: float = 5.0) -> list[str]:
    """The NATS URLs of the clusters announcing themselves on the LAN, first found first;
    waits up to ``timeout_s`` for the first, then a moment for others."""
    zeroconf = Zeroconf()
    found = _Found()
    browser = ServiceBrowser(zeroconf, SERVICE, found)
    try:
        deadline = time.monotonic() + timeout_s
        while not found.urls and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5 if found.urls else 0.0)
        return list(found.urls)
    finally:
        browser.cancel()
        zeroconf.close()
