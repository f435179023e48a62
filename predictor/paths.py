"""Where relative paths of the project resolve (the one definition; engine.config reuses it)."""

from __future__ import annotations

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
