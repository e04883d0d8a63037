"""All tests run on 8 fake CPU devices."""
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
