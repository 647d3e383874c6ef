"""Training data: plain text cut into windows, and examples in the formats mlx-lm documents
(``{"text"}``, ``{"prompt", "completion"}``, ``{"messages"[, "tools"]}``) from JSONL files or from
🤗 datasets (a ``Dataset``/``IterableDataset`` with such columns; local dataset folders, parquet,
CSV or JSON files, or a Hub dataset id ``org/name[:split]``, through ``datasets.load_dataset``: the
``train`` extra), rendered with the model's chat template exactly as :meth:`llamabind.Model.chat`
renders a conversation, with a mask of the tokens the loss counts (the completion / assistant turns
unless ``train_on_prompt``)."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._validate import as_int
from ..model import ROLES, ChatTemplates, Model

__all__ = [
    "Example", "chat_example", "from_dataset", "load_dataset", "load_jsonl", "read_data", "windows", "example_windows",
    "packed_windows",
]  # fmt: skip


@dataclass
class Example:
    """One training example: ``tokens`` int32 (n,) and ``counted`` bool (n,), True where the token
    is a label the loss counts (the model learns to predict it from the tokens before it)."""

    tokens: np.ndarray
    counted: np.ndarray

    def __post_init__(self) -> None:
        t, c = np.asarray(self.tokens), np.asarray(self.counted)
        if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer):
            raise TypeError(f"Example.tokens must be a 1-D integer array; got {t.dtype} {t.shape}")
        if c.shape != t.shape:
            raise ValueError(f"Example.counted must have the shape of tokens {t.shape}; got {c.shape}")
        self.tokens, self.counted = t.astype(np.int32, copy=False), c.astype(bool, copy=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def labelled(self, ctx_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 (n,), labels int32 (n - 1,)) of the first n = min(len, ctx_size + 1)
        tokens (the rest is cut): labels[j] = tokens[j + 1] where that token is counted, else -1."""
        t, c = self.tokens[: ctx_size + 1], self.counted[: ctx_size + 1]
        return t, np.where(c[1:], t[1:], -1).astype(np.int32)


def windows(tokens: Sequence[int] | np.ndarray, ctx_size: int, stride: int | None = None) -> np.ndarray:
    """The training windows of a token sequence: int32 array (n, ctx_size + 1), one every
    ``stride`` tokens (default ctx_size // 2). ValueError if tokens are too few for one window."""
    t = np.asarray(tokens, dtype=np.int64)
    stride = ctx_size // 2 if stride is None else as_int(stride, "stride", 1)
    if t.size < ctx_size + 1:
        raise ValueError(
            f"the data has {t.size} tokens; one training window needs ctx_size + 1 = {ctx_size + 1} "
            "(give more text or a smaller ctx_size)"
        )
    n = max(1, (t.size - ctx_size - 1) // stride)  # as common_opt_dataset_init (at least one)
    idx = np.arange(n)[:, None] * stride + np.arange(ctx_size + 1)[None, :]
    return t[idx].astype(np.int32)


def example_windows(examples: Sequence[Example], ctx_size: int, pad: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One window per example: (tokens int32 (n, ctx_size + 1), labels int32 (n, ctx_size),
    examples cut). An example longer than ctx_size + 1 tokens is cut at the end; a shorter one is
    padded with ``pad`` (not counted). labels[i, j] is tokens[i, j + 1] where that token is counted,
    else -1 (left out of the loss). Examples with no counted label left are dropped; ValueError if
    none remains."""
    toks, labs, cut = [], [], 0
    for ex in examples:
        cut += len(ex) > ctx_size + 1
        t, lab = ex.labelled(ctx_size)
        if (lab >= 0).any():
            toks.append(np.concatenate([t, np.full(ctx_size + 1 - len(t), pad, np.int32)]))
            labs.append(np.concatenate([lab, np.full(ctx_size - len(lab), -1, np.int32)]))
    if not toks:
        raise ValueError(f"no example has a counted token within ctx_size + 1 = {ctx_size + 1} tokens")
    return np.stack(toks), np.stack(labs), cut


def packed_windows(
    examples: Sequence[Example], ctx_size: int, pad: int, max_docs: int = 256
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Examples packed several to a window (sequence packing): (tokens int32 (n, ctx_size + 1), labels
    int32 (n, ctx_size), segments int32 (n, ctx_size), examples cut). An example of m tokens (cut to
    ctx_size + 1 as in :func:`example_windows`) takes m - 1 positions: its tokens but the last as
    inputs, its labels (tokens[j + 1] where counted, else -1) as targets; segments[i, j] is the index in
    its window of the example at position j, counted from 0 (the window's padding, ``pad`` with labels
    -1, belongs to its last example). Trained through a packed context (patch 0096), each example then
    sees only itself from position 0 and has the loss and gradient it has alone in a window. Best-fit
    decreasing (TRL's "bfd"): longest first, each into the window with the least room that holds it
    and fewer than ``max_docs`` examples; an example keeps its order within its window. Examples
    with no counted label are dropped; ValueError if none remains."""
    import bisect

    docs, cut = [], 0
    for ex in examples:
        cut += len(ex) > ctx_size + 1
        t, lab = ex.labelled(ctx_size)
        if (lab >= 0).any():
            docs.append((t[:-1], lab))
    if not docs:
        raise ValueError(f"no example has a counted token within ctx_size + 1 = {ctx_size + 1} tokens")
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, window) of the windows that take more examples, sorted
    for i in sorted(range(len(docs)), key=lambda i: -len(docs[i][0])):
        n = len(docs[i][0])
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            bins.append([i])
            free, b = ctx_size - n, len(bins) - 1
        else:
            free, b = room.pop(k)
            bins[b].append(i)
            free -= n
        if len(bins[b]) < max_docs:
            bisect.insort(room, (free, b))
    toks = np.full((len(bins), ctx_size + 1), pad, np.int32)
    labs = np.full((len(bins), ctx_size), -1, np.int32)
    segs = np.zeros((len(bins), ctx_size), np.int32)
    for w, members in enumerate(bins):
        at = 0
        for d, i in enumerate(sorted(members)):
            t, lab = docs[i]
            toks[w, at : at + len(t)], labs[w, at : at + len(t)], segs[w, at:] = t, lab, d
            at += len(t)
    return toks, labs, segs, cut


def chat_example(
    model: Model,
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    templates: ChatTemplates | None = None,
    train_on_prompt: bool = False,
) -> Example:
    """The conversation ``messages`` (OpenAI-style dicts; ``tools``: the tool definitions the template
    renders) of ``model`` rendered with the chat template (the GGUF's, or ``templates``) as
    :meth:`Model.chat` renders it (``ChatTemplates.apply``, add_special and parse_special on),
    tokenized in segments: each assistant turn is the text between the rendering of the messages
    before it with the generation prompt and the rendering through it; those tokens are counted
    (all are with ``train_on_prompt``). Raises ValueError for no assistant turn, or a template
    whose rendering of a conversation does not extend the rendering of its beginning."""
    tpl = templates if templates is not None else model.chat_templates()
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn: nothing to learn from it")
    whole = tpl.render(messages, tools=tools, add_generation_prompt=False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tpl.render(messages[:i], tools=tools, add_generation_prompt=True) if i else ""
        through = tpl.render(messages[: i + 1], tools=tools, add_generation_prompt=False)
        if not (whole.startswith(through) and through.startswith(before) and len(before) >= pos):
            raise ValueError(
                f"the chat template renders message {i} (assistant) differently inside the whole conversation "
                "than after its beginning, so the assistant's tokens cannot be told apart; train on every token "
                "(train_on_prompt) or give another template"
            )
        segments += [(whole[pos : len(before)], False), (whole[len(before) : len(through)], True)]
        pos = len(through)
    segments.append((whole[pos:], False))
    tokens: list[int] = []
    counted: list[bool] = []
    for k, (text, is_answer) in enumerate(segments):
        if not text:
            continue
        ids = model.tokenize(text, add_special=k == 0, parse_special=True)
        tokens += ids
        counted += [is_answer or train_on_prompt] * len(ids)
    return Example(np.asarray(tokens, np.int32), np.asarray(counted, bool))


def _text_example(model: Model, text: str) -> Example:
    ids = model.tokenize(text, add_special=True, parse_special=False)
    return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool))


def _parse_line(line: str, path: str, lineno: int) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{lineno}: a line must be a JSON object; got {type(obj).__name__}")
    return obj


def _example(model, obj: dict, where: str, templates, train_on_prompt: bool) -> Example:
    def field(name: str, kind: type):
        v = obj.get(name)
        if not isinstance(v, kind):
            raise ValueError(f"{where}: field {name!r} must be a {kind.__name__}; got {type(v).__name__}")
        return v

    formats = [f for f in ("text", "prompt", "messages") if obj.get(f) is not None]  # a dataset's None: absent
    if len(formats) > 1:
        raise ValueError(f"{where}: one example takes one format; this one has {' and '.join(map(repr, formats))}")
    if obj.get("messages") is not None:
        msgs = field("messages", list)
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"{where}: messages[{k}] must be an object with a 'role' (str)")
            if m["role"] not in ROLES:
                raise ValueError(f"{where}: messages[{k}].role must be one of {', '.join(ROLES)}; got {m['role']!r}")
            if m.get("content") is not None and not isinstance(m["content"], (str, list)):
                raise ValueError(f"{where}: messages[{k}].content must be a str or a list of parts")
            if m.get("content") is None and not m.get("tool_calls"):  # an empty answer would be trained
                raise ValueError(f"{where}: messages[{k}] ({m['role']}) has no content")
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"{where}: field 'tools' must be a list")
        try:
            return chat_example(model, msgs, tools=tools, templates=templates, train_on_prompt=train_on_prompt)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    if obj.get("prompt") is not None or obj.get("completion") is not None:
        prompt, completion = field("prompt", str), field("completion", str)
        if templates is not None or model.chat_template() is not None:
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            try:
                return chat_example(model, msgs, templates=templates, train_on_prompt=train_on_prompt)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None
        p = model.tokenize(prompt, add_special=True, parse_special=False)
        c = model.tokenize(completion, add_special=False, parse_special=False)
        return Example(np.asarray(p + c, np.int32), np.asarray([train_on_prompt] * len(p) + [True] * len(c), bool))
    if obj.get("text") is not None:
        return _text_example(model, field("text", str))
    for name, kind in (("messages", list), ("prompt", str), ("completion", str), ("text", str)):
        if name in obj:  # present but None
            field(name, kind)
    raise ValueError(f"{where}: a line needs 'text', 'prompt' and 'completion', or 'messages'; got {sorted(obj)}")


def load_jsonl(
    path: str | os.PathLike,
    model: Model,
    *,
    chat_template: str | None = None,
    train_on_prompt: bool = False,
) -> list[Example]:
    """Every line of the JSONL file ``path`` as an :class:`Example` (blank lines skipped), tokenized by
    ``model``, the format told by its keys: ``{"text"}`` (every token counted), ``{"prompt",
    "completion"}`` (rendered as a user/assistant exchange with the chat template when the model has
    one, else concatenated; the completion counted), ``{"messages"[, "tools"]}`` (the assistant turns
    counted); train_on_prompt: count the prompt's tokens too. chat_template: jinja source instead of
    the GGUF's. The whole file is read and checked before anything is returned. Raises
    FileNotFoundError; ValueError naming the file, line and field for bad JSON, a
    missing or mistyped field, a conversation without an assistant turn, or an empty file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {p}")
    return _examples(p, p.read_text(encoding="utf-8"), model, chat_template, bool(train_on_prompt))


def _examples(p: Path, text: str, model: Model, chat_template: str | None, train_on_prompt: bool) -> list[Example]:
    templates = model.chat_templates(chat_template) if chat_template is not None else None
    out = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        obj = _parse_line(line, str(p), lineno)
        out.append(_example(model, obj, f"{p}:{lineno}", templates, train_on_prompt))
    if not out:
        raise ValueError(f"{p}: no examples (the file is empty)")
    return out


FORMATS = "a 'text' column, 'prompt' and 'completion' columns, or a 'messages' column (the JSONL formats)"


def is_dataset(obj) -> bool:
    """Whether ``obj`` is a 🤗 datasets Dataset or IterableDataset (told without importing datasets); a
    DatasetDict counts too (from_dataset then asks for one of its splits)."""
    return type(obj).__module__.split(".")[0] == "datasets" and (hasattr(obj, "features") or isinstance(obj, dict))


def _require_datasets():
    try:
        import datasets
    except ImportError as err:
        raise ImportError("reading a 🤗 dataset needs the datasets package: pip install 'llamabind[train]'") from err
    return datasets


def is_stream(ds) -> bool:
    """Whether a 🤗 dataset is a stream (an ``IterableDataset``: no length, maybe endless)."""
    return is_dataset(ds) and not hasattr(ds, "__len__")


def from_dataset(
    ds,
    model: Model,
    *,
    chat_template: str | None = None,
    train_on_prompt: bool = False,
    name: str = "the dataset",
    limit: int | None = None,
) -> list[Example]:
    """Every row of ``ds``, a 🤗 ``Dataset`` or ``IterableDataset`` (its first ``limit`` rows if given: a
    stream may be endless) as an :class:`Example`, the format told by its columns as
    :func:`load_jsonl` tells a line's by its keys (``text``; ``prompt`` and ``completion``;
    ``messages`` with optional ``tools``), the loss on the same tokens, tokenized by ``model``;
    chat_template and train_on_prompt as :func:`load_jsonl`'s. The rows are read and checked before
    anything is returned; ``name`` is how the messages call the dataset. Raises ValueError naming the
    columns and the formats (no known column), the row and column (a value of the wrong type), or an empty split."""
    if type(ds).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise ValueError(f"{name} is a {type(ds).__name__} of splits {sorted(ds)}: give one split, e.g. ds['train']")
    cols = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None
    rows: Iterable = ds
    if cols is None:  # an IterableDataset whose features are not resolved: the first row tells
        it = iter(ds)
        first = next(it, None)
        if first is None:
            raise ValueError(f"{name} is empty: no rows to train on")
        cols = list(first)
        rows = _chain(first, it)
    known = "text" in cols or {"prompt", "completion"} <= set(cols) or "messages" in cols
    if not known:
        raise ValueError(f"{name} has the columns {cols}; fine-tuning takes {FORMATS}")
    templates = model.chat_templates(chat_template) if chat_template is not None else None
    if limit is not None:
        rows = itertools.islice(rows, as_int(limit, "limit", 1))
    out = [
        _example(model, dict(row), f"{name}, row {i}", templates, bool(train_on_prompt)) for i, row in enumerate(rows)
    ]
    if not out:
        raise ValueError(f"{name} is empty: no rows to train on")
    return out


def _chain(first, rest):
    yield first
    yield from rest


def load_dataset(spec: str):
    """A 🤗 dataset from ``spec``: a folder written by ``save_to_disk`` (its ``train`` split if it holds
    several), another folder of data files, a parquet / CSV / JSON(-array) / arrow file, or a Hub id
    ``org/name[:split]`` (default split ``train``; huggingface_hub's cache, token, HF_ENDPOINT and
    offline mode apply). Raises ImportError without the datasets package, FileNotFoundError for
    what is none of these, ValueError for a missing split."""
    datasets = _require_datasets()
    try:
        return _load_dataset(datasets, spec)
    except (FileNotFoundError, ValueError, ImportError):
        raise
    except Exception as err:  # noqa: BLE001 (datasets' own exceptions, named in the message)
        raise _dataset_error(spec, err) from None


def _load_dataset(datasets, spec: str):
    p = Path(spec)
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"{p}: no 'train' split among {sorted(ds)}")
                ds = ds["train"]
            return ds
        return datasets.load_dataset(str(p), split="train")
    if p.is_file():
        kind = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}.get(
            p.suffix
        )
        if kind is None:
            raise ValueError(f"{p}: not a dataset file (parquet, csv, json, arrow)")
        return datasets.load_dataset(kind, data_files=str(p), split="train")
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)(?::([\w.-]+))?", spec)
    if m is None:
        raise FileNotFoundError(f"no such file or folder, and not a Hub dataset id (org/name[:split]): {spec}")
    return datasets.load_dataset(m.group(1), split=m.group(2) or "train")


def read_data(
    path, model: Model, *, chat_template: str | None = None, train_on_prompt: bool = False
) -> str | list[Example]:
    """Training data from ``path``: a 🤗 Dataset (:func:`from_dataset`); a file of JSONL examples
    (:func:`load_jsonl`) when its first non-blank line is a JSON object; a parquet, CSV, arrow or
    JSON-array file, a dataset folder or a Hub dataset id ``org/name[:split]`` (:func:`load_dataset`,
    then :func:`from_dataset`); else a file's UTF-8 text (trained on as one stream of sliding
    windows). model tokenizes; chat_template and train_on_prompt as :func:`load_jsonl`'s. Raises
    FileNotFoundError, ImportError (a dataset without the datasets package),
    ValueError (see :func:`load_jsonl` and :func:`from_dataset`; an empty file)."""
    if is_dataset(path):
        return from_dataset(path, model, chat_template=chat_template, train_on_prompt=train_on_prompt)
    p = Path(path)
    if p.is_file() and p.suffix not in (".parquet", ".csv", ".arrow"):
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{p}: not UTF-8 text, JSONL or a dataset file (parquet, csv, json, arrow): byte {e.start} is not UTF-8"
            ) from None
        first = next((ln for ln in text.splitlines() if ln.strip()), "")
        if not first:
            raise ValueError(f"{p}: the file is empty")
        if first.lstrip().startswith("{"):
            return _examples(p, text, model, chat_template, bool(train_on_prompt))  # the text already read
        if not first.lstrip().startswith("[") or p.suffix != ".json":
            return text
    return from_dataset(
        load_dataset(str(path)), model, chat_template=chat_template, train_on_prompt=train_on_prompt, name=str(path)
    )


def _dataset_error(spec: str, err: Exception) -> ValueError:
    """A clear error for what 🤗 datasets raised reading ``spec`` (an empty saved folder: IndexError; bytes
    that are no CSV: DatasetGenerationError; ...)."""
    p = Path(spec)
    if isinstance(err, IndexError) and p.is_dir() and (p / "state.json").exists():
        try:
            files = json.loads((p / "state.json").read_text()).get("_data_files")
        except (OSError, ValueError, AttributeError):
            files = None
        if files == []:
            return ValueError(f"{spec}: a saved dataset with no rows (its state.json lists no data files)")
    cause: BaseException = err
    for _ in range(8):  # datasets wraps the reason (DatasetGenerationError over a UnicodeDecodeError, ...)
        inner = cause.__cause__ or cause.__context__
        if inner is None:
            break
        cause = inner
    because = f"; because {type(cause).__name__}: {cause}" if cause is not err else ""
    return ValueError(f"{spec}: could not be read as a dataset ({type(err).__name__}: {err}{because})")
