"""A saved predictor is a folder: weights plus `predictor.json` naming its kind and provenance.

`load(path)` reads the JSON, imports only the module of that kind (so a lexical predictor never
pays for torch) and hands it the folder. No mlflow here: the registry only stores such folders.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from predictor.base import Predictor

SPEC_FILENAME = "predictor.json"
FORMAT_VERSION = 1
LABELS = ("sharegpt", "trace")  # whose output lengths a predictor can have learned
# kind -> "module:class"; the class has `load(folder, spec)` and `save(folder)`.
KINDS: dict[str, str] = {
    "length": "predictor.length:LengthPredictor",
    "lexical": "predictor.lexical:LexicalPredictor",
    "embed_lgbm": "predictor.embed_lgbm:EmbedLgbmPredictor",
    "finetune": "predictor.finetune:FinetunePredictor",
    "probe": "predictor.probe:ProbePredictor",
}


@dataclass(frozen=True)
class PredictorSpec:
    kind: str
    feature_spec: dict[str, Any]  # what the features are (names, versions, encoder and truncation)
    data_hash: str  # hash of the training table, "" when unknown
    labels: str = "sharegpt"  # whose output lengths it learned: "sharegpt" or "trace"
    # Conversations kept out of its training, e.g. "trace:<trace hash>" for the trace's: a model
    # whose outputs become features of a trace-trained one must not have seen those prompts.
    held_out: str = ""
    version: int = FORMAT_VERSION
    metrics: dict[str, float] = field(default_factory=dict)  # validation figures at save time

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown predictor kind {self.kind!r}; known: {sorted(KINDS)}")
        if not isinstance(self.feature_spec, dict):  # a kind's loader reads its fields by name
            raise ValueError(f"feature_spec must be a JSON object, got {type(self.feature_spec).__name__}")
        if not _is_int(self.version):
            raise ValueError(f"version must be an integer, got {self.version!r}")
        if self.version > FORMAT_VERSION:
            raise ValueError(f"predictor format {self.version} is newer than this code ({FORMAT_VERSION})")
        # Evaluation reads these to tell which test prompts the predictor saw in training: a wrong
        # type failed there, after the whole test split was predicted.
        _check_provenance(self.labels, self.held_out, "")
        if not isinstance(self.data_hash, str):
            raise ValueError(f"data_hash must be a string, got {self.data_hash!r}")
        if not isinstance(self.metrics, dict):
            raise ValueError(f"metrics must be a JSON object, got {type(self.metrics).__name__}")
        prior = self.feature_spec.get("prior")
        if prior is not None:
            if not isinstance(prior, dict):
                raise ValueError(f"feature_spec's prior must be a JSON object, got {type(prior).__name__}")
            _check_provenance(prior.get("labels"), prior.get("held_out", ""), "the prior's ")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_provenance(labels: Any, held_out: Any, whose: str) -> None:
    if labels not in LABELS:
        raise ValueError(f"{whose}labels must be one of {LABELS}, got {labels!r}")
    if not isinstance(held_out, str):
        raise ValueError(f"{whose}held_out must be a string, got {held_out!r}")


def write_spec(folder: Path, spec: PredictorSpec) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fields = asdict(spec)
    if not spec.held_out:
        del fields["held_out"]  # so code from before the field existed still reads the folder
    (folder / SPEC_FILENAME).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def read_spec(folder: Path) -> PredictorSpec:
    path = Path(folder) / SPEC_FILENAME
    if Path(folder).is_file():  # its predictor.json, say: "predictor.json/predictor.json not found"
        raise FileNotFoundError(f"{folder} is a file: a saved predictor is a folder (pass the one holding it)")
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a saved predictor folder")
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a predictor spec (not JSON: {exc})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: not a predictor spec (a JSON object is expected)")
    # The version first: a newer format may carry fields this code does not know.
    version = fields.get("version", FORMAT_VERSION)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ValueError(f"predictor format {version} is newer than this code ({FORMAT_VERSION})")
    try:
        return PredictorSpec(**fields)
    except (TypeError, ValueError) as exc:  # missing or unknown fields, or a field's value
        raise ValueError(f"{path}: not a predictor spec ({exc})") from None


def predictor_class(kind: str):
    module_name, class_name = KINDS[kind].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def load(path: str | Path) -> Predictor:
    """Load a saved predictor folder (any kind)."""
    folder = Path(path)
    spec = read_spec(folder)
    try:
        return predictor_class(spec.kind).load(folder, spec)
    except (KeyError, TypeError) as exc:  # the spec or a weights file lacks a field its kind needs, or has a stray one
        raise ValueError(f"{folder}: its {spec.kind} feature spec or weights lack a field or carry a stray one "
                         f"({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # noqa: BLE001 - a weights file cut short or not what it is named
        # LightGBM's and numpy's errors name neither the folder nor the kind, and LightGBMError is no
        # ValueError: it was a 36-line traceback. Chained, so LENGTHWISE_TRACEBACK=1 still shows it.
        raise ValueError(f"{folder}: its {spec.kind} predictor does not load "
                         f"({type(exc).__name__}: {exc})") from exc


def save(predictor, path: str | Path) -> Path:
    """Write `predictor` (which carries its own spec) to the folder `path`, which must be new or
    empty: files of another predictor left beside the new ones (a stacked model's `prior/`) would
    change what the folder loads as."""
    folder = Path(path)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: save a predictor into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    predictor.save(folder)
    write_spec(folder, predictor.spec)
    return folder
