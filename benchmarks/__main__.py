"""`python -m benchmarks [--quick] [--out DIR]`: see benchmarks.suite."""

import sys

from benchmarks.suite import main

sys.exit(main())
