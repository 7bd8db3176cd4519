"""`python -m llminfer.bench`."""
import sys

from .measure import main

sys.exit(main())
