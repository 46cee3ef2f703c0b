"""Paths of the repository's test fixtures (tests/fixtures; provenance and licences in its README). Tests never
need ../shared: a bare clone of the repository runs the whole suite."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TEXT = FIXTURES / "text"

ENWIK8 = TEXT / "enwik8_head"  # the first 200,000 bytes of enwik8 (Wikipedia, CC BY-SA)
TEXT8 = TEXT / "text8_head"  # the first 100,000 bytes of text8 (the same text, wikifil-cleaned)
WIKITEXT = {"valid": TEXT / "wiki.valid.head.tokens", "test": TEXT / "wiki.test.head.tokens"}


def reference_file(name: str) -> Path:
    """A golden output of the reference LaMemo / Transformer-XL code (tests/fixtures/reference)."""
    return FIXTURES / "reference" / f"{name}.pt"
