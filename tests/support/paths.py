"""Where the repository is, for tests that read its files (docs, schema, examples, bench)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
