"""draftwise's own GGUF tensor table (models/gguf_index.py) against gguf-py's reader: the same
tensors, formats, shapes and bytes, on the packaged SmolLM2 file and on files gguf-py writes with
every kind of metadata; broken files refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from draftwise.errors import ModelLoadError
from draftwise.models import loading
from draftwise.models.gguf_index import GGUFFormatError, read_index
from draftwise.models.gguf_weights import read_blocks


def _agrees_with_gguf_py(path) -> int:
    ours = read_index(path)
    theirs = GGUFReader(path).tensors
    assert [e.name for e in ours] == [t.name for t in theirs]
    file = np.memmap(path, dtype=np.uint8, mode="r")
    for entry, tensor in zip(ours, theirs):
        assert entry.format == tensor.tensor_type and entry.shape == tuple(int(d) for d in tensor.shape)
        assert entry.offset == tensor.data_offset and entry.num_bytes == tensor.n_bytes
        assert np.array_equal(file[entry.offset:entry.offset + entry.num_bytes], np.asarray(tensor.data).view(np.uint8).ravel())
    return len(ours)


def test_the_packaged_smollm2_file_reads_as_gguf_py_reads_it():
    loading.resolve("smollm2-135m", auto_fetch=True, progress=False)
    assert _agrees_with_gguf_py(loading.gguf_source("smollm2-135m")) == 272


def _write(path, alignment: int | None = None) -> None:
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    # Every kind of metadata value a reader must step over, tokenizer-sized string arrays included.
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" * (i % 5) for i in range(3000)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_array("nested", [[1, 2, 3], [4, 5]])
    writer.add_uint64("a.uint64", 2**40)
    writer.add_bool("a.bool", True)
    writer.add_float64("a.float64", 0.5)
    writer.add_int8("a.int8", -3)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quants.quantize(weights, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", weights.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_files_written_by_gguf_py_read_alike(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    assert _agrees_with_gguf_py(path) == 3
    blocks = read_blocks(path, "qwen2", 1, 1)  # no row reordering outside llama
    assert blocks["model.layers.0.input_layernorm.weight"].shape == (64,)
    rows, format, columns = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert format == GGMLQuantizationType.Q8_0 and columns == 64 and tuple(rows.shape) == (8, 2 * 34)


@pytest.mark.parametrize("damage, reason", [
    (lambda data: b"", "empty"),
    (lambda data: b"GGML" + data[4:], "magic"),
    (lambda data: data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7"),
    (lambda data: data[:200], "truncated"),
    (lambda data: data[:-100], "past the end"),
])
def test_a_broken_file_is_refused_with_the_reason(tmp_path, damage, reason):
    path = tmp_path / "m.gguf"
    _write(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GGUFFormatError, match=reason):
        read_index(path)
    with pytest.raises(ModelLoadError, match=f"could not read .* as a GGUF file: .*{reason}"):
        read_blocks(path, "llama", 1, 1)


def test_a_gguf_file_loads_from_its_blocks_without_dequantised_weights(tmp_path, monkeypatch, smollm2):
    """The default path (the file's own blocks) needs the converted folder's config and tokenizer
    only: a GGUF file loaded by its path writes no model.safetensors (7.1 GB for Qwen2.5-Coder-1.5B
    in float32) and computes the packaged model's logits bit for bit."""
    import torch

    monkeypatch.setattr(loading, "_converted_folder_for", lambda gguf_file: tmp_path / "converted")
    loaded = loading.load(str(loading.gguf_source("smollm2-135m")), activations="float32", kv_cache="float32",
                          progress=False)
    assert loaded.folder == tmp_path / "converted" and (loaded.folder / "tokenizer_config.json").is_file()
    assert not list(loaded.folder.glob("*.safetensors"))
    tokens = torch.tensor(loaded.tokenizer.encode("The capital of France is"))
    logits = [model.forward(tokens, torch.arange(len(tokens)), model.new_cache(len(tokens)), num_logits=1)
              for model in (loaded.model, smollm2.model)]
    assert torch.equal(logits[0], logits[1])


def test_a_files_rope_freqs_become_the_shapes_rotary_divisors(tmp_path):
    """llama.cpp stores Llama 3.1+'s rope scaling as a rope_freqs tensor (one divisor per rotary
    frequency) and no config key for it: gguf_weights.rope_scaling reads it, loading.rope_scaled puts
    it in the shape (blocks or float weights alike), so the rotary table divides each frequency by
    it (left out, a Llama 3.2 file would run unscaled angles: a silently different model)."""
    import torch

    from draftwise.models.gguf_weights import rope_scaling
    from draftwise.models.llama import DecoderShape, RopeTable

    divisors = np.array([1.0, 1.0, 2.5, 8.0], dtype=np.float32)  # head_dim 8
    writer = GGUFWriter(tmp_path / "rope.gguf", "llama")
    writer.add_tensor("rope_freqs.weight", divisors)
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read, metadata = rope_scaling(tmp_path / "rope.gguf")
    assert torch.equal(read, torch.from_numpy(divisors))
    assert metadata == {}
    assert rope_scaling(loading.gguf_source("smollm2-135m")) == (None, {})  # SmolLM2 has no scaling
    shape = DecoderShape(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, qkv_bias=False,
                         tie_word_embeddings=True, max_context=64)
    scaled = loading.rope_scaled(shape, read, "rope.gguf")
    assert scaled.rope_factors == (1.0, 1.0, 2.5, 8.0)
    assert torch.equal(RopeTable(scaled).inv_freq, RopeTable(shape).inv_freq / torch.from_numpy(divisors))
    with pytest.raises(ModelLoadError, match="rope_freqs holds 3 values"):
        loading.rope_scaled(shape, torch.ones(3), "rope.gguf")


def test_a_files_rope_scaling_metadata_is_applied_or_refused(tmp_path):
    """`<arch>.rope.scaling.*` (a Gemma 3 4B file's linear factor 8 on its global layers, a Qwen2.5
    converted with YaRN), which transformers' GGUF reader leaves out of the config: applied as
    divisors (and YaRN's scale and context); a kind the decoder does not run (longrope) and a
    llama.cpp YaRN setting transformers has no counterpart for refused by name instead of run
    otherwise; the packaged files have none."""
    import math

    from draftwise.errors import ModelLoadError
    from draftwise.models.gguf_weights import rope_scaling
    from draftwise.models.llama import DecoderShape, rope_divisors

    def write(name: str, kind: str, factor: float, **extra: float):
        writer = GGUFWriter(tmp_path / name, "gemma3")
        writer.add_string("gemma3.rope.scaling.type", kind)  # as llama.cpp's converter writes it
        writer.add_float32("gemma3.rope.scaling.factor", factor)
        writer.add_uint32("gemma3.rope.scaling.original_context_length", 4096)
        for key, value in extra.items():
            writer.add_float32(f"gemma3.rope.scaling.{key}", value)
        writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    linear = write("linear.gguf", "linear", 8.0)
    assert rope_scaling(linear) == (None, {"rope_type": "linear", "factor": 8.0, "original_max_position_embeddings": 4096})
    shape = DecoderShape(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, qkv_bias=False,
                         tie_word_embeddings=True, max_context=64)
    assert loading.gguf_rope_scaling(shape, linear, "linear.gguf").rope_factors == (8.0,) * 4
    yarn = loading.gguf_rope_scaling(shape, write("yarn.gguf", "yarn", 4.0, yarn_beta_fast=4.0, yarn_ext_factor=1.0),
                                     "yarn.gguf")
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 4.0}
    assert yarn.rope_factors == rope_divisors(expected, 8, 10000.0) and yarn.rope_factors != rope_divisors(
        {**expected, "beta_fast": 32.0}, 8, 10000.0)
    assert yarn.rope_attention_factor == pytest.approx(1 + 0.1 * math.log(4)) and yarn.max_context == 4 * 4096
    with pytest.raises(ModelLoadError, match="rope.scaling.yarn_log_multiplier=0.1 is not run"):
        loading.gguf_rope_scaling(shape, write("deepseek.gguf", "yarn", 4.0, yarn_log_multiplier=0.1), "deepseek.gguf")
    with pytest.raises(ModelLoadError, match="rope scaling 'longrope' is not supported"):
        loading.gguf_rope_scaling(shape, write("longrope.gguf", "longrope", 4.0), "longrope.gguf")
    for name in ("smollm2-135m", "gemma3-270m"):
        loading.resolve(name, auto_fetch=True, progress=False, weights=False)
        assert rope_scaling(loading.gguf_source(name)) == (None, {})
