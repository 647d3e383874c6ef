"""A griffe extension for the API reference (mkdocs.yml): the pages are made by importing the
installed package (force_inspection: docstrings as Python composes them, functions made by
factories such as the element-wise ops), where a constant's docstring would be its type's
(``str.__doc__`` for MEDIA_MARKER). Such a docstring is replaced by the one written under the
constant in the source, read statically by griffe."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import griffe


@functools.cache
def _static(package: str) -> griffe.Module | None:
    try:  # the whole package once, its aliases resolved (MEDIA_MARKER is llamabind.multimodal's)
        return griffe.load(package, force_inspection=False, resolve_aliases=True, resolve_external=False)
    except Exception:  # noqa: BLE001 - no source: keep what inspection found
        return None


class StaticConstantDocstrings(griffe.Extension):
    def on_attribute_instance(self, *, node, attr, agent, **kwargs) -> None:
        obj = getattr(node, "obj", None)
        if obj is None or inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            return
        if attr.docstring is None or attr.docstring.value.strip() != (inspect.getdoc(type(obj)) or "").strip():
            return
        attr.docstring = None  # the type's docstring says nothing about this constant
        package, _, rest = attr.path.partition(".")
        static = _static(package)
        try:
            found = static[rest] if static is not None and rest else None
            found = found.final_target if found is not None and found.is_alias else found
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            found = None
        if found is not None and found.docstring is not None:
            attr.docstring = griffe.Docstring(found.docstring.value, parent=attr)


class FieldAnnotations(griffe.Extension):
    """Inspection finds a class's attributes without their annotations, and a dataclass's fields without a default
    not at all (they are no class attributes: PreferencePair's), so the Attributes tables had an empty type column:
    the class's own annotations (strings, as ``from __future__ import annotations`` leaves them) fill it, and a
    field missing from the members is added, typed."""

    def on_class_members(self, *, node, cls, agent, **kwargs) -> None:
        obj = getattr(node, "obj", None)
        if not inspect.isclass(obj) or not dataclasses.is_dataclass(obj):
            return
        # a settings dataclass documents its fields as Attributes: as the constructor's Parameters (merged into the
        # class: mkdocs.yml) they are rendered with their defaults too (TrainingArgs)
        fields = [f for f in dataclasses.fields(obj) if f.init]
        settings = fields and all(
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING for f in fields
        )  # every field has a default: settings users construct (results keep their Attributes)
        doc = cls.docstring
        if doc is not None and settings and re.search(r"^Attributes:$", doc.value, re.M):
            value = re.sub(r"^Attributes:$", "Parameters:", doc.value, count=1, flags=re.M)
            cls.docstring = griffe.Docstring(value, parent=cls, parser=doc.parser, parser_options=doc.parser_options)
        for field in dataclasses.fields(obj):
            annotation = field.type if isinstance(field.type, str) else inspect.formatannotation(field.type)
            member = cls.members.get(field.name)
            if member is None:
                cls.set_member(field.name, griffe.Attribute(field.name, annotation=annotation, parent=cls))
            elif getattr(member, "annotation", "") is None:
                member.annotation = annotation
