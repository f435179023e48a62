"""Predictor behaviour that mutation testing found unpinned: every lexical feature by hand, the
edges of prompt parsing, the feature caps and scan windows, and the heads' and baselines' numbers.

References are numbers worked out by hand from the prompt text (never from the code under test)
or a saved-and-reloaded predictor against the original."""

from __future__ import annotations

import math

import numpy as np
import pytest

from predictor.features import (FEATURE_NAMES, KEYWORDS, check_lexical_spec, lexical_features, lexical_spec,
                                parse_prompt)

USER, ASSISTANT, END = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"
PIRATE = "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face" + END


def chatml(system: str, *turns: tuple[str, str]) -> str:
    return system + "".join(f"<|im_start|>{role}\n{text}{END}" for role, text in turns) + ASSISTANT


def features(prompt: str) -> dict[str, float]:
    return dict(zip(FEATURE_NAMES, lexical_features(prompt).tolist()))


# Twelve words, two line breaks, two "?", five digits, seven capitals, one two-byte "é", a URL, a
# code fence, two numbered lines, one requested count ("40 lines"; poems are not a counted unit).
REQUEST = "1. Write 3 POEMS\n2) in 40 lines?\nSee https://x.io ```py``` é?"
REPLIES = ("Ahoy!", "Once upon a time there was")  # 5 and 26 characters; the last one cut off


def test_every_feature_of_a_multi_turn_prompt_by_hand():
    prompt = chatml(PIRATE, ("user", "Hi"), ("assistant", REPLIES[0]), ("user", "Go on"),
                    ("assistant", REPLIES[1]), ("user", REQUEST))
    size = len(REQUEST)
    expected = {
        "log_prompt_chars": math.log1p(len(prompt)), "log_request_chars": math.log1p(size),
        "log_request_words": math.log1p(12), "request_lines": 2, "turn_index": 2,
        "log_previous_reply_chars": math.log1p(26), "previous_reply_unfinished": 1, "question_marks": 2,
        "ends_with_question": 1, "has_code_block": 1, "non_ascii_share": 1 / size, "digit_share": 5 / size,
        "upper_share": 7 / size, "has_url": 1, "numbered_lines": 2, "log_requested_count": math.log1p(40),
        "has_custom_system": 1, "log_request_head_words": math.log1p(12), "num_previous_replies": 2,
        "log_mean_reply_chars": math.log1p((5 + 26) / 2), "log_max_reply_chars": math.log1p(26),
        "log_history_chars": math.log1p(len(prompt) - size),
    }
    # Only the request is scanned: "go on" (kw_continue) sits in an earlier turn.
    expected |= {name: float(name in ("kw_story", "kw_write")) for name in KEYWORDS}
    assert features(prompt) == pytest.approx(expected, rel=1e-6)


def test_a_first_turn_with_the_default_system_has_no_history_features():
    prompt = chatml(DEFAULT_SYSTEM, ("user", "Thanks. Done."))
    got = features(prompt)
    assert got["has_custom_system"] == 0 and got["turn_index"] == 0 and got["num_previous_replies"] == 0
    assert got["log_previous_reply_chars"] == got["previous_reply_unfinished"] == 0
    assert got["log_mean_reply_chars"] == got["log_max_reply_chars"] == got["log_requested_count"] == 0
    assert got["ends_with_question"] == got["has_url"] == got["has_code_block"] == 0


def test_a_finished_previous_reply_is_not_unfinished():
    for reply, unfinished in [("Done.", 0), ("Really?", 0), ('He said "go"', 0), ("and then", 1), ("x:", 0)]:
        prompt = chatml(PIRATE, ("user", "a"), ("assistant", reply), ("user", "b"))
        assert features(prompt)["previous_reply_unfinished"] == unfinished, reply


def test_a_prompt_without_a_system_message_is_parsed_from_its_first_character():
    parsed = parse_prompt(USER + "hello" + END + ASSISTANT)
    assert (parsed.request, parsed.turn_index, parsed.has_custom_system) == ("hello", 0, False)
    # A conversation that opens with the assistant's message: that message is the context.
    parsed = parse_prompt(ASSISTANT + "Welcome" + END + USER + "more" + END + ASSISTANT)
    assert (parsed.request, parsed.previous_reply, parsed.reply_chars) == ("more", "Welcome", (7,))
    # A prompt cut off inside the request: the request runs to the end of the text.
    assert parse_prompt(PIRATE + USER + "unfinished req").request == "unfinished req"
    assert parse_prompt(PIRATE + USER + "q").has_custom_system


def test_a_bare_text_is_a_first_turn_request_without_a_system():
    got = features("Plain text.")
    assert got["turn_index"] == got["has_custom_system"] == got["num_previous_replies"] == 0
    assert got["log_request_chars"] == pytest.approx(math.log1p(11))


def test_the_counts_are_capped():
    # 60 earlier turns, a request of 250 numbered lines each asking a question.
    turns = [t for i in range(60) for t in (("user", f"u{i}"), ("assistant", "r."))]
    got = features(chatml(PIRATE, *turns, ("user", "1. ok?\n" * 250)))
    assert (got["request_lines"], got["turn_index"], got["question_marks"]) == (200, 50, 20)
    assert (got["numbered_lines"], got["num_previous_replies"]) == (50, 50)


def test_the_largest_requested_count_is_taken():
    assert features("write 3 words in 40 lines")["log_requested_count"] == pytest.approx(math.log1p(40))
    assert features("write 40 lines of 3 words")["log_requested_count"] == pytest.approx(math.log1p(40))


def test_the_character_shares_read_the_first_512_characters_and_non_ascii_is_capped_at_one():
    assert features("a" * 512 + "Z9" * 50)["upper_share"] == 0 and features("a" * 512 + "9")["digit_share"] == 0
    assert features("A" + "b" * 511 + "c")["upper_share"] == pytest.approx(1 / 512)
    # Three bytes a character: the extra bytes count, so a Chinese text reads 2, capped at 1.
    assert features("日本")["non_ascii_share"] == 1.0
    empty = features(chatml(PIRATE, ("user", "")))
    assert empty["non_ascii_share"] == empty["digit_share"] == empty["upper_share"] == 0


def test_keywords_are_read_at_the_ends_of_a_long_request_only():
    def essay_flag(size: int) -> float:
        # "essay" straddles character 1500: whole only when the request is scanned whole.
        text = "x" * 1498 + "essay" + "x" * (size - 1503)
        assert len(text) == size
        return features(text)["kw_essay"]

    assert essay_flag(3000) == 1 and essay_flag(3001) == 0
    assert features("essay " + "x" * 5000)["kw_essay"] == 1 and features("x" * 5000 + " essay")["kw_essay"] == 1
    assert features("x" * 2000 + "essay" + "x" * 2000)["kw_essay"] == 0


def test_the_head_words_are_the_words_of_the_first_200_characters():
    assert features("a " * 150)["log_request_head_words"] == pytest.approx(math.log1p(100))


def test_a_feature_spec_with_other_names_or_another_version_is_refused():
    check_lexical_spec(lexical_spec())
    with pytest.raises(ValueError, match="other lexical features"):
        check_lexical_spec({**lexical_spec(), "lexical_version": lexical_spec()["lexical_version"] + 1})
    with pytest.raises(ValueError, match="other lexical features"):
        check_lexical_spec({**lexical_spec(), "lexical_names": list(reversed(FEATURE_NAMES))})


# ---- heads -------------------------------------------------------------------------------------


class ConstantBooster:
    """A booster that predicts one value and remembers the features it was given."""

    def __init__(self, value: float) -> None:
        self.value, self.seen = value, None

    def predict(self, features, num_threads=None):
        self.seen = np.asarray(features)
        return np.full(len(features), self.value)


def constant_heads(score_head: str = "rank", length_head: str = "point", **values: float):
    from predictor.heads import LgbmHeads

    values = {"point": 1.0, "p50": 2.0, "p90": 3.0, "rank": 4.0, **values}
    return LgbmHeads({name: ConstantBooster(v) for name, v in values.items()}, score_head, length_head)


def tiny_booster(x: np.ndarray, y: np.ndarray):
    import lightgbm

    params = {"objective": "regression", "num_leaves": 4, "min_data_in_leaf": 5, "num_threads": 1, "verbose": -1}
    return lightgbm.train(params, lightgbm.Dataset(x, y), num_boost_round=5)


def real_heads(x: np.ndarray, with_rank: bool = True, score_head: str = "p90", length_head: str = "p50"):
    from predictor.heads import LgbmHeads

    y = x[:, 0] * 2 + 3
    boosters = {"point": tiny_booster(x, y), "p50": tiny_booster(x, y - 0.5), "p90": tiny_booster(x, y + 1.0)}
    if with_rank:
        boosters["rank"] = tiny_booster(x, -y)
    return LgbmHeads(boosters, score_head, length_head)


def test_each_head_output_comes_from_its_own_booster():
    outputs = constant_heads(score_head="rank", length_head="p90").predict(np.zeros((3, 2)))
    assert outputs.score.tolist() == [4.0] * 3 and outputs.log_point.tolist() == [1.0] * 3
    assert outputs.log_p50.tolist() == [2.0] * 3 and outputs.log_p90.tolist() == [3.0] * 3
    assert outputs.log_rank_len.tolist() == [3.0] * 3


def test_heads_refuse_a_missing_token_head_or_a_score_or_length_head_they_lack():
    from predictor.heads import LgbmHeads

    boosters = {"point": ConstantBooster(1), "p50": ConstantBooster(2), "p90": ConstantBooster(3)}
    with pytest.raises(ValueError, match="missing heads: \\['p90'\\]"):
        LgbmHeads({k: v for k, v in boosters.items() if k != "p90"}, "point", "point")
    with pytest.raises(ValueError, match="score head 'rank'"):
        LgbmHeads(boosters, "rank", "point")
    with pytest.raises(ValueError, match="length head 'rank'"):
        LgbmHeads({**boosters, "rank": ConstantBooster(4)}, "rank", "rank")


def test_legacy_length_head_is_the_score_head_in_tokens_else_p50():
    from predictor.heads import legacy_length_head

    assert [legacy_length_head(h) for h in ("point", "p50", "p90", "rank")] == ["point", "p50", "p90", "p50"]


@pytest.mark.parametrize("with_rank", [True, False])
def test_saved_heads_predict_what_they_predicted_and_keep_their_choices(tmp_path, with_rank):
    from predictor.heads import LgbmHeads

    x = np.random.default_rng(0).normal(size=(80, 3))
    heads = real_heads(x, with_rank=with_rank)
    heads.save(tmp_path)
    loaded = LgbmHeads.load(tmp_path)
    assert sorted(loaded.boosters) == sorted(heads.boosters)
    assert (loaded.score_head, loaded.length_head) == ("p90", "p50")
    before, after = heads.predict(x), loaded.predict(x)
    for field in ("score", "log_point", "log_p50", "log_p90", "log_rank_len"):
        np.testing.assert_allclose(getattr(after, field), getattr(before, field), rtol=1e-12)
    np.testing.assert_array_equal(before.score, before.log_p90)  # the score head named
    np.testing.assert_array_equal(before.log_rank_len, before.log_p50)  # the length head named
    assert not np.allclose(before.log_point, before.log_p90)  # distinct heads, so the above can fail
    # Only the heads asked for are read.
    assert sorted(LgbmHeads.load(tmp_path, names=("point", "p50", "p90")).boosters) == ["p50", "p90", "point"]


def test_to_predictions_keeps_each_field_in_its_place_and_row_order():
    from predictor.heads import HeadOutputs, to_predictions

    outputs = HeadOutputs(score=np.array([7.0, -3.0]), log_point=np.log1p([10.0, 1.0]),
                          log_p50=np.log1p([20.0, 2.0]), log_p90=np.log1p([40.0, 4.0]),
                          log_rank_len=np.log1p([30.0, 3.0]))
    got = [(p.point, p.p50, p.p90, p.score, p.rank_len) for p in to_predictions(outputs)]
    assert got == [pytest.approx((10, 20, 40, 7, 30)), pytest.approx((1, 2, 4, -3, 3))]


# ---- length baseline ---------------------------------------------------------------------------


def test_the_length_baseline_by_hand(tmp_path):
    import predictor
    from predictor.length import LengthParams, LengthPredictor
    from predictor.saved import PredictorSpec, save

    spec = PredictorSpec(kind="length", feature_spec={}, data_hash="")
    model = LengthPredictor(LengthParams(intercept=1.0, slope=0.5, residual_p50=0.1, residual_p90=0.8), spec)
    (p,) = model.predict(["x" * 99])  # log1p(99 characters) = log(100)
    value = 1.0 + 0.5 * math.log(100)
    assert (p.point, p.p50, p.p90, p.score, p.rank_len) == pytest.approx(
        (math.expm1(value), math.expm1(value + 0.1), math.expm1(value + 0.8), value, math.expm1(value)))
    loaded = predictor.load(save(model, tmp_path / "length"))
    assert loaded.params == model.params
    # A p90 residual below the p50 one reads as the p50 one.
    (low,) = LengthPredictor(LengthParams(1.0, 0.5, 0.3, 0.1), spec).predict(["x" * 99])
    assert low.p90 == pytest.approx(math.expm1(value + 0.3)) == pytest.approx(low.p50)
    assert model.predict([]) == []
    # Below one log unit the counts are read as they are; below zero they are zero, the score not.
    flat = LengthPredictor(LengthParams(intercept=0.5, slope=0.0, residual_p50=0.1, residual_p90=0.2), spec)
    (small,) = flat.predict(["abc"])
    assert (small.point, small.p50, small.p90, small.rank_len) == pytest.approx(
        (math.expm1(0.5), math.expm1(0.6), math.expm1(0.7), math.expm1(0.5)))
    (negative,) = LengthPredictor(LengthParams(-1.0, 0.0, 0.1, 0.2), spec).predict(["abc"])
    assert (negative.point, negative.p50, negative.p90, negative.rank_len, negative.score) == (0, 0, 0, 0, -1.0)


# ---- saved folders -----------------------------------------------------------------------------


def test_a_spec_comes_back_field_for_field_and_held_out_is_written_only_when_set(tmp_path):
    import json

    from predictor.saved import FORMAT_VERSION, PredictorSpec, read_spec, write_spec

    spec = PredictorSpec("lexical", {"a": 1}, "h", labels="trace", held_out="trace:12", metrics={"tau": 0.5})
    write_spec(tmp_path / "new" / "nested", spec)  # parents are made
    assert read_spec(tmp_path / "new" / "nested") == spec
    bare = PredictorSpec("lexical", {}, "")
    write_spec(tmp_path / "bare", bare)
    written = json.loads((tmp_path / "bare" / "predictor.json").read_text())
    assert "held_out" not in written and written["version"] == FORMAT_VERSION
    assert read_spec(tmp_path / "bare") == bare
    assert PredictorSpec("lexical", {}, "", version=FORMAT_VERSION).version == FORMAT_VERSION
    for newer in (FORMAT_VERSION + 1, 2):  # this code writes and reads format 1 only
        with pytest.raises(ValueError, match="newer than this code"):
            PredictorSpec("lexical", {}, "", version=newer)


def test_save_makes_missing_parents_and_accepts_an_empty_folder(tmp_path):
    import predictor
    from predictor.length import LengthParams, LengthPredictor
    from predictor.saved import PredictorSpec, save

    model = LengthPredictor(LengthParams(1.0, 0.1, 0.0, 0.5), PredictorSpec("length", {}, "t"))
    assert predictor.load(save(model, tmp_path / "a" / "b")).params == model.params
    (tmp_path / "empty").mkdir()
    assert predictor.load(save(model, tmp_path / "empty")).params == model.params


def test_weights_that_do_not_load_are_a_value_error_naming_the_folder_and_chained(tmp_path):
    import predictor
    from predictor.length import LengthParams, LengthPredictor
    from predictor.saved import PredictorSpec, save

    folder = save(LengthPredictor(LengthParams(1.0, 0.1, 0.0, 0.5), PredictorSpec("length", {}, "t")),
                  tmp_path / "p")
    (folder / "length_params.json").write_text("{cut")
    with pytest.raises(ValueError, match="its length predictor does not load") as caught:
        predictor.load(folder)
    assert caught.value.__cause__ is not None
    # Fields missing: a TypeError, still a ValueError naming the folder and the weights.
    (folder / "length_params.json").write_text('{"intercept": 1.0}')
    with pytest.raises(ValueError, match=f"{folder}: its length feature spec or weights lack a field"):
        predictor.load(folder)


# ---- batching ----------------------------------------------------------------------------------


class RecordingPredictor:
    kind = "length"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def predict(self, prompts):
        from predictor.base import Prediction

        self.calls.append(list(prompts))
        return [Prediction(len(p), 0, 0, 0, 0) for p in prompts]


def test_batches_are_consecutive_slices_of_at_most_batch_size():
    from predictor.batching import predict_in_batches

    model = RecordingPredictor()
    prompts = ["x" * n for n in range(7)]
    assert [p.point for p in predict_in_batches(model, prompts, batch_size=3)] == list(range(7))
    assert model.calls == [prompts[0:3], prompts[3:6], prompts[6:7]]
    model.calls.clear()
    assert len(predict_in_batches(model, prompts, batch_size=1)) == 7 and len(model.calls) == 7
    model.calls.clear()
    predict_in_batches(model, ["a"] * 40)  # the default batch: 32
    assert [len(c) for c in model.calls] == [32, 8]
    assert predict_in_batches(model, [], batch_size=4) == []
    with pytest.raises(ValueError, match="batch_size must be >= 1"):  # not an empty list, as range() gives
        predict_in_batches(model, prompts, batch_size=-1)


def test_batches_show_no_progress_bar_unless_asked(capsys):
    from predictor.batching import predict_in_batches

    predict_in_batches(RecordingPredictor(), ["a"] * 5, batch_size=2)
    assert capsys.readouterr().err == ""
    predict_in_batches(RecordingPredictor(), ["a"] * 5, batch_size=2, progress=True)
    assert "predict" in capsys.readouterr().err


# ---- lexical -----------------------------------------------------------------------------------


def test_the_lexical_predictor_feeds_its_heads_the_lexical_matrix(tmp_path):
    from predictor.features import lexical_matrix
    from predictor.lexical import LexicalPredictor
    from predictor.saved import PredictorSpec

    heads = constant_heads()
    model = LexicalPredictor(heads, PredictorSpec("lexical", lexical_spec(), ""))
    prompts = [chatml(PIRATE, ("user", REQUEST)), "hi"]
    (first, _) = model.predict(prompts)
    np.testing.assert_array_equal(heads.boosters["point"].seen, lexical_matrix(prompts))
    assert (first.point, first.p50, first.p90, first.score, first.rank_len) == pytest.approx(
        (math.expm1(1), math.expm1(2), math.expm1(3), 4.0, math.expm1(1)))
    assert model.predict([]) == [] and model.spec.kind == "lexical"


# ---- embed_lgbm, with a stand-in encoder (no torch model needed) -------------------------------


class FakeEncoder:
    """Deterministic 4-dim 'embeddings' of a prompt with values that fp16 cannot hold exactly."""

    def __init__(self, config=None) -> None:
        self.config = config

    def encode(self, prompts):
        return np.asarray([[len(p) / 3.0, 1 / 3.0, -len(p) / 7.0, 0.1] for p in prompts], dtype=np.float32)


def test_embed_lgbm_features_are_fp16_embeddings_then_lexical_then_the_priors_four_outputs():
    from predictor.embed_lgbm import EmbedLgbmPredictor, embed_lgbm_features, with_prior
    from predictor.features import lexical_matrix
    from predictor.saved import PredictorSpec

    prompts = [chatml(PIRATE, ("user", REQUEST)), "hi there"]
    embeddings = FakeEncoder().encode(prompts)
    base = embed_lgbm_features(embeddings, prompts)
    np.testing.assert_array_equal(base[:, :4], embeddings.astype(np.float16).astype(np.float32))
    assert not np.array_equal(base[:, :4], embeddings)  # the rounding is seen
    np.testing.assert_array_equal(base[:, 4:], lexical_matrix(prompts))
    assert with_prior(base, None) is base
    prior = constant_heads(score_head="rank", point=1.5, p50=2.5, p90=3.5, rank=-4.0)
    stacked = with_prior(base, prior)
    np.testing.assert_array_equal(stacked[:, :-4], base)
    np.testing.assert_array_equal(stacked[:, -4:], [[-4.0, 1.5, 2.5, 3.5]] * 2)  # score, point, p50, p90
    heads = constant_heads(score_head="point", length_head="p90")
    spec = PredictorSpec("embed_lgbm", {**lexical_spec(), "encoder": {}}, "")
    (first, _) = EmbedLgbmPredictor(FakeEncoder(), heads, spec, prior).predict(prompts)
    np.testing.assert_array_equal(heads.boosters["p50"].seen, stacked)
    assert (first.score, first.rank_len) == pytest.approx((1.0, math.expm1(3.0)))
    assert EmbedLgbmPredictor(FakeEncoder(), heads, spec, prior).predict([]) == []


@pytest.fixture
def fake_minilm(monkeypatch):
    import predictor.embed_lgbm

    monkeypatch.setattr(predictor.embed_lgbm, "MiniLMEncoder", FakeEncoder)


@pytest.mark.parametrize("stacked", [False, True])
def test_a_saved_embed_lgbm_predicts_what_it_predicted(tmp_path, fake_minilm, stacked):
    import predictor
    from predictor.embed_lgbm import PRIOR_FOLDER, EmbedLgbmPredictor, embed_lgbm_features, with_prior
    from predictor.encoder import EncoderConfig
    from predictor.saved import PredictorSpec, save

    rng = np.random.default_rng(1)
    prompts = [chatml(PIRATE, ("user", "word " * int(n))) for n in rng.integers(1, 60, 120)]
    base = embed_lgbm_features(FakeEncoder().encode(prompts), prompts)
    prior = real_heads(base, score_head="rank") if stacked else None
    heads = real_heads(with_prior(base, prior))
    prior_spec = {"prior": {"labels": "sharegpt"}} if stacked else {}
    feature_spec = {**lexical_spec(), "encoder": EncoderConfig().as_dict(), **prior_spec}
    model = EmbedLgbmPredictor(FakeEncoder(), heads, PredictorSpec("embed_lgbm", feature_spec, "h"), prior)
    folder = save(model, tmp_path / "emb")
    assert (folder / PRIOR_FOLDER).is_dir() == stacked
    loaded = predictor.load(folder)
    assert (loaded.prior is not None) == stacked
    assert loaded.predict(prompts) == model.predict(prompts)


def test_an_embed_lgbm_folder_with_a_prior_its_spec_does_not_name_is_refused(tmp_path, fake_minilm):
    import predictor
    from predictor.encoder import EncoderConfig
    from predictor.saved import PredictorSpec, write_spec

    write_spec(tmp_path, PredictorSpec("embed_lgbm", {**lexical_spec(), "encoder": EncoderConfig().as_dict()}, ""))
    (tmp_path / "prior").mkdir()
    with pytest.raises(ValueError, match="the spec has no prior, but prior/ is there"):
        predictor.load(tmp_path)


# ---- probe: the parts that need no model -------------------------------------------------------


def test_left_padding_by_hand():
    from predictor.probe import left_padded

    batch = left_padded([[5, 6, 7], [8]])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_the_ridge_head_by_hand_clipped_at_max_abs_z_and_saved_as_it_was(tmp_path):
    from predictor.probe import MAX_ABS_Z, RidgeHead

    head = RidgeHead(mean=np.array([1.0, -2.0]), scale=np.array([2.0, 0.5]), coef=np.array([0.5, -1.0]),
                     intercept=3.0, p50_offset=0.25, p90_offset=1.5)
    features = np.array([[3.0, -1.0], [1.0, 100.0]])
    # Row 0: z = (1, 2), 0.5 - 2 + 3 = 1.5. Row 1: z = (0, 204) is clipped to (0, 16): -16 + 3.
    expected = np.array([1.5, 3.0 - MAX_ABS_Z])
    out = head.predict(features)
    np.testing.assert_allclose(out.log_point, expected)
    np.testing.assert_allclose(out.score, expected)
    np.testing.assert_allclose(out.log_rank_len, expected)
    np.testing.assert_allclose(out.log_p50, expected + 0.25)
    np.testing.assert_allclose(out.log_p90, expected + 1.5)
    assert MAX_ABS_Z == 16.0
    head.save(tmp_path)
    loaded = RidgeHead.load(tmp_path)
    for name in ("mean", "scale", "coef"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(head, name))
    assert (loaded.intercept, loaded.p50_offset, loaded.p90_offset) == (3.0, 0.25, 1.5)


def test_probe_features_are_the_states_rounded_to_fp16():
    from predictor.probe import probe_features

    states = np.array([[1 / 3, 1000.1, 1e-8]], dtype=np.float32)
    got = probe_features(states)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [[np.float16(1 / 3), np.float16(1000.1), np.float16(1e-8)]])


def test_a_probe_config_checks_its_fields_and_keys_its_cache_by_all_but_the_batch_size(tmp_path):
    from predictor.paths import project_root
    from predictor.probe import ProbeConfig

    for field in ("layer", "max_tokens", "batch_size"):
        with pytest.raises(ValueError, match="must be >= 1"):
            ProbeConfig(**{field: 0})
    ProbeConfig(layer=1, max_tokens=1, batch_size=1)  # 1 is allowed everywhere
    with pytest.raises(ValueError, match="fingerprint"):
        ProbeConfig().cache_identity()
    config = ProbeConfig(model_ref="m", fingerprint="f", layer=3, max_tokens=5, batch_size=7)
    assert config.cache_identity() == {"probe": {"model_ref": "m", "fingerprint": "f", "layer": 3, "max_tokens": 5}}
    assert config.as_dict()["batch_size"] == 7
    assert config.key_text("<|im_start|>user\nhi") == "<|im_start|>user\nhi"
    assert config.model_dir() == project_root() / "m"
    assert ProbeConfig(model_ref=str(tmp_path)).model_dir() == tmp_path


def fake_model_folder(folder, config: dict, tokenizer: bytes = b"tok", weights: bytes = b"w"):
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes(tokenizer)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_the_fingerprint_reads_architecture_rope_base_tokenizer_and_weights(tmp_path):
    from predictor.probe import model_fingerprint

    config = {"model_type": "llama", "hidden_size": 64, "rope_theta": 10000.0}
    base = model_fingerprint(fake_model_folder(tmp_path / "base", config))
    assert len(base) == 16 and int(base, 16) >= 0
    nested = {**{k: v for k, v in config.items() if k != "rope_theta"}, "rope_parameters": {"rope_theta": 10000.0}}
    assert model_fingerprint(fake_model_folder(tmp_path / "nested", nested)) == base
    others = [
        fake_model_folder(tmp_path / "rope", {**config, "rope_theta": 500.0}),
        fake_model_folder(tmp_path / "nested_rope", {**nested, "rope_parameters": {"rope_theta": 500.0}}),
        fake_model_folder(tmp_path / "tokenizer", config, tokenizer=b"tok2"),
        fake_model_folder(tmp_path / "weights", config, weights=b"w2"),
        fake_model_folder(tmp_path / "arch", {**config, "hidden_size": 65}),
    ]
    assert all(model_fingerprint(folder) != base for folder in others)


def test_a_probe_spec_without_a_fingerprint_is_refused(tmp_path):
    import predictor
    from predictor.probe import ProbeConfig
    from predictor.saved import PredictorSpec, write_spec

    write_spec(tmp_path, PredictorSpec("probe", {"probe": ProbeConfig().as_dict()}, ""))
    with pytest.raises(ValueError, match="fingerprint is missing"):
        predictor.load(tmp_path)


def test_the_fingerprint_format_is_the_one_saved_probes_recorded(tmp_path):
    # A saved probe stores its fingerprint: any change of the recipe refuses every saved probe.
    # The recipe, spelled out: blake2b-128 of the sorted-key JSON of the architecture keys and
    # the RoPE base, then each file's name and bytes (tokenizer, then the weights in name order).
    import hashlib
    import json

    from predictor.probe import ARCHITECTURE_KEYS, model_fingerprint

    folder = fake_model_folder(tmp_path / "m", {"model_type": "llama", "vocab_size": 7, "rope_theta": 5.0, "x": 1})
    (folder / "a.safetensors").write_bytes(b"first")
    architecture = {key: None for key in ARCHITECTURE_KEYS} | {"model_type": "llama", "vocab_size": 7,
                                                               "rope_theta": 5.0}
    digest = hashlib.blake2b(json.dumps(architecture, sort_keys=True).encode(), digest_size=16)
    for name, data in (("tokenizer.json", b"tok"), ("a.safetensors", b"first"), ("model.safetensors", b"w")):
        digest.update(name.encode())
        digest.update(data)
    assert model_fingerprint(folder) == digest.hexdigest()[:16]
