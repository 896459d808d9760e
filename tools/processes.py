"""The chat-template render children a process has (/proc), for the soak and the tests."""

from __future__ import annotations

from pathlib import Path


def template_children(pid: int) -> int:
    """How many `python -m jaxinfer.chat_template` children process `pid` has now."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        count += parent == pid and b"jaxinfer.chat_template" in command
    return count
