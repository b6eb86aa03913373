"""Placing a model: preview, drag, the flow between them."""
