from __future__ import annotations

import pytest

from flashrec_core.search.sid_layout import SidLayout, SidLayoutError, infer_sid_layout


def make_vocab(sizes: list[int], base: int = 10, boundaries: bool = True) -> dict[str, int]:
    """A vocab like a GenRec tokenizer's: base tokens, then SID levels back to back."""
    vocab = {f"tok{i}": i for i in range(base)}
    next_id = base
    for lvl, size in enumerate(sizes):
        for code in range(size):
            vocab[f"<s_{chr(ord('a') + lvl)}_{code}>"] = next_id
            next_id += 1
    if boundaries:
        vocab["<|sid_begin|>"] = next_id
        vocab["<|sid_end|>"] = next_id + 1
    return vocab


def test_infer_basic_layout() -> None:
    layout = infer_sid_layout(make_vocab([4, 3, 5]))
    assert layout == SidLayout(("a", "b", "c"), (10, 14, 17), (4, 3, 5), 22, 23)
    assert (layout.depth, layout.sid_start, layout.sid_end) == (3, 10, 22)


def test_vocab_order_does_not_matter() -> None:
    vocab = make_vocab([4, 3])
    shuffled = dict(reversed(list(vocab.items())))
    assert infer_sid_layout(shuffled) == infer_sid_layout(vocab)


def test_boundary_tokens_are_optional() -> None:
    layout = infer_sid_layout(make_vocab([2, 2], boundaries=False))
    assert layout.begin_token_id is None and layout.end_token_id is None
    layout = infer_sid_layout(make_vocab([2, 2]), begin_token=None, end_token=None)
    assert layout.begin_token_id is None and layout.end_token_id is None


def test_token_id_decode_format_round_trip() -> None:
    layout = infer_sid_layout(make_vocab([4, 3, 5]))
    ids = [layout.token_id(lvl, c) for lvl, c in enumerate((3, 0, 4))]
    assert ids == [13, 14, 21]
    assert layout.decode(ids) == (3, 0, 4)
    assert layout.decode([22, *ids, 23]) == (3, 0, 4)  # boundary tokens are stripped
    assert layout.format((3, 0, 4)) == "<s_a_3><s_b_0><s_c_4>"
    assert layout.format((3,)) == "<s_a_3>"


def test_decode_rejects_token_of_wrong_level() -> None:
    layout = infer_sid_layout(make_vocab([4, 3, 5]))
    with pytest.raises(SidLayoutError, match=r"token id 13 at position 1 .*'b'.*\[14, 17\)"):
        layout.decode([13, 13, 21])
    with pytest.raises(SidLayoutError, match="cannot decode 2 SID tokens"):
        layout.decode([13, 14])


def test_token_id_rejects_out_of_range() -> None:
    layout = infer_sid_layout(make_vocab([4, 3]))
    with pytest.raises(
        SidLayoutError, match=r"code 3 out of range for SID level 'b'; expected 0..2"
    ):
        layout.token_id(1, 3)
    with pytest.raises(SidLayoutError, match="SID level 2 out of range"):
        layout.token_id(2, 0)


def test_missing_code_is_named() -> None:
    vocab = make_vocab([4, 3])
    del vocab["<s_b_1>"]
    with pytest.raises(SidLayoutError, match=r"level 'b' lacks code 1 \(<s_b_1>\)"):
        infer_sid_layout(vocab)


def test_non_contiguous_ids_are_rejected() -> None:
    vocab = make_vocab([4, 3])
    vocab["<s_a_2>"], vocab["<s_a_3>"] = vocab["<s_a_3>"], vocab["<s_a_2>"]
    with pytest.raises(SidLayoutError, match=r"<s_a_2> has id 13, expected 12"):
        infer_sid_layout(vocab)


def test_levels_must_be_back_to_back() -> None:
    vocab = make_vocab([4])
    vocab.update({f"<s_b_{c}>": 100 + c for c in range(3)})
    with pytest.raises(SidLayoutError, match=r"<s_b_0> has id 100, expected 14"):
        infer_sid_layout(vocab)


def test_levels_must_be_in_letter_order() -> None:
    vocab = {f"<s_b_{c}>": c for c in range(3)} | {f"<s_a_{c}>": 3 + c for c in range(2)}
    with pytest.raises(SidLayoutError, match=r"<s_b_0> has id 0, expected 5"):
        infer_sid_layout(vocab)


def test_missing_level_letter_is_named() -> None:
    vocab = {f"<s_a_{c}>": c for c in range(2)} | {f"<s_c_{c}>": 2 + c for c in range(2)}
    with pytest.raises(SidLayoutError, match=r"missing level\(s\) \['b'\]"):
        infer_sid_layout(vocab)


def test_no_sid_tokens() -> None:
    with pytest.raises(SidLayoutError, match="no SID tokens"):
        infer_sid_layout({"hello": 0, "<s_A_0>": 1})


def test_level_sizes_override_must_agree() -> None:
    vocab = make_vocab([256, 128, 256])
    layout = infer_sid_layout(vocab, level_sizes=[256, 128, 256])
    assert layout.level_sizes == (256, 128, 256)
    with pytest.raises(SidLayoutError) as err:
        infer_sid_layout(vocab, level_sizes=[256, 256, 256])
    msg = str(err.value)
    assert "gives 256 codes for level 'b' but the tokenizer has 128" in msg
    assert "pass --sid-level-sizes 256,128,256 or omit it" in msg


def test_shorter_override_selects_first_levels() -> None:
    vocab = make_vocab([4, 3, 5, 6])
    assert infer_sid_layout(vocab, depth=2).level_sizes == (4, 3)
    assert infer_sid_layout(vocab, level_sizes=[4, 3, 5]).level_names == ("a", "b", "c")
    assert infer_sid_layout(vocab, depth=3).sid_end == 10 + 4 + 3 + 5


def test_depth_conflicts() -> None:
    vocab = make_vocab([4, 3])
    with pytest.raises(SidLayoutError, match=r"SID depth 3 asked for.*has 2 SID levels"):
        infer_sid_layout(vocab, depth=3)
    with pytest.raises(SidLayoutError, match="lists 1 levels but --sid-depth is 2"):
        infer_sid_layout(vocab, level_sizes=[4], depth=2)


def test_check_catalog_depth() -> None:
    layout = infer_sid_layout(make_vocab([4, 3]))
    layout.check_catalog_depth(2)
    layout.check_catalog_depth(1, sid_depth=1)
    with pytest.raises(SidLayoutError, match="catalog has SIDs of depth 3 but the SID layout has"):
        layout.check_catalog_depth(3)
    # a shallower catalog needs --sid-depth: a row missing a code looks just like it
    with pytest.raises(SidLayoutError, match="depth 1 but the tokenizer has 2 .* --sid-depth 1"):
        layout.check_catalog_depth(1)


def test_layout_validates_itself() -> None:
    with pytest.raises(SidLayoutError, match="starts at token id 20, expected 14"):
        SidLayout(("a", "b"), (10, 20), (4, 4))


def test_infer_from_saved_hf_tokenizer(tmp_path) -> None:
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    base = {"[UNK]": 0, "[PAD]": 1, "user": 2, "likes": 3, "item": 4}
    backend = Tokenizer(WordLevel(base, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    sid_tokens = [
        f"<s_{lvl}_{c}>" for lvl, size in (("a", 8), ("b", 4), ("c", 6)) for c in range(size)
    ]
    backend.add_tokens([AddedToken(t, normalized=False) for t in sid_tokens])
    backend.add_special_tokens(["<|sid_begin|>", "<|sid_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    tok.save_pretrained(tmp_path)

    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    layout = infer_sid_layout(reloaded.get_vocab())
    assert layout.level_sizes == (8, 4, 6)
    assert layout.level_starts == (5, 13, 17)
    assert (layout.begin_token_id, layout.end_token_id) == (23, 24)
    ids = reloaded.encode("<s_a_7><s_b_0><s_c_5>", add_special_tokens=False)
    assert layout.decode(ids) == (7, 0, 5)
