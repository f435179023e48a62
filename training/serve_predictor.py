"""The predictor `lengthwise serve` loads when asked for `--predictor champion`, resolved before the
server starts (training/cli.py runs `resolve_args` first): the server takes a folder, and the
MLflow registry that names the champion is training's, read by one reader (`download_champion`)
for `serve` and `eval-predictor`.

The champion is the model version under the `champion` alias of `lengthwise-predictor` in the
store under the repository (mlruns/); with none registered, data/predictors/default; without that
either, no predictor. A store named with --store must hold a champion.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from engine.arg_types import configure_serve_logging
from engine.config import DEFAULT_PREDICTOR
from predictor.saved import SPEC_FILENAME

logger = logging.getLogger("lengthwise.serve")


def champion_or_default(store: Path | None = None, fallback: Path = DEFAULT_PREDICTOR) -> str:
    """The registered champion's folder, else `fallback`, else 'none'."""
    champion = _registered_champion(store)
    if champion is not None:
        return champion
    if (fallback / SPEC_FILENAME).is_file():
        logger.info("no champion predictor to serve; using %s", fallback)
        return str(fallback)
    logger.warning("no champion predictor and no %s: serving without length predictions", fallback)
    return "none"


def _registered_champion(store: Path | None) -> str | None:
    from training import tracking

    try:
        folder = tracking.download_champion(store=store)
    except tracking.ChampionFilesMissing as exc:  # registered, yet not there: said loudly
        logger.warning("champion predictor registered but not available (%s)", exc)
        return None
    except LookupError as exc:  # a fresh clone: nothing trained and registered yet
        logger.info("champion predictor not in the registry (%s)", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - a broken registry falls back to the default, said loudly
        logger.warning("champion predictor not available from the registry (%s)", exc)
        return None
    if not (folder / SPEC_FILENAME).is_file():
        logger.warning("the champion's artifacts at %s hold no %s", folder, SPEC_FILENAME)
        return None
    logger.info("predictor: %s@%s (%s)", tracking.MODEL_NAME, tracking.CHAMPION_ALIAS, folder)
    return str(folder)


def champion_of(store: Path) -> str:
    """The champion's folder in a store the user named: ValueError when it holds none, since a
    typo there should not quietly serve the default (as eval-predictor refuses it too)."""
    from training import tracking

    try:
        folder = tracking.download_champion(store=store)
    except LookupError as exc:
        raise ValueError(f"--store {store}: {exc}") from None
    if not (folder / SPEC_FILENAME).is_file():
        raise ValueError(f"--store {store}: the champion's artifacts at {folder} hold no {SPEC_FILENAME}")
    logger.info("predictor: %s@%s of %s (%s)", tracking.MODEL_NAME, tracking.CHAMPION_ALIAS, store, folder)
    return str(folder)


def resolve_args(args: argparse.Namespace) -> None:
    """`--predictor champion` becomes the folder it names (or 'none'): the champion of --store when
    given, else champion_or_default(); other values pass as given."""
    if args.store is not None and args.predictor != "champion":
        raise ValueError(f"--store names where 'champion' is looked up; it has no effect with "
                         f"--predictor {args.predictor}")
    if args.predictor == "champion":
        configure_serve_logging(args.log_level)
        args.predictor = champion_or_default() if args.store is None else champion_of(args.store)
