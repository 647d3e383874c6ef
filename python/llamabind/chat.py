"""Chat: messages rendered by the model's chat template through llama.cpp common's jinja engine
(common_chat_templates_apply; never evaluated in Python), generation, and the reply parsed back
(common_chat_parse: content, reasoning, tool calls). A feature module: it uses public members of
Context/Model only; the templates themselves are :class:`~llamabind.model.ChatTemplates`."""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from . import generation, multimodal
from ._validate import as_int, one_of
from .context import Context
from .generation import GenerationResult, Stream
from .model import ChatTemplates
from .sampling import SamplingParams

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


def chat(
    ctx: Context,
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict = "auto",
    parallel_tool_calls: bool = False,
    response_format: dict | None = None,
    template: str | None = None,
    enable_thinking: bool = True,
    reasoning_format: str = "auto",
    template_kwargs: dict | None = None,
    max_tokens: int = 512,
    stop: str | Sequence[str] | None = None,
    stream: bool = False,
    logprobs: int | None = None,
    logits_processor: Any = None,
    fetch: Any = None,
    context_shift: bool = False,
    n_keep: int = 0,
    **sampling,
) -> ChatResult | Stream[ChatResult]:
    """Generate the assistant's reply to ``messages`` in ``ctx``.

    The conversation is rendered with the model's chat template (or ``template``) by llama.cpp
    common's jinja engine; the generation goes through the sampler chain (``**sampling``: the
    fields of :class:`SamplingParams`); the reply is parsed back by common_chat_parse into content,
    reasoning and tool calls. With ``tools``, the model may call them (parsed into
    ``message["tool_calls"]``) when common supports the template's tool-call format, under
    common's (lazy) tool-call grammar. ``response_format`` ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"schema": ...}}`` constrains the reply to JSON.
    reasoning_format: "auto", "none", "deepseek" or "deepseek-legacy" (where thinking goes).
    logits_processor: as :func:`~llamabind.generation.generate`'s (input_ids are the rendered
    prompt's tokens and the reply's so far).

    Images and audio (with a projector: ``Model(path, mmproj=...)``): a message's ``content``
    may be a list of OpenAI content parts, ``{"type": "text", "text": ...}``, ``{"type":
    "image_url", "image_url": {"url": ...}}`` (a ``data:image/...;base64,`` URL, a ``file://``
    URL or local path, bytes, or a numpy uint8 (height, width, 3) RGB array) and ``{"type":
    "input_audio", "input_audio": {"data": base64, "format": "wav"|"mp3"|"flac"}}``; also
    ``{"type": "image"|"audio", "image"|"audio": bytes | path | array}`` (audio arrays: float32
    mono PCM at the projector's sample rate). Each is rendered where it stands, as llama-server
    renders it, and encoded by libmtmd; an image seen again in a follow-up turn is not encoded
    again (its KV cache is reused with the prefix). ``http(s)`` URLs only through
    ``fetch(url) -> bytes``; nothing is fetched by default.

    context_shift / n_keep: as :func:`~llamabind.generation.generate`'s (a reply that fills the
    context drops half of it after n_keep tokens and goes on; n_keep=-1 keeps the whole prompt).

    A follow-up turn that extends the conversation reuses the KV cache of the shared prefix.
    Returns a :class:`ChatResult`, or with stream=True a :class:`Stream` of raw text pieces whose
    ``result`` is the ChatResult. Raises TypeError/ValueError for malformed arguments (and for
    media without a projector, of a kind it does not take, corrupt, or too large for n_ctx).
    """
    params = SamplingParams.from_kwargs(sampling, "chat")
    one_of(reasoning_format, "reasoning_format", ("auto", "none", "deepseek", "deepseek-legacy"))
    schema = _response_schema(response_format)
    if (schema is not None or tools) and params.grammar is not None:
        raise ValueError("give either grammar or response_format/tools, not both")
    messages, media = multimodal.split_media(messages)
    projector = multimodal.projector_of(ctx.model)
    if media and projector is None:
        raise ValueError(
            "the messages hold images or audio but the model has no projector: load one with "
            "Model(path, mmproj='mmproj.gguf') or model.load_mmproj(path)"
        )
    templates = ctx.model.chat_templates(template)
    cp = templates.apply(
        messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        json_schema=schema,
        enable_thinking=enable_thinking,
        template_kwargs=template_kwargs,
    )
    prompt = multimodal.prompt(projector, cp.prompt, media, fetch=fetch) if media and projector else cp.prompt
    if context_shift and media:
        raise ValueError("context_shift cannot be used with media (a medium's positions cannot be split)")
    keep = as_int(n_keep, "n_keep", -1) if context_shift else None
    gen = generation.run(
        ctx, prompt, max_tokens, params, stop, add_special=True, parse_special=True, logprobs=logprobs, chat=cp,
        processors=generation.logits_processors(logits_processor), n_keep=keep,
    )  # fmt: skip
    out = _reply(gen, cp, bool(tools) and tool_choice != "none", reasoning_format)
    if stream:
        return Stream(out)
    return generation.collect(out)


def _reply(
    gen: Generator[str, None, GenerationResult], cp: Any, parse_tools: bool, reasoning_format: str
) -> Generator[str, None, ChatResult]:
    r = yield from gen
    cut = r.finish_reason == "length"  # the reply may stop mid-way: parse it as partial
    msg = json.loads(cp.parse(r.text, cut, parse_tools, reasoning_format))
    msg.setdefault("role", "assistant")
    msg.setdefault("content", "")
    finish = "tool_calls" if msg.get("tool_calls") and not cut else r.finish_reason
    return ChatResult(message=msg, text=r.text, finish_reason=finish, generation=r)
