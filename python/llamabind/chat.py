"""Chat: messages rendered by the model's chat template through llama.cpp common's jinja engine
(common_chat_templates_apply; never evaluated in Python), generation, and the reply parsed back
(common_chat_parse: content, reasoning, tool calls)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from . import _core, generation
from .generation import GenerationResult, SamplingParams, Stream

if TYPE_CHECKING:
    from .model import Context, Model

__all__ = ["ChatTemplates", "ChatResult", "chat"]


@dataclass
class ChatResult:
    """The assistant's reply.

    message: an OpenAI-style message dict: ``role`` ("assistant"), ``content`` (str), and when
    present ``reasoning_content`` (str) and ``tool_calls`` ([{"type": "function", "id",
    "function": {"name", "arguments" (JSON text)}}]). text: the raw generated text.
    finish_reason: "stop", "length" or "tool_calls". generation: the underlying GenerationResult
    (tokens, timings, logprobs).
    """

    message: dict[str, Any]
    text: str
    finish_reason: str
    generation: GenerationResult

    @property
    def content(self) -> str:
        """The assistant message's text ("" when it only calls tools)."""
        return self.message.get("content") or ""

    @property
    def tool_calls(self) -> list[dict]:
        """The parsed tool calls, OpenAI-style ``[{"type": "function", "id", "function": {"name",
        "arguments" (JSON text)}}]``; [] for none."""
        return self.message.get("tool_calls") or []


class ChatTemplates:
    """A model's chat templates, or ``template`` (jinja source) instead of the GGUF's one.
    Wraps common_chat_templates_init; raises ValueError for a template that does not parse."""

    def __init__(self, model: "Model", template: str | None = None):
        if template is not None and not isinstance(template, str):
            raise TypeError(f"template must be a str (jinja) or None; got {type(template).__name__}")
        self.model = model
        self._t = _core.ChatTemplates(model._m, template or "")

    @property
    def source(self) -> str:
        """The jinja source in use."""
        return self._t.source

    def apply(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, tool_choice: str = "auto",
              parallel_tool_calls: bool = False, json_schema: dict | str | None = None,
              add_generation_prompt: bool = True, enable_thinking: bool = True,
              template_kwargs: dict[str, Any] | None = None) -> _core.ChatParams:
        """Render messages; the result has ``prompt`` (str), ``grammar`` (for tools or a schema),
        ``format`` (the parser common picked) and ``additional_stops``.

        messages: OpenAI-style dicts with ``role`` and ``content`` (str or a list of
        {"type": "text", "text"} parts), optionally ``tool_calls``/``tool_call_id``/``name``.
        tools: OpenAI-style [{"type": "function", "function": {"name", "description",
        "parameters"}}]. tool_choice: "auto", "none" or "required". json_schema: constrain the
        reply to JSON valid for this schema. template_kwargs: extra jinja variables (JSON values).
        Raises TypeError/ValueError for malformed messages, tools or schema.
        """
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a sequence of dicts like {'role': 'user', 'content': '...'}")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] has no 'role' (str)")
        if tool_choice not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice must be 'auto', 'none' or 'required'; got {tool_choice!r}")
        schema = None if json_schema is None else (json_schema if isinstance(json_schema, str) else json.dumps(json_schema))
        kwargs = {str(k): json.dumps(v) for k, v in (template_kwargs or {}).items()}
        try:
            msgs = json.dumps(list(messages))
            tls = json.dumps(list(tools)) if tools else ""
        except TypeError as e:
            raise TypeError(f"messages and tools must be JSON-serializable: {e}") from None
        return self._t.apply(msgs, tls, bool(add_generation_prompt), schema or "", tool_choice,
                             bool(parallel_tool_calls), bool(enable_thinking), kwargs)

    def render(self, messages: Sequence[dict], **kwargs) -> str:
        """The prompt text for messages (see :meth:`apply`)."""
        return self.apply(messages, **kwargs).prompt


def _response_schema(response_format: dict | None) -> dict | str | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return response_format.get("schema") or {"type": "object"}
    if kind == "json_schema":
        js = response_format.get("json_schema", {})
        schema = js.get("schema") if isinstance(js, dict) else None
        if schema is None:
            raise ValueError("response_format {'type': 'json_schema'} needs {'json_schema': {'schema': {...}}}")
        return schema
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema'; got {kind!r}")


def chat(ctx: "Context", messages: Sequence[dict], *, tools: Sequence[dict] | None = None, tool_choice: str = "auto",
         parallel_tool_calls: bool = False, response_format: dict | None = None, template: str | None = None,
         enable_thinking: bool = True, reasoning_format: str = "auto", template_kwargs: dict | None = None,
         max_tokens: int = 512, stop: str | Sequence[str] | None = None, stream: bool = False,
         logprobs: int | None = None, **sampling) -> ChatResult | Stream:
    """Generate the assistant's reply to ``messages`` in ``ctx``.

    The conversation is rendered with the model's chat template (or ``template``) by llama.cpp
    common's jinja engine; the generation goes through the sampler chain (``**sampling``: the
    fields of :class:`SamplingParams`); the reply is parsed back by common_chat_parse into content,
    reasoning and tool calls. With ``tools``, the model may call them (parsed into
    ``message["tool_calls"]``) when common supports the template's tool-call format, under
    common's (lazy) tool-call grammar. ``response_format`` ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"schema": ...}}`` constrains the reply to JSON.
    reasoning_format: "auto", "none", "deepseek" or "deepseek-legacy" (where thinking goes).

    A follow-up turn that extends the conversation reuses the KV cache of the shared prefix.
    Returns a :class:`ChatResult`, or with stream=True a :class:`Stream` of raw text pieces whose
    ``result`` is the ChatResult. Raises TypeError/ValueError for malformed arguments.
    """
    params, rest = SamplingParams.split(sampling)
    if rest:
        raise TypeError(f"chat() got unexpected keyword argument(s): {', '.join(rest)}")
    if reasoning_format not in ("auto", "none", "deepseek", "deepseek-legacy"):
        raise ValueError(f"reasoning_format must be auto, none, deepseek or deepseek-legacy; got {reasoning_format!r}")
    schema = _response_schema(response_format)
    if (schema is not None or tools) and params.grammar is not None:
        raise ValueError("give either grammar or response_format/tools, not both")
    templates = ctx.model._chat_templates(template)
    cp = templates.apply(messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         json_schema=schema, enable_thinking=enable_thinking, template_kwargs=template_kwargs)
    gen = generation.run(ctx, cp.prompt, max_tokens, params, stop, add_special=True, parse_special=True,
                         logprobs=logprobs, chat=cp)
    out = _reply(gen, cp, bool(tools) and tool_choice != "none", reasoning_format)
    if stream:
        return Stream(out)
    return generation.collect(out)


def _reply(gen: Iterator[str], cp: _core.ChatParams, parse_tools: bool, reasoning_format: str) -> Iterator[str]:
    r = yield from gen
    cut = r.finish_reason == "length"  # the reply may stop mid-way: parse it as partial
    msg = json.loads(cp.parse(r.text, cut, parse_tools, reasoning_format))
    msg.setdefault("role", "assistant")
    msg.setdefault("content", "")
    finish = "tool_calls" if msg.get("tool_calls") and not cut else r.finish_reason
    return ChatResult(message=msg, text=r.text, finish_reason=finish, generation=r)
