"""Disk cache of prompt encodings (MiniLM embeddings, the served model's probe states), keyed by
the text the encoder sees.

Embedding tens of thousands of prompts takes most of an hour on two shared cores, so vectors are
computed once and stored under data/cache/embeddings/<encoder-config-hash>/ as append-only npz
chunks (keys: BLAKE2b of the encoder text; vectors: fp16). An encoder config says what identifies
its vectors (`cache_identity()`) and which text of a prompt it reads (`key_text(prompt)`). A
chunk is written under a temporary name and renamed into place, so a killed run loses at most
the chunk it was computing (a chunk that cannot be read, as one cut off by older code, is skipped
with a warning); the next run skips every key already stored. Identical requests ("continue")
are embedded once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.encoder import EncoderConfig
from predictor.probe import ProbeConfig
from training.dataset import REPO_ROOT

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ROOT = REPO_ROOT / "data" / "cache" / "embeddings"
CHUNK_SIZE = 512


def text_key(prompt: str, config: EncoderConfig | ProbeConfig) -> bytes:
    return hashlib.blake2b(config.key_text(prompt).encode("utf-8"), digest_size=16).digest()


def cache_dir(config: EncoderConfig | ProbeConfig, root: Path = DEFAULT_CACHE_ROOT) -> Path:
    digest = hashlib.sha256(json.dumps(config.cache_identity(), sort_keys=True).encode()).hexdigest()[:12]
    return root / digest


def read_cache(directory: Path) -> dict[bytes, np.ndarray]:
    stored: dict[bytes, np.ndarray] = {}
    for chunk in sorted(directory.glob("chunk_*.npz")):
        try:
            with np.load(chunk) as data:
                pairs = list(zip(data["keys"], data["vectors"]))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            logger.warning("skipping unreadable embedding chunk %s (%s)", chunk, exc)
            continue
        for key, vector in pairs:
            stored[bytes(key)] = vector
    return stored


def _write_chunk(path: Path, keys: np.ndarray, vectors: np.ndarray) -> None:
    partial = path.with_name(f".{path.name}.partial")  # outside the chunk_*.npz glob until renamed
    with partial.open("wb") as out:
        np.savez(out, keys=keys, vectors=vectors)
    os.replace(partial, path)


def fill_cache(prompts: Sequence[str], config: EncoderConfig | ProbeConfig, root: Path = DEFAULT_CACHE_ROOT,
               encoder=None) -> int:
    """Embed every prompt whose key is not stored yet, in stored order; returns how many were new."""
    from tqdm import tqdm

    if encoder is not None and encoder.config.cache_identity() != config.cache_identity():
        raise ValueError("the encoder given is not the one `config` describes: its vectors would be "
                         "stored under another encoder's key")
    directory = cache_dir(config, root)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.as_dict(), indent=2))
    stored = read_cache(directory)
    todo: dict[bytes, str] = {}
    for prompt in prompts:
        key = text_key(prompt, config)
        if key not in stored and key not in todo:
            todo[key] = prompt
    if not todo:
        return 0
    if encoder is None:
        encoder = _encoder_for(config)
    keys = list(todo)
    # After the highest chunk, not after the count: a chunk deleted in the middle must not make
    # the next write replace the newest one. (A partial file a killed run left is never read.)
    numbers = (re.fullmatch(r"chunk_(\d+)\.npz", p.name) for p in directory.glob("chunk_*.npz"))
    next_index = 1 + max((int(m.group(1)) for m in numbers if m), default=-1)
    for start in tqdm(range(0, len(keys), CHUNK_SIZE), desc="embed", unit="chunk"):
        chunk_keys = keys[start : start + CHUNK_SIZE]
        vectors = encoder.encode([todo[key] for key in chunk_keys]).astype(np.float16)
        keys_array = np.frombuffer(b"".join(chunk_keys), dtype=np.uint8).reshape(len(chunk_keys), 16)
        _write_chunk(directory / f"chunk_{next_index:05d}.npz", keys_array, vectors)
        next_index += 1
    return len(keys)


def _encoder_for(config):
    from predictor.encoder import MiniLMEncoder
    from predictor.probe import HiddenStateProbe

    return HiddenStateProbe(config) if isinstance(config, ProbeConfig) else MiniLMEncoder(config)


def cached_embeddings(prompts: Sequence[str], config: EncoderConfig | ProbeConfig,
                      root: Path = DEFAULT_CACHE_ROOT) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [N, dim] float32 of the cached prompts, boolean mask of which prompts were cached)."""
    stored = read_cache(cache_dir(config, root))
    keys = [text_key(prompt, config) for prompt in prompts]
    found = np.asarray([key in stored for key in keys])
    dim = next(iter(stored.values())).shape[0] if stored else 384  # nothing found: the rows are unused
    out = np.zeros((len(prompts), dim), dtype=np.float32)
    for row, key in enumerate(keys):
        if found[row]:
            out[row] = stored[key]
    return out, found
