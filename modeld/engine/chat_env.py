"""The Jinja environment real chat templates are written for.

What: one compiled template per model, rendered in a sandbox with what the templates shipped in
models' ``tokenizer_config.json`` (and GGUF ``tokenizer.chat_template``) use. Two references
anchor it: Hugging Face's chat-template environment (transformers) and the engine-side
renderers (minja, and llama.cpp's own ``common/jinja``). Where they differ, modeld takes the
one the models' templates need:

* ``trim_blocks`` and ``lstrip_blocks`` on, loop controls (``{% break %}``, ``{% continue %}``:
  Kimi K2 Thinking, Nemotron), ``{% generation %}`` blocks (Hugging Face's assistant-mask
  marker; rendered as their body);
* ``raise_exception(message)``: the template refuses the conversation. It surfaces as
  :class:`TemplateRefusedError` carrying the template's own message (a 400 over HTTP, never a 500);
* ``strftime_now(format)`` (gpt-oss, Mistral, Llama 3.x): the local time, formatted;
* ``tojson`` as Hugging Face's: key order kept, no HTML escaping, and the keywords
  ``ensure_ascii`` (default False), ``indent``, ``separators``, ``sort_keys`` (GLM passes
  ``ensure_ascii=False``; Jinja's own filter takes only ``indent``, sorts keys and escapes);
* lists may be appended to and popped (Kimi K2 keeps a queue of call ids): minja and llama.cpp
  allow it, Hugging Face's immutable sandbox refuses it. The values a template sees are fresh
  copies made for each rendering, so nothing it changes outlives the call;
* every other construct is Jinja's own: ``namespace``, ``loop.*``, the ``string``,
  ``mapping``, ``sequence``, ``iterable``, ``boolean``, ``true``/``false``, ``none``,
  ``defined`` tests, the ``trim``, ``length``, ``default``, ``join``, ``items``, ``dictsort``,
  ``selectattr``, ``map``, ``upper``/``lower``, ``replace``, ``indent`` filters, and Python's
  string methods (``split``, ``strip``, ``startswith``, ``format``, ...).

Any other error while rendering (a ``TypeError`` from a value the template did not expect, an
undefined attribute it calls) is the template refusing this conversation too: the caller gets
its message, never an internal error.

What not: no file loader (``{% include %}`` has nothing to include), no access to Python
internals (the sandbox), no ``tojson`` that sorts keys by default.

Jinja2 is imported on first use: the base package (no extras) serves prompt_format ``raw``
without it, and a chat session there fails with ``unsupported`` naming the extra to install.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
from types import ModuleType
from typing import TYPE_CHECKING, Any

from modeld.errors import InvalidArgumentError, UnsupportedError

if TYPE_CHECKING:
    import jinja2

__all__ = ["TemplateRefusedError", "compile_template", "jinja_module", "render_template", "tojson"]


class TemplateRefusedError(InvalidArgumentError):
    """The model's chat template refused the conversation (``raise_exception`` or an error while
    rendering); ``template_message`` is the template's own words."""

    def __init__(self, template_message: str) -> None:
        super().__init__(
            f"the model's chat template refused this conversation: {template_message}",
            field="messages",
            template_error=template_message[:500],
        )
        self.template_message = template_message


def jinja_module() -> ModuleType:
    """The jinja2 module (with its sandbox), or ``unsupported`` naming the extra to install."""
    try:
        module = importlib.import_module("jinja2")
        importlib.import_module("jinja2.sandbox")
        importlib.import_module("jinja2.ext")
    except ImportError as exc:
        raise UnsupportedError(
            "prompt_format 'chat' renders the model's template with jinja2, which is not installed "
            f"({exc.name}); install modeld[http] (or the llama/openvino extra), or use prompt_format 'raw'",
            field="config.prompt_format",
        ) from None
    return module


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson``: ``json.dumps`` with its keywords, key order kept, no escaping."""
    if separators is not None:
        separators = tuple(separators)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: object) -> None:
    raise _RaisedError(str(message))


class _RaisedError(Exception):
    """``raise_exception`` inside a template (kept apart from the renderer's own errors)."""


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _generation_extension(jinja: ModuleType) -> type:
    """``{% generation %}...{% endgeneration %}``: Hugging Face marks the assistant's tokens with
    it (for training masks); rendering a prompt keeps the body as it is."""
    nodes = importlib.import_module("jinja2.nodes")
    ext = importlib.import_module("jinja2.ext")

    class Generation(ext.Extension):  # type: ignore[misc,name-defined]
        tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the environment (module docstring); ``unsupported`` when it does
    not compile (the model's template is broken: no conversation can be rendered with it)."""
    jinja = jinja_module()
    env = jinja.sandbox.SandboxedEnvironment(
        loader=jinja.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _generation_extension(jinja)],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        compiled: jinja2.Template = env.from_string(source)
    except jinja.TemplateError as exc:
        raise UnsupportedError(
            f"the model's chat template does not compile: {exc}", field="chat_template"
        ) from exc
    return compiled


def render_template(template: jinja2.Template, values: dict[str, Any]) -> str:
    """Render, with every failure of the template as :class:`TemplateRefusedError`."""
    try:
        return template.render(**values)
    except _RaisedError as exc:
        raise TemplateRefusedError(str(exc)) from None
    except RecursionError:
        raise TemplateRefusedError("the template recursed too deeply") from None
    except Exception as exc:  # a template's failure is the request's, whatever it is
        raise TemplateRefusedError(f"{type(exc).__name__}: {exc}") from None
