"""runner/common/text.py: text for people, defined once."""

from __future__ import annotations

from tests.conftest import REPO

RUNNER = REPO / "runner"


def test_text_for_people_is_defined_once_in_common_text():
    from runner.common.text import human_bytes, plural, printable

    assert human_bytes(1_520_000_000) == "1.52 GB" and human_bytes(900) == "900 B"
    assert human_bytes(12_345_678) == "12.3 MB"
    assert plural(1, "class") == "1 class" and plural(3, "class") == "3 classes"
    assert plural(1200, "image") == "1,200 images"
    assert printable("caf\udce9.jpg") == "caf\\xe9.jpg"
    homes = {name: sorted(str(p.relative_to(REPO)) for p in RUNNER.rglob("*.py")
                          if f"def {name}(" in p.read_text())
             for name in ("human_bytes", "plural", "printable")}
    assert homes == {name: ["runner/common/text.py"] for name in homes}
