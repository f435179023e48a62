"""Does the probe gain from pooling, a second layer, or more trace? (issue 3's trace goal)

The probe predictor (predictor/probe.py) reads layer 16's output at the prompt's last token
(the last 128 tokens read) through a ridge head. This script computes, in one pass over the
trace's prompts, layers 16 and 24 at the last token and averaged over the tokens read, then fits
the head as `lengthwise train --model probe --labels trace` does (train split, penalty chosen on
validation) on several feature sets, and on shares of the train split (a learning curve, three
draws each), and reports each one's Kendall's tau on the test split.

    python scripts/probe_variants.py [--max-tokens 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from engine.arg_types import positive_int, prepare_output_file_or_exit

LAYERS = (16, 24)
TRAIN_SHARES = (0.25, 0.5, 0.75)


def pooled_states(probe, prompts: list[str], layers=LAYERS) -> dict[str, np.ndarray]:
    """'<layer>_last' and '<layer>_mean' features [N, hidden] of each prompt, fp16-rounded; the
    mean is over the prompt's own tokens, never the batch's left padding."""
    import torch
    from tqdm import tqdm

    from predictor.probe import left_padded, probe_features

    out = {f"{layer}_{kind}": np.zeros((len(prompts), probe.dim), np.float32)
           for layer in layers for kind in ("last", "mean")}
    order = np.argsort([len(p) for p in prompts])  # similar lengths batch with little padding
    for start in tqdm(range(0, len(prompts), probe.config.batch_size), desc="states", unit="batch"):
        rows = order[start : start + probe.config.batch_size]
        batch = left_padded([probe.token_ids(prompts[i]) for i in rows])
        with torch.inference_mode():
            hidden = probe.model(**batch, output_hidden_states=True).hidden_states
        mask = batch["attention_mask"].unsqueeze(-1).float()
        for layer in layers:  # hidden[k]: the k-th layer's output (no final norm)
            states = hidden[layer].float()
            out[f"{layer}_last"][rows] = probe_features(states[:, -1].numpy())
            out[f"{layer}_mean"][rows] = probe_features(((states * mask).sum(1) / mask.sum(1)).numpy())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    prepare_output_file_or_exit(parser, args.json, "--json")  # before 13 minutes of states, not after them

    from scipy import stats

    from predictor.probe import HiddenStateProbe, ProbeConfig
    from training import labels
    from training.fitters import fit_ridge_head
    from training.train_models import limit_torch_threads

    limit_torch_threads()
    splits = [labels.load_split(name, "trace") for name in ("train", "validation", "test")]
    train, valid, test = splits
    probe = HiddenStateProbe(ProbeConfig(layer=max(LAYERS), max_tokens=args.max_tokens))
    states = pooled_states(probe, [p for split in splits for p in split.prompts])
    cut = np.cumsum([len(split.prompts) for split in splits])[:2]

    def test_tau(x: np.ndarray, rows: np.ndarray | None = None) -> float:
        x_train, x_valid, x_test = np.split(x, cut)
        rows = np.arange(len(x_train)) if rows is None else rows
        head, _ = fit_ridge_head(x_train[rows], train.lengths[rows], x_valid, valid.lengths)
        return float(stats.kendalltau(head.predict(x_test).log_point, test.lengths).statistic)

    variants = {"16 last": ["16_last"], "16 mean": ["16_mean"], "16 last+mean": ["16_last", "16_mean"],
                "24 last": ["24_last"], "16+24 last": ["16_last", "24_last"],
                "16+24 last+mean": ["16_last", "16_mean", "24_last", "24_mean"]}
    report = {"max_tokens": args.max_tokens, "num_train": len(train.prompts), "test_tau": {}, "train_share": {}}
    for name, parts in variants.items():
        report["test_tau"][name] = test_tau(np.hstack([states[p] for p in parts]))
        print(f"{name:16s} test tau {report['test_tau'][name]:.3f}", flush=True)
    for share in TRAIN_SHARES:
        draws = [test_tau(states["16_last"], np.random.default_rng(seed).permutation(len(train.prompts))
                          [: int(share * len(train.prompts))]) for seed in range(3)]
        report["train_share"][str(share)] = draws
        print(f"16 last on {share:.0%} of train: test tau {np.mean(draws):.3f} {np.round(draws, 3)}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
