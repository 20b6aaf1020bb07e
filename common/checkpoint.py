"""Checkpoints: one torch file per save, written atomically (a crash never leaves half a file)."""

import os
import random
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    """Python, numpy and torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """torch.save ``state`` to ``path`` via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise SystemExit(f"--resume {path}: no checkpoint there; pass a checkpoint.pt or its run folder.")
    # memory-mapped: a trainer rank that needs only the settings and counters does not read the tensors
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
