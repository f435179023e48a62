"""Cheap lexical features of a chat-templated prompt: the one feature function of training and serving.

Algorithm. The prompt is split at the ChatML markers into its messages; the last user message is
the request, the assistant message before it (if any) is context that predicts continuations
("continue" after a reply that was cut off). Features are counts and ratios of that text and
substring flags for words that ask for long answers (essay, article, code, list, step by step)
or short ones (yes or no, one word, briefly). Everything is plain string work: no tokenizer, so
a prompt costs tens of microseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

USER_MARK = "<|im_start|>user\n"
ASSISTANT_MARK = "<|im_start|>assistant\n"
END_MARK = "<|im_end|>"
FEATURE_SPEC_VERSION = 3

# Substring flags over the lowercased request; the name says what it flags.
KEYWORDS: dict[str, tuple[str, ...]] = {
    "kw_essay": ("essay", "article", "blog", "report", "paper"),
    "kw_story": ("story", "poem", "song", "lyrics", "script", "novel", "chapter"),
    "kw_list": ("list", "ideas", "tips", "examples", "outline", "steps", "bullet"),
    "kw_code": ("code", "function", "python", "javascript", "java ", "sql", "c++", "html", "react",
                "script", "class ", "implement", "program"),
    "kw_explain": ("explain", "describe", "elaborate", "in detail", "detailed", "comprehensive"),
    "kw_step": ("step by step", "step-by-step", "how to", "how do i", "how can i", "guide", "tutorial"),
    "kw_write": ("write", "create", "generate", "draft", "compose", "make a", "design", "develop"),
    "kw_translate": ("translate", "translation", "in english", "in chinese", "in korean", "in spanish"),
    "kw_rewrite": ("rewrite", "rephrase", "paraphrase", "improve", "proofread", "correct", "edit"),
    "kw_summary": ("summarize", "summary", "summarise", "tl;dr", "tldr"),
    "kw_short": ("yes or no", "one word", "short", "brief", "concise", "one sentence", "only answer",
                 "just answer", "only the", "in a sentence"),
    "kw_compare": ("compare", "difference", "vs", "versus", "pros and cons"),
    "kw_continue": ("continue", "go on", "keep going", "more", "finish"),
    "kw_table": ("table", "csv", "json", "format"),
    "kw_email": ("email", "letter", "message", "cover letter", "linkedin", "tweet", "post"),
    "kw_plan": ("plan", "strategy", "schedule", "curriculum", "itinerary", "proposal"),
    "kw_roleplay": ("act as", "pretend", "you are a", "i want you to", "roleplay", "role-play"),
    "kw_question": ("what is", "what are", "who is", "when did", "where is", "why ", "is it", "can you"),
    "kw_thanks": ("thank", "thanks", "great", "ok", "okay", "perfect"),
    "kw_error": ("error", "bug", "exception", "traceback", "doesn't work", "not working", "fix"),
    "kw_words": (" words", "word count", "paragraph", "pages", "sentences"),
}
_REQUESTED_COUNT = re.compile(r"\b(\d{1,5})\s*(?:words|word|paragraphs|sentences|pages|items|ideas|tips|examples|questions|points|lines)\b")
_NUMBER_LIST = re.compile(r"^\s*\d+[.)]", re.MULTILINE)

NUMERIC_FEATURES = (
    "log_prompt_chars", "log_request_chars", "log_request_words", "request_lines", "turn_index",
    "log_previous_reply_chars", "previous_reply_unfinished", "question_marks", "ends_with_question",
    "has_code_block", "non_ascii_share", "digit_share", "upper_share", "has_url", "numbered_lines",
    "log_requested_count", "has_custom_system", "log_request_head_words",
    "num_previous_replies", "log_mean_reply_chars", "log_max_reply_chars", "log_history_chars",
)
FEATURE_NAMES: tuple[str, ...] = NUMERIC_FEATURES + tuple(KEYWORDS)


@dataclass(frozen=True)
class ParsedPrompt:
    request: str  # the last user message
    previous_reply: str  # the assistant message before it, "" on the first turn
    turn_index: int  # 0 = first user turn
    has_custom_system: bool
    reply_chars: tuple[int, ...] = ()  # lengths of all earlier assistant messages, in order


def parse_prompt(prompt: str) -> ParsedPrompt:
    """Split a ChatML prompt; text without markers is taken as a bare request."""
    user_start = prompt.rfind(USER_MARK)
    if user_start < 0:
        return ParsedPrompt(prompt, "", 0, False)
    body_start = user_start + len(USER_MARK)
    body_end = prompt.find(END_MARK, body_start)
    request = prompt[body_start : body_end if body_end >= 0 else len(prompt)]
    reply_start = prompt.rfind(ASSISTANT_MARK, 0, user_start)
    previous_reply = ""
    if reply_start >= 0:
        reply_body = reply_start + len(ASSISTANT_MARK)
        reply_end = prompt.find(END_MARK, reply_body)
        previous_reply = prompt[reply_body : reply_end if 0 <= reply_end < user_start else user_start]
    default_system = "You are a helpful AI assistant named SmolLM"
    has_system = prompt.startswith("<|im_start|>system\n") and default_system not in prompt[:120]
    return ParsedPrompt(request, previous_reply, max(prompt.count(USER_MARK) - 1, 0), has_system,
                        _reply_lengths(prompt, user_start))


def _reply_lengths(prompt: str, end: int) -> tuple[int, ...]:
    """Character lengths of the assistant messages before position `end`."""
    lengths = []
    start = prompt.find(ASSISTANT_MARK, 0, end)
    while start >= 0:
        body = start + len(ASSISTANT_MARK)
        stop = prompt.find(END_MARK, body, end)
        lengths.append((stop if stop >= 0 else end) - body)
        start = prompt.find(ASSISTANT_MARK, body, end)
    return tuple(lengths)


SHARE_SAMPLE_CHARS = 512  # a prefix is enough for a character ratio and keeps long pastes cheap
SCAN_CHARS = 1500  # keywords are looked for in the request's first and last SCAN_CHARS characters


def _shares(text: str) -> tuple[float, float, float]:
    """Shares of digit and upper-case characters in a prefix of `text`, and a non-ASCII weight: the
    UTF-8 bytes past one per character, per character, capped at 1 (so CJK text, three bytes a
    character, reads 1, and one two-byte letter in ten characters 0.1). The trained predictors
    learned it so; a true share would need a new feature version and a retrain."""
    sample = text[:SHARE_SAMPLE_CHARS]
    if not sample:
        return 0.0, 0.0, 0.0
    size = len(sample)
    non_ascii = len(sample.encode("utf-8")) - size  # every non-ASCII character adds >= 1 byte
    digits = size - len(sample.translate(_DIGITS))
    upper = sum(map(str.isupper, sample))
    return min(non_ascii / size, 1.0), digits / size, upper / size


_DIGITS = str.maketrans("", "", "0123456789")


def lexical_features(prompt: str) -> np.ndarray:
    """The feature vector of one prompt, ordered as FEATURE_NAMES (float32)."""
    parsed = parse_prompt(prompt)
    request = parsed.request
    # Instructions sit at the ends of a pasted document: scan those, not the whole paste.
    ends = request if len(request) <= 2 * SCAN_CHARS else request[:SCAN_CHARS] + "\n" + request[-SCAN_CHARS:]
    lowered = ends.lower()
    non_ascii, digits, upper = _shares(request)
    stripped = request.rstrip()
    counts = [int(match) for match in _REQUESTED_COUNT.findall(lowered)]
    previous = parsed.previous_reply.rstrip()
    numeric = [
        math.log1p(len(prompt)),
        math.log1p(len(request)),
        math.log1p(len(request.split())),
        min(request.count("\n"), 200),
        min(parsed.turn_index, 50),
        math.log1p(len(previous)),
        float(bool(previous) and previous[-1:] not in ".!?)\"'`:"),
        min(request.count("?"), 20),
        float(stripped.endswith("?")),
        float("```" in request),
        non_ascii,
        digits,
        upper,
        float("http://" in lowered or "https://" in lowered),
        min(len(_NUMBER_LIST.findall(ends)), 50),
        math.log1p(max(counts, default=0)),
        float(parsed.has_custom_system),
        math.log1p(len(lowered[:200].split())),
        min(len(parsed.reply_chars), 50),
        math.log1p(sum(parsed.reply_chars) / len(parsed.reply_chars)) if parsed.reply_chars else 0.0,
        math.log1p(max(parsed.reply_chars, default=0)),
        math.log1p(max(len(prompt) - len(request), 0)),
    ]
    flags = [float(any(word in lowered for word in words)) for words in KEYWORDS.values()]
    return np.asarray(numeric + flags, dtype=np.float32)


def lexical_matrix(prompts: Sequence[str]) -> np.ndarray:
    """Features of many prompts, one row each: shape [len(prompts), len(FEATURE_NAMES)]."""
    if not prompts:
        return np.zeros((0, len(FEATURE_NAMES)), dtype=np.float32)
    return np.stack([lexical_features(prompt) for prompt in prompts])


def lexical_spec() -> dict:
    """What a saved predictor records about these features, to refuse a mismatched load."""
    return {"lexical_version": FEATURE_SPEC_VERSION, "lexical_names": list(FEATURE_NAMES)}


def check_lexical_spec(feature_spec: dict) -> None:
    if feature_spec.get("lexical_names") != list(FEATURE_NAMES) or feature_spec.get("lexical_version") != FEATURE_SPEC_VERSION:
        raise ValueError("saved predictor was trained on other lexical features "
                         f"(version {feature_spec.get('lexical_version')}, this code {FEATURE_SPEC_VERSION})")
