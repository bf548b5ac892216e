"""The documentation cannot drift from the code or point outside the repository.

- docs/configuration.md is what scripts/config_doc.py generates from helix_ray/config.py now;
- README.md and docs/ name nothing a reader of the repository cannot see;
- every relative link in them resolves to a file of the repository (and an anchor to a heading).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

#: Markdown links and images: [text](target) / ![alt](target); the target up to a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: What only a reader of the machine this was written on could follow.
OUTSIDE = (
    (re.compile(r"\.\./shared"), "../shared (a folder outside the repository)"),
    (re.compile(r"FIELD-NOTES", re.IGNORECASE), "FIELD-NOTES (notes outside the repository)"),
    (re.compile(r"\bissue #?\d+\b|\bissues?/\d+\b", re.IGNORECASE), "an issue-tracker reference"),
)


def _config_doc():
    return load_script("config_doc")


def test_configuration_page_is_what_the_script_generates_from_the_config():
    """Protects: a field, default, range or description changed in helix_ray/config.py
    without docs/configuration.md being regenerated."""
    generated = _config_doc().render()
    checked_in = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert checked_in == generated, (
        "docs/configuration.md is out of date with helix_ray/config.py; run `python scripts/config_doc.py` "
        "and commit the result (`python scripts/config_doc.py --check` shows the difference).")


def test_the_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch):
    """Protects: `config_doc.py --check` exits non-zero when the page differs, so CI can use it."""
    module = _config_doc()
    stale = tmp_path / "configuration.md"
    stale.write_text(module.render().replace("RRF k", "RRF kappa"), encoding="utf-8")
    monkeypatch.setattr(module, "TARGET", stale)
    assert module.main(["--check"]) == 1
    stale.write_text(module.render(), encoding="utf-8")
    assert module.main(["--check"]) == 0


def test_every_config_field_is_documented():
    """Protects: a new knob added without the docstring that says what it does."""
    module = _config_doc()
    from helix_ray import config

    docs = module.field_docs((ROOT / "helix_ray" / "config.py").read_text(encoding="utf-8"))
    missing = []
    for name, model in vars(config).items():
        if isinstance(model, type) and issubclass(model, config._Strict) and model is not config._Strict:
            if not docs.get(name, {}).get(""):
                missing.append(name)
            missing += [f"{name}.{field}" for field in model.model_fields
                        if not docs.get(name, {}).get(field)
                        and not isinstance(model.model_fields[field].default, config._Strict)]
    assert not missing, f"these config models or fields have no docstring: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(page):
    """Protects: a page that sends its reader to files, notes or trackers they cannot see."""
    text = page.read_text(encoding="utf-8")
    found = [f"line {text.count(chr(10), 0, m.start()) + 1}: {what} ({m.group(0)!r})"
             for pattern, what in OUTSIDE for m in pattern.finditer(text)]
    assert not found, f"{page.relative_to(ROOT)} points outside the repository: {found}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped,
    spaces as hyphens, a repeated heading numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    """Protects: a link to a page (or a heading) that was renamed, moved or deleted."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"
