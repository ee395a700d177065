"""A weight push relayed server to server: one copy on the trainer's link, all or nothing, only to configured peers.

Through the session's two tiny servers, each the other's weight peer (`tiny_server` also names a
port where nothing listens): the client sends each file once and both servers load it; the same
push with ``fan_out=False`` sends it to each; a relay that fails on the second server cancels
the push on both, so neither loads anything; a relay naming a server that is not a configured
peer (or naming an address at all) is refused before anything is sent anywhere.  The chain
planning and the relay header's parsing on their own.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from conftest import API_KEY, admin_status, peer_url
from samrollout.server.errors import ApiError
from samrollout.server.settings import parse_peer_urls
from samrollout.server.weights.weight_relay import parse_relay_header
from samrollout.testing import ServerProcess
from samrollout_client import RolloutClient, SamrolloutError
from samrollout_client.protocol.weight_uploads import MAX_RELAY_HOPS, RELAY_HEADER
from samrollout_client.weight_sync.weight_push import relay_chains
from support.weight_swap import WeightSwapper, greedy, open_uploads, server_id, swapped_pair

AUTH = {"Authorization": f"Bearer {API_KEY}"}


swaps = swapped_pair("relay")
PROMPT = "relayed weights probe"


# --- through the servers ---------------------------------------------------------------------------------------


def test_each_server_lists_its_configured_peers_with_their_ids_and_the_silent_one_as_unreachable(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess) -> None:
    listed = httpx.get(f"{tiny_server.url}/admin/peers", headers=AUTH, timeout=60).json()
    assert listed["server_id"] == server_id(tiny_server)
    by_url = {peer["url"]: peer for peer in listed["peers"]}
    assert by_url[peer_url("second_tiny_server")]["server_id"] == server_id(second_tiny_server)
    silent = by_url[peer_url("silent_peer")]
    assert silent["reachable"] is False and silent["server_id"] is None and "Connect" in silent["error"]
    back = {peer["url"]: peer for peer in httpx.get(f"{second_tiny_server.url}/admin/peers", headers=AUTH,
                                                     timeout=60).json()["peers"]}
    assert back[peer_url("tiny_server")]["server_id"] == listed["server_id"]
    assert set(back) == {peer_url("tiny_server"), peer_url("relay_victim")}  # the victim: up only in its module


def test_a_push_to_two_peers_crosses_the_clients_link_once_and_both_serve_the_new_weights(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess, tiny_weights_v2: Path, tiny_dir: Path,
        swaps: tuple[WeightSwapper, WeightSwapper]) -> None:
    before, _ = greedy(tiny_server, PROMPT)
    urls = [tiny_server.url, second_tiny_server.url]
    version = swaps[0].new_version("fan-out")
    with RolloutClient(urls, model="tiny", api_key=API_KEY) as client:
        push = client.push_weights(str(tiny_weights_v2), version)
        for swapper in swaps:
            swapper.loaded = tiny_weights_v2
        checkpoint = sum(f.stat().st_size for f in tiny_weights_v2.glob("*.safetensors"))
        assert push.relay_chains == [urls] and push.endpoints == 2
        assert push.bytes == checkpoint and push.bytes_sent == checkpoint  # one copy for two servers
        relayed = [greedy(server, PROMPT) for server in (tiny_server, second_tiny_server)]
        assert relayed[0] == relayed[1] and relayed[0][1] == version and relayed[0][0] != before

        back = swaps[0].new_version("direct")
        direct = client.push_weights(str(tiny_dir), back, fan_out=False)
        for swapper in swaps:
            swapper.loaded = tiny_dir
    assert direct.relay_chains == [[url] for url in urls] and direct.bytes_sent == 2 * direct.bytes
    assert [greedy(server, PROMPT) for server in (tiny_server, second_tiny_server)] == [(before, back)] * 2
    assert all(not open_uploads(server) for server in (tiny_server, second_tiny_server))


def test_a_relay_that_fails_on_the_second_server_cancels_the_push_on_both_and_nothing_loads(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess, tiny_weights_v2: Path,
        swaps: tuple[WeightSwapper, WeightSwapper]) -> None:
    before = [greedy(server, PROMPT) for server in (tiny_server, second_tiny_server)]

    def tensors_after_the_second_servers_upload_is_gone() -> Iterator[tuple[str, Any]]:
        """The new weights, read once the uploads are open: first the second server's upload is cancelled."""
        (upload,) = open_uploads(second_tiny_server)
        assert httpx.delete(f"{second_tiny_server.url}/admin/weight_uploads/{upload['upload_id']}",
                            headers=AUTH, timeout=30).status_code == 200
        for file in sorted(tiny_weights_v2.glob("*.safetensors")):
            yield from load_file(file).items()

    urls = [tiny_server.url, second_tiny_server.url]
    with RolloutClient(urls, model="tiny", api_key=API_KEY) as client, \
            pytest.raises(SamrolloutError, match=r"502.*relaying .* to peer") as failed:
        client.push_weights(tensors_after_the_second_servers_upload_is_gone(), swaps[0].new_version("never"))
    assert server_id(second_tiny_server) in str(failed.value)  # the hop that failed is named
    assert [greedy(server, PROMPT) for server in (tiny_server, second_tiny_server)] == before  # nothing loaded anywhere
    assert all(not open_uploads(server) for server in (tiny_server, second_tiny_server))  # all cancelled
    assert admin_status(tiny_server)["weight_uploads"]["staged_bytes"] == 0


def test_a_relay_to_a_server_that_is_not_a_configured_peer_is_refused_and_nothing_is_sent(
        tiny_server: ServerProcess) -> None:
    """No server-side request forgery: a request cannot make the server send data to an address of its choice."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        opened = httpx.post(f"{tiny_server.url}/admin/weight_uploads", headers=AUTH, timeout=30).json()
        upload_id = opened["upload_id"]
        url = f"{tiny_server.url}/admin/weight_uploads/{upload_id}/files/model.safetensors"
        data = b"not really weights"
        headers = {**AUTH, "X-Content-SHA256": hashlib.sha256(data).hexdigest()}
        try:
            unknown = httpx.put(url, content=data, timeout=60,
                                headers={**headers, RELAY_HEADER: f"{'0' * 16}/{'a' * 32}"})
            assert unknown.status_code == 403, unknown.text
            assert "not among this server's weight peers" in unknown.json()["error"]["message"]
            for named in (f"http://{target}/{'a' * 32}", f"{target}/{'a' * 32}", target):
                refused = httpx.put(url, content=data, timeout=60, headers={**headers, RELAY_HEADER: named})
                assert refused.status_code == 400, (named, refused.text)
                assert "never by address" in refused.json()["error"]["message"]
            itself = httpx.put(url, content=data, timeout=60,
                               headers={**headers, RELAY_HEADER: f"{opened['server_id']}/{'a' * 32}"})
            assert itself.status_code == 400, itself.text
            with pytest.raises(TimeoutError):
                listener.accept()  # nobody came
            shown = httpx.get(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH, timeout=30)
            assert shown.json()["files"] == {}  # nothing staged either
        finally:
            httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH, timeout=30)


def test_the_peer_routes_need_the_api_key(tiny_server: ServerProcess) -> None:
    for path in ("/admin/identity", "/admin/peers", "/admin/weight_uploads"):
        assert httpx.get(f"{tiny_server.url}{path}", timeout=30).status_code == 401, path


def test_a_relayed_put_without_the_key_is_refused_and_nothing_is_passed_on(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess) -> None:
    """A PUT naming a real next hop (the peer's id and its open upload), without the key: 401 at the first server,
    and 401 at the peer when sent to it as a relaying server would; neither upload stages anything."""
    data = b"not really weights"
    uploads = {server.url: httpx.post(f"{server.url}/admin/weight_uploads", headers=AUTH, timeout=30).json()
               for server in (tiny_server, second_tiny_server)}
    first, second = uploads[tiny_server.url], uploads[second_tiny_server.url]
    headers = {"X-Content-SHA256": hashlib.sha256(data).hexdigest()}
    try:
        relayed = httpx.put(f"{tiny_server.url}/admin/weight_uploads/{first['upload_id']}/files/model.safetensors",
                            content=data, timeout=60,
                            headers={**headers, RELAY_HEADER: f"{second['server_id']}/{second['upload_id']}"})
        assert relayed.status_code == 401, relayed.text
        hop = httpx.put(f"{second_tiny_server.url}/admin/weight_uploads/{second['upload_id']}/files/"
                        "model.safetensors", content=data, timeout=60, headers=headers)
        assert hop.status_code == 401, hop.text
        for url, opened in uploads.items():
            shown = httpx.get(f"{url}/admin/weight_uploads/{opened['upload_id']}", headers=AUTH, timeout=30).json()
            assert shown["files"] == {} and shown["bytes"] == 0, url
    finally:
        for url, opened in uploads.items():
            httpx.delete(f"{url}/admin/weight_uploads/{opened['upload_id']}", headers=AUTH, timeout=30)


# --- chains and headers on their own ---------------------------------------------------------------------------


def test_chains_follow_who_reaches_whom_and_servers_no_peer_reaches_get_their_own() -> None:
    ids = ["a" * 16, "b" * 16, "c" * 16, None]
    everyone = {"a" * 16, "b" * 16, "c" * 16}
    assert relay_chains(ids, [everyone, everyone, everyone, set()]) == [[0, 1, 2], [3]]  # an old server: direct
    assert relay_chains(ids[:3], [{"c" * 16}, set(), {"b" * 16}]) == [[0, 2, 1]]
    assert relay_chains(ids[:3], [set(), set(), set()]) == [[0], [1], [2]]  # no peers: today's direct push
    many = [f"{i:016x}" for i in range(MAX_RELAY_HOPS + 5)]
    assert [len(c) for c in relay_chains(many, [set(many)] * len(many))] == [MAX_RELAY_HOPS + 1, 4]


@pytest.mark.parametrize(("header", "says"), [
    ("", "name 1 to"), ("http://10.0.0.1:80/x", "never by address"), ("1234/5678", "never by address"),
    (f"{'b' * 16}/{'c' * 32},{'b' * 16}/{'d' * 32}", "each server once"),
    (f"{'a' * 16}/{'c' * 32}", "each server once"),
    (",".join(f"{i:016x}/{'c' * 32}" for i in range(1, MAX_RELAY_HOPS + 2)), "name 1 to"),
])
def test_a_malformed_relay_header_is_400(header: str, says: str) -> None:
    with pytest.raises(ApiError, match=says) as refused:
        parse_relay_header(header, own_id="a" * 16)
    assert refused.value.status == 400


def test_weight_peers_are_base_urls() -> None:
    assert parse_peer_urls(" http://a:8000/, https://b.svc:9000 ,") == ["http://a:8000", "https://b.svc:9000"]
    for bad in ("a:8000", "ftp://a:1", "http://a:1/path", "http://u:p@a:1", "http://a:99999"):
        with pytest.raises(ValueError, match="weight peer"):
            parse_peer_urls(bad)
