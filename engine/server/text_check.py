"""Whether a request body holds text that is not Unicode.

JSON may escape a lone UTF-16 surrogate ("\\ud800"), and Python then holds a str that is not valid
Unicode: the tokenizer refuses it with a TypeError, and an error message echoing it cannot be
encoded. The request models (protocol.py) refuse such a body at validation, as a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from scheduler.request import has_utf8_form

KEY_SUFFIX = " (a key)"  # a path's ending when the surrogate is in a dict key, not a value


class LoneSurrogate(ValueError):
    """A validator's error for such text; `param` is the nested path to it, which the error
    handler names (pydantic's location stops at the validated field)."""

    def __init__(self, param: str, in_key: bool) -> None:
        super().__init__("not valid Unicode text: a lone UTF-16 surrogate" + (" in a key" if in_key else ""))
        self.param = param


def lone_surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in `value` (a key too) holding a lone surrogate, or None.

    Only strings, lists and dicts are walked: a prompt of token ids (millions of ints in a large
    body) is passed over in one scan, not an element at a time. The walk keeps its own stack: a
    body nested about 960 deep, which the JSON parser still takes, ran a recursive walk past
    Python's recursion limit, and the RecursionError was a 500."""
    pending: list[tuple[Any, str, Any, str]] = [(value, path, None, "")]  # item, its path, its key, the parent's
    while pending:
        value, path, key, parent = pending.pop()
        # Each key is read when its item is, so the first bad string found is the one a recursive
        # walk finds: key i, then its item, then key i + 1.
        if isinstance(key, str) and not has_utf8_form(key):
            return f"{parent}{KEY_SUFFIX}"
        if isinstance(value, str):
            if not has_utf8_form(value):
                return path
            continue
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list) and not all(type(item) is int for item in value):
            items = list(enumerate(value))
        else:
            continue
        pending.extend((item, f"{path}.{k}", k, path) for k, item in reversed(items)
                       if isinstance(item, (str, list, dict)) or isinstance(k, str))
    return None
