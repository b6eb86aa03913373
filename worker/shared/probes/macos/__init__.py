"""Parsers of macOS probes' output."""
