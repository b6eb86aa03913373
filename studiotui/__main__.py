"""`python -m studiotui`: the same as the `studiotui` command."""

from studiotui.cli import main

raise SystemExit(main())
