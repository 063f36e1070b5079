"""The native decoder computes what transformers computes on the same weights."""

import math
from dataclasses import replace

import pytest
import torch

from tests.conftest import PROMPTS

# float32 logits of SmolLM2 are O(10-40); both implementations do the same float32 ops in a
# slightly different order, so they agree to well under 1e-3 absolute.
FP32_ATOL = 1e-3


def prompt_ids(tokenizer, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        return torch.tensor(tokenizer.encode(prompt))
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("weights", ["gguf_blocks", "float32"])
def test_native_logits_match_transformers_in_float32(smollm2, smollm2_dense, hf_smollm2, weights):
    model = (smollm2 if weights == "gguf_blocks" else smollm2_dense).model
    for prompt in PROMPTS[:4]:
        ids = prompt_ids(smollm2.tokenizer, prompt)
        cache = model.new_cache(ids.shape[0])
        ours = model.forward(ids, torch.arange(ids.shape[0]), cache)
        with torch.no_grad():
            reference = hf_smollm2(ids[None]).logits[0].float()
        assert (ours - reference).abs().max() < FP32_ATOL


def test_incremental_decoding_matches_one_pass(smollm2, hf_smollm2):
    ids = prompt_ids(smollm2.tokenizer, PROMPTS[2])
    cache = smollm2.model.new_cache(ids.shape[0])
    pieces = [smollm2.model.forward(ids[:-3], torch.arange(ids.shape[0] - 3), cache, num_logits=1)]
    for position in range(ids.shape[0] - 3, ids.shape[0]):  # three more tokens, one at a time
        pieces.append(smollm2.model.forward(ids[position:position + 1], torch.tensor([position]), cache))
    with torch.no_grad():
        reference = hf_smollm2(ids[None]).logits[0, -4:].float()
    assert (torch.cat(pieces) - reference).abs().max() < FP32_ATOL


def test_bfloat16_model_agrees_on_the_argmax(smollm2):
    from draftwise.models import loading

    bf16 = loading.load("smollm2-135m", dtype="bfloat16", progress=False).model
    assert bf16.model.layers[0].mlp.up_proj.weight.format.name == "BF16"
    ids = prompt_ids(smollm2.tokenizer, PROMPTS[0])
    fp32_logits = smollm2.model.forward(ids, torch.arange(ids.shape[0]), smollm2.model.new_cache(ids.shape[0]))
    bf16_logits = bf16.forward(ids, torch.arange(ids.shape[0]), bf16.new_cache(ids.shape[0]))
    agreement = (fp32_logits.argmax(-1) == bf16_logits.argmax(-1)).float().mean()
    assert agreement > 0.9  # bf16 rounds, so near-ties may flip; the bulk must agree


def test_native_gemma3_matches_transformers_past_its_sliding_window(gemma, hf_gemma):
    """Gemma 3's decoder (scaled embeddings, 1 + w norms, query and key norms, sandwich norms, a
    GELU-gated MLP, five local layers of a 512-token window to each global one, two rotary bases)
    against transformers on the same weights, with a prompt longer than the window: a local layer
    that attended too far, or not far enough, moves the last positions' logits by far more."""
    ids = torch.tensor(gemma.tokenizer.encode("The history of the Roman Empire is long and complicated. " * 60))
    assert ids.shape[0] > 600  # past the window (512)
    ours = gemma.model.forward(ids, torch.arange(ids.shape[0]), gemma.model.new_cache(ids.shape[0]))
    reference = hf_gemma.forward(ids, torch.arange(ids.shape[0]), hf_gemma.new_cache(ids.shape[0]))
    # measured: 2.4e-4 over 662 positions (logits are O(10-30)); a window of 511 or 513 moved them by 0.65-0.72
    assert (ours - reference).abs().max() < FP32_ATOL
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    # --dtype float32 (the path of HF safetensors checkpoints, whose norms hold w, not 1 + w): the
    # same weights, so the blocks' float32 logits bit for bit
    from draftwise.models import loading

    dense = loading.load("gemma3-270m", dtype="float32", progress=False).model
    assert torch.equal(dense.forward(ids, torch.arange(ids.shape[0]), dense.new_cache(ids.shape[0])), ours)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.3}])
def test_rope_scaling_matches_transformers(scaling):
    """Llama 3.1+'s "llama3" rope scaling, "linear", and YaRN (Qwen2.5's long-context recipe): the
    native decoder against transformers on the same (random) weights. No such weights are packaged
    here, so the weights are random; the rotary angles are what is checked (a 64-token original
    context puts the scaled band inside this 300-token prompt's positions). A GGUF file carries
    llama3's scaling as its rope_freqs divisors (loading.rope_scaled), which rope_divisors
    reproduces, and YaRN's as metadata (test_gguf_index)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftwise.models.base import ModelInfo
    from draftwise.models.llama import DecoderShape, LlamaModel, RopeTable, rope_divisors

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_theta": 10000.0, **scaling})
    reference = LlamaForCausalLM(config).eval()
    shape = DecoderShape.from_hf_config(config)
    assert len(shape.rope_factors) == shape.head_dim // 2 and max(shape.rope_factors) == scaling["factor"]
    model = LlamaModel.from_state_dict(shape, ModelInfo("tiny", 128, 512, (0,)), reference.state_dict())
    ids = torch.randint(128, (300,))
    ours = model.forward(ids, torch.arange(300), model.new_cache(300))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    error = (ours - expected).abs().max()
    unscaled = LlamaModel.from_state_dict(DecoderShape.from_hf_config(LlamaConfig(**{
        **config.to_dict(), "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})),
        ModelInfo("tiny", 128, 512, (0,)), reference.state_dict())
    unscaled_error = (unscaled.forward(ids, torch.arange(300), unscaled.new_cache(300)) - expected).abs().max()
    # random weights give logits of O(0.3): measured 2.4e-7 with the scaling, 4.3e-3 / 4.5e-3 without it
    assert error < 1e-5 and unscaled_error > 1e-3, (error, unscaled_error)
    if scaling["rope_type"] == "yarn":  # YaRN's scale of cos and sin counts too: without it the logits move
        assert shape.rope_attention_factor > 1.0
        plain_angles = LlamaModel.from_state_dict(replace(shape, rope_attention_factor=1.0),
                                                  ModelInfo("tiny", 128, 512, (0,)), reference.state_dict())
        scale_error = (plain_angles.forward(ids, torch.arange(300), plain_angles.new_cache(300)) - expected).abs().max()
        assert scale_error > 1e-3, scale_error
    # the divisors, as a GGUF file's rope_freqs would give them, build the same table
    table = RopeTable(shape, factors=rope_divisors(config.rope_parameters, shape.head_dim, 10000.0))
    assert torch.equal(table.inv_freq, RopeTable(shape).inv_freq)


def test_a_gguf_files_yarn_metadata_runs_as_transformers_runs_yarn(smollm2, hf_smollm2, tmp_path, monkeypatch):
    """SmolLM2's own file with llama.cpp's YaRN keys added (what its converter writes for a config
    with YaRN: factor 4 over an original context of 128 positions, so this 300-token prompt reaches
    the scaled band), loaded as a user's .gguf file: its blocks on the native decoder against
    transformers running the same YaRN parameters on the same weights. Real weights, where the
    other rope-scaling cases have random ones; the logits move by the scaling (ignoring the
    metadata fails). And `--rope-scaling yarn:FACTOR` (loading.load's rope_scaling)."""
    from transformers import AutoModelForCausalLM

    from draftwise.errors import ConfigError
    from draftwise.models import loading, registry
    from draftwise.models.llama import rope_divisors
    from tests.gguf_copy import copy_gguf

    def yarn_keys(writer, arch: str) -> None:
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", 4.0)
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", 128)

    path = tmp_path / "smollm2-yarn.gguf"
    copy_gguf(registry.gguf_path("smollm2-135m"), path, metadata=yarn_keys)
    monkeypatch.setattr(loading, "_converted_folder_for", lambda gguf_file: gguf_file.parent / "converted")
    yarn = loading.load(str(path), activations="float32", kv_cache="float32", progress=False).model
    assert yarn.shape.rope_attention_factor == pytest.approx(1 + 0.1 * math.log(4))
    config = hf_smollm2.config.to_dict()
    theta = hf_smollm2.config.rope_parameters["rope_theta"]
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                 "rope_theta": theta}
    reference = AutoModelForCausalLM.from_config(type(hf_smollm2.config).from_dict(config), dtype=torch.float32).eval()
    reference.load_state_dict(hf_smollm2.state_dict())
    ids = torch.tensor(smollm2.tokenizer.encode("The history of the Roman Empire is long and complicated. " * 40))[:300]
    ours = yarn.forward(ids, torch.arange(300), yarn.new_cache(300))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    unscaled = smollm2.model.forward(ids, torch.arange(300), smollm2.model.new_cache(300))
    # measured: 8.0e-5 (logits O(10-40)); the same file without the YaRN keys differs by 6.9 past position 128
    assert (ours - expected).abs().max() < FP32_ATOL
    assert (unscaled - expected)[128:].abs().max() > 0.1
    # --rope-scaling yarn:FACTOR asks the same of a model that carries none, over its own context
    # (8,192 positions for SmolLM2), and is refused for one that does
    asked = loading.load("smollm2-135m", rope_scaling="yarn:4", progress=False).model.shape
    own = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert asked.rope_factors == rope_divisors(own, 64, theta) and asked.max_context == 4 * 8192
    with pytest.raises(ConfigError, match="already carries rope scaling"):
        loading.load(str(path), rope_scaling="yarn:2", progress=False)
    for text in ("yarn", "yarn:1", "dynamic:4"):
        with pytest.raises(ConfigError, match="give yarn:FACTOR"):
            loading.load("smollm2-135m", rope_scaling=text, progress=False)


def test_yarn_reaches_factor_times_the_original_context():
    """Qwen2.5's recipe adds YaRN (factor 4 over 32,768 positions) to a config whose
    max_position_embeddings stays 32,768: the model then takes 131,072 positions, as vLLM serves
    it; a config without the original length (transformers fills in max_position_embeddings) and one
    without a factor (the ratio of the two lengths, DeepSeek's form) are completed as transformers does."""
    from transformers import Qwen2Config

    from draftwise.errors import ModelLoadError
    from draftwise.models.llama import DecoderShape

    def shape(max_position: int, **rope):
        return DecoderShape.from_hf_config(Qwen2Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=max_position, rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", **rope}))

    qwen = shape(32768, factor=4.0, original_max_position_embeddings=32768)
    assert qwen.max_context == 131072 and qwen.rope_attention_factor == pytest.approx(1 + 0.1 * math.log(4))
    assert shape(32768, factor=4.0).max_context == 131072
    implied = shape(131072, factor=None, original_max_position_embeddings=32768)
    assert implied.rope_factors == qwen.rope_factors and implied.max_context == 131072
    with pytest.raises(ModelLoadError, match="partial_rotary_factor=0.5"):
        shape(32768, factor=4.0, partial_rotary_factor=0.5)


def test_an_unsupported_rope_scaling_is_refused_by_name():
    from transformers import LlamaConfig

    from draftwise.errors import ModelLoadError
    from draftwise.models.llama import DecoderShape

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         max_position_embeddings=512, rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic",
                                                                       "factor": 2.0})
    with pytest.raises(ModelLoadError, match="rope scaling 'dynamic' is not supported"):
        DecoderShape.from_hf_config(config)


def _native_and_reference_logits(shape, reference, length: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny random transformers model's weights on the native decoder: its logits and the
    reference's over `length` random tokens."""
    from draftwise.models.base import ModelInfo
    from draftwise.models.llama import LlamaModel

    model = LlamaModel.from_state_dict(shape, ModelInfo("tiny", 128, 512, (0,)), reference.state_dict())
    ids = torch.randint(128, (length,))
    with torch.no_grad():
        return model.forward(ids, torch.arange(length), model.new_cache(length)), reference(ids[None]).logits[0]


@pytest.mark.parametrize("architecture", ["qwen2", "mistral", "mistral, linear rope scaling"])
def test_sliding_window_architectures_match_transformers(architecture):
    """Qwen2's sliding layers (from max_window_layers on) and Mistral's (all of them) attend within
    the decoder's window, as Gemma 3's local layers do, rotated as the other layers are (rope
    scaling included): against transformers on random weights, a prompt 2.5x the window."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from draftwise.models.llama import DecoderShape

    torch.manual_seed(2)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, sliding_window=48,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    if "linear" in architecture:
        common["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}
    config = (Qwen2Config(**common, use_sliding_window=True, max_window_layers=1) if architecture == "qwen2"
              else MistralConfig(**common))
    reference = AutoModelForCausalLM.from_config(config).eval()
    shape = DecoderShape.from_hf_config(config)
    assert shape.sliding_window == 48 and shape.local_layers == ((1,) if architecture == "qwen2" else (0, 1))
    assert shape.max_context == 512  # no longer capped at the window
    ours, expected = _native_and_reference_logits(shape, reference)
    assert (ours - expected).abs().max() < 1e-5


@pytest.mark.parametrize("sliding", [False, True])
def test_qwen3_matches_transformers(sliding):
    """Qwen3 is Qwen2 without q/k/v biases, with each head's query and key RMS-normed (weights w)
    before rope; its optional sliding layers take the decoder's window. Against transformers'
    Qwen3ForCausalLM on random weights (no Qwen3 weights are packaged here), a prompt longer than
    the window."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from draftwise.models.llama import DecoderShape

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                         use_sliding_window=sliding, sliding_window=48, max_window_layers=1,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    reference = Qwen3ForCausalLM(config).eval()
    for norm in (reference.model.layers[0].self_attn.q_norm, reference.model.layers[1].self_attn.k_norm):
        norm.weight.data.uniform_(0.5, 1.5)  # not all ones: a norm left out must show
    shape = DecoderShape.from_hf_config(config)
    assert shape.qk_norm and (shape.local_layers != ()) == sliding
    ours, expected = _native_and_reference_logits(shape, reference)
    assert (ours - expected).abs().max() < 1e-5
