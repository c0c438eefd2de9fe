import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fp8serve.engine.detokenizer import IncrementalDetokenizer
from fp8serve.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A naive cafe serves creme brulee.",
    "Once upon a time, the end was near; stop here and then continue with the story.",
    "naïve café crème brûlée. 日本語のテキストも少し。",
]
MULTIBYTE = "naïve café 日本語 🙂 — the end, stop here!! ok"


@pytest.fixture(scope="module")
def tokenizer():
    # Small byte-level BPE trained in-process: deterministic, no downloads. Its vocabulary is
    # small enough that CJK characters and the emoji are split across several byte tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def stream(detok, ids):
    deltas = [detok.append(t) for t in ids]
    return deltas


def test_deltas_concatenate_to_full_decode(tokenizer):
    prompt = tokenizer.encode("Once upon a time").ids
    ids = tokenizer.encode(MULTIBYTE).ids
    eos = tokenizer.token_to_id("<eos>")
    ids = ids[:5] + [eos] + ids[5:]  # a skipped special token mid-stream
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True, stop=[],
                                   include_stop_str_in_output=False)
    deltas = stream(detok, ids)
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # The split multi-byte characters really did arrive in pieces: some tokens emit nothing.
    assert deltas.count("") > 1
    assert detok.output_token_ids == ids


def test_special_tokens_kept_when_not_skipped(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    ids = tokenizer.encode("the end").ids + [eos]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, stop=[],
                                   include_stop_str_in_output=False)
    assert "".join(stream(detok, ids)) == tokenizer.decode(ids, skip_special_tokens=False)
    assert detok.text.endswith("<eos>")


def test_transformers_tokenizer_wrapper(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    ids = tokenizer.encode(MULTIBYTE).ids
    detok = IncrementalDetokenizer(hf, tokenizer.encode("Once").ids, True, [], False)
    assert "".join(stream(detok, ids)) + detok.flush() == hf.decode(ids, skip_special_tokens=True)


def test_wrapper_decodes_through_its_backend_with_the_same_text(tokenizer):
    import random

    from transformers import PreTrainedTokenizerFast

    from fp8serve.engine.detokenizer import direct_decoder

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)
    assert direct_decoder(hf) == hf.backend_tokenizer.decode  # the wrapper is skipped
    rng = random.Random()  # fresh ids every run: the claim is "the same text", for any ids
    vocab = tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert direct_decoder(hf)(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    ids = tokenizer.encode(MULTIBYTE).ids
    detok = IncrementalDetokenizer(hf, tokenizer.encode("Once").ids, True, [], False)
    assert detok._decoder == hf.backend_tokenizer.decode
    assert "".join(stream(detok, ids)) + detok.flush() == hf.decode(ids, skip_special_tokens=True)


def test_wrapper_kept_when_it_changes_the_text(tokenizer):
    from transformers import PreTrainedTokenizerFast

    from fp8serve.engine.detokenizer import direct_decoder

    # Space clean-up is the wrapper's own step: it must stay in the path.
    cleaning = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=True)
    assert direct_decoder(cleaning) == cleaning.decode

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    loud = Shouting(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)
    assert direct_decoder(loud) == loud.decode
    ids = tokenizer.encode("the end").ids
    detok = IncrementalDetokenizer(loud, [], True, [], False)
    assert "".join(stream(detok, ids)) + detok.flush() == "THE END"
    # A plain tokenizers.Tokenizer (no wrapper) decodes itself.
    assert direct_decoder(tokenizer) == tokenizer.decode


class CountingTokenizer:
    def __init__(self, inner):
        self.inner = inner
        self.max_window = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_window = max(self.max_window, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(MULTIBYTE * 20).ids
    detok = IncrementalDetokenizer(counting, list(range(50)), True, [], False)
    text = "".join(stream(detok, ids))
    assert text == tokenizer.decode(ids)
    assert len(ids) > 200
    assert counting.max_window <= 10  # a few tokens, not the whole sequence


def test_stop_string_truncates_and_reports(tokenizer):
    ids = tokenizer.encode("the end, stop here and more text").ids
    detok = IncrementalDetokenizer(tokenizer, [], True, ["stop", "zzz"], False)
    streamed = ""
    for n, t in enumerate(ids):
        streamed += detok.append(t)
        if detok.is_stopped:
            break
    assert detok.stop_reason == "stop"
    assert detok.text == streamed == "the end, "
    assert n < len(ids) - 1  # stopped early
    with pytest.raises(RuntimeError):
        detok.append(ids[-1])


def test_stop_string_included(tokenizer):
    ids = tokenizer.encode("the end, stop here and more text").ids
    detok = IncrementalDetokenizer(tokenizer, [], True, ["stop"], True)
    streamed = ""
    for t in ids:
        streamed += detok.append(t)
        if detok.is_stopped:
            break
    assert detok.text == streamed == "the end, stop"


def test_earliest_stop_string_wins_and_text_after_it_is_cut():
    # Both stop strings complete in the same multi-character delta; list order does not matter.
    words = ["the", " end", ", stop here and on"]
    detok = IncrementalDetokenizer(WordTokenizer(words), [], True, ["here", "stop"], False)
    streamed = "".join(stream_until_stop(detok, [0, 1, 2]))
    assert detok.stop_reason == "stop"
    assert streamed == detok.text == "the end, "


def stream_until_stop(detok, ids):
    for t in ids:
        yield detok.append(t)
        if detok.is_stopped:
            return


class CharTokenizer:
    """One token per character, so the tests control exactly when text arrives."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class WordTokenizer:
    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids)


def char_ids(text):
    return [ord(c) for c in text]


def test_hold_back_while_stop_string_may_form():
    detok = IncrementalDetokenizer(CharTokenizer(), [], True, ["###"], False)
    assert [detok.append(t) for t in char_ids("ab#")] == ["a", "b", ""]
    assert detok.append(ord("#")) == ""  # "##" could still become "###"
    assert detok.append(ord("x")) == "##x"  # it did not: release the held text
    assert detok.append(ord("#")) == ""
    assert detok.flush() == "#"  # finished for another reason (e.g. length)
    assert detok.text == "ab##x#"


def test_held_back_text_never_streamed_before_stop():
    detok = IncrementalDetokenizer(CharTokenizer(), [], True, ["abc", "bcd"], False)
    deltas = list(stream_until_stop(detok, char_ids("xxabcd")))
    assert "".join(deltas) == "xx" == detok.text
    assert detok.stop_reason == "abc"


def test_include_stop_str_does_not_hold_back():
    detok = IncrementalDetokenizer(CharTokenizer(), [], True, ["###"], True)
    assert [detok.append(t) for t in char_ids("a##")] == ["a", "#", "#"]
    assert detok.append(ord("#")) == "#"
    assert detok.text == "a###" and detok.stop_reason == "###"


def test_stop_strings_ignored_before_min_tokens():
    params = SamplingParams(stop=["ab"], min_tokens=3)
    detok = IncrementalDetokenizer.from_params(CharTokenizer(), [], params)
    deltas = list(stream_until_stop(detok, char_ids("abxab")))
    assert "".join(deltas) == detok.text == "abx"
    assert detok.stop_reason == "ab"


def test_rejects_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(CharTokenizer(), [], True, [""], False)


def test_sentencepiece_style_leading_space_comes_from_context():
    # Metaspace decoders drop the space of the first token decoded; the prompt context in
    # the decode window keeps it, as in the full text.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    prompt = tok.encode("Once upon a time").ids
    ids = tok.encode("Once upon a time the end was near").ids[len(prompt):]
    detok = IncrementalDetokenizer(tok, prompt, True, [], False)
    text = "".join(stream(detok, ids))
    assert text == " the end was near"
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
