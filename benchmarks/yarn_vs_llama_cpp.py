"""YaRN as llama.cpp runs it: SmolLM2's GGUF file with YaRN keys added (factor 4 over an original
context of 128 positions), draftwise's logits against llama.cpp's (llama-cpp-python) on a 301-token
prompt, each with and without the scaling, so the crossed pairs show what ignoring it would cost.

    python benchmarks/yarn_vs_llama_cpp.py

llama.cpp rounds activations to 8 bits, so even the matching pairs differ by about a logit;
tests/test_model_parity.py holds the exact comparison (against transformers' YaRN). llama.cpp runs
in a child process: it and draftwise's kernels in one process crashed here."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

TEXT = ("The history of the Roman Empire is long and complicated. It began with the founding of the city "
        "and ended many centuries later. ") * 12
FIRST = 99  # logits compared from this position on; the scaled band starts near position 128

CHILD = """
import json, sys, numpy as np, llama_cpp
path, ids_path, out, scaled = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
ids = json.load(open(ids_path))
llm = llama_cpp.Llama(path, n_ctx=1024, logits_all=True, verbose=False, n_threads=2,
                      **({} if scaled else {"rope_scaling_type": 0}))  # 0: none, whatever the file says
llm.eval(ids)
np.save(out, np.array(llm.scores[%d:len(ids)]))
""" % FIRST


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests/ (its GGUF copier)
    from draftwise.models import loading, registry
    from draftwise.models.kernels import describe_machine, machine
    from tests.gguf_copy import copy_gguf

    def yarn_keys(writer, arch: str) -> None:
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", 4.0)
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", 128)

    folder = Path(tempfile.mkdtemp())
    path = folder / "smollm2-yarn.gguf"
    loading.resolve("smollm2-135m", auto_fetch=True, progress=False)
    copy_gguf(registry.gguf_path("smollm2-135m"), path, metadata=yarn_keys)
    loading._converted_folder_for = lambda gguf_file: gguf_file.parent / "converted"
    ours = {}
    for name, spec in (("YaRN", str(path)), ("none", "smollm2-135m")):
        loaded = loading.load(spec, activations="float32", kv_cache="float32", progress=False)
        ids = loaded.tokenizer.encode(TEXT)
        ours[name] = loaded.model.forward(torch.tensor(ids), torch.arange(len(ids)),
                                          loaded.model.new_cache(len(ids)))[FIRST:]
    (folder / "ids.json").write_text(json.dumps(ids))
    print(describe_machine(machine()))
    print(f"{len(ids)} tokens; positions {FIRST}..{len(ids) - 1}; max / mean |logit diff|, top-1 agreement")
    for label, scaled in (("YaRN", "1"), ("none", "0")):
        out = folder / f"llama_cpp_{label}.npy"
        subprocess.run([sys.executable, "-c", CHILD, str(path), str(folder / "ids.json"), str(out), scaled], check=True)
        reference = torch.from_numpy(np.load(out))
        for name, logits in ours.items():
            diff = (logits - reference).abs()
            agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
            print(f"llama.cpp {label:4} vs draftwise {name:4}: {diff.max():.3f} / {diff.mean():.4f}, {agree:.3f}")


if __name__ == "__main__":
    main()
