"""The docs' tables come from the registries: each table here must list exactly what the code registers."""

import importlib
import re
from pathlib import Path

from taperfold import families
from taperfold.engines import ENGINES
from taperfold.exportdir import VARIANT_TABLE

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table after `heading`, header and rule left out."""
    section = text[text.index(heading) :]
    rows, started = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif started:
            break
    assert rows, f"no table after {heading!r}"
    return rows[2:]


def test_design_variant_table_is_the_variant_table():
    rows = _table_after((DOCS / "design.md").read_text(), "## Variants of one model")
    expected = [[v.name, f"`{v.stem}`", "yes" if v.default else "", v.meaning] for v in VARIANT_TABLE]
    assert rows == expected, "docs/design.md's variant table should read:\n" + "\n".join(
        "| " + " | ".join(row) + " |" for row in expected
    )


def test_hf_family_table_lists_every_shipped_family():
    """A row names its families before the brackets, and the `model_type`s that differ from the name in them."""
    rows = _table_after((DOCS / "hf.md").read_text(), "## Families")
    documented = {name: row[0] for row in rows for name in re.findall(r"[a-z0-9_]+", row[0].split("(")[0])}
    shipped = {name: importlib.import_module(f"taperfold.families.{name}").FAMILY for name in families._MODULES}
    assert set(documented) == set(shipped)
    for name, family in shipped.items():
        assert family.name == name
        for model_type in family.model_types:
            assert families.family_for(model_type) is family
            assert model_type == name or f"`{model_type}`" in documented[name], (name, model_type)


def test_design_engine_table_is_the_engine_table():
    rows = _table_after((DOCS / "design.md").read_text(), "The engine table")
    expected = [
        [
            e.name,
            e.title,
            e.runs,
            ", ".join(e.devices),
            "yes" if e.prefills else "no",
            ", ".join(e.caches) if e.decodes else "no",
            ", ".join(f"`{o.flag}`" for o in e.options),
            f"`{e.module}`",
        ]
        for e in ENGINES.values()
    ]
    assert rows == expected, "docs/design.md's engine table should read:\n" + "\n".join(
        "| " + " | ".join(row) + " |" for row in expected
    )


MACHINE_PATHS = re.compile(r"(?<![\w.])/(?:tmp|work|root|home|mnt)/")


def test_recorded_commands_name_no_path_of_the_machine_they_ran_on():
    """The runs docs/ records (taperfold commands, scripts in examples/) name their files as a reader reruns them:
    placeholders (OUT, WORK) or paths in the repository. (Set-up steps may pick a scratch folder such as /tmp.)"""
    documents = [*DOCS.glob("*.md"), *DOCS.glob("gpu/*.md"), DOCS / "gpu" / "runs.json"]
    runs = re.compile(r"^\s*(\"command\": \")?(taperfold |python3? examples/)")
    found = [
        f"{doc.relative_to(DOCS)}:{n}"
        for doc in documents
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if runs.search(line) and MACHINE_PATHS.search(line)
    ]
    assert not found, found
