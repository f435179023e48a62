"""Where relative paths of the project resolve (the one definition; engine.config reuses it), and
where the installed data packages (weights, the dataset) keep their files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The served model's converted folder, relative to project_root(): engine.config's default model,
# and the model a probe predictor reads unless told otherwise (the Makefile's MODEL_DIR).
SERVED_MODEL_REF = "data/models/smollm2-135m-instruct"


def project_root() -> Path:
    """The checkout's root, so default paths do not depend on the directory a command runs in;
    for an installed (non-editable) package, which has no checkout around it, the working
    directory."""
    checkout = Path(__file__).resolve().parents[1]
    return checkout if (checkout / "pyproject.toml").exists() else Path.cwd()


def package_dir(name: str, install_hint: str = "") -> Path:
    """Folder of an installed package, found without importing it: the data packages hold only
    files, and their declared dependencies are not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed" + (f" ({install_hint})" if install_hint else ""))
    return Path(list(spec.submodule_search_locations)[0])


def digest_files(digest, paths) -> None:
    """Feed each file's name and contents to `digest` (a hashlib object), in the order given, a
    chunk at a time: the weight fingerprints of the encoder and the probe."""
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as data:
            while chunk := data.read(1 << 24):
                digest.update(chunk)
