"""Resolve a model spec (registry name, local folder, local .gguf, hub id) and load it.

A GGUF model gets a plain HF folder in the cache: its config and tokenizer (read from the file's
metadata by transformers, once) and, only when something needs float weights (--dtype float32 /
bfloat16, --quantize, an architecture that runs through transformers, the bench's transformers
baselines, `draftwise train`), its weights dequantised by transformers into model.safetensors
(16-73 s here; 7.1 GB for Qwen2.5-Coder-1.5B). The default path runs the file's own blocks and
never needs them.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftwise.errors import ConfigError, ModelLoadError, ModelNotFoundError
from draftwise.kv_cache import cache_dtype, check_kv_cache, kv_cache_name
from draftwise.models import registry
from draftwise.models.base import ModelInfo
from draftwise.models.hf import HFModel, load_hf_model
from draftwise.models.gguf_weights import dequantised_note, read_blocks, rope_scaling
from draftwise.models.kernels import native_kernels
from draftwise.models.linear import (BlockWeight, WeightFormat, check_activations, check_quantize,
                                     default_activations, use_activations)
from draftwise.models.llama import (SUPPORTED_ARCHITECTURES, DecoderShape, LlamaModel, requested_rope_scaling,
                                     with_rope_scaling)
from draftwise.models.memory import keep_freed_memory

# --dtype: how the native decoder stores weights (activations: --activations, models/linear.py).
# "auto": a GGUF model's blocks as shipped (4-8 bits a weight), any other model in float32.
DTYPES = {"auto": None, "float32": WeightFormat.F32, "bfloat16": WeightFormat.BF16}
# The torch dtype transformers loads a model in, for the fallback and the bench's baselines.
TORCH_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel | HFModel
    tokenizer: object  # a transformers tokenizer
    folder: Path  # the HF folder the weights came from
    activations: str = "float32"  # what the linears round their input to (--activations, "auto" resolved)
    kv_cache: str = "float32"  # what the caches store keys and values in (--kv-cache, "auto" resolved)


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype transformers should load a model in for --dtype name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not supported: use one of {', '.join(DTYPES)}.") from None


def gguf_source(spec: str) -> Path | None:
    """The GGUF file spec's weights come from, if any (a packaged model or a local .gguf)."""
    if spec in registry.PACKAGED_MODELS:
        return registry.gguf_path(spec) if registry.is_fetched(spec) else None
    path = Path(spec).expanduser()
    ggufs = [] if _is_hf_folder(path) else _ggufs(path)
    return ggufs[0] if len(ggufs) == 1 else None


def check_findable(spec: str, auto_fetch: bool = False, weights: bool = False) -> None:
    """Raise resolve's error where spec names no model it can find, fetching and converting
    nothing (cheap: draftwise.load asks it of a draft model before loading the target). A hub id
    is taken on trust until it is downloaded."""
    if spec in registry.PACKAGED_MODELS:
        converted = registry.gguf_path(spec).parent / "hf"
        ready = _is_hf_folder(converted) or not weights and _is_described(converted)
        if not ready and not registry.is_fetched(spec) and not auto_fetch:
            raise ModelNotFoundError(
                f"model {spec!r} is not fetched yet: run `draftwise models fetch {spec}` first."
            )
        return
    path = Path(spec).expanduser()
    if path.exists():
        if not _is_hf_folder(path) and len(_ggufs(path)) != 1:
            raise ModelNotFoundError(
                f"{path} is neither an HF model folder (config.json + *.safetensors + tokenizer) "
                "nor a single .gguf file."
            )
        return
    if "/" not in spec or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"unknown model {spec!r}: not a packaged model ({', '.join(registry.PACKAGED_MODELS)}), "
            "not an existing path, not a hub id. See `draftwise models list`."
        )


def _ggufs(path: Path) -> list[Path]:
    """The GGUF files path stands for: itself, or those in the folder it names."""
    if path.suffix == ".gguf" and path.is_file():
        return [path]
    return sorted(path.glob("*.gguf")) if path.is_dir() else []


def resolve(spec: str, auto_fetch: bool = False, progress: bool = True, weights: bool = True) -> Path:
    """Return an HF folder (config.json + tokenizer + safetensors) for spec. weights=False: for
    a GGUF model, config and tokenizer suffice (the native decoder reads the file's blocks), so
    its weights are not dequantised into the folder unless they already are."""
    if spec in registry.PACKAGED_MODELS:
        converted = registry.gguf_path(spec).parent / "hf"
        if _is_hf_folder(converted) or not weights and _is_described(converted):
            return converted
        check_findable(spec, auto_fetch, weights)
        return _from_gguf(lambda: registry.fetch(spec, progress=progress), converted, weights)
    check_findable(spec, auto_fetch)
    path = Path(spec).expanduser()
    if path.exists():
        if _is_hf_folder(path):
            return path
        gguf = _ggufs(path)[0]
        return _from_gguf(lambda: gguf, _converted_folder_for(gguf), weights)
    return _download_from_hub(spec)


def load(spec: str, dtype: str = "auto", auto_fetch: bool = False, progress: bool = True,
         quantize: str | None = None, activations: str = "auto", kv_cache: str = "auto",
         rope_scaling: str | None = None) -> LoadedModel:
    """Load spec as a native model with its tokenizer. dtype says how weights are stored
    ("auto": a GGUF model's own blocks, else float32; "float32"; "bfloat16"); quantize ("int8"
    or "int4") re-quantizes the float weights into Q8_0 / Q4_1 blocks instead. activations:
    "float32", "int8" (each linear's input rounded to 8 bits per 32 values, integer dot products
    against the blocks: faster, close to float32), "bf16" (input and weights rounded to bfloat16,
    float32 sums), "amx" (the same rounding summed on AMX tiles) or "auto" (amx or bf16 for a GGUF
    model's own blocks where the CPU has AMX tiles or AVX-512 BF16, else float32:
    linear.default_activations); the result's .activations says which. kv_cache: what the caches
    store keys and values in, "float32", "bf16" or "auto" (bf16 unless the activations are
    float32; kv_cache.cache_dtype); .kv_cache says which. rope_scaling: "yarn:FACTOR" extends a
    model without rope scaling of its own to FACTOR times its context by YaRN (as llama.cpp's
    `--rope-scaling yarn --rope-scale FACTOR`). Architectures the native decoder lacks (e.g.
    Phi-3) load through transformers instead (models/hf.py)."""
    from transformers import AutoConfig, AutoTokenizer
    from safetensors.torch import load_file

    torch_dtype = parse_dtype(dtype)
    check_quantize(quantize)  # before the slow part
    check_activations(activations)
    check_kv_cache(kv_cache)
    requested = None if rope_scaling is None else requested_rope_scaling(rope_scaling)
    keep_freed_memory()  # forwards reuse their tensors' pages instead of faulting them in again
    own_blocks = dtype == "auto" and quantize is None  # a GGUF model then runs its file's blocks
    folder = resolve(spec, auto_fetch=auto_fetch, progress=progress, weights=not own_blocks)
    # The first load on a machine compiles the kernels (minutes): say so, and only once the model
    # is known to exist, so that a mistyped name is answered at once.
    native_kernels(progress)
    gguf_file = gguf_source(spec) if own_blocks else None
    with tqdm(total=3, desc=f"loading {spec}", unit="step", disable=not progress, leave=False) as bar:
        config = AutoConfig.from_pretrained(folder)
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            if activations not in ("auto", "float32"):
                raise ConfigError(f"--activations {activations} needs the native decoder, which does not implement "
                                  f"{config.model_type!r} ({spec} loads through transformers): drop --activations.")
            if kv_cache != "auto":
                raise ConfigError(f"--kv-cache {kv_cache} needs the native decoder, which does not implement "
                                  f"{config.model_type!r} ({spec} loads through transformers): drop --kv-cache.")
            if requested is not None:
                raise ConfigError(f"--rope-scaling needs the native decoder, which does not implement "
                                  f"{config.model_type!r} ({spec} loads through transformers): drop --rope-scaling.")
            folder = resolve(spec, auto_fetch=auto_fetch, progress=progress)  # transformers reads the weights
            return _load_through_transformers(spec, folder, config, torch_dtype, quantize)
        shape = DecoderShape.from_hf_config(config)
        source = gguf_file or gguf_source(spec)  # its float weights too come from a GGUF file's
        if source is not None:  # rope scaling that transformers' GGUF reader leaves out of the config
            shape = gguf_rope_scaling(shape, source, spec)
        if requested is not None:
            shape = requested_scaling(shape, requested, spec)
        bar.update()
        if gguf_file is not None:
            weights = read_blocks(gguf_file, config.model_type, shape.num_heads, shape.num_kv_heads)
            if (note := dequantised_note(gguf_file, weights)) is not None:
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        else:
            weights = {}
            for shard in sorted(folder.glob("*.safetensors")):
                weights.update(load_file(shard))
        bar.update()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        bar.update()
    info = ModelInfo(
        name=spec,
        vocab_size=shape.vocab_size,
        max_context=shape.max_context,
        eos_token_ids=_eos_token_ids(config, tokenizer),
    )
    if gguf_file is not None:
        model = LlamaModel.from_blocks(shape, info, weights)
    else:
        model = LlamaModel.from_state_dict(shape, info, weights, DTYPES[dtype] or WeightFormat.F32, quantize)
    if activations == "auto":
        formats = frozenset(m.format for m in model.modules() if isinstance(m, BlockWeight))
        activations = default_activations(own_blocks=gguf_file is not None, formats=formats)
    use_activations(model, activations)
    model.cache_dtype = cache_dtype(kv_cache, activations)
    del weights  # the model copied them out of the mapped files: let the mappings go
    return LoadedModel(model, tokenizer, folder, activations, kv_cache_name(model.cache_dtype))


def gguf_rope_scaling(shape: DecoderShape, path: Path, spec: str) -> DecoderShape:
    """shape with the rope scaling of the GGUF file at path: its rope_freqs divisors (Llama 3.1+),
    else its `<arch>.rope.scaling.*` metadata (linear: a Gemma 3 4B's global layers; yarn: a Qwen2.5
    converted with its long-context settings), which the config transformers wrote from the file
    lacks; a kind or setting the decoder does not run is refused."""
    divisors, scaling = rope_scaling(path)
    if divisors is not None:
        return rope_scaled(shape, divisors, spec)
    if not scaling or shape.rope_factors:
        return shape
    try:
        # llama.cpp's YaRN counts the original context as the file's own where no key says otherwise
        parameters = ({"original_max_position_embeddings": shape.max_context, **_llama_cpp_yarn(scaling)}
                      if scaling["rope_type"] == "yarn" else scaling)
        return with_rope_scaling(shape, parameters)
    except (KeyError, ModelLoadError) as error:
        raise ModelLoadError(f"{spec}: its rope scaling {scaling} cannot be applied: {error}") from None


# llama.cpp's YaRN settings a GGUF file may carry, at the values that leave its rope_yarn as
# transformers' (cos and sin scaled by 0.1 ln(factor) + 1, the ramp fully applied); others are
# refused by name rather than run otherwise.
_YARN_NO_OPS = {"attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_ext_factor": (-1.0, 1.0),
                "yarn_log_multiplier": (0.0,)}


def _llama_cpp_yarn(scaling: dict) -> dict:
    """A GGUF file's YaRN metadata as transformers' rope parameters."""
    parameters = {"rope_type": "yarn"}
    for key, value in scaling.items():
        if key in _YARN_NO_OPS:
            if float(value) not in _YARN_NO_OPS[key]:
                raise ModelLoadError(f"rope.scaling.{key}={float(value):g} is not run by the native decoder (it runs YaRN as "
                                     "transformers does: factor, original_context_length, beta_fast, beta_slow)")
        elif key in ("yarn_beta_fast", "yarn_beta_slow"):
            parameters[key.removeprefix("yarn_")] = float(value)
        elif key != "finetuned":
            parameters[key] = value
    return parameters


def requested_scaling(shape: DecoderShape, parameters: dict, spec: str) -> DecoderShape:
    """shape with --rope-scaling's YaRN over its own context, where it has no scaling already."""
    if shape.rope_factors:
        raise ConfigError(f"{spec} already carries rope scaling (its config or file sets it): drop --rope-scaling.")
    return with_rope_scaling(shape, {**parameters, "original_max_position_embeddings": shape.max_context})


def rope_scaled(shape: DecoderShape, divisors: torch.Tensor, spec: str) -> DecoderShape:
    """shape with a GGUF file's rope_freqs (one divisor per rotary frequency: how llama.cpp stores
    Llama 3.1+'s rope scaling, which its config then omits)."""
    if divisors.numel() != shape.head_dim // 2:
        raise ModelLoadError(f"{spec}: rope_freqs holds {divisors.numel()} values; its heads of {shape.head_dim} "
                             f"need {shape.head_dim // 2} (one per rotary frequency).")
    return replace(shape, rope_factors=tuple(float(value) for value in divisors))


def weights_folder(loaded: LoadedModel, progress: bool = True) -> Path:
    """loaded's HF folder with its float weights in it (for transformers, or to read tables from
    the safetensors): a GGUF model's are dequantised into it the first time they are asked for."""
    return resolve(loaded.model.info.name, auto_fetch=True, progress=progress)


def runs_natively(spec: str, progress: bool = True) -> bool:
    """Whether spec's architecture runs on the native decoder (else: through transformers)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve(spec, progress=progress, weights=False)).model_type in SUPPORTED_ARCHITECTURES


def _load_through_transformers(spec: str, folder: Path, config, dtype: torch.dtype, quantize: str | None) -> LoadedModel:
    from transformers import AutoTokenizer

    if quantize is not None:
        raise ConfigError(
            f"--quantize {quantize} needs the native decoder, which does not implement "
            f"{config.model_type!r} ({spec} loads through transformers): drop --quantize."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    info = ModelInfo(
        name=spec,
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
        eos_token_ids=_eos_token_ids(config, tokenizer),
    )
    return LoadedModel(load_hf_model(folder, info, dtype), tokenizer, folder)


def describe_gguf(gguf_file: Path, out_folder: Path) -> Path:
    """Save a GGUF file's config and tokenizer (read from its metadata by transformers) as an HF
    folder without weights (atomically): what a load of the file's own blocks needs."""
    from transformers import AutoConfig, AutoTokenizer

    staging = out_folder.with_name(out_folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        kwargs = {"gguf_file": gguf_file.name}
        config = AutoConfig.from_pretrained(gguf_file.parent, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    except Exception as error:  # transformers raises many types for unsupported GGUF content
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(f"transformers could not read {gguf_file}: {error}") from error
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder's weights, when written, are plain float32
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out_folder, ignore_errors=True)
    staging.replace(out_folder)
    return out_folder


def convert_gguf(gguf_file: Path, out_folder: Path) -> Path:
    """Dequantise a GGUF file with transformers into out_folder/model.safetensors (float32,
    written under another name and renamed: a reader never sees half a file), describing the
    folder first where describe_gguf has not."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if not _is_described(out_folder):
        describe_gguf(gguf_file, out_folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, gguf_file=gguf_file.name)
    except Exception as error:  # transformers raises many types for unsupported GGUF content
        raise ModelLoadError(f"transformers could not read {gguf_file}: {error}") from error
    state_dict = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # safetensors refuses shared storage
    partial = out_folder / "model.safetensors.partial"
    save_file(state_dict, str(partial), metadata={"format": "pt"})
    partial.replace(out_folder / "model.safetensors")
    return out_folder


def _from_gguf(gguf_file, folder: Path, weights: bool) -> Path:
    """folder for the GGUF file gguf_file() returns (fetching it, for a packaged model), with
    its weights or only described; one process writes it (an inter-process lock), the others
    wait and then find it written."""
    ready = _is_hf_folder if weights else _is_described
    if ready(folder):
        return folder
    with registry.exclusive(folder):
        if ready(folder):
            return folder
        return (convert_gguf if weights else describe_gguf)(gguf_file(), folder)


def _is_described(path: Path) -> bool:
    """An HF folder's config and tokenizer are there (its weights may not be)."""
    return (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()


def _converted_folder_for(gguf_file: Path) -> Path:
    stat = gguf_file.resolve().stat()
    key = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return registry.cache_root() / registry.CONVERTED / f"{gguf_file.stem}-{digest}"


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _download_from_hub(hub_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]))
    except Exception as error:  # offline, unknown repo, gated repo: all end the same way
        raise ModelNotFoundError(
            f"could not fetch {hub_id!r} from a model hub ({type(error).__name__}). Use a packaged "
            f"model ({', '.join(registry.PACKAGED_MODELS)}) or a local folder / .gguf path."
        ) from None


def _eos_token_ids(config, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))
