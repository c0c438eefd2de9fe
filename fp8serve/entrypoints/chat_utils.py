"""Chat messages as the chat template takes them: what the server and the
offline `LLM.chat` both accept, checked with errors that name the message and
field (a malformed message otherwise fails deep in Jinja or transformers)."""

from __future__ import annotations

from typing import Any

from fp8serve.errors import InvalidParameterError


def content_text(content: Any, where: str) -> str:
    """The text of a message's content: a string, None (empty), or OpenAI's
    list of parts, of which the served models take text parts only
    (`{"type": "text", "text": "..."}`, joined). ValueError naming `where`
    otherwise (the server's schema validator turns it into a 400)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}[{i}]: part type {kind!r} is not supported (this model takes text parts "
                             f"only: {{\"type\": \"text\", \"text\": \"...\"}})")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}].text must be a string, got {type(part.get('text')).__name__}")
        texts.append(part["text"])
    return "".join(texts)


# What chat_template_kwargs may not set: the request's own fields and apply_chat_template's
# plumbing (a template variable of the same name would silently change what the request asked).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "add_generation_prompt", "chat_template", "continue_final_message", "conversation", "documents", "messages",
    "return_assistant_tokens_mask", "return_dict", "return_tensors", "tokenize", "tokenizer_kwargs", "tools",
})


def template_options(add_generation_prompt: bool | None, continue_final_message: bool,
                     chat_template_kwargs: Any = None) -> dict[str, Any]:
    """Keyword arguments for `tokenizer.apply_chat_template` from vLLM's request fields.

    continue_final_message leaves the last message open (no end-of-turn marker), so the model
    continues it; a generation prompt would open a new turn instead, so the two exclude each
    other. add_generation_prompt None (not given) means True, or False with continue_final_message.
    chat_template_kwargs are extra template variables (e.g. enable_thinking)."""
    if continue_final_message is not True and continue_final_message is not False:
        raise InvalidParameterError(f"continue_final_message must be true or false, got {continue_final_message!r}",
                                    "continue_final_message")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    elif continue_final_message and add_generation_prompt:
        raise InvalidParameterError(
            "continue_final_message and add_generation_prompt cannot both be true: one continues the last "
            "message, the other opens a new assistant turn; send add_generation_prompt false",
            "continue_final_message")
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise InvalidParameterError(f"chat_template_kwargs must be an object of template variables, got "
                                    f"{type(chat_template_kwargs).__name__}", "chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs))
    if reserved:
        raise InvalidParameterError(f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's "
                                    "own fields", "chat_template_kwargs")
    return {**chat_template_kwargs, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message}


def conversation_for_template(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """A conversation (list of {"role", "content", ...} dicts) with every
    content made plain text; InvalidParameterError naming the message
    otherwise. Other keys of a message (name, tool_calls, ...) pass through."""
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                                    f"got {type(messages).__name__ if messages else messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidParameterError(f"{where}[{i}] must be a dict with 'role' and 'content', got "
                                        f"{type(m).__name__}", "messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidParameterError(f"{where}[{i}].role must be a non-empty string, got {m.get('role')!r}",
                                        "messages")
        try:
            text = content_text(m.get("content"), f"{where}[{i}].content")
        except ValueError as e:
            raise InvalidParameterError(str(e), "messages") from None
        out.append({**m, "content": text})
    return out


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a Jinja file, or the template itself (with
    backslash escapes such as \\n decoded, as vLLM does). UserError naming the file or the
    line when it cannot be read or does not parse: at start-up, not in every chat request."""
    import codecs
    from pathlib import Path

    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from fp8serve.errors import UserError

    path = Path(value)
    if path.is_file():
        try:
            template, where = path.read_text(encoding="utf-8"), f"--chat-template file '{value}'"
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--chat-template: cannot read '{value}' ({e})") from None
    elif "{" not in value:
        # No Jinja tag or expression: meant as a file, not a template that prints itself.
        what = "is a directory" if path.is_dir() else "not found"
        raise UserError(f"--chat-template '{value}': {what} (expected a Jinja template file or the template "
                        "text itself)")
    else:
        template, where = codecs.decode(value, "unicode_escape"), "--chat-template"
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise UserError(f"{where}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return template
