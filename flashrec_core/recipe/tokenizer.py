"""The recipe's tokenizer: one word per item id (the prompt is the history, item ids separated by
spaces), then the SID tokens in FlashRec's layout (`<s_a_0>`..., levels back to back) and the
`<|sid_begin|>` / `<|sid_end|>` boundaries. The chat template only joins the user messages'
contents with spaces, so a chat request and a plain prompt of the same history give the same
tokens (the model was trained on plain histories)."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

SPECIAL = ["[PAD]", "[UNK]", "<s>", "</s>"]
SID_BEGIN, SID_END = "<|sid_begin|>", "<|sid_end|>"
HISTORY_CHAT_TEMPLATE = (
    "{% for m in messages if m['role'] == 'user' %}{{ m['content'] }}"
    "{% if not loop.last %} {% endif %}{% endfor %}"
)


def sid_token(level: int, code: int) -> str:
    return f"<s_{string.ascii_lowercase[level]}_{code}>"


def build_recipe_tokenizer(items: Sequence[str], level_sizes: Sequence[int]) -> Any:
    """A WordLevel HF tokenizer: special tokens, item words (in `items` order), SID tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sid = [sid_token(lv, c) for lv, size in enumerate(level_sizes) for c in range(size)]
    clash = sorted(set(items) & set(SPECIAL + sid + [SID_BEGIN, SID_END]))
    if clash:
        raise ValueError(
            f"item ids {clash[:5]} collide with special or SID token names; rename them"
        )
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(items))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False) for t in sid])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (SID_BEGIN, SID_END)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    fast.chat_template = HISTORY_CHAT_TEMPLATE
    return fast


def history_prompt(history: Sequence[str], max_history: int) -> str:
    """The prompt for a history: its last `max_history` item ids, oldest first."""
    return " ".join(history[-max_history:])
