"""The package's version (one place: ``pyproject.toml`` reads it from here)."""

VERSION = "0.1.0"
