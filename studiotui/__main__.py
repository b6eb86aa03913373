"""`python -m studiotui`: the same as the `studiotui` command."""

from studiotui.cli.main import main

raise SystemExit(main())
