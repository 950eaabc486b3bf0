"""`python -m appliance` runs the CLI."""

from appliance.cli import main

raise SystemExit(main())
