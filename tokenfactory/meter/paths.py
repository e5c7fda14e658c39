"""The data directory every command that reads or writes the ledger shares (light: no heavy imports).

`--data-dir DIR` wins; else $TOKENFACTORY_DATA_DIR; else the platform's per-user data directory:
$XDG_DATA_HOME/tokenfactory (default ~/.local/share/tokenfactory) on Linux and other Unixes,
~/Library/Application Support/tokenfactory on macOS, %LOCALAPPDATA%\\tokenfactory on Windows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DATA_DIR_ENV = "TOKENFACTORY_DATA_DIR"
LEDGER_FILENAME = "ledger.db"


def default_data_dir() -> Path:
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "tokenfactory"


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """`data_dir` if given (the --data-dir flag), else default_data_dir()."""
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def ledger_path(data_dir: str | Path | None) -> Path:
    return resolve_data_dir(data_dir) / LEDGER_FILENAME
