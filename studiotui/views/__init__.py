"""Drawings of the core's facts that the CLI prints and the dashboard shows alike (Rich
renderables and text): pure, facts in and drawings out, no I/O and no Textual (a
contract), so `studiotui place --dry-run` and the preview screen show one table."""
