"""A push to several servers never splits them silently: commits failing on some servers, a relay losing a hop.

Real servers: the session's two tiny servers, and two of this module's that a test SIGKILLs.
A server that refuses its commit (409: a file is still arriving in its upload) is named with the
version each server serves, its upload stays staged, and committing again brings both onto the new
weights; the split shows in the servers' status meanwhile.  A server SIGKILLed after the uploads
and before its commit is named as not answering, and the server that loaded the new weights rolls
back to the old ones.  A relay whose last hop is SIGKILLed mid-upload fails naming that hop and
every server's version; nothing is loaded or left staged, and the next push to the survivors works.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from conftest import API_KEY, admin_status, second_tiny_server_args, server_fixture
from samrollout.testing import ServerProcess
from samrollout_client import AsyncRolloutClient, RolloutClient, SamrolloutError, WeightsSplit
from support.weight_swap import WeightSwapper, greedy, open_uploads, server_id, swapped_pair

AUTH = {"Authorization": f"Bearer {API_KEY}"}

# The last hop of a relay (`second_tiny_server` names its port as a weight peer: conftest.PEER_PORTS), and a
# server killed before its commit.  Each test kills its own.
relay_victim = server_fixture("relay_victim", second_tiny_server_args)
commit_victim = server_fixture("commit_victim", second_tiny_server_args)


swaps = swapped_pair("split")
PROMPT = "split weights probe"


def test_a_server_that_refuses_its_commit_is_named_and_its_staged_upload_commits_when_tried_again(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess, tiny_weights_v2: Path,
        swaps: tuple[WeightSwapper, WeightSwapper]) -> None:
    """The second server refuses its commit (409) because a file is still arriving in its upload: the first loads
    the new weights, the error names both servers' versions and the second's staged upload, the servers' status
    shows the split, and committing the staged upload again brings the second onto the new weights."""
    before, _ = greedy(tiny_server, PROMPT)
    old_second = admin_status(second_tiny_server)["weight_version"]  # the session's servers may differ here
    version = swaps[0].new_version("refused")
    data = (tiny_weights_v2 / "model.safetensors").read_bytes()

    async def scenario() -> tuple[WeightsSplit, dict[str, Any], dict[str, Any], int]:
        async with AsyncRolloutClient([tiny_server.url, second_tiny_server.url], model="tiny",
                                      api_key=API_KEY) as client, \
                httpx.AsyncClient(headers=AUTH, timeout=300) as http:
            staged = await client.stage_weights(tiny_weights_v2)
            assert staged.relay_chains == [[tiny_server.url, second_tiny_server.url]]
            upload = staged.targets[1].upload_id
            release = asyncio.Event()

            async def slowly() -> AsyncIterator[bytes]:
                yield data[:1024]
                await release.wait()
                yield data[1024:]

            arriving = asyncio.create_task(http.put(
                f"{second_tiny_server.url}/admin/weight_uploads/{upload}/files/model.safetensors", content=slowly(),
                headers={"X-Content-SHA256": hashlib.sha256(data).hexdigest(), "Content-Length": str(len(data))}))

            async def arriving_there() -> bool:
                shown = (await http.get(f"{second_tiny_server.url}/admin/weight_uploads/{upload}")).json()
                return int(shown["bytes"]) > len(data)  # the staged file, and the start of the one arriving

            while not await arriving_there():
                await asyncio.sleep(0.05)
            with pytest.raises(WeightsSplit) as failed:
                await client.commit_weights(staged, version)
            await http.get(f"{tiny_server.url}/admin/peers")  # a probe now, rather than the next one in 15 s
            status = (await http.get(f"{tiny_server.url}/admin/status", params={"drafter": "false"})).json()
            peers = (await http.get(f"{tiny_server.url}/admin/peers")).json()
            release.set()
            assert (await arriving).status_code == 200  # the same bytes again: the staged file is unchanged
            again = await client.commit_weights(failed.value.staged, version)
            return failed.value, status, peers, again.endpoints

    split, status, peers, committed_again = asyncio.run(scenario())
    for swapper in swaps:
        swapper.loaded = tiny_weights_v2
    first, second = split.endpoints
    assert (first.url, first.version, first.error) == (tiny_server.url, version, None)
    assert (second.url, second.version, second.staged) == (second_tiny_server.url, old_second, True)
    assert "(409)" in (second.error or "") and "still being received" in (second.error or "")
    assert f"{tiny_server.url} serves {version!r}" in str(split) and f"serves {old_second!r}" in str(split)
    assert split.committed == [tiny_server.url] and split.staged.endpoints == [second_tiny_server.url]
    assert status["weight_peers"]["split"] is True and status["weight_peers"]["versions"] == {version: 1,
                                                                                            old_second: 1}
    assert peers["versions_agree"] is False
    assert committed_again == 1
    after = [greedy(server, PROMPT) for server in (tiny_server, second_tiny_server)]
    assert after[0] == after[1] and after[0][1] == version and after[0][0] != before
    assert not open_uploads(tiny_server) and not open_uploads(second_tiny_server)


def test_a_server_killed_after_the_uploads_and_before_its_commit_is_named_and_the_other_rolls_back(
        tiny_server: ServerProcess, commit_victim: ServerProcess, swaps: tuple[WeightSwapper, WeightSwapper]) -> None:
    """Both servers hold the staged files; one is SIGKILLed; the commits split: the error names the new version on
    the survivor and the dead server as not answering; `roll_back` loads the old weights on the survivor again."""
    before = greedy(tiny_server, PROMPT)
    previous, new = swaps[0].loaded, swaps[0].next_dir()
    version = swaps[0].new_version("killed")
    with RolloutClient([tiny_server.url, commit_victim.url], model="tiny", api_key=API_KEY) as client:
        staged = client.stage_weights(new)
        commit_victim.kill()
        with pytest.raises(WeightsSplit) as failed:
            client.commit_weights(staged, version)
        swaps[0].loaded = new
        assert greedy(tiny_server, PROMPT)[0] != before[0]
        split = failed.value
        survivor, dead = split.endpoints
        assert (survivor.url, survivor.version, survivor.error) == (tiny_server.url, version, None)
        assert (dead.url, dead.version, dead.staged) == (commit_victim.url, None, False) and dead.error
        assert f"{commit_victim.url} does not answer" in str(split)
        with pytest.raises(ValueError, match="needs the version"):  # nobody else answers: which version is it?
            client.roll_back(split, previous)
        rolled = client.roll_back(split, previous, before[1])
        swaps[0].loaded = previous
    assert rolled.endpoints == 1 and greedy(tiny_server, PROMPT) == before
    assert not open_uploads(tiny_server)


def test_a_relay_whose_last_hop_is_killed_mid_upload_names_it_and_every_server_keeps_its_version(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess, relay_victim: ServerProcess,
        tiny_weights_v2: Path, swaps: tuple[WeightSwapper, WeightSwapper]) -> None:
    """Three servers in one chain (the client sends to the first, which relays to the second, which relays to the
    third); the third is SIGKILLed once the first file went through all three: the push fails naming it and what
    each server serves, none loaded or keeps anything staged, and a push to the two survivors then succeeds."""
    survivors = (tiny_server, second_tiny_server)
    before = [greedy(server, PROMPT) for server in survivors]
    victim_id = server_id(relay_victim)
    tensors = [pair for file in sorted(tiny_weights_v2.glob("*.safetensors")) for pair in load_file(file).items()]

    def killed_after_the_first_file() -> Iterator[tuple[str, Any]]:
        """One tensor per file (shard_bytes=1): the third pair is asked for once the first file went through."""
        for index, pair in enumerate(tensors):
            if index == 2:
                relay_victim.kill()
            yield pair

    urls = [tiny_server.url, second_tiny_server.url, relay_victim.url]
    with RolloutClient(urls, model="tiny", api_key=API_KEY) as client, \
            pytest.raises(SamrolloutError, match=r"502.*relaying .* to peer") as failed:
        client.push_weights(killed_after_the_first_file(), swaps[0].new_version("never"), shard_bytes=1)
    message = str(failed.value)
    assert victim_id in message  # the hop that failed is named
    assert "nothing was staged or loaded" in message and f"{relay_victim.url} does not answer" in message
    for server, (_, version) in zip(survivors, before, strict=True):
        assert f"{server.url} serves {version!r}" in message
    assert [greedy(server, PROMPT) for server in survivors] == before
    assert all(not open_uploads(server) for server in survivors)
    assert admin_status(tiny_server)["weight_uploads"]["staged_bytes"] == 0
    version = swaps[0].new_version("survivors")
    with RolloutClient([server.url for server in survivors], model="tiny", api_key=API_KEY) as client:
        push = client.push_weights(str(tiny_weights_v2), version)
    for swapper in swaps:
        swapper.loaded = tiny_weights_v2
    assert push.relay_chains == [[tiny_server.url, second_tiny_server.url]]
    assert {greedy(server, PROMPT)[1] for server in survivors} == {version}
