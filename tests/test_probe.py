"""The probe predictor: the served model's hidden state at the prompt's end, and its ridge head.

References: HF transformers' own hidden states of the same checkpoint (the tiny random Llama),
a prompt alone against the same prompt padded into a batch, and a ridge fit against a known
linear relation.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

PROMPTS = [
    "<|im_start|>user\nWrite an essay about rivers.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\n" + "Translate this sentence into French, please. " * 6 + "<|im_end|>\n<|im_start|>assistant\n",
]


def probe_config(model_dir, **changes):
    from predictor.probe import ProbeConfig

    return ProbeConfig(**{"model_ref": str(model_dir), "layer": 1, "max_tokens": 512, "batch_size": 8, **changes})


@pytest.fixture(scope="module")
def probe(tiny_model_dir):
    from predictor.probe import HiddenStateProbe

    return HiddenStateProbe(probe_config(tiny_model_dir))


def hf_state(model_dir, ids: list[int], layer: int) -> np.ndarray:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return states[layer][0, -1].numpy()  # hidden_states[0] is the embedding; [1] the first layer's output


def test_states_are_hf_hidden_states_at_the_last_token_whatever_the_batch(probe, tiny_model_dir):
    from predictor.probe import HiddenStateProbe

    batched = probe.encode(PROMPTS)  # three lengths: left padding in one batch
    for row, prompt in enumerate(PROMPTS):
        ids = probe.tokenizer.encode(prompt, add_special_tokens=False)
        expected = hf_state(tiny_model_dir, ids, layer=1)
        np.testing.assert_allclose(batched[row], expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(probe.encode([prompt])[0], batched[row], rtol=1e-4, atol=1e-4)
    assert not np.allclose(batched[0], batched[1], atol=1e-3)  # the prompt reaches the state
    # An empty prompt gets a state, alone or batched (alone, its batch had no width at all).
    assert np.isfinite(probe.encode([""])).all() and np.isfinite(probe.encode(["", PROMPTS[1]])).all()
    # Through a second layer too, padding changes nothing (a padded position that leaked into
    # the first layer's output would reach the last token only through the second's attention).
    deeper = HiddenStateProbe(probe_config(tiny_model_dir, layer=2))
    together = deeper.encode(PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(deeper.encode([prompt])[0], together[row], rtol=1e-4, atol=1e-4)


def test_a_long_prompt_is_read_by_its_last_max_tokens_ids(tiny_model_dir):
    from predictor.probe import HiddenStateProbe

    short = HiddenStateProbe(probe_config(tiny_model_dir, max_tokens=8))
    ids = short.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    assert len(ids) > 8 and short.token_ids(PROMPTS[2]) == ids[-8:]
    np.testing.assert_allclose(short.encode([PROMPTS[2]])[0], hf_state(tiny_model_dir, ids[-8:], layer=1),
                               rtol=1e-4, atol=1e-4)


def test_the_probe_refuses_a_model_other_than_the_one_it_was_fitted_on(tiny_model_dir, tmp_path):
    from predictor.probe import HiddenStateProbe, model_fingerprint

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"rms_norm_eps": 1e-05',
                                                                                   '"rms_norm_eps": 1e-06'))
    assert model_fingerprint(other) != model_fingerprint(tiny_model_dir)
    # Another transformers release writing the same model's config is the same model, however it
    # spells the RoPE base and whatever keys of its own it adds.
    rewritten = tmp_path / "rewritten"
    shutil.copytree(tiny_model_dir, rewritten)
    config = json.loads((rewritten / "config.json").read_text())
    theta = config.pop("rope_theta", None) or config.pop("rope_parameters")["rope_theta"]
    (rewritten / "config.json").write_text(json.dumps(
        {**config, "transformers_version": "9.9.9", "use_cache": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": theta}}, indent=4))
    assert model_fingerprint(rewritten) == model_fingerprint(tiny_model_dir)
    # Other weights of the same size (another GGUF converted into the same folder) are not.
    weights = rewritten / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(rewritten) != model_fingerprint(tiny_model_dir)
    fitted = probe_config(tiny_model_dir).resolved()
    with pytest.raises(ValueError, match="not the model the probe was fitted on"):
        HiddenStateProbe(dataclasses.replace(fitted, model_ref=str(other)))
    with pytest.raises(ValueError, match="layer 3"):
        HiddenStateProbe(probe_config(tiny_model_dir, layer=3))


def test_ridge_head_recovers_a_linear_order_and_picks_its_penalty():
    from scipy import stats

    from training.fitters import fit_ridge_head

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 12)).astype(np.float32) * rng.uniform(0.1, 50, size=12)  # unequal scales
    signal = x[:, 0] / x[:, 0].std() - 0.5 * x[:, 3] / x[:, 3].std()
    lengths = np.expm1(4 + signal + 0.1 * rng.normal(size=600)).round().astype(np.int64) + 1
    head, alpha = fit_ridge_head(x[:400], lengths[:400], x[400:], lengths[400:])
    out = head.predict(x[400:])
    assert stats.kendalltau(out.log_point, lengths[400:]).statistic > 0.85
    # Calibrated, not only ordered: the point is the log length the relation gives.
    assert np.abs(out.log_point - np.log1p(lengths[400:])).mean() < 0.15
    assert alpha in (1.0, 10.0, 100.0)  # a strong penalty would flatten a clean signal
    assert head.p90_offset > head.p50_offset
    np.testing.assert_array_equal(out.log_rank_len, out.log_point)


def test_a_saved_probe_predicts_what_it_predicted_and_lengths_follow_the_head(probe, tmp_path):
    from predictor import load
    from predictor.probe import ProbePredictor, RidgeHead, probe_features
    from predictor.saved import PredictorSpec, save

    states = probe_features(probe.encode(PROMPTS))
    dim = states.shape[1]
    coef = np.linspace(-0.05, 0.05, dim).astype(np.float32)
    head = RidgeHead(states.mean(0), np.ones(dim, np.float32), coef, 3.0, 0.1, 0.8)
    spec = PredictorSpec(kind="probe", feature_spec={"probe": probe.config.as_dict()}, data_hash="test")
    predictor = ProbePredictor(probe, head, spec)
    before = predictor.predict(PROMPTS)
    loaded = load(save(predictor, tmp_path / "probe"))
    after = loaded.predict(PROMPTS)
    assert [p.point for p in after] == pytest.approx([p.point for p in before], rel=1e-5)
    expected = np.expm1((states - states.mean(0)) @ coef + 3.0)
    assert [p.point for p in before] == pytest.approx(expected.tolist(), rel=1e-4)
    assert all(p.p50 < p.p90 and p.rank_len == p.point for p in before)
    assert loaded.encoder.config.fingerprint == probe.config.fingerprint != ""


def test_cached_states_are_the_served_features_and_keyed_by_the_whole_prompt(probe, tmp_path):
    from predictor.encoder import EncoderConfig
    from predictor.probe import probe_features
    from training import embedding_cache

    # The same last message after another history: one MiniLM key, two probe keys.
    other_history = "<|im_start|>user\nEarlier.<|im_end|>\n<|im_start|>assistant\nOk.<|im_end|>\n" + PROMPTS[1]
    assert embedding_cache.text_key(other_history, EncoderConfig()) == embedding_cache.text_key(PROMPTS[1], EncoderConfig())
    assert embedding_cache.text_key(other_history, probe.config) != embedding_cache.text_key(PROMPTS[1], probe.config)
    prompts = [*PROMPTS, other_history]
    assert embedding_cache.fill_cache(prompts, probe.config, root=tmp_path, encoder=probe) == 4
    cached, found = embedding_cache.cached_embeddings(prompts, probe.config, root=tmp_path)
    assert found.all()
    np.testing.assert_array_equal(probe_features(cached), probe_features(probe.encode(prompts)))
    with pytest.raises(ValueError, match="fingerprint"):
        embedding_cache.cache_dir(dataclasses.replace(probe.config, fingerprint=""), tmp_path)


@pytest.mark.integration
def test_the_committed_probe_reproduces_its_recorded_tau_on_the_converted_model(real_model_dir):
    from predictor import load
    from training import labels
    from training.dataset import REPO_ROOT
    from training.metrics import prediction_metrics

    model = load(REPO_ROOT / "data" / "predictors" / "probe_trace")  # its fingerprint matches `make model`'s
    test = labels.load_split("test", "trace")
    tau = prediction_metrics(test.lengths, model.predict(test.prompts)).kendall_tau
    # The states are deterministic, so training's figure comes back. Close variants do not: the
    # final norm applied to the states gives 0.3085, layer 20 0.2945, layer 12 0.1855.
    assert tau == pytest.approx(model.spec.metrics["test_kendall_tau"], abs=5e-4)
    # A one-token prompt ("Hi" sent to /v1/completions, or "" read as one eos) is read at the
    # attention-sink state: the linear head had predicted 1e11-1e12 tokens for it.
    for odd in model.predict(["Hi", ""]):
        assert 1 <= odd.rank_len <= odd.p90 < 1000 and odd.point < 1000


def test_the_cache_refuses_an_encoder_other_than_its_config(probe, tmp_path):
    from training import embedding_cache

    other = dataclasses.replace(probe.config, max_tokens=probe.config.max_tokens // 2)
    with pytest.raises(ValueError, match="not the one `config` describes"):
        embedding_cache.fill_cache(PROMPTS, other, root=tmp_path, encoder=probe)
    assert not any(tmp_path.iterdir())  # refused before anything is written
