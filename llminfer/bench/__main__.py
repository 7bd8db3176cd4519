"""`python -m llminfer.bench <what>`."""
import sys

from .cli import main

sys.exit(main())
