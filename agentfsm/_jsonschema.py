"""Every jsonschema validator of agentfsm, built one way: no `$ref` ever retrieves.

Schemas come from parties agentfsm does not trust (an MCP server's tool list)
or from users who may not know that jsonschema, left to its defaults, follows
a `$ref` it cannot resolve by fetching it: an HTTP GET with no timeout, on the
event loop's thread, or a `file://` read whose content then shows up in
validation errors. Here a validator's registry retrieves nothing (it holds
the schema and jsonschema's bundled metaschemas), and a schema is checked when
it is taken: valid against its draft's metaschema, and each `$ref`,
`$dynamicRef` and `$recursiveRef` in it resolved within the schema itself. A
schema that fails either is refused with a `SchemaProblem` saying where and
why, before it reaches a model; validation never meets an unresolvable
reference later.

Import this module where a schema is first checked, not at the top of a
module: it imports jsonschema and referencing (~50 ms). Their names are bound
here at import, not inside the functions, so that a Temporal workflow sandbox,
which passes `agentfsm` modules through, never imports a second referencing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

import jsonschema.validators
import referencing.jsonschema
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable

if TYPE_CHECKING:
    from referencing._core import Resolver

__all__ = ("Draft", "SchemaProblem", "check", "errors", "validator")

Draft = Literal["declared", "2020-12"]
"""Which draft a schema is read as: the one its `$schema` names (2020-12 when
it names none, or one jsonschema does not know), or 2020-12 whatever it says."""

_REFERENCES: Final = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaProblem(ValueError):
    """A JSON schema agentfsm will not use: not a valid schema of its draft, or
    with a reference that does not resolve within it (the message says where)."""


def validator(
    schema: Mapping[str, Any], *, draft: Draft = "declared", checked: bool = False
) -> Validator:
    """A validator of `schema`, once `check` accepts it, whose registry
    retrieves nothing. `checked`: `check` accepted the schema before (a
    request's structured output); only its references are walked again, as it
    may have changed since (checking it against its metaschema takes ~4 ms).

    Raises:
        SchemaProblem: see `check`.
    """
    kind = _kind(schema, draft)
    _check(kind, schema, metaschema=not checked)
    # An explicit registry replaces jsonschema's default one, which retrieves
    # what it does not hold; `Registry()` retrieves nothing.
    return kind(schema, registry=Registry())


def check(schema: Mapping[str, Any], *, draft: Draft = "declared") -> None:
    """Refuse a schema that is not valid against its draft's metaschema, or has
    a reference that does not resolve within it (another document, a URL, a
    file, a pointer to nothing).

    Raises:
        SchemaProblem: naming the JSON path of the problem and what it is.
    """
    _check(_kind(schema, draft), schema)


def errors(validator: Validator, instance: Any) -> list[ValidationError]:
    """The validation errors of `instance`, in jsonschema's order.

    Raises:
        SchemaProblem: the schema cannot be applied (it refers to itself
            without end, or the instance is nested too deeply to check).
    """
    try:
        return list(validator.iter_errors(instance))
    except Unresolvable as exc:  # `check` makes this unreachable; said clearly if not
        raise SchemaProblem(f"a reference does not resolve: {exc}") from None
    except RecursionError:
        raise SchemaProblem(
            "nested too deeply to check (or a schema that refers to itself without end)"
        ) from None


def _kind(schema: Mapping[str, Any], draft: Draft) -> type[Validator]:
    if not isinstance(schema, Mapping):
        raise SchemaProblem(f"a schema is a JSON object, got {type(schema).__name__}")
    default = jsonschema.validators.Draft202012Validator
    if draft == "2020-12":
        return default
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        # jsonschema looks it up in a dict: a list would raise TypeError there.
        raise SchemaProblem(f"$.$schema: {dialect!r} is not of type 'string'")
    return jsonschema.validators.validator_for(schema, default=default)


def _check(
    kind: type[Validator], schema: Mapping[str, Any], *, metaschema: bool = True
) -> None:
    try:
        if metaschema:
            kind.check_schema(dict(schema))
        unresolved = next(_unresolved(kind, schema), None)
    except SchemaError as exc:
        raise SchemaProblem(f"{exc.json_path}: {exc.message}") from None
    except RecursionError:
        raise SchemaProblem("nested too deeply to check") from None
    except Exception as exc:  # noqa: BLE001 - referencing's walk of an odd draft
        raise SchemaProblem(
            f"cannot be checked ({type(exc).__name__}: {exc})"[:300]
        ) from None
    if unresolved is not None:
        path, keyword, ref, walked = unresolved
        if not walked:
            why = "stands where its draft's references cannot be followed safely"
        elif ref.startswith("#"):
            why = "points to nothing in the schema"
        else:
            why = (
                "is outside the schema (other documents and files are never "
                "retrieved: put what it refers to under $defs)"
            )
        raise SchemaProblem(f"{path}.{keyword}: {ref!r} {why}")


def _unresolved(
    kind: type[Validator], schema: Mapping[str, Any]
) -> Iterator[tuple[str, str, str, bool]]:
    """(JSON path, keyword, reference, whether the walk reached it) of each
    reference that does not resolve within the schema, walked as the
    validator's draft reads it (`$id`s change the base URI of what they
    hold), then of each the walk did not reach."""
    specification = referencing.jsonschema.specification_with(
        kind.META_SCHEMA.get("$schema", ""),
        default=referencing.jsonschema.DRAFT202012,
    )
    root = specification.create_resource(schema)
    objects = _objects(schema, "$")
    # Only the schema itself: a reference to anything else, even a bundled
    # metaschema, is refused.
    resolver = Registry().resolver_with_root(root)
    walked: set[int] = set()
    try:
        for found in list(_walk(resolver, root, objects, walked)):
            yield (*found, True)
    except RecursionError:
        raise
    except Exception:  # noqa: BLE001 - referencing's walk of an odd draft crashed
        walked.clear()  # then every reference is one the walk did not reach
    # A reference where the draft's walk never goes (draft 3's `type`, a
    # `dependencies` entry after a list) is one the validator may still
    # follow: refused too, as unresolvable.
    for value_id, (path, contents) in objects.items():
        if value_id in walked:
            continue
        for keyword in _REFERENCES:
            ref = contents.get(keyword)
            if isinstance(ref, str):
                yield path, keyword, ref, False


def _walk(
    resolver: Resolver[Any],
    resource: Resource[Any],
    objects: dict[int, tuple[str, Mapping[str, Any]]],
    walked: set[int],
) -> Iterator[tuple[str, str, str]]:
    contents = resource.contents
    if isinstance(contents, Mapping):
        walked.add(id(contents))
        for keyword in _REFERENCES:
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except (Unresolvable, ValueError):  # ValueError: not a URI at all
                yield objects.get(id(contents), ("$",))[0], keyword, ref
    for sub in resource.subresources():
        yield from _walk(resolver.in_subresource(sub), sub, objects, walked)


def _objects(value: Any, path: str) -> dict[int, tuple[str, Mapping[str, Any]]]:
    """Each object in `value`, by identity, with its JSON path."""
    found: dict[int, tuple[str, Mapping[str, Any]]] = {}
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, Mapping):
            found[id(item)] = (where, item)
            stack.extend((v, f"{where}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{n}]") for n, v in enumerate(item))
    return found
