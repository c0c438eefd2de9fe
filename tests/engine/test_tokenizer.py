import pytest

from fp8serve.engine.tokenizer import check_text, first_invalid_text
from fp8serve.errors import InvalidParameterError, UserError


def test_first_invalid_text_names_the_path_and_character():
    assert first_invalid_text("caf\u00e9 \U0001f600", "prompt") is None
    assert first_invalid_text(["ok", {"a": ["x", "y\udc80z"]}], "stop") == ("stop[1].a[1]", 1)
    assert first_invalid_text({"role": "user", "content": "\ud83d\ude00"}, "m") == ("m.content", 0)
    assert first_invalid_text([1, None, 2.5, {"k": 3}], "x") is None


def test_check_text_raises_a_parameter_error():
    check_text({"content": "fine"}, "messages")
    with pytest.raises(InvalidParameterError, match=r"messages\[0\]\.content is not valid Unicode text: a lone "
                                                    r"UTF-16 surrogate at character 2") as info:
        check_text([{"content": "ab\ud800"}], "messages")
    assert info.value.parameter == "messages"
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    with pytest.raises(InvalidParameterError) as info:
        check_text("\udfff", "prompt.text", parameter="prompt")
    assert info.value.parameter == "prompt"
