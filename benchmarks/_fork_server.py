"""Imported by the fork server of quick runs (`benchmarks.common.fast_start`) and nowhere else.

The server ends when the script that started it does; Python's teardown of torch's modules would then take it
a second or two more, which whoever reads the script's output to its end waits out. It has nothing to flush or
clean up, so it ends at once instead. The processes it forks end by `os._exit` and never run this hook.
"""

import atexit
import os

atexit.register(os._exit, 0)
