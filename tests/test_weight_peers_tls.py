"""An ``https`` weight peer whose name stands for several addresses keeps its name for TLS, with a real certificate.

Two HTTPS servers on loopback (127.0.0.1 and 127.0.0.2, one port) hold a self-signed certificate
for the name ``peers.test`` and answer what a samrollout peer answers (its identity; a relayed
file's PUT), recording the SNI server name of each TLS handshake and the ``Host`` header of each
request.  The server's `WeightPeers` is given that name, resolving to both addresses (this machine
has no name with two loopback addresses, and its ``/etc/hosts`` is not ours to change: the resolver
is the one thing handed in), and the certificate as its only trusted one.  The TLS handshakes,
the certificate and hostname checks and the HTTP requests are real.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from samrollout.server.weights.weight_peers import WeightPeers
from samrollout.server.weights.weight_relay import Hop, start_relay
from samrollout.testing import free_port

NAME = "peers.test"
ADDRESSES = ["127.0.0.1", "127.0.0.2"]
PEER_IDS = {"127.0.0.1": "1" * 16, "127.0.0.2": "2" * 16}


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A key and a self-signed certificate for ``name`` (its subject alternative name), as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / f"{name}.crt", folder / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@dataclass
class Seen:
    """What the stand-in peers saw: each handshake's SNI name, each request's (address, method, path, Host)."""

    sni: list[str | None] = field(default_factory=list)
    requests: list[tuple[str, str, str, str]] = field(default_factory=list)


def peer_app(address: str, seen: Seen) -> Any:
    """An ASGI app answering as a samrollout peer at ``address``: its identity, and a relayed file's PUT."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        seen.requests.append((address, scope["method"], scope["path"], headers.get(b"host", b"").decode()))
        data = b""
        while True:
            message = await receive()
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            body = f'{{"server_id": "{PEER_IDS[address]}", "weight_version": "v1"}}'
        else:
            body = f'{{"bytes": {len(data)}, "sha256": "{hashlib.sha256(data).hexdigest()}"}}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    return app


@pytest.fixture(scope="module")
def tls_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Seen]]:
    """The two stand-in peers, listening with the certificate for `NAME`; (port, certificate, what they saw)."""
    folder = tmp_path_factory.mktemp("tls")
    cert_file, key_file = self_signed(folder, NAME)
    seen, port = Seen(), free_port()
    servers = []
    for address in ADDRESSES:
        config = uvicorn.Config(peer_app(address, seen), host=address, port=port, log_level="warning",
                                ssl_certfile=str(cert_file), ssl_keyfile=str(key_file), lifespan="off")
        config.load()
        assert config.ssl is not None
        config.ssl.sni_callback = lambda _socket, name, _context: seen.sni.append(name)  # type: ignore[assignment]
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
    for server in servers:
        while not server.started:
            threading.Event().wait(0.05)
    yield port, cert_file, seen
    for server in servers:
        server.should_exit = True


def trusting(cert_file: Path) -> ssl.SSLContext:
    """A client TLS context that trusts ``cert_file`` only (hostnames checked, as by default)."""
    return ssl.create_default_context(cafile=str(cert_file))


async def both_addresses(host: str, port: int) -> list[str]:
    """`NAME` resolves to both loopback addresses (any other name: none)."""
    if host != NAME:
        raise OSError(f"unknown name {host}")
    return ADDRESSES


def test_an_https_peer_reached_at_each_address_keeps_its_name_for_sni_the_certificate_and_host(
        tls_peers: tuple[int, Path, Seen]) -> None:
    port, cert_file, seen = tls_peers
    seen.sni.clear()
    seen.requests.clear()

    async def run() -> tuple[list[Any], list[dict[str, Any]]]:
        peers = WeightPeers([f"https://{NAME}:{port}"], "f" * 16, "key", 30.0, verify=trusting(cert_file),
                            resolve=both_addresses)
        try:
            found = await peers.probe()
            data = b"relayed over TLS"
            relay = await start_relay(peers, [Hop(PEER_IDS["127.0.0.2"], "a" * 32)], "model.safetensors",
                                      hashlib.sha256(data).hexdigest(), len(data))

            async def chunks() -> AsyncIterator[bytes]:
                yield data

            async for _ in relay.tee(chunks()):
                pass
            return found, await relay.finish()
        finally:
            await peers.aclose()

    found, confirmed = asyncio.run(run())
    assert [(peer.url, peer.server_id, peer.weight_version) for peer in found] == [
        (f"https://{address}:{port}", PEER_IDS[address], "v1") for address in ADDRESSES]
    assert all(peer.shown()["name"] == f"{NAME}:{port}" and peer.error is None for peer in found)
    assert confirmed[0]["server_id"] == PEER_IDS["127.0.0.2"] and confirmed[0]["bytes"] == len(b"relayed over TLS")
    assert seen.sni and set(seen.sni) == {NAME}  # every handshake named the peer, not its address
    assert sorted(seen.requests) == sorted([*((a, "GET", "/admin/identity", f"{NAME}:{port}") for a in ADDRESSES),
                                            ("127.0.0.2", "PUT", f"/admin/weight_uploads/{'a' * 32}/files/"
                                             "model.safetensors", f"{NAME}:{port}")])


def test_an_https_peer_whose_certificate_is_for_another_name_is_unreachable(
        tls_peers: tuple[int, Path, Seen], tmp_path: Path) -> None:
    """The hostname is checked against the certificate: the same peers under a name their certificate does not
    hold are refused at the handshake."""
    port, _, _ = tls_peers
    other_cert, _ = self_signed(tmp_path, "other.test")

    async def other_name(host: str, port: int) -> list[str]:
        return ADDRESSES if host == "other.test" else []

    async def run() -> list[Any]:
        peers = WeightPeers([f"https://other.test:{port}"], "f" * 16, None, 30.0,
                            verify=trusting(other_cert), resolve=other_name)
        try:
            return await peers.probe()
        finally:
            await peers.aclose()

    found = asyncio.run(run())
    assert len(found) == 2 and all(peer.server_id is None and "CERTIFICATE_VERIFY_FAILED" in (peer.error or "")
                                   for peer in found)
