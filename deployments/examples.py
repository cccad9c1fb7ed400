"""Example scenarios seeded into an empty store on first start, so a request works right away.

* ``sentiment``: a label set;
* ``person``: a JSON schema;
* ``topics``: a token tree built for the served tokenizer from a few phrases.

The tree's paths are the real token ids of each phrase tokenized as a continuation (``" " +
phrase``, the way it follows the prompt); its root is the last token of the tokenizer's chat
generation prompt, so a chat prompt already ends with the root and nothing is appended; its end
token is the model's EOS.

Example::

    >>> bodies = example_scenarios(tokenizer)
    >>> sorted(bodies)
    ['person', 'sentiment', 'topics']
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["EXAMPLE_TOPICS", "build_phrase_tree", "chat_root_token_id", "example_scenarios"]

EXAMPLE_TOPICS = (
    "weather forecast",
    "weather report",
    "sports news",
    "sports results",
    "stock market update",
    "science and technology",
    "travel tips",
)

SENTIMENT = {
    "type": "labels",
    "description": "Sentiment of a text: one of three labels.",
    "labels": ["positive", "negative", "neutral"],
    "system_prompt": "Classify the sentiment of the user's text as positive, negative or neutral.",
}

PERSON = {
    "type": "json_schema",
    "description": "A person as a JSON object with a name, an age and a city.",
    "schema": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "max_new_tokens": 64,
}


def chat_root_token_id(tokenizer) -> int:
    """The last token id of the chat template's generation prompt (where the answer starts)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("the chat template's generation prompt tokenizes to nothing")
    return int(ids[-1])


def build_phrase_tree(tokenizer, phrases, *, root: int, end: int) -> dict[str, Any]:
    """A tree (the tree file format) whose paths are ``phrases`` tokenized as continuations.

    Raises ``ValueError`` when a phrase does not survive a tokenizer round trip.
    """
    prefix_dict: dict[str, list[int]] = {}
    for phrase in phrases:
        ids = tokenizer.encode(" " + phrase, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not ids or back != " " + phrase:
            raise ValueError(f"phrase {phrase!r} does not survive a tokenizer round trip ({ids} -> {back!r})")
        state = str(root)
        for token in list(ids) + [end]:
            options = prefix_dict.setdefault(state, [])
            if token not in options:
                options.append(int(token))
            state = f"{state}_{token}"
    return {"start_token_id": int(root), "end_token_id": int(end), "sep": "_", "prefix_dict": prefix_dict}


def example_scenarios(tokenizer) -> dict[str, dict[str, Any]]:
    """``{name: scenario body}`` of the examples, built for ``tokenizer``."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; the example tree needs one")
    tree = build_phrase_tree(tokenizer, EXAMPLE_TOPICS, root=chat_root_token_id(tokenizer), end=int(eos))
    return {
        "sentiment": copy.deepcopy(SENTIMENT),
        "person": copy.deepcopy(PERSON),
        "topics": {
            "type": "tree",
            "description": "Pick one topic phrase (a token tree built from the served tokenizer).",
            "tree": tree,
            "system_prompt": "Name the topic of the user's text.",
        },
    }
