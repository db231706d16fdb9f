"""STYLE.md: one file per concept; past 500 lines, split it. Every module of the package is held to
it here, so a file that grows past the line is split when it does, not found later."""

from pathlib import Path

from package_walk import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_no_package_module_is_over_500_lines() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for folder in ("atomrt", *PACKAGES)
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 100, "the walk found too few modules: wrong root?"
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them, STYLE.md): {over}"
