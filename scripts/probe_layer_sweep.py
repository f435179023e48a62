"""Which of the served model's layers, read at the prompt's last token, ranks its traced lengths best?

The probe predictor (predictor/probe.py) reads one decoder layer's output at the prompt's last
token through a ridge head. This script runs the model once per batch up to the deepest layer
asked for and compares layers by 5-fold cross-validated Kendall's tau over the trace's pooled
train and validation prompts (the folds of `training.labels.trace_cv_folds`, as in
scripts/trace_head_cv.py), and by the test split's tau of a head fitted on all of them, with the
default predictor's p50 as the baseline. The ridge head is the one `lengthwise train --model
probe` fits, its penalty chosen on a tenth of its own training rows.

    python scripts/probe_layer_sweep.py [--layers 4,8,12,16,20,24,29] [--max-tokens 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from engine.arg_types import positive_int
from engine.config import DEFAULT_PREDICTOR


def layer_list(text: str) -> list[int]:
    try:
        layers = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None
    if not layers or layers[0] < 1:
        raise argparse.ArgumentTypeError(f"layers are numbered from 1, got {text!r}")
    return layers


def layer_states(probe, prompts: list[str], layers: list[int]) -> dict[int, np.ndarray]:
    """Each layer's output at each prompt's last token, fp16-rounded as the probe's features."""
    import torch
    from tqdm import tqdm

    from predictor.probe import left_padded, probe_features

    out = {layer: np.zeros((len(prompts), probe.dim), dtype=np.float32) for layer in layers}
    order = np.argsort([len(p) for p in prompts])  # similar lengths batch with little padding
    step = probe.config.batch_size
    for start in tqdm(range(0, len(prompts), step), desc="states", unit="batch"):
        rows = order[start : start + step]
        with torch.inference_mode():
            hidden = probe.model(**left_padded([probe.token_ids(prompts[i]) for i in rows]),
                                 output_hidden_states=True).hidden_states
        for layer in layers:  # hidden[0] is the embedding; hidden[k] the k-th layer's output (no norm)
            out[layer][rows] = probe_features(hidden[layer][:, -1].float().numpy())
    return out


def fit_with_own_validation(x: np.ndarray, y: np.ndarray):
    """A ridge head whose penalty is chosen on a tenth of its own rows, never on the rows it is
    scored on (as `lengthwise train` chooses it on the validation split)."""
    from training.fitters import fit_ridge_head

    rows = np.random.default_rng(0).permutation(len(y))
    held = rows[: len(y) // 10]
    head, _ = fit_ridge_head(x[rows[len(y) // 10:]], y[rows[len(y) // 10:]], x[held], y[held])
    return head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=layer_list, default=layer_list("4,8,12,16,20,24,29"))
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--folds", type=positive_int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from scipy import stats

    import predictor
    from predictor.probe import HiddenStateProbe, ProbeConfig
    from training import labels
    from training.train_models import limit_torch_threads

    limit_torch_threads()
    probe = HiddenStateProbe(ProbeConfig(layer=max(args.layers), max_tokens=args.max_tokens))
    pooled = [labels.load_split(name, "trace") for name in ("train", "validation")]
    test = labels.load_split("test", "trace")
    prompts = [p for split in pooled for p in split.prompts]
    y = np.concatenate([split.lengths for split in pooled])
    states = layer_states(probe, prompts + test.prompts, args.layers)
    folds = labels.trace_cv_folds(prompts, args.folds)

    def tau(score, truth) -> float:
        return float(stats.kendalltau(score, truth).statistic)

    default = predictor.load(DEFAULT_PREDICTOR)
    baseline = np.asarray([p.p50 for p in default.predict(prompts)])
    report = {"max_tokens": args.max_tokens, "num_pooled": len(prompts), "num_test": len(test.prompts),
              "default_p50": {"cv_tau": float(np.mean([tau(baseline[b], y[b]) for _, b in folds])),
                              "test_tau": tau([p.p50 for p in default.predict(test.prompts)], test.lengths)},
              "layers": {}}
    for layer in args.layers:
        x, x_test = states[layer][: len(prompts)], states[layer][len(prompts):]
        taus = [tau(fit_with_own_validation(x[train], y[train]).predict(x[held]).log_point, y[held])
                for train, held in folds]
        head = fit_with_own_validation(x, y)
        report["layers"][layer] = {"cv_tau": float(np.mean(taus)),
                                   "cv_tau_se": float(np.std(taus, ddof=1) / np.sqrt(len(taus))),
                                   "test_tau": tau(head.predict(x_test).log_point, test.lengths)}
        print(f"layer {layer:2d}: cv tau {np.mean(taus):.3f} ({report['layers'][layer]['cv_tau_se']:.3f}), "
              f"test tau {report['layers'][layer]['test_tau']:.3f}", flush=True)
    print(f"default p50: cv tau {report['default_p50']['cv_tau']:.3f}, test tau {report['default_p50']['test_tau']:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
