"""MLflow tracking and registry of predictor runs.

Every `lengthwise train` run logs its config, data hash, git sha (and whether tracked files
differed from it), metrics, plots and the saved predictor folder (artifact path `predictor`). After
each run the registry is reconciled: the run with the best validation Kendall's tau in the
experiment is the `champion` alias of model `lengthwise-predictor` (a new model version is made
only when the champion changes). Only runs whose validation taus are comparable compete: tagged
with this code's lexical feature version (a predictor trained on other features would not load) and
with the tau of the scheduler's order (`tau_of`), trained and validated on ShareGPT's labels with
nothing held out (a trace run is validated on other labels, a `--hold-out-trace` run on a smaller
validation split), logged as a candidate (not `--no-register`), and scored on the same fixed
validation rows (`SELECTION_METRIC`: each kind validates on its own number of rows, and a small set
flatters). The tracking URI is set inside `tracking_session`, never at import."""

from __future__ import annotations

import sqlite3
import subprocess
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

from engine.arg_types import check_output_location
from predictor.features import FEATURE_SPEC_VERSION
from training.dataset import REPO_ROOT

MODEL_NAME = "lengthwise-predictor"
CHAMPION_ALIAS = "champion"
EXPERIMENT_NAME = "lengthwise-predictor"
# Kendall's tau on training.train.SELECTION_ROWS fixed validation rows, the same for every run.
SELECTION_METRIC = "val_kendall_tau_selection"
# What SELECTION_METRIC is the tau of: the order the scheduler uses. Untagged runs measured the
# predictor's score (for a lambdarank or ListMLE run not that order), runs tagged "p50" the
# median, which a head trained on capped labels can predict as the cap for every prompt; only
# runs with this tag compete for champion.
TAU_OF = "rank_len"
ARTIFACT_PATH = "predictor"


def default_store() -> Path:
    return REPO_ROOT / "mlruns"


def tracking_uri(store: Path) -> str:
    return f"sqlite:///{Path(store).resolve() / 'mlflow.db'}"


def check_store(store: Path, for_writing: bool = True, flag: str = "MLflow store") -> None:
    """An MLflow store is a folder: refuse a file in its place, and, for a store to be written, a
    folder that cannot be made or written, before any work is done for it (`main` checks a
    command's --store before it runs). Nothing is created here: a command refused later must not
    leave a store behind; `tracking_session` makes it when a run is logged."""
    if store.exists() and not store.is_dir():
        raise NotADirectoryError(f"{flag} {store} is a file, not a folder")
    if for_writing:
        check_output_location(store, flag, folder=True)
        # Found after a whole training run, this was a database error's traceback, nothing logged.
        database = store / "mlflow.db"
        foreign = (database.exists() and not database.is_file()) or (_holds_data(database)
                                                                     and not _has_registry(database))
        if foreign:
            raise ValueError(f"{flag} {store}: its mlflow.db is not an MLflow store")


@contextmanager
def tracking_session(store: Path | None = None, experiment: str = EXPERIMENT_NAME) -> Iterator[str]:
    """Point mlflow at `store` (sqlite + artifact folder) and make sure `experiment` exists there."""
    store = Path(store or default_store())
    check_store(store)
    import mlflow

    store.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri(store)
    previous, previous_registry = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        if mlflow.get_experiment_by_name(experiment) is None:
            mlflow.create_experiment(experiment, artifact_location=(store / "artifacts").resolve().as_uri())
        mlflow.set_experiment(experiment)
        yield uri
    finally:  # both: a later session's model lookups must not read this store's registry
        mlflow.set_tracking_uri(previous)
        mlflow.set_registry_uri(previous_registry)


def comparison_tags(labels: str, held_out: str, candidate: bool = True) -> dict[str, str]:
    """The tags that say whether a run's validation tau can be compared for champion; `candidate`
    False for a run logged with --no-register, which must not win later either."""
    return {"labels": labels, "held_out": held_out or "none", "candidate": str(candidate).lower()}


def git_tags(repo: Path = REPO_ROOT) -> dict[str, str]:
    """The commit a run was trained from, and whether tracked files differed from it (the sha
    alone named a commit whose code the run may not have had)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"git_sha": git("rev-parse", "HEAD"),
                "git_dirty": str(bool(git("status", "--porcelain", "--untracked-files=no"))).lower()}
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": "unknown", "git_dirty": "unknown"}


def log_run(run_name: str, params: dict, metrics: dict[str, float], predictor_dir: Path,
            plots: list[Path], tags: dict[str, str]) -> str:
    """One finished training run; returns its run id. Call inside `tracking_session`."""
    import mlflow

    with mlflow.start_run(run_name=run_name) as run:
        mlflow.set_tags({**git_tags(), "feature_version": str(FEATURE_SPEC_VERSION), "tau_of": TAU_OF,
                         **tags})
        mlflow.log_params({key: str(value)[:500] for key, value in params.items()})
        mlflow.log_metrics({key: float(value) for key, value in metrics.items()})
        for plot in plots:
            mlflow.log_artifact(str(plot), artifact_path="plots")
        mlflow.log_artifacts(str(predictor_dir), artifact_path=ARTIFACT_PATH)
        return run.info.run_id


def best_run_id(data_hash: str | None = None) -> str | None:
    """The best comparable run, the earliest of equals; with `data_hash`, only among runs trained on
    that turn table (the selection rows are drawn from it, so a tau on another table's rows is not
    comparable)."""
    import mlflow

    loadable = (f"attributes.status = 'FINISHED' AND tags.feature_version = '{FEATURE_SPEC_VERSION}'"
                f" AND tags.tau_of = '{TAU_OF}' AND tags.labels = 'sharegpt' AND tags.held_out = 'none'"
                f" AND tags.candidate = 'true' AND metrics.{SELECTION_METRIC} >= -1")
    if data_hash is not None:
        loadable += f" AND tags.data_hash = '{data_hash}'"
    # Among equals the earliest: the newest won a tie, so each rerun of the same config took the
    # alias and made a new model version.
    runs = mlflow.search_runs(experiment_names=[EXPERIMENT_NAME], filter_string=loadable,
                              order_by=[f"metrics.{SELECTION_METRIC} DESC", "attributes.start_time ASC"],
                              max_results=1, output_format="list")
    return runs[0].info.run_id if runs else None


def update_champion(data_hash: str | None = None) -> str | None:
    """Alias `champion` to a version made from the best run (on `data_hash`'s table when given);
    returns that run id."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    best = best_run_id(data_hash)
    if best is None:
        return None
    try:
        current = client.get_model_version_by_alias(MODEL_NAME, CHAMPION_ALIAS)
        if current.run_id == best:
            return best
    except MlflowException:
        pass  # no model or no alias yet
    try:
        client.create_registered_model(MODEL_NAME)
    except MlflowException:
        pass  # it exists
    source = f"{client.get_run(best).info.artifact_uri}/{ARTIFACT_PATH}"
    version = client.create_model_version(MODEL_NAME, source=source, run_id=best)
    client.set_registered_model_alias(MODEL_NAME, CHAMPION_ALIAS, version.version)
    return best


class ChampionFilesMissing(LookupError):
    """A champion is registered, but its run's files are gone: not a fresh clone's empty registry,
    which callers fall back from quietly."""


def download_champion(dst: Path | None = None, store: Path | None = None) -> Path:
    """Local folder of the champion predictor: LookupError when there is none (no store, no
    registry, no alias, its files gone), OSError when the store's database cannot be read.

    Reads the store only: no session, no experiment created, nothing written to it, so a server
    can load the champion from a store it may not write."""
    store = Path(store or default_store())
    check_store(store, for_writing=False)
    database = store / "mlflow.db"
    if not _holds_data(database):  # reading: a store that is not there is not created (nor mlflow imported)
        raise LookupError(f"no MLflow store at {store}")
    # MlflowClient makes its tables in a database that lacks them: that would write to the store.
    if not _has_registry(database):
        raise LookupError(f"{database} is not an MLflow store with a model registry")
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = tracking_uri(store)
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        version = client.get_model_version_by_alias(MODEL_NAME, CHAMPION_ALIAS)
    except MlflowException as error:
        raise LookupError(f"no {CHAMPION_ALIAS!r} alias on model {MODEL_NAME!r}") from error
    kwargs = {"dst_path": str(dst)} if dst is not None else {}
    try:
        source = _source_in_store(client, version, store)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=uri, **kwargs))
    except MlflowException as error:  # its run, or the run's artifacts, deleted
        raise ChampionFilesMissing(f"the champion's files are missing ({version.source}): {error}") from error


def _holds_data(database: Path) -> bool:
    """Whether there is a database file with anything in it (an empty one, MLflow initialises)."""
    return database.is_file() and database.stat().st_size > 0


def _has_registry(database: Path) -> bool:
    """Whether `database` is an SQLite file holding MLflow's registry tables (opened read-only);
    OSError when it cannot be read (locked, or no permission), which says nothing of what it is."""
    try:
        with closing(sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True)) as connection:
            found = connection.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = "
                                       "'model_versions'").fetchone()
    except sqlite3.DatabaseError as error:
        if "not a database" in str(error):
            return False
        raise OSError(f"{database}: {error}") from error
    return found is not None


def _source_in_store(client, version, store: Path) -> str:
    """The champion's artifact location, moved into `store` when the store itself was moved or
    copied: the experiment records its artifact folder as an absolute path."""
    source = version.source
    if not source.startswith("file:") or Path(unquote(urlparse(source).path)).exists():
        return source
    run = client.get_run(version.run_id)
    root = client.get_experiment(run.info.experiment_id).artifact_location.rstrip("/")
    if not source.startswith(root + "/"):
        return source
    moved = (store / "artifacts").resolve().joinpath(*source[len(root) + 1:].split("/"))
    return moved.as_uri() if moved.exists() else source
