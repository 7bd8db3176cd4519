"""pytest's setup for the chapters and their solutions under nbval (make test-notebooks).

The kernels nbval starts inherit this process's environment: with llminfer.notebooks.RECORDING_ENV they draw no
progress bars, as when `make notebooks` recorded the outputs they are compared with.
"""
import os

from llminfer.notebooks import RECORDING_ENV

os.environ.update(RECORDING_ENV)
