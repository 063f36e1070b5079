"""Output folders: made before the work that fills them, so that a bad --out is said at once
and never after minutes of benchmarking or training."""

from __future__ import annotations

from pathlib import Path

from draftwise.errors import ConfigError


def make_output_folder(folder: Path, holds: str) -> None:
    """Make folder (and its parents) or raise a ConfigError naming why not: a file in its place or
    a place this process cannot write. holds: what goes there, for the message."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        what = "a file" if folder.exists() else f"not writable here ({error.strerror})"
        raise ConfigError(f"the output folder {folder} is {what}: give --out a folder to hold {holds}.") from None
