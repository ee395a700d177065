"""The staging folder is the server's own and the API key stays secret (issue 59, items 8 and 9).

On real start-ups of `samrollout serve`: a staging folder that is pre-created open to others, owned by another
user or a symbolic link stops the start, saying so; the default one is a 0700 folder under the server's own
cache.  The key given as a file (``--api-key-file``) is the key and never shows in the process's command line;
``--api-key`` on the command line draws a warning; plain-http weight peers beyond loopback are refused with a key
unless ``--allow-plain-http-peers`` (then a warning).  Through the session's two tiny servers: a relayed file with
a bad name is a 400 naming it, and nothing reaches the peer.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from conftest import API_KEY, TINY_SERVER_MEMORY, server_fixture
from samrollout.server.settings import ServerSettings
from samrollout.server.weights.weight_uploads import default_staging_root
from samrollout.testing import ServerProcess, launch_server
from samrollout_client.protocol.weight_uploads import RELAY_HEADER

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FILE_KEY = "key-from-a-file-0123456789abcdef"
KEY_DIR = Path(tempfile.mkdtemp(prefix="samrollout-key-file-"))
atexit.register(shutil.rmtree, KEY_DIR, ignore_errors=True)  # the fixture server reads it until the session ends
UNREACHABLE_PLAIN_PEER = "http://192.0.2.1:8000"  # TEST-NET-1: not loopback, never answers


def _key_file() -> Path:
    path = KEY_DIR / "api-key"
    path.write_text(FILE_KEY + "\n")
    path.chmod(0o600)
    return path


def keyed_server_args(tiny_dir: Path) -> list[str]:
    """A tiny server whose key comes from a file, with a plain-http peer allowed explicitly."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key-file", str(_key_file()),
            "--max-model-len", "256", "--dtype", "float32", "--gpu-memory-utilization", str(TINY_SERVER_MEMORY),
            "--weight-peers", UNREACHABLE_PLAIN_PEER, "--allow-plain-http-peers"]


keyed_server = server_fixture("keyed_server", keyed_server_args)


def _refused_at_start(args: list[str], log: Path, env: dict[str, str] | None = None) -> str:
    """The log of `samrollout serve ARGS`, which must exit before it serves (else it is stopped and this fails)."""
    server = launch_server(args, log, env)
    try:
        server.ready()
    except RuntimeError as exited:
        assert "server exited with" in str(exited), str(exited)
        return log.read_text()
    server.stop()
    pytest.fail(f"the server started and served: {args}")


def _tiny(tiny_dir: Path) -> list[str]:
    return ["--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "256",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


# --- the staging folder ----------------------------------------------------------------------------------------


def test_a_staging_folder_pre_created_open_to_others_stops_the_start(tiny_dir: Path, tmp_path: Path) -> None:
    """What a local user racing the server would make: the default folder, created first and world-writable."""
    cache = tmp_path / "cache"
    staging = cache / "weight-uploads"
    staging.mkdir(parents=True)
    staging.chmod(0o777)
    log = _refused_at_start(_tiny(tiny_dir), tmp_path / "server.log", {"SAMROLLOUT_CACHE": str(cache)})
    assert f"the weight staging directory {staging} is open to its group or others (mode 0777)" in log, log[-3000:]
    assert f"chmod 700 {staging}" in log
    assert not list(staging.iterdir())  # nothing staged there


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_staging_folder_owned_by_another_user_stops_the_start(tiny_dir: Path, tmp_path: Path) -> None:
    staging = tmp_path / "theirs"
    staging.mkdir(mode=0o700)
    os.chown(staging, 65534, 65534)  # nobody
    log = _refused_at_start([*_tiny(tiny_dir), "--weight-staging-dir", str(staging)], tmp_path / "server.log")
    assert f"the weight staging directory {staging} is owned by uid 65534, not by this server's user" in log, \
        log[-3000:]
    assert not list(staging.iterdir())


def test_a_staging_folder_that_is_a_symbolic_link_stops_the_start(tiny_dir: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    link = tmp_path / "staging"
    link.symlink_to(real)
    log = _refused_at_start([*_tiny(tiny_dir), "--weight-staging-dir", str(link)], tmp_path / "server.log")
    assert f"the weight staging directory {link} is a symbolic link" in log, log[-3000:]
    assert not list(real.iterdir())


def test_the_default_staging_folder_is_a_private_one_under_the_servers_own_cache(
        keyed_server: ServerProcess) -> None:
    """The server of this module stages by default (the test process's SAMROLLOUT_CACHE is the server's)."""
    root = default_staging_root()
    info = os.lstat(root)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) & 0o077 == 0, oct(info.st_mode)
    assert not str(root).startswith(tempfile.gettempdir() + "/samrollout-weight-uploads")
    opened = httpx.post(f"{keyed_server.url}/admin/weight_uploads", timeout=30,
                        headers={"Authorization": f"Bearer {FILE_KEY}"}).json()
    try:
        assert list(root.glob(f"server-*/{opened['upload_id']}"))  # this server stages there
    finally:
        httpx.delete(f"{keyed_server.url}/admin/weight_uploads/{opened['upload_id']}", timeout=30,
                     headers={"Authorization": f"Bearer {FILE_KEY}"})


# --- the key ---------------------------------------------------------------------------------------------------


def test_the_key_given_as_a_file_is_the_key_and_is_not_on_the_command_line(keyed_server: ServerProcess) -> None:
    url = f"{keyed_server.url}/v1/models"
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, timeout=30, headers=AUTH).status_code == 401  # another key
    assert httpx.get(url, timeout=30, headers={"Authorization": f"Bearer {FILE_KEY}"}).status_code == 200
    command_line = Path(f"/proc/{keyed_server.process.pid}/cmdline").read_bytes().decode()
    assert "--api-key-file" in command_line and FILE_KEY not in command_line  # what `ps` shows
    assert "shows in `ps`" not in keyed_server.log_tail(100_000)


def test_allowed_plain_http_peers_draw_a_warning_that_the_key_goes_in_clear(keyed_server: ServerProcess) -> None:
    log = keyed_server.log_tail(100_000)
    assert re.search(rf"WARNING .*weight peers {re.escape(UNREACHABLE_PLAIN_PEER)} are plain http://", log), log


def test_the_api_key_on_the_command_line_draws_a_warning() -> None:
    """Checked before anything else: here the settings are then refused (--max-n 0), so no engine starts."""
    ran = subprocess.run([sys.executable, "-m", "samrollout.cli", "serve", "--api-key", "on-the-command-line",
                          "--max-n", "0"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 2, ran.stderr
    assert "--api-key on the command line shows in `ps`" in ran.stderr and "--api-key-file" in ran.stderr


def test_plain_http_peers_beyond_loopback_with_a_key_are_refused_at_start(tiny_dir: Path, tmp_path: Path) -> None:
    log = _refused_at_start([*_tiny(tiny_dir), "--weight-peers", "http://rollout-1:8000,http://127.0.0.1:9"],
                            tmp_path / "server.log", {"SAMROLLOUT_API_KEY": FILE_KEY})
    assert "--weight-peers http://rollout-1:8000: plain http:// beyond loopback" in log, log[-3000:]
    assert "--allow-plain-http-peers" in log and FILE_KEY not in log


def test_the_key_is_given_once_and_a_key_file_must_hold_one(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  from-the-file\n")
    assert ServerSettings(api_key_file=str(key_file)).api_key.get_secret_value() == "from-the-file"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="give the key once"):
        ServerSettings(api_key="on-the-line", api_key_file=str(key_file))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ServerSettings(api_key_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read the key"):
        ServerSettings(api_key_file=str(tmp_path / "missing"))
    assert ServerSettings(api_key_file=str(key_file), weight_peers="https://rollout-1:8443").weight_peers


# --- relayed names ---------------------------------------------------------------------------------------------


def _relayed_put(server: ServerProcess, upload_id: str, name: str, data: bytes, hop: str) -> httpx.Response:
    """PUT ``data`` as file ``name`` of ``upload_id`` on ``server``, to be relayed to ``hop`` (server/upload ids)."""
    return httpx.put(f"{server.url}/admin/weight_uploads/{upload_id}/files/{name}", content=data, timeout=60,
                     headers={**AUTH, "X-Content-SHA256": hashlib.sha256(data).hexdigest(), RELAY_HEADER: hop})


def _errors_400(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(r'^samrollout_http_errors_total\{code="400"\} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


@pytest.mark.parametrize("name", ["two words.safetensors", ".hidden.safetensors", "weights.bin"])
def test_a_relayed_file_with_a_bad_name_is_refused_naming_it_and_never_reaches_the_peer(
        tiny_server: ServerProcess, second_tiny_server: ServerProcess, name: str) -> None:
    data = b"not really weights"
    first = httpx.post(f"{tiny_server.url}/admin/weight_uploads", headers=AUTH, timeout=30).json()
    second = httpx.post(f"{second_tiny_server.url}/admin/weight_uploads", headers=AUTH, timeout=30).json()
    before = _errors_400(second_tiny_server)
    try:
        peer_hop = f"{second['server_id']}/{second['upload_id']}"
        refused = _relayed_put(tiny_server, first["upload_id"], name, data, peer_hop)
        assert refused.status_code == 400, refused.text
        assert f"bad file name {name!r}" in refused.json()["error"]["message"]
        assert _errors_400(second_tiny_server) == before  # the peer was never asked
        # The name is checked before anything of the relay: even a hop that is no peer (a 403 for a good name)
        # gets the 400 naming the file.
        unknown_hop = _relayed_put(tiny_server, first["upload_id"], name, data, f"{'0' * 16}/{second['upload_id']}")
        assert unknown_hop.status_code == 400, unknown_hop.text
        assert f"bad file name {name!r}" in unknown_hop.json()["error"]["message"]
        shown = httpx.get(f"{second_tiny_server.url}/admin/weight_uploads/{second['upload_id']}", headers=AUTH,
                          timeout=30).json()
        assert shown["files"] == {} and shown["bytes"] == 0
    finally:
        httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{first['upload_id']}", headers=AUTH, timeout=30)
        httpx.delete(f"{second_tiny_server.url}/admin/weight_uploads/{second['upload_id']}", headers=AUTH,
                     timeout=30)
