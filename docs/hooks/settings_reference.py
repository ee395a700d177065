"""MkDocs hook: renders the server settings table of docs/settings.md from `ServerSettings`.

Each setting's flag, environment variable, Helm value, default and description come from its
pydantic field, so the page cannot drift from `samrollout serve --help`.
"""

from __future__ import annotations

from typing import Any

from pydantic.fields import FieldInfo

from samrollout.server.settings import NOT_FLAGS, ServerSettings, default_text, env_var, flag, flag_options

PAGE = "settings.md"
MARKER = "<!-- settings-table -->"
# Settings the chart sets otherwise than as ``server.<camelCase>``, and how.
HELM_OTHERWISE = {"api_key": "`apiKey` (a Secret)", "api_key_file": "`apiKey` (a Secret; no file)"}


def helm_value(name: str) -> str:
    """The Helm chart value that sets a setting: ``server.maxModelLen`` for ``max_model_len``."""
    if name in HELM_OTHERWISE:
        return HELM_OTHERWISE[name]
    head, *rest = name.split("_")
    return f"`server.{head}{''.join(part.capitalize() for part in rest)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def allowed(name: str, field: FieldInfo) -> str:
    """The values a setting accepts, as its flag's choices and the field's bounds say (empty: any of its type)."""
    choices = flag_options(name, field).get("choices")
    if choices:
        return ", ".join(f"`{choice}`" for choice in choices)
    bounds = []
    for constraint in field.metadata:
        for attribute, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(constraint, attribute, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    return ", ".join(bounds)


def settings_table() -> str:
    """One Markdown table row per server setting: flag, variable, Helm value, default, values, description."""
    rows = ["| Flag | Environment variable | Helm value | Default | Values | What it does |",
            "|---|---|---|---|---|---|"]
    for name, field in ServerSettings.model_fields.items():
        option = "after `--`" if name in NOT_FLAGS else f"`{flag(name)}`"
        default = _cell(default_text(name, field))
        rows.append(f"| {option} | `{env_var(name)}` | {helm_value(name)} | `{default}` | {allowed(name, field)} | "
                    f"{_cell(field.description or '')} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Put the table where docs/settings.md has its marker."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} line: the settings table has nowhere to go")
    return markdown.replace(MARKER, settings_table())
