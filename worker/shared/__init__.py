"""What both sides import: the wire protocol, probe parsers, the model support table,
demo models."""
