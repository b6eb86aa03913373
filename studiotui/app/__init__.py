"""The Textual dashboard: views of the controller's state, nothing that does I/O itself.

`launch.launch` is what `studiotui` with no verb runs; `app.StudioApp` composes the
panes (`nodes`, `topology`, `rdma`, `placements`, `models`, `log`), each a module
that turns a slice of `ClusterState` into text and redraws only when that slice
changes. Themes are TOML files in the top-level `themes` package (`themes.py`).
"""
