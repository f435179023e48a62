"""Predictors: prompt parsing, feature parity between training and serving, save/load round trips."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import predictor
from predictor.base import Prediction
from predictor.batching import predict_in_batches
from predictor.features import FEATURE_NAMES, lexical_features, lexical_matrix, lexical_spec, parse_prompt
from predictor.heads import HeadOutputs, to_predictions
from predictor.length import LengthParams, LengthPredictor
from predictor.paths import project_root
from predictor.saved import PredictorSpec, read_spec, save

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def chat(*turns: tuple[str, str]) -> str:
    """A ChatML prompt as the SmolLM2 template writes it, ending with the generation prompt."""
    body = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)
    return SYSTEM + body + "<|im_start|>assistant\n"


def test_parse_prompt_finds_request_history_and_turn():
    prompt = chat(("user", "hi"), ("assistant", "Hello! How can I help"), ("user", "Write an essay"))
    parsed = parse_prompt(prompt)
    assert parsed.request == "Write an essay"
    assert parsed.previous_reply == "Hello! How can I help"
    assert parsed.turn_index == 1
    assert parsed.reply_chars == (len("Hello! How can I help"),)
    assert not parsed.has_custom_system


def test_parse_prompt_first_turn_and_bare_text():
    assert parse_prompt(chat(("user", "q"))).turn_index == 0
    assert parse_prompt(chat(("user", "q"))).previous_reply == ""
    assert parse_prompt("just text").request == "just text"


def test_lexical_features_flag_what_they_name():
    values = dict(zip(FEATURE_NAMES, lexical_features(chat(("user", "Write a 500 words essay in python code?")))))
    assert len(values) == len(FEATURE_NAMES)
    assert values["kw_essay"] == 1 and values["kw_code"] == 1 and values["kw_translate"] == 0
    assert values["ends_with_question"] == 1
    assert values["log_requested_count"] == pytest.approx(np.log1p(500))
    assert values["previous_reply_unfinished"] == 0
    unfinished = dict(zip(FEATURE_NAMES, lexical_features(chat(("user", "a"), ("assistant", "and then the"),
                                                                 ("user", "continue")))))
    assert unfinished["previous_reply_unfinished"] == 1 and unfinished["kw_continue"] == 1


def test_lexical_matrix_rows_hold_each_prompts_features():
    # Pinned by hand, row by row (the matrix is built from lexical_features, so comparing the two
    # could not fail): the one feature function serves training and serving alike.
    matrix = lexical_matrix([chat(("user", "list ten ideas")), chat(("user", "yes or no?")), "bare"])
    assert matrix.shape == (3, len(FEATURE_NAMES))
    rows = [dict(zip(FEATURE_NAMES, row)) for row in matrix]
    assert rows[0]["kw_list"] == 1 and rows[1]["kw_list"] == 0 and rows[2]["kw_list"] == 0
    assert rows[1]["ends_with_question"] == 1 and rows[1]["question_marks"] == 1 and rows[1]["kw_short"] == 1
    assert rows[0]["ends_with_question"] == 0 and rows[0]["kw_short"] == 0
    assert rows[0]["log_request_chars"] == pytest.approx(np.log1p(len("list ten ideas")))
    assert rows[2]["log_request_chars"] == rows[2]["log_prompt_chars"] == pytest.approx(np.log1p(4))
    assert rows[2]["log_request_words"] == pytest.approx(np.log1p(1))
    assert rows[2]["log_history_chars"] == 0 and rows[0]["log_history_chars"] > 0
    assert lexical_matrix([]).shape == (0, len(FEATURE_NAMES))


def test_quantile_outputs_are_ordered_and_in_tokens():
    outputs = HeadOutputs(score=np.array([0.3, -1.0]), log_point=np.log1p([100.0, 5.0]),
                          log_p50=np.log1p([90.0, 7.0]), log_p90=np.log1p([50.0, 30.0]),
                          log_rank_len=np.log1p([60.0, 11.0]))  # unlike any other head
    first, second = to_predictions(outputs)
    assert first.point == pytest.approx(100.0) and first.p50 == pytest.approx(90.0)
    assert first.p90 == pytest.approx(90.0)  # a p90 below p50 is raised to p50
    assert second.p90 == pytest.approx(30.0) and second.score == -1.0
    assert (first.rank_len, second.rank_len) == pytest.approx((60.0, 11.0))


@pytest.mark.parametrize("length_head", ["point", "p50", "p90"])
def test_the_ranking_length_comes_from_the_chosen_head(length_head):
    # What the scheduler orders by: the committed predictors name p50; a trace-trained one, point.
    from predictor.heads import LgbmHeads

    class ConstantBooster:
        def __init__(self, value: float) -> None:
            self.value = value

        def predict(self, features, num_threads=None):
            return np.full(len(features), self.value)

    boosters = {"point": ConstantBooster(1.0), "p50": ConstantBooster(2.0), "p90": ConstantBooster(3.0)}
    outputs = LgbmHeads(boosters, score_head="p50", length_head=length_head).predict(np.zeros((2, 4)))
    assert outputs.log_rank_len.tolist() == [boosters[length_head].value] * 2


def _length_predictor() -> LengthPredictor:
    spec = PredictorSpec(kind="length", feature_spec={"input": "chars"}, data_hash="abc")
    return LengthPredictor(LengthParams(intercept=1.0, slope=0.5, residual_p50=0.1, residual_p90=0.8), spec)


def test_length_predictor_round_trip(tmp_path):
    model = _length_predictor()
    prompts = [chat(("user", "short")), chat(("user", "long " * 200))]
    folder = save(model, tmp_path / "p")
    assert read_spec(folder).data_hash == "abc"
    loaded = predictor.load(folder)
    assert loaded.kind == "length"
    assert loaded.predict(prompts) == model.predict(prompts)
    short, long = loaded.predict(prompts)
    assert short.score < long.score and short.p50 <= short.p90


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "a JSON object is expected"),
    ('{"kind": "length", "feature_spec": {}, "data_hash": "", "weights": 3}', "not a predictor spec"),
    ('{"kind": "forest", "feature_spec": {}, "data_hash": ""}', "unknown predictor kind"),
    # Was an AttributeError (a traceback from serve --predictor) once the kind read a field of it.
    ('{"kind": "lexical", "feature_spec": null, "data_hash": ""}', "feature_spec must be a JSON object"),
    ('{"kind": "lexical", "feature_spec": [], "data_hash": ""}', "feature_spec must be a JSON object"),
    # Evaluation reads these to find the prompts it trained on: a wrong type failed there, late.
    ('{"kind": "length", "feature_spec": {}, "data_hash": "", "held_out": 5}', "held_out must be a string"),
    ('{"kind": "length", "feature_spec": {}, "data_hash": "", "labels": "bogus"}', "labels must be one of"),
    ('{"kind": "length", "feature_spec": {}, "data_hash": 7}', "data_hash must be a string"),
    ('{"kind": "length", "feature_spec": {}, "data_hash": "", "metrics": 5}', "metrics must be a JSON object"),
    ('{"kind": "length", "feature_spec": {}, "data_hash": "", "version": "1"}', "version must be an integer"),
    ('{"kind": "length", "feature_spec": {"prior": "x"}, "data_hash": ""}', "prior must be a JSON object"),
    ('{"kind": "length", "feature_spec": {"prior": {"labels": "x"}}, "data_hash": ""}', "the prior's labels"),
    ('{"kind": "length", "feature_spec": {"prior": {"labels": "sharegpt", "held_out": 1}}, "data_hash": ""}',
     "the prior's held_out"),
])
def test_a_spec_that_is_not_a_predictors_is_a_value_error_naming_the_file(tmp_path, text, message):
    (tmp_path / "predictor.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        predictor.load(tmp_path)


@pytest.mark.parametrize("value", [None, "abc", True, float("nan")])
def test_length_params_that_are_not_finite_numbers_are_refused_at_load(tmp_path, value):
    folder = save(_length_predictor(), tmp_path / "p")
    params = json.loads((folder / "length_params.json").read_text())
    (folder / "length_params.json").write_text(json.dumps({**params, "intercept": value}))
    with pytest.raises(ValueError, match="intercept must be a finite number"):
        predictor.load(folder)


def test_predict_in_batches_keeps_order():
    model = _length_predictor()
    prompts = [chat(("user", "x" * n)) for n in range(70)]
    assert predict_in_batches(model, prompts, batch_size=8) == model.predict(prompts)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):  # range() itself refuses a step of 0
        predict_in_batches(model, prompts, batch_size=0)


def test_spec_rejects_unknown_kind_and_missing_folder(tmp_path):
    with pytest.raises(ValueError):
        PredictorSpec(kind="oracle", feature_spec={}, data_hash="")
    with pytest.raises(FileNotFoundError):
        predictor.load(tmp_path)


def _tiny_heads(features: np.ndarray, lengths: np.ndarray):
    from training.fitters import LgbmConfig, fit_lgbm_heads

    config = LgbmConfig(num_leaves=4, max_rounds=20, early_stopping_rounds=5, min_data_in_leaf=5, num_threads=1)
    return fit_lgbm_heads(features, lengths, features, lengths, config)


def _synthetic_prompts(count: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(seed)
    words = ["essay", "yes or no", "list", "code", "hi", "translate", "explain"]
    prompts, lengths = [], []
    for _ in range(count):
        word = words[rng.integers(len(words))]
        prompts.append(chat(("user", f"please {word} " + "x" * int(rng.integers(1, 50)))))
        lengths.append(400 if word in ("essay", "code", "explain") else 20 + int(rng.integers(0, 10)))
    return prompts, np.asarray(lengths)


def test_ranking_length_comes_from_a_head_that_ranks_when_the_median_sits_at_a_cap(tmp_path):
    from scipy import stats

    from predictor.heads import LgbmHeads

    # Most replies reach the max_tokens cap, more so as x grows: the conditional median is the cap
    # everywhere, so a p50 head ranks nothing, while the point head (the mean of log length) does.
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, (3000, 1))
    capped = rng.uniform(0.0, 1.0, 3000) < 0.55 + 0.4 * x[:, 0]
    lengths = np.where(capped, 256, rng.integers(1, 255, 3000))
    heads = _tiny_heads(x, lengths)
    assert heads.length_head != "p50"
    predictions = to_predictions(heads.predict(x))
    rank_tau = stats.kendalltau([p.rank_len for p in predictions], lengths).statistic
    p50_tau = stats.kendalltau([p.p50 for p in predictions], lengths).statistic
    assert rank_tau > 0.1 and not p50_tau >= rank_tau  # nan (a constant median) or lower
    heads.save(tmp_path)
    assert LgbmHeads.load(tmp_path).length_head == heads.length_head
    # A folder saved before heads.json named a length head: its best token head was its score head,
    # unless that was lambdarank's.
    (tmp_path / "heads.json").write_text('{"score_head": "point"}')
    assert LgbmHeads.load(tmp_path).length_head == "point"
    (tmp_path / "heads.json").write_text('{"score_head": "rank"}')
    assert LgbmHeads.load(tmp_path).length_head == "p50"


def test_lexical_predictor_round_trip_and_learns_keywords(tmp_path):
    from predictor.lexical import LexicalPredictor

    prompts, lengths = _synthetic_prompts(400)
    heads = _tiny_heads(lexical_matrix(prompts), lengths)
    model = LexicalPredictor(heads, PredictorSpec(kind="lexical", feature_spec=lexical_spec(), data_hash="h"))
    loaded = predictor.load(save(model, tmp_path / "lex"))
    assert loaded.predict(prompts[:20]) == model.predict(prompts[:20])
    essay, yes_no = loaded.predict([chat(("user", "please essay x")), chat(("user", "please yes or no x"))])
    assert essay.score > yes_no.score and essay.point > 3 * yes_no.point


def test_lexical_predictor_refuses_other_features(tmp_path):
    from predictor.lexical import LexicalPredictor

    prompts, lengths = _synthetic_prompts(100)
    spec = PredictorSpec(kind="lexical", feature_spec={"lexical_names": ["old"]}, data_hash="h")
    folder = save(LexicalPredictor(_tiny_heads(lexical_matrix(prompts), lengths), spec), tmp_path / "lex")
    with pytest.raises(ValueError):
        predictor.load(folder)


def test_lexical_heads_of_another_width_are_refused_at_load(tmp_path):
    from predictor.lexical import LexicalPredictor

    prompts, lengths = _synthetic_prompts(100)
    narrow = _tiny_heads(lexical_matrix(prompts)[:, :5], lengths)  # five features where 43 are read
    spec = PredictorSpec(kind="lexical", feature_spec=lexical_spec(), data_hash="h")
    folder = save(LexicalPredictor(narrow, spec), tmp_path / "lex")
    with pytest.raises(ValueError, match="reads 5 features, and the lexical features are"):
        predictor.load(folder)


@pytest.fixture(scope="module")
def encoder():
    import torch

    from predictor.encoder import EncoderConfig, MiniLMEncoder

    torch.set_num_threads(2)
    return MiniLMEncoder(EncoderConfig(head_tokens=4, tail_tokens=12, batch_size=4))


@pytest.mark.integration
def test_encoder_matches_sentence_transformers_pooling(encoder):
    import torch

    text = "How do I sort a list in Python?"
    embedding = encoder.encode([chat(("user", text))])[0]
    batch = encoder.tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        hidden = encoder.model(**batch).last_hidden_state[0]
    reference = hidden.mean(0) / hidden.mean(0).norm()
    np.testing.assert_allclose(embedding, reference.numpy(), atol=1e-5)


@pytest.mark.integration
def test_encoder_keeps_head_and_tail_tokens(encoder):
    ids, mask = encoder.batch_inputs([chat(("user", "word " * 100)), chat(("user", "hi"))])
    assert ids.shape[1] == 4 + 12 + 2 and mask[0].sum() == 18 and mask[1].sum() < 18
    # Sorted batching gives the same vectors as one-by-one encoding.
    prompts = [chat(("user", "a" * n)) for n in (300, 5, 60, 1, 90)]
    together = encoder.encode(prompts)
    alone = np.stack([encoder.encode([p])[0] for p in prompts])
    np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.mark.integration
def test_embed_lgbm_cached_features_match_serving(tmp_path, encoder, monkeypatch):
    from predictor.embed_lgbm import EmbedLgbmPredictor, embed_lgbm_features
    from training import embedding_cache

    prompts, lengths = _synthetic_prompts(60)
    monkeypatch.setattr(embedding_cache, "CHUNK_SIZE", 20)
    directory = embedding_cache.cache_dir(encoder.config, tmp_path / "cache")
    directory.mkdir(parents=True)
    (directory / ".chunk_00007.npz.partial").write_bytes(b"killed mid-write")  # never read
    # One vector per distinct encoder text (these prompts repeat some), in chunks of 20.
    keys = list(dict.fromkeys(embedding_cache.text_key(p, encoder.config) for p in prompts))
    first = list(dict.fromkeys(embedding_cache.text_key(p, encoder.config) for p in prompts[:40]))
    assert embedding_cache.fill_cache(prompts[:40], encoder.config, root=tmp_path / "cache",
                                      encoder=encoder) == len(first)
    # A chunk deleted in the middle: the next write goes after the highest, not over it.
    (directory / "chunk_00000.npz").unlink()
    assert embedding_cache.fill_cache(prompts, encoder.config, root=tmp_path / "cache",
                                      encoder=encoder) == len(set(keys) - set(first[20:])) == 38
    assert sorted(p.name for p in directory.glob("chunk_*.npz")) == [
        "chunk_00001.npz", "chunk_00002.npz", "chunk_00003.npz"]
    (directory / "chunk_00001.bak.npz").write_bytes(b"a copy someone kept")  # not a chunk number
    assert embedding_cache.fill_cache(prompts, encoder.config, root=tmp_path / "cache", encoder=encoder) == 0
    assert sorted(p.name for p in directory.glob("chunk_0000?.npz")) == [
        "chunk_00001.npz", "chunk_00002.npz", "chunk_00003.npz"]
    # Every field of the encoder's configuration but the batch size names its own cache.
    from dataclasses import replace

    assert embedding_cache.cache_dir(replace(encoder.config, tail_tokens=encoder.config.tail_tokens + 1)) != \
        embedding_cache.cache_dir(encoder.config)
    # And so do the encoder's files: the same folder with one tokenizer file changed keys another.
    from predictor.encoder import resolve_model_dir

    folder = tmp_path / "encoder"
    folder.mkdir()
    for path in resolve_model_dir(encoder.config.model_ref).iterdir():
        (folder / path.name).symlink_to(path)
    at_folder = replace(encoder.config, model_ref=str(folder))
    before = embedding_cache.cache_dir(at_folder)
    assert embedding_cache.cache_dir(at_folder) == before
    vocabulary = (folder / "vocab.txt").read_text()
    (folder / "vocab.txt").unlink()
    (folder / "vocab.txt").write_text(vocabulary + "extra\n")
    assert embedding_cache.cache_dir(at_folder) != before
    # A chunk cut off by a killed run (before chunks were renamed into place) is skipped, not fatal.
    (directory / "chunk_99999.npz").write_bytes(b"PK\x03\x04cut off")
    cached, found = embedding_cache.cached_embeddings(prompts, encoder.config, root=tmp_path / "cache")
    assert found.all()
    np.testing.assert_allclose(cached, encoder.encode(prompts), atol=2e-3)  # fp16 storage
    heads = _tiny_heads(embed_lgbm_features(cached, prompts), lengths)
    from predictor.encoder import encoder_feature_spec

    spec = PredictorSpec(kind="embed_lgbm", data_hash="h",
                         feature_spec={**lexical_spec(), **encoder_feature_spec(encoder.config)})
    loaded = predictor.load(save(EmbedLgbmPredictor(encoder, heads, spec), tmp_path / "emb"))
    # Rounded to fp16 like the cache, served features equal the cached ones but where batching
    # moved an fp32 value across a rounding boundary (one fp16 step, in a few elements per 1,000).
    differ = embed_lgbm_features(encoder.encode(prompts), prompts) != embed_lgbm_features(cached, prompts)
    assert differ.mean() < 0.005
    served = np.asarray([p.point for p in loaded.predict(prompts)])
    trained = np.expm1(heads.predict(embed_lgbm_features(cached, prompts)).log_point)
    np.testing.assert_allclose(served, trained, rtol=0.01)


@pytest.mark.integration
def test_embed_lgbm_stacked_on_a_prior_serves_what_it_trained_on(tmp_path, encoder):
    from predictor.embed_lgbm import PRIOR_FOLDER, EmbedLgbmPredictor, embed_lgbm_features, with_prior

    prompts, lengths = _synthetic_prompts(60)
    base = embed_lgbm_features(encoder.encode(prompts), prompts)
    prior = _tiny_heads(base, lengths)
    stacked_features = with_prior(base, prior)
    assert stacked_features.shape == (60, base.shape[1] + 4)
    heads = _tiny_heads(stacked_features, lengths // 2 + 1)  # "another model": half as long
    prior_named = {"labels": "sharegpt", "data_hash": "p", "held_out": "trace:0"}
    spec = PredictorSpec(kind="embed_lgbm", data_hash="h", labels="trace",
                         feature_spec={**lexical_spec(), "encoder": encoder.config.as_dict(), "prior": prior_named})
    folder = save(EmbedLgbmPredictor(encoder, heads, spec, prior), tmp_path / "stacked")
    assert (folder / PRIOR_FOLDER / "point.lgb.txt").exists()
    loaded = predictor.load(folder)
    assert loaded.prior is not None
    served = np.asarray([p.point for p in loaded.predict(prompts)])
    trained = np.expm1(np.maximum(heads.predict(stacked_features).log_point, 0.0))
    np.testing.assert_allclose(served, trained, rtol=1e-3)
    # A folder whose spec and prior/ disagree fails at load, not at every prediction.
    shutil.copytree(folder, tmp_path / "copied")
    shutil.rmtree(tmp_path / "copied" / PRIOR_FOLDER)
    with pytest.raises(ValueError, match="the spec names prior, but prior/ is missing"):
        predictor.load(tmp_path / "copied")


def test_an_embed_lgbm_folder_refuses_encoder_files_it_was_not_trained_on(tmp_path):
    # Another release of the encoder package under the same reference gave vectors the heads never
    # saw: predictions ranked at random, with no error anywhere.
    from predictor.encoder import EncoderConfig, encoder_feature_spec

    folder = tmp_path / "default"
    shutil.copytree(project_root() / "data" / "predictors" / "default", folder)
    fields = json.loads((folder / "predictor.json").read_text())
    recorded = fields["feature_spec"]["encoder_weights"]
    assert recorded == encoder_feature_spec(EncoderConfig(**fields["feature_spec"]["encoder"]))["encoder_weights"]
    fields["feature_spec"]["encoder_weights"] = "0" * 16
    (folder / "predictor.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=f"trained on other encoder weights .*fingerprint {recorded}, "
                                         "expected 0000000000000000"):
        predictor.load(folder)


def test_a_feature_spec_its_kind_cannot_read_is_a_value_error(tmp_path):
    folder = tmp_path / "probe"
    shutil.copytree(project_root() / "data" / "predictors" / "probe_trace", folder)
    fields = json.loads((folder / "predictor.json").read_text())
    fields["feature_spec"].pop("probe")
    (folder / "predictor.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="its probe feature spec or weights lack a field or carry a stray one"):
        predictor.load(folder)
    # A weights file with a stray field reads the same (it had blamed the feature spec).
    from predictor.length import PARAMS_FILENAME

    saved = save(_length_predictor(), tmp_path / "length")
    weights = saved / PARAMS_FILENAME
    weights.write_text(json.dumps({**json.loads(weights.read_text()), "stray": 1.0}))
    with pytest.raises(ValueError, match="its length feature spec or weights lack a field or carry a stray one"):
        predictor.load(saved)


def _fresh_encoder():
    """An encoder of its own: adapters change the encoder they are added to."""
    from predictor.encoder import EncoderConfig, MiniLMEncoder

    return MiniLMEncoder(EncoderConfig(head_tokens=4, tail_tokens=12, batch_size=4))


@pytest.mark.integration
@pytest.mark.parametrize("lora_rank", [None, 4])
def test_finetune_round_trip(tmp_path, lora_rank):
    import torch
    from safetensors.torch import load_file

    from predictor.finetune import WEIGHTS_FILENAME, FinetunePredictor, RankingNetwork

    encoder = _fresh_encoder()
    spec = PredictorSpec(kind="finetune", data_hash="h", feature_spec={
        **lexical_spec(), "encoder": encoder.config.as_dict(), "lora_rank": lora_rank})
    network = RankingNetwork(encoder, lora_rank=lora_rank)
    with torch.no_grad():  # as if trained: a saved adapter or weight that differs from its start
        last = network.encoder.model.encoder.layer[5].output.dense
        (last.lora_b if lora_rank else last.bias).add_(0.05)
    model = FinetunePredictor(network, spec)
    prompts = [chat(("user", "write an essay")), chat(("user", "hi"))]
    before = model.predict(prompts)
    folder = save(model, tmp_path / "ft")
    saved = load_file(str(folder / WEIGHTS_FILENAME))
    encoder_names = {name for name in saved if name.startswith("encoder.")}
    if lora_rank:  # the adapters of 6 maps in each of 6 layers, and nothing else of the encoder
        assert len(encoder_names) == 72 and all(name.endswith((".lora_a", ".lora_b")) for name in encoder_names)
    else:
        assert "encoder.model.embeddings.word_embeddings.weight" in saved
    after = predictor.load(folder).predict(prompts)
    for a, b in zip(before, after):
        assert isinstance(b, Prediction) and b.p90 >= b.p50
        assert (b.score, b.p50, b.p90) == (a.score, a.p50, a.p90)  # the very network evaluated


@pytest.mark.integration
def test_adapters_start_at_the_pretrained_function_and_must_fit_the_network(encoder):
    import torch

    from predictor.finetune import RankingNetwork

    adapted = RankingNetwork(_fresh_encoder(), lora_rank=2)
    ids, mask = encoder.batch_inputs([chat(("user", "write an essay on rivers"))])
    with torch.no_grad():
        assert torch.equal(adapted.encoder.pooled(ids, mask), encoder.pooled(ids, mask))  # B starts at 0
    state = adapted.trained_state()
    with pytest.raises(ValueError, match="missing .*layer.5.output.dense.lora_b"):
        adapted.load_trained_state({k: v for k, v in state.items() if "layer.5.output.dense.lora_b" not in k})
    with pytest.raises(ValueError, match="stray .*word_embeddings"):
        adapted.load_trained_state({**state, "encoder.model.embeddings.word_embeddings.weight": state["mlp.0.bias"]})
    with pytest.raises(ValueError, match="already has adapters"):
        RankingNetwork(adapted.encoder, lora_rank=2)


@pytest.mark.parametrize("name", ["lexical", pytest.param("default", marks=pytest.mark.integration)])
def test_committed_predictors_load_and_rank_an_essay_above_a_greeting(name):
    from training.dataset import REPO_ROOT

    model = predictor.load(REPO_ROOT / "data" / "predictors" / name)
    essay, greeting = model.predict([chat(("user", "Write a detailed 1000 word essay on the history of Rome.")),
                                     chat(("user", "hi"))])
    assert essay.score > greeting.score and essay.p50 > greeting.p50
    assert 0 < greeting.p50 <= greeting.p90
    # Both name p50 as their ranking length (heads.json): what the scheduler orders by.
    chosen = json.loads((REPO_ROOT / "data" / "predictors" / name / "heads.json").read_text())["length_head"]
    assert chosen == "p50" and (essay.rank_len, greeting.rank_len) == (essay.p50, greeting.p50)


@pytest.mark.integration
def test_the_committed_finetune_reproduces_its_recorded_test_tau():
    from training import labels
    from training.dataset import REPO_ROOT
    from training.metrics import prediction_metrics

    model = predictor.load(REPO_ROOT / "data" / "predictors" / "finetune")  # adapters on the package's MiniLM
    essay, greeting = model.predict([chat(("user", "Write a detailed 1000 word essay on the history of Rome.")),
                                     chat(("user", "hi"))])
    assert essay.rank_len > greeting.rank_len and 0 < greeting.p50 <= greeting.p90
    # The rows training scored it on (`lengthwise train` subsamples the test split with seed 2):
    # a network loaded other than it was trained (adapters, scaling, features) ranks them otherwise.
    test = labels.subsample(labels.load_split("test", "sharegpt"), 2000, seed=2)
    tau = prediction_metrics(test.lengths, predict_in_batches(model, test.prompts)).kendall_tau
    assert tau == pytest.approx(model.spec.metrics["test_kendall_tau"], abs=5e-4)


def test_a_saved_folder_is_never_mixed_with_another_predictor_and_a_newer_format_says_so(tmp_path):
    from predictor.length import LengthParams, LengthPredictor

    spec = PredictorSpec(kind="length", feature_spec={}, data_hash="t")
    model = LengthPredictor(LengthParams(1.0, 0.1, 0.0, 0.5), spec)
    folder = save(model, tmp_path / "p")
    (folder / "prior").mkdir()  # as a stacked model saved there earlier would have left
    with pytest.raises(ValueError, match="not empty"):
        save(model, folder)
    spec_file = folder / "predictor.json"
    spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), "version": 9, "calibration": {}}))
    with pytest.raises(ValueError, match="newer than this code"):
        predictor.load(folder)  # before: a TypeError about the unknown field


def test_the_length_baseline_keeps_p90_at_or_above_p50_and_counts_at_or_above_zero():
    from predictor.length import LengthParams, LengthPredictor

    spec = PredictorSpec(kind="length", feature_spec={}, data_hash="")
    # A fit whose p90 residual fell below its p50 one, and an intercept that goes negative.
    model = LengthPredictor(LengthParams(intercept=-3.0, slope=1.0, residual_p50=0.8, residual_p90=0.2), spec)
    for prediction in model.predict([chat(("user", "a")), chat(("user", "a much longer request " * 40))]):
        assert prediction.p90 >= prediction.p50 >= 0 and prediction.point >= 0 and prediction.rank_len >= 0


def test_head_outputs_below_zero_tokens_are_read_as_zero():
    outputs = HeadOutputs(score=np.array([-2.0]), log_point=np.array([-0.7]), log_p50=np.array([-0.3]),
                          log_p90=np.array([-0.1]), log_rank_len=np.array([-0.5]))
    (prediction,) = to_predictions(outputs)
    assert (prediction.point, prediction.p50, prediction.p90, prediction.rank_len) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("folder", ["default", "lexical", "finetune"])
def test_predict_refuses_what_is_no_list_of_prompt_texts(folder) -> None:
    # A bare string was scored as one prompt per character, without a word; None failed in a tokenizer.
    from engine.config import REPO_ROOT

    loaded = predictor.load(REPO_ROOT / "data" / "predictors" / folder)
    for prompts, message in (("hi", "got one string"), (["hi", None], "got a NoneType among them"),
                             ([123], "got a int among them")):
        with pytest.raises(TypeError, match=message):
            loaded.predict(prompts)
    assert len(loaded.predict(["hi"])) == 1
