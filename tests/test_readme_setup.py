"""The README's two set-up commands are the ones CI runs, and each installs before it serves or tests."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)]


def _dry_run(target: str) -> list[str]:
    """The commands ``make TARGET`` would run, in order (make -n runs nothing)."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip() and not line.startswith("make")]


def test_readme_gives_the_two_set_up_commands() -> None:
    blocks = _bash_blocks()
    assert "make serve" in blocks
    assert "make test" in blocks


def test_ci_runs_the_readme_test_command_as_written() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in [line.strip() for line in ci]


def test_make_serve_installs_the_serving_extra_then_starts_the_builtin_server() -> None:
    commands = _dry_run("serve")
    assert "install -e ./clients" in commands[0]  # first: pip 23 looks for it on the index otherwise
    assert 'install -e ".[cpu]"' in commands[1]
    assert "uninstall -y torchvision torchaudio torchcodec" in commands[2]
    assert commands[-1].strip() == "samrollout serve"


def test_make_test_installs_the_dev_tools_then_runs_pytest() -> None:
    commands = _dry_run("test")
    assert '"./clients[progress]"' in commands[0]
    assert '".[cpu,dev]"' in commands[1]
    assert any("arctic-inference" in c for c in commands)
    assert any("prometheus" in c for c in commands)
    assert commands[-1].strip().endswith("-m pytest")
