"""chat_utils: the one check of chat messages that the server and LLM.chat share."""

import pytest

from fp8serve.entrypoints.chat_utils import content_text, conversation_for_template


def test_content_forms():
    assert content_text("hi", "c") == "hi"
    assert content_text(None, "c") == ""
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "c") == "ab"


@pytest.mark.parametrize("content, words", [
    (5, "c must be a string or a list of content parts, got int"),
    ([{"type": "image_url", "image_url": {"url": "x"}}], "c[0]: part type 'image_url' is not supported"),
    (["text"], "c[0]: part type None is not supported"),
    ([{"type": "text"}], "c[0].text must be a string, got NoneType"),
])
def test_content_errors(content, words):
    with pytest.raises(ValueError) as e:
        content_text(content, "c")
    assert words in str(e.value)


def test_conversation_keeps_other_keys_and_names_the_message():
    conv = conversation_for_template([{"role": "user", "content": [{"type": "text", "text": "x"}], "name": "a"}])
    assert conv == [{"role": "user", "content": "x", "name": "a"}]
    with pytest.raises(ValueError, match=r"chat\[1\]\.role must be a non-empty string, got None"):
        conversation_for_template([{"role": "user", "content": "x"}, {"content": "y"}], "chat")
    with pytest.raises(ValueError) as e:
        conversation_for_template([{"role": "user", "content": 3}])
    assert e.value.parameter == "messages"


def test_load_chat_template_from_a_file_or_the_text(tmp_path):
    from fp8serve.entrypoints.chat_utils import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    assert load_chat_template(str(f)) == f.read_text()
    # The text itself, with backslash escapes decoded as vLLM does.
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"


@pytest.mark.parametrize("kind", ["missing", "directory", "syntax-file", "syntax-text"])
def test_load_chat_template_names_what_is_wrong(tmp_path, kind):
    from fp8serve.entrypoints.chat_utils import load_chat_template
    from fp8serve.errors import UserError

    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}{{ m.content }}")
    value, message = {
        "missing": (str(tmp_path / "nope.jinja"), "nope.jinja': not found (expected a Jinja template file"),
        "directory": (str(tmp_path), "': is a directory"),
        "syntax-file": (str(bad), f"--chat-template file '{bad}': not a valid Jinja template (line 2: "),
        "syntax-text": ("{% if x %}", "--chat-template: not a valid Jinja template (line 1: "),
    }[kind]
    with pytest.raises(UserError) as e:
        load_chat_template(value)
    assert message in str(e.value)
