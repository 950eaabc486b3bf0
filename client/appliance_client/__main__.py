"""`python -m appliance_client exec|mcp ...`."""

import sys

from appliance_client.cli import main

sys.exit(main())
