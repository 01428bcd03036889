"""llama.cpp's RPC between hosts through the cluster's mutual-TLS channel, on a LAN of network
namespaces (``libs/harness/lan.py``): this machine is the head, host B lends its RPC server
(Tessera's ``RpcServer``: ggml-rpc-server on B's loopback, the TLS listener on B's address),
and host C, on the same LAN, tries to get in. Certificates come from a cluster CA as
``tessera up`` makes it and ``tessera join`` gets them (``libs/runtime/pki.py``)."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.contracts import Sampling, shard_ring
from libs.harness.lan import UNAVAILABLE, Lan, lan, lender
from libs.models.shipped import MODEL_NAME, gguf_path
from libs.runtime.pki import ClusterCA, Credentials, accept, request
from services.worker.rpc.channel import ChannelError, open_tunnels
from services.worker.rpc.server import RpcServer
from services.worker.served.llama_server import LlamaServer
from services.worker.served.llama_worker import LAYERS, whole_task
from services.worker.settings import WorkerSettings

BINARIES = WorkerSettings().llama_bin
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
    pytest.mark.skipif(shutil.which("socat") is None, reason="socat: `make deps` installs it"),
    pytest.mark.skipif(
        not (BINARIES / ".installed").exists(),
        reason=f"no llama.cpp build in {BINARIES}: `make llama` builds it (`make test` does)",
    ),
]
#: llama.cpp's RPC HELLO (command 14, 24 bytes of capabilities); the answer is its 8-byte
#: size, 28, then the server's version.
HELLO = bytes([14]) + struct.pack("<Q", 24) + bytes(24)
ANSWER_SIZE = struct.pack("<Q", 28)

#: Run on host C: what each way in gets (JSON).
PROBE = """
import json, socket, ssl, sys
host, tls_port, hello = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])

def plain(port):
    try:
        sock = socket.create_connection((host, port), 3)
    except OSError as exc:
        return {"connect": type(exc).__name__}
    got, ended = b"", "eof"
    with sock:
        sock.settimeout(3)
        sock.sendall(hello)
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except OSError as exc:
            ended = type(exc).__name__
    return {"bytes": got.hex(), "ended": ended}

def tls(files):
    ca, cert, key = files
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False
    if cert:
        context.load_cert_chain(cert, key)
    try:
        with socket.create_connection((host, tls_port), 3) as raw:
            with context.wrap_socket(raw) as sock:
                sock.settimeout(3)
                sock.sendall(hello)
                return {"answer": sock.recv(64).hex()}
    except (OSError, ssl.SSLError) as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"[:300]}

ways = json.loads(sys.argv[4])
print(json.dumps({
    "tls_port_plain": plain(tls_port),
    **{name: tls(files) for name, files in ways.items()},
}))
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster CA; the head's credentials (``head``), host B's (``lender``, made as
    ``tessera join`` makes them: the key on the host, the certificate signed from its
    request), host C's own cluster credentials (``third``) and ones of another CA (``foreign``)."""
    folder = tmp_path_factory.mktemp("pki")
    ca = ClusterCA.create(folder / "ca")
    ca.issue(folder / "head", "head-a")
    accept(
        folder / "lender",
        ca.sign(request(folder / "lender", "asked-for-a-name"), "lender-b"),
        ca.cert_pem,
    )
    ca.issue(folder / "third", "third-c")
    ca.issue(folder / "other", "other-d")
    other = ClusterCA.create(folder / "other-ca")
    other.issue(folder / "foreign", "lender-b")
    return folder


@pytest.fixture(scope="module")
def network() -> Iterator[Lan]:
    with lan(2) as made:
        yield made


@pytest.fixture(scope="module")
def lent(network: Lan, pki: Path) -> Iterator[dict[str, object]]:
    with lender(network.hosts[0], BINARIES, pki / "lender", heads=["head-a"]) as info:
        yield info


def test_only_the_heads_cluster_certificate_reaches_the_rpc_server(
    network: Lan, pki: Path, lent: dict[str, object]
) -> None:
    """On host B, llama.cpp's RPC server listens on loopback only, the channel on B's address.
    From host C: a plain-TCP connection to the channel's port gets no RPC answer, only a
    failed handshake; TLS without a certificate, with one of another CA, or with the
    cluster's own for another device (C's: as a revoked device's would be) is refused; the
    certificate of the head B lends to gets llama.cpp's answer (the way in works)."""
    host_b, host_c = network.hosts
    endpoint = str(lent["endpoint"])
    assert endpoint == f"{host_b.address}:{endpoint.rsplit(':', 1)[1]}"
    port = int(endpoint.rsplit(":", 1)[1])
    assert listeners(host_b.prefix, port) == {"127.0.0.1", host_b.address}
    cluster_ca = str(pki / "ca" / "ca.pem")

    def files(name: str | None) -> list[str]:
        if name is None:
            return [cluster_ca, "", ""]
        held = Credentials.in_folder(pki / name)
        return [cluster_ca, str(held.cert), str(held.key)]

    ways = {
        "no_cert": files(None),
        "foreign_cert": files("foreign"),
        "cluster_cert": files("third"),
        "head_cert": files("head"),
    }
    argv = [host_b.address, endpoint.rsplit(":", 1)[1], HELLO.hex()]
    done = subprocess.run(
        [*host_c.prefix, sys.executable, "-c", PROBE, *argv, json.dumps(ways)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    print(f"from host C: {seen}")

    plain = bytes.fromhex(seen["tls_port_plain"]["bytes"])
    assert not plain.startswith(ANSWER_SIZE), seen
    assert plain == b"" or plain[0] == 0x15, seen  # nothing, or a TLS alert record
    assert "refused" in seen["no_cert"] and "refused" in seen["foreign_cert"], seen
    assert not bytes.fromhex(seen["cluster_cert"].get("answer", "")).startswith(ANSWER_SIZE)
    assert bytes.fromhex(seen["head_cert"]["answer"]).startswith(ANSWER_SIZE), seen


async def test_the_listener_follows_the_heads_it_lends_to(network: Lan, pki: Path) -> None:
    """A lending device's listener lets in only the heads of its placements: nobody before
    any; then ``head-a`` and not ``third-c``; both while both lead one (``head-a``'s open
    connection kept); and once only ``third-c`` does, ``head-a``'s connection ends and a new
    one is refused, as a revoked head's would be."""
    rpc = RpcServer(BINARIES, network.address, credentials=Credentials.in_folder(pki / "lender"))
    await rpc.start()
    try:
        endpoint = rpc.endpoint
        assert await hello(endpoint, pki, "head") == b""
        await rpc.lend_to(["head-a"])
        assert (await hello(endpoint, pki, "head")).startswith(ANSWER_SIZE)
        assert await hello(endpoint, pki, "third") == b""

        reader, writer = await connect(endpoint, pki, "head")  # no HELLO yet
        await rpc.lend_to(["head-a", "third-c"])
        assert (await exchange(reader, writer)).startswith(ANSWER_SIZE)  # still served
        assert (await hello(endpoint, pki, "third")).startswith(ANSWER_SIZE)
        assert await hello(endpoint, pki, "other") == b""

        reader, writer = await connect(endpoint, pki, "head")
        await rpc.lend_to(["third-c"])
        assert await exchange(reader, writer) == b""  # its connection ended with the change
        assert await hello(endpoint, pki, "head") == b""
        assert (await hello(endpoint, pki, "third")).startswith(ANSWER_SIZE)
    finally:
        await rpc.stop()


async def connect(
    endpoint: str, pki: Path, name: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TLS connection to a listener with the cluster certificate in ``pki / name``."""
    held = Credentials.in_folder(pki / name)
    context = ssl.create_default_context(cafile=str(pki / "ca" / "ca.pem"))
    context.check_hostname = False
    context.load_cert_chain(held.cert, held.key)
    host, port = endpoint.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), ssl=context)


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """llama.cpp's HELLO over an open connection: its answer, or b"" if refused or ended."""
    try:
        writer.write(HELLO)
        await writer.drain()
        return await asyncio.wait_for(reader.read(64), 10)
    except (OSError, ssl.SSLError):
        return b""
    finally:
        writer.close()


async def hello(endpoint: str, pki: Path, name: str) -> bytes:
    try:
        return await exchange(*await connect(endpoint, pki, name))
    except (OSError, ssl.SSLError):
        return b""


def listeners(prefix: list[str], port: int) -> set[str]:
    """The addresses that sockets of a host's network namespace listen on at ``port``."""
    table = subprocess.run([*prefix, "cat", "/proc/net/tcp"], capture_output=True, text=True)
    found = set()
    for row in table.stdout.splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, at = local.split(":")
        if state == "0A" and int(at, 16) == port:
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


async def test_a_device_on_this_host_is_reached_on_loopback_and_others_never_in_the_clear(
    network: Lan,
) -> None:
    """Same-host placements connect directly: an endpoint at one of this host's addresses
    becomes loopback at its port (where its RPC server listens). Another host's endpoint
    without this device's certificate is refused, not reached in the clear; so is one at an
    address of this host with nothing on that loopback port (a fleet's linked device in a
    namespace of its own, behind its link's relay)."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        own = f"{network.address}:{port}"
        assert await open_tunnels(None, [own], ["worker-1"]) == ([f"127.0.0.1:{port}"], [])
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(ChannelError, match="no cluster certificate"):
        await open_tunnels(None, [f"{network.address}:{port}"], ["linked-1"])
    with pytest.raises(ChannelError, match="no cluster certificate"):
        await open_tunnels(None, [f"{network.hosts[0].address}:50123"], ["lender-b"])


async def test_the_head_reaches_only_the_device_its_placement_names(
    pki: Path, lent: dict[str, object]
) -> None:
    """The head's tunnel checks the name in the other end's certificate: to ``lender-b``'s
    endpoint as ``lender-b``, llama.cpp answers; as any other device, the handshake fails and
    nothing reaches the server."""
    head = Credentials.in_folder(pki / "head")
    answers = []
    for device_id in ("lender-b", "worker-x"):
        [address], tunnels = await open_tunnels(head, [str(lent["endpoint"])], [device_id])
        try:
            host, port = address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(HELLO)
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(64), 10))
            writer.close()
        finally:
            for tunnel in tunnels:
                await tunnel.stop()
    assert answers[0].startswith(ANSWER_SIZE) and answers[1] == b"", answers


async def test_a_split_over_the_channel_gives_the_whole_models_greedy_tokens(
    pki: Path, lent: dict[str, object]
) -> None:
    """The head (this host) keeps layers 0..14 and offloads 15..29 and the output layer to
    host B's RPC server through the channel: the greedy tokens equal the whole model's."""
    endpoints = ("127.0.0.1:1", str(lent["endpoint"]))  # the head's own is not used
    shards = [("head-a", 0, 15), ("lender-b", 15, 30)]
    [head_task, _] = shard_ring("load", "tls", MODEL_NAME, shards, 1, 0.0, None, endpoints, 1024)
    head = Credentials.in_folder(pki / "head")
    split = LlamaServer(BINARIES, gguf_path(), head_task, LAYERS, threads=1, credentials=head)
    whole = LlamaServer(BINARIES, gguf_path(), whole_task("whole", "head-a"), LAYERS, threads=1)
    prompt, sampling = list(range(1, 40)), Sampling(max_tokens=32)
    runs = []
    for server in (whole, split):
        try:
            await server.start(120.0)
            if server is split:  # llama-server was given the tunnel, not B's address
                assert split.rpc_addresses[0].startswith("127.0.0.1:"), split.rpc_addresses
            pieces = [p async for p in server.complete(prompt, sampling, 32)]
            runs.append([t for p in pieces for t in p.token_ids])
        finally:
            await server.stop()
    assert len(runs[0]) == 32 and runs[0] == runs[1], runs
